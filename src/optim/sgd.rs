//! Stochastic gradient descent with momentum, dampening, Nesterov momentum, L2 weight decay
//! and `maximize`, as `torch.optim.SGD`'s single-tensor path.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use super::update::{
    check_hparam, check_state_len, run_kernel, slots_to_update, state_at, Kernel, Optimizer,
    ParamSlot, StateBefore, StatePrecision,
};
use crate::dtype::{round_slice, round_to, DType};
use crate::Result;

/// Hyper-parameters of [`Sgd`], with PyTorch's defaults.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SgdConfig {
    /// Learning rate (default 1e-3).
    pub lr: f64,
    /// Momentum factor (default 0: no momentum buffer).
    pub momentum: f64,
    /// Dampening of the gradient added to the momentum buffer (default 0).
    pub dampening: f64,
    /// L2 penalty added to the gradient (default 0).
    pub weight_decay: f64,
    /// Nesterov momentum; needs `momentum > 0` and `dampening == 0` (default false).
    pub nesterov: bool,
    /// Ascend the objective instead of descending it (default false).
    pub maximize: bool,
    /// Precision of the momentum buffer and update arithmetic for fp16/bf16 parameters
    /// (default `f32`).
    pub state_precision: StatePrecision,
}

impl Default for SgdConfig {
    fn default() -> Self {
        SgdConfig {
            lr: 1e-3,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
            maximize: false,
            state_precision: StatePrecision::F32,
        }
    }
}

impl SgdConfig {
    /// Checks the values as `torch.optim.SGD.__init__` does.
    pub fn validate(&self) -> Result<()> {
        check_hparam(self.lr >= 0.0, "lr", self.lr, "learning rate must be >= 0")?;
        check_hparam(
            self.momentum >= 0.0,
            "momentum",
            self.momentum,
            "momentum must be >= 0",
        )?;
        check_hparam(
            self.weight_decay >= 0.0,
            "weight_decay",
            self.weight_decay,
            "weight_decay must be >= 0",
        )?;
        check_hparam(
            self.dampening.is_finite(),
            "dampening",
            self.dampening,
            "dampening must be a finite number",
        )?;
        if self.nesterov {
            check_hparam(
                self.momentum > 0.0,
                "momentum",
                self.momentum,
                "Nesterov momentum requires momentum > 0",
            )?;
            check_hparam(
                self.dampening == 0.0,
                "dampening",
                self.dampening,
                "Nesterov momentum requires dampening == 0",
            )?;
        }
        Ok(())
    }
}

/// `torch.optim.SGD` (single-tensor path).
///
/// Per parameter, with `g` the gradient (negated when `maximize`):
/// `g = fma(p, wd, g)` if `weight_decay != 0`; with momentum, the buffer is a copy of `g`
/// on the first update (no dampening then) and afterwards `b = fma(g, 1 - dampening, b * m)`;
/// Nesterov uses `g = fma(b, m, g)`, plain momentum `g = b`; finally `p = fma(g, -lr, p)`.
/// Low-precision parameters are rounded to their dtype once, after the update.
#[derive(Debug, Clone)]
pub struct Sgd {
    cfg: SgdConfig,
    state: HashMap<String, SgdState>,
}

#[derive(Debug, Clone, Default)]
struct SgdState {
    updates: f32,
    momentum_buffer: Option<Vec<f32>>,
}

impl Sgd {
    /// Builds the optimizer after validating the config.
    pub fn new(cfg: SgdConfig) -> Result<Self> {
        cfg.validate()?;
        Ok(Sgd {
            cfg,
            state: HashMap::new(),
        })
    }

    /// The hyper-parameters in use.
    pub fn config(&self) -> &SgdConfig {
        &self.cfg
    }
}

/// One parameter's SGD update, element by element, as `torch.optim.SGD`'s single-tensor
/// path computes it.
struct SgdKernel<'a> {
    data: &'a mut [f32],
    grad: &'a [f32],
    buf: Option<&'a mut [f32]>,
    first: bool,
    maximize: bool,
    use_wd: bool,
    nesterov: bool,
    /// The dtype each op rounds to.
    od: DType,
    neg_lr: f32,
    wd: f32,
    momentum_alpha: f32,
    momentum: f32,
    one_minus_damp: f32,
}

impl Kernel for SgdKernel<'_> {
    #[inline(always)]
    fn run(self) {
        let od = self.od;
        let r = |x: f32| round_to(od, x);
        let mut buf = self.buf;
        for (j, (p, &g0)) in self.data.iter_mut().zip(self.grad).enumerate() {
            let mut g = if self.maximize { -g0 } else { g0 };
            if self.use_wd {
                // grad.add(param, alpha=wd)
                g = r(p.mul_add(self.wd, g));
            }
            if let Some(buf) = buf.as_deref_mut() {
                let b = if self.first {
                    // PyTorch clones the gradient into the fresh buffer.
                    g
                } else {
                    // buf.mul_(momentum).add_(grad, alpha=1 - dampening)
                    r(g.mul_add(self.one_minus_damp, r(buf[j] * self.momentum)))
                };
                buf[j] = b;
                // grad.add(buf, alpha=momentum)
                g = if self.nesterov {
                    r(b.mul_add(self.momentum_alpha, g))
                } else {
                    b
                };
            }
            // param.add_(grad, alpha=-lr)
            *p = g.mul_add(self.neg_lr, *p);
        }
    }
}

impl Optimizer for Sgd {
    fn step(&mut self, params: &mut [ParamSlot<'_>]) -> Result<()> {
        let todo = slots_to_update("sgd", params)?;
        for &i in &todo {
            let p = &params[i];
            if let Some(buf) = self
                .state
                .get(p.name)
                .and_then(|s| s.momentum_buffer.as_ref())
            {
                check_state_len("sgd", p.name, buf.len(), p.data.len())?;
            }
        }

        let c = &self.cfg;
        let use_wd = c.weight_decay != 0.0;
        let use_momentum = c.momentum != 0.0;

        for i in todo {
            let slot = &mut params[i];
            let Some(grad) = slot.grad else { continue };
            // Dtype each op rounds to: f32, or the parameter's own under `StatePrecision::Param`.
            let od = c.state_precision.op_dtype(slot.dtype);
            let r = |x: f32| round_to(od, x);
            // Python floats meet the tensors here, rounded once: `add`'s alpha to the tensor's
            // dtype, a `mul` scalar to f32 (ATen's opmath type for fp16/bf16 too).
            let neg_lr = r((-c.lr) as f32);
            let wd = r(c.weight_decay as f32);
            let momentum_alpha = r(c.momentum as f32);
            let momentum = c.momentum as f32;
            let one_minus_damp = r((1.0 - c.dampening) as f32);

            let st = self.state.entry(slot.name.to_string()).or_default();
            let first = st.momentum_buffer.is_none();
            if use_momentum && first {
                st.momentum_buffer = Some(vec![0.0; grad.len()]);
            }
            run_kernel(SgdKernel {
                data: slot.data,
                grad,
                buf: st.momentum_buffer.as_deref_mut(),
                first,
                maximize: c.maximize,
                use_wd,
                nesterov: c.nesterov,
                od,
                neg_lr,
                wd,
                momentum_alpha,
                momentum,
                one_minus_damp,
            });
            round_slice(slot.dtype, slot.data);
            st.updates += 1.0;
        }
        Ok(())
    }

    fn name(&self) -> &'static str {
        "sgd"
    }

    fn lr_f64(&self) -> f64 {
        self.cfg.lr
    }

    fn set_lr_f64(&mut self, lr: f64) {
        self.cfg.lr = lr;
    }

    fn state_buffer(&self, name: &str, key: &str) -> Option<&[f32]> {
        match key {
            "momentum_buffer" => self.state.get(name)?.momentum_buffer.as_deref(),
            _ => None,
        }
    }

    fn step_count(&self, name: &str) -> Option<f32> {
        self.state.get(name).map(|s| s.updates)
    }

    fn exact_step(&self, name: &str, param: &[f64], grad: &[f64]) -> Option<Vec<f64>> {
        let st = self.state.get(name);
        let state = StateBefore {
            updates: st.map_or(0.0, |s| s.updates),
            first: st.and_then(|s| s.momentum_buffer.as_deref()),
            ..StateBefore::default()
        };
        exact_update(&self.cfg, self.cfg.lr, state, param, grad)
    }
}

/// `torch.optim.SGD`'s update of `param` by `grad` at learning rate `lr`, in f64; `None`
/// when the lengths differ.
pub fn exact_update(
    c: &SgdConfig,
    lr: f64,
    state: StateBefore<'_>,
    param: &[f64],
    grad: &[f64],
) -> Option<Vec<f64>> {
    let n = param.len();
    if grad.len() != n || !state.fits(n) {
        return None;
    }
    // (the buffer starts as a copy of the first gradient)
    let buf = state.first.filter(|_| state.updates > 0.0);
    let out = param
        .iter()
        .zip(grad)
        .enumerate()
        .map(|(j, (&p, &g0))| {
            let mut g = if c.maximize { -g0 } else { g0 };
            g += c.weight_decay * p;
            if c.momentum != 0.0 {
                let b = match buf {
                    Some(_) => c.momentum * state_at(buf, j) + (1.0 - c.dampening) * g,
                    None => g,
                };
                g = if c.nesterov { g + c.momentum * b } else { b };
            }
            p - lr * g
        })
        .collect();
    Some(out)
}

#[cfg(test)]
mod tests;
