//! Layer norm, embedding and dropout on the device (`nn.cu`), with the CPU emulator's
//! order of operations; dropout draws the CPU's very mask from the same SplitMix64 stream.

use super::kernels::{Kernels, Mask, Stats};
use crate::device::cuda::DeviceBuffer;
use crate::dtype::DType;
use crate::engine::{Computed, Grad};
use crate::error::{Error, Result};
use crate::ops::cuda::{arg, arg_ptr, device_of, launch, launch_with, output};
use crate::ops::{device_counts, device_counts_n, grad};
use crate::rng::Rng;
use crate::tensor::Tensor;
use cudarc::driver::LaunchConfig;

/// The kernels of `nn.cu`.
pub const KERNELS: &[&str] = &[
    "amp_ln_stats",
    "amp_ln_forward",
    "amp_ln_backward_x",
    "amp_ln_backward_wb",
    "amp_embedding",
    "amp_embedding_rank",
    "amp_embedding_chunk_scan",
    "amp_embedding_offsets",
    "amp_embedding_scatter",
    "amp_embedding_backward",
    "amp_embedding_backward_warp",
    "amp_dropout",
];

/// Dropout of `x` (or its gradient) with the keep mask of the stream whose state after
/// derivation is `state`: kept elements scaled by `scale`, dropped ones multiplied by 0.
pub fn dropout(x: &Tensor, state: u64, keep: f64, scale: f64, counts: u64) -> Result<Tensor> {
    let dev = device_of("dropout", &[x])?;
    let y = output(&dev, x.shape(), x.dtype())?;
    let ((xp, k), (yp, _)) = (arg(x, "dropout")?, arg(&y, "dropout")?);
    let n = x.numel() as u64;
    launch!(
        dev,
        "amp_dropout",
        n,
        &xp,
        &yp,
        &k,
        &n,
        &state,
        &keep,
        &scale,
        &counts
    );
    Ok(y)
}

/// Row statistics of layer norm over rows of `d`: mean and 1/√(var + eps) as f32 device
/// tensors.
pub fn ln_stats(x: &Tensor, d: usize, eps: f64) -> Result<(Tensor, Tensor)> {
    let dev = device_of("layer_norm", &[x])?;
    let rows = x.numel() / d;
    let mean = output(&dev, &[rows], DType::F32)?;
    let rstd = output(&dev, &[rows], DType::F32)?;
    let (xp, k) = arg(x, "layer_norm")?;
    let (mp, rp) = (arg_ptr(&mean, "layer_norm")?, arg_ptr(&rstd, "layer_norm")?);
    let (r, dd) = (rows as u64, d as u64);
    let init = crate::ops::reduce::cuda::sum_identity();
    launch!(
        dev,
        "amp_ln_stats",
        r,
        &xp,
        &k,
        &r,
        &dd,
        &eps,
        &init,
        &mp,
        &rp
    );
    Ok((mean, rstd))
}

fn opt(t: Option<&Tensor>) -> Result<u64> {
    t.map_or(Ok(0), |t| arg_ptr(t, "layer_norm"))
}

/// Layer norm forward from the row statistics.
pub fn ln_forward(
    x: &Tensor,
    w: Option<&Tensor>,
    b: Option<&Tensor>,
    (mean, rstd): (&Tensor, &Tensor),
    counts: u64,
) -> Result<Tensor> {
    let dev = device_of("layer_norm", &[x])?;
    let d = x.shape()[x.rank() - 1] as u64;
    let y = output(&dev, x.shape(), x.dtype())?;
    let ((xp, k), (yp, _)) = (arg(x, "layer_norm")?, arg(&y, "layer_norm")?);
    let (wp, bp) = (opt(w)?, opt(b)?);
    let (mp, rp) = (arg_ptr(mean, "layer_norm")?, arg_ptr(rstd, "layer_norm")?);
    let n = x.numel() as u64;
    launch!(
        dev,
        "amp_ln_forward",
        n,
        &xp,
        &wp,
        &bp,
        &yp,
        &k,
        &n,
        &d,
        &mp,
        &rp,
        &counts
    );
    Ok(y)
}

/// Layer norm input gradient.
pub fn ln_backward_x(
    x: &Tensor,
    w: Option<&Tensor>,
    g: &Tensor,
    (mean, rstd): (&Tensor, &Tensor),
    counts: u64,
) -> Result<Tensor> {
    let dev = device_of("layer_norm", &[x, g])?;
    let d = x.shape()[x.rank() - 1];
    let dx = output(&dev, x.shape(), x.dtype())?;
    let ((xp, k), (gp, _), (dp, _)) = (
        arg(x, "layer_norm")?,
        arg(g, "layer_norm")?,
        arg(&dx, "layer_norm")?,
    );
    let wp = opt(w)?;
    let (mp, rp) = (arg_ptr(mean, "layer_norm")?, arg_ptr(rstd, "layer_norm")?);
    let (rows, dd) = ((x.numel() / d) as u64, d as u64);
    launch!(
        dev,
        "amp_ln_backward_x",
        rows,
        &xp,
        &wp,
        &gp,
        &dp,
        &k,
        &rows,
        &dd,
        &mp,
        &rp,
        &counts
    );
    Ok(dx)
}

/// Layer norm weight and bias gradients (each when asked), with their count addresses.
pub fn ln_backward_wb(
    x: &Tensor,
    g: &Tensor,
    (mean, rstd): (&Tensor, &Tensor),
    want_w: Option<u64>,
    want_b: Option<u64>,
) -> Result<(Option<Tensor>, Option<Tensor>)> {
    let dev = device_of("layer_norm", &[x, g])?;
    let d = x.shape()[x.rank() - 1];
    let gw = want_w.map(|_| output(&dev, &[d], x.dtype())).transpose()?;
    let gb = want_b.map(|_| output(&dev, &[d], x.dtype())).transpose()?;
    let ((xp, k), (gp, _)) = (arg(x, "layer_norm")?, arg(g, "layer_norm")?);
    let (wp, bp) = (opt(gw.as_ref())?, opt(gb.as_ref())?);
    let (mp, rp) = (arg_ptr(mean, "layer_norm")?, arg_ptr(rstd, "layer_norm")?);
    let (rows, dd) = ((x.numel() / d) as u64, d as u64);
    let (cw, cb) = (want_w.unwrap_or(0), want_b.unwrap_or(0));
    launch!(
        dev,
        "amp_ln_backward_wb",
        dd,
        &xp,
        &gp,
        &wp,
        &bp,
        &k,
        &rows,
        &dd,
        &mp,
        &rp,
        &cw,
        &cb
    );
    Ok((gw, gb))
}

/// Embedding rows of `w` [V, D] at int64 device `ids`, as `out_shape`.
pub fn embedding(w: &Tensor, ids: &Tensor, out_shape: &[usize]) -> Result<Tensor> {
    let dev = device_of("embedding", &[w, ids])?;
    if ids.dtype() != DType::I64 {
        return Err(Error::tensor(
            "input_ids",
            format!("expected int64 ids, got {}", ids.dtype()),
        ));
    }
    let (v, d) = (w.shape()[0] as u64, w.shape()[1] as u64);
    let y = output(&dev, out_shape, w.dtype())?;
    let ((wp, k), ip, (yp, _)) = (
        arg(w, "embedding")?,
        arg_ptr(ids, "embedding")?,
        arg(&y, "embedding")?,
    );
    let n = y.numel() as u64;
    launch!(dev, "amp_embedding", n, &wp, &ip, &yp, &k, &n, &d, &v);
    Ok(y)
}

/// The embedding weight gradient: rows of `g` added at `ids` in f64 in position order,
/// rounded once to `[v, d]` (the positions sorted by id on the device first, stably); the
/// row of id `pad` (PyTorch's `padding_idx`; -1 for none) stays zero.
pub fn embedding_backward(
    g: &Tensor,
    ids: &Tensor,
    v: usize,
    d: usize,
    pad: i64,
    counts: u64,
) -> Result<Tensor> {
    let dev = device_of("embedding", &[g, ids])?;
    let n_ids = ids.numel();
    let chunks = n_ids.div_ceil(256);
    let index = |len: usize, zero: bool| -> Result<Tensor> {
        let len = len.max(1);
        Tensor::on_device(
            &dev,
            DeviceBuffer::alloc(&dev, len, DType::I64, zero)?,
            &[len],
            DType::I64,
        )
    };
    let (rank, per_chunk, total) = (
        index(n_ids, false)?,
        index(chunks * v, true)?,
        index(v, false)?,
    );
    let (offset, sorted) = (index(v, false)?, index(n_ids, false)?);
    let out = output(&dev, &[v, d], g.dtype())?;
    let p = |t: &Tensor| arg_ptr(t, "embedding");
    let (ip, rp, cp, tp, op_, sp) = (
        p(ids)?,
        p(&rank)?,
        p(&per_chunk)?,
        p(&total)?,
        p(&offset)?,
        p(&sorted)?,
    );
    let ((gp, k), yp) = (arg(g, "embedding")?, p(&out)?);
    let (nn, cc, dd, vv) = (n_ids as u64, chunks as u64, d as u64, v as u64);
    if chunks > 0 {
        let by_chunk = LaunchConfig {
            grid_dim: (
                u32::try_from(chunks).map_err(|_| {
                    Error::Device(format!(
                        "embedding: {n_ids} positions are too many for one launch"
                    ))
                })?,
                1,
                1,
            ),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        launch_with!(dev, "amp_embedding_rank", by_chunk, &ip, &rp, &cp, &nn, &vv);
    }
    launch!(dev, "amp_embedding_chunk_scan", vv, &cp, &tp, &cc, &vv);
    let one_block = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    launch_with!(dev, "amp_embedding_offsets", one_block, &tp, &op_, &vv);
    launch!(
        dev,
        "amp_embedding_scatter",
        nn,
        &ip,
        &rp,
        &cp,
        &op_,
        &sp,
        &nn,
        &vv
    );
    // Ids averaging 32 positions or more take a warp each (per column), the others a thread.
    let (kernel, threads) = if nn >= 32 * vv {
        ("amp_embedding_backward_warp", vv * dd * 32)
    } else {
        ("amp_embedding_backward", vv * dd)
    };
    launch!(dev, kernel, threads, &gp, &sp, &tp, &op_, &yp, &k, &dd, &vv, &pad, &counts);
    Ok(out)
}

/// The device's layer-norm, embedding and dropout kernels.
pub struct Device;

impl Kernels for Device {
    fn layer_norm(
        &self,
        x: &Tensor,
        (w, b): (Option<&Tensor>, Option<&Tensor>),
        d: usize,
        eps: f64,
    ) -> Result<(Computed, Stats)> {
        let (m, r) = ln_stats(x, d, eps)?;
        let (slot, counts) = device_counts(x)?;
        let y = ln_forward(x, w, b, (&m, &r), counts)?;
        Ok((Computed::pending(y, slot), Stats::Device(m, r)))
    }

    fn layer_norm_backward(
        &self,
        x: &Tensor,
        w: Option<&Tensor>,
        has_b: bool,
        g: &Tensor,
        stats: &Stats,
        _d: usize,
    ) -> Result<Vec<Option<Grad>>> {
        let Stats::Device(m, r) = stats else {
            return Err(Error::Device(
                "layer_norm backward: the forward's statistics are on the host".into(),
            ));
        };
        let (slot, counts) = device_counts(g)?;
        let dx = ln_backward_x(x, w, g, (m, r), counts)?;
        let mut out = vec![grad(Computed::pending(dx, slot))];
        let mut taken = device_counts_n(g, w.is_some() as usize + has_b as usize)?.into_iter();
        let sw = w.and_then(|_| taken.next());
        let sb = if has_b { taken.next() } else { None };
        let (gw, gb) = ln_backward_wb(x, g, (m, r), sw.map(|s| s.1), sb.map(|s| s.1))?;
        if let (Some(t), Some((slot, _))) = (gw, sw) {
            out.push(grad(Computed::pending(t, slot)));
        }
        if let (Some(t), Some((slot, _))) = (gb, sb) {
            out.push(grad(Computed::pending(t, slot)));
        }
        Ok(out)
    }

    fn embedding(
        &self,
        w: &Tensor,
        ids: &Tensor,
        out_shape: &[usize],
    ) -> Result<(Computed, Tensor)> {
        let dev = device_of("embedding", &[w])?;
        let idd = ids.to_device(&dev)?;
        let out = Computed::new(embedding(w, &idd, out_shape)?, Default::default());
        Ok((out, idd))
    }

    fn embedding_backward(
        &self,
        g: &Tensor,
        ids: &Tensor,
        (v, d): (usize, usize),
        pad: i64,
        _dtype: DType,
    ) -> Result<Computed> {
        let (slot, counts) = device_counts(g)?;
        Ok(Computed::pending(
            embedding_backward(g, ids, v, d, pad, counts)?,
            slot,
        ))
    }

    fn dropout(&self, x: &Tensor, rng: Rng, keep: f64, scale: f64) -> Result<(Computed, Mask)> {
        let state = rng.state();
        let (slot, counts) = device_counts(x)?;
        let out = Computed::pending(dropout(x, state, keep, scale, counts)?, slot);
        Ok((out, Mask::Device { state, keep }))
    }

    fn dropout_backward(
        &self,
        g: &Tensor,
        mask: &Mask,
        scale: f64,
        _dtype: DType,
    ) -> Result<Computed> {
        let Mask::Device { state, keep } = *mask else {
            return Err(Error::Device(
                "dropout backward: the forward's mask is on the host".into(),
            ));
        };
        let (slot, counts) = device_counts(g)?;
        Ok(Computed::pending(
            dropout(g, state, keep, scale, counts)?,
            slot,
        ))
    }
}
