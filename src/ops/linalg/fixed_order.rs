//! Matrix products whose bits depend on the operands alone: element (i, j) is the chain of
//! fused multiply-adds c = fma(a[i][p], b[p][j], c) for p = 0, 1, …, k − 1 from c = +0,
//! on every machine. The blocked kernels of the default GEMM choose their k blocks from
//! the machine's cache sizes and their microkernel from its instruction set, so their
//! sums group differently from one machine to another; these do not block k at all.
//!
//! With AVX-512, sixteen f32 chains (sixteen columns of one row) advance together in one
//! register; with AVX2 and FMA, eight; without them, each chain is `mul_add` one term at a
//! time. All round the same way (IEEE 754's fusedMultiplyAdd, in hardware or in the C
//! library), so all give the same bits; only the speed depends on the machine.

use super::mat::Mat;
use crate::tensor::Real;
use std::mem::MaybeUninit;

/// How many chains advance together: the widest registers the CPU has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Lanes {
    /// Sixteen f32 lanes (AVX-512F).
    Avx512,
    /// Eight f32 lanes (AVX2 and FMA).
    Avx2,
    /// One chain at a time (`mul_add`).
    Scalar,
}

impl Lanes {
    /// The widest this CPU runs.
    pub(crate) fn detect() -> Lanes {
        Lanes::available()[0]
    }

    /// Every width this CPU runs, widest first.
    fn available() -> Vec<Lanes> {
        let mut v = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                v.push(Lanes::Avx512);
            }
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                v.push(Lanes::Avx2);
            }
        }
        v.push(Lanes::Scalar);
        v
    }

    /// The name the trace header gives it.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Lanes::Avx512 => "avx512f",
            Lanes::Avx2 => "avx2-fma",
            Lanes::Scalar => "scalar",
        }
    }
}

/// C = A·B over `c` (row-major m×n, every element written), each element its own
/// fused multiply-add chain in k order (see the module's comment), for m, n and k of at
/// least 1 (the caller, `cpu.rs`, answers empty products). Rows of C are shared out to
/// threads when `parallel`; which thread computes a row does not change it.
pub(crate) fn gemm_into<T: Real>(
    m: usize,
    n: usize,
    k: usize,
    a: Mat<'_, T>,
    b: Mat<'_, T>,
    parallel: bool,
    c: &mut [MaybeUninit<T>],
) {
    gemm_with(Lanes::detect(), m, n, k, a, b, parallel, c)
}

/// [`gemm_into`] on `lanes`, which the CPU must run.
#[allow(clippy::too_many_arguments)]
fn gemm_with<T: Real>(
    lanes: Lanes,
    m: usize,
    n: usize,
    k: usize,
    a: Mat<'_, T>,
    b: Mat<'_, T>,
    parallel: bool,
    c: &mut [MaybeUninit<T>],
) {
    assert!(
        m > 0 && n > 0 && k > 0,
        "an empty product of {m}x{k} by {k}x{n}"
    );
    assert_eq!(c.len(), m * n, "gemm output of {m}x{n}");
    if let Some(c32) = as_f32(c) {
        let (a32, b32) = (cast_mat::<T>(a), cast_mat::<T>(b));
        match lanes {
            #[cfg(target_arch = "x86_64")]
            Lanes::Avx512 => {
                let panels = pack_panels(k, n, b32, avx512::NR);
                run_rows(m, n, avx512::MR, parallel, c32, |i0, rows, out| {
                    // SAFETY: `lanes` is one the CPU runs (Lanes::available).
                    unsafe { avx512::rows(i0, rows, n, k, a32, &panels, out) }
                });
                return;
            }
            #[cfg(target_arch = "x86_64")]
            Lanes::Avx2 => {
                let panels = pack_panels(k, n, b32, avx2::NR);
                run_rows(m, n, avx2::MR, parallel, c32, |i0, rows, out| {
                    // SAFETY: `lanes` is one the CPU runs (Lanes::available).
                    unsafe { avx2::rows(i0, rows, n, k, a32, &panels, out) }
                });
                return;
            }
            _ => {}
        }
    }
    run_rows(m, n, 1, parallel, c, |i0, _, out| {
        scalar_row(i0, n, k, a, b, out)
    });
}

/// The scalar chains of row `i` of C.
fn scalar_row<T: Real>(
    i: usize,
    n: usize,
    k: usize,
    a: Mat<'_, T>,
    b: Mat<'_, T>,
    out: &mut [MaybeUninit<T>],
) {
    for (j, o) in out.iter_mut().enumerate().take(n) {
        let mut s = T::zero();
        for p in 0..k {
            s = a.data[i * a.rs + p * a.cs].mul_add(b.data[p * b.rs + j * b.cs], s);
        }
        o.write(s);
    }
}

/// Calls `f(first_row, rows, out)` for blocks of `block` rows of C (the last may be
/// shorter), on threads when `parallel`.
fn run_rows<T: Send>(
    m: usize,
    n: usize,
    block: usize,
    parallel: bool,
    c: &mut [MaybeUninit<T>],
    f: impl Fn(usize, usize, &mut [MaybeUninit<T>]) + Sync,
) {
    let chunk = block * n;
    if parallel {
        use rayon::prelude::*;
        c.par_chunks_mut(chunk)
            .enumerate()
            .for_each(|(blk, out)| f(blk * block, (m - blk * block).min(block), out));
    } else {
        for (blk, out) in c.chunks_mut(chunk).enumerate() {
            f(blk * block, (m - blk * block).min(block), out);
        }
    }
}

/// `c` as f32 storage when T is f32.
pub(super) fn as_f32<T: Real>(c: &mut [MaybeUninit<T>]) -> Option<&mut [MaybeUninit<f32>]> {
    if std::any::TypeId::of::<T>() != std::any::TypeId::of::<f32>() {
        return None;
    }
    // SAFETY: T is f32 (checked above): same size, alignment and validity.
    Some(unsafe { std::slice::from_raw_parts_mut(c.as_mut_ptr().cast(), c.len()) })
}

/// An operand of T = f32 as f32 (called only when T is f32).
pub(super) fn cast_mat<T: Real>(m: Mat<'_, T>) -> Mat<'_, f32> {
    assert_eq!(std::any::TypeId::of::<T>(), std::any::TypeId::of::<f32>());
    // SAFETY: T is f32 (asserted above).
    let data = unsafe { std::slice::from_raw_parts(m.data.as_ptr().cast::<f32>(), m.data.len()) };
    Mat {
        data,
        rs: m.rs,
        cs: m.cs,
    }
}

/// B copied into panels of `nr` columns, each panel k rows of `nr` contiguous values
/// (columns past n are zeros, whose products are never stored).
fn pack_panels(k: usize, n: usize, b: Mat<'_, f32>, nr: usize) -> Vec<f32> {
    let panels = n.div_ceil(nr);
    let mut out = vec![0.0f32; panels * k * nr];
    for (q, panel) in out.chunks_mut(k * nr).enumerate() {
        let j0 = q * nr;
        let w = (n - j0).min(nr);
        for p in 0..k {
            let row = &mut panel[p * nr..p * nr + w];
            for (jj, v) in row.iter_mut().enumerate() {
                *v = b.data[p * b.rs + (j0 + jj) * b.cs];
            }
        }
    }
    out
}

/// The vector kernels: for a block of ROWS rows of C and each panel of B, 2·ROWS
/// registers of chains that stay in registers over the whole k loop (ROWS is a constant,
/// so the loops over rows unroll), then stored.
macro_rules! vector_kernel {
    ($name:ident, $feature:literal, $lanes:literal, $mr:literal, $reg:ty, $zero:ident, $load:ident,
     $set1:ident, $fma:ident, $store:ident, rows: [$($r:literal),+]) => {
        #[cfg(target_arch = "x86_64")]
        mod $name {
            use super::Mat;
            use std::arch::x86_64::*;
            use std::mem::MaybeUninit;

            /// Columns of one packed panel of B: two registers.
            pub(super) const NR: usize = 2 * $lanes;
            /// Rows of C one block keeps in registers.
            pub(super) const MR: usize = $mr;

            /// Rows i0 .. i0 + rows (at most MR) of C, every panel, into `out` (those
            /// rows, row-major, n wide).
            #[target_feature(enable = $feature)]
            pub(super) unsafe fn rows(
                i0: usize,
                rows: usize,
                n: usize,
                k: usize,
                a: Mat<'_, f32>,
                panels: &[f32],
                out: &mut [MaybeUninit<f32>],
            ) {
                match rows {
                    $($r => block::<$r>(i0, n, k, a, panels, out),)+
                    _ => unreachable!("a block of {rows} rows"),
                }
            }

            #[target_feature(enable = $feature)]
            unsafe fn block<const ROWS: usize>(
                i0: usize,
                n: usize,
                k: usize,
                a: Mat<'_, f32>,
                panels: &[f32],
                out: &mut [MaybeUninit<f32>],
            ) {
                for (q, panel) in panels.chunks(k * NR).enumerate() {
                    let j0 = q * NR;
                    let w = (n - j0).min(NR);
                    let mut acc: [[$reg; 2]; ROWS] = [[$zero(); 2]; ROWS];
                    for p in 0..k {
                        let bp = panel.as_ptr().add(p * NR);
                        let (b0, b1) = ($load(bp), $load(bp.add($lanes)));
                        for (r, acc_r) in acc.iter_mut().enumerate() {
                            let av = $set1(*a.data.get_unchecked((i0 + r) * a.rs + p * a.cs));
                            acc_r[0] = $fma(av, b0, acc_r[0]);
                            acc_r[1] = $fma(av, b1, acc_r[1]);
                        }
                    }
                    for (r, acc_r) in acc.iter().enumerate() {
                        let mut lanes = [0.0f32; NR];
                        $store(lanes.as_mut_ptr(), acc_r[0]);
                        $store(lanes.as_mut_ptr().add($lanes), acc_r[1]);
                        for (jj, v) in lanes.iter().enumerate().take(w) {
                            out[r * n + j0 + jj].write(*v);
                        }
                    }
                }
            }
        }
    };
}

vector_kernel!(avx512, "avx512f", 16, 12, __m512, _mm512_setzero_ps, _mm512_loadu_ps,
    _mm512_set1_ps, _mm512_fmadd_ps, _mm512_storeu_ps, rows: [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]);
vector_kernel!(avx2, "avx2,fma", 8, 6, __m256, _mm256_setzero_ps, _mm256_loadu_ps,
    _mm256_set1_ps, _mm256_fmadd_ps, _mm256_storeu_ps, rows: [1, 2, 3, 4, 5, 6]);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    fn mats(rng: &mut Rng, m: usize, n: usize, k: usize) -> (Vec<f32>, Vec<f32>) {
        let mut v = |len: usize| (0..len).map(|_| rng.normal() as f32).collect::<Vec<f32>>();
        (v(m * k), v(k * n))
    }

    fn run_with<T: Real>(
        lanes: Lanes,
        m: usize,
        n: usize,
        k: usize,
        a: Mat<'_, T>,
        b: Mat<'_, T>,
        par: bool,
    ) -> Vec<T> {
        let mut c = vec![MaybeUninit::<T>::uninit(); m * n];
        gemm_with(lanes, m, n, k, a, b, par, &mut c);
        // SAFETY: gemm_with writes every element.
        c.into_iter().map(|x| unsafe { x.assume_init() }).collect()
    }

    fn run<T: Real>(
        m: usize,
        n: usize,
        k: usize,
        a: Mat<'_, T>,
        b: Mat<'_, T>,
        par: bool,
    ) -> Vec<T> {
        run_with(Lanes::detect(), m, n, k, a, b, par)
    }

    /// Every lane width the CPU runs gives the scalar chains' bits, on shapes with partial
    /// row blocks and panels of both widths, transposed and strided operands, threads or not.
    #[test]
    fn every_lane_width_gives_the_scalar_chains_bits() {
        let widths = Lanes::available();
        eprintln!("lane widths on this CPU: {widths:?}");
        let mut rng = Rng::new(3);
        for &(m, n, k) in &[
            (1, 1, 1),
            (7, 17, 5),
            (13, 33, 64),
            (6, 16, 200),
            (25, 3, 9),
            (30, 70, 33),
        ] {
            let (a, b) = mats(&mut rng, m, n, k);
            for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
                let am = if ta {
                    Mat {
                        data: &a,
                        rs: 1,
                        cs: m,
                    }
                } else {
                    Mat {
                        data: &a,
                        rs: k,
                        cs: 1,
                    }
                };
                let bm = if tb {
                    Mat {
                        data: &b,
                        rs: 1,
                        cs: k,
                    }
                } else {
                    Mat {
                        data: &b,
                        rs: n,
                        cs: 1,
                    }
                };
                let want: Vec<f32> = (0..m * n)
                    .map(|t| {
                        let (i, j) = (t / n, t % n);
                        (0..k).fold(0.0f32, |s, p| {
                            am.data[i * am.rs + p * am.cs]
                                .mul_add(bm.data[p * bm.rs + j * bm.cs], s)
                        })
                    })
                    .collect();
                for (&lanes, par) in widths.iter().flat_map(|l| [(l, false), (l, true)]) {
                    let got = run_with(lanes, m, n, k, am, bm, par);
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
                    assert_eq!(
                        bits(&got),
                        bits(&want),
                        "{lanes:?} {m}x{n}x{k} trans {ta}/{tb} par {par}"
                    );
                }
            }
        }
    }

    /// Each element is within the error bound of a k-term sum, k·u·Σ|a||b|, of the exact
    /// product (in f64, itself exact to far below it), in f32 and in f64.
    #[test]
    fn products_are_within_the_sums_error_bound() {
        let mut rng = Rng::new(9);
        let (m, n, k) = (9, 21, 300);
        let (a, b) = mats(&mut rng, m, n, k);
        let got = run(
            m,
            n,
            k,
            Mat {
                data: &a,
                rs: k,
                cs: 1,
            },
            Mat {
                data: &b,
                rs: n,
                cs: 1,
            },
            false,
        );
        let (a64, b64): (Vec<f64>, Vec<f64>) = (
            a.iter().map(|&x| f64::from(x)).collect(),
            b.iter().map(|&x| f64::from(x)).collect(),
        );
        let got64 = run(
            m,
            n,
            k,
            Mat {
                data: &a64,
                rs: k,
                cs: 1,
            },
            Mat {
                data: &b64,
                rs: n,
                cs: 1,
            },
            true,
        );
        for t in 0..m * n {
            let (i, j) = (t / n, t % n);
            let exact: f64 = (0..k).map(|p| a64[i * k + p] * b64[p * n + j]).sum();
            let mag: f64 = (0..k)
                .map(|p| (a64[i * k + p] * b64[p * n + j]).abs())
                .sum();
            let bound32 = k as f64 * f64::from(f32::EPSILON) / 2.0 * mag;
            assert!(
                (f64::from(got[t]) - exact).abs() <= bound32,
                "f32 element {t}"
            );
            assert!(
                (got64[t] - exact).abs() <= k as f64 * f64::EPSILON * mag,
                "f64 element {t}"
            );
        }
    }
}
