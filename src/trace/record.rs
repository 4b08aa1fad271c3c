//! The records of a trace file and their JSON form.

use super::stats::TensorStats;
use crate::dtype::{DType, RoundCounts};
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
    /// The backend that ran the step (`cpu`, `cuda`).
    pub backend: String,
    /// The name of the device that ran the step, when it was a GPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    /// The host's GEMM kernels (`fixed-order`, or `gemm-crate:` and the instruction set
    /// they ran with): whether products can differ from another machine's in their last
    /// bits (absent in traces of older builds and of the PyTorch companion).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_gemm: Option<String>,
    /// Random seed.
    pub seed: u64,
    /// Command line of the run, program name first.
    pub command_line: Vec<String>,
    /// The full resolved configuration.
    pub config: serde_json::Value,
    /// The folder the configuration's relative paths (weights, inputs) resolve against, so
    /// that the run can be reproduced from its trace (absent when unknown).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_dir: Option<std::path::PathBuf>,
    /// Where a trace captured outside amprobe came from (the PyTorch companion); absent in
    /// amprobe's own runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<Source>,
}

/// The `source` of a header written by the PyTorch companion: which process of which run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Source {
    /// What captured the run (`"pytorch"`).
    pub kind: String,
    /// The torch version, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub torch: Option<String>,
    /// This process's rank in torch.distributed (0 outside it).
    #[serde(default)]
    pub rank: u32,
    /// Processes in the run (1 outside torch.distributed).
    #[serde(default = "one")]
    pub world_size: u32,
    /// The companion's AMPROBE_SAMPLE_EVERY.
    #[serde(default)]
    pub sample_every: u64,
    /// An identifier all ranks of one launch share (torchrun's run id), when the writer
    /// knows one: rank traces of different runs are told apart by it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_id: Option<String>,
    /// Whether the watched model is a transformers `PreTrainedModel` (a fix is then a
    /// `_keep_in_fp32_modules` list), when the writer told.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transformers: Option<bool>,
    /// What the companion's discovery found, where it found the training itself (a script
    /// run by `amprobe run -- CMD` with no amprobe line); absent where `watch` was called.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub discovery: Option<Box<Discovery>>,
    /// The 16-bit precision the training library was asked for (Accelerate's and the HF
    /// Trainer's `mixed_precision`, Lightning's `precision`), where one was.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requested_precision: Option<RequestedPrecision>,
    /// The watched model's parts `torch.compile` compiled, and how they ran while watched.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compiled: Option<Box<Compiled>>,
}

/// What of the watched model `torch.compile` compiled.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Compiled {
    /// The compiled parts' module names (`""`: the model itself).
    pub regions: Vec<String>,
    /// `eager` (Dynamo's stance forced eager while watched) or `compiled`.
    pub ran: String,
}

/// What the companion's discovery found as the script made it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct Discovery {
    /// The classes of the models watched (the outermost modules holding the optimizers'
    /// parameters, their wrappers taken off).
    #[serde(default)]
    pub models: Vec<String>,
    /// The classes of the optimizers.
    #[serde(default)]
    pub optimizers: Vec<String>,
    /// The classes of every GradScaler made (a disabled one marked so).
    #[serde(default)]
    pub scalers: Vec<String>,
    /// The class of the scaler watched, if any.
    #[serde(default)]
    pub scaler: Option<String>,
    /// Where discovery was unsure: what it saw, and the line that settles it.
    #[serde(default)]
    pub note: Option<String>,
}

/// A precision a training library was asked for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestedPrecision {
    /// `fp16`, `bf16` or `fp8`.
    pub precision: String,
    /// Which library, and the setting that asked for it.
    pub by: String,
}

fn one() -> u32 {
    1
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
            device: None,
            host_gemm: None,
            seed: 0,
            command_line: Vec::new(),
            config: serde_json::Value::Null,
            config_dir: None,
            source: None,
        }
    }
}

impl Default for Header {
    fn default() -> Self {
        Header::new()
    }
}

/// The outcome of a run, from its records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Verdict {
    /// No Inf or NaN anywhere, no step skipped.
    Clean,
    /// Steps were skipped for gradient overflow; the forward pass stayed finite.
    OverflowSkips,
    /// An Inf or NaN originated in a forward pass.
    ForwardNonfinite,
    /// A parameter ended non-finite.
    Diverged,
}

impl Verdict {
    /// The kebab-case name (`clean`, `overflow-skips`, `forward-nonfinite`, `diverged`).
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Clean => "clean",
            Verdict::OverflowSkips => "overflow-skips",
            Verdict::ForwardNonfinite => "forward-nonfinite",
            Verdict::Diverged => "diverged",
        }
    }
}

/// A verdict equals its kebab-case name, so `summary.verdict == "clean"` reads naturally.
impl PartialEq<&str> for Verdict {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

impl std::fmt::Display for Verdict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
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

/// A module path as shown to people: `<root>` for the empty path (the model itself).
pub fn module_name(m: &str) -> &str {
    if m.is_empty() {
        "<root>"
    } else {
        m
    }
}

impl Phase {
    /// `forward`, `backward` or `optimizer`, as the trace writes it.
    pub fn name(self) -> &'static str {
        match self {
            Phase::Forward => "forward",
            Phase::Backward => "backward",
            Phase::Optimizer => "optimizer",
        }
    }
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
    /// The op makes or applies an additive attention mask (its dtype's lowest finite value
    /// where attention is masked): every -inf of its output is the mask's (counted in
    /// `masked_neg_inf`), and its values at the dtype's limit are the mask's.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub additive_mask: bool,
    /// Where the op's error against exact arithmetic came from (every op of a step run
    /// with `--blame`; absent otherwise).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub blame: Option<OpBlame>,
}

/// The blame of one op (forward or backward): relative errors of its output, each
/// `‖a − b‖₂ / ‖b‖₂` over the positions where both are finite.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct OpBlame {
    /// Against the op recomputed in f64 from its own inputs: what its own rounding and
    /// arithmetic introduce.
    #[serde(with = "float_json")]
    pub introduced: f64,
    /// The op recomputed from its own inputs against the all-f64 shadow of the step: the
    /// error its inputs carry in, as the op passes it on.
    #[serde(with = "float_json")]
    pub inherited: f64,
    /// The output against the shadow.
    #[serde(with = "float_json")]
    pub total: f64,
    /// The largest relative error of its floating inputs against their shadows.
    #[serde(with = "float_json")]
    pub input: f64,
}

impl OpBlame {
    /// How much the op magnifies the error its inputs carry (`inherited / input`): a
    /// norm-wise estimate of its relative condition number at these inputs (the pointwise
    /// one where the inputs' relative error is the same everywhere); `None` where the
    /// inputs carry none (or the op has no floating input).
    pub fn amplification(&self) -> Option<f64> {
        (self.input > 0.0 && self.input.is_finite()).then(|| self.inherited / self.input)
    }
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
    /// NaN parameter values after the step (absent in traces written before it was
    /// recorded: read as 0).
    #[serde(default)]
    pub param_nan_after: u64,
}

impl ParamRecord {
    /// Whether the parameter is finite after the step: no NaN and no infinity.
    pub fn finite_after(&self) -> bool {
        self.param_nan_after == 0 && self.param_max_abs_after.is_finite()
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
    pub skip_cause: Option<Box<SkipCause>>,
}

impl StepRecord {
    /// Whether every parameter is finite after this step (no NaN, no infinity): a run
    /// whose last step says otherwise diverged.
    pub fn params_finite(&self) -> bool {
        self.params.iter().all(ParamRecord::finite_after)
    }
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

/// The kind of cause of a skipped step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SkipKind {
    /// The loss scale pushed finite gradients out of the low dtype's range.
    ScaleTooHigh,
    /// A forward activation was non-finite before the backward pass.
    ForwardOverflow,
    /// A gradient overflows the low dtype even without loss scaling.
    BackwardOverflow,
    /// The step is non-finite in fp32 too.
    Divergence,
}

impl SkipKind {
    /// The kebab-case name (`scale-too-high`, ...).
    pub fn name(self) -> &'static str {
        match self {
            SkipKind::ScaleTooHigh => "scale-too-high",
            SkipKind::ForwardOverflow => "forward-overflow",
            SkipKind::BackwardOverflow => "backward-overflow",
            SkipKind::Divergence => "divergence",
        }
    }
}

impl std::fmt::Display for SkipKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The cause of one skipped step, with the evidence.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SkipCause {
    /// The kind of cause.
    pub kind: SkipKind,
    /// The op that went non-finite first: the forward origin (`forward-overflow`), the
    /// first backward op that overflowed (`scale-too-high`, `backward-overflow`), or the
    /// origin in the fp32 re-run (`divergence`; its step number is the step's).
    pub op: Option<OpRef>,
    /// For a backward `op`: the forward op it differentiates.
    pub forward_op: Option<OpRef>,
    /// Dtype of `op`'s output: the range that was left.
    pub dtype: Option<DType>,
    /// Loss scale the step used.
    #[serde(with = "float_json")]
    pub scale: f64,
    /// For a backward `op`: its largest `|g|` before scaling, measured in the re-run at
    /// scale 1 (`null` when that re-run overflowed too, or was not made).
    #[serde(with = "float_json::option", default)]
    pub unscaled_max_abs: Option<f64>,
    /// The largest power of two `s` with `unscaled_max_abs · s < max(dtype)`: the highest
    /// scale at which `op` would not have overflowed.
    #[serde(with = "float_json::option", default)]
    pub op_safe_scale: Option<f64>,
    /// The largest power of two at which every backward op of the step fits its dtype
    /// (`scale-too-high` only): an initial scale that would not have skipped this step.
    #[serde(with = "float_json::option", default)]
    pub safe_scale: Option<f64>,
    /// The backward op that bounds `safe_scale`.
    #[serde(default)]
    pub limiting_op: Option<OpRef>,
    /// Re-runs the classification used.
    pub replays: u32,
}

pub use super::float_json;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_parameter_is_finite_after_its_step_without_nan_or_infinity() {
        // Written before the NaN count was recorded: read as none.
        let json = r#"{"name":"w","dtype":"float32","grad_dtype":"float32","numel":4,"grad_l2":1.0,
            "max_abs_grad":1.0,"zero_frac":0.0,"f16_underflow_frac_unscaled":0.0,
            "f16_underflow_frac_scaled":0.0,"nonfinite":0,"param_max_abs_after":2.0}"#;
        let p: ParamRecord = serde_json::from_str(json).unwrap();
        assert_eq!(p.param_nan_after, 0);
        assert!(p.finite_after());
        let mut step = StepRecord {
            params: vec![p.clone(), p],
            ..StepRecord::default()
        };
        assert!(step.params_finite());
        // All NaN: the largest |p| over the non-NaN values is 0, and still it diverged.
        step.params[1].param_nan_after = 4;
        step.params[1].param_max_abs_after = 0.0;
        assert!(!step.params_finite());
        step.params[1].param_nan_after = 0;
        step.params[1].param_max_abs_after = f64::INFINITY;
        assert!(!step.params_finite());
    }

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
}
