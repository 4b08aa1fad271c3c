//! Remedies, proven: the failing step re-run from the same weights, scale and data under
//! each candidate fix, with whether it becomes finite and what it costs in accuracy against
//! fp32 (see [`super::accuracy`] for the definitions).
//!
//! Which remedies are tried depends on the cause:
//! - range overflow (`forward-overflow`, `backward-overflow`, or a forward value non-finite
//!   in a step that was not skipped): bf16 instead of fp16; the modules to keep in fp32
//!   found by bisection (the minimal set and, when there is one, its generalised pattern);
//!   transformers' fp16 clamp when the model has one; each of the model's own fp16
//!   switches from transformers' config that is off (GPT-2's `reorder_and_upcast_attn`
//!   and `scale_attn_by_inverse_layer_idx`);
//! - `scale-too-high`: the safe initial scale from the cause, and bf16;
//! - `divergence`: none: the step is non-finite in fp32 too.

use super::accuracy::{compare, Accuracy};
use super::cause::{classify_with, fp32_reference, SkipKind};
use super::collapse::short;
use super::module_bisect::{bisect, Bisection};
use super::outcome::{any_origin, finite, nonfinite_anywhere};
use crate::amp::mode::Precision;
use crate::dtype::DType;
use crate::error::Result;
use crate::trace::record::{float_json, OpRef, StepRecord};
use crate::train::{Replay, Trainer, Variant};
use serde::{Deserialize, Serialize};

/// What to try at the first failing step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RemedyMode {
    /// Nothing.
    #[default]
    Off,
    /// Every remedy that fits the cause.
    All,
    /// Only the precision bisection (with the accuracy of its answers).
    BisectOnly,
}

/// The kind of a remedy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RemedyKind {
    /// bf16 in place of fp16 (same mode otherwise).
    Bf16,
    /// Modules kept in fp32.
    KeepFp32,
    /// transformers' fp16 clamp.
    Clamp,
    /// A lower initial loss scale.
    LowerScale,
    /// One of the model's own fp16 switches from transformers' config (GPT-2's
    /// `reorder_and_upcast_attn`, ...).
    Switch,
}

/// One remedy and what re-running the step with it showed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RemedyResult {
    /// Kind.
    pub kind: RemedyKind,
    /// In words, as the subject of a sentence (`keeping \`wo\` in fp32`).
    pub remedy: String,
    /// The run flags that apply it (added to the run's own).
    pub flags: Vec<String>,
    /// The step became finite: not skipped, no inf/NaN gradient, a finite loss, no forward
    /// origin.
    pub finite: bool,
    /// The re-run was skipped by the scaler.
    pub skipped: bool,
    /// The re-run's first non-finite op, if any.
    pub first_nonfinite: Option<OpRef>,
    /// The re-run's loss (mean over micro-batches).
    #[serde(with = "float_json::option", default)]
    pub loss: Option<f64>,
    /// Largest relative error of the loss against fp32.
    #[serde(with = "float_json::option", default)]
    pub loss_rel_err: Option<f64>,
    /// Largest ∞-norm relative error of the final hidden state against fp32.
    #[serde(with = "float_json::option", default)]
    pub hidden_rel_err: Option<f64>,
}

/// The remedies tried at one failing step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RemedyReport {
    /// The failing step.
    pub step: u64,
    /// How it failed: a skip cause, or `forward-nonfinite` for a step that was not skipped.
    pub failure: String,
    /// The fp32 loss of the step (the accuracy reference).
    #[serde(with = "float_json::option", default)]
    pub reference_loss: Option<f64>,
    /// The fp32 re-run is finite (else no precision remedy can help).
    pub reference_finite: bool,
    /// Each remedy tried, in the order tried.
    pub remedies: Vec<RemedyResult>,
    /// The precision bisection, when it ran.
    pub bisection: Option<Bisection>,
    /// Re-runs used (the fp32 reference included when it was made here).
    pub replays: u32,
    /// Why nothing was tried, when nothing was.
    pub note: Option<String>,
}

impl RemedyReport {
    /// The finite remedy with the smallest loss error, if any. When the bisection's
    /// generalised pattern was verified, it stands for the bisection (it also covers the
    /// modules that overflow at later steps), and the exact set is not considered.
    pub fn best(&self) -> Option<&RemedyResult> {
        let pattern = self
            .bisection
            .as_ref()
            .filter(|b| b.pattern_finite == Some(true))
            .map(|b| keep_flags(&b.keep_fp32));
        self.remedies
            .iter()
            .filter(|r| r.finite)
            .filter(|r| {
                r.kind != RemedyKind::KeepFp32 || pattern.as_ref().is_none_or(|p| *p == r.flags)
            })
            .min_by(|a, b| {
                let k = |r: &RemedyResult| r.loss_rel_err.unwrap_or(f64::INFINITY);
                k(a).total_cmp(&k(b))
            })
    }
}

fn mean_loss(r: &Replay) -> Option<f64> {
    r.record.loss
}

fn result(
    kind: RemedyKind,
    remedy: String,
    flags: Vec<String>,
    r: &Replay,
    reference: &Replay,
) -> Result<RemedyResult> {
    let ok = finite(&r.record);
    let acc: Option<Accuracy> = if ok {
        Some(compare(&r.outputs, &reference.outputs)?)
    } else {
        None
    };
    Ok(RemedyResult {
        kind,
        remedy,
        flags,
        finite: ok,
        skipped: r.record.skipped,
        first_nonfinite: any_origin(&r.record).cloned(),
        loss: mean_loss(r),
        loss_rel_err: acc.map(|a| a.loss_rel_err),
        hidden_rel_err: acc.map(|a| a.hidden_rel_err),
    })
}

/// The bf16 counterpart of an fp16 mode.
fn bf16_of(p: Precision) -> Option<(Precision, &'static str)> {
    match p {
        Precision::Fp16 => Some((Precision::Bf16, "bf16 autocast")),
        Precision::O2 => Some((Precision::O2Bf16, "bf16 O2")),
        Precision::Half => Some((Precision::Bf16Pure, "pure bf16")),
        _ => None,
    }
}

fn keep_flags(keep: &[String]) -> Vec<String> {
    keep.iter()
        .flat_map(|p| ["--keep-fp32".to_string(), p.clone()])
        .collect()
}

/// Tries the remedies that fit the failure of the trainer's last step (`rec`), re-running
/// the step for each. `reference` is its fp32 re-run at scale 1 when already made (by the
/// skip classification); `budget` caps the bisection's re-runs.
pub fn try_remedies(
    trainer: &Trainer,
    rec: &StepRecord,
    reference: Option<Replay>,
    mode: RemedyMode,
    budget: u32,
) -> Result<RemedyReport> {
    let mut replays = 0;
    let fp32 = match reference {
        Some(r) => r,
        None => {
            replays += 1;
            fp32_reference(trainer)?
        }
    };
    let mut report = RemedyReport {
        step: rec.step,
        failure: String::new(),
        reference_loss: mean_loss(&fp32),
        reference_finite: !nonfinite_anywhere(&fp32.record),
        remedies: Vec::new(),
        bisection: None,
        replays: 0,
        note: None,
    };
    let cause = match (&rec.skip_cause, rec.skipped) {
        (Some(c), _) => Some(c.as_ref().clone()),
        (None, true) => {
            let c = classify_with(trainer, rec, &fp32)?;
            replays += c.replays;
            Some(c)
        }
        (None, false) => None,
    };
    let kind = cause.as_ref().map(|c| c.kind);
    report.failure = kind.map_or("forward-nonfinite", SkipKind::name).to_string();
    if !report.reference_finite {
        report.note = Some(
            "the step is non-finite in fp32 too: this is not a precision problem, so no precision remedy can fix it (look at the data, the learning rate and the model)".into(),
        );
        report.replays = replays;
        return Ok(report);
    }
    let cfg = trainer.config();
    let low = cfg.precision.low_dtype();
    let range = matches!(
        kind,
        None | Some(SkipKind::ForwardOverflow) | Some(SkipKind::BackwardOverflow)
    );
    let all = mode == RemedyMode::All;
    if all {
        if let (Some(DType::F16), Some((p, name))) = (low, bf16_of(cfg.precision)) {
            replays += 1;
            let r = trainer.replay(&Variant {
                precision: Some(p),
                probes: Some(true),
                ..Variant::default()
            })?;
            let flags = vec!["--precision".into(), p.name().into()];
            report
                .remedies
                .push(result(RemedyKind::Bf16, name.into(), flags, &r, &fp32)?);
        }
    }
    let want_bisect = mode == RemedyMode::BisectOnly || (all && range);
    if want_bisect && low.is_some() {
        replays += bisection_remedies(trainer, rec, budget, &fp32, &mut report)?;
    }
    if all && range {
        replays += model_remedies(trainer, low, &fp32, &mut report)?;
    }
    if all && kind == Some(SkipKind::ScaleTooHigh) {
        if let Some(s) = cause.as_ref().and_then(|c| c.safe_scale) {
            replays += 1;
            let r = trainer.replay(&Variant {
                scale: Some(s as f32),
                probes: Some(true),
                ..Variant::default()
            })?;
            report.remedies.push(result(
                RemedyKind::LowerScale,
                format!("initial loss scale {} (2^{})", short(s), s.log2().round()),
                vec!["--init-scale".into(), format!("{s}")],
                &r,
                &fp32,
            )?);
        }
    }
    if report.remedies.is_empty() && report.note.is_none() {
        report.note = Some(match (low, kind) {
            (None, _) => "the run is fp32: there is no precision to change".to_string(),
            (_, Some(SkipKind::ScaleTooHigh)) if !all => {
                "the step was skipped because the loss scale was too high: lower the initial scale (see the skip cause)".to_string()
            }
            _ => "no remedy applies to this failure".to_string(),
        });
    }
    report.replays = replays;
    Ok(report)
}

/// The bisection's remedies: the modules it keeps in fp32, and its generalised pattern.
/// Returns its re-runs.
fn bisection_remedies(
    trainer: &Trainer,
    rec: &StepRecord,
    budget: u32,
    fp32: &Replay,
    report: &mut RemedyReport,
) -> Result<u32> {
    let b = bisect(trainer, rec, budget)?;
    let b_replays = b.report.replays;
    let base = &b.report.base_keep_fp32;
    if let Some(r) = &b.modules_replay {
        let mut keep = base.clone();
        keep.extend(b.report.modules.iter().cloned());
        let name = format!("keeping {} in fp32", b.report.modules.join(", "));
        report.remedies.push(result(
            RemedyKind::KeepFp32,
            name,
            keep_flags(&keep),
            r,
            fp32,
        )?);
    }
    if let (Some(p), Some(r)) = (&b.report.pattern, &b.pattern_replay) {
        let mut keep = base.clone();
        keep.push(p.clone());
        let name = format!("keeping `{p}` in fp32");
        report.remedies.push(result(
            RemedyKind::KeepFp32,
            name,
            keep_flags(&keep),
            r,
            fp32,
        )?);
    }
    report.bisection = Some(b.report);
    Ok(b_replays)
}

/// The model's own fp16 remedies: transformers' clamp (fp16 only) and each fp16 switch of
/// its config that is off. Returns their re-runs.
fn model_remedies(
    trainer: &Trainer,
    low: Option<DType>,
    fp32: &Replay,
    report: &mut RemedyReport,
) -> Result<u32> {
    let mut replays = 0;
    if low == Some(DType::F16) && !trainer.model().clamp() {
        let mut m = trainer.model().clone_model();
        if m.set_clamp(true) {
            replays += 1;
            let r = trainer.replay(&Variant {
                clamp: Some(true),
                probes: Some(true),
                ..Variant::default()
            })?;
            report.remedies.push(result(
                RemedyKind::Clamp,
                "transformers' fp16 clamp in T5Block (--t5-clamp)".into(),
                vec!["--t5-clamp".into()],
                &r,
                fp32,
            )?);
        }
    }
    if low.is_some() {
        let model = trainer.model();
        for (name, what) in model.fp16_switches() {
            if model.switch(name) {
                continue;
            }
            replays += 1;
            let r = trainer.replay(&Variant {
                switches: vec![name.to_string()],
                probes: Some(true),
                ..Variant::default()
            })?;
            report.remedies.push(result(
                RemedyKind::Switch,
                format!("transformers' `{name}` ({what})"),
                vec!["--switch".into(), name.into()],
                &r,
                fp32,
            )?);
        }
    }
    Ok(replays)
}
