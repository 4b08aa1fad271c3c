//! GEMM through cuBLAS `gemm_ex`: fp16 / bf16 / f32 inputs, f32 compute, and an f32
//! output (rounded to the op's dtype by amprobe's cast kernel, which counts overflow and
//! underflow) or an output in the inputs' 16-bit type (cuBLAS's epilogue rounds the f32
//! result once, to nearest even, and counts nothing). The f32 mode computes true f32
//! unless TF32 is asked for.

use super::driver_error::dev_err;
use crate::error::Result;
use cudarc::cublas::{sys, CudaBlas};
use cudarc::driver::CudaStream;
use std::sync::Arc;

/// The cuBLAS handle and its math settings.
pub struct Blas {
    handle: CudaBlas,
    tf32: bool,
}

/// One row-major GEMM (or a strided batch of them): `C = op(A) · op(B)`, C of m×n.
#[derive(Debug, Clone, Copy)]
pub struct Gemm {
    /// Rows of op(A) and C.
    pub m: usize,
    /// Columns of op(B) and C.
    pub n: usize,
    /// Columns of op(A), rows of op(B).
    pub k: usize,
    /// A is stored k×m (op(A) = Aᵀ).
    pub trans_a: bool,
    /// B is stored n×k (op(B) = Bᵀ).
    pub trans_b: bool,
    /// Number of matrices (1 for a plain GEMM).
    pub batch: usize,
    /// Elements between consecutive A matrices (0: the same A for every batch).
    pub stride_a: usize,
    /// Elements between consecutive B matrices.
    pub stride_b: usize,
}

impl Blas {
    /// A handle on `stream`; `tf32` allows TF32 tensor cores for f32 inputs.
    pub fn new(stream: Arc<CudaStream>, tf32: bool) -> Result<Blas> {
        let handle = CudaBlas::new(stream).map_err(|e| dev_err("cuBLAS handle")(&e))?;
        // Reduced-precision split-K reductions would round partial sums to fp16.
        let mode = sys::cublasMath_t::CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION;
        // SAFETY: a valid handle; the mode is a documented flag.
        unsafe { sys::cublasSetMathMode(*handle.handle(), mode) }
            .result()
            .map_err(|e| dev_err("cublasSetMathMode")(&e))?;
        Ok(Blas { handle, tf32 })
    }

    /// Runs `g` on raw device pointers: `a`, `b` of storage kind `kind` (0 f32, 1 f16,
    /// 2 bf16) and `c` of `batch·m·n` elements of kind `out`: 0 (f32), or `kind` itself.
    ///
    /// # Safety
    /// The pointers must address device memory of the sizes `g` implies, on this handle's
    /// stream's context.
    pub unsafe fn gemm(&self, g: Gemm, kind: i32, a: u64, b: u64, c: u64, out: i32) -> Result<()> {
        use sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
        use sys::cudaDataType_t as D;
        let data_type = |kind: i32| match kind {
            0 => D::CUDA_R_32F,
            1 => D::CUDA_R_16F,
            _ => D::CUDA_R_16BF,
        };
        if out != 0 && out != kind {
            return Err(crate::error::Error::Device(format!(
                "a GEMM of storage kind {kind} cannot write kind {out}"
            )));
        }
        let (dt, ct) = (data_type(kind), data_type(out));
        let compute = if kind == 0 && self.tf32 {
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32
        } else {
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F
        };
        // Row-major C (m×n) is column-major Cᵀ (n×m) = op(B)ᵀ · op(A)ᵀ.
        let (op_b, ldb) = if g.trans_b {
            (CUBLAS_OP_T, g.k)
        } else {
            (CUBLAS_OP_N, g.n)
        };
        let (op_a, lda) = if g.trans_a {
            (CUBLAS_OP_T, g.m)
        } else {
            (CUBLAS_OP_N, g.k)
        };
        let alpha = 1.0f32;
        let beta = 0.0f32;
        let i = |x: usize| x as std::ffi::c_int;
        cudarc::cublas::result::gemm_strided_batched_ex(
            *self.handle.handle(),
            op_b,
            op_a,
            i(g.n),
            i(g.m),
            i(g.k),
            (&alpha) as *const f32 as *const _,
            b as *const _,
            dt,
            i(ldb),
            g.stride_b as i64,
            a as *const _,
            dt,
            i(lda),
            g.stride_a as i64,
            (&beta) as *const f32 as *const _,
            c as *mut _,
            ct,
            i(g.n),
            (g.m * g.n) as i64,
            i(g.batch),
            compute,
            sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
        .map_err(|e| dev_err("cublasGemmStridedBatchedEx")(&e))
    }
}
