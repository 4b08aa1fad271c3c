//! The shapes of a (batched) matrix product, checked: what the host and device kernels of
//! `linalg` both take. A leaf: it uses only the crate's error type.

use crate::error::{Error, Result};

/// Shapes of a batched matmul.
#[derive(Clone, Debug)]
pub(crate) struct MmShape {
    pub batch: usize,
    pub m: usize,
    pub k: usize,
    pub n: usize,
    pub b_shared: bool,
    pub out: Vec<usize>,
}

/// The shapes of `a @ b` (`op` names the op in an error): operands of rank 2 or more with
/// equal inner dimensions, and equal batch dimensions unless `b` is a matrix.
pub(crate) fn mm_shape(a: &[usize], b: &[usize], op: &str) -> Result<MmShape> {
    if a.len() < 2 || b.len() < 2 {
        return Err(Error::shape(
            op,
            format!("needs operands of rank >= 2, got {a:?} and {b:?}"),
        ));
    }
    let (m, k) = (a[a.len() - 2], a[a.len() - 1]);
    let (k2, n) = (b[b.len() - 2], b[b.len() - 1]);
    if k != k2 {
        return Err(Error::shape(
            op,
            format!("inner dimensions differ: {a:?} @ {b:?}"),
        ));
    }
    let b_shared = b.len() == 2;
    if !b_shared && a[..a.len() - 2] != b[..b.len() - 2] {
        return Err(Error::shape(
            op,
            format!("batch dimensions differ: {a:?} @ {b:?}"),
        ));
    }
    let batch: usize = a[..a.len() - 2].iter().product();
    let mut out = a[..a.len() - 2].to_vec();
    out.extend([m, n]);
    Ok(MmShape {
        batch,
        m,
        k,
        n,
        b_shared,
        out,
    })
}
