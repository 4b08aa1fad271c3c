//! Shape ops: reshape/view, squeeze/unsqueeze, transpose, permute, cat and slice.
//!
//! They move values without arithmetic, so they never round (their rounding counts are
//! zero); a gradient is routed back to where each value came from. They also take int64
//! tensors (ids, labels), which get no gradient.
//!
//! On a device, reshapes share the input's memory and the other ops are strided copies
//! (`cuda.rs` + `shape.cu`) described by shape and strides, never by index arrays.

mod cpu;
pub mod cuda;
mod kernels;

pub(crate) use cpu::{gather, scatter};
pub use kernels::Kernels;

use crate::dtype::RoundCounts;
use crate::engine::{BackwardFn, Computed, Engine, Grad};
use crate::error::{Error, Result};
use crate::tensor::{norm_dim, strides, Tensor};

/// The shape kernels of the backend that holds `t`.
pub fn kernels(t: &Tensor) -> &'static dyn Kernels {
    if super::on_device(t) {
        &cuda::Device
    } else {
        &cpu::Host
    }
}

/// Names of the inputs of `cat` for gradient events (one per tensor, up to 64).
static CAT_WRT: [&str; 64] = ["tensors"; 64];

/// Fails unless the gradient `g` has the shape of the op's output.
pub(crate) fn check_grad(g: &Tensor, out: &[usize], op: &str) -> Result<()> {
    if g.shape() != out {
        return Err(Error::shape(
            op,
            format!(
                "gradient has shape {:?}, the output has {:?}",
                g.shape(),
                out
            ),
        ));
    }
    Ok(())
}

/// Where a routing op's output element at index i (row-major over the output shape) comes
/// from: input element `base + Σ i·strides`.
#[derive(Clone)]
struct Route {
    strides: Vec<usize>,
    base: usize,
    /// Every input element is read (a permutation): the gradient needs no zero fill.
    onto: bool,
}

/// Resolves a target shape with at most one -1 for a tensor of `n` elements.
fn resolve_shape(n: usize, shape: &[isize], from: &[usize], op: &str) -> Result<Vec<usize>> {
    let mut infer = None;
    let mut known = 1usize;
    for (i, &s) in shape.iter().enumerate() {
        match s {
            -1 if infer.is_some() => {
                return Err(Error::shape(
                    op,
                    format!("shape {shape:?} has more than one -1"),
                ))
            }
            -1 => infer = Some(i),
            s if s < 0 => {
                return Err(Error::shape(
                    op,
                    format!("shape {shape:?} has a negative size {s} (only -1 is allowed)"),
                ))
            }
            s => known *= s as usize,
        }
    }
    let mut out: Vec<usize> = shape.iter().map(|&s| s.max(0) as usize).collect();
    match infer {
        Some(i) => {
            if known == 0 || !n.is_multiple_of(known) {
                return Err(Error::shape(
                    op,
                    format!("cannot reshape {from:?} ({n} elements) into {shape:?}"),
                ));
            }
            out[i] = n / known;
        }
        None if known != n => {
            return Err(Error::shape(
                op,
                format!("cannot reshape {from:?} ({n} elements) into {shape:?}"),
            ))
        }
        None => {}
    }
    Ok(out)
}

impl Engine {
    /// Records a one-input routing op whose output follows `route` (`None`: the same
    /// order, a reshape). Int64 inputs get no backward.
    fn record_routed(
        &mut self,
        op: &'static str,
        x: &Tensor,
        out_shape: Vec<usize>,
        route: Option<Route>,
    ) -> Result<Tensor> {
        // A bijective route only moves values.
        let permuted = route.as_ref().is_some_and(|r| r.onto);
        let (out, slot) = match &route {
            Some(r) => {
                kernels(x).gather_strided(op, x, &out_shape, (&r.strides, r.base), x.dtype())?
            }
            None => (
                Tensor::from_storage(x.storage().clone(), &out_shape, x.dtype())?,
                None,
            ),
        };
        let (redo_route, redo_shape) = (route.clone(), out_shape.clone());
        let backward: Option<BackwardFn> = if x.dtype().is_float() {
            let (in_shape, dtype) = (x.shape().to_vec(), x.dtype());
            Some(Box::new(move |g: &Tensor| {
                check_grad(g, &out_shape, op)?;
                let (tensor, slot) = match &route {
                    Some(r) => kernels(g).scatter_strided(
                        op,
                        g,
                        (&in_shape, &out_shape),
                        (&r.strides, r.base),
                        r.onto,
                        dtype,
                    )?,
                    None => (
                        Tensor::from_storage(g.storage().clone(), &in_shape, dtype)?,
                        None,
                    ),
                };
                Ok(vec![Some(Grad {
                    tensor,
                    rounding: RoundCounts::default(),
                    slot,
                    permuted,
                    finite: false,
                })])
            }))
        } else {
            None
        };
        let out = Computed {
            slot,
            permuted,
            ..Computed::new(out, RoundCounts::default())
        };
        self.record(
            op,
            &[x],
            &["self"],
            out,
            backward,
            Box::new(move |e: &mut Engine, r: &[Tensor]| {
                e.record_routed(op, &r[0], redo_shape.clone(), redo_route.clone())
            }),
        )
    }

    fn reshape_op(&mut self, op: &'static str, x: &Tensor, shape: &[isize]) -> Result<Tensor> {
        let ins = self.prepare(op, &[x])?;
        let x = &ins[0];
        let to = resolve_shape(x.numel(), shape, x.shape(), op)?;
        self.record_routed(op, x, to, None)
    }

    /// `x.reshape(shape)`: the same values in row-major order under a new shape; one
    /// entry may be -1 (inferred).
    pub fn reshape(&mut self, x: &Tensor, shape: &[isize]) -> Result<Tensor> {
        self.reshape_op("reshape", x, shape)
    }

    /// `x.view(shape)`: as [`Engine::reshape`] (storage is always contiguous here).
    pub fn view(&mut self, x: &Tensor, shape: &[isize]) -> Result<Tensor> {
        self.reshape_op("view", x, shape)
    }

    /// `x.unsqueeze(dim)`: inserts a dimension of size 1 at `dim` (in `-(rank+1)..=rank`).
    pub fn unsqueeze(&mut self, x: &Tensor, dim: isize) -> Result<Tensor> {
        let ins = self.prepare("unsqueeze", &[x])?;
        let x = &ins[0];
        let d = norm_dim(dim, x.rank() + 1, "unsqueeze")?;
        let mut to = x.shape().to_vec();
        to.insert(d, 1);
        self.record_routed("unsqueeze", x, to, None)
    }

    /// `x.squeeze(dim)`: removes `dim` when its size is 1 (otherwise the shape is kept,
    /// as in PyTorch).
    pub fn squeeze(&mut self, x: &Tensor, dim: isize) -> Result<Tensor> {
        let ins = self.prepare("squeeze", &[x])?;
        let x = &ins[0];
        let mut to = x.shape().to_vec();
        if x.rank() > 0 {
            let d = norm_dim(dim, x.rank(), "squeeze")?;
            if to[d] == 1 {
                to.remove(d);
            }
        } else {
            norm_dim(dim, 1, "squeeze")?;
        }
        self.record_routed("squeeze", x, to, None)
    }

    fn permute_op(&mut self, op: &'static str, x: &Tensor, perm: Vec<usize>) -> Result<Tensor> {
        let own = strides(x.shape());
        let out_shape: Vec<usize> = perm.iter().map(|&p| x.shape()[p]).collect();
        let out_strides: Vec<usize> = perm.iter().map(|&p| own[p]).collect();
        let route = Route {
            strides: out_strides,
            base: 0,
            onto: true,
        };
        self.record_routed(op, x, out_shape, Some(route))
    }

    /// `x.transpose(d0, d1)`: swaps two dimensions (the values are moved into a new
    /// contiguous tensor).
    pub fn transpose(&mut self, x: &Tensor, d0: isize, d1: isize) -> Result<Tensor> {
        let ins = self.prepare("transpose", &[x])?;
        let x = &ins[0];
        let r = x.rank();
        let (a, b) = (
            norm_dim(d0, r.max(1), "transpose")?,
            norm_dim(d1, r.max(1), "transpose")?,
        );
        let mut perm: Vec<usize> = (0..r).collect();
        if r > 0 {
            perm.swap(a, b);
        }
        self.permute_op("transpose", x, perm)
    }

    /// `x.permute(dims)`: output dimension `k` is input dimension `dims[k]`.
    pub fn permute(&mut self, x: &Tensor, dims: &[isize]) -> Result<Tensor> {
        let ins = self.prepare("permute", &[x])?;
        let x = &ins[0];
        let r = x.rank();
        if dims.len() != r {
            return Err(Error::shape(
                "permute",
                format!(
                    "dims {dims:?} must list all {r} dimensions of {:?}",
                    x.shape()
                ),
            ));
        }
        let mut seen = vec![false; r];
        let mut perm = Vec::with_capacity(r);
        for &d in dims {
            let p = norm_dim(d, r, "permute")?;
            if std::mem::replace(&mut seen[p], true) {
                return Err(Error::shape(
                    "permute",
                    format!("dims {dims:?} repeat dimension {p}; expected a permutation"),
                ));
            }
            perm.push(p);
        }
        self.permute_op("permute", x, perm)
    }

    /// `x[..., start:end, ...]` along `dim` with Python slice rules: negative bounds count
    /// from the end and bounds are clamped to the size.
    pub fn slice(&mut self, x: &Tensor, dim: isize, start: isize, end: isize) -> Result<Tensor> {
        let ins = self.prepare("slice", &[x])?;
        let x = &ins[0];
        if x.rank() == 0 {
            return Err(Error::shape("slice", "cannot slice a 0-dimensional tensor"));
        }
        let d = norm_dim(dim, x.rank(), "slice")?;
        let n = x.shape()[d] as isize;
        let clamp = |i: isize| (if i < 0 { i + n } else { i }).clamp(0, n) as usize;
        let s = clamp(start);
        let e = clamp(end).max(s);
        let own = strides(x.shape());
        let mut out_shape = x.shape().to_vec();
        out_shape[d] = e - s;
        let route = Route {
            base: s * own[d],
            strides: own,
            onto: e - s == n as usize,
        };
        self.record_routed("slice", x, out_shape, Some(route))
    }

    /// `torch.cat(tensors, dim)`: joins tensors of equal shape except in `dim`. Goes
    /// through autocast's promote rule and native type promotion; int64 tensors can be
    /// joined with each other only.
    pub fn cat(&mut self, tensors: &[&Tensor], dim: isize) -> Result<Tensor> {
        let Some(first) = tensors.first() else {
            return Err(Error::shape("cat", "needs at least one tensor"));
        };
        if tensors.len() > CAT_WRT.len() {
            return Err(Error::shape(
                "cat",
                format!(
                    "joins at most {} tensors, got {}",
                    CAT_WRT.len(),
                    tensors.len()
                ),
            ));
        }
        let ints = tensors.iter().filter(|t| !t.dtype().is_float()).count();
        if ints != 0 && ints != tensors.len() {
            return Err(Error::shape(
                "cat",
                "cannot join int64 and floating-point tensors",
            ));
        }
        let r = first.rank();
        if r == 0 {
            return Err(Error::shape(
                "cat",
                "zero-dimensional tensor (at position 0) cannot be concatenated",
            ));
        }
        let d = norm_dim(dim, r, "cat")?;
        for (i, t) in tensors.iter().enumerate() {
            let same = t.rank() == r && (0..r).all(|k| k == d || t.shape()[k] == first.shape()[k]);
            if !same {
                return Err(Error::shape(
                    "cat",
                    format!(
                        "tensor {i} has shape {:?}; expected {:?} except in dim {d}",
                        t.shape(),
                        first.shape()
                    ),
                ));
            }
        }
        let ins = self.prepare("cat", tensors)?;
        let mut out_shape = first.shape().to_vec();
        out_shape[d] = ins.iter().map(|t| t.shape()[d]).sum();
        let os = strides(&out_shape);
        let offs: Vec<usize> = ins
            .iter()
            .scan(0, |off, t| {
                let o = *off;
                *off += t.shape()[d];
                Some(o * os[d])
            })
            .collect();
        let out = kernels(&ins[0]).cat(&ins, &out_shape, &os, &offs)?;
        let backward: Option<BackwardFn> = if ins[0].dtype().is_float() {
            let shapes: Vec<Vec<usize>> = ins.iter().map(|t| t.shape().to_vec()).collect();
            let (dtype, out_shape) = (ins[0].dtype(), out_shape.clone());
            Some(Box::new(move |g: &Tensor| {
                check_grad(g, &out_shape, "cat")?;
                shapes
                    .iter()
                    .enumerate()
                    .map(|(k, s)| {
                        let (tensor, slot) =
                            kernels(g).gather_strided("cat", g, s, (&os, offs[k]), dtype)?;
                        Ok(Some(Grad {
                            tensor,
                            rounding: RoundCounts::default(),
                            slot,
                            permuted: false,
                            finite: false,
                        }))
                    })
                    .collect()
            }))
        } else {
            None
        };
        let refs: Vec<&Tensor> = ins.iter().collect();
        let out = Computed::new(out, RoundCounts::default());
        self.record(
            "cat",
            &refs,
            &CAT_WRT[..refs.len()],
            out,
            backward,
            Box::new(move |e: &mut Engine, r: &[Tensor]| {
                let refs: Vec<&Tensor> = r.iter().collect();
                e.cat(&refs, dim)
            }),
        )
    }
}

#[cfg(test)]
mod tests {
    use crate::engine::Engine;
    use crate::{DType, Tensor};

    fn arange(shape: &[usize]) -> Tensor {
        let n: usize = shape.iter().product();
        Tensor::from_f32((0..n).map(|i| i as f32).collect(), shape, DType::F32).unwrap()
    }

    fn err(r: crate::Result<Tensor>) -> String {
        match r {
            Ok(t) => panic!("expected an error, got shape {:?}", t.shape()),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn reshape_infers_one_dim_and_keeps_order() {
        let mut e = Engine::new();
        let y = e.reshape(&arange(&[2, 3, 4]), &[-1, 6]).unwrap();
        assert_eq!(y.shape(), &[4, 6]);
        assert_eq!(y.f32s().unwrap()[7], 7.0);
        let v = e.view(&y, &[24]).unwrap();
        assert_eq!(v.shape(), &[24]);
        assert!(err(e.reshape(&y, &[-1, -1])).contains("more than one -1"));
        assert!(err(e.reshape(&y, &[5, -1])).contains("cannot reshape [4, 6]"));
        assert!(err(e.reshape(&y, &[4, 5])).contains("24 elements"));
        assert!(err(e.reshape(&y, &[-2, 12])).contains("negative size -2"));
    }

    #[test]
    fn transpose_and_permute_move_values() {
        let mut e = Engine::new();
        let x = arange(&[2, 3]);
        let t = e.transpose(&x, 0, -1).unwrap();
        assert_eq!(t.shape(), &[3, 2]);
        assert_eq!(t.f32s().unwrap(), &[0.0, 3.0, 1.0, 4.0, 2.0, 5.0]);
        let x = arange(&[2, 3, 4]);
        let p = e.permute(&x, &[2, 0, 1]).unwrap();
        assert_eq!(p.shape(), &[4, 2, 3]);
        let pv = p.f32s().unwrap();
        for a in 0..4 {
            for b in 0..2 {
                for c in 0..3 {
                    // p[a, b, c] = x[b, c, a] = 12 b + 4 c + a
                    assert_eq!(pv[a * 6 + b * 3 + c], (12 * b + 4 * c + a) as f32);
                }
            }
        }
        assert!(err(e.permute(&x, &[0, 0, 1])).contains("expected a permutation"));
        assert!(err(e.permute(&x, &[0, 1])).contains("all 3 dimensions"));
        assert!(err(e.transpose(&x, 0, 3)).contains("dim 3 out of range for rank 3"));
    }

    #[test]
    fn slice_follows_python_rules() {
        let mut e = Engine::new();
        let x = arange(&[3, 5]);
        let s = e.slice(&x, 1, 1, -1).unwrap();
        assert_eq!(s.shape(), &[3, 3]);
        assert_eq!(
            s.f32s().unwrap(),
            &[1.0, 2.0, 3.0, 6.0, 7.0, 8.0, 11.0, 12.0, 13.0]
        );
        let s = e.slice(&x, 0, -1, 100).unwrap();
        assert_eq!(s.f32s().unwrap(), &[10.0, 11.0, 12.0, 13.0, 14.0]);
        let s = e.slice(&x, 0, 2, 1).unwrap();
        assert_eq!(s.shape(), &[0, 5]);
        assert!(err(e.slice(&x, 2, 0, 1)).contains("dim 2 out of range"));
    }

    #[test]
    fn cat_joins_along_a_dim_and_promotes() {
        let mut e = Engine::new();
        let a = arange(&[2, 2]);
        let b = Tensor::from_f32(
            vec![10.0, 11.0, 12.0, 13.0, 14.0, 15.0],
            &[2, 3],
            DType::F16,
        )
        .unwrap();
        let c = e.cat(&[&a, &b], 1).unwrap();
        assert_eq!(c.dtype(), DType::F32);
        assert_eq!(c.shape(), &[2, 5]);
        assert_eq!(
            c.f32s().unwrap(),
            &[0.0, 1.0, 10.0, 11.0, 12.0, 2.0, 3.0, 13.0, 14.0, 15.0]
        );
        let r = e.cat(&[&a, &b], 0);
        assert!(err(r).contains("tensor 1 has shape [2, 3]; expected [2, 2] except in dim 0"));
        let i = Tensor::from_i64(vec![1, 2], &[1, 2]).unwrap();
        assert!(err(e.cat(&[&a, &i], 0)).contains("int64 and floating-point"));
        assert!(err(e.cat(&[], 0)).contains("at least one"));
    }

    #[test]
    fn int64_tensors_are_reshaped_sliced_and_joined_without_a_tape() {
        let mut e = Engine::new();
        let ids = Tensor::from_i64((0..6).collect(), &[2, 3])
            .unwrap()
            .as_leaf(false);
        let r = e.reshape(&ids, &[3, 2]).unwrap();
        assert_eq!(r.i64s().unwrap(), &[0, 1, 2, 3, 4, 5]);
        let s = e.slice(&ids, 1, 1, 3).unwrap();
        assert_eq!(s.i64s().unwrap(), &[1, 2, 4, 5]);
        let c = e.cat(&[&ids, &s], 1).unwrap();
        assert_eq!(c.i64s().unwrap(), &[0, 1, 2, 1, 2, 3, 4, 5, 4, 5]);
        let t = e.transpose(&ids, 0, 1).unwrap();
        assert_eq!(t.i64s().unwrap(), &[0, 3, 1, 4, 2, 5]);
        assert_eq!(e.tape_len(), 0);
    }

    #[test]
    fn squeeze_and_unsqueeze() {
        let mut e = Engine::new();
        let x = arange(&[2, 3]);
        let u = e.unsqueeze(&x, -1).unwrap();
        assert_eq!(u.shape(), &[2, 3, 1]);
        let u0 = e.unsqueeze(&x, 0).unwrap();
        assert_eq!(u0.shape(), &[1, 2, 3]);
        assert_eq!(e.squeeze(&u, 2).unwrap().shape(), &[2, 3]);
        assert_eq!(e.squeeze(&u, 0).unwrap().shape(), &[2, 3, 1]);
        assert!(err(e.unsqueeze(&x, 3)).contains("out of range"));
    }

    #[test]
    fn slice_gradient_is_zero_outside_the_slice() {
        let mut e = Engine::new();
        let x = arange(&[2, 3]).as_leaf(true);
        let s = e.slice(&x, 1, 1, 2).unwrap();
        let g = Tensor::from_f32(vec![5.0, 7.0], &[2, 1], DType::F32).unwrap();
        let grads = e.backward_with(&s, g).unwrap();
        assert_eq!(
            grads[&x.id()].f32s().unwrap(),
            &[0.0, 5.0, 0.0, 0.0, 7.0, 0.0]
        );
    }
}
