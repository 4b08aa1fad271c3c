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
        (Storage::F32(v), _) => {
            let mut data = v.to_vec();
            let rounding = crate::dtype::round_slice(to, &mut data);
            Ok(Computed::new(
                Tensor::from_exact(data, x.shape(), to)?,
                rounding,
            ))
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
