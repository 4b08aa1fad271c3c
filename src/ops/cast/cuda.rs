//! The cast on the device (`cast.cu`).

use crate::dtype::DType;
use crate::error::Result;
use crate::ops::cuda::{arg, device_of, launch, output};
use crate::tensor::Tensor;

/// The kernels of `cast.cu`.
pub const KERNELS: &[&str] = &["amp_cast"];

/// Rounds device tensor `x` to `to` (any of f32, f16, bf16), counting over/underflow at
/// `counts`.
pub fn cast(x: &Tensor, to: DType, counts: u64) -> Result<Tensor> {
    let dev = device_of("to", &[x])?;
    let y = output(&dev, x.shape(), to)?;
    let ((xp, xk), (yp, yk)) = (arg(x, "to")?, arg(&y, "to")?);
    let n = x.numel() as u64;
    launch!(dev, "amp_cast", n, &xp, &xk, &yp, &yk, &n, &counts);
    Ok(y)
}
