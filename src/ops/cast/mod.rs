//! Cast to another dtype; its backward casts the gradient back. The host kernel is in
//! `cpu.rs`, the device one in `cuda.rs` + `cast.cu`.

mod cpu;
pub mod cuda;
mod kernels;

pub use kernels::Kernels;

use super::grad;
use crate::dtype::DType;
use crate::engine::{Computed, Engine};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// Casts `x` to `to`, rounding once (RNE), counting over/underflow: on the host at once,
/// on a device into an arena slot (f32, f16 and bf16 there; f64 stays on the host).
pub fn cast(x: &Tensor, to: DType) -> Result<Computed> {
    if to == DType::I64 || x.dtype() == DType::I64 {
        return Err(Error::shape(
            "to",
            format!("cannot cast {} to {to}", x.dtype()),
        ));
    }
    kernels(x).cast(x, to)
}

/// The cast kernel of the backend that holds `t`.
pub fn kernels(t: &Tensor) -> &'static dyn Kernels {
    if super::on_device(t) {
        &cuda::Device
    } else {
        &cpu::Host
    }
}

impl Engine {
    /// Casts `x` to `dtype` as a recorded op (`to`); returns `x` itself when it already has
    /// that dtype.
    pub fn to_dtype(&mut self, x: &Tensor, dtype: DType) -> Result<Tensor> {
        if x.dtype() == dtype {
            return Ok(x.clone());
        }
        let out = cast(x, dtype)?;
        let from = x.dtype();
        let bw = Box::new(move |g: &Tensor| Ok(vec![grad(cast(g, from)?)]));
        // The exact cast of a value is the value.
        self.record(
            "to",
            &[x],
            &["input"],
            out,
            Some(bw),
            Box::new(move |_: &mut Engine, r: &[Tensor]| Ok(r[0].clone())),
        )
    }
}
