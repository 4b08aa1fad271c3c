//! The layer-norm, embedding-gradient and dropout kernels on the host.

use super::kernels::{Kernels, Mask, Stats};
use crate::dtype::DType;
use crate::engine::{Computed, Grad};
use crate::error::{Error, Result};
use crate::ops::shape::gather;
use crate::ops::{fdata, grad, with_float, FData, Finish};
use crate::ops::{line_piece, produce_in, produce_lines, PAR_MIN};
use crate::rng::Rng;
use crate::tensor::Real;
use crate::tensor::Tensor;

/// Per-row mean and 1/√(var + eps) of `x` split in rows of `d`, accumulated in f64 (two
/// passes, biased variance) and converted once to T. Rows run in parallel when there are
/// many; each row's sums keep their order.
pub(super) fn row_stats<T: Real>(x: &[T], d: usize, eps: f64) -> (Vec<T>, Vec<T>) {
    use rayon::prelude::*;
    let one = |r: &[T]| {
        let m = r.iter().map(|v| v.f64()).sum::<f64>() / d as f64;
        let var = r.iter().map(|v| (v.f64() - m).powi(2)).sum::<f64>() / d as f64;
        (T::of(m), T::of(1.0 / (var + eps).sqrt()))
    };
    if x.len() >= PAR_MIN {
        x.par_chunks(d).map(one).unzip()
    } else {
        x.chunks(d).map(one).unzip()
    }
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
    produce_lines(mean.len(), d, shape, dtype, |l, y: &mut [T]| {
        let (r, m, s) = (&x[l * d..(l + 1) * d], mean[l], rstd[l]);
        for (j, (y, &v)) in y.iter_mut().zip(r).enumerate() {
            let mut v = (v - m) * s;
            if let Some(w) = w {
                v = v * w[j];
            }
            if let Some(b) = b {
                v = v + b[j];
            }
            *y = v;
        }
    })
}

/// Gradients of layer norm: input (always), weight and bias (when present). The input's
/// gradient runs over rows in parallel; the weight's and bias's sums over the rows (in row
/// order, per column) over blocks of columns.
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
    use rayon::prelude::*;
    let gx = produce_in(
        line_piece(d),
        x.len(),
        shape,
        dtype,
        |start, out: &mut [T]| {
            let mut xhat = vec![T::zero(); d];
            let mut gh = vec![T::zero(); d];
            let rows = x[start..].chunks(d).zip(g[start..].chunks(d));
            let stats = mean[start / d..].iter().zip(&rstd[start / d..]);
            for ((o, (r, gr)), (&m, &s)) in out.chunks_mut(d).zip(rows).zip(stats) {
                let (mut s1, mut s2) = (0f64, 0f64);
                for j in 0..d {
                    xhat[j] = (r[j] - m) * s;
                    gh[j] = match w {
                        Some(w) => gr[j] * w[j],
                        None => gr[j],
                    };
                    s1 += gh[j].f64();
                    s2 += (gh[j] * xhat[j]).f64();
                }
                let (a, c) = (T::of(s1 / d as f64), T::of(s2 / d as f64));
                for j in 0..d {
                    o[j] = s * (gh[j] - a - xhat[j] * c);
                }
            }
        },
    )?;
    let mut out = vec![grad(gx)];
    if w.is_some() || has_b {
        let mut gw = vec![0f64; d];
        let mut gb = vec![0f64; d];
        const COLS: usize = 32;
        let block = |(k, (gw, gb)): (usize, (&mut [f64], &mut [f64]))| {
            let j0 = k * COLS;
            let rows = x.chunks(d).zip(g.chunks(d)).zip(mean.iter().zip(rstd));
            for ((r, gr), (&m, &s)) in rows {
                for (c, (a, b)) in gw.iter_mut().zip(gb.iter_mut()).enumerate() {
                    let j = j0 + c;
                    *a += (gr[j] * ((r[j] - m) * s)).f64();
                    *b += gr[j].f64();
                }
            }
        };
        if x.len() >= PAR_MIN {
            let blocks = gw.par_chunks_mut(COLS).zip(gb.par_chunks_mut(COLS));
            blocks.enumerate().for_each(block);
        } else {
            let blocks = gw.chunks_mut(COLS).zip(gb.chunks_mut(COLS));
            blocks.enumerate().for_each(block);
        }
        if w.is_some() {
            out.push(grad(T::finish_acc(gw, &[d], dtype)?));
        }
        if has_b {
            out.push(grad(T::finish_acc(gb, &[d], dtype)?));
        }
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

/// The f32 storage of an optional layer-norm operand.
fn opt_f32(t: Option<&Tensor>) -> Result<Option<&[f32]>> {
    match t.map(|t| fdata(t, "layer_norm")).transpose()? {
        Some(FData::F32(v)) => Ok(Some(v)),
        None => Ok(None),
        Some(FData::F64(_)) => Err(Error::shape("layer_norm", "operands have different dtypes")),
    }
}

/// The f64 storage of an optional layer-norm operand.
fn opt_f64(t: Option<&Tensor>) -> Result<Option<&[f64]>> {
    match t.map(|t| fdata(t, "layer_norm")).transpose()? {
        Some(FData::F64(v)) => Ok(Some(v)),
        None => Ok(None),
        Some(FData::F32(_)) => Err(Error::shape("layer_norm", "operands have different dtypes")),
    }
}

/// The host's layer-norm, embedding and dropout kernels.
pub(super) struct Host;

impl Kernels for Host {
    fn layer_norm(
        &self,
        x: &Tensor,
        (w, b): (Option<&Tensor>, Option<&Tensor>),
        d: usize,
        eps: f64,
    ) -> Result<(Computed, Stats)> {
        let (shape, dtype) = (x.shape(), x.dtype());
        match fdata(x, "layer_norm")? {
            FData::F32(xd) => {
                let (wd, bd) = (opt_f32(w)?, opt_f32(b)?);
                let (m, r) = row_stats(xd, d, eps);
                let out = layer_norm_fwd(xd, wd, bd, d, (&m, &r), shape, dtype)?;
                Ok((out, Stats::F32(m, r)))
            }
            FData::F64(xd) => {
                let (wd, bd) = (opt_f64(w)?, opt_f64(b)?);
                let (m, r) = row_stats(xd, d, eps);
                let out = layer_norm_fwd(xd, wd, bd, d, (&m, &r), shape, dtype)?;
                Ok((out, Stats::F64(m, r)))
            }
        }
    }

    fn layer_norm_backward(
        &self,
        x: &Tensor,
        w: Option<&Tensor>,
        has_b: bool,
        g: &Tensor,
        stats: &Stats,
        d: usize,
    ) -> Result<Vec<Option<Grad>>> {
        const OP: &str = "layer_norm";
        let (shape, dtype) = (x.shape(), x.dtype());
        match (fdata(x, OP)?, fdata(g, OP)?, stats) {
            (FData::F32(x), FData::F32(g), Stats::F32(m, r)) => {
                layer_norm_bwd(x, opt_f32(w)?, g, d, (m, r), shape, has_b, dtype)
            }
            (FData::F64(x), FData::F64(g), Stats::F64(m, r)) => {
                layer_norm_bwd(x, opt_f64(w)?, g, d, (m, r), shape, has_b, dtype)
            }
            _ => Err(Error::shape(OP, "gradient dtype differs from the input")),
        }
    }

    fn embedding(
        &self,
        w: &Tensor,
        ids: &Tensor,
        out_shape: &[usize],
    ) -> Result<(Computed, Tensor)> {
        let d = w.shape()[1];
        let src: Vec<usize> = ids
            .i64s()?
            .iter()
            .flat_map(|&id| (id as usize * d)..(id as usize + 1) * d)
            .collect();
        let out = Tensor::from_storage(
            gather(w.storage(), &src, "embedding")?,
            out_shape,
            w.dtype(),
        )?;
        Ok((Computed::new(out, Default::default()), ids.clone()))
    }

    fn embedding_backward(
        &self,
        g: &Tensor,
        ids: &Tensor,
        (v, d): (usize, usize),
        pad: i64,
        dtype: DType,
    ) -> Result<Computed> {
        let ids = ids.i64s()?;
        with_float!(g, "embedding", |gd| embedding_bwd(
            gd, ids, v, d, pad, dtype
        ))
    }

    fn dropout(&self, x: &Tensor, mut rng: Rng, keep: f64, scale: f64) -> Result<(Computed, Mask)> {
        let mask: Vec<bool> = (0..x.numel()).map(|_| rng.uniform() < keep).collect();
        let (shape, dtype) = (x.shape(), x.dtype());
        let out = with_float!(x, "dropout", |d| dropout_apply(
            d, &mask, scale, shape, dtype
        ))?;
        Ok((out, Mask::Host(mask)))
    }

    fn dropout_backward(
        &self,
        g: &Tensor,
        mask: &Mask,
        scale: f64,
        dtype: DType,
    ) -> Result<Computed> {
        let Mask::Host(mask) = mask else {
            return Err(Error::Device(
                "dropout backward: the forward's mask is on a device".into(),
            ));
        };
        with_float!(g, "dropout", |gd| dropout_apply(
            gd,
            mask,
            scale,
            g.shape(),
            dtype
        ))
    }
}
