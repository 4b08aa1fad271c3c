//! GEMM on the host: the gemm crate accumulates in f32 (f64 for the reference dtype), or,
//! with `--reproducible`, the fixed-order kernels do (`host_gemm.rs`); the result is
//! rounded once to the output dtype.

use super::mat::Mat;
use super::shape::MmShape;
use crate::engine::{Computed, Grad};
use crate::error::{Error, Result};
use crate::ops::grad;
use crate::ops::{fdata, sum_to, FData, Finish};
use crate::tensor::{Real, Tensor};

/// Whether a product's operands are all bf16 values (then `bf16_dot.rs` may take it).
#[derive(Clone, Copy)]
pub(crate) struct Bf16(pub bool);

impl Bf16 {
    /// Whether every one of `dtypes` is bf16.
    fn of(dtypes: &[crate::DType]) -> Bf16 {
        Bf16(dtypes.iter().all(|d| *d == crate::DType::BF16))
    }
}

/// C = A·B for A [m, k] and B [k, n] (strided), accumulated in T, as a new row-major Vec.
pub(crate) fn gemm<T: Real>(
    m: usize,
    n: usize,
    k: usize,
    a: Mat<'_, T>,
    b: Mat<'_, T>,
    bf16: Bf16,
) -> Vec<T> {
    gemm_batched(1, m, n, k, |_| a, |_| b, bf16)
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
    bf16: Bf16,
) -> Vec<T> {
    use rayon::prelude::*;
    let size = m * n;
    let mut y: Vec<T> = uninit_output(batch * size);
    if size > 0 {
        let out = &mut y.spare_capacity_mut()[..batch * size];
        // Each product is written straight into its place in the output.
        if batch > 1 && m * n * k < 1 << 21 {
            out.par_chunks_mut(size)
                .enumerate()
                .for_each(|(i, c)| gemm_into(m, n, k, a(i), b(i), false, bf16, c));
        } else {
            for (i, c) in out.chunks_mut(size).enumerate() {
                gemm_into(m, n, k, a(i), b(i), m * n * k >= 1 << 18, bf16, c);
            }
        }
    }
    // SAFETY: every product wrote all of its `size` elements (see `gemm_into`), and the
    // products tile the first `batch * size` elements.
    unsafe { y.set_len(batch * size) };
    y
}

/// An empty Vec with room for `len` elements; in debug builds the room holds NaN, so that
/// an element a product failed to write shows up.
fn uninit_output<T: Real>(len: usize) -> Vec<T> {
    let mut c: Vec<T> = Vec::with_capacity(len);
    if cfg!(debug_assertions) {
        c.resize(len, T::nan());
        c.clear();
    }
    c
}

/// C = A·B written over `c` (row-major, exactly m*n elements), every element of which it
/// writes: the product is written over memory that is not zeroed first (gemm with
/// `read_dst` false writes every element and reads none it has not written).
// A kernel takes its operands, their shapes and how to run explicitly.
#[allow(clippy::too_many_arguments)]
fn gemm_into<T: Real>(
    m: usize,
    n: usize,
    k: usize,
    a: Mat<'_, T>,
    b: Mat<'_, T>,
    parallel: bool,
    bf16: Bf16,
    c: &mut [std::mem::MaybeUninit<T>],
) {
    assert_eq!(c.len(), m * n, "gemm output of {m}x{n}");
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        c.fill(std::mem::MaybeUninit::new(T::zero()));
        return;
    }
    if super::host_gemm::reproducible() {
        return super::fixed_order::gemm_into(m, n, k, a, b, parallel, c);
    }
    if bf16.0 {
        if let Some(c32) = super::fixed_order::as_f32(c) {
            let (a32, b32) = (
                super::fixed_order::cast_mat(a),
                super::fixed_order::cast_mat(b),
            );
            if super::bf16_dot::gemm_into(m, n, k, a32, b32, parallel, c32) {
                return;
            }
        }
    }
    let par = if parallel {
        gemm::Parallelism::Rayon(0)
    } else {
        gemm::Parallelism::None
    };
    debug_assert!(a.data.len() > (m - 1) * a.rs + (k - 1) * a.cs);
    debug_assert!(b.data.len() > (k - 1) * b.rs + (n - 1) * b.cs);
    // SAFETY: the asserts above hold for every caller in this module: operands are sized
    // from the same shapes that set m, n, k and the strides; c has exactly m*n elements,
    // which gemm writes (dst is not read).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr() as *mut T,
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

/// y = x·wᵀ + b (w [n, k]; with `w_t`, y = x·w + b for w [k, n]), the bias added to the f32
/// product and the sum rounded once.
// A kernel takes its operands, their shapes and the output dtype explicitly.
#[allow(clippy::too_many_arguments)]
pub(super) fn linear_fwd<T: Finish>(
    x: &[T],
    w: &[T],
    w_t: bool,
    b: Option<&[T]>,
    m: usize,
    k: usize,
    n: usize,
    out_shape: &[usize],
    dtype: crate::DType,
    bf16: Bf16,
) -> Result<Computed> {
    let wm = if w_t { row(w, n) } else { transposed(w, k) };
    let mut y = gemm(m, n, k, row(x, k), wm, bf16);
    if let Some(b) = b {
        let add = |r: &mut [T]| {
            for (v, &bb) in r.iter_mut().zip(b) {
                *v = *v + bb;
            }
        };
        if y.len() >= crate::ops::PAR_MIN && n > 0 {
            use rayon::prelude::*;
            y.par_chunks_mut(n).for_each(add);
        } else {
            y.chunks_mut(n.max(1)).for_each(add);
        }
    }
    T::finish(y, out_shape, dtype)
}

pub(super) fn matmul_fwd<T: Finish>(
    a: &[T],
    b: &[T],
    s: &MmShape,
    dtype: crate::DType,
    bf16: Bf16,
) -> Result<Computed> {
    let MmShape {
        batch,
        m,
        k,
        n,
        b_shared,
        ..
    } = *s;
    if b_shared {
        return T::finish(
            gemm(batch * m, n, k, row(a, k), row(b, n), bf16),
            &s.out,
            dtype,
        );
    }
    let y = gemm_batched(
        batch,
        m,
        n,
        k,
        |i| row(&a[i * m * k..], k),
        |i| row(&b[i * k * n..], n),
        bf16,
    );
    T::finish(y, &s.out, dtype)
}

// A kernel takes its operands, their shapes and the output dtype explicitly.
#[allow(clippy::too_many_arguments)]
pub(super) fn matmul_bwd<T: Finish>(
    a: &[T],
    b: &[T],
    g: &[T],
    s: &MmShape,
    sa: &[usize],
    sb: &[usize],
    dtype: crate::DType,
    bf16: Bf16,
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
        let ga = gemm(batch * m, k, n, row(g, n), transposed(b, n), bf16);
        let gb = gemm(k, n, batch * m, transposed(a, k), row(g, n), bf16);
        return Ok((T::finish(ga, sa, dtype)?, T::finish(gb, sb, dtype)?));
    }
    let ga = gemm_batched(
        batch,
        m,
        k,
        n,
        |i| row(&g[i * m * n..], n),
        |i| transposed(&b[i * k * n..], n),
        bf16,
    );
    let gb = gemm_batched(
        batch,
        k,
        n,
        m,
        |i| transposed(&a[i * m * k..], k),
        |i| row(&g[i * m * n..], n),
        bf16,
    );
    Ok((T::finish(ga, sa, dtype)?, T::finish(gb, sb, dtype)?))
}

/// Gradients of linear: dx = g·w, dw = gᵀ·x, db = Σ g over rows (each rounded once); with
/// `w_t` (w [k, n]), dx = g·wᵀ and dw = xᵀ·g.
// A kernel takes its operands, their shapes and the output dtype explicitly.
#[allow(clippy::too_many_arguments)]
pub(super) fn linear_bwd<T: Finish>(
    x: &[T],
    w: &[T],
    w_t: bool,
    g: &[T],
    (m, k, n): (usize, usize, usize),
    (x_shape, w_shape): (&[usize], &[usize]),
    has_b: bool,
    dtype: crate::DType,
    bf16: Bf16,
) -> Result<Vec<Option<Grad>>> {
    let (gx, gw) = if w_t {
        let gx = gemm(m, k, n, row(g, n), transposed(w, n), bf16);
        (gx, gemm(k, n, m, transposed(x, k), row(g, n), bf16))
    } else {
        let gx = gemm(m, k, n, row(g, n), row(w, k), bf16);
        (gx, gemm(n, k, m, transposed(g, n), row(x, k), bf16))
    };
    let gx = T::finish(gx, x_shape, dtype)?;
    let gw = T::finish(gw, w_shape, dtype)?;
    let mut v = vec![grad(gx), grad(gw)];
    if has_b {
        v.push(grad(sum_to(g, &[m, n], &[n], dtype)?));
    }
    Ok(v)
}

/// The host's matrix-product kernels (the gemm crate).
pub(super) struct Host;

impl super::kernels::Kernels for Host {
    fn affine(
        &self,
        op: &'static str,
        x: &Tensor,
        w: &Tensor,
        b: Option<&Tensor>,
        w_t: bool,
        (m, k, n): super::kernels::Mkn,
        out_shape: &[usize],
    ) -> Result<Computed> {
        let dtype = x.dtype();
        let bf = Bf16::of(&[x.dtype(), w.dtype()]);
        match (
            fdata(x, op)?,
            fdata(w, op)?,
            b.map(|t| fdata(t, op)).transpose()?,
        ) {
            (FData::F32(xd), FData::F32(wd), Some(FData::F32(bd))) => {
                linear_fwd(xd, wd, w_t, Some(bd), m, k, n, out_shape, dtype, bf)
            }
            (FData::F32(xd), FData::F32(wd), None) => {
                linear_fwd(xd, wd, w_t, None, m, k, n, out_shape, dtype, bf)
            }
            (FData::F64(xd), FData::F64(wd), Some(FData::F64(bd))) => {
                linear_fwd(xd, wd, w_t, Some(bd), m, k, n, out_shape, dtype, bf)
            }
            (FData::F64(xd), FData::F64(wd), None) => {
                linear_fwd(xd, wd, w_t, None, m, k, n, out_shape, dtype, bf)
            }
            _ => Err(Error::shape(op, "operands have different dtypes")),
        }
    }

    fn affine_backward(
        &self,
        op: &'static str,
        x: &Tensor,
        w: &Tensor,
        w_t: bool,
        g: &Tensor,
        mkn: super::kernels::Mkn,
        has_b: bool,
    ) -> Result<Vec<Option<Grad>>> {
        let shapes = (x.shape(), w.shape());
        let dtype = x.dtype();
        let bf = Bf16::of(&[x.dtype(), w.dtype(), g.dtype()]);
        match (fdata(x, op)?, fdata(w, op)?, fdata(g, op)?) {
            (FData::F32(xd), FData::F32(wd), FData::F32(gd)) => {
                linear_bwd(xd, wd, w_t, gd, mkn, shapes, has_b, dtype, bf)
            }
            (FData::F64(xd), FData::F64(wd), FData::F64(gd)) => {
                linear_bwd(xd, wd, w_t, gd, mkn, shapes, has_b, dtype, bf)
            }
            _ => Err(Error::shape(op, "gradient dtype differs from inputs")),
        }
    }

    fn matmul(&self, op: &'static str, a: &Tensor, b: &Tensor, s: &MmShape) -> Result<Computed> {
        let dtype = a.dtype();
        let bf = Bf16::of(&[a.dtype(), b.dtype()]);
        crate::ops::with_float2!(a, b, op, |x, y| matmul_fwd(x, y, s, dtype, bf))
    }

    fn matmul_backward(
        &self,
        op: &'static str,
        a: &Tensor,
        b: &Tensor,
        g: &Tensor,
        s: &MmShape,
    ) -> Result<Vec<Option<Grad>>> {
        let dtype = a.dtype();
        let bf = Bf16::of(&[a.dtype(), b.dtype(), g.dtype()]);
        let (ga, gb) = match (fdata(a, op)?, fdata(b, op)?, fdata(g, op)?) {
            (FData::F32(x), FData::F32(y), FData::F32(gg)) => {
                matmul_bwd(x, y, gg, s, a.shape(), b.shape(), dtype, bf)?
            }
            (FData::F64(x), FData::F64(y), FData::F64(gg)) => {
                matmul_bwd(x, y, gg, s, a.shape(), b.shape(), dtype, bf)?
            }
            _ => return Err(Error::shape(op, "gradient dtype differs from inputs")),
        };
        Ok(vec![grad(ga), grad(gb)])
    }
}
