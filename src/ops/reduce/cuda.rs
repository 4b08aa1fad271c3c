//! Reductions on the device (`reduce.cu`) with the CPU emulator's order of operations:
//! sums in f64 in row-major order, one rounding, over/underflow counted where it rounds.

use super::kernels::{Kernels, Lines, MaxIdx};
use crate::dtype::DType;
use crate::engine::Computed;
use crate::error::Result;
use crate::ops::cuda::{
    arg, arg_ptr, collapse, device_of, launch, launch_with, output, pad_shape, pad_strides, Out,
    MAX_DIMS,
};
use crate::ops::Pattern;
use crate::tensor::{strides, Tensor};
use cudarc::driver::DeviceRepr;

/// The kernels of `reduce.cu`.
pub const KERNELS: &[&str] = &[
    "amp_sum",
    "amp_sum_warp",
    "amp_expand",
    "amp_argmax",
    "amp_argmax_backward",
    "amp_softmax",
    "amp_softmax_backward",
    "amp_softmax_grouped",
    "amp_softmax_backward_grouped",
];

/// From this many lines on, softmax and its gradient run a warp per 32 lines (each line's
/// sums formed by one lane: one add per value) rather than a warp per line (every lane
/// adds every term): enough warps then to fill a GPU's SMs several times over.
pub const GROUPED_MIN_LINES: u64 = 8192;

/// The softmax kernel for `lines` lines and its launch's thread count: grouped lines from
/// [`GROUPED_MIN_LINES`] on, a warp per line below.
fn softmax_kernel(name: &'static str, grouped: &'static str, lines: u64) -> (&'static str, u64) {
    if lines >= GROUPED_MIN_LINES {
        (grouped, lines.div_ceil(32) * 32)
    } else {
        (name, lines * 32)
    }
}

/// `SumGeometry` in reduce.cu.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct SumGeometry {
    shape: [u64; MAX_DIMS],
    sx: [u64; MAX_DIMS],
    reduced: [u32; MAX_DIMS],
}

/// `ExpandGeometry` in reduce.cu.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct ExpandGeometry {
    shape: [u64; MAX_DIMS],
    sg: [u64; MAX_DIMS],
}

// SAFETY: plain-old-data with the C layout of the kernels' structs.
unsafe impl DeviceRepr for SumGeometry {}
// SAFETY: as above.
unsafe impl DeviceRepr for ExpandGeometry {}

/// The identity of Rust's f64 `Sum` (where the CPU sums through it).
pub(crate) fn sum_identity() -> f64 {
    std::iter::empty::<f64>().sum()
}

/// The f64 the CPU's `sum_to_f64(full → kept)` starts each output from: none when nothing
/// is summed (a copy: -0.0 adds nothing), Rust's `Sum` identity for the per-row pattern,
/// 0.0 otherwise.
pub(crate) fn sum_to_init(full: &[usize], kept: &[usize]) -> f64 {
    if full == kept {
        -0.0
    } else if let Pattern::Repeat(_) = Pattern::of(kept, full) {
        sum_identity()
    } else {
        0.0
    }
}

/// Sums `x` down to `kept` (same rank, 1 where summed) as `out_shape`, divided by `div`
/// when given (mean), in f64 in row-major order, rounded once.
pub fn sum(
    op: &str,
    x: &Tensor,
    kept: &[usize],
    div: Option<f64>,
    out_shape: &[usize],
    sink: Out,
) -> Result<Tensor> {
    let dev = device_of(op, &[x])?;
    let full = x.shape();
    let mut reduced = [0u32; MAX_DIMS];
    let pad = MAX_DIMS - full.len();
    for (i, (&f, &k)) in full.iter().zip(kept).enumerate() {
        reduced[pad + i] = (f != k) as u32;
    }
    let n_reduced = full
        .iter()
        .zip(kept)
        .filter(|(f, k)| f != k)
        .map(|(&f, _)| f as u64)
        .product::<u64>();
    let mut geo = SumGeometry {
        shape: pad_shape(full)?,
        sx: pad_strides(&strides(full)),
        reduced,
    };
    collapse(&mut geo.shape, &mut [&mut geo.sx], Some(&mut geo.reduced));
    let y = output(&dev, out_shape, x.dtype())?;
    let ((xp, k), (yp, _)) = (arg(x, op)?, arg(&y, op)?);
    let n = y.numel() as u64;
    let init = sum_to_init(full, kept);
    let (d, has) = (div.unwrap_or(1.0), div.is_some() as i32);
    if n_reduced >= 32 {
        // A warp per output element; its statistics come from the arena's own pass.
        let counts = sink.counts();
        launch!(
            dev,
            "amp_sum_warp",
            n * 32,
            &xp,
            &yp,
            &k,
            &n,
            &geo,
            &n_reduced,
            &init,
            &d,
            &has,
            &counts
        );
        return Ok(y);
    }
    let o = sink.for_output(&y, n)?;
    launch_with!(
        dev,
        "amp_sum",
        o.cfg,
        &xp,
        &yp,
        &k,
        &n,
        &geo,
        &n_reduced,
        &init,
        &d,
        &has,
        &o.counts,
        &o.partials
    );
    Ok(y)
}

/// Broadcasts `g` (shape `kept`, same rank as `full`) back to `full`, divided by `div`
/// (in f32) when given.
pub fn expand(
    op: &str,
    g: &Tensor,
    kept: &[usize],
    full: &[usize],
    div: Option<f64>,
    sink: Out,
) -> Result<Tensor> {
    let dev = device_of(op, &[g])?;
    let mut geo = ExpandGeometry {
        shape: pad_shape(full)?,
        sg: pad_strides(&crate::ops::bstrides(kept, full)),
    };
    collapse(&mut geo.shape, &mut [&mut geo.sg], None);
    let y = output(&dev, full, g.dtype())?;
    let ((gp, k), (yp, _)) = (arg(g, op)?, arg(&y, op)?);
    let n = y.numel() as u64;
    let (d, has) = (div.unwrap_or(1.0) as f32, div.is_some() as i32);
    let o = sink.for_output(&y, n)?;
    launch_with!(
        dev,
        "amp_expand",
        o.cfg,
        &gp,
        &yp,
        &k,
        &n,
        &geo,
        &d,
        &has,
        &o.counts,
        &o.partials
    );
    Ok(y)
}

/// The maximum of each line of an (outer, n, inner) split as `out_shape`, and the flat
/// offsets of the first maximal elements (an int64 device tensor, for the backward).
pub fn argmax(
    x: &Tensor,
    (outer, n, inner): (usize, usize, usize),
    out_shape: &[usize],
) -> Result<(Tensor, Tensor)> {
    let dev = device_of("max", &[x])?;
    let y = output(&dev, out_shape, x.dtype())?;
    let idx = output(&dev, &[outer * inner], DType::I64)?;
    let ((xp, k), (yp, _), ip) = (arg(x, "max")?, arg(&y, "max")?, arg_ptr(&idx, "max")?);
    let (lines, n, inner) = ((outer * inner) as u64, n as u64, inner as u64);
    launch!(
        dev,
        "amp_argmax",
        lines,
        &xp,
        &yp,
        &ip,
        &k,
        &lines,
        &n,
        &inner
    );
    Ok((y, idx))
}

/// The gradient of max: `g` at each line's maximal element, zero elsewhere.
pub fn argmax_backward(
    g: &Tensor,
    idx: &Tensor,
    (_, n, inner): (usize, usize, usize),
    in_shape: &[usize],
) -> Result<Tensor> {
    let dev = device_of("max", &[g, idx])?;
    let dx = output(&dev, in_shape, g.dtype())?;
    let ((gp, k), ip, (dp, _)) = (arg(g, "max")?, arg_ptr(idx, "max")?, arg(&dx, "max")?);
    let (total, n, inner) = (dx.numel() as u64, n as u64, inner as u64);
    launch!(
        dev,
        "amp_argmax_backward",
        total,
        &gp,
        &ip,
        &dp,
        &k,
        &total,
        &n,
        &inner
    );
    Ok(dx)
}

/// Softmax or log-softmax along the lines of an (outer, n, inner) split.
pub fn softmax(
    op: &str,
    x: &Tensor,
    (outer, n, inner): (usize, usize, usize),
    log: bool,
    sink: Out,
) -> Result<Tensor> {
    let dev = device_of(op, &[x])?;
    let y = output(&dev, x.shape(), x.dtype())?;
    let ((xp, k), (yp, _)) = (arg(x, op)?, arg(&y, op)?);
    let (lines, n, inner, l) = ((outer * inner) as u64, n as u64, inner as u64, log as i32);
    let (name, threads) = softmax_kernel("amp_softmax", "amp_softmax_grouped", lines);
    let o = sink.for_lines(&y, lines * n, threads)?;
    launch_with!(
        dev,
        name,
        o.cfg,
        &xp,
        &yp,
        &k,
        &lines,
        &n,
        &inner,
        &l,
        &o.counts,
        &o.partials
    );
    Ok(y)
}

/// The softmax or log-softmax gradient from the output `y` and its gradient `g`.
pub fn softmax_backward(
    op: &str,
    y: &Tensor,
    g: &Tensor,
    (outer, n, inner): (usize, usize, usize),
    log: bool,
    sink: Out,
) -> Result<Tensor> {
    let dev = device_of(op, &[y, g])?;
    crate::ops::cuda::same_dtype(op, &[y, g])?;
    let dx = output(&dev, y.shape(), y.dtype())?;
    let ((yp, k), (gp, _), (dp, _)) = (arg(y, op)?, arg(g, op)?, arg(&dx, op)?);
    let (lines, n, inner, l) = ((outer * inner) as u64, n as u64, inner as u64, log as i32);
    let init = sum_identity();
    let (name, threads) = softmax_kernel(
        "amp_softmax_backward",
        "amp_softmax_backward_grouped",
        lines,
    );
    let o = sink.for_lines(&dx, lines * n, threads)?;
    launch_with!(
        dev,
        name,
        o.cfg,
        &yp,
        &gp,
        &dp,
        &k,
        &lines,
        &n,
        &inner,
        &l,
        &init,
        &o.counts,
        &o.partials
    );
    Ok(dx)
}

/// The device's reduction and softmax kernels.
pub struct Device;

impl Kernels for Device {
    fn sum(
        &self,
        op: &'static str,
        x: &Tensor,
        kept: &[usize],
        div: Option<f64>,
        out_shape: &[usize],
    ) -> Result<Computed> {
        let (slot, sink) = crate::ops::device_out(x)?;
        Ok(Computed::pending(
            sum(op, x, kept, div, out_shape, sink)?,
            slot,
        ))
    }

    fn sum_backward(
        &self,
        op: &'static str,
        g: &Tensor,
        (kept, full): (&[usize], &[usize]),
        div: Option<f64>,
        _dtype: DType,
    ) -> Result<Computed> {
        let (slot, sink) = crate::ops::device_out(g)?;
        let gk = g.view_as(kept)?;
        Ok(Computed::pending(
            expand(op, &gk, kept, full, div, sink)?,
            slot,
        ))
    }

    fn argmax(&self, x: &Tensor, lines: Lines, out_shape: &[usize]) -> Result<(Tensor, MaxIdx)> {
        let (y, idx) = argmax(x, lines, out_shape)?;
        Ok((y, MaxIdx::Device(idx)))
    }

    fn argmax_backward(
        &self,
        g: &Tensor,
        idx: &MaxIdx,
        lines: Lines,
        in_shape: &[usize],
        _dtype: DType,
    ) -> Result<Tensor> {
        match idx {
            MaxIdx::Device(i) => argmax_backward(g, i, lines, in_shape),
            MaxIdx::Host(_) => Err(crate::error::Error::Device(
                "max backward: the forward's index is in host memory".into(),
            )),
        }
    }

    fn softmax(&self, op: &'static str, x: &Tensor, lines: Lines, log: bool) -> Result<Computed> {
        let (slot, sink) = crate::ops::device_out(x)?;
        Ok(Computed::pending(softmax(op, x, lines, log, sink)?, slot))
    }

    fn softmax_backward(
        &self,
        op: &'static str,
        y: &Tensor,
        g: &Tensor,
        lines: Lines,
        log: bool,
        _dtype: DType,
    ) -> Result<Computed> {
        let (slot, sink) = crate::ops::device_out(y)?;
        Ok(Computed::pending(
            softmax_backward(op, y, g, lines, log, sink)?,
            slot,
        ))
    }
}
