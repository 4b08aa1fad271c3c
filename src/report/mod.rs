//! Layer 12 of `amprobe::LAYERS`: may use layers 0–11 (`dtype` … `shrink`).
//!
//! Reports over traces: charts, `summary.md` and `index.html` (`amprobe report`), the CI
//! gate (`--fail-on`) and its numerics lockfile (`amprobe baseline`), comparison of runs in different precisions (`amprobe compare`) and
//! the Chrome trace-event export (`amprobe export --perfetto`).
//!
//! Everything here reads trace records only, so a report works on any trace — a finished
//! run, a killed one (a cut last line), or a model with thousands of ops per step.

pub mod charts;
pub mod compare;
pub mod doc;
pub mod drift;
pub mod facts;
pub mod gate;
pub mod lockfile;
pub mod perfetto;
pub mod summary_doc;
pub mod trace_file;

pub use summary_doc::{write_report, ReportOptions, ReportOutput};
pub use trace_file::TraceFile;
