//! Matrix products: linear (+bias), matmul, bmm. GEMM accumulates in f32 (f64 for the
//! reference dtype) and the result is rounded once to the output dtype.

use super::{expect_float, grad, sum_to, with_float2, FData, Finish};
use crate::engine::{Computed, Engine};
use crate::error::{Error, Result};
use crate::tensor::{Real, Tensor};

/// A strided matrix operand: data, row stride, column stride.
#[derive(Clone, Copy)]
pub(crate) struct Mat<'a, T> {
    pub data: &'a [T],
    pub rs: usize,
    pub cs: usize,
}

/// C = A·B for A [m, k] and B [k, n] (strided), accumulated in T, as a new row-major Vec.
pub(crate) fn gemm<T: Real>(m: usize, n: usize, k: usize, a: Mat<'_, T>, b: Mat<'_, T>) -> Vec<T> {
    gemm_par(m, n, k, a, b, m * n * k >= 1 << 18)
}

/// Batched C_i = A_i·B_i into one row-major Vec: small products run one per thread, large
/// ones one after another, each parallel inside.
fn gemm_batched<'a, T: Real>(
    batch: usize,
    m: usize,
    n: usize,
    k: usize,
    a: impl Fn(usize) -> Mat<'a, T> + Sync,
    b: impl Fn(usize) -> Mat<'a, T> + Sync,
) -> Vec<T> {
    use rayon::prelude::*;
    if batch > 1 && m * n * k < 1 << 21 {
        let parts: Vec<Vec<T>> = (0..batch)
            .into_par_iter()
            .map(|i| gemm_par(m, n, k, a(i), b(i), false))
            .collect();
        parts.concat()
    } else {
        let mut y = Vec::with_capacity(batch * m * n);
        for i in 0..batch {
            y.extend(gemm(m, n, k, a(i), b(i)));
        }
        y
    }
}

fn gemm_par<T: Real>(
    m: usize,
    n: usize,
    k: usize,
    a: Mat<'_, T>,
    b: Mat<'_, T>,
    parallel: bool,
) -> Vec<T> {
    let mut c = vec![T::zero(); m * n];
    if m == 0 || n == 0 || k == 0 {
        return c;
    }
    let par = if parallel {
        gemm::Parallelism::Rayon(0)
    } else {
        gemm::Parallelism::None
    };
    debug_assert!(a.data.len() > (m - 1) * a.rs + (k - 1) * a.cs);
    debug_assert!(b.data.len() > (k - 1) * b.rs + (n - 1) * b.cs);
    // SAFETY: the asserts above hold for every caller in this module: operands are sized
    // from the same shapes that set m, n, k and the strides; c has m*n elements.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr(),
            1,
            n as isize,
            false,
            a.data.as_ptr(),
            a.cs as isize,
            a.rs as isize,
            b.data.as_ptr(),
            b.cs as isize,
            b.rs as isize,
            T::zero(),
            T::one(),
            false,
            false,
            false,
            par,
        );
    }
    c
}

fn row<T>(data: &[T], cols: usize) -> Mat<'_, T> {
    Mat {
        data,
        rs: cols,
        cs: 1,
    }
}

fn transposed<T>(data: &[T], cols: usize) -> Mat<'_, T> {
    Mat {
        data,
        rs: 1,
        cs: cols,
    }
}

// A kernel takes its operands, their shapes and the output dtype explicitly.
#[allow(clippy::too_many_arguments)]
fn linear_fwd<T: Finish>(
    x: &[T],
    w: &[T],
    b: Option<&[T]>,
    m: usize,
    k: usize,
    n: usize,
    out_shape: &[usize],
    dtype: crate::DType,
) -> Result<Computed> {
    let mut y = gemm(m, n, k, row(x, k), transposed(w, k));
    if let Some(b) = b {
        for r in y.chunks_mut(n) {
            for (v, &bb) in r.iter_mut().zip(b) {
                *v = *v + bb;
            }
        }
    }
    T::finish(y, out_shape, dtype)
}

/// Shapes of a batched matmul.
#[derive(Clone, Debug)]
struct MmShape {
    batch: usize,
    m: usize,
    k: usize,
    n: usize,
    b_shared: bool,
    out: Vec<usize>,
}

fn mm_shape(a: &[usize], b: &[usize], op: &str) -> Result<MmShape> {
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

fn matmul_fwd<T: Finish>(a: &[T], b: &[T], s: &MmShape, dtype: crate::DType) -> Result<Computed> {
    let MmShape {
        batch,
        m,
        k,
        n,
        b_shared,
        ..
    } = *s;
    if b_shared {
        return T::finish(gemm(batch * m, n, k, row(a, k), row(b, n)), &s.out, dtype);
    }
    let y = gemm_batched(
        batch,
        m,
        n,
        k,
        |i| row(&a[i * m * k..], k),
        |i| row(&b[i * k * n..], n),
    );
    T::finish(y, &s.out, dtype)
}

fn matmul_bwd<T: Finish>(
    a: &[T],
    b: &[T],
    g: &[T],
    s: &MmShape,
    sa: &[usize],
    sb: &[usize],
    dtype: crate::DType,
) -> Result<(Computed, Computed)> {
    let MmShape {
        batch,
        m,
        k,
        n,
        b_shared,
        ..
    } = *s;
    if b_shared {
        // ga [B*m, k] = g [B*m, n] · bᵀ; gb [k, n] = aᵀ [k, B*m] · g [B*m, n]
        let ga = gemm(batch * m, k, n, row(g, n), transposed(b, n));
        let gb = gemm(k, n, batch * m, transposed(a, k), row(g, n));
        return Ok((T::finish(ga, sa, dtype)?, T::finish(gb, sb, dtype)?));
    }
    let ga = gemm_batched(
        batch,
        m,
        k,
        n,
        |i| row(&g[i * m * n..], n),
        |i| transposed(&b[i * k * n..], n),
    );
    let gb = gemm_batched(
        batch,
        k,
        n,
        m,
        |i| transposed(&a[i * m * k..], k),
        |i| row(&g[i * m * n..], n),
    );
    Ok((T::finish(ga, sa, dtype)?, T::finish(gb, sb, dtype)?))
}

impl Engine {
    /// y = x·wᵀ + b for x [..., in], w [out, in], b [out] (`torch.nn.functional.linear`).
    pub fn linear(&mut self, x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
        expect_float(x, "linear", "input")?;
        let mut raw = vec![x, w];
        raw.extend(b);
        let ins = self.prepare("linear", &raw)?;
        let (x, w) = (&ins[0], &ins[1]);
        let b = ins.get(2);
        if w.rank() != 2 || x.rank() == 0 {
            return Err(Error::shape(
                "linear",
                format!(
                    "weight must be [out, in], got {:?}; input {:?}",
                    w.shape(),
                    x.shape()
                ),
            ));
        }
        let (n, k) = (w.shape()[0], w.shape()[1]);
        if x.shape()[x.rank() - 1] != k {
            return Err(Error::shape(
                "linear",
                format!(
                    "input {:?} does not end in {k} (weight {:?})",
                    x.shape(),
                    w.shape()
                ),
            ));
        }
        if let Some(b) = b {
            if b.shape() != [n] {
                return Err(Error::shape(
                    "linear",
                    format!("bias must be [{n}], got {:?}", b.shape()),
                ));
            }
        }
        let m = x.numel() / k.max(1);
        let mut out_shape = x.shape().to_vec();
        *out_shape.last_mut().expect("rank >= 1") = n;
        let dtype = x.dtype();
        let out = match (
            super::fdata(x, "linear")?,
            super::fdata(w, "linear")?,
            b.map(|t| super::fdata(t, "linear")).transpose()?,
        ) {
            (FData::F32(xd), FData::F32(wd), Some(FData::F32(bd))) => {
                linear_fwd(xd, wd, Some(bd), m, k, n, &out_shape, dtype)?
            }
            (FData::F32(xd), FData::F32(wd), None) => {
                linear_fwd(xd, wd, None, m, k, n, &out_shape, dtype)?
            }
            (FData::F64(xd), FData::F64(wd), Some(FData::F64(bd))) => {
                linear_fwd(xd, wd, Some(bd), m, k, n, &out_shape, dtype)?
            }
            (FData::F64(xd), FData::F64(wd), None) => {
                linear_fwd(xd, wd, None, m, k, n, &out_shape, dtype)?
            }
            _ => return Err(Error::shape("linear", "operands have different dtypes")),
        };
        let (xt, wt, has_b) = (x.clone(), w.clone(), b.is_some());
        let bw = Box::new(move |g: &Tensor| {
            macro_rules! go {
                ($x:ident, $w:ident, $g:ident) => {{
                    let gx = <_ as Finish>::finish(
                        gemm(m, k, n, row($g, n), row($w, k)),
                        xt.shape(),
                        dtype,
                    )?;
                    let gw = <_ as Finish>::finish(
                        gemm(n, k, m, transposed($g, n), row($x, k)),
                        wt.shape(),
                        dtype,
                    )?;
                    let mut v = vec![grad(gx), grad(gw)];
                    if has_b {
                        v.push(grad(sum_to($g, &[m, n], &[n], dtype)?));
                    }
                    Ok(v)
                }};
            }
            match (
                super::fdata(&xt, "linear")?,
                super::fdata(&wt, "linear")?,
                super::fdata(g, "linear")?,
            ) {
                (FData::F32(x), FData::F32(w), FData::F32(g)) => go!(x, w, g),
                (FData::F64(x), FData::F64(w), FData::F64(g)) => go!(x, w, g),
                _ => Err(Error::shape("linear", "gradient dtype differs from inputs")),
            }
        });
        let refs: Vec<&Tensor> = ins.iter().collect();
        self.record("linear", &refs, &["input", "weight", "bias"], out, Some(bw))
    }

    fn matmul_op(&mut self, op: &'static str, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        expect_float(a, op, "left operand")?;
        expect_float(b, op, "right operand")?;
        let ins = self.prepare(op, &[a, b])?;
        let (a, b) = (&ins[0], &ins[1]);
        let s = mm_shape(a.shape(), b.shape(), op)?;
        let dtype = a.dtype();
        let out = with_float2!(a, b, op, |x, y| matmul_fwd(x, y, &s, dtype))?;
        let (at, bt) = (a.clone(), b.clone());
        let bw = Box::new(move |g: &Tensor| {
            let (ga, gb) = match (
                super::fdata(&at, op)?,
                super::fdata(&bt, op)?,
                super::fdata(g, op)?,
            ) {
                (FData::F32(x), FData::F32(y), FData::F32(gg)) => {
                    matmul_bwd(x, y, gg, &s, at.shape(), bt.shape(), dtype)?
                }
                (FData::F64(x), FData::F64(y), FData::F64(gg)) => {
                    matmul_bwd(x, y, gg, &s, at.shape(), bt.shape(), dtype)?
                }
                _ => return Err(Error::shape(op, "gradient dtype differs from inputs")),
            };
            Ok(vec![grad(ga), grad(gb)])
        });
        self.record(op, &[a, b], &["self", "other"], out, Some(bw))
    }

    /// Matrix product of a [..., m, k] and b [..., k, n] (same batch dims) or b [k, n].
    pub fn matmul(&mut self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        self.matmul_op("matmul", a, b)
    }

    /// Batched matrix product of a [B, m, k] and b [B, k, n].
    pub fn bmm(&mut self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        if a.rank() != 3 || b.rank() != 3 {
            return Err(Error::shape(
                "bmm",
                format!(
                    "needs rank-3 operands, got {:?} and {:?}",
                    a.shape(),
                    b.shape()
                ),
            ));
        }
        self.matmul_op("bmm", a, b)
    }
}
