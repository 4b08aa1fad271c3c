//! Layer 1 of `amprobe::LAYERS`: may use layer 0 (`dtype` … `rng`).
//!
//! The trace file: one JSON record per line (header, one record per step, end), written as
//! the run goes so that a killed run leaves a readable trace. See `docs/trace-schema.md`.
pub mod float_json;
pub mod io;
pub mod record;
pub mod stats;

pub use io::{read_trace, read_trace_from, Trace, TraceReader, TraceWriter, Truncation};
pub use record::{
    EndRecord, Header, OpRecord, OpRef, Origins, ParamRecord, Phase, Record, SkipCause, SkipKind,
    StepRecord, TensorMeta, Verdict, SCHEMA_VERSION,
};
pub use stats::{CastCounts, ExpHist, TensorStats};
