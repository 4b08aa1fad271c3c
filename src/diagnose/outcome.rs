//! What one step record says on its own: whether the step failed or stayed finite, where
//! its non-finite values began, and lookups of its op records. Shared by the diagnoses
//! beside it; uses only the trace records.

use crate::trace::record::{OpRecord, OpRef, Phase, StepRecord};

/// The first op of a step whose forward output became non-finite on its own (first Inf or
/// first NaN in the forward phase, whichever ran first).
pub fn forward_origin(rec: &StepRecord) -> Option<&OpRef> {
    [&rec.origins.first_inf, &rec.origins.first_nan]
        .into_iter()
        .flatten()
        .filter(|o| o.phase == Phase::Forward)
        .min_by_key(|o| o.op_index)
}

/// The earliest origin of a step in any phase.
pub fn any_origin(rec: &StepRecord) -> Option<&OpRef> {
    [&rec.origins.first_inf, &rec.origins.first_nan]
        .into_iter()
        .flatten()
        .min_by_key(|o| o.op_index)
}

/// A step failed: it was skipped, or a forward value became non-finite.
pub fn failed(rec: &StepRecord) -> bool {
    rec.skipped || forward_origin(rec).is_some()
}

/// A step is finite: not skipped, no inf/NaN gradient, a finite loss, and no forward
/// origin of a non-finite value.
pub fn finite(rec: &StepRecord) -> bool {
    !rec.skipped
        && !rec.found_inf
        && rec.loss.is_none_or(f64::is_finite)
        && forward_origin(rec).is_none()
}

/// Anything non-finite in a step: an origin in any phase, an inf/NaN gradient, a skipped
/// step, a non-finite loss or gradient norm.
pub fn nonfinite_anywhere(rec: &StepRecord) -> bool {
    rec.skipped
        || rec.found_inf
        || any_origin(rec).is_some()
        || rec.loss.is_some_and(|l| !l.is_finite())
        || rec.grad_norm.is_some_and(|g| !g.is_finite())
        || rec.params.iter().any(|p| p.nonfinite > 0)
}

/// The op record with index `index` (records are in index order, so a binary search finds
/// it; a linear scan covers any other order).
pub(crate) fn op_by_index(ops: &[OpRecord], index: u64) -> Option<&OpRecord> {
    match ops.binary_search_by_key(&index, |o| o.index) {
        Ok(i) => Some(&ops[i]),
        Err(_) => ops.iter().find(|o| o.index == index),
    }
}

/// The forward op a backward op reference differentiates, as a reference.
pub(crate) fn forward_ref(step: u64, ops: &[OpRecord], op: &OpRef) -> Option<OpRef> {
    op.forward_op
        .and_then(|i| op_by_index(ops, i))
        .map(|o| OpRef::from_op(step, o))
}
