//! Headroom: the warning before the NaN. From the op records of any run (fp32 and bf16
//! included), the ops whose values come close to fp16's largest value, and the ops that
//! would flush a share of their nonzero values to zero in fp16.
//!
//! An op is *near overflow* when its largest finite `|x|` exceeds `overflow_share · 65504`,
//! or when it overflowed its own dtype while rounding (then its `max_abs` is reported as
//! inf). An op *underflows* when more than `underflow_share` of its finite nonzero values
//! would round to zero in fp16 (`|x| ≤ 2^-25`). Forward and backward ops are scanned
//! (backward values carry the step's loss scale, reported beside them); optimizer-phase
//! ops are not, nor the loss scaling's own ops (the `scaler` module: fp32 in every mode).
//! Each (kind, module, op, phase) is reported once, at its worst.

use super::align::is_scaler_op;
use crate::dtype::{DType, FP16};
use crate::trace::record::{float_json, OpRecord, Phase};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Headroom thresholds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct HeadroomThresholds {
    /// Share of fp16's largest value (65504) above which an op is near overflow
    /// (default 0.5, i.e. 32752).
    pub overflow_share: f64,
    /// Share of an op's finite nonzero values that may flush to zero in fp16 before it is
    /// reported (default 0.01). One in a hundred values lost is where a tensor starts to
    /// lose information a mean or a matmul would notice; below that, flushes are the
    /// normal tail of a wide distribution.
    pub underflow_share: f64,
}

impl Default for HeadroomThresholds {
    fn default() -> Self {
        HeadroomThresholds {
            overflow_share: 0.5,
            underflow_share: 0.01,
        }
    }
}

/// Which limit an op comes close to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum HeadroomKind {
    /// Large values: close to (or past) fp16's largest value.
    NearOverflow,
    /// Small values: a share would flush to zero in fp16.
    Underflow,
}

/// One op close to an fp16 limit, at the step where it was worst.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HeadroomWarning {
    /// Which limit.
    pub kind: HeadroomKind,
    /// Op name.
    pub op: String,
    /// Module path.
    pub module: String,
    /// Phase.
    pub phase: Phase,
    /// Step of the worst occurrence.
    pub step: u64,
    /// Micro-batch of the worst occurrence.
    pub micro: u32,
    /// Index of the op within that step.
    pub op_index: u64,
    /// Dtype the op's output had in this run.
    pub dtype: DType,
    /// Largest finite `|x|` (inf when the op overflowed its own dtype).
    #[serde(with = "float_json")]
    pub max_abs: f64,
    /// `max_abs / 65504`.
    #[serde(with = "float_json")]
    pub fp16_max_share: f64,
    /// Values that are (or would be) ±inf in fp16: finite values `≥ 65520`, plus those that
    /// overflowed when the op rounded to its dtype.
    pub fp16_overflow: u64,
    /// Share of the finite nonzero values that would flush to zero in fp16.
    #[serde(with = "float_json")]
    pub underflow_share: f64,
    /// Those values.
    pub fp16_underflow: u64,
    /// Finite nonzero values of the output.
    pub finite_nonzero: u64,
    /// For backward ops: the loss scale the gradient carries.
    #[serde(with = "float_json::option", default)]
    pub loss_scale: Option<f64>,
    /// Inf values in the output (an attention mask's -inf left out).
    #[serde(default)]
    pub inf: u64,
}

impl HeadroomWarning {
    /// True when the op ran in a 16-bit float type (the values the run itself risks); an
    /// fp32 op would reach the limit only if it were cast.
    pub fn low_precision(&self) -> bool {
        matches!(self.dtype, DType::F16 | DType::BF16)
    }

    /// How bad it is: `max_abs` (near overflow) or `underflow_share` (underflow).
    pub fn severity(&self) -> f64 {
        match self.kind {
            HeadroomKind::NearOverflow => self.max_abs,
            HeadroomKind::Underflow => self.underflow_share,
        }
    }
}

/// The headroom section of a run summary.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct HeadroomReport {
    /// Thresholds used.
    pub thresholds: HeadroomThresholds,
    /// Steps whose op records were scanned (step 0, sampled steps, and steps with a
    /// non-finite value; `--sample-every 1` scans all).
    pub steps_scanned: Vec<u64>,
    /// The warnings, near-overflow first, each kind in execution order.
    pub warnings: Vec<HeadroomWarning>,
}

/// Collects headroom warnings over the steps of a run.
#[derive(Debug, Clone)]
pub struct Headroom {
    t: HeadroomThresholds,
    steps: Vec<u64>,
    worst: BTreeMap<(HeadroomKind, String, String, u8), HeadroomWarning>,
}

fn phase_key(p: Phase) -> u8 {
    match p {
        Phase::Forward => 0,
        Phase::Backward => 1,
        Phase::Optimizer => 2,
    }
}

impl Headroom {
    /// A collector with these thresholds.
    pub fn new(t: HeadroomThresholds) -> Headroom {
        Headroom {
            t,
            steps: Vec::new(),
            worst: BTreeMap::new(),
        }
    }

    /// Scans the op records of step `step` (loss scale `scale`).
    pub fn observe(&mut self, step: u64, scale: f64, ops: &[OpRecord]) {
        self.steps.push(step);
        for o in ops {
            // The loss scaling's multiply and its backward hold the scale itself and run in
            // fp32 in every precision mode: nothing there would be cast to fp16.
            if o.phase == Phase::Optimizer || !o.output.dtype.is_float() || is_scaler_op(o) {
                continue;
            }
            // An attention mask's lowest finite value (and the −inf it makes of a masked
            // fp16 score) is what it is for; the scores' own range shows at the product.
            let mask = o.additive_mask && o.phase == Phase::Forward;
            let s = &o.stats;
            let nonzero = s.finite_nonzero();
            let overflowed = o.rounding.overflow > 0;
            let max_abs = if overflowed { f64::INFINITY } else { s.max_abs };
            let under = if nonzero == 0 {
                0.0
            } else {
                s.to_f16.underflow as f64 / nonzero as f64
            };
            let make = |kind| HeadroomWarning {
                kind,
                op: o.op.clone(),
                module: o.module.clone(),
                phase: o.phase,
                step,
                micro: o.micro,
                op_index: o.index,
                dtype: o.output.dtype,
                max_abs,
                fp16_max_share: max_abs / FP16.max,
                fp16_overflow: s.to_f16.overflow + o.rounding.overflow,
                underflow_share: under,
                fp16_underflow: s.to_f16.underflow,
                finite_nonzero: nonzero,
                loss_scale: (o.phase == Phase::Backward).then_some(scale),
                inf: s.pos_inf + s.neg_inf.saturating_sub(o.masked_neg_inf),
            };
            if !mask && (overflowed || s.max_abs > self.t.overflow_share * FP16.max) {
                self.keep(make(HeadroomKind::NearOverflow));
            }
            if under > self.t.underflow_share {
                self.keep(make(HeadroomKind::Underflow));
            }
        }
    }

    fn keep(&mut self, w: HeadroomWarning) {
        let key = (w.kind, w.module.clone(), w.op.clone(), phase_key(w.phase));
        match self.worst.get(&key) {
            Some(old) if old.severity() >= w.severity() => {}
            _ => {
                self.worst.insert(key, w);
            }
        }
    }

    /// The report: near-overflow warnings first, then underflow; within each, ops that ran
    /// in a 16-bit type before fp32 ones, each in execution order (phase, then op index).
    pub fn report(&self) -> HeadroomReport {
        let mut warnings: Vec<HeadroomWarning> = self.worst.values().cloned().collect();
        warnings.sort_by_key(|w| {
            (
                w.kind,
                !w.low_precision(),
                phase_key(w.phase),
                w.op_index,
                w.step,
            )
        });
        HeadroomReport {
            thresholds: self.t,
            steps_scanned: self.steps.clone(),
            warnings,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::RoundCounts;
    use crate::probe::TensorStats;
    use crate::trace::record::TensorMeta;

    fn op(
        index: u64,
        phase: Phase,
        name: &str,
        module: &str,
        dtype: DType,
        data: &[f32],
    ) -> OpRecord {
        OpRecord {
            micro: 0,
            index,
            phase,
            op: name.into(),
            module: module.into(),
            inputs: vec![],
            output: TensorMeta {
                dtype,
                shape: vec![data.len()],
            },
            stats: TensorStats::compute(dtype, data),
            rounding: RoundCounts::default(),
            forward_op: None,
            wrt: None,
            masked_neg_inf: 0,
            additive_mask: false,
            blame: None,
        }
    }

    #[test]
    fn thresholds_and_dedup_keep_the_worst() {
        let mut h = Headroom::new(HeadroomThresholds::default());
        // 32752 is exactly half of 65504: not above the threshold; 32753 is.
        h.observe(
            0,
            65536.0,
            &[
                op(
                    0,
                    Phase::Forward,
                    "linear",
                    "a",
                    DType::F32,
                    &[32752.0, 1.0],
                ),
                op(
                    1,
                    Phase::Forward,
                    "linear",
                    "b",
                    DType::F32,
                    &[-32753.0, 1.0],
                ),
                // 2 of 100 nonzero values at 2^-26 flush (2%); 1 of 100 (1%) does not count.
                op(2, Phase::Backward, "mul", "c", DType::F32, &{
                    let mut v = vec![1.0f32; 100];
                    v[0] = 2f32.powi(-26);
                    v[1] = -2f32.powi(-30);
                    v
                }),
                op(3, Phase::Backward, "mul", "d", DType::F32, &{
                    let mut v = vec![1.0f32; 100];
                    v[0] = 2f32.powi(-26);
                    v
                }),
                op(4, Phase::Optimizer, "unscale", "e", DType::F32, &[1e9]),
                // loss × scale and its backward: the scale, not a model value.
                op(5, Phase::Forward, "mul", "scaler", DType::F32, &[150667.0]),
                op(6, Phase::Backward, "mul", "scaler", DType::F32, &[65536.0]),
            ],
        );
        let mut big = op(1, Phase::Forward, "linear", "b", DType::F16, &[40000.0]);
        big.rounding.overflow = 1;
        h.observe(
            1,
            32768.0,
            &[
                big,
                op(3, Phase::Forward, "add", "b", DType::F32, &[50000.0]),
            ],
        );
        h.observe(
            2,
            32768.0,
            &[op(1, Phase::Forward, "linear", "b", DType::F32, &[60000.0])],
        );
        let r = h.report();
        assert_eq!(r.steps_scanned, vec![0, 1, 2]);
        let got: Vec<(HeadroomKind, &str, &str, u64)> = r
            .warnings
            .iter()
            .map(|w| (w.kind, w.module.as_str(), w.op.as_str(), w.step))
            .collect();
        assert_eq!(
            got,
            vec![
                (HeadroomKind::NearOverflow, "b", "linear", 1),
                (HeadroomKind::NearOverflow, "b", "add", 1),
                (HeadroomKind::Underflow, "c", "mul", 0),
            ]
        );
        assert_eq!(r.warnings[0].max_abs, f64::INFINITY);
        assert_eq!(r.warnings[0].fp16_overflow, 1);
        assert_eq!(r.warnings[1].max_abs, 50000.0);
        assert_eq!(r.warnings[2].underflow_share, 0.02);
        assert_eq!(r.warnings[2].loss_scale, Some(65536.0));
        assert_eq!(r.warnings[1].loss_scale, None);
    }
}
