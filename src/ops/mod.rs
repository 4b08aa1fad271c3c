//! Layer 6 of `amprobe::LAYERS`: may use layers 0–5 (`dtype` … `engine`).
//!
//! Ops: one module per family. Each op has a forward kernel, a backward, and an autocast
//! category (its ATen name looked up in the policy table).
//!
//! Kernels compute in `f32` (in `f64` for the reference dtype) and round once to the output
//! dtype; reductions accumulate in `f64` before that single rounding.
//!
//! The backend seam: each family is a folder whose `kernels.rs` states once, as a
//! `Kernels` trait, what a backend must provide; `cpu.rs` implements it on the host
//! (`Host`) and `cuda.rs` on a device (`Device`, beside its `.cu` source); `mod.rs` holds
//! the ops and their recording and reaches kernels only through the family's `kernels(t)`,
//! which picks by [`on_device`]. A backend that lacks a kernel does not compile. A host
//! kernel handed device storage (which the seam never does) refuses it with an error naming
//! the op ([`fdata`]).
//!
//! Which family holds an op (each an `Engine` method in the family's `mod.rs`):
//!
//! | folder | ops |
//! |---|---|
//! | `cast/` | `to_dtype` (autocast's and promotion's casts) |
//! | `elementwise/` | `unary`, `binary`, `add`, `sub`, `mul`, `div`, `neg`, `relu`, `gelu`, `silu`, `tanh`, `sigmoid`, `exp`, `log`, `pow`, `sqrt`, `rsqrt`, `clamp`, `clamp_on_inf`, `mul_scalar`, `add_scalar` (the formulas in `functions.rs`) |
//! | `linalg/` | `linear`, `addmm`, `matmul`, `bmm` |
//! | `reduce/` | `sum`, `mean`, `max`, `softmax`, `log_softmax` |
//! | `nn/` | `layer_norm`, `embedding`, `embedding_padded`, `dropout` |
//! | `loss/` | `nll_loss`, `cross_entropy`, `mse_loss` |
//! | `select/` | `where_`, `masked_fill` |
//! | `shape/` | `reshape`, `view`, `unsqueeze`, `squeeze`, `transpose`, `permute`, `slice`, `cat` |
//!
//! Gradient accumulation (`accumulate_grad`) is the engine's, not an op family's.

pub mod cast;
pub mod cuda;
pub mod elementwise;
pub mod gradcheck;
pub mod kernel_sources;
pub mod linalg;
pub mod loss;
pub mod nn;
pub mod reduce;
pub mod select;
pub mod shape;

use crate::dtype::{round_slice, DType, RoundCounts};
use crate::engine::{Computed, Grad};
use crate::error::{Error, Result};
use crate::tensor::{Real, Storage, Tensor};

/// Float data of a tensor, borrowed.
pub(crate) enum FData<'a> {
    /// f32 storage (f32, f16, bf16).
    F32(&'a [f32]),
    /// f64 storage.
    F64(&'a [f64]),
}

/// Borrows the float data of a tensor, or fails naming the op.
pub(crate) fn fdata<'a>(t: &'a Tensor, op: &str) -> Result<FData<'a>> {
    match t.storage() {
        Storage::F32(v) => Ok(FData::F32(v)),
        Storage::F64(v) => Ok(FData::F64(v)),
        Storage::I64(_) => Err(Error::shape(
            op,
            "expected a floating-point tensor, got int64",
        )),
        Storage::Cuda(_) => Err(no_device_kernel(op)),
    }
}

/// The error of a host-only op given a device tensor.
pub(crate) fn no_device_kernel(op: &str) -> Error {
    Error::Device(format!(
        "`{op}` has no CUDA kernel yet: run it on the CPU backend"
    ))
}

/// Values of a computation in the compute type of a dtype.
pub(crate) trait Finish: Real {
    /// Builds the tensor, rounding once to `dtype`.
    fn finish(data: Vec<Self>, shape: &[usize], dtype: DType) -> Result<Computed>;
    /// Builds the tensor from f64 accumulators, rounding each once to `dtype`.
    fn finish_acc(acc: Vec<f64>, shape: &[usize], dtype: DType) -> Result<Computed>;
    /// Rounds a piece of an output to `dtype` in place (one thread), counting over- and
    /// underflow.
    fn round_piece(dtype: DType, piece: &mut [Self]) -> RoundCounts;
    /// [`Finish::round_piece`], and whether every value of the piece is finite once
    /// rounded (false: not known), checked while the piece is in cache.
    fn round_piece_checked(dtype: DType, piece: &mut [Self]) -> (RoundCounts, bool);
    /// Builds the tensor from values [`Finish::round_piece`] has already rounded.
    fn finish_rounded(
        data: Vec<Self>,
        rounding: RoundCounts,
        shape: &[usize],
        dtype: DType,
    ) -> Result<Computed>;
}

/// Outputs at least this long are produced over rayon's threads.
pub(crate) const PAR_MIN: usize = 64 * 1024;
/// The piece of an output one thread computes and rounds at a time (small enough to stay
/// in cache between the two).
pub(crate) const PIECE: usize = 8 * 1024;

/// Produces an op's `n` output values piece by piece: `f(start, piece)` writes elements
/// `start..start + piece.len()`, and each piece is rounded to `dtype` right after, while it
/// is in cache. Long outputs run over rayon's threads; every element is computed alone, so
/// the values and counts are those of one thread.
pub(crate) fn produce<T: Finish>(
    n: usize,
    shape: &[usize],
    dtype: DType,
    f: impl Fn(usize, &mut [T]) + Sync + Send,
) -> Result<Computed> {
    produce_in(PIECE, n, shape, dtype, f)
}

/// [`produce`] with pieces of `piece` values (at least 1; a multiple of a line's length
/// for kernels that write whole lines).
pub(crate) fn produce_in<T: Finish>(
    piece: usize,
    n: usize,
    shape: &[usize],
    dtype: DType,
    f: impl Fn(usize, &mut [T]) + Sync + Send,
) -> Result<Computed> {
    use rayon::prelude::*;
    // Read on the calling thread: the pieces may run on others.
    let check = crate::engine::finite_checks();
    let round = |p: &mut [T]| round_checked_if(check, dtype, p);
    if n >= PAR_MIN {
        // Each piece is zeroed just before it is computed, while it is in cache, rather
        // than the whole output up front (a pass over memory of its own).
        let mut out: Vec<T> = Vec::with_capacity(n);
        let (rounding, finite) = out.spare_capacity_mut()[..n]
            .par_chunks_mut(piece)
            .enumerate()
            .map(|(c, p)| {
                let p = zeroed(p);
                f(c * piece, p);
                round(p)
            })
            .reduce(
                || (RoundCounts::default(), true),
                |(mut a, x), (b, y)| {
                    a.add(b);
                    (a, x && y)
                },
            );
        // SAFETY: the pieces cover 0..n and each was initialized by `zeroed`.
        unsafe { out.set_len(n) };
        let c = T::finish_rounded(out, rounding, shape, dtype)?;
        return Ok(Computed { finite, ..c });
    }
    let mut out = vec![T::zero(); n];
    f(0, &mut out);
    let (rounding, finite) = round(&mut out);
    let c = T::finish_rounded(out, rounding, shape, dtype)?;
    Ok(Computed { finite, ..c })
}

/// [`Finish::round_piece`], checking the values for non-finite ones as well when `check`:
/// the rounding counts and whether every value is known to be finite.
fn round_checked_if<T: Finish>(check: bool, dtype: DType, p: &mut [T]) -> (RoundCounts, bool) {
    match check {
        true => T::round_piece_checked(dtype, p),
        false => (T::round_piece(dtype, p), false),
    }
}

/// Pieces of whole lines of `n` values, about [`PIECE`] values each (a line of no values
/// still makes a whole number of lines per piece).
pub(crate) fn line_piece(n: usize) -> usize {
    let w = n.max(1);
    (PIECE / w).max(1) * w
}

/// Produces an output of `outer` contiguous lines of `n` values: `f(line, out)` writes one
/// line. Groups of whole lines are the pieces of [`produce_in`] (over rayon's threads, each
/// rounded while in cache); every line is computed alone.
pub(crate) fn produce_lines<T: Finish>(
    outer: usize,
    n: usize,
    shape: &[usize],
    dtype: DType,
    f: impl Fn(usize, &mut [T]) + Sync + Send,
) -> Result<Computed> {
    let w = n.max(1);
    produce_in(
        line_piece(n),
        outer * n,
        shape,
        dtype,
        |s, piece: &mut [T]| {
            for (k, line) in piece.chunks_mut(w).enumerate() {
                f(s / w + k, line);
            }
        },
    )
}

/// A kernel's loop over one piece of its output, for [`produce_wide`]: `run(start, piece)`
/// writes elements `start..start + piece.len()`. Each implementation marks `run`
/// `#[inline(always)]`, so that it is compiled into the AVX2 copy as well as the portable
/// one (a closure would be compiled once, for the portable target).
pub(crate) trait PieceKernel<T>: Sync + Send {
    /// Writes one piece.
    fn run(&self, start: usize, piece: &mut [T]);
}

/// [`produce`] for a [`PieceKernel`], run in code compiled for AVX2 where the CPU has it: the
/// kernel's element loop then runs 4 f64 or 8 f32 lanes wide (the branch-free
/// transcendentals of [`crate::tensor::exp_f32`] and its kin above all). The values are the
/// same either way: no fused multiply-add is formed from separate operations.
pub(crate) fn produce_wide<T: Finish, K: PieceKernel<T>>(
    n: usize,
    shape: &[usize],
    dtype: DType,
    kernel: K,
) -> Result<Computed> {
    produce(n, shape, dtype, |s, p| run_wide(&kernel, s, p))
}

#[inline(always)]
pub(crate) fn run_wide<T, K: PieceKernel<T>>(kernel: &K, start: usize, piece: &mut [T]) {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx2")]
        fn avx2<T, K: PieceKernel<T>>(kernel: &K, start: usize, piece: &mut [T]) {
            kernel.run(start, piece)
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU was just checked to have AVX2.
            return unsafe { avx2(kernel, start, piece) };
        }
    }
    kernel.run(start, piece)
}

/// Writes zeros over an uninitialized piece and returns it as initialized values.
fn zeroed<T: Real>(p: &mut [std::mem::MaybeUninit<T>]) -> &mut [T] {
    for v in p.iter_mut() {
        v.write(T::zero());
    }
    // SAFETY: every element was just written; MaybeUninit<T> has T's layout.
    unsafe { &mut *(p as *mut [std::mem::MaybeUninit<T>] as *mut [T]) }
}

impl Finish for f32 {
    fn round_piece(dtype: DType, piece: &mut [f32]) -> RoundCounts {
        round_slice(dtype, piece)
    }
    fn round_piece_checked(dtype: DType, piece: &mut [f32]) -> (RoundCounts, bool) {
        crate::dtype::round_slice_checked(dtype, piece)
    }
    fn finish_rounded(
        data: Vec<f32>,
        rounding: RoundCounts,
        shape: &[usize],
        dtype: DType,
    ) -> Result<Computed> {
        Ok(Computed::new(
            Tensor::from_exact(data, shape, dtype)?,
            rounding,
        ))
    }
    fn finish(mut data: Vec<f32>, shape: &[usize], dtype: DType) -> Result<Computed> {
        let (rounding, finite) = round_checked_if(crate::engine::finite_checks(), dtype, &mut data);
        Ok(Computed {
            finite,
            ..Computed::new(Tensor::from_exact(data, shape, dtype)?, rounding)
        })
    }
    fn finish_acc(acc: Vec<f64>, shape: &[usize], dtype: DType) -> Result<Computed> {
        let mut rounding = RoundCounts::default();
        if dtype == DType::F32 {
            let data: Vec<f32> = acc.iter().map(|&x| x as f32).collect();
            for (&x, &r) in acc.iter().zip(&data) {
                rounding.overflow += (x.is_finite() && r.is_infinite()) as u64;
                rounding.underflow += (x != 0.0 && r == 0.0) as u64;
            }
            return Ok(Computed::new(
                Tensor::from_exact(data, shape, dtype)?,
                rounding,
            ));
        }
        let data: Vec<f32> = acc
            .into_iter()
            .map(|x| {
                let r = crate::dtype::round_f64_to(dtype, x) as f32;
                rounding.overflow += (x.is_finite() && r.is_infinite()) as u64;
                rounding.underflow += (x != 0.0 && r == 0.0) as u64;
                r
            })
            .collect();
        Ok(Computed::new(
            Tensor::from_exact(data, shape, dtype)?,
            rounding,
        ))
    }
}

impl Finish for f64 {
    fn round_piece(_dtype: DType, _piece: &mut [f64]) -> RoundCounts {
        RoundCounts::default()
    }
    // Probes compute the statistics of f64 outputs in full: nothing to check here.
    fn round_piece_checked(_dtype: DType, _piece: &mut [f64]) -> (RoundCounts, bool) {
        (RoundCounts::default(), false)
    }
    fn finish_rounded(
        data: Vec<f64>,
        _rounding: RoundCounts,
        shape: &[usize],
        _dtype: DType,
    ) -> Result<Computed> {
        Ok(Computed::new(
            Tensor::from_f64(data, shape)?,
            RoundCounts::default(),
        ))
    }
    fn finish(data: Vec<f64>, shape: &[usize], _dtype: DType) -> Result<Computed> {
        Ok(Computed::new(
            Tensor::from_f64(data, shape)?,
            RoundCounts::default(),
        ))
    }
    fn finish_acc(acc: Vec<f64>, shape: &[usize], _dtype: DType) -> Result<Computed> {
        Ok(Computed::new(
            Tensor::from_f64(acc, shape)?,
            RoundCounts::default(),
        ))
    }
}

/// Turns a computed result into a gradient.
pub(crate) fn grad(c: Computed) -> Option<Grad> {
    Some(Grad {
        tensor: c.tensor,
        rounding: c.rounding,
        slot: c.slot,
        permuted: c.permuted,
        finite: c.finite,
    })
}

/// Whether `t` lives on a device: the one test by which each op family picks its
/// backend's kernels (the family's `kernels`).
pub(crate) fn on_device(t: &Tensor) -> bool {
    t.storage().is_device()
}

/// A fresh arena slot on `t`'s device for an op's rounding counts, with the counters'
/// device address for the kernel.
pub(crate) fn device_counts(t: &Tensor) -> Result<(u32, u64)> {
    t.cuda("device op")?.dev.counts_slot()
}

/// [`device_counts`] as the kernel that writes the op's output takes it: the slot, and
/// where that kernel counts its rounding and (while the arena gathers) its statistics.
pub(crate) fn device_out(t: &Tensor) -> Result<(u32, cuda::Out)> {
    let (slot, counts) = device_counts(t)?;
    Ok((slot, cuda::Out::new(slot, counts)))
}

/// `n` arena slots at once, for an op whose kernels are launched after all of them are
/// taken (a slot taken later could move the arena under the earlier addresses).
pub(crate) fn device_counts_n(t: &Tensor, n: usize) -> Result<Vec<(u32, u64)>> {
    t.cuda("device op")?.dev.counts_slots(n)
}

/// Dispatches a generic computation over the float storage of one tensor.
macro_rules! with_float {
    ($t:expr, $op:expr, |$d:ident| $body:expr) => {
        match $crate::ops::fdata($t, $op)? {
            $crate::ops::FData::F32($d) => $body,
            $crate::ops::FData::F64($d) => $body,
        }
    };
}
pub(crate) use with_float;

/// Dispatches a generic computation over the float storage of two same-dtype tensors.
macro_rules! with_float2 {
    ($a:expr, $b:expr, $op:expr, |$x:ident, $y:ident| $body:expr) => {
        match ($crate::ops::fdata($a, $op)?, $crate::ops::fdata($b, $op)?) {
            ($crate::ops::FData::F32($x), $crate::ops::FData::F32($y)) => $body,
            ($crate::ops::FData::F64($x), $crate::ops::FData::F64($y)) => $body,
            _ => {
                return Err($crate::error::Error::shape(
                    $op,
                    format!(
                        "inputs have different storage ({} and {})",
                        $a.dtype(),
                        $b.dtype()
                    ),
                ))
            }
        }
    };
}
pub(crate) use with_float2;

/// Checks that `t` is floating point.
pub(crate) fn expect_float(t: &Tensor, op: &str, what: &str) -> Result<()> {
    if !t.dtype().is_float() {
        return Err(Error::shape(
            op,
            format!("{what} must be floating point, got {}", t.dtype()),
        ));
    }
    Ok(())
}

/// Broadcast shape of two shapes (NumPy rules).
pub fn broadcast_shape(a: &[usize], b: &[usize], op: &str) -> Result<Vec<usize>> {
    let r = a.len().max(b.len());
    let mut out = vec![0; r];
    for i in 0..r {
        let da = if i + a.len() >= r {
            a[i + a.len() - r]
        } else {
            1
        };
        let db = if i + b.len() >= r {
            b[i + b.len() - r]
        } else {
            1
        };
        out[i] = match (da, db) {
            (x, y) if x == y => x,
            (1, y) => y,
            (x, 1) => x,
            _ => {
                return Err(Error::shape(
                    op,
                    format!("shapes {a:?} and {b:?} do not broadcast"),
                ))
            }
        };
    }
    Ok(out)
}

/// How a broadcast operand's elements map onto the output, for the common fast cases.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pattern {
    /// The operand is the output's trailing dims (a bias): element i of the output uses
    /// operand element i % k.
    Tile(usize),
    /// The operand is the output's leading dims with trailing 1s (a per-row scale):
    /// element i uses operand element i / r.
    Repeat(usize),
    /// Anything else.
    General,
}

impl Pattern {
    /// The pattern of `shape` broadcast to `out`.
    pub(crate) fn of(shape: &[usize], out: &[usize]) -> Pattern {
        let r = out.len();
        let pad = r - shape.len().min(r);
        let dim = |i: usize| if i < pad { 1 } else { shape[i - pad] };
        let n: usize = shape.iter().product();
        let total: usize = out.iter().product();
        if n == 0 || total == 0 {
            return Pattern::General;
        }
        // Tile: leading dims 1, then exactly the output's trailing dims.
        let first_real = (0..r).find(|&i| dim(i) != 1).unwrap_or(r);
        if (first_real..r).all(|i| dim(i) == out[i]) {
            return Pattern::Tile(n);
        }
        // Repeat: exactly the output's leading dims, then 1s.
        let last_real = (0..r).rev().find(|&i| dim(i) != 1).map_or(0, |i| i + 1);
        if (0..last_real).all(|i| dim(i) == out[i]) {
            return Pattern::Repeat(total / n);
        }
        Pattern::General
    }
}

/// Strides of `shape` inside a broadcast `out` shape (0 where broadcast).
pub(crate) fn bstrides(shape: &[usize], out: &[usize]) -> Vec<usize> {
    let r = out.len();
    let own = crate::tensor::strides(shape);
    let mut s = vec![0; r];
    for i in 0..shape.len() {
        let o = r - shape.len() + i;
        s[o] = if shape[i] == 1 && out[o] != 1 {
            0
        } else {
            own[i]
        };
    }
    s
}

/// Visits every element of the `out` shape in row-major order with the flat offsets of
/// inputs with the given strides.
pub(crate) fn for_each_offset<const N: usize>(
    out: &[usize],
    strides: [&[usize]; N],
    mut f: impl FnMut([usize; N]),
) {
    let total: usize = out.iter().product();
    if total == 0 {
        return;
    }
    let r = out.len();
    if r == 0 {
        f([0; N]);
        return;
    }
    let inner = out[r - 1];
    let inner_s: [usize; N] = std::array::from_fn(|k| strides[k][r - 1]);
    let mut idx = vec![0usize; r];
    let mut base = [0usize; N];
    let outer = total / inner;
    for _ in 0..outer {
        for j in 0..inner {
            f(std::array::from_fn(|k| base[k] + j * inner_s[k]));
        }
        for d in (0..r - 1).rev() {
            idx[d] += 1;
            for k in 0..N {
                base[k] += strides[k][d];
            }
            if idx[d] < out[d] {
                break;
            }
            for k in 0..N {
                base[k] -= strides[k][d] * out[d];
            }
            idx[d] = 0;
        }
    }
}

/// Sums `data` (of shape `full`) down to `target` (broadcast-compatible, same rank or a
/// suffix), accumulating in f64.
pub(crate) fn sum_to_f64<T: Real>(data: &[T], full: &[usize], target: &[usize]) -> Vec<f64> {
    let n: usize = target.iter().product();
    let mut acc = vec![0f64; n];
    if target == full {
        return data.iter().map(|x| x.f64()).collect();
    }
    match Pattern::of(target, full) {
        Pattern::Tile(k) => {
            for rowv in data.chunks_exact(k) {
                for (a, &x) in acc.iter_mut().zip(rowv) {
                    *a += x.f64();
                }
            }
            return acc;
        }
        Pattern::Repeat(r) => {
            for (a, rowv) in acc.iter_mut().zip(data.chunks_exact(r)) {
                *a = rowv.iter().map(|x| x.f64()).sum();
            }
            return acc;
        }
        Pattern::General => {}
    }
    let ts = bstrides(target, full);
    let ones = crate::tensor::strides(full);
    for_each_offset(full, [&ones, &ts], |[i, t]| acc[t] += data[i].f64());
    acc
}

/// Sums `data` down to `target` and rounds once to `dtype`.
pub(crate) fn sum_to<T: Finish>(
    data: &[T],
    full: &[usize],
    target: &[usize],
    dtype: DType,
) -> Result<Computed> {
    if full == target {
        // Nothing to sum: the values are already in the dtype.
        return T::finish(data.to_vec(), target, dtype);
    }
    T::finish_acc(sum_to_f64(data, full, target), target, dtype)
}
