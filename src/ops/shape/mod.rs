//! Shape ops: reshape/view, squeeze/unsqueeze, transpose, permute, cat and slice.
//!
//! They move values without arithmetic, so they never round (their rounding counts are
//! zero); a gradient is routed back to where each value came from. They also take int64
//! tensors (ids, labels), which get no gradient.
//!
//! On a device, reshapes share the input's memory and the other ops are strided copies
//! (`cuda.rs` + `shape.cu`) described by shape and strides, never by index arrays.

pub mod cuda;

use super::for_each_offset;
use crate::dtype::RoundCounts;
use crate::engine::{BackwardFn, Computed, Engine, Grad};
use crate::error::{Error, Result};
use crate::tensor::{norm_dim, numel, strides, Storage, Tensor};
use std::sync::Arc;

/// Names of the inputs of `cat` for gradient events (one per tensor, up to 64).
static CAT_WRT: [&str; 64] = ["tensors"; 64];

/// A new storage of the same kind holding `src[idx[i]]` at position `i` (host storage;
/// `op` names the op in the error for device storage).
pub(crate) fn gather(src: &Storage, idx: &[usize], op: &str) -> Result<Storage> {
    fn pick<T: Copy>(v: &[T], idx: &[usize]) -> Arc<Vec<T>> {
        Arc::new(idx.iter().map(|&i| v[i]).collect())
    }
    Ok(match src {
        Storage::F32(v) => Storage::F32(pick(v, idx)),
        Storage::F64(v) => Storage::F64(pick(v, idx)),
        Storage::I64(v) => Storage::I64(pick(v, idx)),
        Storage::Cuda(_) => return Err(super::no_device_kernel(op)),
    })
}

/// A zero storage of `n` elements with each part's element `i` written at `idx[i]`;
/// every part must have the storage kind of the first.
pub(crate) fn scatter(parts: &[(&Storage, &[usize])], n: usize, op: &str) -> Result<Storage> {
    fn put<T: Copy>(out: &mut [T], v: &[T], idx: &[usize]) {
        for (&x, &i) in v.iter().zip(idx) {
            out[i] = x;
        }
    }
    let mixed = || Error::shape(op, "inputs have different storage kinds (int and float)");
    let Some((first, _)) = parts.first() else {
        return Err(Error::shape(op, "nothing to scatter"));
    };
    Ok(match first {
        Storage::F32(_) => {
            let mut out = vec![0f32; n];
            for (s, idx) in parts {
                let Storage::F32(v) = s else {
                    return Err(mixed());
                };
                put(&mut out, v, idx);
            }
            Storage::F32(Arc::new(out))
        }
        Storage::F64(_) => {
            let mut out = vec![0f64; n];
            for (s, idx) in parts {
                let Storage::F64(v) = s else {
                    return Err(mixed());
                };
                put(&mut out, v, idx);
            }
            Storage::F64(Arc::new(out))
        }
        Storage::I64(_) => {
            let mut out = vec![0i64; n];
            for (s, idx) in parts {
                let Storage::I64(v) = s else {
                    return Err(mixed());
                };
                put(&mut out, v, idx);
            }
            Storage::I64(Arc::new(out))
        }
        Storage::Cuda(_) => return Err(super::no_device_kernel(op)),
    })
}

/// A new host storage holding, in row-major order over `shape`, the elements of `src` laid
/// out with `strides` from `base` (a permuted or sliced copy without an index list). Large
/// copies run over rayon's threads, one slab of the first dim each.
fn gather_strided(
    src: &Storage,
    shape: &[usize],
    strides: &[usize],
    base: usize,
    op: &str,
) -> Result<Storage> {
    fn copy<T: Copy + Default + Send + Sync>(
        v: &[T],
        shape: &[usize],
        strides: &[usize],
        base: usize,
    ) -> Arc<Vec<T>> {
        use rayon::prelude::*;
        let n = numel(shape);
        let mut out = vec![T::default(); n];
        let slab = |o: &mut [T], sub: &[usize], st: &[usize], b: usize| {
            if let (Some((&inner, outer)), Some((&1, ost))) = (sub.split_last(), st.split_last()) {
                // Rows contiguous in the source: copied a row at a time.
                if inner > 0 {
                    for (row, dst) in o.chunks_exact_mut(inner).enumerate() {
                        let at = b + row_offset(row, outer, ost);
                        dst.copy_from_slice(&v[at..at + inner]);
                    }
                }
                return;
            }
            // Elements apart in the source: the last two dims copied as tiles, so that
            // both sides stay in cache (a transpose).
            if let [outer @ .., r, c] = sub {
                let ([os @ .., sr, sc], rc) = (st, r * c) else {
                    unreachable!("strides have the shape's rank")
                };
                let mut k = 0;
                for_each_offset(outer, [os], |[i]| {
                    for_tiles(*r, *c, |rr, cc| {
                        o[k + rr * c + cc] = v[b + i + rr * sr + cc * sc]
                    });
                    k += rc;
                });
                return;
            }
            let mut k = 0;
            for_each_offset(sub, [st], |[i]| {
                o[k] = v[b + i];
                k += 1;
            });
        };
        // A 2-D copy with its elements apart is tiled whole rather than split in rows.
        let rows_apart = shape.len() == 2 && strides[1] != 1;
        if n >= super::PAR_MIN && shape.len() > 1 && shape[0] > 1 && !rows_apart {
            let inner = n / shape[0];
            out.par_chunks_mut(inner)
                .enumerate()
                .for_each(|(i, o)| slab(o, &shape[1..], &strides[1..], base + i * strides[0]));
        } else if n > 0 {
            slab(&mut out, shape, strides, base);
        }
        Arc::new(out)
    }
    Ok(match src {
        Storage::F32(v) => Storage::F32(copy(v, shape, strides, base)),
        Storage::F64(v) => Storage::F64(copy(v, shape, strides, base)),
        Storage::I64(v) => Storage::I64(copy(v, shape, strides, base)),
        Storage::Cuda(_) => return Err(super::no_device_kernel(op)),
    })
}

/// Calls `f(row, col)` over an `r` × `c` block in square tiles (a transpose's reads or
/// writes then stay within a few cache lines per tile).
#[inline(always)]
fn for_tiles(r: usize, c: usize, mut f: impl FnMut(usize, usize)) {
    const TILE: usize = 16;
    for r0 in (0..r).step_by(TILE) {
        for c0 in (0..c).step_by(TILE) {
            for rr in r0..(r0 + TILE).min(r) {
                for cc in c0..(c0 + TILE).min(c) {
                    f(rr, cc);
                }
            }
        }
    }
}

/// The flat offset of row `row` (row-major over the dims `shape`) laid out with `strides`.
fn row_offset(mut row: usize, shape: &[usize], strides: &[usize]) -> usize {
    let mut off = 0;
    for (&d, &s) in shape.iter().zip(strides).rev() {
        off += (row % d) * s;
        row /= d;
    }
    off
}

/// The gradient of [`gather_strided`]: a zero host storage of `n` elements with `g`'s
/// elements (row-major over `shape`) written where the copy read them.
fn scatter_strided(
    g: &Storage,
    n: usize,
    shape: &[usize],
    strides: &[usize],
    base: usize,
    op: &str,
) -> Result<Storage> {
    place_parts(&[(g, shape, base)], n, strides, op)
}

/// A zero host storage of `n` elements with each part's elements (row-major over its shape)
/// written at `base + Σ i·strides`; every part must have the storage kind of the first.
fn place_parts(
    parts: &[(&Storage, &[usize], usize)],
    n: usize,
    strides: &[usize],
    op: &str,
) -> Result<Storage> {
    fn fill<T: Copy + Default>(
        data: &[&[T]],
        parts: &[(&Storage, &[usize], usize)],
        n: usize,
        strides: &[usize],
    ) -> Arc<Vec<T>> {
        let mut out = vec![T::default(); n];
        for (g, (_, shape, base)) in data.iter().zip(parts) {
            put_strided(&mut out, g, shape, strides, *base);
        }
        Arc::new(out)
    }
    // Every part's data as the first part's kind, or an error naming the op.
    macro_rules! fill_as {
        ($kind:ident) => {{
            let data = parts
                .iter()
                .map(|(s, _, _)| match s {
                    Storage::$kind(v) => Some(&v[..]),
                    _ => None,
                })
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| {
                    Error::shape(op, "inputs have different storage kinds (int and float)")
                })?;
            Storage::$kind(fill(&data, parts, n, strides))
        }};
    }
    let Some((first, _, _)) = parts.first() else {
        return Err(Error::shape(op, "nothing to place"));
    };
    Ok(match first {
        Storage::F32(_) => fill_as!(F32),
        Storage::F64(_) => fill_as!(F64),
        Storage::I64(_) => fill_as!(I64),
        Storage::Cuda(_) => return Err(super::no_device_kernel(op)),
    })
}

/// Writes `g` (row-major over `shape`) into `out` at `base + Σ i·strides`.
fn put_strided<T: Copy>(out: &mut [T], g: &[T], shape: &[usize], strides: &[usize], base: usize) {
    if let (Some((&inner, outer)), Some((&1, ost))) = (shape.split_last(), strides.split_last()) {
        // Rows contiguous in the destination: written a row at a time.
        if inner > 0 {
            for (row, src) in g[..numel(shape)].chunks_exact(inner).enumerate() {
                let at = base + row_offset(row, outer, ost);
                out[at..at + inner].copy_from_slice(src);
            }
        }
        return;
    }
    if let ([outer @ .., r, c], [os @ .., sr, sc]) = (shape, strides) {
        let (mut k, rc) = (0, r * c);
        for_each_offset(outer, [os], |[i]| {
            for_tiles(*r, *c, |rr, cc| {
                out[base + i + rr * sr + cc * sc] = g[k + rr * c + cc]
            });
            k += rc;
        });
        return;
    }
    let mut k = 0;
    for_each_offset(shape, [strides], |[i]| {
        out[base + i] = g[k];
        k += 1;
    });
}

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
            if known == 0 || n % known != 0 {
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
        let device = x.storage().is_device();
        // A bijective route only moves values.
        let permuted = route.as_ref().is_some_and(|r| r.onto);
        let mut slot = None;
        let out = match &route {
            Some(r) if device => {
                let (s, sink) = super::device_out(x)?;
                slot = Some(s);
                cuda::gather_strided(op, x, &out_shape, (&r.strides, r.base), sink)?
            }
            Some(r) => Tensor::from_storage(
                gather_strided(x.storage(), &out_shape, &r.strides, r.base, op)?,
                &out_shape,
                x.dtype(),
            )?,
            None => Tensor::from_storage(x.storage().clone(), &out_shape, x.dtype())?,
        };
        let backward: Option<BackwardFn> = if x.dtype().is_float() {
            let (in_shape, dtype) = (x.shape().to_vec(), x.dtype());
            Some(Box::new(move |g: &Tensor| {
                check_grad(g, &out_shape, op)?;
                let mut slot = None;
                let tensor = match &route {
                    Some(r) if g.storage().is_device() => {
                        let (s, sink) = super::device_out(g)?;
                        slot = Some(s);
                        cuda::scatter_strided(
                            op,
                            g,
                            &in_shape,
                            (&r.strides, r.base),
                            !r.onto,
                            sink,
                        )?
                    }
                    Some(r) => Tensor::from_storage(
                        scatter_strided(
                            g.storage(),
                            numel(&in_shape),
                            &out_shape,
                            &r.strides,
                            r.base,
                            op,
                        )?,
                        &in_shape,
                        dtype,
                    )?,
                    None => Tensor::from_storage(g.storage().clone(), &in_shape, dtype)?,
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
        self.record(op, &[x], &["self"], out, backward)
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
        let device = ins[0].storage().is_device();
        let out = if device {
            let dev = super::cuda::device_of("cat", &ins.iter().collect::<Vec<_>>())?;
            let out = super::cuda::output(&dev, &out_shape, ins[0].dtype())?;
            for (t, &o) in ins.iter().zip(&offs) {
                cuda::copy(
                    "cat",
                    t,
                    &out,
                    t.shape(),
                    (&strides(t.shape()), 0),
                    (&os, o),
                    super::cuda::Out::NONE,
                )?;
            }
            out
        } else {
            // Each input's rows copied into place in the output's layout.
            let parts: Vec<(&Storage, &[usize], usize)> = ins
                .iter()
                .zip(&offs)
                .map(|(t, &o)| (t.storage(), t.shape(), o))
                .collect();
            let storage = place_parts(&parts, numel(&out_shape), &os, "cat")?;
            Tensor::from_storage(storage, &out_shape, ins[0].dtype())?
        };
        let backward: Option<BackwardFn> = if ins[0].dtype().is_float() {
            let shapes: Vec<Vec<usize>> = ins.iter().map(|t| t.shape().to_vec()).collect();
            let (dtype, out_shape) = (ins[0].dtype(), out_shape.clone());
            Some(Box::new(move |g: &Tensor| {
                check_grad(g, &out_shape, "cat")?;
                shapes
                    .iter()
                    .enumerate()
                    .map(|(k, s)| {
                        let mut slot = None;
                        let tensor = if g.storage().is_device() {
                            let (at, sink) = super::device_out(g)?;
                            slot = Some(at);
                            cuda::gather_strided("cat", g, s, (&os, offs[k]), sink)?
                        } else {
                            let part = gather_strided(g.storage(), s, &os, offs[k], "cat")?;
                            Tensor::from_storage(part, s, dtype)?
                        };
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
        self.record("cat", &refs, &CAT_WRT[..refs.len()], out, backward)
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
