//! Loss scaling: PyTorch's `torch.amp.GradScaler` with its exact arithmetic, plus the
//! scale policies of other frameworks (capped, hysteresis with a floor, fixed, disabled).
//!
//! The engine owns the tensors; the scaler sees gradients as `f32` slices tagged with
//! their dtype ([`GradView`]). One training step drives it in PyTorch's order:
//!
//! 1. [`GradScaler::scale_loss`] multiplies the loss by the scale before backward;
//! 2. optionally [`GradScaler::unscale_`] divides an optimizer's gradients by the scale
//!    (e.g. before gradient clipping) and records whether any was inf/NaN;
//! 3. [`GradScaler::should_step`] (or [`GradScaler::step`] with a closure) unscales if that
//!    has not happened yet and says whether the optimizer step must be skipped;
//! 4. [`GradScaler::update`] backs the scale off after an overflow or grows it after
//!    `growth_interval` clean steps, and reports a collapsing scale.
//!
//! Arithmetic follows ATen's CPU kernels: the inverse scale is `1/scale` computed in `f64`
//! and rounded to `f32`; each gradient element is multiplied by it in `f32` and rounded
//! once to the gradient's dtype; the inf/NaN check looks at the gradient *before* the
//! multiplication; the default policy multiplies the `f32` scale by an `f64` factor and
//! rounds the product to `f32`, refusing a growth that would round to infinity.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::dtype::{round_slice, DType, RoundCounts};
use crate::error::{Error, Result};

/// One gradient tensor as the scaler sees it: its name (for messages), its values and its
/// dtype. Values of an fp16/bf16 gradient are `f32` values exactly representable in that
/// dtype, and stay so after unscaling.
#[derive(Debug)]
pub struct GradView<'a> {
    /// Parameter name, used in warnings and errors.
    pub name: &'a str,
    /// The gradient values, unscaled in place.
    pub data: &'a mut [f32],
    /// The gradient's dtype: the result of unscaling is rounded to it.
    pub dtype: DType,
}

impl<'a> GradView<'a> {
    /// Wraps a gradient slice.
    pub fn new(name: &'a str, data: &'a mut [f32], dtype: DType) -> Self {
        GradView { name, data, dtype }
    }
}

/// How the scale evolves from step to step.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum ScalerKind {
    /// `torch.amp.GradScaler`: back off by `backoff_factor` on every overflow, grow by
    /// `growth_factor` after `growth_interval` consecutive clean steps, no lower bound.
    #[default]
    Default,
    /// insightface's `MaxClipGradScaler`: the default policy, but the scale never exceeds
    /// `max_scale` (a growth past it lands on `max_scale`, an initial or set scale above it
    /// is clipped to it). insightface hard-codes a growth factor of 2; here the configured
    /// `growth_factor` is used.
    MaxClip {
        /// Upper bound on the scale.
        #[serde(serialize_with = "crate::trace::float_json::f32_exact::serialize")]
        max_scale: f32,
    },
    /// Megatron-LM's `DynamicGradScaler`: an overflow decrements a hysteresis counter and
    /// the scale backs off only once the counter is at or below 0 (and then on every
    /// further overflow), never below `min_scale`; `growth_interval` consecutive clean steps
    /// reset the counter to `hysteresis` and grow the scale. Scale arithmetic is in `f32`
    /// with the factors rounded to `f32`, as Megatron keeps them in `f32` tensors.
    Hysteresis {
        /// Overflows tolerated before the first backoff (Megatron's `hysteresis`, >= 1).
        hysteresis: u32,
        /// Lower bound on the scale (> 0, at most `init_scale`).
        #[serde(serialize_with = "crate::trace::float_json::f32_exact::serialize")]
        min_scale: f32,
        /// DeepSpeed's `raise_error_at_min_scale`: an overflow that calls for a backoff
        /// while the scale is already at `min_scale` makes [`GradScaler::update`] fail.
        error_at_floor: bool,
    },
    /// A constant scale (Megatron's `ConstantGradScaler`, apex's static loss scale): steps
    /// with inf/NaN gradients are still skipped, the scale never changes by itself.
    Fixed,
    /// No loss scaling: scale 1, no inf/NaN checks, no step is ever skipped.
    None,
}

impl ScalerKind {
    /// Short name of the kind, as written in configs (`default`, `max_clip`, ...).
    pub fn name(&self) -> &'static str {
        match self {
            ScalerKind::Default => "default",
            ScalerKind::MaxClip { .. } => "max_clip",
            ScalerKind::Hysteresis { .. } => "hysteresis",
            ScalerKind::Fixed => "fixed",
            ScalerKind::None => "none",
        }
    }
}

/// Loss scaler configuration. `Default` gives PyTorch's defaults: init scale 65536,
/// growth factor 2, backoff factor 0.5, growth interval 2000, enabled.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ScalerConfig {
    /// The scale policy.
    pub kind: ScalerKind,
    /// `false` disables scaling exactly like `GradScaler(enabled=False)` (same as kind `none`).
    pub enabled: bool,
    /// Initial scale (finite, > 0), stored as `f32` like PyTorch's scale tensor.
    #[serde(serialize_with = "crate::trace::float_json::f32_exact::serialize")]
    pub init_scale: f32,
    /// Multiplier applied after `growth_interval` clean steps (> 1).
    pub growth_factor: f64,
    /// Multiplier applied after an overflow (strictly between 0 and 1).
    pub backoff_factor: f64,
    /// Consecutive clean steps before the scale grows (1 ..= i32::MAX).
    pub growth_interval: u32,
    /// Report a collapse once the scale has fallen on this many consecutive updates
    /// (0 turns that check off).
    pub collapse_streak: u32,
    /// Refuse fp16 gradients in unscaling as PyTorch does (`ValueError: Attempting to
    /// unscale FP16 gradients.`). Off by default because pure-fp16 training needs it;
    /// the scaler then records a warning instead.
    pub reject_fp16_grads: bool,
}

impl Default for ScalerConfig {
    fn default() -> Self {
        ScalerConfig {
            kind: ScalerKind::Default,
            enabled: true,
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            collapse_streak: 8,
            reject_fp16_grads: false,
        }
    }
}

fn cfg_err(field: &str, message: String) -> Error {
    Error::config(format!("scaler.{field}"), message)
}

fn check_factors(growth_factor: f64, backoff_factor: f64, growth_interval: u32) -> Result<()> {
    if !(growth_factor.is_finite() && growth_factor > 1.0) {
        return Err(cfg_err(
            "growth_factor",
            format!("expected a finite number > 1, got {growth_factor}"),
        ));
    }
    if !(backoff_factor > 0.0 && backoff_factor < 1.0) {
        return Err(cfg_err(
            "backoff_factor",
            format!("expected a number strictly between 0 and 1, got {backoff_factor}"),
        ));
    }
    if growth_interval == 0 || growth_interval > i32::MAX as u32 {
        return Err(cfg_err(
            "growth_interval",
            format!(
                "expected an integer in 1..={}, got {growth_interval}",
                i32::MAX
            ),
        ));
    }
    Ok(())
}

fn check_kind(kind: &ScalerKind, init_scale: f32) -> Result<()> {
    match *kind {
        ScalerKind::MaxClip { max_scale } => {
            if !(max_scale.is_finite() && max_scale > 0.0) {
                return Err(cfg_err(
                    "kind.max_scale",
                    format!("expected a finite number > 0, got {max_scale}"),
                ));
            }
        }
        ScalerKind::Hysteresis {
            hysteresis,
            min_scale,
            ..
        } => {
            if hysteresis == 0 || hysteresis > i32::MAX as u32 {
                return Err(cfg_err(
                    "kind.hysteresis",
                    format!("expected an integer in 1..={}, got {hysteresis}", i32::MAX),
                ));
            }
            if !(min_scale.is_finite() && min_scale > 0.0) {
                return Err(cfg_err(
                    "kind.min_scale",
                    format!("expected a finite number > 0, got {min_scale}"),
                ));
            }
            if min_scale > init_scale {
                return Err(cfg_err(
                    "kind.min_scale",
                    format!("min_scale {min_scale} is above init_scale {init_scale}"),
                ));
            }
        }
        ScalerKind::Default | ScalerKind::Fixed | ScalerKind::None => {}
    }
    Ok(())
}

impl ScalerConfig {
    /// Checks every field and names the first bad one.
    pub fn validate(&self) -> Result<()> {
        if !(self.init_scale.is_finite() && self.init_scale > 0.0) {
            return Err(cfg_err(
                "init_scale",
                format!("expected a finite number > 0, got {}", self.init_scale),
            ));
        }
        check_factors(
            self.growth_factor,
            self.backoff_factor,
            self.growth_interval,
        )?;
        check_kind(&self.kind, self.init_scale)
    }

    /// True when the configuration scales at all (enabled and kind not `none`).
    pub fn is_enabled(&self) -> bool {
        self.enabled && self.kind != ScalerKind::None
    }
}

/// Where one optimizer is within the current step (PyTorch's `OptState`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Stage {
    /// Gradients still scaled; nothing done since the last update.
    Ready,
    /// Gradients unscaled and checked for inf/NaN.
    Unscaled,
    /// The step decision has been taken.
    Stepped,
}

#[derive(Debug, Clone, Copy)]
struct OptRecord {
    stage: Stage,
    /// None: no gradient was checked (PyTorch's empty `found_inf_per_device`).
    found_inf: Option<bool>,
    rounding: RoundCounts,
}

impl Default for OptRecord {
    fn default() -> Self {
        OptRecord {
            stage: Stage::Ready,
            found_inf: None,
            rounding: RoundCounts::default(),
        }
    }
}

/// What [`GradScaler::should_step`] decided for one optimizer.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct StepDecision {
    /// Skip the optimizer step (an inf/NaN gradient was found and scaling is enabled).
    pub skip: bool,
    /// Some gradient of this optimizer was inf/NaN before unscaling (always false when
    /// scaling is disabled, as nothing is checked).
    pub found_inf: bool,
    /// This call unscaled the gradients (false when `unscale_` had already done it).
    pub unscaled_here: bool,
    /// The inverse scale the gradients were multiplied by (1 when disabled).
    #[serde(serialize_with = "crate::trace::float_json::f32_exact::serialize")]
    pub inv_scale: f32,
}

/// Signs that the loss scale has collapsed, reported by [`GradScaler::update`].
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Collapse {
    /// The scale after the update.
    #[serde(serialize_with = "crate::trace::float_json::f32_exact::serialize")]
    pub scale: f32,
    /// The scale is below 1: the loss is shrunk, so scaling now causes underflow.
    pub below_one: bool,
    /// The scale is 0: the loss and every gradient become 0, and unscaling multiplies
    /// by an infinite inverse scale.
    pub zero: bool,
    /// `1/scale` overflows `f32` (scale <= 2^-128): unscaling turns every finite gradient
    /// into ±inf or NaN *after* the inf check, so the optimizer step is not skipped and
    /// writes inf/NaN into the weights.
    pub inv_scale_infinite: bool,
    /// Number of consecutive updates, ending with this one, that lowered the scale.
    pub falling_streak: u32,
    /// `falling_streak` reached the configured `collapse_streak`.
    pub streak_alarm: bool,
}

impl fmt::Display for Collapse {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "loss scale {:e}", self.scale)?;
        if self.zero {
            write!(f, " is 0")?;
        } else if self.below_one {
            write!(f, " is below 1")?;
        }
        if self.inv_scale_infinite {
            write!(
                f,
                "; 1/scale overflows f32, unscaled gradients become inf/NaN unchecked"
            )?;
        }
        if self.streak_alarm {
            write!(f, "; fell on {} consecutive updates", self.falling_streak)?;
        }
        Ok(())
    }
}

/// What one [`GradScaler::update`] did.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct UpdateOutcome {
    /// Scale before the update.
    #[serde(serialize_with = "crate::trace::float_json::f32_exact::serialize")]
    pub scale_before: f32,
    /// Scale after the update.
    #[serde(serialize_with = "crate::trace::float_json::f32_exact::serialize")]
    pub scale_after: f32,
    /// Any optimizer found an inf/NaN gradient in this step.
    pub found_inf: bool,
    /// Consecutive clean steps counted towards the next growth, after the update.
    pub growth_tracker: i32,
    /// Hysteresis counter after the update (kind `hysteresis` only).
    pub hysteresis_tracker: Option<i32>,
    /// Set when the scale is collapsing (see [`Collapse`]).
    pub collapse: Option<Collapse>,
}

/// Everything needed to resume a scaler exactly: PyTorch's `state_dict` fields plus the
/// kind and its state. A PyTorch state dict (`scale`, `growth_factor`, `backoff_factor`,
/// `growth_interval`, `_growth_tracker`) deserializes into it as kind `default`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScalerState {
    /// The scale policy.
    #[serde(default)]
    pub kind: ScalerKind,
    /// Whether the scaler that saved this was enabled.
    #[serde(default = "enabled_default")]
    pub enabled: bool,
    /// Current scale.
    #[serde(serialize_with = "crate::trace::float_json::f32_exact::serialize")]
    pub scale: f32,
    /// Growth factor.
    pub growth_factor: f64,
    /// Backoff factor.
    pub backoff_factor: f64,
    /// Growth interval.
    pub growth_interval: u32,
    /// Consecutive clean steps since the last growth or overflow.
    #[serde(alias = "_growth_tracker")]
    pub growth_tracker: i32,
    /// Hysteresis counter (kind `hysteresis`; absent means "full").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hysteresis_tracker: Option<i32>,
    /// Consecutive updates that lowered the scale (collapse detection).
    #[serde(default)]
    pub falling_streak: u32,
}

fn enabled_default() -> bool {
    true
}

/// Gradient scaler with PyTorch's semantics and state machine. One scaler serves any
/// number of optimizers, identified by a `usize` the engine chooses.
#[derive(Debug, Clone)]
pub struct GradScaler {
    cfg: ScalerConfig,
    scale: f32,
    growth_tracker: i32,
    hysteresis_tracker: i32,
    falling_streak: u32,
    per_opt: BTreeMap<usize, OptRecord>,
    warnings: Vec<String>,
    warned_fp16: BTreeSet<usize>,
}

impl Default for GradScaler {
    /// A scaler with PyTorch's default configuration.
    fn default() -> Self {
        GradScaler::from_valid(ScalerConfig::default())
    }
}

/// Multiplies an `f32` scale by an `f64` factor and rounds once to `f32`, as ATen's
/// `_amp_update_scale_` does (`float * double` is evaluated in double).
fn mul_f64(scale: f32, factor: f64) -> f32 {
    (scale as f64 * factor) as f32
}

impl GradScaler {
    /// Builds a scaler after checking the configuration.
    pub fn new(cfg: ScalerConfig) -> Result<Self> {
        cfg.validate()?;
        Ok(GradScaler::from_valid(cfg))
    }

    fn from_valid(cfg: ScalerConfig) -> Self {
        let scale = match cfg.kind {
            ScalerKind::MaxClip { max_scale } => cfg.init_scale.min(max_scale),
            _ => cfg.init_scale,
        };
        let hysteresis_tracker = match cfg.kind {
            ScalerKind::Hysteresis { hysteresis, .. } => hysteresis as i32,
            _ => 0,
        };
        GradScaler {
            cfg,
            scale,
            growth_tracker: 0,
            hysteresis_tracker,
            falling_streak: 0,
            per_opt: BTreeMap::new(),
            warnings: Vec::new(),
            warned_fp16: BTreeSet::new(),
        }
    }

    /// The configuration (factors and interval as last set or loaded).
    pub fn config(&self) -> &ScalerConfig {
        &self.cfg
    }

    /// True when the scaler scales and checks gradients.
    pub fn is_enabled(&self) -> bool {
        self.cfg.is_enabled()
    }

    /// The current scale (1 when disabled, like PyTorch's `get_scale`).
    pub fn scale(&self) -> f32 {
        if self.is_enabled() {
            self.scale
        } else {
            1.0
        }
    }

    /// `1/scale` computed in `f64` and rounded to `f32`, as PyTorch's
    /// `scale.double().reciprocal().float()` (1 when disabled).
    pub fn inv_scale(&self) -> f32 {
        (1.0f64 / self.scale() as f64) as f32
    }

    /// Consecutive clean steps counted towards the next growth (0 when disabled).
    pub fn growth_tracker(&self) -> i32 {
        if self.is_enabled() {
            self.growth_tracker
        } else {
            0
        }
    }

    /// The hysteresis counter (kind `hysteresis` only).
    pub fn hysteresis_tracker(&self) -> Option<i32> {
        match self.cfg.kind {
            ScalerKind::Hysteresis { .. } if self.is_enabled() => Some(self.hysteresis_tracker),
            _ => None,
        }
    }

    /// Where `optimizer_id` is within the current step.
    pub fn stage(&self, optimizer_id: usize) -> Stage {
        self.per_opt
            .get(&optimizer_id)
            .map_or(Stage::Ready, |r| r.stage)
    }

    /// Values of `optimizer_id`'s gradients that overflowed to inf or flushed to zero when
    /// they were unscaled and rounded to their dtype in this step (None before unscaling).
    pub fn unscale_rounding(&self, optimizer_id: usize) -> Option<RoundCounts> {
        self.per_opt
            .get(&optimizer_id)
            .filter(|r| r.stage != Stage::Ready)
            .map(|r| r.rounding)
    }

    /// Things PyTorch would have refused or warned about but this scaler allowed
    /// (fp16 gradients), one line each, oldest first.
    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }

    /// Sets the growth factor (PyTorch's `set_growth_factor`, but checked: > 1).
    pub fn set_growth_factor(&mut self, factor: f64) -> Result<()> {
        check_factors(factor, self.cfg.backoff_factor, self.cfg.growth_interval)?;
        self.cfg.growth_factor = factor;
        Ok(())
    }

    /// Sets the backoff factor (PyTorch's `set_backoff_factor`, but checked: in (0, 1)).
    pub fn set_backoff_factor(&mut self, factor: f64) -> Result<()> {
        check_factors(self.cfg.growth_factor, factor, self.cfg.growth_interval)?;
        self.cfg.backoff_factor = factor;
        Ok(())
    }

    /// Sets the growth interval (PyTorch's `set_growth_interval`, but checked: >= 1).
    /// A growth tracker at or past the new interval restarts from 0, since an equality
    /// test could otherwise never fire again.
    pub fn set_growth_interval(&mut self, interval: u32) -> Result<()> {
        check_factors(self.cfg.growth_factor, self.cfg.backoff_factor, interval)?;
        self.cfg.growth_interval = interval;
        if self.growth_tracker >= interval as i32 {
            self.growth_tracker = 0;
        }
        Ok(())
    }

    /// Multiplies a loss by the scale in `f32` (PyTorch's `scaler.scale(loss)` for a
    /// 0-dim float32 loss, or a 0-dim fp16/bf16 one, which promotes to float32).
    /// Disabled: the loss unchanged.
    pub fn scale_loss(&self, loss: f32) -> f32 {
        if self.is_enabled() {
            loss * self.scale
        } else {
            loss
        }
    }

    /// Scales a non-scalar output tensor in place: each value times the scale in `f32`,
    /// rounded once to `dtype`. This is PyTorch's `scaler.scale(t)` for a tensor with at
    /// least one dimension, whose dtype wins over the 0-dim float32 scale. Disabled: no-op.
    pub fn scale_outputs(&self, data: &mut [f32], dtype: DType) -> RoundCounts {
        if !self.is_enabled() {
            return RoundCounts::default();
        }
        for x in data.iter_mut() {
            *x *= self.scale;
        }
        round_slice(dtype, data)
    }

    /// Unscales `optimizer_id`'s gradients in place and returns whether any was inf/NaN.
    ///
    /// Each element is checked for inf/NaN, then multiplied by [`GradScaler::inv_scale`]
    /// in `f32` and rounded once to its gradient's dtype. Errors, as in PyTorch, when this
    /// optimizer was already unscaled or stepped since the last update; also for integer
    /// gradients, and for fp16 gradients when `reject_fp16_grads` is set. On error no
    /// gradient is touched. Disabled: no-op returning `false`.
    pub fn unscale_(&mut self, optimizer_id: usize, grads: &mut [GradView<'_>]) -> Result<bool> {
        if !self.is_enabled() {
            return Ok(false);
        }
        let named: Vec<(&str, DType)> = grads.iter().map(|g| (g.name, g.dtype)).collect();
        self.check_unscale(optimizer_id, &named)?;
        let inv = self.inv_scale();
        let mut found_inf = false;
        let mut rounding = RoundCounts::default();
        for g in grads.iter_mut() {
            found_inf |= unscale_slice(g.data, g.dtype, inv, &mut rounding);
        }
        self.mark_unscaled(optimizer_id, !grads.is_empty(), found_inf, rounding);
        Ok(found_inf)
    }

    /// [`GradScaler::unscale_`] for gradients that were unscaled elsewhere (on a device,
    /// by the same arithmetic): the same checks and warnings on their names and dtypes,
    /// then the inf check's outcome and the unscale's rounding counts as that device
    /// reported them. Disabled: no-op returning `false`.
    pub fn unscaled_elsewhere(
        &mut self,
        optimizer_id: usize,
        grads: &[(&str, DType)],
        found_inf: bool,
        rounding: RoundCounts,
    ) -> Result<bool> {
        if !self.is_enabled() {
            return Ok(false);
        }
        self.check_unscale(optimizer_id, grads)?;
        self.mark_unscaled(optimizer_id, !grads.is_empty(), found_inf, rounding);
        Ok(found_inf)
    }

    /// The checks before an unscale: the optimizer's stage, float dtypes, fp16 gradients
    /// (refused or warned about once).
    fn check_unscale(&mut self, optimizer_id: usize, grads: &[(&str, DType)]) -> Result<()> {
        match self.stage(optimizer_id) {
            Stage::Unscaled => {
                return Err(Error::Scaler(format!(
                    "unscale_() has already been called on this optimizer since the last \
                     update() (optimizer {optimizer_id})"
                )))
            }
            Stage::Stepped => {
                return Err(Error::Scaler(format!(
                    "unscale_() is being called after step() (optimizer {optimizer_id})"
                )))
            }
            Stage::Ready => {}
        }
        let mut first_fp16: Option<&str> = None;
        for &(name, dtype) in grads {
            if !dtype.is_float() {
                return Err(Error::tensor(
                    name,
                    format!(
                        "gradient of dtype {dtype} cannot be unscaled; expected a floating dtype"
                    ),
                ));
            }
            if dtype == DType::F16 {
                if self.cfg.reject_fp16_grads {
                    return Err(Error::tensor(
                        name,
                        "Attempting to unscale FP16 gradients (reject_fp16_grads is set, as \
                         in PyTorch); keep fp32 master gradients or unset reject_fp16_grads",
                    ));
                }
                first_fp16.get_or_insert(name);
            }
        }
        if let Some(name) = first_fp16 {
            if self.warned_fp16.insert(optimizer_id) {
                self.warnings.push(format!(
                    "optimizer {optimizer_id}: unscaling float16 gradients (first: `{name}`); \
                     PyTorch's GradScaler refuses this with \"Attempting to unscale FP16 \
                     gradients.\""
                ));
            }
        }
        Ok(())
    }

    fn mark_unscaled(
        &mut self,
        optimizer_id: usize,
        any: bool,
        found_inf: bool,
        rounding: RoundCounts,
    ) {
        let rec = self.per_opt.entry(optimizer_id).or_default();
        rec.found_inf = any.then_some(found_inf);
        rec.rounding = rounding;
        rec.stage = Stage::Unscaled;
    }

    /// Takes the step decision for `optimizer_id`, as PyTorch's `scaler.step(optimizer)`
    /// does before calling `optimizer.step()`: unscales `grads` unless `unscale_` already
    /// did this step (then `grads` is not looked at), and asks to skip the step when any
    /// gradient was inf/NaN. The optimizer counts as stepped from here on; apply the step
    /// yourself when `skip` is false. Errors when this optimizer was already stepped since
    /// the last update, or when it has no gradients ("no inf checks were recorded").
    /// Disabled: never skips and checks nothing.
    pub fn should_step(
        &mut self,
        optimizer_id: usize,
        grads: &mut [GradView<'_>],
    ) -> Result<StepDecision> {
        let decision = self.prepare_step(optimizer_id, grads)?;
        self.mark_stepped(optimizer_id);
        Ok(decision)
    }

    /// [`GradScaler::should_step`] with the optimizer step as a closure: `apply` receives
    /// the unscaled gradients and runs only when the step is not skipped. Returns
    /// `Ok(None)` for a skipped step. If `apply` fails, its error is returned and the
    /// optimizer stays unscaled-but-not-stepped, as when `optimizer.step()` raises inside
    /// PyTorch's `scaler.step`.
    pub fn step<'a, R>(
        &mut self,
        optimizer_id: usize,
        grads: &mut [GradView<'a>],
        apply: impl FnOnce(&mut [GradView<'a>]) -> Result<R>,
    ) -> Result<Option<R>> {
        let decision = self.prepare_step(optimizer_id, grads)?;
        let out = if decision.skip {
            None
        } else {
            Some(apply(grads)?)
        };
        self.mark_stepped(optimizer_id);
        Ok(out)
    }

    fn prepare_step(
        &mut self,
        optimizer_id: usize,
        grads: &mut [GradView<'_>],
    ) -> Result<StepDecision> {
        if !self.is_enabled() {
            return Ok(StepDecision {
                skip: false,
                found_inf: false,
                unscaled_here: false,
                inv_scale: 1.0,
            });
        }
        let stage = self.stage(optimizer_id);
        if stage == Stage::Stepped {
            return Err(Error::Scaler(format!(
                "step() has already been called since the last update() (optimizer {optimizer_id})"
            )));
        }
        let unscaled_here = stage == Stage::Ready;
        if unscaled_here {
            self.unscale_(optimizer_id, grads)?;
        }
        let found_inf = self
            .per_opt
            .get(&optimizer_id)
            .and_then(|r| r.found_inf)
            .ok_or_else(|| {
                Error::Scaler(format!(
                    "no inf checks were recorded for this optimizer (optimizer {optimizer_id} \
                     has no gradients)"
                ))
            })?;
        Ok(StepDecision {
            skip: found_inf,
            found_inf,
            unscaled_here,
            inv_scale: self.inv_scale(),
        })
    }

    fn mark_stepped(&mut self, optimizer_id: usize) {
        if self.is_enabled() {
            self.per_opt.entry(optimizer_id).or_default().stage = Stage::Stepped;
        }
    }

    /// Ends the step: with `Some(s)`, sets the scale to `s` (growth tracker kept, as in
    /// PyTorch; clipped to `max_scale` for kind `max_clip`); with `None`, applies the
    /// kind's policy to "did any optimizer find inf/NaN this step". Then forgets every
    /// optimizer's per-step state.
    ///
    /// Errors, leaving all state unchanged: `None` while no optimizer has been unscaled
    /// this step ("no inf checks were recorded"); `Some(s)` with `s` negative, NaN or
    /// infinite (PyTorch would store it); kind `hysteresis` with `error_at_floor` when an
    /// overflow calls for a backoff at `min_scale`. Disabled: nothing to do.
    pub fn update(&mut self, new_scale: Option<f32>) -> Result<UpdateOutcome> {
        if !self.is_enabled() {
            return Ok(UpdateOutcome {
                scale_before: 1.0,
                scale_after: 1.0,
                found_inf: false,
                growth_tracker: 0,
                hysteresis_tracker: None,
                collapse: None,
            });
        }
        let scale_before = self.scale;
        let recorded: Vec<bool> = self.per_opt.values().filter_map(|r| r.found_inf).collect();
        let found_inf = recorded.iter().any(|&f| f);
        match new_scale {
            Some(s) => {
                if !(s.is_finite() && s >= 0.0) {
                    return Err(Error::Scaler(format!(
                        "update(new_scale={s}): expected a finite scale >= 0"
                    )));
                }
                self.scale = match self.cfg.kind {
                    ScalerKind::MaxClip { max_scale } => s.min(max_scale),
                    _ => s,
                };
            }
            None => {
                if recorded.is_empty() {
                    return Err(Error::Scaler(
                        "no inf checks were recorded prior to update(): call unscale_() or \
                         should_step() for at least one optimizer with gradients first"
                            .into(),
                    ));
                }
                self.apply_policy(found_inf)?;
            }
        }
        self.per_opt.clear();

        if self.scale < scale_before {
            self.falling_streak = self.falling_streak.saturating_add(1);
        } else {
            self.falling_streak = 0;
        }
        Ok(UpdateOutcome {
            scale_before,
            scale_after: self.scale,
            found_inf,
            growth_tracker: self.growth_tracker,
            hysteresis_tracker: self.hysteresis_tracker(),
            collapse: self.collapse(),
        })
    }

    fn apply_policy(&mut self, found_inf: bool) -> Result<()> {
        let (gf, bf, interval) = (
            self.cfg.growth_factor,
            self.cfg.backoff_factor,
            self.cfg.growth_interval as i32,
        );
        match self.cfg.kind {
            ScalerKind::Default | ScalerKind::MaxClip { .. } => {
                let cap = match self.cfg.kind {
                    ScalerKind::MaxClip { max_scale } => max_scale,
                    _ => f32::INFINITY,
                };
                if found_inf {
                    self.scale = mul_f64(self.scale, bf);
                    self.growth_tracker = 0;
                } else if self.growth_tracker + 1 == interval {
                    let grown = mul_f64(self.scale, gf);
                    if grown.is_finite() {
                        self.scale = grown.min(cap);
                    }
                    self.growth_tracker = 0;
                } else {
                    self.growth_tracker += 1;
                }
            }
            ScalerKind::Hysteresis {
                hysteresis,
                min_scale,
                error_at_floor,
            } => {
                if found_inf {
                    let h = self.hysteresis_tracker.saturating_sub(1);
                    if h <= 0 {
                        if error_at_floor && self.scale <= min_scale {
                            return Err(Error::Scaler(format!(
                                "overflow with the loss scale already at its minimum \
                                 {min_scale:e} (kind hysteresis, error_at_floor): cannot back \
                                 off further"
                            )));
                        }
                        self.scale = (self.scale * bf as f32).max(min_scale);
                    }
                    self.hysteresis_tracker = h;
                    self.growth_tracker = 0;
                } else {
                    self.growth_tracker += 1;
                    if self.growth_tracker == interval {
                        self.growth_tracker = 0;
                        self.hysteresis_tracker = hysteresis as i32;
                        // Megatron grows unchecked; keep PyTorch's guard against reaching inf.
                        let grown = self.scale * gf as f32;
                        if grown.is_finite() {
                            self.scale = grown;
                        }
                    }
                }
            }
            ScalerKind::Fixed | ScalerKind::None => {}
        }
        Ok(())
    }

    fn collapse(&self) -> Option<Collapse> {
        let s = self.scale;
        let k = self.cfg.collapse_streak;
        let c = Collapse {
            scale: s,
            below_one: s < 1.0,
            zero: s == 0.0,
            inv_scale_infinite: !self.inv_scale().is_finite(),
            falling_streak: self.falling_streak,
            streak_alarm: k > 0 && self.falling_streak >= k,
        };
        (c.below_one || c.zero || c.inv_scale_infinite || c.streak_alarm).then_some(c)
    }

    /// The state to checkpoint (take it after `update`, as PyTorch advises).
    pub fn state(&self) -> ScalerState {
        ScalerState {
            kind: self.cfg.kind,
            enabled: self.is_enabled(),
            scale: self.scale(),
            growth_factor: self.cfg.growth_factor,
            backoff_factor: self.cfg.backoff_factor,
            growth_interval: self.cfg.growth_interval,
            growth_tracker: self.growth_tracker(),
            hysteresis_tracker: self.hysteresis_tracker(),
            falling_streak: self.falling_streak,
        }
    }

    /// Restores a checkpointed state: scale, factors, interval, trackers. As in PyTorch a
    /// disabled scaler ignores it, and a state saved by a disabled scaler is refused. The
    /// state's kind must be the same policy as this scaler's (its parameters are taken from
    /// the state). Per-optimizer step state is left as it is.
    pub fn load_state(&mut self, state: ScalerState) -> Result<()> {
        if !self.is_enabled() {
            return Ok(());
        }
        if !state.enabled || state.kind == ScalerKind::None {
            return Err(Error::Scaler(
                "the source state is from a disabled scaler; it holds no scale to restore".into(),
            ));
        }
        if std::mem::discriminant(&state.kind) != std::mem::discriminant(&self.cfg.kind) {
            return Err(Error::Scaler(format!(
                "the source state is from a `{}` scaler, this scaler is `{}`",
                state.kind.name(),
                self.cfg.kind.name()
            )));
        }
        if !(state.scale.is_finite() && state.scale >= 0.0) {
            return Err(cfg_err(
                "state.scale",
                format!("expected a finite scale >= 0, got {}", state.scale),
            ));
        }
        check_factors(
            state.growth_factor,
            state.backoff_factor,
            state.growth_interval,
        )?;
        check_kind(&state.kind, f32::INFINITY)?;
        if state.growth_tracker < 0 || state.growth_tracker >= state.growth_interval as i32 {
            return Err(cfg_err(
                "state.growth_tracker",
                format!(
                    "expected 0..{} (below growth_interval), got {}",
                    state.growth_interval, state.growth_tracker
                ),
            ));
        }
        let hysteresis_tracker = match state.kind {
            ScalerKind::Hysteresis { hysteresis, .. } => {
                let h = state.hysteresis_tracker.unwrap_or(hysteresis as i32);
                if h > hysteresis as i32 {
                    return Err(cfg_err(
                        "state.hysteresis_tracker",
                        format!("expected at most hysteresis = {hysteresis}, got {h}"),
                    ));
                }
                h
            }
            _ => 0,
        };
        self.cfg.kind = state.kind;
        self.cfg.growth_factor = state.growth_factor;
        self.cfg.backoff_factor = state.backoff_factor;
        self.cfg.growth_interval = state.growth_interval;
        self.scale = match state.kind {
            ScalerKind::MaxClip { max_scale } => state.scale.min(max_scale),
            _ => state.scale,
        };
        self.growth_tracker = state.growth_tracker;
        self.hysteresis_tracker = hysteresis_tracker;
        self.falling_streak = state.falling_streak;
        Ok(())
    }
}

/// Checks `data` for inf/NaN, multiplies it by `inv` in `f32`, rounds once to `dtype`, and
/// adds the values that overflowed or flushed to zero on the way to `rounding`.
fn unscale_slice(data: &mut [f32], dtype: DType, inv: f32, rounding: &mut RoundCounts) -> bool {
    use rayon::prelude::*;
    /// Gradients at least this long are unscaled over rayon's threads, a piece each (each
    /// element alone; the flag and counts are an OR and sums of integers).
    const PAR_MIN: usize = 64 * 1024;
    let (found_inf, counts) = if data.len() >= PAR_MIN {
        data.par_chunks_mut(PAR_MIN / 8)
            .map(|piece| unscale_piece(piece, dtype, inv))
            .reduce(
                || (false, RoundCounts::default()),
                |(fa, mut ca), (fb, cb)| {
                    ca.add(cb);
                    (fa | fb, ca)
                },
            )
    } else {
        unscale_piece(data, dtype, inv)
    };
    rounding.add(counts);
    found_inf
}

/// [`unscale_slice`] on one thread: whether a value was Inf/NaN, and the rounding's counts.
fn unscale_piece(data: &mut [f32], dtype: DType, inv: f32) -> (bool, RoundCounts) {
    const CHUNK: usize = 1024;
    let mut before = [0f32; CHUNK];
    let mut found_inf = false;
    let mut rounding = RoundCounts::default();
    for chunk in data.chunks_mut(CHUNK) {
        let n = chunk.len();
        before[..n].copy_from_slice(chunk);
        for x in chunk.iter_mut() {
            found_inf |= !x.is_finite();
            // ATen skips the multiply for inv_scale == 1; x * 1 == x, so no special case.
            *x *= inv;
        }
        round_slice(dtype, chunk);
        // Branch-free, so the loop vectorizes.
        for (&a, &b) in before[..n].iter().zip(chunk.iter()) {
            rounding.overflow += (a.is_finite() & b.is_infinite()) as u64;
            rounding.underflow += (a.is_finite() & (a != 0.0) & (b == 0.0)) as u64;
        }
    }
    (found_inf, rounding)
}

#[cfg(test)]
mod tests;
