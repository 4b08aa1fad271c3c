//! Elementwise ops: unary maps, scalar ops and broadcasting binary arithmetic.
//!
//! The op definitions and their recording live here; the kernels per backend beside them
//! (`cpu.rs` on the host, `cuda.rs` + `elementwise.cu` on a device).

mod cpu;
pub mod cuda;
mod functions;
mod kernels;

pub use functions::{Binary, Unary};
pub use kernels::{Kernels, Side};

use super::shape::check_grad;
use super::{expect_float, grad};
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

/// The elementwise kernels of the backend that holds `t`.
pub fn kernels(t: &Tensor) -> &'static dyn Kernels {
    if super::on_device(t) {
        &cuda::Device
    } else {
        &cpu::Host
    }
}

impl Engine {
    /// Applies a unary elementwise op, recording it.
    pub fn unary(&mut self, op: Unary, x: &Tensor) -> Result<Tensor> {
        self.unary_with(op, x, None)
    }

    /// [`Engine::unary`]; `on_inf` are the two parameters that replace the op's own when
    /// the input holds an inf, decided beside the values by a backend that does not read
    /// them back ([`Kernels::any_inf`]).
    fn unary_with(&mut self, op: Unary, x: &Tensor, on_inf: Option<(f64, f64)>) -> Result<Tensor> {
        expect_float(x, op.name(), "input")?;
        let ins = self.prepare(op.name(), &[x])?;
        let x = &ins[0];
        let (out, kept) = kernels(x).unary(op, x, on_inf)?;
        let out = self.output_as_saved(out)?;
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
            let dx = kernels(g).unary_backward(op, (xs, ys, g), dtype, kept.as_ref(), on_inf)?;
            Ok(vec![grad(dx)])
        });
        self.record(
            op.name(),
            &[x],
            &["input"],
            out,
            Some(bw),
            Box::new(move |e: &mut Engine, r: &[Tensor]| e.unary_with(op, &r[0], on_inf)),
        )
    }

    /// Applies a broadcasting binary op, recording it.
    pub fn binary(&mut self, op: Binary, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        expect_float(a, op.name(), "left operand")?;
        expect_float(b, op.name(), "right operand")?;
        let ins = self.prepare(op.name(), &[a, b])?;
        let (a, b) = (&ins[0], &ins[1]);
        let out_shape = super::broadcast_shape(a.shape(), b.shape(), op.name())?;
        let out = kernels(a).binary(op, a, b, &out_shape)?;
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
            let pass = |target: &[usize]| -> Result<Option<Computed>> {
                if target != out_shape.as_slice() || g.dtype() != dt || g.shape() != target {
                    return Ok(None);
                }
                Ok(Some(Computed::new(
                    Tensor::from_storage(g.storage().clone(), target, dt)?,
                    Default::default(),
                )))
            };
            let sides = [
                Side {
                    shape: &shape_a,
                    values: kept_a.as_ref(),
                },
                Side {
                    shape: &shape_b,
                    values: kept_b.as_ref(),
                },
            ];
            let k = kernels(g);
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
                grads.push(grad(k.binary_grad(op, sides, g, &out_shape, dt, wrt_b)?));
            }
            Ok(grads)
        });
        self.record(
            op.name(),
            &[a, b],
            &["self", "other"],
            out,
            Some(bw),
            Box::new(move |e: &mut Engine, r: &[Tensor]| e.binary(op, &r[0], &r[1])),
        )
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
        match kernels(x).any_inf(x)? {
            Some(any_inf) => {
                let v = if any_inf { on_inf } else { clean };
                self.clamp(x, Some(-v), Some(v))
            }
            None => self.unary_with(
                Unary::Clamp(Some(-clean), Some(clean)),
                x,
                Some((-on_inf, on_inf)),
            ),
        }
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
