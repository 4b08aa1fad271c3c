//! The one arithmetic the autograd tape needs below the ops: summing two gradients of one
//! tensor, element by element, rounded once to their dtype, on the host or (kernel in
//! `accumulate.cu`, launched through the device runtime) on a device.

use super::{Storage, Tensor};
use crate::device::cuda::{buffer, dev_err, elems_config, DeviceBuffer};
use crate::dtype::{round_slice, RoundCounts};
use crate::error::{Error, Result};
use std::sync::Arc;

/// The source of the accumulation kernel.
pub const SOURCE: &str = include_str!("accumulate.cu");

/// The kernels of `accumulate.cu`.
pub const KERNELS: &[&str] = &["amp_add_same"];

/// The sum of two device tensors: the result and the arena slot where its rounding is
/// counted.
fn add_same_device(a: &Tensor, b: &Tensor, op: &str) -> Result<(Tensor, u32)> {
    use cudarc::driver::PushKernelArg;
    let (ca, cb) = (a.cuda(op)?, b.cuda(op)?);
    if !Arc::ptr_eq(&ca.dev, &cb.dev) {
        return Err(Error::Device(format!(
            "{op}: operands are on different devices"
        )));
    }
    if a.dtype() != b.dtype() {
        return Err(Error::shape(
            op,
            format!(
                "inputs have different storage ({} and {})",
                a.dtype(),
                b.dtype()
            ),
        ));
    }
    let dev = &ca.dev;
    let kind = buffer::kind_code(a.dtype())?;
    let n = a.numel() as u64;
    let y = Tensor::on_device(
        dev,
        DeviceBuffer::alloc(dev, a.numel(), a.dtype(), false)?,
        a.shape(),
        a.dtype(),
    )?;
    let (slot, counts) = dev.counts_slot()?;
    let (ap, bp, yb) = (ca.buf.ptr(dev), cb.buf.ptr(dev), &y.cuda(op)?.buf);
    let yp = yb.ptr(dev);
    // The sum is the op's output: while the arena gathers, its kernel gathers the sum's
    // statistics on the statistics pass's launch shape.
    let partials = dev.with_arena(|a| a.gather(dev, slot, yb))?;
    let cfg = match partials {
        Some(_) => crate::device::cuda::arena::stats_config(n),
        None => elems_config(n),
    };
    let partials = partials.unwrap_or(0);
    const NAME: &str = "amp_add_same";
    dev.check_args(NAME, 7)?;
    let mut l = dev.stream().launch_builder(dev.func(NAME)?);
    l.arg(&ap)
        .arg(&bp)
        .arg(&yp)
        .arg(&kind)
        .arg(&n)
        .arg(&counts)
        .arg(&partials);
    // SAFETY: a, b and y are live device buffers of n elements of `kind`, counts is an
    // arena slot's two counters and partials (when not 0) that slot's partial sums; the
    // arguments match amp_add_same's signature.
    unsafe { l.launch(cfg) }.map_err(|e| dev_err(NAME)(&e))?;
    Ok((y, slot))
}

impl Tensor {
    /// `self + other` for two tensors of one shape and storage, computed in the storage type
    /// and rounded once to the dtype (as an elementwise add does), with the rounding counts
    /// (for two device tensors: zero, and the arena slot where the kernel counts them).
    /// `op` names the operation in errors.
    pub fn add_same(&self, other: &Tensor, op: &str) -> Result<(Tensor, RoundCounts, Option<u32>)> {
        if self.shape() != other.shape() {
            return Err(Error::shape(
                op,
                format!(
                    "operands must have one shape, got {:?} and {:?}",
                    self.shape(),
                    other.shape()
                ),
            ));
        }
        match (self.storage(), other.storage()) {
            (Storage::Cuda(_), Storage::Cuda(_)) => {
                let (t, slot) = add_same_device(self, other, op)?;
                Ok((t, RoundCounts::default(), Some(slot)))
            }
            (Storage::F32(a), Storage::F32(b)) => {
                let mut sum: Vec<f32> = Vec::with_capacity(a.len());
                if a.len() >= 64 * 1024 {
                    use rayon::prelude::*;
                    let terms = a.par_iter().zip(b.par_iter());
                    terms.map(|(&x, &y)| x + y).collect_into_vec(&mut sum);
                } else {
                    sum.extend(a.iter().zip(b.iter()).map(|(&x, &y)| x + y));
                }
                let rounding = round_slice(self.dtype(), &mut sum);
                Ok((
                    Tensor::from_exact(sum, self.shape(), self.dtype())?,
                    rounding,
                    None,
                ))
            }
            (Storage::F64(a), Storage::F64(b)) => {
                let sum = a.iter().zip(b.iter()).map(|(&x, &y)| x + y).collect();
                Ok((
                    Tensor::from_f64(sum, self.shape())?,
                    RoundCounts::default(),
                    None,
                ))
            }
            (Storage::I64(_), _) | (_, Storage::I64(_)) => Err(Error::shape(
                op,
                "expected a floating-point tensor, got int64",
            )),
            _ => Err(Error::shape(
                op,
                format!(
                    "inputs have different storage ({} and {})",
                    self.dtype(),
                    other.dtype()
                ),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::dtype::DType;
    use crate::tensor::Tensor;

    #[test]
    fn rounds_once_to_the_dtype_and_counts_overflow() {
        let a = Tensor::from_exact(vec![65504.0, 1.0, 2f32.powi(-24)], &[3], DType::F16).unwrap();
        let b = Tensor::from_exact(vec![32.0, 2f32.powi(-11), 0.0], &[3], DType::F16).unwrap();
        let (s, r, _) = a.add_same(&b, "accumulate_grad").unwrap();
        // 65536 rounds to inf in fp16; 1 + 2^-11 is a tie that rounds to even (1.0).
        assert_eq!(s.f32s().unwrap(), &[f32::INFINITY, 1.0, 2f32.powi(-24)]);
        assert_eq!((r.overflow, r.underflow), (1, 0));
        let c = Tensor::from_exact(vec![1.0, 2.0], &[2], DType::F16).unwrap();
        let e = a.add_same(&c, "accumulate_grad").unwrap_err().to_string();
        assert!(
            e.contains("accumulate_grad") && e.contains("one shape"),
            "{e}"
        );
    }
}
