//! The cast on the device (`cast.cu`).

use crate::dtype::DType;
use crate::error::Result;
use crate::ops::cuda::{arg, device_of, launch_with, output, Out};
use crate::tensor::Tensor;

/// The kernels of `cast.cu`.
pub const KERNELS: &[&str] = &["amp_cast"];

/// Rounds device tensor `x` to `to` (any of f32, f16, bf16), counting over/underflow and
/// gathering statistics where `sink` says.
pub fn cast(x: &Tensor, to: DType, sink: Out) -> Result<Tensor> {
    let dev = device_of("to", &[x])?;
    let y = output(&dev, x.shape(), to)?;
    let ((xp, xk), (yp, yk)) = (arg(x, "to")?, arg(&y, "to")?);
    let n = x.numel() as u64;
    let o = sink.for_output(&y, n)?;
    launch_with!(
        dev,
        "amp_cast",
        o.cfg,
        &xp,
        &xk,
        &yp,
        &yk,
        &n,
        &o.counts,
        &o.partials
    );
    Ok(y)
}

/// The device's cast kernel.
pub struct Device;

impl super::kernels::Kernels for Device {
    fn cast(&self, x: &Tensor, to: DType) -> Result<crate::engine::Computed> {
        if x.dtype() == to {
            return Ok(crate::engine::Computed::new(
                x.clone(),
                crate::dtype::RoundCounts::default(),
            ));
        }
        let (slot, sink) = crate::ops::device_out(x)?;
        Ok(crate::engine::Computed::pending(cast(x, to, sink)?, slot))
    }
}
