//! Elementwise ops: unary maps, scalar ops and broadcasting binary arithmetic.
//!
//! The op definitions and their recording live here; the kernels per backend beside them
//! (`cpu.rs` on the host, `cuda.rs` + `elementwise.cu` on a device).

mod cpu;
pub mod cuda;
mod functions;

pub use functions::{Binary, Unary};

use super::shape::check_grad;
use super::{device_out, expect_float, grad, sum_to, with_float, with_float2};
use crate::engine::{Computed, Engine};
use crate::error::Result;
use crate::tensor::Tensor;

/// Adds two tensors of the same shape and dtype (gradient accumulation), rounding once.
pub fn add_same(a: &Tensor, b: &Tensor) -> Result<Computed> {
    let (t, rounding, slot) = a.add_same(b, "accumulate_grad")?;
    Ok(Computed {
        slot,
        ..Computed::new(t, rounding)
    })
}

/// The device switch of [`Engine::unary_with`]: its flag with the parameters it selects.
fn switch(flag: &Option<Tensor>, on_inf: Option<(f64, f64)>) -> Option<cuda::Switch<'_>> {
    flag.as_ref()
        .zip(on_inf)
        .map(|(flag, (p0, p1))| cuda::Switch { flag, p0, p1 })
}

impl Engine {
    /// Applies a unary elementwise op, recording it.
    pub fn unary(&mut self, op: Unary, x: &Tensor) -> Result<Tensor> {
        self.unary_with(op, x, None)
    }

    /// [`Engine::unary`]; on a device, `on_inf` are the two parameters that replace the
    /// op's own when the input holds an inf, decided there by a flag kernel (the host
    /// decides by looking before it calls this, so it passes none).
    fn unary_with(&mut self, op: Unary, x: &Tensor, on_inf: Option<(f64, f64)>) -> Result<Tensor> {
        expect_float(x, op.name(), "input")?;
        let ins = self.prepare(op.name(), &[x])?;
        let x = &ins[0];
        let flag = match on_inf {
            Some(_) if x.storage().is_device() => Some(cuda::inf_flag(x)?),
            Some(_) => {
                return Err(crate::Error::Device(format!(
                    "{}: a parameter switch on an inf is decided on a device only",
                    op.name()
                )))
            }
            None => None,
        };
        // The exact GELU on the host keeps its cdf for the backward (erf once, not twice).
        let mut gelu_cdf = None;
        let out = if x.storage().is_device() {
            let (slot, sink) = device_out(x)?;
            Computed::pending(cuda::unary(op, x, switch(&flag, on_inf), sink)?, slot)
        } else if let (Unary::GeluErf, super::FData::F32(d)) = (op, super::fdata(x, op.name())?) {
            let (y, cdf) = cpu::gelu_erf_fwd(d, x.shape(), x.dtype())?;
            gelu_cdf = Some(cdf);
            y
        } else {
            with_float!(x, op.name(), |d| cpu::unary(d, op, x.shape(), x.dtype()))?
        };
        // Only the values the derivative reads stay alive until the backward; `g` (of the
        // same length) stands in for the others.
        let (reads_x, reads_y) = op.reads();
        let kept_x = reads_x.then(|| x.clone());
        let kept_y = reads_y.then(|| out.tensor.clone());
        let (shape, dtype) = (x.shape().to_vec(), x.dtype());
        let bw = Box::new(move |g: &Tensor| {
            check_grad(g, &shape, op.name())?;
            let xs = kept_x.as_ref().unwrap_or(g);
            let ys = kept_y.as_ref().unwrap_or(g);
            if g.storage().is_device() {
                let (slot, sink) = device_out(g)?;
                let dx = cuda::unary_backward(op, (xs, ys, g), switch(&flag, on_inf), sink)?;
                return Ok(vec![grad(Computed::pending(dx, slot))]);
            }
            if let Some(cdf) = &gelu_cdf {
                let r = match (
                    super::fdata(xs, "backward")?,
                    super::fdata(cdf, "backward")?,
                    super::fdata(g, "backward")?,
                ) {
                    (super::FData::F32(a), super::FData::F32(c), super::FData::F32(gd)) => {
                        cpu::gelu_erf_bwd(a, c, gd, &shape, dtype)?
                    }
                    _ => {
                        return Err(crate::Error::shape(
                            op.name(),
                            "gradient dtype differs from input",
                        ))
                    }
                };
                return Ok(vec![grad(r)]);
            }
            let r = match (
                super::fdata(xs, "backward")?,
                super::fdata(ys, "backward")?,
                super::fdata(g, "backward")?,
            ) {
                (super::FData::F32(a), super::FData::F32(b), super::FData::F32(c)) => {
                    cpu::unary_backward(a, b, c, op, &shape, dtype)?
                }
                (super::FData::F64(a), super::FData::F64(b), super::FData::F64(c)) => {
                    cpu::unary_backward(a, b, c, op, &shape, dtype)?
                }
                _ => {
                    return Err(crate::Error::shape(
                        op.name(),
                        "gradient dtype differs from input",
                    ))
                }
            };
            Ok(vec![grad(r)])
        });
        self.record(op.name(), &[x], &["input"], out, Some(bw))
    }

    /// Applies a broadcasting binary op, recording it.
    pub fn binary(&mut self, op: Binary, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        expect_float(a, op.name(), "left operand")?;
        expect_float(b, op.name(), "right operand")?;
        let ins = self.prepare(op.name(), &[a, b])?;
        let (a, b) = (&ins[0], &ins[1]);
        let out_shape = super::broadcast_shape(a.shape(), b.shape(), op.name())?;
        let out = if a.storage().is_device() {
            let (slot, sink) = device_out(a)?;
            Computed::pending(cuda::binary(op, a, b, sink)?, slot)
        } else {
            with_float2!(a, b, op.name(), |x, y| cpu::binary(
                x,
                a.shape(),
                y,
                b.shape(),
                &out_shape,
                op,
                a.dtype()
            ))?
        };
        // No gradient is computed for an operand that needs none (a mask, the rotary
        // tables): the engine would drop it unrecorded. Only the operand values that the
        // needed gradients read stay alive until the backward.
        let need = [a.requires_grad(), b.requires_grad()];
        let (reads_a, reads_b) = op.grad_reads(need);
        let kept_a = reads_a.then(|| a.clone());
        let kept_b = reads_b.then(|| b.clone());
        let (shape_a, shape_b, dt) = (a.shape().to_vec(), b.shape().to_vec(), a.dtype());
        let bw = Box::new(move |g: &Tensor| {
            check_grad(g, &out_shape, op.name())?;
            // The gradient of an operand that is the output's shape and dtype (an add's
            // either, a subtraction's left one), passed through unchanged: the same
            // storage, nothing rounds, no kernel (host and device alike).
            let pass = |target: &[usize]| -> Result<Option<crate::engine::Computed>> {
                if target != out_shape.as_slice() || g.dtype() != dt || g.shape() != target {
                    return Ok(None);
                }
                Ok(Some(crate::engine::Computed::new(
                    Tensor::from_storage(g.storage().clone(), target, dt)?,
                    Default::default(),
                )))
            };
            if g.storage().is_device() {
                let sides = [
                    cuda::Side {
                        shape: &shape_a,
                        values: kept_a.as_ref(),
                    },
                    cuda::Side {
                        shape: &shape_b,
                        values: kept_b.as_ref(),
                    },
                ];
                let mut grads = Vec::with_capacity(2);
                for (wrt_b, needed) in [(false, need[0]), (true, need[1])] {
                    if !needed {
                        grads.push(None);
                        continue;
                    }
                    let shape = if wrt_b { &shape_b } else { &shape_a };
                    if matches!((op, wrt_b), (Binary::Add, _) | (Binary::Sub, false)) {
                        if let Some(c) = pass(shape)? {
                            grads.push(grad(c));
                            continue;
                        }
                    }
                    let (slot, sink) = device_out(g)?;
                    let d = cuda::binary_grad_of(op, sides, g, wrt_b, sink)?;
                    grads.push(grad(Computed::pending(d, slot)));
                }
                return Ok(grads);
            }
            // An operand whose values no needed gradient reads: `g`, at least as long,
            // stands in (never read).
            let at = kept_a.as_ref().unwrap_or(g);
            let bt = kept_b.as_ref().unwrap_or(g);
            let (sa, sb) = (shape_a.as_slice(), shape_b.as_slice());
            let (na, nb) = (crate::tensor::numel(sa), crate::tensor::numel(sb));
            macro_rules! grads {
                ($x:ident, $y:ident, $gg:ident) => {{
                    // The gradient of the operand of shape `$t` from `$k(a, b, g)` per element.
                    macro_rules! of {
                        ($t:expr, $k:expr) => {
                            Some(cpu::binary_grad(
                                $x, sa, $y, sb, $gg, &out_shape, $t, dt, $k,
                            )?)
                        };
                    }
                    let summed = |t: &[usize]| -> Result<Option<crate::engine::Computed>> {
                        Ok(Some(match pass(t)? {
                            Some(c) => c,
                            None => sum_to($gg, &out_shape, t, dt)?,
                        }))
                    };
                    let ga = match op {
                        _ if !need[0] => None,
                        Binary::Add | Binary::Sub => summed(sa)?,
                        Binary::Mul => of!(sa, |_, b, g| g * b),
                        Binary::Div => of!(sa, |_, b, g| g / b),
                    };
                    let gb = match op {
                        _ if !need[1] => None,
                        Binary::Add => summed(sb)?,
                        Binary::Sub => of!(sb, |_, _, g| -g),
                        Binary::Mul => of!(sb, |a, _, g| g * a),
                        Binary::Div => of!(sb, |a, b, g| -g * a / (b * b)),
                    };
                    Ok(vec![ga.and_then(grad), gb.and_then(grad)])
                }};
            }
            match (
                super::fdata(at, "backward")?,
                super::fdata(bt, "backward")?,
                super::fdata(g, "backward")?,
            ) {
                (super::FData::F32(x), super::FData::F32(y), super::FData::F32(gg)) => {
                    let (x, y) = (&x[..na.min(x.len())], &y[..nb.min(y.len())]);
                    grads!(x, y, gg)
                }
                (super::FData::F64(x), super::FData::F64(y), super::FData::F64(gg)) => {
                    let (x, y) = (&x[..na.min(x.len())], &y[..nb.min(y.len())]);
                    grads!(x, y, gg)
                }
                _ => Err(crate::Error::shape(
                    op.name(),
                    "gradient dtype differs from inputs",
                )),
            }
        });
        self.record(op.name(), &[a, b], &["self", "other"], out, Some(bw))
    }

    /// a + b (broadcasting).
    pub fn add(&mut self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        self.binary(Binary::Add, a, b)
    }
    /// a - b (broadcasting).
    pub fn sub(&mut self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        self.binary(Binary::Sub, a, b)
    }
    /// a · b (broadcasting).
    pub fn mul(&mut self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        self.binary(Binary::Mul, a, b)
    }
    /// a / b (broadcasting).
    pub fn div(&mut self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        self.binary(Binary::Div, a, b)
    }
    /// -x
    pub fn neg(&mut self, x: &Tensor) -> Result<Tensor> {
        self.unary(Unary::Neg, x)
    }
    /// max(x, 0)
    pub fn relu(&mut self, x: &Tensor) -> Result<Tensor> {
        self.unary(Unary::Relu, x)
    }
    /// GELU; `tanh_approx` selects the tanh form.
    pub fn gelu(&mut self, x: &Tensor, tanh_approx: bool) -> Result<Tensor> {
        self.unary(
            if tanh_approx {
                Unary::GeluTanh
            } else {
                Unary::GeluErf
            },
            x,
        )
    }
    /// x·sigmoid(x)
    pub fn silu(&mut self, x: &Tensor) -> Result<Tensor> {
        self.unary(Unary::Silu, x)
    }
    /// tanh(x)
    pub fn tanh(&mut self, x: &Tensor) -> Result<Tensor> {
        self.unary(Unary::Tanh, x)
    }
    /// sigmoid(x)
    pub fn sigmoid(&mut self, x: &Tensor) -> Result<Tensor> {
        self.unary(Unary::Sigmoid, x)
    }
    /// e^x
    pub fn exp(&mut self, x: &Tensor) -> Result<Tensor> {
        self.unary(Unary::Exp, x)
    }
    /// ln x
    pub fn log(&mut self, x: &Tensor) -> Result<Tensor> {
        self.unary(Unary::Log, x)
    }
    /// x^p
    pub fn pow(&mut self, x: &Tensor, p: f64) -> Result<Tensor> {
        self.unary(Unary::Pow(p), x)
    }
    /// √x
    pub fn sqrt(&mut self, x: &Tensor) -> Result<Tensor> {
        self.unary(Unary::Sqrt, x)
    }
    /// 1/√x
    pub fn rsqrt(&mut self, x: &Tensor) -> Result<Tensor> {
        self.unary(Unary::Rsqrt, x)
    }
    /// transformers' T5 fp16 clamp, `clamp(x, ±on_inf)` when any value of `x` is infinite
    /// and `clamp(x, ±clean)` otherwise, recorded as one `clamp` op. On the host the choice
    /// is made by looking; on a device a flag kernel makes it there (transformers'
    /// `torch.where(isinf(x).any(), ...)`), so the step reads nothing back.
    pub fn clamp_on_inf(&mut self, x: &Tensor, clean: f64, on_inf: f64) -> Result<Tensor> {
        if !x.storage().is_device() {
            let any_inf = x.f32s()?.iter().any(|v| v.is_infinite());
            let v = if any_inf { on_inf } else { clean };
            return self.clamp(x, Some(-v), Some(v));
        }
        self.unary_with(
            Unary::Clamp(Some(-clean), Some(clean)),
            x,
            Some((-on_inf, on_inf)),
        )
    }

    /// clamp(x, lo, hi)
    pub fn clamp(&mut self, x: &Tensor, lo: Option<f64>, hi: Option<f64>) -> Result<Tensor> {
        self.unary(Unary::Clamp(lo, hi), x)
    }
    /// x · s
    pub fn mul_scalar(&mut self, x: &Tensor, s: f64) -> Result<Tensor> {
        self.unary(Unary::MulScalar(s), x)
    }
    /// x + s
    pub fn add_scalar(&mut self, x: &Tensor, s: f64) -> Result<Tensor> {
        self.unary(Unary::AddScalar(s), x)
    }
}

#[cfg(test)]
mod tests {
    use super::Unary;

    /// `reads` names every argument `df` uses: with the others replaced by NaN, the
    /// derivative is the same, for every op and values across signs and magnitudes.
    #[test]
    fn unary_derivatives_read_only_what_reads_names() {
        let ops = [
            Unary::Neg,
            Unary::Relu,
            Unary::GeluErf,
            Unary::GeluTanh,
            Unary::Silu,
            Unary::Tanh,
            Unary::Sigmoid,
            Unary::Exp,
            Unary::Log,
            Unary::Sqrt,
            Unary::Rsqrt,
            Unary::Pow(2.0),
            Unary::Pow(3.0),
            Unary::Pow(1.0),
            Unary::Pow(-1.5),
            Unary::Clamp(Some(-1.0), Some(2.0)),
            Unary::MulScalar(0.125),
            Unary::AddScalar(3.0),
        ];
        for op in ops {
            let (rx, ry) = op.reads();
            for x in [-3.5f32, -1.0, -0.0, 0.25, 1.5, 7.0] {
                let y = op.f(x);
                for g in [1.0f32, -0.5] {
                    let want = op.df(x, y, g);
                    let got = op.df(
                        if rx { x } else { f32::NAN },
                        if ry { y } else { f32::NAN },
                        g,
                    );
                    assert_eq!(got.to_bits(), want.to_bits(), "{op:?} at x = {x}");
                }
            }
        }
    }
}
