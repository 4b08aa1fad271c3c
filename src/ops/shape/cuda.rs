//! Strided copies on the device (`shape.cu`): the value moves of transpose, permute,
//! slice and cat and of their gradients, as raw element bits. The geometry travels as one
//! kernel argument; no index array is uploaded.

use crate::device::cuda::buffer::kind_code;
use crate::device::cuda::DeviceBuffer;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::ops::cuda::{
    arg_ptr, collapse, device_of, launch_with, output, pad_shape, pad_strides, Out, MAX_DIMS,
};
use crate::tensor::{strides, Tensor};
use cudarc::driver::DeviceRepr;

/// The kernels of `shape.cu`.
pub const KERNELS: &[&str] = &["amp_strided_copy"];

/// A strided copy's geometry (`Strided` in shape.cu).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Strided {
    pub shape: [u64; MAX_DIMS],
    pub src: [u64; MAX_DIMS],
    pub dst: [u64; MAX_DIMS],
    pub src_base: u64,
    pub dst_base: u64,
}

// SAFETY: plain-old-data with the C layout of the kernel's struct.
unsafe impl DeviceRepr for Strided {}

/// Bytes per stored element of a device dtype.
pub(crate) fn elem_bytes(dtype: DType, op: &str) -> Result<i32> {
    match dtype {
        DType::F16 | DType::BF16 => Ok(2),
        DType::F32 => Ok(4),
        DType::I64 => Ok(8),
        DType::F64 => Err(Error::shape(op, "f64 tensors stay on the host")),
    }
}

/// Copies, for every index of `shape`, `x[src_base + Σ i·src]` to
/// `y[dst_base + Σ i·dst]`. `sink` gathers y's statistics: only for a copy that writes every
/// element of y (else [`Out::NONE`]); int64 values get none.
pub(crate) fn copy(
    op: &str,
    x: &Tensor,
    y: &Tensor,
    shape: &[usize],
    (src, src_base): (&[usize], usize),
    (dst, dst_base): (&[usize], usize),
    sink: Out,
) -> Result<()> {
    let dev = device_of(op, &[x, y])?;
    let n = shape.iter().product::<usize>() as u64;
    if n == 0 {
        return Ok(());
    }
    if x.dtype() != y.dtype() {
        return Err(Error::shape(
            op,
            format!("cannot copy {} into {}", x.dtype(), y.dtype()),
        ));
    }
    let mut geo = Strided {
        shape: pad_shape(shape)?,
        src: pad_strides(src),
        dst: pad_strides(dst),
        src_base: src_base as u64,
        dst_base: dst_base as u64,
    };
    collapse(&mut geo.shape, &mut [&mut geo.src, &mut geo.dst], None);
    let bytes = elem_bytes(x.dtype(), op)?;
    let (xp, yp) = (arg_ptr(x, op)?, arg_ptr(y, op)?);
    let (kind, sink) = match x.dtype() {
        DType::I64 => (-1, Out::NONE),
        d => (kind_code(d)?, sink),
    };
    let o = sink.for_output(y, n)?;
    launch_with!(
        dev,
        "amp_strided_copy",
        o.cfg,
        &xp,
        &yp,
        &bytes,
        &n,
        &geo,
        &kind,
        &o.counts,
        &o.partials
    );
    Ok(())
}

/// A new contiguous tensor of `out_shape` whose element at index i is
/// `x[base + Σ i·src]`, its statistics gathered where `sink` says.
pub fn gather_strided(
    op: &str,
    x: &Tensor,
    out_shape: &[usize],
    (src, base): (&[usize], usize),
    sink: Out,
) -> Result<Tensor> {
    let dev = device_of(op, &[x])?;
    let y = output(&dev, out_shape, x.dtype())?;
    copy(
        op,
        x,
        &y,
        out_shape,
        (src, base),
        (&strides(out_shape), 0),
        sink,
    )?;
    Ok(y)
}

/// A tensor of `full` holding contiguous `g` (shape `part`) at `base + Σ i·dst`; zero
/// elsewhere when `zero` (the copy does not cover `full`). Statistics are gathered where
/// `sink` says only when the copy covers `full`.
pub fn scatter_strided(
    op: &str,
    g: &Tensor,
    full: &[usize],
    (dst, base): (&[usize], usize),
    zero: bool,
    sink: Out,
) -> Result<Tensor> {
    let dev = device_of(op, &[g])?;
    let n = full.iter().product();
    let y = Tensor::on_device(
        &dev,
        DeviceBuffer::alloc(&dev, n, g.dtype(), zero)?,
        full,
        g.dtype(),
    )?;
    let sink = if zero { Out::NONE } else { sink };
    copy(
        op,
        g,
        &y,
        g.shape(),
        (&strides(g.shape()), 0),
        (dst, base),
        sink,
    )?;
    Ok(y)
}

/// The device's shape kernels: strided copies, each into a fresh output.
pub struct Device;

impl super::kernels::Kernels for Device {
    fn gather_strided(
        &self,
        op: &'static str,
        x: &Tensor,
        out_shape: &[usize],
        route: (&[usize], usize),
        _dtype: DType,
    ) -> Result<(Tensor, Option<u32>)> {
        let (slot, sink) = crate::ops::device_out(x)?;
        Ok((gather_strided(op, x, out_shape, route, sink)?, Some(slot)))
    }

    fn scatter_strided(
        &self,
        op: &'static str,
        g: &Tensor,
        (in_shape, _): (&[usize], &[usize]),
        route: (&[usize], usize),
        onto: bool,
        _dtype: DType,
    ) -> Result<(Tensor, Option<u32>)> {
        let (slot, sink) = crate::ops::device_out(g)?;
        Ok((
            scatter_strided(op, g, in_shape, route, !onto, sink)?,
            Some(slot),
        ))
    }

    fn cat(
        &self,
        ins: &[Tensor],
        out_shape: &[usize],
        os: &[usize],
        offs: &[usize],
    ) -> Result<Tensor> {
        let dev = device_of("cat", &ins.iter().collect::<Vec<_>>())?;
        let out = output(&dev, out_shape, ins[0].dtype())?;
        for (t, &o) in ins.iter().zip(offs) {
            copy(
                "cat",
                t,
                &out,
                t.shape(),
                (&strides(t.shape()), 0),
                (os, o),
                Out::NONE,
            )?;
        }
        Ok(out)
    }
}
