//! Headroom: the warning before the NaN. From the op records of any run (fp32 and bf16
//! included), the ops whose values come close to fp16's largest value, and the ops that
//! would flush a share of their nonzero values to zero in fp16.
//!
//! An op is *near overflow* when the `|x|` it is judged by exceeds `overflow_share · 65504`,
//! or when it overflowed its own dtype while rounding (then its `max_abs` is reported as
//! inf). The `|x|` judged is the op's largest finite `|x|`, but for a backward op held in a
//! type other than fp16 (fp32, bf16) it is that divided by the step's loss scale
//! ([`HeadroomWarning::judged_max_abs`]). Backward values carry the scale: held in fp16,
//! the scale is in the bits that overflow (the scaler's skips come from there), so an fp16
//! gradient is judged as it is. Held in another type, fp16's limit would apply only if the
//! op were cast, and the scaler of a run whose gradients were fp16 there would pick its
//! scale for them: what overflows whatever the scale is the gradient's own size. So an
//! fp32 `div` whose `|x|` is the scale itself (the backward of `loss / accumulation_steps`
//! at scale 32768), or an fp32 RMSNorm backward at a few times the scale, is not near
//! overflow. An op *underflows* when more than `underflow_share` of its finite nonzero
//! values would round to zero in fp16 (`|x| ≤ 2^-25`), judged on the values as they are:
//! lifting small gradients out of fp16's underflow is what the scale is for, and what
//! still flushes at the run's scale is lost. Forward and backward ops are scanned (backward
//! values report the scale they carry), optimizer-phase ops are not, nor the loss
//! scaling's own ops (the `scaler` module: fp32 in every mode). Each (kind, module, op,
//! phase) is reported once, at its worst.
//!
//! A run some of whose scanned ops ran in 16 bits ([`ran_in_16_bits`],
//! [`HeadroomReport::ran_16bit`]) risks the limits in those ops: they are its findings, and
//! its fp32 ops (kept in fp32 by the precision mode, reaching fp16's limits only if cast)
//! come after them, never as the finding. In a run with none (fp32), headroom answers
//! whether the values would fit fp16, and the fp32 ops are the findings.

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

    /// The `|x|` the near-overflow test judges: `max_abs`, divided by the loss scale for a
    /// backward op held in a type other than fp16 (see the module docs).
    pub fn judged_max_abs(&self) -> f64 {
        judged(
            self.dtype,
            self.phase,
            self.max_abs,
            self.loss_scale.unwrap_or(1.0),
        )
    }

    /// How bad it is: [`HeadroomWarning::judged_max_abs`] (near overflow) or
    /// `underflow_share` (underflow).
    pub fn severity(&self) -> f64 {
        match self.kind {
            HeadroomKind::NearOverflow => self.judged_max_abs(),
            HeadroomKind::Underflow => self.underflow_share,
        }
    }
}

/// `max_abs` of an op in `dtype` and `phase` at loss scale `scale`, as the near-overflow
/// test judges it.
fn judged(dtype: DType, phase: Phase, max_abs: f64, scale: f64) -> f64 {
    if phase == Phase::Backward && dtype != DType::F16 && scale.is_finite() && scale > 0.0 {
        max_abs / scale
    } else {
        max_abs
    }
}

/// True for an op of the model's step that ran in a 16-bit float type (fp16, bf16):
/// forward or backward, neither the optimizer's nor the loss scaling's own.
pub fn ran_in_16_bits(op: &OpRecord) -> bool {
    op.phase != Phase::Optimizer
        && !is_scaler_op(op)
        && matches!(op.output.dtype, DType::F16 | DType::BF16)
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
    /// True when a scanned op ran in a 16-bit float type ([`ran_in_16_bits`]): the run's
    /// findings are its 16-bit ops, its fp32 ops are apart.
    #[serde(default)]
    pub ran_16bit: bool,
}

/// Collects headroom warnings over the steps of a run.
#[derive(Debug, Clone)]
pub struct Headroom {
    t: HeadroomThresholds,
    steps: Vec<u64>,
    worst: BTreeMap<(HeadroomKind, String, String, u8), HeadroomWarning>,
    ran_16bit: bool,
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
            ran_16bit: false,
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
            self.ran_16bit |= ran_in_16_bits(o);
            self.scan(step, scale, o);
        }
    }

    /// The warnings of one op of step `step` (loss scale `scale`).
    fn scan(&mut self, step: u64, scale: f64, o: &OpRecord) {
        // An attention mask's lowest finite value (and the −inf it makes of a masked fp16
        // score) is what it is for; the scores' own range shows at the product.
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
        let large = judged(o.output.dtype, o.phase, s.max_abs, scale);
        if !mask && (overflowed || large > self.t.overflow_share * FP16.max) {
            self.keep(make(HeadroomKind::NearOverflow));
        }
        if under > self.t.underflow_share {
            self.keep(make(HeadroomKind::Underflow));
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
            ran_16bit: self.ran_16bit,
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

    /// A captured fp16 step at loss scale 32768, as HF Trainer with gradient accumulation
    /// and a GradScaler records it: the backward of `loss / accumulation_steps` and
    /// RMSNorm's backward run in fp32 and carry the scale; the MLP's backward carries it in
    /// fp16.
    fn captured_fp16_step(scale: f32) -> Vec<OpRecord> {
        vec![
            op(
                0,
                Phase::Forward,
                "mm",
                "mlp.up_proj",
                DType::F16,
                &[3.0, -1.5],
            ),
            op(1, Phase::Forward, "mean", "norm", DType::F32, &[2.0]),
            // Its |x| is the scale itself.
            op(10, Phase::Backward, "div", "", DType::F32, &[scale, 0.0]),
            op(
                11,
                Phase::Backward,
                "mul",
                "norm",
                DType::F32,
                &[3.0 * scale, -0.5 * scale],
            ),
            op(
                12,
                Phase::Backward,
                "mm",
                "mlp.down_proj",
                DType::F16,
                &[60000.0, 1.0],
            ),
            // Past half of fp16's max even without the scale.
            op(
                13,
                Phase::Backward,
                "mul",
                "embed",
                DType::F32,
                &[40000.0 * scale],
            ),
        ]
    }

    #[test]
    fn fp32_gradients_are_judged_without_the_loss_scale_fp16_ones_as_they_are() {
        let mut h = Headroom::new(HeadroomThresholds::default());
        h.observe(3, 32768.0, &captured_fp16_step(32768.0));
        let r = h.report();
        let got: Vec<(&str, &str, DType, u64)> = r
            .warnings
            .iter()
            .map(|w| (w.module.as_str(), w.op.as_str(), w.dtype, w.step))
            .collect();
        assert_eq!(
            got,
            vec![
                ("mlp.down_proj", "mm", DType::F16, 3),
                ("embed", "mul", DType::F32, 3),
            ]
        );
        assert!(r
            .warnings
            .iter()
            .all(|w| w.kind == HeadroomKind::NearOverflow));
        assert_eq!(r.warnings[0].max_abs, 60000.0);
        assert_eq!(r.warnings[0].loss_scale, Some(32768.0));
        assert_eq!(r.warnings[1].max_abs, 40000.0 * 32768.0);
        assert_eq!(r.warnings[1].judged_max_abs(), 40000.0);
        assert!(r.ran_16bit);
        // At a lower scale the same fp32 gradient is smaller, and larger without it: that
        // step is its worst.
        h.observe(
            4,
            2048.0,
            &[op(
                13,
                Phase::Backward,
                "mul",
                "embed",
                DType::F32,
                &[50000.0 * 2048.0],
            )],
        );
        let w = h.report().warnings;
        assert_eq!((w[1].module.as_str(), w[1].step), ("embed", 4));
    }

    #[test]
    fn an_fp32_run_has_no_16_bit_ops_and_its_gradients_at_scale_1_are_judged_as_they_are() {
        let mut h = Headroom::new(HeadroomThresholds::default());
        let scaled = op(2, Phase::Forward, "mul", "scaler", DType::F16, &[4.0]);
        h.observe(
            0,
            1.0,
            &[
                op(0, Phase::Forward, "linear", "wo", DType::F32, &[40000.0]),
                op(1, Phase::Backward, "linear", "wo", DType::F32, &[40000.0]),
                // Neither the scaler's ops nor the optimizer's make a run 16-bit.
                scaled,
                op(3, Phase::Optimizer, "unscale", "wo", DType::BF16, &[1.0]),
            ],
        );
        let r = h.report();
        assert!(!r.ran_16bit);
        let got: Vec<(Phase, f64)> = r
            .warnings
            .iter()
            .map(|w| (w.phase, w.judged_max_abs()))
            .collect();
        assert_eq!(
            got,
            vec![(Phase::Forward, 40000.0), (Phase::Backward, 40000.0)]
        );
    }

    #[test]
    fn a_bf16_gradient_is_judged_without_the_scale_as_fp16_would_be_only_if_cast() {
        // bf16 holds 2^17 at scale 2^16: 2 without the scale, far from fp16's limit; 2^31
        // is 32768 without it, past half of fp16's max.
        let mut h = Headroom::new(HeadroomThresholds::default());
        h.observe(
            0,
            65536.0,
            &[
                op(0, Phase::Backward, "mm", "a", DType::BF16, &[131072.0]),
                op(1, Phase::Backward, "mm", "b", DType::BF16, &[2f32.powi(31)]),
            ],
        );
        let r = h.report();
        let got: Vec<&str> = r.warnings.iter().map(|w| w.module.as_str()).collect();
        assert_eq!(got, vec!["b"]);
        assert!(r.ran_16bit);
    }
}
