//! Reductions: sum, mean, max along a dim, softmax and log-softmax.
//!
//! Sums accumulate in f64 and are rounded once to the output dtype. Softmax computes its
//! exponentials in f32 (f64 for the reference dtype) with the row sum in f64, and rounds
//! once, so fp16 inputs never overflow inside the op.

use super::shape::check_grad;
use super::{expect_float, grad};
use crate::dtype::RoundCounts;
use crate::engine::{Computed, Engine, Grad};
use crate::error::{Error, Result};
use crate::tensor::{norm_dim, numel, Tensor};

mod cpu;
pub mod cuda;
mod kernels;

pub use kernels::{Kernels, Lines, MaxIdx};

/// The reduction kernels of the backend that holds `t`.
pub fn kernels(t: &Tensor) -> &'static dyn Kernels {
    if super::on_device(t) {
        &cuda::Device
    } else {
        &cpu::Host
    }
}

/// Which dims of `shape` a reduction over `dims` removes (empty `dims`: all of them).
fn reduced_dims(shape: &[usize], dims: &[isize], op: &str) -> Result<Vec<bool>> {
    let r = shape.len();
    if dims.is_empty() {
        return Ok(vec![true; r]);
    }
    let mut red = vec![false; r];
    for &d in dims {
        // A 0-dimensional tensor accepts dim 0 or -1 and has nothing to reduce.
        let k = norm_dim(d, r.max(1), op)?;
        if r == 0 {
            continue;
        }
        if std::mem::replace(&mut red[k], true) {
            return Err(Error::shape(
                op,
                format!("dim {d} appears more than once in {dims:?}"),
            ));
        }
    }
    Ok(red)
}

/// Splits `shape` around dim `d`: (elements before, size of d, elements after).
fn split_at_dim(shape: &[usize], d: usize) -> (usize, usize, usize) {
    (numel(&shape[..d]), shape[d], numel(&shape[d + 1..]))
}

/// Resolves the dim of a one-dim op; a 0-dimensional tensor acts as shape `[1]`.
fn line_dim(x: &Tensor, dim: isize, op: &str) -> Result<(usize, usize, usize)> {
    if x.rank() == 0 {
        norm_dim(dim, 1, op)?;
        return Ok((1, 1, 1));
    }
    let d = norm_dim(dim, x.rank(), op)?;
    Ok(split_at_dim(x.shape(), d))
}

impl Engine {
    fn sum_op(
        &mut self,
        op: &'static str,
        x: &Tensor,
        dims: &[isize],
        keepdim: bool,
        mean: bool,
    ) -> Result<Tensor> {
        expect_float(x, op, "input")?;
        let ins = self.prepare(op, &[x])?;
        let x = &ins[0];
        let red = reduced_dims(x.shape(), dims, op)?;
        let kept: Vec<usize> = x
            .shape()
            .iter()
            .zip(&red)
            .map(|(&s, &r)| if r { 1 } else { s })
            .collect();
        let out_shape: Vec<usize> = if keepdim {
            kept.clone()
        } else {
            x.shape()
                .iter()
                .zip(&red)
                .filter(|(_, &r)| !r)
                .map(|(&s, _)| s)
                .collect()
        };
        let count = x
            .shape()
            .iter()
            .zip(&red)
            .filter(|(_, &r)| r)
            .map(|(&s, _)| s as f64)
            .product::<f64>();
        let dtype = x.dtype();
        let div = mean.then_some(count);
        let out = kernels(x).sum(op, x, &kept, div, &out_shape)?;
        let full = x.shape().to_vec();
        let bw = Box::new(move |g: &Tensor| {
            check_grad(g, &out_shape, op)?;
            let dx = kernels(g).sum_backward(op, g, (&kept, &full), div, dtype)?;
            Ok(vec![grad(dx)])
        });
        let dims = dims.to_vec();
        self.record(
            op,
            &[x],
            &["self"],
            out,
            Some(bw),
            Box::new(move |e: &mut Engine, r: &[Tensor]| e.sum_op(op, &r[0], &dims, keepdim, mean)),
        )
    }

    /// `x.sum(dims, keepdim)`; an empty `dims` sums over every dim. Accumulates in f64 and
    /// rounds once.
    pub fn sum(&mut self, x: &Tensor, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        self.sum_op("sum", x, dims, keepdim, false)
    }

    /// `x.mean(dims, keepdim)`; an empty `dims` averages over every dim. Accumulates in
    /// f64 and rounds once.
    pub fn mean(&mut self, x: &Tensor, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        self.sum_op("mean", x, dims, keepdim, true)
    }

    /// The values of `x.max(dim, keepdim)`. A NaN is maximal (it propagates); the gradient
    /// goes to the first maximal element of each line.
    pub fn max(&mut self, x: &Tensor, dim: isize, keepdim: bool) -> Result<Tensor> {
        expect_float(x, "max", "input")?;
        let ins = self.prepare("max", &[x])?;
        let x = &ins[0];
        let (outer, n, inner) = line_dim(x, dim, "max")?;
        if n == 0 {
            return Err(Error::shape(
                "max",
                format!(
                    "dim {dim} of {:?} is empty; a maximum needs at least one element",
                    x.shape()
                ),
            ));
        }
        let mut out_shape = x.shape().to_vec();
        if x.rank() > 0 {
            let d = norm_dim(dim, x.rank(), "max")?;
            if keepdim {
                out_shape[d] = 1;
            } else {
                out_shape.remove(d);
            }
        }
        let lines = (outer, n, inner);
        let k = kernels(x);
        let (out, idx) = k.argmax(x, lines, &out_shape)?;
        let (in_shape, dtype) = (x.shape().to_vec(), x.dtype());
        let bw = Box::new(move |g: &Tensor| {
            check_grad(g, &out_shape, "max")?;
            let tensor = k.argmax_backward(g, &idx, lines, &in_shape, dtype)?;
            Ok(vec![Some(Grad {
                tensor,
                rounding: RoundCounts::default(),
                slot: None,
                permuted: false,
                finite: false,
            })])
        });
        let out = Computed::new(out, RoundCounts::default());
        self.record(
            "max",
            &[x],
            &["self"],
            out,
            Some(bw),
            Box::new(move |e: &mut Engine, r: &[Tensor]| e.max(&r[0], dim, keepdim)),
        )
    }

    fn softmax_op(
        &mut self,
        op: &'static str,
        x: &Tensor,
        dim: isize,
        log: bool,
    ) -> Result<Tensor> {
        expect_float(x, op, "input")?;
        let ins = self.prepare(op, &[x])?;
        let x = &ins[0];
        let lines = line_dim(x, dim, op)?;
        let (shape, dtype) = (x.shape().to_vec(), x.dtype());
        let out = self.output_as_saved(kernels(x).softmax(op, x, lines, log)?)?;
        let y = out.tensor.clone();
        let bw = Box::new(move |g: &Tensor| {
            check_grad(g, &shape, op)?;
            let dx = kernels(&y).softmax_backward(op, &y, g, lines, log, dtype)?;
            Ok(vec![grad(dx)])
        });
        self.record(
            op,
            &[x],
            &["self"],
            out,
            Some(bw),
            Box::new(move |e: &mut Engine, r: &[Tensor]| e.softmax_op(op, &r[0], dim, log)),
        )
    }

    /// `torch.softmax(x, dim)`.
    pub fn softmax(&mut self, x: &Tensor, dim: isize) -> Result<Tensor> {
        self.softmax_op("softmax", x, dim, false)
    }

    /// `torch.log_softmax(x, dim)`.
    pub fn log_softmax(&mut self, x: &Tensor, dim: isize) -> Result<Tensor> {
        self.softmax_op("log_softmax", x, dim, true)
    }
}

#[cfg(test)]
mod tests {
    use crate::amp::policy::{DeviceType, PolicyTable};
    use crate::engine::{Autocast, Engine};
    use crate::{DType, Tensor};

    fn t32(v: &[f32], shape: &[usize]) -> Tensor {
        Tensor::from_f32(v.to_vec(), shape, DType::F32).unwrap()
    }

    fn close(a: &[f32], b: &[f64], tol: f64) {
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(b) {
            assert!((*x as f64 - y).abs() <= tol, "{a:?} vs {b:?}");
        }
    }

    #[test]
    fn sum_and_mean_over_dims() {
        let mut e = Engine::new();
        // x[i, j, k] = 6i + 2j + k for shape [2, 3, 2]
        let x = t32(&(0..12).map(|i| i as f32).collect::<Vec<_>>(), &[2, 3, 2]);
        let s = e.sum(&x, &[0, -1], false).unwrap();
        assert_eq!(s.shape(), &[3]);
        // j=0: 0+1+6+7 = 14; j=1: 2+3+8+9 = 22; j=2: 4+5+10+11 = 30
        assert_eq!(s.f32s().unwrap(), &[14.0, 22.0, 30.0]);
        let s = e.sum(&x, &[1], true).unwrap();
        assert_eq!(s.shape(), &[2, 1, 2]);
        assert_eq!(s.f32s().unwrap(), &[6.0, 9.0, 24.0, 27.0]);
        let m = e.mean(&x, &[], false).unwrap();
        assert_eq!(m.shape(), &[] as &[usize]);
        assert_eq!(m.f32s().unwrap(), &[5.5]);
        let m = e.mean(&x, &[2], false).unwrap();
        assert_eq!(m.f32s().unwrap(), &[0.5, 2.5, 4.5, 6.5, 8.5, 10.5]);
        let err = e.sum(&x, &[1, -2], false).unwrap_err().to_string();
        assert!(err.contains("appears more than once"), "{err}");
        let err = e.mean(&x, &[3], false).unwrap_err().to_string();
        assert!(err.contains("dim 3 out of range for rank 3"), "{err}");
    }

    #[test]
    fn fp16_sum_rounds_once() {
        // Summed left to right in fp16, 2048 + 1 rounds back to 2048 (twice); the exact
        // sum 2050 is representable.
        let x = Tensor::from_f32(vec![2048.0, 1.0, 1.0], &[3], DType::F16).unwrap();
        let mut e = Engine::new();
        let s = e.sum(&x, &[], false).unwrap();
        assert_eq!(s.dtype(), DType::F16);
        assert_eq!(s.f32s().unwrap(), &[2050.0]);
    }

    #[test]
    fn max_values_nan_and_gradient_to_the_first_maximum() {
        let mut e = Engine::new();
        let x = t32(&[1.0, 3.0, 3.0, -1.0, f32::NAN, 2.0], &[2, 3]);
        let m = e.max(&x, 1, false).unwrap();
        let v = m.f32s().unwrap();
        assert_eq!(v[0], 3.0);
        assert!(v[1].is_nan());
        let m0 = e.max(&x, 0, true).unwrap();
        assert_eq!(m0.shape(), &[1, 3]);
        assert!(m0.f32s().unwrap()[1].is_nan());
        let leaf = x.as_leaf(true);
        let m = e.max(&leaf, -1, true).unwrap();
        let g = t32(&[10.0, 20.0], &[2, 1]);
        let grads = e.backward_with(&m, g).unwrap();
        assert_eq!(
            grads[&leaf.id()].f32s().unwrap(),
            &[0.0, 10.0, 0.0, 0.0, 20.0, 0.0]
        );
        let empty = t32(&[], &[2, 0]);
        let err = e.max(&empty, 1, false).unwrap_err().to_string();
        assert!(err.contains("is empty"), "{err}");
    }

    #[test]
    fn softmax_and_log_softmax_values() {
        let mut e = Engine::new();
        let x = t32(&[1.0, 2.0, 3.0, 0.0, 0.0, 0.0], &[2, 3]);
        let z: f64 = (1f64).exp() + (2f64).exp() + (3f64).exp();
        let want = [
            1f64.exp() / z,
            2f64.exp() / z,
            3f64.exp() / z,
            1.0 / 3.0,
            1.0 / 3.0,
            1.0 / 3.0,
        ];
        let y = e.softmax(&x, -1).unwrap();
        close(y.f32s().unwrap(), &want, 1e-7);
        let l = e.log_softmax(&x, 1).unwrap();
        let lw: Vec<f64> = want.iter().map(|v| v.ln()).collect();
        close(l.f32s().unwrap(), &lw, 1e-6);
        // Along dim 0 every column is softmax([a, 0]).
        let y0 = e.softmax(&x, 0).unwrap();
        let s = |a: f64| a.exp() / (a.exp() + 1.0);
        close(
            y0.f32s().unwrap(),
            &[
                s(1.0),
                s(2.0),
                s(3.0),
                1.0 - s(1.0),
                1.0 - s(2.0),
                1.0 - s(3.0),
            ],
            1e-7,
        );
        // A fully masked row is NaN, as in PyTorch.
        let m = t32(&[f32::NEG_INFINITY, f32::NEG_INFINITY], &[2]);
        assert!(e.softmax(&m, 0).unwrap().f32s().unwrap()[0].is_nan());
        let err = e.softmax(&x, 2).unwrap_err().to_string();
        assert!(err.contains("softmax: dim 2 out of range"), "{err}");
    }

    #[test]
    fn fp16_softmax_of_large_inputs_is_finite() {
        // exp(60000) overflows every float format; the max is subtracted in f32 first.
        let x =
            Tensor::from_f32(vec![60000.0, 60000.0, -60000.0, 59968.0], &[4], DType::F16).unwrap();
        let mut e = Engine::new();
        let y = e.softmax(&x, 0).unwrap();
        assert_eq!(y.dtype(), DType::F16);
        let v = y.f32s().unwrap();
        assert!(v.iter().all(|a| a.is_finite()), "{v:?}");
        assert_eq!(v[0], v[1]);
        assert_eq!(v[2], 0.0);
        // exp(-32) ≈ 1.3e-14 is far below fp16's smallest subnormal: it underflows to 0.
        assert_eq!(v[3], 0.0);
        assert_eq!(v[0], 0.5);
        let l = e.log_softmax(&x, 0).unwrap();
        assert!(l.f32s().unwrap()[..2].iter().all(|a| a.is_finite()));
        // Under autocast softmax runs in fp32 (fp32_set_opt_dtype).
        e.set_autocast(Some(Autocast {
            dtype: DType::F16,
            table: PolicyTable::for_device(DeviceType::Cuda),
        }));
        let y = e.softmax(&x, 0).unwrap();
        assert_eq!(y.dtype(), DType::F32);
        assert!(y.f32s().unwrap().iter().all(|a| a.is_finite()));
    }
}
