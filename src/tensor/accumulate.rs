//! The one arithmetic the autograd tape needs below the ops: summing two gradients of one
//! tensor, element by element, rounded once to their dtype.

use super::{Storage, Tensor};
use crate::dtype::{round_slice, RoundCounts};
use crate::error::{Error, Result};

impl Tensor {
    /// `self + other` for two tensors of one shape and storage, computed in the storage type
    /// and rounded once to the dtype (as an elementwise add does), with the rounding counts.
    /// `op` names the operation in errors.
    pub fn add_same(&self, other: &Tensor, op: &str) -> Result<(Tensor, RoundCounts)> {
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
            (Storage::F32(a), Storage::F32(b)) => {
                let mut sum: Vec<f32> = a.iter().zip(b.iter()).map(|(&x, &y)| x + y).collect();
                let rounding = round_slice(self.dtype(), &mut sum);
                Ok((
                    Tensor::from_exact(sum, self.shape(), self.dtype())?,
                    rounding,
                ))
            }
            (Storage::F64(a), Storage::F64(b)) => {
                let sum = a.iter().zip(b.iter()).map(|(&x, &y)| x + y).collect();
                Ok((Tensor::from_f64(sum, self.shape())?, RoundCounts::default()))
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
        let (s, r) = a.add_same(&b, "accumulate_grad").unwrap();
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
