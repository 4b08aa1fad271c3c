//! The machine-readable summary of a run (`--summary-json`) and the one verdict function
//! that runner, report and terminal UI share.

use crate::amp::mode::Precision;
use crate::backend::BackendKind;
use crate::trace::record::{OpRef, Phase, StepRecord, Verdict};
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::PathBuf;

/// The verdict of a run from its step records: `diverged` when a parameter ended
/// non-finite, `forward-nonfinite` when an Inf or NaN originated in a forward pass,
/// `overflow-skips` when a step was skipped, else `clean`.
pub fn verdict(records: &[StepRecord], params_finite: bool) -> Verdict {
    if !params_finite {
        Verdict::Diverged
    } else if records.iter().any(|r| {
        r.origins
            .first_inf
            .as_ref()
            .or(r.origins.first_nan.as_ref())
            .is_some_and(|o| o.phase == Phase::Forward)
    }) {
        Verdict::ForwardNonfinite
    } else if records.iter().any(|r| r.skipped) {
        Verdict::OverflowSkips
    } else {
        Verdict::Clean
    }
}

/// Per-step line of the summary.
#[derive(Debug, Clone, Serialize)]
pub struct StepSummary {
    /// Step number (from 0).
    pub step: u64,
    /// Mean loss of the step's micro-batches.
    #[serde(with = "crate::trace::record::float_json::option")]
    pub loss: Option<f64>,
    /// Loss scale before the step.
    #[serde(with = "crate::trace::record::float_json")]
    pub scale_before: f64,
    /// Loss scale after the update.
    #[serde(with = "crate::trace::record::float_json")]
    pub scale_after: f64,
    /// A gradient was Inf/NaN.
    pub found_inf: bool,
    /// The optimizer step was skipped.
    pub skipped: bool,
    /// Total L2 norm of the unscaled gradients (before clipping); `"inf"` when a gradient
    /// holds an Inf or NaN.
    #[serde(with = "crate::trace::record::float_json::option")]
    pub grad_norm: Option<f64>,
    /// Why the step was skipped (skipped steps within the classification limit).
    pub skip_cause: Option<crate::trace::record::SkipCause>,
}

/// Per-parameter line of the summary (last step).
#[derive(Debug, Clone, Serialize)]
pub struct ParamSummary {
    /// Largest |unscaled gradient|.
    #[serde(with = "crate::trace::record::float_json")]
    pub max_abs_grad: f64,
    /// L2 norm of the unscaled gradient.
    #[serde(with = "crate::trace::record::float_json")]
    pub grad_norm: f64,
    /// Largest |parameter| after the step.
    #[serde(with = "crate::trace::record::float_json")]
    pub max_abs_after: f64,
}

/// What a run found: the machine-readable summary.
#[derive(Debug, Clone, Serialize)]
pub struct RunSummary {
    /// The outcome of the run.
    pub verdict: Verdict,
    /// Model description.
    pub model: String,
    /// Precision mode.
    pub precision: Precision,
    /// The backend that ran the step.
    pub backend: BackendKind,
    /// The name of the device that ran the step, when it was a GPU.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    /// Why a GPU that `--backend auto` found did not run the step, when it did not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend_warning: Option<String>,
    /// First op whose output held an Inf while its inputs were finite.
    pub first_inf: Option<OpRef>,
    /// First op whose output held a NaN while its inputs had none.
    pub first_nan: Option<OpRef>,
    /// Ops from the first Inf to the first NaN, in execution order.
    pub chain: Vec<OpRef>,
    /// Every step.
    pub steps: Vec<StepSummary>,
    /// Every parameter, for the last step.
    pub params: BTreeMap<String, ParamSummary>,
    /// Scaler and clipping events (collapse, non-finite norms, warnings), with their step.
    pub events: Vec<String>,
    /// Number of skipped steps.
    pub skipped_steps: u64,
    /// Trace file, if one was written.
    pub trace: Option<PathBuf>,
    // --- diagnosis (src/diagnose) ---
    /// The loss-scale collapse flag, when raised.
    pub scale_collapse: Option<super::collapse::CollapseFlag>,
    /// Skipped steps left without a cause (past the classification limit).
    pub unclassified_skips: u64,
    /// Ops close to fp16's limits.
    pub headroom: super::headroom::HeadroomReport,
    /// Remedies tried at the first failing step (`run --try-remedies`, `fix`, `bisect`).
    pub remedies: Option<super::remedy::RemedyReport>,
    /// Step re-runs the diagnosis used.
    pub diagnosis_replays: u32,
}
