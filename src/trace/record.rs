//! The records of a trace file and their JSON form.

use crate::dtype::{DType, RoundCounts};
use crate::probe::TensorStats;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

/// Version of the record layout. A reader refuses traces with a newer version.
pub const SCHEMA_VERSION: u32 = 1;

/// Name written in [`Header::tool`].
pub const TOOL: &str = "amprobe";

/// One line of a trace file. The JSON object carries its kind in a `"type"` field
/// (`"header"`, `"step"`, `"end"`) next to the record's own fields.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Record {
    /// First line: what was run and how.
    Header(Header),
    /// One optimizer step.
    Step(StepRecord),
    /// Last line of a run that finished.
    End(EndRecord),
}

/// What was run and how: the first record of every trace.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Header {
    /// Layout version of the file ([`SCHEMA_VERSION`] when written by this build).
    pub schema_version: u32,
    /// Name of the writing tool (`"amprobe"`).
    pub tool: String,
    /// Version of the writing tool.
    pub tool_version: String,
    /// Model name or path.
    pub model: String,
    /// Precision mode (e.g. `"fp16-amp"`, `"bf16-amp"`, `"fp32"`).
    pub precision: String,
    /// Dtype autocast casts eligible ops to; `None` when autocast is off.
    pub autocast_dtype: Option<DType>,
    /// Device whose autocast op table was used (`"cuda"`, `"cpu"`).
    pub policy_device: String,
    /// Autocast policy (op lists and overrides).
    pub policy: serde_json::Value,
    /// Grad scaler configuration.
    pub scaler: serde_json::Value,
    /// Optimizer configuration.
    pub optimizer: serde_json::Value,
    /// Compute backend.
    pub backend: String,
    /// Random seed.
    pub seed: u64,
    /// Command line of the run, program name first.
    pub command_line: Vec<String>,
    /// The full resolved configuration.
    pub config: serde_json::Value,
}

impl Header {
    /// A header with this build's schema version, tool name and version, and everything
    /// else empty (use with struct update syntax).
    pub fn new() -> Self {
        Header {
            schema_version: SCHEMA_VERSION,
            tool: TOOL.to_string(),
            tool_version: env!("CARGO_PKG_VERSION").to_string(),
            model: String::new(),
            precision: String::new(),
            autocast_dtype: None,
            policy_device: String::new(),
            policy: serde_json::Value::Null,
            scaler: serde_json::Value::Null,
            optimizer: serde_json::Value::Null,
            backend: String::new(),
            seed: 0,
            command_line: Vec::new(),
            config: serde_json::Value::Null,
        }
    }
}

impl Default for Header {
    fn default() -> Self {
        Header::new()
    }
}

/// Part of a training step an op ran in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Forward pass (loss computation included).
    Forward,
    /// Backward pass.
    Backward,
    /// Unscaling, clipping and the optimizer update.
    Optimizer,
}

/// Dtype and shape of a tensor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorMeta {
    /// Element type.
    pub dtype: DType,
    /// Dimensions, outermost first.
    pub shape: Vec<usize>,
}

/// One executed op and what its output looked like.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OpRecord {
    /// Micro-batch index within the step (0-based).
    pub micro: u32,
    /// Index of the op within the step, in execution order (0-based, across micro-batches
    /// and phases).
    pub index: u64,
    /// Phase the op ran in.
    pub phase: Phase,
    /// Op name (e.g. `"matmul"`, `"softmax"`, `"matmul_backward"`).
    pub op: String,
    /// Dotted path of the module that ran the op.
    pub module: String,
    /// Inputs, in argument order.
    pub inputs: Vec<TensorMeta>,
    /// The output.
    pub output: TensorMeta,
    /// Statistics of the output.
    pub stats: TensorStats,
    /// Values that over/underflowed when the op's f32 result was rounded to its output dtype.
    pub rounding: RoundCounts,
    /// For backward ops: `index` of the forward op being differentiated.
    pub forward_op: Option<u64>,
    /// For backward ops: which input the gradient is for (e.g. `"weight"`, `"input"`).
    pub wrt: Option<String>,
    /// -inf values written on purpose by a mask (e.g. attention masking): not an origin
    /// of a non-finite value.
    pub masked_neg_inf: u64,
}

/// A reference to one op of one step.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpRef {
    /// Step number.
    pub step: u64,
    /// Micro-batch index.
    pub micro: u32,
    /// Phase.
    pub phase: Phase,
    /// [`OpRecord::index`] of the op.
    pub op_index: u64,
    /// Op name.
    pub op: String,
    /// Module path.
    pub module: String,
    /// For backward ops: index of the forward op.
    pub forward_op: Option<u64>,
}

impl OpRef {
    /// Refers to `op` of step `step`.
    pub fn from_op(step: u64, op: &OpRecord) -> Self {
        OpRef {
            step,
            micro: op.micro,
            phase: op.phase,
            op_index: op.index,
            op: op.op.clone(),
            module: op.module.clone(),
            forward_op: op.forward_op,
        }
    }
}

/// Where the non-finite values of a step came from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Origins {
    /// First op (execution order) whose output had an inf it did not get from an input
    /// (masked -inf excluded).
    pub first_inf: Option<OpRef>,
    /// First op whose output had a NaN none of its inputs had.
    pub first_nan: Option<OpRef>,
    /// Ops that carried the non-finite values on, from the origin onward.
    pub chain: Vec<OpRef>,
}

/// Gradient and update statistics of one parameter in one step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ParamRecord {
    /// Parameter name.
    pub name: String,
    /// Dtype the parameter is stored in.
    pub dtype: DType,
    /// Dtype of its gradient; `None` when it got no gradient.
    pub grad_dtype: Option<DType>,
    /// Number of elements.
    pub numel: u64,
    /// L2 norm of the finite values of the unscaled gradient.
    #[serde(with = "float_json")]
    pub grad_l2: f64,
    /// Largest `|g|` over the finite values of the unscaled gradient (0 when none).
    #[serde(with = "float_json")]
    pub max_abs_grad: f64,
    /// Zeros (±0) of the unscaled gradient / `numel` (0 for an empty parameter).
    #[serde(with = "float_json")]
    pub zero_frac: f64,
    /// Of the finite nonzero unscaled gradient values, the share that rounding to fp16
    /// would flush to zero (0 when there are none).
    #[serde(with = "float_json")]
    pub f16_underflow_frac_unscaled: f64,
    /// Of the same values, the share whose scaled value (`g * scale`, computed in f32)
    /// would be zero in fp16: what the loss scale failed to rescue.
    #[serde(with = "float_json")]
    pub f16_underflow_frac_scaled: f64,
    /// NaN and ±inf values in the unscaled gradient.
    pub nonfinite: u64,
    /// Largest `|p|` over the non-NaN parameter values after the step (inf if any is
    /// infinite; 0 when none).
    #[serde(with = "float_json")]
    pub param_max_abs_after: f64,
}

impl ParamRecord {
    /// Builds the record of parameter `name` from its unscaled gradient, the loss scale
    /// used in the step, and its values after the update. The fractions are defined on
    /// the fields; none is NaN.
    pub fn from_grad(
        name: &str,
        dtype: DType,
        grad_dtype: DType,
        unscaled_grad: &[f32],
        scale: f32,
        param_after: &[f32],
    ) -> Self {
        let g = TensorStats::compute(grad_dtype, unscaled_grad);
        let nonzero = g.finite_nonzero();
        let frac = |n: u64, d: u64| if d == 0 { 0.0 } else { n as f64 / d as f64 };
        let p = TensorStats::compute(dtype, param_after);
        ParamRecord {
            name: name.to_string(),
            dtype,
            grad_dtype: Some(grad_dtype),
            numel: g.numel,
            grad_l2: g.l2(),
            max_abs_grad: g.max_abs,
            zero_frac: frac(g.zeros, g.numel),
            f16_underflow_frac_unscaled: frac(g.to_f16.underflow, nonzero),
            f16_underflow_frac_scaled: frac(scaled_f16_flushes(unscaled_grad, scale), nonzero),
            nonfinite: g.nonfinite(),
            param_max_abs_after: if p.has_inf() {
                f64::INFINITY
            } else {
                p.max_abs
            },
        }
    }
}

/// Finite nonzero values `g` for which `g * scale` (in f32) is zero in fp16: at most 2^-25
/// in magnitude (the tie rounds to zero), or zero already in f32.
fn scaled_f16_flushes(grad: &[f32], scale: f32) -> u64 {
    const FLUSH: u32 = 0x3300_0000; // 2^-25
    let count = |c: &[f32]| -> u64 {
        c.iter()
            .map(|&g| {
                let a = g.to_bits() & 0x7fff_ffff;
                let s = (g * scale).to_bits() & 0x7fff_ffff;
                (a != 0 && a < 0x7f80_0000 && s <= FLUSH) as u64
            })
            .sum()
    };
    if grad.len() < 64 * 1024 {
        count(grad)
    } else {
        grad.par_chunks(16 * 1024).map(count).sum()
    }
}

/// One optimizer step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct StepRecord {
    /// Step number (0-based).
    pub step: u64,
    /// Micro-batches accumulated in the step.
    pub micro_batches: u32,
    /// Unscaled loss (mean over micro-batches); `None` when not computed.
    #[serde(with = "float_json::option", default)]
    pub loss: Option<f64>,
    /// Loss times the loss scale, as backpropagated; `None` without a scaler.
    #[serde(with = "float_json::option", default)]
    pub scaled_loss: Option<f64>,
    /// Loss scale used for this step's backward.
    #[serde(with = "float_json")]
    pub scale_before: f64,
    /// Loss scale after the scaler's update.
    #[serde(with = "float_json")]
    pub scale_after: f64,
    /// The scaler found an inf/NaN in the gradients.
    pub found_inf: bool,
    /// The optimizer step was skipped.
    pub skipped: bool,
    /// Scaler's count of consecutive finite steps since the last scale change.
    pub growth_tracker: i64,
    /// Total L2 norm of the unscaled gradients (as gradient clipping computes it); `None`
    /// when not computed.
    #[serde(with = "float_json::option", default)]
    pub grad_norm: Option<f64>,
    /// Clipping coefficient applied (≤ 1); `None` when clipping is off.
    #[serde(with = "float_json::option", default)]
    pub clip_coef: Option<f64>,
    /// Learning rate of the step.
    #[serde(with = "float_json")]
    pub lr: f64,
    /// Number of values rounded when weights were cast to the autocast dtype.
    pub weight_casts: u64,
    /// Where non-finite values came from.
    pub origins: Origins,
    /// Per-parameter statistics.
    pub params: Vec<ParamRecord>,
    /// Full op records: present for sampled steps and steps with a non-finite value.
    #[serde(default)]
    pub ops: Option<Vec<OpRecord>>,
    /// Number of ops executed in the step.
    pub op_count: u64,
    /// Notable events (scaler collapse, warnings), as sentences.
    pub events: Vec<String>,
    /// Wall-clock time of the step, milliseconds.
    #[serde(with = "float_json")]
    pub wall_ms: f64,
    /// Why the step was skipped, for skipped steps the diagnosis classified (`None`
    /// otherwise, and in traces written before the field existed). Boxed: most steps
    /// have none.
    #[serde(default)]
    pub skip_cause: Option<Box<crate::diagnose::cause::SkipCause>>,
}

/// Last record of a run that finished.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct EndRecord {
    /// Steps run.
    pub steps: u64,
    /// One-line verdict of the run.
    pub verdict: String,
    /// Wall-clock time of the whole run, milliseconds.
    #[serde(with = "float_json")]
    pub wall_ms: f64,
}

/// Serde helpers that write an `f64` as a JSON number when finite and as the string
/// `"NaN"`, `"inf"` or `"-inf"` otherwise (JSON has no non-finite numbers). Reading
/// accepts numbers and those strings (also `"nan"`, `"+inf"`, `"Infinity"`,
/// `"-Infinity"`).
pub mod float_json {
    use serde::de::{self, Deserializer, Visitor};
    use serde::Serializer;
    use std::fmt;

    /// Writes one `f64`.
    pub fn serialize<S: Serializer>(x: &f64, s: S) -> Result<S::Ok, S::Error> {
        if x.is_finite() {
            s.serialize_f64(*x)
        } else if x.is_nan() {
            s.serialize_str("NaN")
        } else if *x > 0.0 {
            s.serialize_str("inf")
        } else {
            s.serialize_str("-inf")
        }
    }

    /// Reads one `f64`.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
        d.deserialize_any(F64Visitor)
    }

    struct F64Visitor;

    impl Visitor<'_> for F64Visitor {
        type Value = f64;

        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a number or one of \"NaN\", \"inf\", \"-inf\"")
        }
        fn visit_f64<E: de::Error>(self, v: f64) -> Result<f64, E> {
            Ok(v)
        }
        fn visit_i64<E: de::Error>(self, v: i64) -> Result<f64, E> {
            Ok(v as f64)
        }
        fn visit_u64<E: de::Error>(self, v: u64) -> Result<f64, E> {
            Ok(v as f64)
        }
        fn visit_str<E: de::Error>(self, v: &str) -> Result<f64, E> {
            match v {
                "NaN" | "nan" => Ok(f64::NAN),
                "inf" | "+inf" | "Infinity" | "+Infinity" => Ok(f64::INFINITY),
                "-inf" | "-Infinity" => Ok(f64::NEG_INFINITY),
                _ => Err(E::invalid_value(de::Unexpected::Str(v), &self)),
            }
        }
    }

    /// The same for `Option<f64>` (`None` is `null`).
    pub mod option {
        use super::*;

        /// Writes one `Option<f64>`.
        pub fn serialize<S: Serializer>(x: &Option<f64>, s: S) -> Result<S::Ok, S::Error> {
            match x {
                Some(v) => super::serialize(v, s),
                None => s.serialize_none(),
            }
        }

        /// Reads one `Option<f64>`.
        pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<f64>, D::Error> {
            d.deserialize_option(OptVisitor)
        }

        struct OptVisitor;

        impl<'de> Visitor<'de> for OptVisitor {
            type Value = Option<f64>;

            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("null, a number or one of \"NaN\", \"inf\", \"-inf\"")
            }
            fn visit_none<E: de::Error>(self) -> Result<Option<f64>, E> {
                Ok(None)
            }
            fn visit_unit<E: de::Error>(self) -> Result<Option<f64>, E> {
                Ok(None)
            }
            fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Option<f64>, D::Error> {
                super::deserialize(d).map(Some)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_json_shape() {
        let end = Record::End(EndRecord {
            steps: 3,
            verdict: "ok".into(),
            wall_ms: 1.5,
        });
        let s = serde_json::to_string(&end).unwrap();
        assert_eq!(
            s,
            r#"{"type":"end","steps":3,"verdict":"ok","wall_ms":1.5}"#
        );
        let back: Record = serde_json::from_str(&s).unwrap();
        assert_eq!(back, end);
        let ph = serde_json::to_string(&Phase::Backward).unwrap();
        assert_eq!(ph, r#""backward""#);
    }

    #[test]
    fn nonfinite_floats_round_trip() {
        let step = StepRecord {
            loss: Some(f64::NAN),
            scaled_loss: Some(f64::INFINITY),
            grad_norm: Some(f64::NEG_INFINITY),
            clip_coef: None,
            scale_before: 65536.0,
            ..Default::default()
        };
        let s = serde_json::to_string(&Record::Step(step)).unwrap();
        assert!(s.contains(r#""loss":"NaN""#), "{s}");
        assert!(s.contains(r#""scaled_loss":"inf""#), "{s}");
        assert!(s.contains(r#""grad_norm":"-inf""#), "{s}");
        assert!(s.contains(r#""clip_coef":null"#), "{s}");
        let Record::Step(back) = serde_json::from_str(&s).unwrap() else {
            panic!("not a step: {s}");
        };
        assert!(back.loss.unwrap().is_nan());
        assert_eq!(back.scaled_loss, Some(f64::INFINITY));
        assert_eq!(back.grad_norm, Some(f64::NEG_INFINITY));
        assert_eq!(back.clip_coef, None);
        assert_eq!(back.scale_before, 65536.0);
        let bad = s.replace(r#""loss":"NaN""#, r#""loss":"huge""#);
        assert!(serde_json::from_str::<Record>(&bad).is_err());
    }

    #[test]
    fn param_record_from_grad() {
        let t = 2f32.powi(-25);
        // Finite nonzero: 1e-3, 2^-25 (flushes), 2^-30 (flushes), -3.0, 2^-40 (flushes).
        let grad = [
            0.0f32,
            1e-3,
            t,
            2f32.powi(-30),
            -3.0,
            f32::NAN,
            -0.0,
            2f32.powi(-40),
        ];
        let r = ParamRecord::from_grad(
            "w",
            DType::F32,
            DType::F32,
            &grad,
            1024.0,
            &[1.0, -7.5, f32::NAN],
        );
        assert_eq!(r.numel, 8);
        assert_eq!(r.zero_frac, 2.0 / 8.0);
        assert_eq!(r.nonfinite, 1);
        assert_eq!(r.max_abs_grad, 3.0);
        let sq = 1e-3f32 as f64 * 1e-3f32 as f64
            + 2f64.powi(-50)
            + 2f64.powi(-60)
            + 9.0
            + 2f64.powi(-80);
        assert!((r.grad_l2 - sq.sqrt()).abs() <= 1e-15 * sq.sqrt());
        assert_eq!(r.f16_underflow_frac_unscaled, 3.0 / 5.0);
        // Scaled by 2^10: 2^-15 and 2^-20 are representable, 2^-30 still flushes.
        assert_eq!(r.f16_underflow_frac_scaled, 1.0 / 5.0);
        assert_eq!(r.param_max_abs_after, 7.5);
        let inf = ParamRecord::from_grad("b", DType::F16, DType::F16, &[], 1.0, &[f32::INFINITY]);
        assert_eq!(inf.param_max_abs_after, f64::INFINITY);
        assert_eq!(inf.zero_frac, 0.0);
        assert_eq!(inf.f16_underflow_frac_scaled, 0.0);
    }

    #[test]
    fn scaled_flush_counts_large_and_tie() {
        // 3 * 2^-27 * 4 = 3 * 2^-25 stays; 2^-27 * 4 = 2^-25 is the tie and flushes.
        let mut g = vec![2f32.powi(-27); 100_000];
        g[7] = 3.0 * 2f32.powi(-27);
        assert_eq!(scaled_f16_flushes(&g, 4.0), 99_999);
        // A scale that underflows f32 itself flushes everything.
        assert_eq!(scaled_f16_flushes(&[1e-30], 1e-20), 1);
        assert_eq!(scaled_f16_flushes(&[1e-3], f32::NAN), 0);
    }
}
