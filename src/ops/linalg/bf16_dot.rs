//! bf16 products on CPUs with AVX512-BF16. Its dot-product instruction, VDPBF16PS, adds
//! two bf16 products to each of sixteen f32 lanes a step: twice the multiply-adds of an
//! f32 FMA. The default kernels take it when both operands hold bf16 values and none of
//! its flushes can happen; the fixed-order kernels (`--reproducible`) never do.
//!
//! VDPBF16PS treats subnormal inputs as zero and flushes subnormal results to zero, where
//! the emulator keeps both. Neither can happen when the smallest nonzero magnitudes of A
//! and B, 2^ea and 2^eb rounded down to powers of two, have ea + eb ≥ −112:
//!
//! - a nonzero bf16 value is an integer of at most 8 bits times 2^(e − 7), so every
//!   product of an A value and a B value is a multiple of g = 2^(ea + eb − 14) ≥ 2^−126;
//! - a sum of multiples of g rounded to f32 is a multiple of g (rounding to a multiple of
//!   a power of two no smaller than g keeps it one, and a value whose spacing is finer than
//!   g is already exact), so every partial sum is zero or at least g in magnitude;
//! - and a value at least 2^−126 in magnitude is normal, as are the operands then (a
//!   subnormal operand would make ea or eb less than −126).
//!
//! Products exact in f32 and partial sums rounded to nearest-even are then what the
//! emulator's f32 accumulation computes, in the instruction's order within each pair of
//! terms. Otherwise, and for small products, the f32 kernels run as before.

use super::mat::Mat;
use std::mem::MaybeUninit;

/// Rows of A a tile computes.
const MR: usize = 12;
/// Columns of B a tile computes (two registers of sixteen lanes).
const NR: usize = 32;
/// Products with fewer multiply-adds than this run the f32 kernels: packing does not pay
/// (T5-mini's attention products, 2^20 each, run faster there).
const MIN_WORK: usize = 1 << 21;
/// The least sum of the two smallest nonzero biased exponents for which no flush can
/// happen (ea + eb ≥ −112 unbiased).
const MIN_EXPONENT_SUM: u32 = 2 * 127 - 112;

/// Whether this CPU runs VDPBF16PS.
pub(super) fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// C = A·B over `c` (row-major m×n, every element written) by VDPBF16PS, for operands that
/// hold bf16 values (in f32). Returns false, writing nothing, when the CPU lacks the
/// instruction, the product is small, an operand holds a value bf16 cannot, or a flush
/// could happen (see the module's comment): the caller then runs the f32 kernels.
pub(super) fn gemm_into(
    m: usize,
    n: usize,
    k: usize,
    a: Mat<'_, f32>,
    b: Mat<'_, f32>,
    parallel: bool,
    c: &mut [MaybeUninit<f32>],
) -> bool {
    m * n * k >= MIN_WORK && product(m, n, k, a, b, parallel, c)
}

/// [`gemm_into`] whatever the product's size.
fn product(
    m: usize,
    n: usize,
    k: usize,
    a: Mat<'_, f32>,
    b: Mat<'_, f32>,
    parallel: bool,
    c: &mut [MaybeUninit<f32>],
) -> bool {
    assert_eq!(c.len(), m * n, "gemm output of {m}x{n}");
    if m == 0 || n == 0 || k == 0 || !available() {
        return false;
    }
    let (Some(ra), Some(rb)) = (region(a, m, k), region(b, k, n)) else {
        return false;
    };
    let ((ea, exact_a), (eb, exact_b)) = (scan(ra), scan(rb));
    if !(exact_a && exact_b) || ea + eb < MIN_EXPONENT_SUM {
        return false;
    }
    let (mut pa, mut pb) = (take_buffer(&PACKED_A), take_buffer(&PACKED_B));
    pack_a(m, k, a, parallel, &mut pa);
    pack_b(k, n, b, parallel, &mut pb);
    #[cfg(target_arch = "x86_64")]
    run(m, n, k, &pa, &pb, parallel, c);
    PACKED_A.with(|b| b.replace(pa));
    PACKED_B.with(|b| b.replace(pb));
    cfg!(target_arch = "x86_64")
}

thread_local! {
    /// Each thread's packing buffers, kept from product to product (a fresh one of this
    /// size pays its page faults and its zeroing every time).
    static PACKED_A: std::cell::RefCell<Vec<u32>> = const { std::cell::RefCell::new(Vec::new()) };
    static PACKED_B: std::cell::RefCell<Vec<u32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A thread's packing buffer, taken out while a product uses it.
fn take_buffer(slot: &'static std::thread::LocalKey<std::cell::RefCell<Vec<u32>>>) -> Vec<u32> {
    slot.with(|b| b.take())
}

/// What a pass over an operand's values says: the smallest biased exponent among its
/// nonzero values (255 when all are zero), and whether bf16 holds every one of them.
fn scan(values: &[f32]) -> (u32, bool) {
    #[cfg(target_arch = "x86_64")]
    if available() {
        // SAFETY: the CPU runs AVX-512F (`available`).
        return unsafe { avx512::scan(values) };
    }
    scan_portable(values)
}

/// [`scan`] one value at a time.
fn scan_portable(values: &[f32]) -> (u32, bool) {
    // Sixteen lanes of accumulators, which the compiler keeps in vector registers.
    let (mut low, mut min_exp) = ([0u32; 16], [255u32; 16]);
    let mut step = |l: usize, x: f32| {
        let bits = x.to_bits();
        low[l] |= bits;
        let e = if bits & 0x7FFF_FFFF != 0 {
            (bits >> 23) & 0xFF
        } else {
            255
        };
        min_exp[l] = min_exp[l].min(e);
    };
    let mut chunks = values.chunks_exact(16);
    for c in &mut chunks {
        for (l, &x) in c.iter().enumerate() {
            step(l, x);
        }
    }
    for (l, &x) in chunks.remainder().iter().enumerate() {
        step(l, x);
    }
    let low = low.iter().fold(0, |a, b| a | b);
    (min_exp.into_iter().min().unwrap_or(255), low & 0xFFFF == 0)
}

/// The values of an operand of `rows` × `cols`, row-major (`cs` 1) or column-major (`rs`
/// 1) from its first element: what `cpu.rs` passes (None for any other layout).
fn region<'a>(x: Mat<'a, f32>, rows: usize, cols: usize) -> Option<&'a [f32]> {
    let row_major = x.cs == 1 && (x.rs == cols || rows == 1);
    let col_major = x.rs == 1 && (x.cs == rows || cols == 1);
    (row_major || col_major).then(|| &x.data[..rows * cols])
}

/// A k-pair's bf16 bits in a word: the even term's low, the odd term's high.
#[inline(always)]
fn pair(even: f32, odd: f32) -> u32 {
    even.to_bits() >> 16 | odd.to_bits() & 0xFFFF_0000
}

/// Writes `out[t * stride]` = the pair of line[2t], line[2t + 1] for each pair of a line
/// of `k` terms (the term past an odd k is zero).
#[cfg_attr(target_arch = "x86_64", target_feature(enable = "avx512f"))]
fn pairs_of_line(line: &[f32], k: usize, out: &mut [u32], stride: usize) {
    let line = &line[..k];
    let mut twos = line.chunks_exact(2);
    for (t, two) in (&mut twos).enumerate() {
        out[t * stride] = pair(two[0], two[1]);
    }
    if let [last] = twos.remainder() {
        out[(k / 2) * stride] = pair(*last, 0.0);
    }
}

/// Writes `out[r]` = the pair of even[r], odd[r] (odd all zero when None), sixteen at a
/// time where the compiler may use AVX-512.
#[cfg_attr(target_arch = "x86_64", target_feature(enable = "avx512f"))]
fn pairs_across(even: &[f32], odd: Option<&[f32]>, out: &mut [u32]) {
    match odd {
        Some(odd) => {
            for ((o, &e), &d) in out.iter_mut().zip(even).zip(odd) {
                *o = pair(e, d);
            }
        }
        None => {
            for (o, &e) in out.iter_mut().zip(even) {
                *o = pair(e, 0.0);
            }
        }
    }
}

/// A into `out` in blocks of MR rows, each block `pairs` steps of MR words (a row's
/// k-pair, see `pair`; rows past m and the term past an odd k are zeros). A is row- or
/// column-major (`region`).
fn pack_a(m: usize, k: usize, a: Mat<'_, f32>, parallel: bool, out: &mut Vec<u32>) {
    pack(out, m, MR, k, parallel, |i0, rows, block| {
        if a.cs == 1 {
            // Row-major: the block's rows side by side, one step of MR words at a time (its
            // writes in order; a row at a time would write MR words apart).
            let lines: [&[f32]; MR] = std::array::from_fn(|r| {
                if r < rows {
                    &a.data[(i0 + r) * a.rs..][..k]
                } else {
                    &[]
                }
            });
            for (p, step) in block.chunks_exact_mut(MR).enumerate() {
                let (q, odd) = (2 * p, 2 * p + 1 < k);
                for (w, line) in step.iter_mut().zip(&lines).take(rows) {
                    *w = pair(line[q], if odd { line[q + 1] } else { 0.0 });
                }
            }
        } else {
            // Column-major: term q of rows i0.. is a run at q·cs + i0.
            runs_of_terms(a.data, a.cs, i0, rows, k, block, MR);
        }
    });
}

/// For each k-pair p, the pairs of the runs of `width` values at term 2p and 2p + 1
/// (terms `stride` apart, the runs starting at `start`) into `out[p·step..]`: a
/// column-major A's rows, a row-major B's columns.
fn runs_of_terms(
    data: &[f32],
    stride: usize,
    start: usize,
    width: usize,
    k: usize,
    out: &mut [u32],
    step: usize,
) {
    for p in 0..k.div_ceil(2) {
        let even = &data[2 * p * stride + start..][..width];
        let odd = (2 * p + 1 < k).then(|| &data[(2 * p + 1) * stride + start..][..width]);
        // SAFETY: the CPU runs AVX-512F (this module runs only where `available`).
        unsafe { pairs_across(even, odd, &mut out[p * step..p * step + width]) };
    }
}

/// B into `out` in panels of NR columns, each panel `pairs` steps of NR words (a
/// column's k-pair; columns past n are zeros). B is row- or column-major (`region`).
fn pack_b(k: usize, n: usize, b: Mat<'_, f32>, parallel: bool, out: &mut Vec<u32>) {
    pack(out, n, NR, k, parallel, |j0, w, panel| {
        if b.cs == 1 {
            // Row-major: term q of columns j0.. is a run at q·rs + j0.
            runs_of_terms(b.data, b.rs, j0, w, k, panel, NR);
        } else {
            for jj in 0..w {
                // SAFETY: as in `pack_a`.
                unsafe { pairs_of_line(&b.data[(j0 + jj) * b.cs..], k, &mut panel[jj..], NR) };
            }
        }
    });
}

/// Packs `count` rows of A (or columns of B) into `out` in groups of `width`, each group
/// k.div_ceil(2) steps of `width` words: `f(first, valid, group)` writes the words of its
/// `valid` lines, over rayon's threads when `parallel`; the words of lines past `count` in
/// the last group are zeros. `out` is reused from product to product, so every word is
/// written here or by `f`.
fn pack(
    out: &mut Vec<u32>,
    count: usize,
    width: usize,
    k: usize,
    parallel: bool,
    f: impl Fn(usize, usize, &mut [u32]) + Sync + Send,
) {
    let len = k.div_ceil(2) * width;
    out.resize(count.div_ceil(width) * len, 0);
    let group = |(g, words): (usize, &mut [u32])| {
        let valid = width.min(count - g * width);
        if valid < width {
            words.fill(0);
        }
        f(g * width, valid, words)
    };
    if parallel {
        use rayon::prelude::*;
        out.par_chunks_mut(len).enumerate().for_each(group);
    } else {
        out.chunks_mut(len).enumerate().for_each(group);
    }
}

/// C's storage, shared by the threads that write its disjoint tiles.
#[derive(Clone, Copy)]
struct Out(*mut f32);
// SAFETY: the tiles the threads write do not overlap (see `run`).
unsafe impl Send for Out {}
unsafe impl Sync for Out {}

impl Out {
    /// The first element (a method, so that closures capture the whole `Out`).
    fn ptr(self) -> *mut f32 {
        self.0
    }
}

/// Every tile of C: tasks of a panel of B and a run of row blocks, panel by panel (a
/// panel stays in cache while A's blocks pass it).
#[cfg(target_arch = "x86_64")]
fn run(
    m: usize,
    n: usize,
    k: usize,
    pa: &[u32],
    pb: &[u32],
    parallel: bool,
    c: &mut [MaybeUninit<f32>],
) {
    use rayon::prelude::*;
    let pairs = k.div_ceil(2);
    let panels = n.div_ceil(NR);
    let blocks = m.div_ceil(MR);
    // Enough tasks for the threads when B has few panels.
    let threads = if parallel {
        rayon::current_num_threads()
    } else {
        1
    };
    let per_task = if panels >= 2 * threads {
        blocks
    } else {
        blocks.div_ceil(2 * threads.div_ceil(panels)).max(1)
    };
    let runs = blocks.div_ceil(per_task);
    let out = Out(c.as_mut_ptr().cast::<f32>());
    let task = |t: usize| {
        let (q, run) = (t / runs, t % runs);
        let panel = &pb[q * pairs * NR..(q + 1) * pairs * NR];
        let j0 = q * NR;
        let cols = NR.min(n - j0);
        for blk in run * per_task..((run + 1) * per_task).min(blocks) {
            let block = &pa[blk * pairs * MR..(blk + 1) * pairs * MR];
            let rows = MR.min(m - blk * MR);
            // SAFETY: the CPU runs AVX-512F and AVX512-BF16 (`available`, checked by the
            // caller); the tile is rows × cols of C at (blk·MR, j0), inside C's m×n, and no
            // other task writes it.
            unsafe {
                let dst = out.ptr().add(blk * MR * n + j0);
                avx512::tile(pairs, block, panel, dst, n, rows, cols);
            }
        }
    };
    if parallel {
        (0..panels * runs).into_par_iter().for_each(task);
    } else {
        (0..panels * runs).for_each(task);
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{MR, NR};
    use std::arch::x86_64::*;

    /// `super::scan` sixteen values at a time.
    ///
    /// # Safety
    /// The CPU runs AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn scan(values: &[f32]) -> (u32, bool) {
        let (mut low, mut min_exp) = (_mm512_setzero_si512(), _mm512_set1_epi32(255));
        let magnitude = _mm512_set1_epi32(0x7FFF_FFFF);
        let mut chunks = values.chunks_exact(16);
        for c in &mut chunks {
            // SAFETY: a chunk holds sixteen f32.
            let bits = _mm512_loadu_si512(c.as_ptr().cast());
            low = _mm512_or_si512(low, bits);
            let nonzero = _mm512_test_epi32_mask(bits, magnitude);
            let e = _mm512_and_si512(_mm512_srli_epi32::<23>(bits), _mm512_set1_epi32(0xFF));
            min_exp = _mm512_mask_min_epu32(min_exp, nonzero, min_exp, e);
        }
        let (e, exact) = super::scan_portable(chunks.remainder());
        let low = _mm512_reduce_or_epi32(low) as u32;
        let min = (_mm512_reduce_min_epu32(min_exp)).min(e);
        (min, exact && low & 0xFFFF == 0)
    }

    /// C[r][j] = Σ_p over k-pairs of the row's and column's pair products, for the first
    /// `rows` rows and `cols` columns of a tile; `dst` is the tile's first element and
    /// `ldc` C's row stride.
    ///
    /// # Safety
    /// The CPU runs AVX-512F and AVX512-BF16; `block` holds `pairs`·MR words and `panel`
    /// `pairs`·NR; `dst` is valid for writes of `rows` rows of `cols` floats `ldc` apart.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn tile(
        pairs: usize,
        block: &[u32],
        panel: &[u32],
        dst: *mut f32,
        ldc: usize,
        rows: usize,
        cols: usize,
    ) {
        debug_assert!(block.len() >= pairs * MR && panel.len() >= pairs * NR);
        let mut acc = [[_mm512_setzero_ps(); 2]; MR];
        let (a, b) = (block.as_ptr(), panel.as_ptr());
        for p in 0..pairs {
            // SAFETY (all loads): p < pairs, within `block` and `panel` (see above).
            let b0: __m512bh = std::mem::transmute(_mm512_loadu_si512(b.add(p * NR).cast()));
            let b1: __m512bh = std::mem::transmute(_mm512_loadu_si512(b.add(p * NR + 16).cast()));
            for (r, acc_r) in acc.iter_mut().enumerate() {
                let av: __m512bh =
                    std::mem::transmute(_mm512_set1_epi32(*a.add(p * MR + r) as i32));
                acc_r[0] = _mm512_dpbf16_ps(acc_r[0], av, b0);
                acc_r[1] = _mm512_dpbf16_ps(acc_r[1], av, b1);
            }
        }
        let lo: __mmask16 = if cols >= 16 {
            0xFFFF
        } else {
            (1u32 << cols) as u16 - 1
        };
        let hi: __mmask16 = if cols >= NR {
            0xFFFF
        } else if cols > 16 {
            (1u32 << (cols - 16)) as u16 - 1
        } else {
            0
        };
        for (r, acc_r) in acc.iter().enumerate().take(rows) {
            let row = dst.add(r * ldc);
            _mm512_mask_storeu_ps(row, lo, acc_r[0]);
            if hi != 0 {
                _mm512_mask_storeu_ps(row.add(16), hi, acc_r[1]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// f32 values that bf16 holds, from a seed (magnitudes 2^-8 to 2^8, both signs).
    fn bf16_values(len: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..len)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                let mant = (s >> 20) as u32 & 0x7F;
                let exp = 127 - 8 + (s >> 40) as u32 % 17;
                let sign = (s >> 63) as u32;
                f32::from_bits(sign << 31 | exp << 23 | mant << 16)
            })
            .collect()
    }

    fn row(data: &[f32], cols: usize) -> Mat<'_, f32> {
        Mat {
            data,
            rs: cols,
            cs: 1,
        }
    }

    fn product(m: usize, n: usize, k: usize, a: Mat<'_, f32>, b: Mat<'_, f32>) -> Option<Vec<f32>> {
        let mut c = vec![MaybeUninit::new(f32::NAN); m * n];
        // SAFETY (assume_init): every element starts initialized (NaN).
        super::product(m, n, k, a, b, true, &mut c)
            .then(|| c.iter().map(|v| unsafe { v.assume_init() }).collect())
    }

    #[test]
    fn small_products_are_left_to_the_f32_kernels() {
        let (a, b) = (bf16_values(64 * 64, 5), bf16_values(64 * 64, 6));
        let mut c = vec![MaybeUninit::new(0.0f32); 64 * 64];
        assert!(!gemm_into(
            64,
            64,
            64,
            row(&a, 64),
            row(&b, 64),
            true,
            &mut c
        ));
        let (a, b) = (bf16_values(128 * 256, 5), bf16_values(256 * 64, 6));
        let mut c = vec![MaybeUninit::new(0.0f32); 128 * 64];
        let taken = gemm_into(128, 64, 256, row(&a, 256), row(&b, 64), true, &mut c);
        assert_eq!(taken, available());
    }

    /// The f64 product and, per element, the bound on an f32 accumulation's error
    /// (k roundings of at most 2^-24 of the running sum's magnitude).
    fn reference(
        m: usize,
        n: usize,
        k: usize,
        a: Mat<'_, f32>,
        b: Mat<'_, f32>,
    ) -> (Vec<f64>, Vec<f64>) {
        let mut c = vec![0.0; m * n];
        let mut bound = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                let (mut s, mut t) = (0.0f64, 0.0f64);
                for p in 0..k {
                    let x = a.data[i * a.rs + p * a.cs] as f64 * b.data[p * b.rs + j * b.cs] as f64;
                    s += x;
                    t += x.abs();
                }
                c[i * n + j] = s;
                bound[i * n + j] = t * (k as f64) * 2f64.powi(-24) * 1.01;
            }
        }
        (c, bound)
    }

    #[test]
    fn products_of_small_integers_are_exact() {
        if !available() {
            assert!(product(64, 64, 64, row(&[1.0; 4096], 64), row(&[1.0; 4096], 64)).is_none());
            return;
        }
        // Every product and partial sum an integer below 2^24: any order gives them exactly.
        for &(m, n, k) in &[(64, 64, 64), (37, 45, 61), (13, 33, 161), (100, 31, 27)] {
            let a: Vec<f32> = (0..m * k)
                .map(|i| ((i * 7 + 3) % 17) as f32 - 8.0)
                .collect();
            let b: Vec<f32> = (0..k * n)
                .map(|i| ((i * 5 + 1) % 13) as f32 - 6.0)
                .collect();
            let (want, _) = reference(m, n, k, row(&a, k), row(&b, n));
            let got = product(m, n, k, row(&a, k), row(&b, n)).expect("bf16 path");
            for (g, w) in got.iter().zip(&want) {
                assert_eq!(*g as f64, *w, "{m}x{n}x{k}");
            }
        }
    }

    #[test]
    fn products_of_bf16_values_are_within_an_f32_accumulations_bound() {
        if !available() {
            return;
        }
        for &(m, n, k) in &[(50, 70, 300), (12, 32, 384), (25, 100, 129), (96, 33, 64)] {
            let a = bf16_values(m * k, 1 + k as u64);
            let b = bf16_values(k * n, 2 + n as u64);
            // A transposed in memory and B strided as a column-major view.
            let at: Vec<f32> = (0..k * m).map(|i| a[(i % m) * k + i / m]).collect();
            let bt: Vec<f32> = (0..n * k).map(|i| b[(i % k) * n + i / k]).collect();
            let (want, bound) = reference(m, n, k, row(&a, k), row(&b, n));
            let views = [
                (row(&a, k), row(&b, n)),
                (
                    Mat {
                        data: &at,
                        rs: 1,
                        cs: m,
                    },
                    Mat {
                        data: &bt,
                        rs: 1,
                        cs: k,
                    },
                ),
            ];
            for (va, vb) in views {
                let got = product(m, n, k, va, vb).expect("bf16 path");
                for (idx, g) in got.iter().enumerate() {
                    let err = (*g as f64 - want[idx]).abs();
                    assert!(
                        err <= bound[idx],
                        "{m}x{n}x{k} [{idx}]: {g} vs {} (bound {})",
                        want[idx],
                        bound[idx]
                    );
                }
            }
        }
    }

    #[test]
    fn it_declines_where_a_flush_could_happen_or_a_value_is_not_bf16() {
        if !available() {
            return;
        }
        let (m, n, k) = (40, 40, 64);
        let base_a = bf16_values(m * k, 3);
        let base_b = bf16_values(k * n, 4);
        let with = |v: &[f32], at: usize, x: f32| {
            let mut v = v.to_vec();
            v[at] = x;
            v
        };
        // Smallest magnitudes 2^-56 and 2^-56: exponents summing to -112, the least allowed.
        let a = with(&base_a, 5, 2f32.powi(-56));
        let b = with(&base_b, 9, -(2f32.powi(-56)));
        assert!(product(m, n, k, row(&a, k), row(&b, n)).is_some());
        // One binade lower on one side: a product could be subnormal.
        let b_low = with(&base_b, 9, 2f32.powi(-57));
        assert!(product(m, n, k, row(&a, k), row(&b_low, n)).is_none());
        // A subnormal operand (bf16 holds it: its low 16 bits are zero).
        let sub = with(&base_a, 0, f32::from_bits(0x0001_0000));
        assert!(product(m, n, k, row(&sub, k), row(&base_b, n)).is_none());
        // A value bf16 does not hold.
        let odd = with(&base_b, 3, 1.0 + 2f32.powi(-20));
        assert!(product(m, n, k, row(&base_a, k), row(&odd, n)).is_none());
        // Zeros do not count: an operand of zeros but one value of 2^-60, against A's
        // smallest 2^-8 (a sum of -68), then 2^-80 (-140).
        let mut zeros = vec![0.0f32; k * n];
        zeros[17] = 2f32.powi(-60);
        assert!(product(m, n, k, row(&base_a, k), row(&zeros, n)).is_some());
        let tiny = with(&base_a, 11, 2f32.powi(-80));
        assert!(product(m, n, k, row(&tiny, k), row(&zeros, n)).is_none());
    }
}
