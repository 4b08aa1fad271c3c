//! Cast to another dtype; its backward casts the gradient back.

use super::grad;
use crate::dtype::{round_f64_to, DType, RoundCounts};
use crate::engine::{Computed, Engine};
use crate::error::{Error, Result};
use crate::tensor::{Storage, Tensor};

/// Casts `x` to `to`, rounding once (RNE), counting over/underflow.
pub fn cast(x: &Tensor, to: DType) -> Result<Computed> {
    if to == DType::I64 || x.dtype() == DType::I64 {
        return Err(Error::shape(
            "to",
            format!("cannot cast {} to {to}", x.dtype()),
        ));
    }
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
        self.record("to", &[x], &["input"], out, Some(bw))
    }
}
