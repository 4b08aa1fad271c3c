//! What every optimizer's update shares: the slot a parameter is updated through, the
//! [`Optimizer`] trait, where low-precision state is kept, the element-loop runner, the
//! checks of arguments and the state an update in f64 starts from ([`StateBefore`]). A leaf of `optim`: sgd.rs and adam.rs build on it, mod.rs re-exports
//! it and builds an optimizer from a config.

use std::collections::HashSet;

use serde::{Deserialize, Serialize};

use crate::dtype::DType;
use crate::{Error, Result};

/// One parameter as an optimizer sees it.
#[derive(Debug)]
pub struct ParamSlot<'a> {
    /// Unique parameter name; optimizer state is keyed by it.
    pub name: &'a str,
    /// Parameter values, updated in place (each value representable in `dtype`).
    pub data: &'a mut [f32],
    /// Gradient, same length as `data`; `None` leaves the parameter and its state untouched.
    pub grad: Option<&'a [f32]>,
    /// Storage dtype of the parameter (and of its gradient).
    pub dtype: DType,
}

/// An optimizer: updates parameters from their gradients, keeping per-parameter state.
pub trait Optimizer: Send {
    /// One update of every parameter with a gradient. Parameters are identified by name;
    /// state is kept per name. All slots are validated before any is changed, so an error
    /// leaves parameters and state as they were.
    fn step(&mut self, params: &mut [ParamSlot<'_>]) -> Result<()>;
    /// Short name: `sgd`, `adam` or `adamw`.
    fn name(&self) -> &'static str;
    /// Learning rate, as `f32`.
    fn lr(&self) -> f32 {
        self.lr_f64() as f32
    }
    /// Sets the learning rate from an `f32` (widened exactly to the `f64` held inside).
    fn set_lr(&mut self, lr: f32) {
        self.set_lr_f64(f64::from(lr));
    }
    /// Learning rate as held inside: an `f64`, like PyTorch's Python float.
    fn lr_f64(&self) -> f64;
    /// Sets the learning rate as an `f64`, as a PyTorch scheduler does; scalars derived from
    /// it are computed in `f64` and rounded to `f32` once.
    fn set_lr_f64(&mut self, lr: f64);
    /// A state buffer of one parameter by its PyTorch state-dict key (`momentum_buffer`,
    /// `exp_avg`, `exp_avg_sq`, `max_exp_avg_sq`); `None` if the parameter has none yet.
    fn state_buffer(&self, name: &str, key: &str) -> Option<&[f32]>;
    /// Number of updates applied to a parameter so far (`None` before its first update).
    /// For Adam this is PyTorch's `f32` `step` tensor, which stops counting at 2^24.
    fn step_count(&self, name: &str) -> Option<f32>;
    /// The value parameter `name` (now `param`) would take from one update with gradient
    /// `grad`, computed in f64 from the state as it is now, which stays as it is: the
    /// exact update that blame holds the step's to. `None` when the state does not fit
    /// (its length differs from the parameter's).
    fn exact_step(&self, name: &str, param: &[f64], grad: &[f64]) -> Option<Vec<f64>>;
}

/// Where the optimizer math and state of an fp16/bf16 parameter live (f32 parameters are
/// updated identically either way).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StatePrecision {
    /// State in f32, update arithmetic in f32, the new parameter rounded once to its dtype.
    #[default]
    F32,
    /// What PyTorch's optimizers do for a module converted with `.half()` / `.bfloat16()`:
    /// state tensors in the parameter's dtype and every op's result rounded to it (ATen
    /// computes each op in f32 and rounds; `add`'s alpha is rounded to the dtype first).
    /// This reproduces, for example, Adam's fp16 `exp_avg_sq` underflowing to zero and
    /// `eps = 1e-8` vanishing, which drives small-gradient parameters to infinity.
    Param,
}

impl StatePrecision {
    /// The dtype each intermediate op rounds to for a parameter of dtype `param`.
    pub fn op_dtype(self, param: DType) -> DType {
        match self {
            StatePrecision::Param if param.is_low_precision() => param,
            _ => DType::F32,
        }
    }
}

/// An optimizer's element loop over one parameter, run by [`run_kernel`]. `run` is
/// `#[inline(always)]` in each implementation, so that it is compiled into the FMA copy.
pub(crate) trait Kernel {
    /// Updates every element.
    fn run(self);
}

/// Runs `k` in code compiled for FMA and AVX2 where the CPU has them, so its `mul_add`s
/// are one instruction each (and its loop vectorizes) instead of a call to libm's `fmaf`
/// per element. The values are the same either way: a fused multiply-add rounds once by
/// definition, in hardware or in libm.
pub(crate) fn run_kernel<K: Kernel>(k: K) {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "fma,avx2")]
        fn with_fma<K: Kernel>(k: K) {
            k.run()
        }
        if std::arch::is_x86_feature_detected!("fma") && std::arch::is_x86_feature_detected!("avx2")
        {
            // SAFETY: the CPU was just checked to have both features.
            return unsafe { with_fma(k) };
        }
    }
    k.run()
}

/// Checks every slot that has a gradient: float dtype, gradient as long as the data, and
/// no name used twice. Returns the indices of the slots to update.
pub(crate) fn slots_to_update(optimizer: &str, params: &[ParamSlot<'_>]) -> Result<Vec<usize>> {
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    for (i, p) in params.iter().enumerate() {
        let Some(g) = p.grad else { continue };
        if !p.dtype.is_float() {
            return Err(Error::tensor(
                p.name,
                format!(
                    "{optimizer}: parameter dtype must be floating point, got {}",
                    p.dtype
                ),
            ));
        }
        if g.len() != p.data.len() {
            return Err(Error::tensor(
                p.name,
                format!(
                    "{optimizer}: gradient has {} elements but the parameter has {}",
                    g.len(),
                    p.data.len()
                ),
            ));
        }
        if !seen.insert(p.name) {
            return Err(Error::tensor(
                p.name,
                format!("{optimizer}: parameter name appears twice in one step"),
            ));
        }
        out.push(i);
    }
    Ok(out)
}

/// Checks that a state buffer kept for `name` still fits the parameter.
pub(crate) fn check_state_len(
    optimizer: &str,
    name: &str,
    state: usize,
    data: usize,
) -> Result<()> {
    if state != data {
        return Err(Error::tensor(
            name,
            format!(
                "{optimizer}: optimizer state has {state} elements but the parameter now has {data}"
            ),
        ));
    }
    Ok(())
}

/// Checks a hyper-parameter against a predicate (false for NaN, as PyTorch's `not 0.0 <= x`).
pub(crate) fn check_hparam(ok: bool, field: &str, value: f64, expected: &str) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(Error::config(
            format!("optimizer.{field}"),
            format!("{expected}, got {value}"),
        ))
    }
}

/// One parameter's state before an update, as f32 buffers (`None`: not made yet, zeros).
#[derive(Debug, Clone, Copy, Default)]
pub struct StateBefore<'a> {
    /// Updates applied so far.
    pub updates: f32,
    /// SGD's momentum buffer, or Adam's first moment.
    pub first: Option<&'a [f32]>,
    /// Adam's second moment.
    pub second: Option<&'a [f32]>,
    /// AMSGrad's running maximum of the second moment.
    pub max_second: Option<&'a [f32]>,
}

impl StateBefore<'_> {
    /// False when a buffer's length is not `n`.
    pub(super) fn fits(&self, n: usize) -> bool {
        [self.first, self.second, self.max_second]
            .iter()
            .all(|b| b.is_none_or(|b| b.len() == n))
    }
}

/// Element `j` of a buffer, 0 where it is not made yet.
pub(super) fn state_at(b: Option<&[f32]>, j: usize) -> f64 {
    b.map_or(0.0, |b| f64::from(b[j]))
}
