//! The layer-norm, embedding-gradient and dropout kernels on the host.

use super::*;

/// Per-row mean and 1/√(var + eps) of `x` split in rows of `d`, accumulated in f64 (two
/// passes, biased variance) and converted once to T.
pub(super) fn row_stats<T: Real>(x: &[T], d: usize, eps: f64) -> (Vec<T>, Vec<T>) {
    let rows = x.len() / d;
    let mut mean = Vec::with_capacity(rows);
    let mut rstd = Vec::with_capacity(rows);
    for r in x.chunks(d) {
        let m = r.iter().map(|v| v.f64()).sum::<f64>() / d as f64;
        let var = r.iter().map(|v| (v.f64() - m).powi(2)).sum::<f64>() / d as f64;
        mean.push(T::of(m));
        rstd.push(T::of(1.0 / (var + eps).sqrt()));
    }
    (mean, rstd)
}

pub(super) fn layer_norm_fwd<T: Finish>(
    x: &[T],
    w: Option<&[T]>,
    b: Option<&[T]>,
    d: usize,
    (mean, rstd): (&[T], &[T]),
    shape: &[usize],
    dtype: crate::DType,
) -> Result<Computed> {
    let mut y = Vec::with_capacity(x.len());
    for ((r, &m), &s) in x.chunks(d).zip(mean).zip(rstd) {
        for (j, &v) in r.iter().enumerate() {
            let mut o = (v - m) * s;
            if let Some(w) = w {
                o = o * w[j];
            }
            if let Some(b) = b {
                o = o + b[j];
            }
            y.push(o);
        }
    }
    T::finish(y, shape, dtype)
}

/// Gradients of layer norm: input (always), weight and bias (when present).
#[allow(clippy::too_many_arguments)]
pub(super) fn layer_norm_bwd<T: Finish>(
    x: &[T],
    w: Option<&[T]>,
    g: &[T],
    d: usize,
    (mean, rstd): (&[T], &[T]),
    shape: &[usize],
    has_b: bool,
    dtype: crate::DType,
) -> Result<Vec<Option<crate::engine::Grad>>> {
    let mut gx = Vec::with_capacity(x.len());
    let mut gw = vec![0f64; d];
    let mut gb = vec![0f64; d];
    let mut xhat = vec![T::zero(); d];
    let mut gh = vec![T::zero(); d];
    for (((r, gr), &m), &s) in x.chunks(d).zip(g.chunks(d)).zip(mean).zip(rstd) {
        let (mut s1, mut s2) = (0f64, 0f64);
        for j in 0..d {
            xhat[j] = (r[j] - m) * s;
            gh[j] = match w {
                Some(w) => gr[j] * w[j],
                None => gr[j],
            };
            s1 += gh[j].f64();
            s2 += (gh[j] * xhat[j]).f64();
            gw[j] += (gr[j] * xhat[j]).f64();
            gb[j] += gr[j].f64();
        }
        let (a, c) = (T::of(s1 / d as f64), T::of(s2 / d as f64));
        for j in 0..d {
            gx.push(s * (gh[j] - a - xhat[j] * c));
        }
    }
    let mut out = vec![grad(T::finish(gx, shape, dtype)?)];
    if w.is_some() {
        out.push(grad(T::finish_acc(gw, &[d], dtype)?));
    }
    if has_b {
        out.push(grad(T::finish_acc(gb, &[d], dtype)?));
    }
    Ok(out)
}

/// Scatter-adds the rows of `g` into a [V, D] gradient at `ids`, in f64, rounded once.
pub(super) fn embedding_bwd<T: Finish>(
    g: &[T],
    ids: &[i64],
    v: usize,
    d: usize,
    pad: i64,
    dtype: crate::DType,
) -> Result<Computed> {
    let mut acc = vec![0f64; v * d];
    for (&id, row) in ids.iter().zip(g.chunks(d.max(1))) {
        if id == pad {
            continue;
        }
        let dst = &mut acc[id as usize * d..(id as usize + 1) * d];
        for (a, &x) in dst.iter_mut().zip(row) {
            *a += x.f64();
        }
    }
    T::finish_acc(acc, &[v, d], dtype)
}

/// `x · mask · scale` computed in T, rounded once (a NaN or inf in a dropped position
/// gives NaN, as PyTorch's `x * mask * scale` does).
pub(super) fn dropout_apply<T: Finish>(
    x: &[T],
    mask: &[bool],
    scale: f64,
    shape: &[usize],
    dtype: crate::DType,
) -> Result<Computed> {
    let s = T::of(scale);
    let y = x
        .iter()
        .zip(mask)
        .map(|(&v, &k)| if k { v * s } else { v * T::zero() })
        .collect();
    T::finish(y, shape, dtype)
}
