//! Adam and AdamW (with AMSGrad and `maximize`), as `torch.optim.Adam` / `torch.optim.AdamW`'s
//! single-tensor path.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use super::update::{
    check_hparam, check_state_len, run_kernel, slots_to_update, state_at, Kernel, Optimizer,
    ParamSlot, StateBefore, StatePrecision,
};
use crate::dtype::{round_slice, round_to, DType};
use crate::Result;

/// Hyper-parameters of [`Adam`], with `torch.optim.Adam`'s defaults.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdamConfig {
    /// Learning rate (default 1e-3).
    pub lr: f64,
    /// Decay rates of the first and second moment averages (default (0.9, 0.999)).
    pub betas: (f64, f64),
    /// Term added to the denominator (default 1e-8).
    pub eps: f64,
    /// Weight decay (default 0): an L2 term added to the gradient, or decoupled.
    pub weight_decay: f64,
    /// AMSGrad: normalize by the running maximum of the second moment (default false).
    pub amsgrad: bool,
    /// Ascend the objective instead of descending it (default false).
    pub maximize: bool,
    /// Decoupled weight decay, `p *= 1 - lr * weight_decay` before the update: AdamW
    /// (default false).
    pub decoupled: bool,
    /// Precision of the moments and update arithmetic for fp16/bf16 parameters
    /// (default `f32`).
    pub state_precision: StatePrecision,
}

impl Default for AdamConfig {
    fn default() -> Self {
        AdamConfig {
            lr: 1e-3,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.0,
            amsgrad: false,
            maximize: false,
            decoupled: false,
            state_precision: StatePrecision::F32,
        }
    }
}

impl AdamConfig {
    /// Checks the values as `torch.optim.Adam.__init__` does.
    pub fn validate(&self) -> Result<()> {
        check_hparam(self.lr >= 0.0, "lr", self.lr, "learning rate must be >= 0")?;
        check_hparam(self.eps >= 0.0, "eps", self.eps, "eps must be >= 0")?;
        let (b1, b2) = self.betas;
        check_hparam(
            (0.0..1.0).contains(&b1),
            "betas[0]",
            b1,
            "beta1 must be in [0, 1)",
        )?;
        check_hparam(
            (0.0..1.0).contains(&b2),
            "betas[1]",
            b2,
            "beta2 must be in [0, 1)",
        )?;
        check_hparam(
            self.weight_decay >= 0.0,
            "weight_decay",
            self.weight_decay,
            "weight_decay must be >= 0",
        )
    }
}

/// Hyper-parameters of AdamW, with `torch.optim.AdamW`'s defaults (`weight_decay` 0.01);
/// converts into an [`AdamConfig`] with `decoupled: true`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdamWConfig {
    /// Learning rate (default 1e-3).
    pub lr: f64,
    /// Decay rates of the first and second moment averages (default (0.9, 0.999)).
    pub betas: (f64, f64),
    /// Term added to the denominator (default 1e-8).
    pub eps: f64,
    /// Decoupled weight decay coefficient (default 0.01).
    pub weight_decay: f64,
    /// AMSGrad variant (default false).
    pub amsgrad: bool,
    /// Ascend the objective instead of descending it (default false).
    pub maximize: bool,
    /// Precision of the moments and update arithmetic for fp16/bf16 parameters
    /// (default `f32`).
    pub state_precision: StatePrecision,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        AdamWConfig {
            lr: 1e-3,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.01,
            amsgrad: false,
            maximize: false,
            state_precision: StatePrecision::F32,
        }
    }
}

impl From<AdamWConfig> for AdamConfig {
    fn from(c: AdamWConfig) -> Self {
        AdamConfig {
            lr: c.lr,
            betas: c.betas,
            eps: c.eps,
            weight_decay: c.weight_decay,
            amsgrad: c.amsgrad,
            maximize: c.maximize,
            decoupled: true,
            state_precision: c.state_precision,
        }
    }
}

/// `torch.optim.Adam` / `torch.optim.AdamW` (single-tensor path, `capturable=False`).
///
/// Per parameter, with `g` the gradient (negated when `maximize`) and `t` the `f32` step
/// count after increment:
///
/// 1. weight decay: AdamW `p = p * f32(1 - lr*wd)`; Adam `g = fma(p, wd, g)`;
/// 2. `m.lerp_(g, 1 - beta1)`; `v = v * beta2`, then `v = fma((1 - beta2) * g, g, v)`;
/// 3. in `f64`: `bc1 = 1 - beta1^t`, `bc2 = 1 - beta2^t`, `step_size = lr / bc1`,
///    `bc2_sqrt = bc2^0.5`;
/// 4. AMSGrad: `vmax = maximum(vmax, v)` (NaN-propagating), used in place of `v` below;
/// 5. `denom = sqrt(v) / f32(bc2_sqrt) + f32(eps)`;
/// 6. `p = p + (f32(-step_size) * m) / denom`.
///
/// Low-precision parameters are rounded to their dtype once, after the update.
#[derive(Debug, Clone)]
pub struct Adam {
    cfg: AdamConfig,
    state: HashMap<String, AdamState>,
}

#[derive(Debug, Clone)]
struct AdamState {
    step: f32,
    exp_avg: Vec<f32>,
    exp_avg_sq: Vec<f32>,
    max_exp_avg_sq: Option<Vec<f32>>,
}

impl Adam {
    /// Builds the optimizer after validating the config.
    pub fn new(cfg: AdamConfig) -> Result<Self> {
        cfg.validate()?;
        Ok(Adam {
            cfg,
            state: HashMap::new(),
        })
    }

    /// The hyper-parameters in use.
    pub fn config(&self) -> &AdamConfig {
        &self.cfg
    }
}

/// `start.lerp_(end, weight)` for one element, as ATen's vectorized CPU kernel.
#[inline(always)]
fn lerp(start: f32, end: f32, weight: f32) -> f32 {
    let diff = end - start;
    if weight.abs() < 0.5 {
        weight.mul_add(diff, start)
    } else {
        (weight - 1.0).mul_add(diff, end)
    }
}

/// `torch.maximum`: NaN if either input is NaN.
#[inline]
fn maximum(a: f32, b: f32) -> f32 {
    if a.is_nan() || b.is_nan() {
        f32::NAN
    } else if a >= b {
        a
    } else {
        b
    }
}

/// One parameter's Adam/AdamW update, element by element, as `torch.optim.Adam`'s
/// single-tensor path computes it.
struct AdamKernel<'a> {
    data: &'a mut [f32],
    grad: &'a [f32],
    exp_avg: &'a mut [f32],
    exp_avg_sq: &'a mut [f32],
    /// AMSGrad's running maximum of the second moment.
    vmax: Option<&'a mut [f32]>,
    maximize: bool,
    use_wd: bool,
    decoupled: bool,
    /// The dtype each op rounds to.
    od: DType,
    decay_factor: f32,
    wd: f32,
    lerp_weight: f32,
    beta2: f32,
    one_minus_beta2: f32,
    bc2_sqrt: f32,
    eps: f32,
    neg_step_size: f32,
}

impl Kernel for AdamKernel<'_> {
    #[inline(always)]
    fn run(self) {
        let od = self.od;
        let r = |x: f32| round_to(od, x);
        let mut vmax = self.vmax;
        for (j, (p, &g0)) in self.data.iter_mut().zip(self.grad).enumerate() {
            let mut g = if self.maximize { -g0 } else { g0 };
            if self.use_wd {
                if self.decoupled {
                    // param.mul_(1 - lr * weight_decay)
                    *p = r(*p * self.decay_factor);
                } else {
                    // grad.add(param, alpha=weight_decay)
                    g = r(p.mul_add(self.wd, g));
                }
            }
            // exp_avg.lerp_(grad, 1 - beta1)
            let m = r(lerp(self.exp_avg[j], g, self.lerp_weight));
            self.exp_avg[j] = m;
            // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            let v = r((self.one_minus_beta2 * g).mul_add(g, r(self.exp_avg_sq[j] * self.beta2)));
            self.exp_avg_sq[j] = v;
            let second = match vmax.as_deref_mut() {
                Some(vmax) => {
                    vmax[j] = maximum(vmax[j], v);
                    vmax[j]
                }
                None => v,
            };
            // (second.sqrt() / bias_correction2_sqrt).add_(eps)
            let denom = r(r(r(second.sqrt()) / self.bc2_sqrt) + self.eps);
            // param.addcdiv_(exp_avg, denom, value=-step_size)
            *p += (self.neg_step_size * m) / denom;
        }
    }
}

impl Optimizer for Adam {
    fn step(&mut self, params: &mut [ParamSlot<'_>]) -> Result<()> {
        let todo = slots_to_update(self.name(), params)?;
        for &i in &todo {
            let p = &params[i];
            if let Some(st) = self.state.get(p.name) {
                check_state_len(self.name(), p.name, st.exp_avg.len(), p.data.len())?;
            }
        }

        let c = &self.cfg;
        let (beta1, beta2) = c.betas;
        let use_wd = c.weight_decay != 0.0;
        // Python floats meet the tensors as f32 (ATen's opmath type for fp16/bf16 too),
        // except `add`'s alpha, which is rounded to the tensor's dtype (below).
        let decay_factor = (1.0 - c.lr * c.weight_decay) as f32;
        let lerp_weight = (1.0 - beta1) as f32;
        let beta2_f = beta2 as f32;
        let one_minus_beta2 = (1.0 - beta2) as f32;
        let eps = c.eps as f32;

        for i in todo {
            let slot = &mut params[i];
            let Some(grad) = slot.grad else { continue };
            // Dtype each op rounds to: f32, or the parameter's own under `StatePrecision::Param`.
            let od = c.state_precision.op_dtype(slot.dtype);
            let r = |x: f32| round_to(od, x);
            let wd = r(c.weight_decay as f32);
            let n = grad.len();
            let st = self
                .state
                .entry(slot.name.to_string())
                .or_insert_with(|| AdamState {
                    step: 0.0,
                    exp_avg: vec![0.0; n],
                    exp_avg_sq: vec![0.0; n],
                    max_exp_avg_sq: None,
                });
            if c.amsgrad && st.max_exp_avg_sq.is_none() {
                st.max_exp_avg_sq = Some(vec![0.0; n]);
            }
            st.step += 1.0;
            // `step_t.item()` is a Python float; the bias corrections are Python arithmetic.
            let t = f64::from(st.step);
            let bias_correction1 = 1.0 - beta1.powf(t);
            let bias_correction2 = 1.0 - beta2.powf(t);
            let step_size = c.lr / bias_correction1;
            let bc2_sqrt = bias_correction2.powf(0.5) as f32;
            let neg_step_size = (-step_size) as f32;

            let vmax = if c.amsgrad {
                st.max_exp_avg_sq.as_deref_mut()
            } else {
                None
            };
            run_kernel(AdamKernel {
                data: slot.data,
                grad,
                exp_avg: &mut st.exp_avg,
                exp_avg_sq: &mut st.exp_avg_sq,
                vmax,
                maximize: c.maximize,
                use_wd,
                decoupled: c.decoupled,
                od,
                decay_factor,
                wd,
                lerp_weight,
                beta2: beta2_f,
                one_minus_beta2,
                bc2_sqrt,
                eps,
                neg_step_size,
            });
            round_slice(slot.dtype, slot.data);
        }
        Ok(())
    }

    fn name(&self) -> &'static str {
        if self.cfg.decoupled {
            "adamw"
        } else {
            "adam"
        }
    }

    fn lr_f64(&self) -> f64 {
        self.cfg.lr
    }

    fn set_lr_f64(&mut self, lr: f64) {
        self.cfg.lr = lr;
    }

    fn state_buffer(&self, name: &str, key: &str) -> Option<&[f32]> {
        let st = self.state.get(name)?;
        match key {
            "exp_avg" => Some(&st.exp_avg),
            "exp_avg_sq" => Some(&st.exp_avg_sq),
            "max_exp_avg_sq" => st.max_exp_avg_sq.as_deref(),
            _ => None,
        }
    }

    fn step_count(&self, name: &str) -> Option<f32> {
        self.state.get(name).map(|s| s.step)
    }

    fn exact_step(&self, name: &str, param: &[f64], grad: &[f64]) -> Option<Vec<f64>> {
        let st = self.state.get(name);
        let state = StateBefore {
            updates: st.map_or(0.0, |s| s.step),
            first: st.map(|s| s.exp_avg.as_slice()),
            second: st.map(|s| s.exp_avg_sq.as_slice()),
            max_second: st.and_then(|s| s.max_exp_avg_sq.as_deref()),
        };
        exact_update(&self.cfg, self.cfg.lr, state, param, grad)
    }
}

/// `torch.optim.Adam`'s (AdamW's with `c.decoupled`) update of `param` by `grad` at
/// learning rate `lr`, in f64; `None` when the lengths differ.
pub fn exact_update(
    c: &AdamConfig,
    lr: f64,
    state: StateBefore<'_>,
    param: &[f64],
    grad: &[f64],
) -> Option<Vec<f64>> {
    let n = param.len();
    if grad.len() != n || !state.fits(n) {
        return None;
    }
    let (beta1, beta2) = c.betas;
    let t = f64::from(state.updates) + 1.0;
    let (bc1, bc2) = (1.0 - beta1.powf(t), 1.0 - beta2.powf(t));
    let out = param
        .iter()
        .zip(grad)
        .enumerate()
        .map(|(j, (&p0, &g0))| {
            let (mut p, mut g) = (p0, if c.maximize { -g0 } else { g0 });
            if c.decoupled {
                p *= 1.0 - lr * c.weight_decay;
            } else {
                g += c.weight_decay * p;
            }
            let m = beta1 * state_at(state.first, j) + (1.0 - beta1) * g;
            let v = beta2 * state_at(state.second, j) + (1.0 - beta2) * g * g;
            let second = match c.amsgrad {
                true => {
                    let vmax = state_at(state.max_second, j);
                    // (torch.maximum propagates a NaN)
                    if v.is_nan() || vmax.is_nan() {
                        f64::NAN
                    } else {
                        v.max(vmax)
                    }
                }
                false => v,
            };
            p - lr / bc1 * m / (second.sqrt() / bc2.sqrt() + c.eps)
        })
        .collect();
    Some(out)
}

#[cfg(test)]
mod tests;
