//! The machine-readable summary of a run (`--summary-json`) and the one verdict function
//! that runner, report and terminal UI share.

use super::RunDiagnosis;
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
    /// What a captured run's trace says of how it was captured: what discovery found, a
    /// precision the training library was asked for that did not run
    /// ([`capture::notes`](super::capture::notes)).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub capture_notes: Vec<String>,
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
    /// The top offenders of precision loss, when the run blamed its ops (`--blame`).
    #[serde(default, skip_serializing_if = "super::blame::BlameReport::is_empty")]
    pub blame: super::blame::BlameReport,
    /// Remedies tried at the first failing step (`run --try-remedies`, `fix`, `bisect`).
    pub remedies: Option<super::remedy::RemedyReport>,
    /// Step re-runs the diagnosis used.
    pub diagnosis_replays: u32,
    /// A run over several ranks: which rank made the first Inf and NaN, which received
    /// them, and whether the ranks agreed on found_inf; absent for one trace.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ranks: Option<super::rank_summary::RanksSummary>,
}

/// What ran, for a [`RunSummary`]: the model, precision, backend and trace.
pub struct RunIdentity {
    /// Model description.
    pub model: String,
    /// Precision mode.
    pub precision: Precision,
    /// The backend that ran the step.
    pub backend: BackendKind,
    /// The device's name, when it was a GPU.
    pub device: Option<String>,
    /// Why a GPU found by `--backend auto` did not run the step.
    pub backend_warning: Option<String>,
    /// The trace written, if any.
    pub trace: Option<PathBuf>,
}

/// The summary of a run from its step records (op records may be dropped by then), what
/// ran, its verdict and its diagnosis.
pub fn summarize(
    records: &[StepRecord],
    who: RunIdentity,
    verdict: Verdict,
    diagnosis: RunDiagnosis,
) -> RunSummary {
    let first = |f: fn(&StepRecord) -> Option<&OpRef>| records.iter().find_map(|r| f(r).cloned());
    let first_inf = first(|r| r.origins.first_inf.as_ref());
    let first_nan = first(|r| r.origins.first_nan.as_ref());
    let chain = records
        .iter()
        .find(|r| !r.origins.chain.is_empty())
        .map(|r| r.origins.chain.clone())
        .unwrap_or_default();
    let mut params = BTreeMap::new();
    if let Some(last) = records.last() {
        for p in &last.params {
            params.insert(
                p.name.clone(),
                ParamSummary {
                    max_abs_grad: p.max_abs_grad,
                    grad_norm: p.grad_l2,
                    max_abs_after: p.param_max_abs_after,
                },
            );
        }
    }
    let events = records
        .iter()
        .flat_map(|r| {
            r.events
                .iter()
                .map(move |e| format!("step {}: {e}", r.step))
        })
        .collect();
    RunSummary {
        verdict,
        model: who.model,
        precision: who.precision,
        backend: who.backend,
        device: who.device,
        backend_warning: who.backend_warning,
        capture_notes: Vec::new(),
        first_inf,
        first_nan,
        chain,
        skipped_steps: records.iter().filter(|r| r.skipped).count() as u64,
        steps: records
            .iter()
            .map(|r| StepSummary {
                step: r.step,
                loss: r.loss,
                scale_before: r.scale_before,
                scale_after: r.scale_after,
                found_inf: r.found_inf,
                skipped: r.skipped,
                grad_norm: r.grad_norm,
                skip_cause: r.skip_cause.as_deref().cloned(),
            })
            .collect(),
        params,
        events,
        trace: who.trace,
        scale_collapse: diagnosis.scale_collapse,
        unclassified_skips: diagnosis.unclassified_skips,
        headroom: diagnosis.headroom,
        blame: diagnosis.blame,
        remedies: diagnosis.remedies,
        diagnosis_replays: diagnosis.replays,
        ranks: None,
    }
}

/// The summary of a run that a trace records, diagnosed as the runner diagnoses its own
/// (headroom, collapse flag; skip causes as recorded): for traces captured from a PyTorch
/// script, whose steps amprobe cannot re-run.
pub fn summary_of_trace(
    trace: &crate::trace::io::Trace,
    path: Option<PathBuf>,
    opts: super::DiagnoseOptions,
) -> crate::error::Result<RunSummary> {
    let h = &trace.header;
    let precision = Precision::parse(&h.precision)?;
    let backend = match h.backend.as_str() {
        "cpu" => BackendKind::Cpu,
        "cuda" => BackendKind::Cuda,
        other => {
            return Err(crate::error::Error::config(
                "header.backend",
                format!("`{other}` (expected cpu or cuda)"),
            ))
        }
    };
    let mut diag = super::Diagnoser::new(opts);
    let mut records = trace.steps.clone();
    for r in &mut records {
        diag.after_recorded_step(r);
    }
    let params_finite = records.last().is_none_or(StepRecord::params_finite);
    let verdict = verdict(&records, params_finite);
    let mut s = summarize(
        &records,
        RunIdentity {
            model: h.model.clone(),
            precision,
            backend,
            device: h.device.clone(),
            backend_warning: None,
            trace: path,
        },
        verdict,
        diag.finish(),
    );
    s.capture_notes = super::capture::notes(h);
    Ok(s)
}
