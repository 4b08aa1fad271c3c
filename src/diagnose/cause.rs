//! Why a step was skipped, decided by re-running it.
//!
//! In order:
//! 1. `divergence`: the step re-run in fp32 at loss scale 1 is non-finite too, so no
//!    precision recipe is to blame.
//! 2. `forward-overflow`: a forward value was already non-finite before the backward pass.
//! 3. `scale-too-high`: the forward pass was finite, a backward op overflowed its dtype at
//!    this scale, and the same step re-run at scale 1 is finite: the gradients fit, the scale
//!    pushed them out of range.
//! 4. `backward-overflow`: the forward pass was finite but a gradient overflows the low
//!    dtype even unscaled (scale 1 or below), while fp32 is finite.

use super::outcome::{any_origin, forward_origin, forward_ref, nonfinite_anywhere, op_by_index};
use crate::amp::mode::Precision;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::trace::record::{OpRecord, OpRef, Phase, StepRecord};
pub use crate::trace::record::{SkipCause, SkipKind};
use crate::train::{Replay, Trainer, Variant};

/// The largest power of two `s` with `max_abs · s < limit`; `None` when `max_abs` is zero
/// or not finite. Scaling by a power of two is exact in binary floating point (away from
/// the subnormal range), so an op whose unscaled largest value is `max_abs` stays below
/// `limit` at any such scale.
pub fn safe_pow2_scale(max_abs: f64, limit: f64) -> Option<f64> {
    if !(max_abs > 0.0 && max_abs.is_finite() && limit > 0.0 && limit.is_finite()) {
        return None;
    }
    let mut s = 2f64.powi((limit / max_abs).log2().floor() as i32);
    while s > 0.0 && max_abs * s >= limit {
        s /= 2.0;
    }
    while max_abs * s * 2.0 < limit {
        s *= 2.0;
    }
    // A scale is stored as f32.
    Some(s.clamp(2f64.powi(-149), 2f64.powi(127)))
}

/// The largest finite value of a dtype (None for integers).
fn limit(d: DType) -> Option<f64> {
    d.format().map(|f| f.max)
}

/// The re-run in fp32 at loss scale 1 that decides `divergence`, and serves as the
/// accuracy reference of remedies.
pub fn fp32_reference(trainer: &Trainer) -> Result<Replay> {
    trainer.replay(&Variant {
        precision: Some(Precision::Fp32),
        scale: Some(1.0),
        probes: Some(true),
        ..Variant::default()
    })
}

/// The trainer's last step with its op records and origins: `rec` when it kept them, else
/// a re-run of the same recipe with probes on (counted in `replays`).
fn probed(trainer: &Trainer, rec: &StepRecord, replays: &mut u32) -> Result<StepRecord> {
    if rec.ops.is_some() {
        return Ok(rec.clone());
    }
    *replays += 1;
    let r = trainer.replay(&Variant {
        probes: Some(true),
        ..Variant::default()
    })?;
    if r.record.ops.is_none() {
        return Err(Error::Invalid(format!(
            "step {}: re-run kept no op records",
            rec.step
        )));
    }
    Ok(r.record)
}

/// The first backward op that overflowed its dtype when rounding (else the first backward
/// origin).
fn first_backward_overflow(step: u64, ops: &[OpRecord], rec: &StepRecord) -> Option<OpRef> {
    ops.iter()
        .find(|o| o.phase == Phase::Backward && o.rounding.overflow > 0)
        .map(|o| OpRef::from_op(step, o))
        .or_else(|| {
            [&rec.origins.first_inf, &rec.origins.first_nan]
                .into_iter()
                .flatten()
                .filter(|o| o.phase == Phase::Backward)
                .min_by_key(|o| o.op_index)
                .cloned()
        })
}

/// The op of `ops` that corresponds to `r` (same index, op, module and phase; else the
/// same occurrence of that op, module, phase and micro-batch).
fn matching<'a>(ops: &'a [OpRecord], all: &[OpRecord], r: &OpRef) -> Option<&'a OpRecord> {
    let same = |o: &OpRecord| o.op == r.op && o.module == r.module && o.phase == r.phase;
    if let Some(o) = op_by_index(ops, r.op_index).filter(|o| same(o)) {
        return Some(o);
    }
    let nth = all
        .iter()
        .filter(|o| same(o) && o.micro == r.micro && o.index < r.op_index)
        .count();
    ops.iter()
        .filter(|o| same(o) && o.micro == r.micro)
        .nth(nth)
}

/// Classifies the trainer's last step (`rec`, which was skipped) and returns the cause with
/// the fp32 re-run it made (the accuracy reference of remedies).
pub fn classify(trainer: &Trainer, rec: &StepRecord) -> Result<(SkipCause, Replay)> {
    let fp32 = fp32_reference(trainer)?;
    let cause = classify_with(trainer, rec, &fp32)?;
    Ok((
        SkipCause {
            replays: cause.replays + 1,
            ..cause
        },
        fp32,
    ))
}

/// Classifies the trainer's last step given its fp32 re-run at scale 1 (`fp32`, not
/// counted in `replays`).
pub fn classify_with(trainer: &Trainer, rec: &StepRecord, fp32: &Replay) -> Result<SkipCause> {
    let step = rec.step;
    let mut replays = 0;
    let blank = |kind| SkipCause {
        kind,
        op: None,
        forward_op: None,
        dtype: None,
        scale: rec.scale_before,
        unscaled_max_abs: None,
        op_safe_scale: None,
        safe_scale: None,
        limiting_op: None,
        replays: 0,
    };
    if nonfinite_anywhere(&fp32.record) {
        let ops = fp32.record.ops.as_deref().unwrap_or(&[]);
        let op = any_origin(&fp32.record).cloned();
        return Ok(SkipCause {
            forward_op: op.as_ref().and_then(|o| forward_ref(step, ops, o)),
            dtype: op
                .as_ref()
                .and_then(|o| op_by_index(ops, o.op_index))
                .map(|o| o.output.dtype),
            op,
            ..blank(SkipKind::Divergence)
        });
    }
    let rec = &probed(trainer, rec, &mut replays)?;
    let ops = rec.ops.clone().unwrap_or_default();
    if let Some(o) = forward_origin(rec) {
        return Ok(SkipCause {
            dtype: op_by_index(&ops, o.op_index).map(|x| x.output.dtype),
            op: Some(o.clone()),
            replays,
            ..blank(SkipKind::ForwardOverflow)
        });
    }
    let op = first_backward_overflow(step, &ops, rec);
    let fwd = op.as_ref().and_then(|o| forward_ref(step, &ops, o));
    let dtype = op
        .as_ref()
        .and_then(|o| op_by_index(&ops, o.op_index))
        .map(|o| o.output.dtype);
    let base = SkipCause {
        op: op.clone(),
        forward_op: fwd,
        dtype,
        ..blank(SkipKind::BackwardOverflow)
    };
    // At scale 1 or below, unscaled gradients are at least as large as these.
    if rec.scale_before <= 1.0 {
        return Ok(SkipCause { replays, ..base });
    }
    replays += 1;
    let one = trainer.replay(&Variant {
        scale: Some(1.0),
        probes: Some(true),
        ..Variant::default()
    })?;
    let one_ops = one.record.ops.as_deref().unwrap_or(&[]);
    let unscaled = op
        .as_ref()
        .and_then(|r| matching(one_ops, &ops, r))
        .and_then(|o| {
            (o.stats.nonfinite() == 0 && o.rounding.overflow == 0).then_some(o.stats.max_abs)
        });
    let op_safe = unscaled.and_then(|m| dtype.and_then(limit).and_then(|l| safe_pow2_scale(m, l)));
    if nonfinite_anywhere(&one.record) {
        return Ok(SkipCause {
            unscaled_max_abs: unscaled,
            op_safe_scale: op_safe,
            replays,
            ..base
        });
    }
    // The step-wide safe scale: the smallest over every backward op of the scale-1 re-run.
    let mut safe: Option<(f64, &OpRecord)> = None;
    for o in one_ops.iter().filter(|o| o.phase == Phase::Backward) {
        let Some(l) = limit(o.output.dtype) else {
            continue;
        };
        if let Some(s) = safe_pow2_scale(o.stats.max_abs, l) {
            if safe.is_none_or(|(b, _)| s < b) {
                safe = Some((s, o));
            }
        }
    }
    Ok(SkipCause {
        kind: SkipKind::ScaleTooHigh,
        unscaled_max_abs: unscaled,
        op_safe_scale: op_safe,
        safe_scale: safe.map(|(s, _)| s),
        limiting_op: safe.map(|(_, o)| OpRef::from_op(step, o)),
        replays,
        ..base
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn safe_scale_is_the_largest_power_of_two_below_the_limit() {
        // 1.0 · 2^15 = 32768 < 65504, 1.0 · 2^16 = 65536 does not fit.
        assert_eq!(safe_pow2_scale(1.0, 65504.0), Some(32768.0));
        // 65504 / 3 = 21834.67 → 2^14 = 16384 (3 · 16384 = 49152; 3 · 32768 = 98304).
        assert_eq!(safe_pow2_scale(3.0, 65504.0), Some(16384.0));
        // Exactly at the limit does not count as fitting: 2047 · 32 = 65504.
        assert_eq!(safe_pow2_scale(2047.0, 65504.0), Some(16.0));
        // Larger than the limit: a scale below 1.
        assert_eq!(safe_pow2_scale(131008.0, 65504.0), Some(0.25));
        assert_eq!(safe_pow2_scale(0.0, 65504.0), None);
        assert_eq!(safe_pow2_scale(f64::INFINITY, 65504.0), None);
        // Tiny gradients: capped at the largest f32 power of two.
        assert_eq!(
            safe_pow2_scale(1e-45, f32::MAX as f64),
            Some(2f64.powi(127))
        );
    }
}
