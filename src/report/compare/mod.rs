//! `amprobe compare`: runs of the same model and data in different precisions, aligned op by
//! op against a reference run (fp32), with each divergence classified as a range failure
//! (overflow, underflow, Inf/NaN) or a rounding difference.
//!
//! Alignment ([`crate::diagnose::align`], the same as the terminal UI's Compare panel):
//! within a step that has op records in both runs, ops are matched by micro-batch, phase, op
//! name, module, gradient input and occurrence (the k-th `linear` of `fc1` in the backward
//! pass of micro-batch 0 matches the k-th one of the other run). Casts are left out of the
//! diff: autocast adds them to low-precision runs only, so op indices differ between runs
//! while the rest of the graph is the same. Values that carry the loss scale (backward outputs and the scaler's
//! own ops) are divided by their step's scale first, so runs with different scales compare.
//!
//! Only summary statistics are in a trace, so the per-op difference is the relative
//! difference of the output's largest |x| and of its L2 norm (finite values), not an
//! elementwise error.

//!
//! [`comparison`] computes the comparison; [`render`] writes it as a report and the chart
//! of per-op differences is [`diff_chart::DiffChart`]. This file only declares and
//! re-exports them.

pub mod comparison;
pub mod diff_chart;
pub mod render;

pub use comparison::{
    compare, diff_runs, rel_diff, Class, Comparison, OpDiff, RunDiff, RunInfo, DEFAULT_THRESHOLD,
};
pub use render::{first_divergence_lines, write_compare, CompareOptions, CompareOutput};
