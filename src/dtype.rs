//! Layer 0 of `amprobe::LAYERS`: uses no other module of the crate.
//!
//! Data types, their format limits, and the one rounding rule of the engine.
//!
//! Low-precision values (fp16, bf16) are held in `f32` storage, each value exactly
//! representable in its dtype. An op computes in `f32` (or `f64` for the reference dtype)
//! and rounds once, round-to-nearest-even, to its output dtype with [`round_slice`].

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use serde::{Deserialize, Serialize};

/// Element type of a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, PartialOrd, Ord)]
pub enum DType {
    /// IEEE binary16.
    #[serde(rename = "float16")]
    F16,
    /// bfloat16 (8 exponent bits, 7 mantissa bits).
    #[serde(rename = "bfloat16")]
    BF16,
    /// IEEE binary32.
    #[serde(rename = "float32")]
    F32,
    /// IEEE binary64: the reference dtype for gradient checks and error measurement.
    #[serde(rename = "float64")]
    F64,
    /// 64-bit integers, for indices and labels.
    #[serde(rename = "int64")]
    I64,
}

impl DType {
    /// PyTorch's name of the dtype (`float16`, `bfloat16`, ...).
    pub fn name(self) -> &'static str {
        match self {
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::F32 => "float32",
            DType::F64 => "float64",
            DType::I64 => "int64",
        }
    }

    /// Parses a dtype from PyTorch-style or short names (`fp16`, `half`, `bf16`, `float32`, ...).
    pub fn parse(s: &str) -> Option<DType> {
        Some(match s.to_ascii_lowercase().as_str() {
            "float16" | "fp16" | "f16" | "half" => DType::F16,
            "bfloat16" | "bf16" => DType::BF16,
            "float32" | "fp32" | "f32" | "float" => DType::F32,
            "float64" | "fp64" | "f64" | "double" => DType::F64,
            "int64" | "i64" | "long" => DType::I64,
            _ => return None,
        })
    }

    /// True for the floating-point dtypes.
    pub fn is_float(self) -> bool {
        !matches!(self, DType::I64)
    }

    /// True for fp16 and bf16.
    pub fn is_low_precision(self) -> bool {
        matches!(self, DType::F16 | DType::BF16)
    }

    /// Format limits of a floating-point dtype (None for integers).
    pub fn format(self) -> Option<Format> {
        match self {
            DType::F16 => Some(FP16),
            DType::BF16 => Some(BF16),
            DType::F32 => Some(FP32),
            DType::F64 => Some(FP64),
            DType::I64 => None,
        }
    }

    /// PyTorch's type promotion for two floating dtypes (fp16 + bf16 → fp32).
    pub fn promote(a: DType, b: DType) -> DType {
        use DType::*;
        match (a, b) {
            (x, y) if x == y => x,
            (F64, _) | (_, F64) => F64,
            (F32, _) | (_, F32) => F32,
            (F16, BF16) | (BF16, F16) => F32,
            (I64, x) | (x, I64) => x,
            _ => F32,
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Limits of a floating-point format.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Format {
    /// Name of the format.
    pub name: &'static str,
    /// Largest finite value.
    pub max: f64,
    /// Smallest positive normal value.
    pub min_normal: f64,
    /// Smallest positive subnormal value.
    pub min_subnormal: f64,
    /// Distance from 1.0 to the next larger representable value.
    pub epsilon: f64,
}

/// IEEE binary16 limits.
pub const FP16: Format = Format {
    name: "float16",
    max: 65504.0,
    min_normal: 6.103515625e-05,          // 2^-14
    min_subnormal: 5.960464477539063e-08, // 2^-24
    epsilon: 0.0009765625,                // 2^-10
};

/// bfloat16 limits.
pub const BF16: Format = Format {
    name: "bfloat16",
    max: 3.3895313892515355e38,
    min_normal: 1.1754943508222875e-38,   // 2^-126
    min_subnormal: 9.183549615799121e-41, // 2^-133
    epsilon: 0.0078125,                   // 2^-7
};

/// IEEE binary32 limits.
pub const FP32: Format = Format {
    name: "float32",
    max: f32::MAX as f64,
    min_normal: 1.1754943508222875e-38,
    min_subnormal: 1.401298464324817e-45, // 2^-149
    epsilon: f32::EPSILON as f64,
};

/// IEEE binary64 limits.
pub const FP64: Format = Format {
    name: "float64",
    max: f64::MAX,
    min_normal: f64::MIN_POSITIVE,
    min_subnormal: 5e-324,
    epsilon: f64::EPSILON,
};

/// fp8 E4M3 (the "fn" variant: no infinities, max 448), for what-if range checks.
pub const FP8_E4M3: Format = Format {
    name: "float8_e4m3fn",
    max: 448.0,
    min_normal: 0.015625,       // 2^-6
    min_subnormal: 0.001953125, // 2^-9
    epsilon: 0.125,             // 2^-3
};

/// fp8 E5M2 (IEEE-like, max 57344), for what-if range checks.
pub const FP8_E5M2: Format = Format {
    name: "float8_e5m2",
    max: 57344.0,
    min_normal: 6.103515625e-05,      // 2^-14
    min_subnormal: 1.52587890625e-05, // 2^-16
    epsilon: 0.25,                    // 2^-2
};

/// Values that over- or underflowed while being rounded to a narrower dtype.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RoundCounts {
    /// Finite before rounding, infinite after.
    pub overflow: u64,
    /// Nonzero before rounding, zero after.
    pub underflow: u64,
}

impl RoundCounts {
    /// Adds another count to this one.
    pub fn add(&mut self, o: RoundCounts) {
        self.overflow += o.overflow;
        self.underflow += o.underflow;
    }
}

/// Rounds an f32 to bf16 (round-to-nearest-even) and returns it as f32.
#[inline(always)]
pub fn round_bf16(x: f32) -> f32 {
    let b = x.to_bits();
    if (b & 0x7fff_ffff) > 0x7f80_0000 {
        // NaN: keep it NaN, quiet.
        return f32::from_bits((b | 0x0040_0000) & 0xffff_0000);
    }
    let r = b.wrapping_add(0x7fff + ((b >> 16) & 1)) & 0xffff_0000;
    f32::from_bits(r)
}

/// Rounds an f32 to fp16 (round-to-nearest-even) and returns it as f32.
#[inline]
pub fn round_f16(x: f32) -> f32 {
    f16::from_f32(x).to_f32()
}

/// Rounds one f32 value to `dtype` and returns it as f32 (f32, f64 and i64 pass through).
#[inline]
pub fn round_to(dtype: DType, x: f32) -> f32 {
    match dtype {
        DType::F16 => round_f16(x),
        DType::BF16 => round_bf16(x),
        _ => x,
    }
}

const CHUNK: usize = 1024;

/// Rounds every value of `data` in place to `dtype`, once, round-to-nearest-even,
/// and counts the values that overflowed or underflowed in doing so. Long slices are
/// rounded in parallel pieces; the counts are integers, so the result is the same.
pub fn round_slice(dtype: DType, data: &mut [f32]) -> RoundCounts {
    round_slice_with::<false>(dtype, data).0
}

/// [`round_slice`], and whether every value is finite once rounded: checked in the same
/// pass (fp16, bf16), or right after each piece is rounded, while it is in cache (other
/// dtypes), so that the check costs next to nothing beside the rounding.
pub fn round_slice_checked(dtype: DType, data: &mut [f32]) -> (RoundCounts, bool) {
    let (counts, max) = round_slice_with::<true>(dtype, data);
    (counts, max < F32_INF_BITS)
}

/// |x| bit pattern of an f32 infinity; a larger one is a NaN.
const F32_INF_BITS: u32 = 0x7f80_0000;

/// [`round_slice`], with the largest `|x|` bit pattern of the rounded values when `MAX`
/// (0 otherwise).
fn round_slice_with<const MAX: bool>(dtype: DType, data: &mut [f32]) -> (RoundCounts, u32) {
    use rayon::prelude::*;
    /// Slices at least this long are split over rayon's threads.
    const PAR_MIN: usize = 64 * 1024;
    if data.len() < PAR_MIN {
        return round_piece::<MAX>(dtype, data);
    }
    data.par_chunks_mut(PAR_MIN / 4)
        .map(|piece| round_piece::<MAX>(dtype, piece))
        .reduce(Default::default, |(mut a, x), (b, y)| {
            a.add(b);
            (a, x.max(y))
        })
}

/// [`round_slice_with`] on one thread, in code compiled for AVX-512 or AVX2 where the CPU
/// has it (the counting loops then run sixteen or eight lanes wide; the values are the same
/// either way).
fn round_piece<const MAX: bool>(dtype: DType, data: &mut [f32]) -> (RoundCounts, u32) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU was just checked to have AVX-512F.
            return unsafe { avx512::round_piece::<MAX>(dtype, data) };
        }
        #[target_feature(enable = "avx2")]
        fn avx2<const MAX: bool>(dtype: DType, data: &mut [f32]) -> (RoundCounts, u32) {
            round_piece_body::<MAX>(dtype, data)
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU was just checked to have AVX2.
            return unsafe { avx2::<MAX>(dtype, data) };
        }
    }
    round_piece_body::<MAX>(dtype, data)
}

#[inline(always)]
fn round_piece_body<const MAX: bool>(dtype: DType, data: &mut [f32]) -> (RoundCounts, u32) {
    let mut counts = RoundCounts::default();
    let mut max = 0;
    match dtype {
        DType::F16 => {
            let mut tmp = [f16::ZERO; CHUNK];
            let mut back = [0f32; CHUNK];
            for chunk in data.chunks_mut(CHUNK) {
                let n = chunk.len();
                tmp[..n].convert_from_f32_slice(chunk);
                tmp[..n].convert_to_f32_slice(&mut back[..n]);
                store_counting::<MAX>(chunk, &back[..n], &mut counts, &mut max);
            }
        }
        DType::BF16 => {
            let mut back = [0f32; CHUNK];
            for chunk in data.chunks_mut(CHUNK) {
                let n = chunk.len();
                for (o, &x) in back[..n].iter_mut().zip(chunk.iter()) {
                    *o = round_bf16(x);
                }
                store_counting::<MAX>(chunk, &back[..n], &mut counts, &mut max);
            }
        }
        _ if MAX => max = max_abs_bits_body(data),
        _ => {}
    }
    (counts, max)
}

/// The AVX-512 rounding: fp16's conversions sixteen at a time (`vcvtps2ph` with round to
/// nearest even, then `vcvtph2ps`: the F16C instructions the half crate's slice conversions
/// use eight at a time, at twice the width), the counting loop sixteen lanes wide.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{round_piece_body, store_counting, DType, RoundCounts, CHUNK};
    use std::arch::x86_64::*;

    /// [`super::round_piece`] for a CPU with AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(super) fn round_piece<const MAX: bool>(
        dtype: DType,
        data: &mut [f32],
    ) -> (RoundCounts, u32) {
        if dtype != DType::F16 {
            return round_piece_body::<MAX>(dtype, data);
        }
        let mut counts = RoundCounts::default();
        let mut max = 0;
        let mut back = [0f32; CHUNK];
        for chunk in data.chunks_mut(CHUNK) {
            let n = chunk.len();
            let full = n - n % 16;
            for i in (0..full).step_by(16) {
                // SAFETY: i + 16 <= full <= n, inside both `chunk` and `back`.
                unsafe { round16(chunk.as_ptr().add(i), back.as_mut_ptr().add(i)) };
            }
            if full < n {
                // The last few values through the same instruction, in a padded buffer.
                let (mut x, mut y) = ([0f32; 16], [0f32; 16]);
                x[..n - full].copy_from_slice(&chunk[full..]);
                // SAFETY: both buffers hold 16 values.
                unsafe { round16(x.as_ptr(), y.as_mut_ptr()) };
                back[full..n].copy_from_slice(&y[..n - full]);
            }
            store_counting::<MAX>(chunk, &back[..n], &mut counts, &mut max);
        }
        (counts, max)
    }

    /// Sixteen values at `x` rounded to fp16 and widened back, to `y`.
    #[target_feature(enable = "avx512f")]
    unsafe fn round16(x: *const f32, y: *mut f32) {
        let h = _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm512_loadu_ps(x),
        );
        _mm512_storeu_ps(y, _mm512_cvtph_ps(h));
    }
}

/// The largest `|x|` bit pattern of `data` (0 for no values): below
/// `0x7f80_0000` exactly when every value is finite.
pub fn max_abs_bits(data: &[f32]) -> u32 {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx2")]
        fn avx2(data: &[f32]) -> u32 {
            max_abs_bits_body(data)
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU was just checked to have AVX2.
            return unsafe { avx2(data) };
        }
    }
    max_abs_bits_body(data)
}

/// One fold, which the compiler turns into SIMD maxima (`vpmaxud` with AVX2, unrolled): in
/// cache about 0.02 ns per value on a Zen 3 core, against 0.19 for 32 explicit lanes.
#[inline(always)]
fn max_abs_bits_body(data: &[f32]) -> u32 {
    data.iter().fold(0, |m, x| m.max(x.to_bits() & 0x7fff_ffff))
}

/// Writes the rounded values `after` over `before` (at most [`CHUNK`] of them), counting
/// the finite values that became infinite and the nonzero ones that became zero, and,
/// when `MAX`, raising `max` to the largest `|x|` bit pattern written.
#[inline(always)]
fn store_counting<const MAX: bool>(
    before: &mut [f32],
    after: &[f32],
    counts: &mut RoundCounts,
    max: &mut u32,
) {
    // u32 lanes: a chunk holds at most 1024 values.
    let mut over = 0u32;
    let mut under = 0u32;
    let mut m = 0u32;
    for (a, &b) in before.iter_mut().zip(after) {
        let ab = a.to_bits() & 0x7fff_ffff;
        let bb = b.to_bits() & 0x7fff_ffff;
        over += ((ab < 0x7f80_0000) & (bb == 0x7f80_0000)) as u32;
        under += ((ab != 0) & (bb == 0)) as u32;
        if MAX {
            m = m.max(bb);
        }
        *a = b;
    }
    counts.overflow += u64::from(over);
    counts.underflow += u64::from(under);
    *max = (*max).max(m);
}

/// Rounds an f64 to f32 with round-to-odd, so that a following round-to-nearest-even to a
/// format of at most 24 significand bits gives the correctly rounded result (no double
/// rounding).
fn f64_to_f32_round_to_odd(x: f64) -> f32 {
    if !x.is_finite() {
        return x as f32;
    }
    let r = x as f32; // round-to-nearest-even
    if r as f64 == x {
        return r;
    }
    // Truncate toward zero, then set the sticky bit.
    let t = if (r as f64).abs() > x.abs() {
        f32::from_bits(r.to_bits() - 1)
    } else {
        r
    };
    f32::from_bits(t.to_bits() | 1)
}

/// Rounds an f64 once, correctly, to `dtype` (returned as f64).
pub fn round_f64_to(dtype: DType, x: f64) -> f64 {
    match dtype {
        DType::F64 | DType::I64 => x,
        DType::F32 => x as f32 as f64,
        DType::F16 => round_f16(f64_to_f32_round_to_odd(x)) as f64,
        DType::BF16 => round_bf16(f64_to_f32_round_to_odd(x)) as f64,
    }
}

/// Converts an f16 bit pattern to f32.
pub fn f16_bits_to_f32(bits: u16) -> f32 {
    f16::from_bits(bits).to_f32()
}

/// Converts a bf16 bit pattern to f32.
pub fn bf16_bits_to_f32(bits: u16) -> f32 {
    bf16::from_bits(bits).to_f32()
}

#[cfg(test)]
mod tests {

    #[test]
    fn a_long_slice_rounds_and_counts_as_one_thread_does() {
        let mut rng = crate::rng::Rng::new(9);
        let v: Vec<f32> = (0..300_001)
            .map(|i| match i % 7 {
                0 => 1e6,
                1 => 1e-9,
                _ => (rng.normal() * 1e3) as f32,
            })
            .collect();
        for dt in [DType::F16, DType::BF16] {
            let (mut par, mut one) = (v.clone(), v.clone());
            let a = round_slice(dt, &mut par);
            let b = round_piece::<false>(dt, &mut one).0;
            assert_eq!(a, b, "{dt}");
            assert!(b.overflow > 0 || dt == DType::BF16);
            assert!(par
                .iter()
                .zip(&one)
                .all(|(x, y)| x.to_bits() == y.to_bits()));
        }
    }

    use super::*;

    /// The AVX-512 fp16 rounding gives the portable path's bits and counts on every one of
    /// the 2^32 f32 patterns (NaN payloads included), in chunks of 1000 values (tails
    /// through the padded buffer) and as whole chunks.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx512_fp16_rounding_agrees_on_every_f32_pattern() {
        if !std::arch::is_x86_feature_detected!("avx512f") {
            eprintln!("no AVX-512F on this CPU: the path is not taken here");
            return;
        }
        let block = 1u64 << 20;
        let (mut a, mut b) = (vec![0f32; block as usize], vec![0f32; block as usize]);
        let (mut ca, mut cb) = (RoundCounts::default(), RoundCounts::default());
        for start in (0..1u64 << 32).step_by(block as usize) {
            for (i, (x, y)) in a.iter_mut().zip(b.iter_mut()).enumerate() {
                *x = f32::from_bits((start + i as u64) as u32);
                *y = *x;
            }
            for (pa, pb) in a.chunks_mut(1000).zip(b.chunks_mut(1000)) {
                // SAFETY: checked above that the CPU has AVX-512F.
                let (c, m) = unsafe { avx512::round_piece::<true>(DType::F16, pa) };
                let (d, n) = round_piece_body::<true>(DType::F16, pb);
                assert_eq!(m, n, "max from {start:#x}");
                ca.add(c);
                cb.add(d);
            }
            assert!(
                a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
                "patterns from {start:#x}"
            );
        }
        assert_eq!(ca, cb);
        assert!(ca.overflow > 0 && ca.underflow > 0);
    }

    #[test]
    fn dispatched_and_portable_rounding_agree_on_values_and_counts() {
        // Every 997th f32 bit pattern: normals, subnormals, infinities and NaNs alike.
        let data: Vec<f32> = (0..=u32::MAX / 997)
            .map(|i| f32::from_bits(i * 997))
            .collect();
        for dtype in [DType::F16, DType::BF16, DType::F32] {
            let (mut a, mut b) = (data.clone(), data.clone());
            let ca = round_piece::<false>(dtype, &mut a);
            let cb = round_piece_body::<false>(dtype, &mut b);
            assert_eq!(ca, cb, "{dtype}");
            let ca = ca.0;
            assert!(
                a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
                "{dtype}"
            );
            if dtype == DType::F16 {
                assert!(ca.overflow > 0 && ca.underflow > 0);
            }
        }
    }

    /// The checked rounding rounds and counts as the plain one does, and its verdict and
    /// the largest absolute pattern are those of the rounded values, whether they were
    /// non-finite before (every 997th pattern), became so (fp16 overflow) or are finite.
    #[test]
    fn checked_rounding_says_whether_every_rounded_value_is_finite() {
        let every: Vec<f32> = (0..=u32::MAX / 997)
            .map(|i| f32::from_bits(i * 997))
            .collect();
        let finite: Vec<f32> = every.iter().copied().filter(|x| x.is_finite()).collect();
        let small: Vec<f32> = finite.iter().map(|x| x.clamp(-6.0e4, 6.0e4)).collect();
        for dtype in [DType::F16, DType::BF16, DType::F32] {
            for data in [&every, &finite, &small] {
                for n in [data.len(), 1000, 33] {
                    let (mut a, mut b) = (data[..n].to_vec(), data[..n].to_vec());
                    let counts = round_slice(dtype, &mut a);
                    let (checked, all_finite) = round_slice_checked(dtype, &mut b);
                    assert_eq!(counts, checked, "{dtype}");
                    assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()));
                    assert_eq!(all_finite, b.iter().all(|x| x.is_finite()), "{dtype} {n}");
                    let max = b.iter().map(|x| x.to_bits() & 0x7fff_ffff).max().unwrap();
                    assert_eq!(round_piece::<true>(dtype, &mut b).1, max, "{dtype}");
                    assert_eq!(max_abs_bits(&b), max);
                    assert_eq!(max_abs_bits_body(&b), max);
                }
            }
            let (_, ok) = round_slice_checked(dtype, &mut small.clone());
            assert!(ok, "{dtype}");
            let (_, ok) = round_slice_checked(dtype, &mut finite.clone());
            // The largest f32 values overflow fp16 and bf16.
            assert_eq!(ok, dtype == DType::F32, "{dtype}");
        }
        assert_eq!(max_abs_bits(&[]), 0);
    }

    #[test]
    fn all_f16_patterns_round_trip() {
        for bits in 0..=u16::MAX {
            let h = f16::from_bits(bits);
            let x = h.to_f32();
            let r = round_f16(x);
            if h.is_nan() {
                assert!(r.is_nan(), "{bits:#06x}");
            } else {
                assert_eq!(r.to_bits(), x.to_bits(), "{bits:#06x}");
                assert_eq!(f16::from_f32(r).to_bits(), bits);
            }
            let mut v = [x];
            let c = round_slice(DType::F16, &mut v);
            assert_eq!(c, RoundCounts::default());
            assert!(v[0].to_bits() == x.to_bits() || x.is_nan());
        }
    }

    #[test]
    fn all_bf16_patterns_round_trip() {
        for bits in 0..=u16::MAX {
            let h = bf16::from_bits(bits);
            let x = h.to_f32();
            let r = round_bf16(x);
            if h.is_nan() {
                assert!(r.is_nan());
            } else {
                assert_eq!(r.to_bits(), x.to_bits(), "{bits:#06x}");
            }
        }
    }

    #[test]
    fn dense_f32_sweep_matches_half() {
        // Every 97th f32 bit pattern, plus all patterns near the fp16 range edges.
        let mut xs: Vec<f32> = (0..=u32::MAX / 97)
            .map(|i| f32::from_bits(i * 97))
            .collect();
        for base in [
            65504f32,
            65519.0,
            65520.0,
            2f32.powi(-24),
            2f32.powi(-25),
            2f32.powi(-14),
        ] {
            let b = base.to_bits();
            for d in 0..4096u32 {
                xs.push(f32::from_bits(b.wrapping_add(d)));
                xs.push(f32::from_bits(b.wrapping_sub(d)));
            }
        }
        let mut a = xs.clone();
        round_slice(DType::F16, &mut a);
        let mut b = xs.clone();
        round_slice(DType::BF16, &mut b);
        for (i, &x) in xs.iter().enumerate() {
            let h = f16::from_f32(x).to_f32();
            let g = bf16::from_f32(x).to_f32();
            if x.is_nan() {
                assert!(a[i].is_nan() && b[i].is_nan());
                continue;
            }
            assert_eq!(a[i].to_bits(), h.to_bits(), "f16 of {x:e}");
            assert_eq!(b[i].to_bits(), g.to_bits(), "bf16 of {x:e}");
            assert_eq!(round_bf16(x).to_bits(), g.to_bits());
        }
    }

    #[test]
    fn edge_cases() {
        assert_eq!(round_f16(65519.0), 65504.0);
        assert_eq!(round_f16(65520.0), f32::INFINITY);
        assert_eq!(round_f16(-65520.0), f32::NEG_INFINITY);
        assert_eq!(round_f16(2f32.powi(-25)), 0.0); // tie to even (zero)
        assert_eq!(round_f16(2f32.powi(-25) * 1.0000001), 2f32.powi(-24));
        assert_eq!(round_f16(2f32.powi(-24)), 2f32.powi(-24));
        // Ties to even: 1 + 2^-11 lies halfway between 1 and 1 + 2^-10.
        assert_eq!(round_f16(1.0 + 2f32.powi(-11)), 1.0);
        assert_eq!(
            round_f16(1.0 + 3.0 * 2f32.powi(-11)),
            1.0 + 2.0 * 2f32.powi(-10)
        );
        assert_eq!(round_bf16(1.0 + 2f32.powi(-8)), 1.0);
        assert_eq!(round_bf16(f32::MAX), f32::INFINITY);
        let mut v = vec![65520.0f32, 1e-8, 3.0, 0.0, f32::INFINITY];
        let c = round_slice(DType::F16, &mut v);
        assert_eq!(
            c,
            RoundCounts {
                overflow: 1,
                underflow: 1
            }
        );
    }

    #[test]
    fn f64_rounding_is_single() {
        // 1 + 2^-11 + 2^-40 is above the fp16 tie: it must round up, where f64→f32→f16
        // would first land on the tie and then round to even (down).
        let x = 1.0 + 2f64.powi(-11) + 2f64.powi(-40);
        assert_eq!(round_f64_to(DType::F16, x), 1.0 + 2f64.powi(-10));
        assert_eq!(round_f64_to(DType::F16, 1.0 + 2f64.powi(-11)), 1.0);
        let y = 1.0 + 2f64.powi(-8) + 2f64.powi(-40);
        assert_eq!(round_f64_to(DType::BF16, y), 1.0 + 2f64.powi(-7));
        assert_eq!(round_f64_to(DType::F16, 1e6), f64::INFINITY);
    }

    #[test]
    fn constants_match_half() {
        assert_eq!(FP16.max, f16::MAX.to_f64());
        assert_eq!(FP16.min_normal, f16::MIN_POSITIVE.to_f64());
        assert_eq!(FP16.min_subnormal, f16::from_bits(1).to_f64());
        assert_eq!(FP16.epsilon, f16::EPSILON.to_f64());
        assert_eq!(BF16.max, bf16::MAX.to_f64());
        assert_eq!(BF16.min_normal, bf16::MIN_POSITIVE.to_f64());
        assert_eq!(BF16.min_subnormal, bf16::from_bits(1).to_f64());
        assert_eq!(BF16.epsilon, bf16::EPSILON.to_f64());
        assert_eq!(FP32.min_subnormal, f32::from_bits(1) as f64);
        assert_eq!(FP8_E4M3.max, 448.0);
        assert_eq!(FP8_E5M2.max, 57344.0);
    }
}
