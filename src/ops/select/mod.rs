//! Selection: `torch.where` and `masked_fill`. Values are picked, not computed, so only
//! the fill value of `masked_fill` is ever rounded.

use super::shape::check_grad;
use super::{broadcast_shape, bstrides, expect_float, for_each_offset, grad};
use crate::dtype::{round_f64_to, RoundCounts};
use crate::engine::{BackwardFn, Computed, Engine};
use crate::error::{Error, Result};
use crate::tensor::{Storage, Tensor};

mod cpu;
pub mod cuda;
use cpu::*;

/// Truth values of a condition or mask: nonzero (NaN included) is true.
fn truth(t: &Tensor, op: &str) -> Result<Vec<bool>> {
    Ok(match t.storage() {
        Storage::F32(v) => v.iter().map(|&x| x != 0.0).collect(),
        Storage::F64(v) => v.iter().map(|&x| x != 0.0).collect(),
        Storage::I64(v) => v.iter().map(|&x| x != 0).collect(),
        Storage::Cuda(_) => return Err(super::no_device_kernel(op)),
    })
}

/// Elements of `shape` where the mask (truth values `m` of shape `mask`, broadcast) is set.
fn masked_count(m: &[bool], mask: &[usize], shape: &[usize]) -> u64 {
    let ms = bstrides(mask, shape);
    let mut masked = 0u64;
    for_each_offset(shape, [&ms], |[i]| masked += m[i] as u64);
    masked
}

/// A condition or mask on the device of `like`: itself when it is there already, else its
/// truth values uploaded as int64 0/1 (any host dtype, f64 included, keeps its exact
/// truth).
fn device_truth(t: &Tensor, like: &Tensor, op: &str) -> Result<Tensor> {
    if t.storage().is_device() {
        return Ok(t.clone());
    }
    let dev = like.cuda(op)?.dev.clone();
    let v = truth(t, op)?.into_iter().map(i64::from).collect();
    Tensor::from_i64(v, t.shape())?.to_device(&dev)
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
        if a.storage().is_device() || b.storage().is_device() {
            let c = device_truth(cond, a, OP)?;
            let out = cuda::where_(&c, a, b, &out_shape)?;
            let backward: Option<BackwardFn> = if dtype.is_float() {
                let (ta, tb) = (a.shape().to_vec(), b.shape().to_vec());
                Some(Box::new(move |g: &Tensor| {
                    check_grad(g, &out_shape, OP)?;
                    let branch = |on: bool, target: &[usize]| -> Result<Computed> {
                        let (slot, counts) = super::device_counts(g)?;
                        let r = cuda::where_grad(&c, g, &out_shape, on, target, counts)?;
                        Ok(Computed::pending(r, slot))
                    };
                    Ok(vec![
                        None,
                        grad(branch(true, &ta)?),
                        grad(branch(false, &tb)?),
                    ])
                }))
            } else {
                None
            };
            // Values are picked, not rounded: nothing to count (the probe takes a slot).
            let out = Computed::new(out, RoundCounts::default());
            return self.record(
                OP,
                &[cond, a, b],
                &["condition", "self", "other"],
                out,
                backward,
            );
        }
        let c = truth(cond, OP)?;
        let (sc, sa, sb) = (
            bstrides(cond.shape(), &out_shape),
            bstrides(a.shape(), &out_shape),
            bstrides(b.shape(), &out_shape),
        );
        let st = [sc.as_slice(), &sa, &sb];
        let storage = match (a.storage(), b.storage()) {
            (Storage::F32(x), Storage::F32(y)) => Storage::F32(pick(&c, x, y, st, &out_shape)),
            (Storage::F64(x), Storage::F64(y)) => Storage::F64(pick(&c, x, y, st, &out_shape)),
            (Storage::I64(x), Storage::I64(y)) => Storage::I64(pick(&c, x, y, st, &out_shape)),
            _ => return Err(Error::shape(OP, "branches have different storage")),
        };
        let out = Tensor::from_storage(storage, &out_shape, dtype)?;
        let backward: Option<BackwardFn> = if dtype.is_float() {
            let (ta, tb) = (a.shape().to_vec(), b.shape().to_vec());
            Some(Box::new(move |g: &Tensor| {
                check_grad(g, &out_shape, OP)?;
                let (ga, gb) = super::with_float!(g, OP, |gd| (
                    where_grad(&c, &sc, gd, &out_shape, true, &ta, dtype)?,
                    where_grad(&c, &sc, gd, &out_shape, false, &tb, dtype)?
                ));
                Ok(vec![None, grad(ga), grad(gb)])
            }))
        } else {
            None
        };
        let out = Computed::new(out, RoundCounts::default());
        self.record(
            OP,
            &[cond, a, b],
            &["condition", "self", "other"],
            out,
            backward,
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
        if x.storage().is_device() {
            // A host mask is counted here; a device mask's -inf count stays on the device
            // (the kernel counts it into the op's slot, resolved with the step's read).
            let host_masked = match mask.storage().is_device() {
                true => None,
                false => Some(masked_count(&truth(mask, OP)?, mask.shape(), &shape)),
            };
            let m = device_truth(mask, x, OP)?;
            let (slot, counts) = super::device_counts(x)?;
            let neg_inf = value == f64::NEG_INFINITY;
            let word = match (neg_inf, host_masked) {
                (true, None) => cuda::masked_neg_inf_word(x, slot)?,
                _ => 0,
            };
            let y = cuda::masked_fill(x, &m, v as f32, fill_underflowed, counts, word)?;
            let mut out = Computed::pending(y, slot);
            if neg_inf {
                out.masked_neg_inf = host_masked.unwrap_or(0);
            }
            let bw = Box::new(move |g: &Tensor| {
                check_grad(g, &shape, OP)?;
                let (slot, counts) = super::device_counts(g)?;
                let r = cuda::masked_fill(g, &m, 0.0, false, counts, 0)?;
                Ok(vec![grad(Computed::pending(r, slot)), None])
            });
            return self.record(OP, &[x, mask], &["self", "mask"], out, Some(bw));
        }
        let m = truth(mask, OP)?;
        let ms = bstrides(mask.shape(), &shape);
        let mut out = super::with_float!(x, OP, |d| fill(d, &m, &ms, v, &shape, dtype))?;
        let masked = masked_count(&m, mask.shape(), &shape);
        out.rounding = RoundCounts {
            overflow: 0,
            underflow: if fill_underflowed { masked } else { 0 },
        };
        if value == f64::NEG_INFINITY {
            out.masked_neg_inf = masked;
        }
        let bw = Box::new(move |g: &Tensor| {
            check_grad(g, &shape, OP)?;
            let r = super::with_float!(g, OP, |gd| fill(gd, &m, &ms, 0.0, &shape, dtype))?;
            Ok(vec![grad(r), None])
        });
        self.record(OP, &[x, mask], &["self", "mask"], out, Some(bw))
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
