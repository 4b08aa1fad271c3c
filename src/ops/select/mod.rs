//! Selection: `torch.where` and `masked_fill`. Values are picked, not computed, so only
//! the fill value of `masked_fill` is ever rounded.

use super::shape::check_grad;
use super::{broadcast_shape, expect_float, grad};
use crate::dtype::round_f64_to;
use crate::engine::{BackwardFn, Engine};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

mod cpu;
pub mod cuda;
mod kernels;
mod truth;

pub use kernels::{Kernels, Truth};

/// The selection kernels of the backend that holds `t`.
pub fn kernels(t: &Tensor) -> &'static dyn Kernels {
    if super::on_device(t) {
        &cuda::Device
    } else {
        &cpu::Host
    }
}

impl Engine {
    /// `torch.where(cond, a, b)` with broadcasting: `a` where `cond` is nonzero, else `b`.
    /// `cond` may be int64 or floating point (a NaN counts as true) and is neither cast
    /// nor differentiated; `a` and `b` follow native type promotion and are both floating
    /// point or both int64.
    pub fn where_(&mut self, cond: &Tensor, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        const OP: &str = "where";
        if a.dtype().is_float() != b.dtype().is_float() {
            return Err(Error::shape(
                OP,
                format!(
                    "branches must both be floating point or both int64, got {} and {}",
                    a.dtype(),
                    b.dtype()
                ),
            ));
        }
        // The condition stays out of promotion: casting it could turn tiny values to 0.
        let ins = self.prepare(OP, &[a, b])?;
        let (a, b) = (&ins[0], &ins[1]);
        let out_shape = broadcast_shape(
            &broadcast_shape(cond.shape(), a.shape(), OP)?,
            b.shape(),
            OP,
        )?;
        let dtype = a.dtype();
        // A device branch puts the op on its device (the other moves there or is refused).
        let kern = kernels(if super::on_device(b) { b } else { a });
        let (out, c) = kern.where_(cond, a, b, &out_shape)?;
        let backward: Option<BackwardFn> = if dtype.is_float() {
            let (ta, tb) = (a.shape().to_vec(), b.shape().to_vec());
            Some(Box::new(move |g: &Tensor| {
                check_grad(g, &out_shape, OP)?;
                let ga = kern.where_grad(&c, g, &out_shape, true, &ta, dtype)?;
                let gb = kern.where_grad(&c, g, &out_shape, false, &tb, dtype)?;
                Ok(vec![None, grad(ga), grad(gb)])
            }))
        } else {
            None
        };
        self.record(
            OP,
            &[cond, a, b],
            &["condition", "self", "other"],
            out,
            backward,
            Box::new(move |e: &mut Engine, r: &[Tensor]| e.where_(&r[0], &r[1], &r[2])),
        )
    }

    /// `x.masked_fill(mask, value)`: `value` where the mask (broadcast to `x`; int64 or
    /// floating point, nonzero = true) is set. As in PyTorch, a finite `value` that
    /// overflows `x`'s dtype is an error (use the dtype's lowest finite value or -inf).
    /// A -inf fill is reported as intentional (`masked_neg_inf`), not as an origin. The
    /// gradient is zero where masked.
    pub fn masked_fill(&mut self, x: &Tensor, mask: &Tensor, value: f64) -> Result<Tensor> {
        const OP: &str = "masked_fill";
        expect_float(x, OP, "input")?;
        let ins = self.prepare(OP, &[x])?;
        let x = &ins[0];
        let shape = x.shape().to_vec();
        if broadcast_shape(&shape, mask.shape(), OP)? != shape {
            return Err(Error::shape(
                OP,
                format!(
                    "mask {:?} does not broadcast to the input {:?}",
                    mask.shape(),
                    shape
                ),
            ));
        }
        let dtype = x.dtype();
        let v = round_f64_to(dtype, value);
        if value.is_finite() && v.is_infinite() {
            return Err(Error::shape(
                OP,
                format!("value {value} cannot be converted to {dtype} without overflow"),
            ));
        }
        let fill_underflowed = value != 0.0 && v == 0.0;
        let kern = kernels(x);
        let (out, m) = kern.masked_fill(x, mask, value, v, fill_underflowed)?;
        let bw = Box::new(move |g: &Tensor| {
            check_grad(g, &shape, OP)?;
            Ok(vec![grad(kern.masked_fill_backward(g, &m, dtype)?), None])
        });
        // (the fill as the op's dtype holds it, in the recomputations too: a mask's
        // lowest finite value is the dtype's own)
        self.record(
            OP,
            &[x, mask],
            &["self", "mask"],
            out,
            Some(bw),
            Box::new(move |e: &mut Engine, r: &[Tensor]| e.masked_fill(&r[0], &r[1], v)),
        )
    }
}

#[cfg(test)]
mod tests {
    use crate::engine::observer::{Observer, OpEvent};
    use crate::engine::Engine;
    use crate::{DType, Tensor};
    use std::sync::{Arc, Mutex};

    fn t32(v: &[f32], shape: &[usize]) -> Tensor {
        Tensor::from_f32(v.to_vec(), shape, DType::F32).unwrap()
    }

    struct Seen(Arc<Mutex<Vec<(String, u64)>>>);
    impl Observer for Seen {
        fn on_op(&mut self, ev: &OpEvent<'_>) {
            if let Ok(mut v) = self.0.lock() {
                v.push((ev.op.to_string(), ev.masked_neg_inf));
            }
        }
        fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
            self
        }
    }

    #[test]
    fn where_broadcasts_condition_and_branches() {
        let mut e = Engine::new();
        let c = Tensor::from_i64(vec![1, 0], &[2, 1]).unwrap();
        let a = t32(&[1.0, 2.0, 3.0], &[3]);
        let b = t32(&[-1.0], &[1]);
        let y = e.where_(&c, &a, &b).unwrap();
        assert_eq!(y.shape(), &[2, 3]);
        assert_eq!(y.f32s().unwrap(), &[1.0, 2.0, 3.0, -1.0, -1.0, -1.0]);
        // A float condition: nonzero and NaN are true, and a tiny value is not cast away.
        let cf = Tensor::from_f64(vec![0.0, 1e-300, f64::NAN], &[3]).unwrap();
        let y = e.where_(&cf, &a, &b).unwrap();
        assert_eq!(y.f32s().unwrap(), &[-1.0, 2.0, 3.0]);
        let bad = t32(&[0.0; 2], &[2]);
        let err = e.where_(&c, &a, &bad).unwrap_err().to_string();
        assert!(err.contains("do not broadcast"), "{err}");
        let ia = Tensor::from_i64(vec![5, 6, 7], &[3]).unwrap();
        let ib = Tensor::from_i64(vec![-100], &[1]).unwrap();
        let y = e.where_(&c, &ia, &ib).unwrap();
        assert_eq!(y.i64s().unwrap(), &[5, 6, 7, -100, -100, -100]);
        let err = e.where_(&c, &ia, &b).unwrap_err().to_string();
        assert!(
            err.contains("must both be floating point or both int64"),
            "{err}"
        );
    }

    #[test]
    fn where_gradient_sums_over_broadcast_dims() {
        let mut e = Engine::new();
        let c = Tensor::from_i64(vec![1, 0, 1, 0, 0, 1], &[2, 3]).unwrap();
        let a = t32(&[1.0, 2.0, 3.0], &[3]).as_leaf(true);
        let b = t32(&[0.0], &[1]).as_leaf(true);
        let y = e.where_(&c, &a, &b).unwrap();
        let g = t32(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]);
        let grads = e.backward_with(&y, g).unwrap();
        assert_eq!(grads[&a.id()].f32s().unwrap(), &[1.0, 0.0, 9.0]);
        assert_eq!(grads[&b.id()].f32s().unwrap(), &[2.0 + 4.0 + 5.0]);
    }

    #[test]
    fn masked_fill_values_counts_and_gradient() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let mut e = Engine::new();
        e.add_observer(Box::new(Seen(seen.clone())));
        let x = t32(&[1.0, 2.0, 3.0, 4.0], &[2, 2]).as_leaf(true);
        let m = Tensor::from_i64(vec![0, 1], &[2]).unwrap();
        let y = e.masked_fill(&x, &m, f64::NEG_INFINITY).unwrap();
        let v = y.f32s().unwrap();
        assert_eq!(v[0], 1.0);
        assert_eq!(v[1], f32::NEG_INFINITY);
        assert_eq!(v[3], f32::NEG_INFINITY);
        let g = t32(&[1.0, 1.0, 1.0, 1.0], &[2, 2]);
        let grads = e.backward_with(&y, g).unwrap();
        assert_eq!(grads[&x.id()].f32s().unwrap(), &[1.0, 0.0, 1.0, 0.0]);
        let ev = seen.lock().unwrap().clone();
        assert_eq!(ev[0], ("masked_fill".to_string(), 2));
        // A finite fill is an ordinary value.
        let y = e.masked_fill(&x, &m, -5.0).unwrap();
        assert_eq!(y.f32s().unwrap(), &[1.0, -5.0, 3.0, -5.0]);
        assert_eq!(seen.lock().unwrap().last().unwrap().1, 0);
    }

    #[test]
    fn masked_fill_rejects_overflowing_values_and_bad_masks() {
        let mut e = Engine::new();
        let h = Tensor::from_f32(vec![1.0, 2.0], &[2], DType::F16).unwrap();
        let m = Tensor::from_i64(vec![1, 0], &[2]).unwrap();
        let err = e.masked_fill(&h, &m, -1e9).unwrap_err().to_string();
        assert_eq!(
            err,
            "masked_fill: value -1000000000 cannot be converted to float16 without overflow"
        );
        let y = e.masked_fill(&h, &m, -65504.0).unwrap();
        assert_eq!(y.f32s().unwrap(), &[-65504.0, 2.0]);
        let y = e.masked_fill(&h, &m, -65519.0).unwrap();
        // -65519 rounds to fp16's lowest finite value (below the overflow threshold 65520).
        assert_eq!(y.f32s().unwrap()[0], -65504.0);
        let m3 = Tensor::from_i64(vec![1, 0, 1], &[3]).unwrap();
        let err = e.masked_fill(&h, &m3, 0.0).unwrap_err().to_string();
        assert!(err.contains("do not broadcast"), "{err}");
        let m21 = Tensor::from_i64(vec![1, 0], &[2, 1]).unwrap();
        let err = e.masked_fill(&h, &m21, 0.0).unwrap_err().to_string();
        assert!(err.contains("does not broadcast to the input [2]"), "{err}");
    }
}
