//! The cuBLAS functions amprobe calls: handles, streams, the math mode, the library
//! version, and `cublasGemmStridedBatchedEx` with fp16, bf16 or f32 operands, an f32
//! result or one of the operands' 16-bit type (the f32 result rounded once to nearest
//! even, as cuBLAS's epilogue converts it), and f32 accumulation in k order (TF32 inputs
//! only when that compute type is asked for). Real cuBLAS sums in an order of its choosing, with fused multiply-adds on
//! tensor cores; this one multiplies and adds separately, one k after another. Each GEMM
//! is counted on the stream last given to `cublasSetStream_v2`: calls, flops, operand bytes.

use std::ffi::{c_int, c_longlong, c_void};
use std::sync::atomic::{AtomicUsize, Ordering};

const SUCCESS: u32 = 0;
const NOT_INITIALIZED: u32 = 1;
const INVALID_VALUE: u32 = 7;
const NOT_SUPPORTED: u32 = 15;

const R_32F: u32 = 0;
const R_16F: u32 = 2;
const R_16BF: u32 = 14;
const COMPUTE_32F: u32 = 68;
const COMPUTE_32F_FAST_TF32: u32 = 77;

const HANDLE: usize = 0xB1A5;

/// The stream of the (one) handle, whose counters its GEMMs add to.
static STREAM: AtomicUsize = AtomicUsize::new(0);

#[no_mangle]
pub unsafe extern "C" fn cublasCreate_v2(handle: *mut *mut c_void) -> u32 {
    if handle.is_null() {
        return INVALID_VALUE;
    }
    *handle = HANDLE as *mut c_void;
    SUCCESS
}

#[no_mangle]
pub extern "C" fn cublasDestroy_v2(_handle: *mut c_void) -> u32 {
    SUCCESS
}

#[no_mangle]
pub extern "C" fn cublasSetStream_v2(handle: *mut c_void, stream: *mut c_void) -> u32 {
    if handle as usize != HANDLE {
        return NOT_INITIALIZED;
    }
    STREAM.store(stream as usize, Ordering::Relaxed);
    SUCCESS
}

#[no_mangle]
pub extern "C" fn cublasSetMathMode(handle: *mut c_void, _mode: u32) -> u32 {
    if handle as usize != HANDLE {
        return NOT_INITIALIZED;
    }
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cublasGetProperty(which: u32, value: *mut c_int) -> u32 {
    if value.is_null() {
        return INVALID_VALUE;
    }
    // Reports itself as cuBLAS 13.0.0, the version amprobe is built against.
    *value = match which {
        0 => 13,
        _ => 0,
    };
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cublasGetVersion_v2(_handle: *mut c_void, v: *mut c_int) -> u32 {
    if v.is_null() {
        return INVALID_VALUE;
    }
    *v = 130_000;
    SUCCESS
}

/// Element `i` of a matrix of data type `ty`, as f32 (exact).
unsafe fn load(p: *const c_void, ty: u32, i: usize) -> f32 {
    match ty {
        R_32F => *(p as *const f32).add(i),
        R_16F => half::f16::from_bits(*(p as *const u16).add(i)).to_f32(),
        _ => f32::from_bits(u32::from(*(p as *const u16).add(i)) << 16),
    }
}

/// Stores `v` as element `i` of a matrix of data type `ty`, rounded once to it.
unsafe fn store(p: *mut c_void, ty: u32, i: usize, v: f32) {
    match ty {
        R_32F => *(p as *mut f32).add(i) = v,
        R_16F => *(p as *mut u16).add(i) = half::f16::from_f32(v).to_bits(),
        _ => *(p as *mut u16).add(i) = half::bf16::from_f32(v).to_bits(),
    }
}

/// An f32 rounded to TF32 (10 explicit mantissa bits, round to nearest even).
fn tf32(x: f32) -> f32 {
    if !x.is_finite() {
        return x;
    }
    let b = x.to_bits();
    let r = b.wrapping_add(0xfff + ((b >> 13) & 1)) & !0x1fff;
    f32::from_bits(r)
}

#[no_mangle]
pub unsafe extern "C" fn cublasGemmStridedBatchedEx(
    handle: *mut c_void,
    transa: u32,
    transb: u32,
    m: c_int,
    n: c_int,
    k: c_int,
    alpha: *const c_void,
    a: *const c_void,
    atype: u32,
    lda: c_int,
    stride_a: c_longlong,
    b: *const c_void,
    btype: u32,
    ldb: c_int,
    stride_b: c_longlong,
    beta: *const c_void,
    c: *mut c_void,
    ctype: u32,
    ldc: c_int,
    stride_c: c_longlong,
    batch: c_int,
    compute: u32,
    _algo: c_int,
) -> u32 {
    if handle as usize != HANDLE {
        return NOT_INITIALIZED;
    }
    if m < 0 || n < 0 || k < 0 || batch < 0 || alpha.is_null() || beta.is_null() {
        return INVALID_VALUE;
    }
    let ok_type = |t: u32| matches!(t, R_32F | R_16F | R_16BF);
    let ok_c = ctype == R_32F || ctype == atype;
    if !ok_type(atype) || atype != btype || !ok_c || transa > 1 || transb > 1 {
        eprintln!(
            "cudasim: cublasGemmStridedBatchedEx with A {atype}, B {btype}, C {ctype}, ops \
             {transa}/{transb} is not simulated (A = B in f32/f16/bf16, C f32 or A's type, N \
             or T)"
        );
        return NOT_SUPPORTED;
    }
    if compute != COMPUTE_32F && compute != COMPUTE_32F_FAST_TF32 {
        eprintln!("cudasim: cublasGemmStridedBatchedEx compute type {compute} is not simulated");
        return NOT_SUPPORTED;
    }
    let (m, n, k) = (m as usize, n as usize, k as usize);
    let (lda, ldb, ldc) = (lda as usize, ldb as usize, ldc as usize);
    // Column-major: op(A) is m×k, op(B) k×n, C m×n with leading dimensions lda, ldb, ldc.
    let rows_a = if transa == 0 { m } else { k };
    let rows_b = if transb == 0 { k } else { n };
    if lda < rows_a.max(1) || ldb < rows_b.max(1) || ldc < m.max(1) {
        return INVALID_VALUE;
    }
    let alpha = *(alpha as *const f32);
    let beta = *(beta as *const f32);
    let tf = compute == COMPUTE_32F_FAST_TF32 && atype == R_32F;
    let f = Gemm {
        m,
        k,
        alpha,
        beta,
        ldc,
        ctype,
    };
    // op(A) by columns (each k's m values together) and op(B) by columns, as f32 (TF32 when
    // asked), so that the sums below run over contiguous memory.
    let mut a_cols = vec![0f32; m * k];
    let mut b_cols = vec![0f32; k * n];
    for bi in 0..batch as usize {
        let ab = a
            .cast::<u8>()
            .offset((bi as isize) * (stride_a as isize) * elem_bytes(atype) as isize)
            as *const c_void;
        let bb = b
            .cast::<u8>()
            .offset((bi as isize) * (stride_b as isize) * elem_bytes(btype) as isize)
            as *const c_void;
        let cb = c
            .cast::<u8>()
            .offset((bi as isize) * (stride_c as isize) * elem_bytes(ctype) as isize)
            as *mut c_void;
        let round = |x: f32| if tf { tf32(x) } else { x };
        for p in 0..k {
            for i in 0..m {
                let ai = if transa == 0 {
                    i + p * lda
                } else {
                    p + i * lda
                };
                a_cols[p * m + i] = round(load(ab, atype, ai));
            }
        }
        for j in 0..n {
            for p in 0..k {
                let bi_ = if transb == 0 {
                    p + j * ldb
                } else {
                    j + p * ldb
                };
                b_cols[j * k + p] = round(load(bb, btype, bi_));
            }
        }
        // Columns of C split between two threads when the product is large (disjoint
        // writes); each element's sum is the same either way.
        let work = m * n * k;
        let threads = if work >= 1 << 22 && n >= 2 { 2 } else { 1 };
        let cols_per = n.div_ceil(threads);
        let c_addr = cb as usize;
        std::thread::scope(|sc| {
            for t in 1..threads {
                let (a_cols, b_cols, f) = (&a_cols, &b_cols, &f);
                let j0 = t * cols_per;
                // SAFETY: this thread writes columns j0.. of C only.
                sc.spawn(move || unsafe {
                    f.columns(a_cols, b_cols, c_addr as *mut c_void, j0..n)
                });
            }
            // SAFETY: this thread writes the first columns only.
            unsafe { f.columns(&a_cols, &b_cols, cb, 0..cols_per.min(n)) };
        });
    }
    if batch > 0 && m > 0 && n > 0 {
        crate::driver::note_writer(c as u64, "cublasGemmStridedBatchedEx");
    }
    let (m, n, k, nb) = (m as u64, n as u64, k as u64, batch as u64);
    let ab = elem_bytes(atype) as u64;
    let c_passes = if beta == 0.0 { 1 } else { 2 };
    let cb = elem_bytes(ctype) as u64;
    crate::driver::note_gemm(
        STREAM.load(Ordering::Relaxed),
        2 * m * n * k * nb,
        atype == R_32F,
        nb * ((m * k + k * n) * ab + c_passes * m * n * cb),
    );
    SUCCESS
}

/// One batch entry's product, over operands laid out by columns (see
/// `cublasGemmStridedBatchedEx`).
struct Gemm {
    m: usize,
    k: usize,
    alpha: f32,
    beta: f32,
    ldc: usize,
    /// C's data type: f32, or a 16-bit type each result is rounded to once.
    ctype: u32,
}

impl Gemm {
    /// Columns `cols` of C: each element the f32 sum over k in order of separately rounded
    /// products, then scaled by alpha (plus beta times C's old value), then rounded to C's
    /// type. Four columns at a time share each pass over A's columns.
    unsafe fn columns(
        &self,
        a_cols: &[f32],
        b_cols: &[f32],
        c: *mut c_void,
        cols: std::ops::Range<usize>,
    ) {
        const W: usize = 4;
        let (m, k) = (self.m, self.k);
        let mut acc = vec![0f32; W * m];
        let mut j = cols.start;
        while j < cols.end {
            let w = W.min(cols.end - j);
            acc.fill(0.0);
            for p in 0..k {
                let a = &a_cols[p * m..(p + 1) * m];
                for (jj, acc) in acc.chunks_exact_mut(m).take(w).enumerate() {
                    let y = b_cols[(j + jj) * k + p];
                    for (s, &x) in acc.iter_mut().zip(a) {
                        let prod = x * y;
                        *s += prod;
                    }
                }
            }
            for (jj, acc) in acc.chunks_exact(m).take(w).enumerate() {
                let col = (j + jj) * self.ldc;
                for (i, &s) in acc.iter().enumerate() {
                    let v = if self.beta == 0.0 {
                        self.alpha * s
                    } else {
                        self.alpha * s + self.beta * load(c, self.ctype, col + i)
                    };
                    store(c, self.ctype, col + i, v);
                }
            }
            j += w;
        }
    }
}

fn elem_bytes(t: u32) -> usize {
    if t == R_32F {
        4
    } else {
        2
    }
}
