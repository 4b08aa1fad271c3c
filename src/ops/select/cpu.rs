//! The `where` and `masked_fill` kernels on the host.

use super::kernels::{Kernels, Truth};
use super::truth::{masked_count, truth};
use crate::dtype::{DType, RoundCounts};
use crate::engine::Computed;
use crate::error::{Error, Result};
use crate::ops::{bstrides, for_each_offset, sum_to, with_float, Finish};
use crate::tensor::{numel, strides, Storage, Tensor};
use std::sync::Arc;

/// Picks `a` where `c` is true and `b` elsewhere, over the broadcast `out` shape.
pub(super) fn pick<T: Copy>(
    c: &[bool],
    a: &[T],
    b: &[T],
    strides: [&[usize]; 3],
    out: &[usize],
) -> Arc<Vec<T>> {
    let mut v = Vec::with_capacity(numel(out));
    for_each_offset(out, strides, |[i, j, k]| {
        v.push(if c[i] { a[j] } else { b[k] })
    });
    Arc::new(v)
}

/// The gradient of one branch of `where`: `g` where the condition equals `branch`, zero
/// elsewhere, summed down to the branch's shape in f64 and rounded once.
pub(super) fn where_grad<T: Finish>(
    c: &[bool],
    cs: &[usize],
    g: &[T],
    out: &[usize],
    branch: bool,
    target: &[usize],
    dtype: DType,
) -> Result<Computed> {
    let mut full = Vec::with_capacity(g.len());
    for_each_offset(out, [cs, &strides(out)], |[i, k]| {
        full.push(if c[i] == branch { g[k] } else { T::zero() })
    });
    sum_to(&full, out, target, dtype)
}

/// `x` with `v` written where the broadcast mask is true (`v` is exact in the dtype).
pub(super) fn fill<T: Finish>(
    x: &[T],
    m: &[bool],
    ms: &[usize],
    v: f64,
    shape: &[usize],
    dtype: DType,
) -> Result<Computed> {
    let mut y = Vec::with_capacity(x.len());
    let v = T::of(v);
    for_each_offset(shape, [ms, &strides(shape)], |[i, k]| {
        y.push(if m[i] { v } else { x[k] })
    });
    T::finish(y, shape, dtype)
}

/// The host's selection kernels.
pub(super) struct Host;

/// The host truth values of a forward that ran here.
fn host_truth<'a>(t: &'a Truth, op: &str) -> Result<(&'a [bool], &'a [usize])> {
    match t {
        Truth::Host(v, s) => Ok((v, s)),
        Truth::Device(_) => Err(Error::Device(format!(
            "{op} backward: the forward's condition is on a device"
        ))),
    }
}

impl Kernels for Host {
    fn where_(
        &self,
        cond: &Tensor,
        a: &Tensor,
        b: &Tensor,
        out_shape: &[usize],
    ) -> Result<(Computed, Truth)> {
        const OP: &str = "where";
        let c = truth(cond, OP)?;
        let (sc, sa, sb) = (
            bstrides(cond.shape(), out_shape),
            bstrides(a.shape(), out_shape),
            bstrides(b.shape(), out_shape),
        );
        let st = [sc.as_slice(), &sa, &sb];
        let storage = match (a.storage(), b.storage()) {
            (Storage::F32(x), Storage::F32(y)) => Storage::F32(pick(&c, x, y, st, out_shape)),
            (Storage::F64(x), Storage::F64(y)) => Storage::F64(pick(&c, x, y, st, out_shape)),
            (Storage::I64(x), Storage::I64(y)) => Storage::I64(pick(&c, x, y, st, out_shape)),
            _ => return Err(Error::shape(OP, "branches have different storage")),
        };
        let out = Tensor::from_storage(storage, out_shape, a.dtype())?;
        Ok((
            Computed::new(out, RoundCounts::default()),
            Truth::Host(c, sc),
        ))
    }

    fn where_grad(
        &self,
        c: &Truth,
        g: &Tensor,
        out_shape: &[usize],
        on: bool,
        target: &[usize],
        dtype: DType,
    ) -> Result<Computed> {
        let (c, sc) = host_truth(c, "where")?;
        with_float!(g, "where", |gd| where_grad(
            c, sc, gd, out_shape, on, target, dtype
        ))
    }

    fn masked_fill(
        &self,
        x: &Tensor,
        mask: &Tensor,
        value: f64,
        v: f64,
        fill_underflowed: bool,
    ) -> Result<(Computed, Truth)> {
        const OP: &str = "masked_fill";
        let (shape, dtype) = (x.shape(), x.dtype());
        let m = truth(mask, OP)?;
        let ms = bstrides(mask.shape(), shape);
        let mut out = with_float!(x, OP, |d| fill(d, &m, &ms, v, shape, dtype))?;
        let masked = masked_count(&m, mask.shape(), shape);
        out.rounding = RoundCounts {
            overflow: 0,
            underflow: if fill_underflowed { masked } else { 0 },
        };
        if value == f64::NEG_INFINITY {
            out.masked_neg_inf = masked;
        }
        Ok((out, Truth::Host(m, ms)))
    }

    fn masked_fill_backward(&self, g: &Tensor, m: &Truth, dtype: DType) -> Result<Computed> {
        let (m, ms) = host_truth(m, "masked_fill")?;
        with_float!(g, "masked_fill", |gd| fill(
            gd,
            m,
            ms,
            0.0,
            g.shape(),
            dtype
        ))
    }
}
