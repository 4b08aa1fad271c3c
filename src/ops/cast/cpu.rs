//! The cast on the host.

use crate::dtype::{round_f64_to, DType, RoundCounts};
use crate::engine::Computed;
use crate::error::{Error, Result};
use crate::tensor::{Storage, Tensor};

/// Casts `x` to `to`, rounding once (RNE), counting over/underflow.
pub(super) fn cast(x: &Tensor, to: DType) -> Result<Computed> {
    match (x.storage(), to) {
        (Storage::F32(v), DType::F64) => Ok(Computed::new(
            Tensor::from_f64(v.iter().map(|&a| a as f64).collect(), x.shape())?,
            RoundCounts::default(),
        )),
        (Storage::F32(_), DType::F32) => {
            // fp16, bf16 and f32 values are all f32 values: the same storage, nothing rounds.
            Ok(Computed::new(
                Tensor::from_storage(x.storage().clone(), x.shape(), DType::F32)?,
                RoundCounts::default(),
            ))
        }
        (Storage::F32(v), _) => {
            crate::ops::produce(v.len(), x.shape(), to, |s, piece: &mut [f32]| {
                piece.copy_from_slice(&v[s..s + piece.len()]);
            })
        }
        (Storage::F64(_), DType::F64) => Ok(Computed::new(x.clone(), RoundCounts::default())),
        (Storage::F64(v), _) => {
            let mut rounding = RoundCounts::default();
            let data: Vec<f32> = v
                .iter()
                .map(|&a| {
                    let r = round_f64_to(to, a) as f32;
                    rounding.overflow += (a.is_finite() && r.is_infinite()) as u64;
                    rounding.underflow += (a != 0.0 && r == 0.0) as u64;
                    r
                })
                .collect();
            Ok(Computed::new(
                Tensor::from_exact(data, x.shape(), to)?,
                rounding,
            ))
        }
        (Storage::I64(_), _) => Err(Error::shape("to", "cannot cast int64")),
        (Storage::Cuda(_), _) => Err(Error::Device(
            "to: a device tensor reached the host cast".into(),
        )),
    }
}

/// The host's cast kernel.
pub(super) struct Host;

impl super::kernels::Kernels for Host {
    fn cast(&self, x: &Tensor, to: DType) -> Result<Computed> {
        cast(x, to)
    }
}
