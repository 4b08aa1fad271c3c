//! Transcendental functions of f32 values as the device kernels compute them: in f64, then
//! rounded once to f32 (`(float)tanh((double)x)` and the like). Each is branch-free, so a
//! loop over it vectorizes; libm's scalar `tanhf`, `expf` and `erff` were a tenth of a
//! GPT-2 or BERT step. Each is within one ulp of the f64 function rounded once, and equal
//! to it for all but rare inputs whose value lies within about 1e-15 of a rounding tie.

const LOG2E: f64 = std::f64::consts::LOG2_E;
// ln 2 split so that k · LN2_HI is exact for every |k| < 2^20.
const LN2_HI: f64 = 6.931_471_803_691_238e-1;
const LN2_LO: f64 = 1.908_214_929_270_587_7e-10;
// Adding 1.5 · 2^52 rounds to an integer, which lands in the low mantissa bits.
const SHIFT: f64 = 6_755_399_441_055_744.0;
/// (e^r − 1)/r = Σ r^j/(j + 1)! for j = 0..=12.
const EM1_OVER_R: [f64; 13] = {
    let mut c = [1.0; 13];
    let mut j = 1;
    while j < 13 {
        c[j] = c[j - 1] / (j + 1) as f64;
        j += 1;
    }
    c
};

/// `e^y = (m + 1) · s` for |y| ≤ 700: `y = k·ln 2 + r`, |r| ≤ ln 2 / 2, `m = e^r − 1` by its
/// Taylor series to degree 13 (no cancellation near 0; the first term left out is under
/// 4e-18 of it) and `s = 2^k` from the exponent bits. Returns `(m, s, k)`.
#[inline(always)]
fn exp_reduced(y: f64) -> (f64, f64, f64) {
    let kd = y * LOG2E + SHIFT;
    let k = kd - SHIFT;
    let r = (y - k * LN2_HI) - k * LN2_LO;
    let q = poly(&EM1_OVER_R, r);
    // The low 12 bits of kd hold k (two's complement), so this is 2^k for |k| ≤ 1022.
    let s = f64::from_bits(kd.to_bits().wrapping_add(1023) << 52);
    (q * r, s, k)
}

/// e^x of an f32, computed in f64 and rounded once (the device's `(float)exp((double)x)`).
/// Arguments beyond ±110 give what e^±110 rounds to (+inf, 0); NaN stays NaN.
#[inline(always)]
pub fn exp_f32(x: f32) -> f32 {
    let y = x as f64;
    // Comparisons rather than min/max, so that NaN passes through.
    #[allow(clippy::manual_clamp)]
    let y = if y < -110.0 {
        -110.0
    } else if y > 110.0 {
        110.0
    } else {
        y
    };
    let (m, s, _) = exp_reduced(y);
    ((m + 1.0) * s) as f32
}

/// tanh of an f32, computed in f64 and rounded once (the device's `(float)tanh((double)x)`):
/// `e = exp(2|x|)`, then `(e − 1) / (e + 1)` with the sign of `x`.
#[inline(always)]
pub fn tanh_f32(x: f32) -> f32 {
    // tanh(20) rounds to 1 in f32; the clamp also takes ±inf there.
    let y = 2.0 * (x as f64).abs().min(20.0);
    let (em1r, s, k) = exp_reduced(y);
    let em1 = if k == 0.0 {
        em1r
    } else {
        (em1r + 1.0) * s - 1.0
    };
    let t = (em1 / (em1 + 2.0)) as f32;
    if x.is_nan() {
        x
    } else {
        t.copysign(x)
    }
}

/// erf(a)/a as a polynomial in `2a² − 1` for 0 ≤ a ≤ 1 (Chebyshev interpolation in
/// 50-digit arithmetic, degree 10; relative error under 6e-16 in f64).
const ERF_SMALL: [f64; 11] = [
    0.965_468_738_669_867_3,
    -0.140_536_089_022_721_22,
    0.019_852_496_688_983_864,
    -0.002_285_485_561_062_318_4,
    0.000_217_517_156_038_475_16,
    -1.753_716_989_920_623_7e-5,
    1.223_382_755_856_204_4e-6,
    -7.511_464_577_090_118e-8,
    4.115_760_589_927_64e-9,
    -2.045_699_759_554_313_4e-10,
    9.207_614_215_658_363e-12,
];

/// e^(a²)·erfc(a) as a polynomial in `(2a − 5)/3` for 1 ≤ a ≤ 4 (the same way, degree 21;
/// relative error under 1e-15).
const ERFC_SCALED: [f64; 22] = [
    0.210_806_364_061_143_7,
    -0.111_521_020_184_692_04,
    0.056_110_493_444_949_665,
    -0.027_005_296_664_584_375,
    0.012_489_373_880_621_222,
    -0.005_570_706_179_242_084,
    0.002_403_647_668_382_675_7,
    -0.001_005_831_446_140_600_2,
    0.000_409_084_977_734_220_1,
    -0.000_162_011_736_579_825_96,
    6.257_875_758_500_552e-5,
    -2.360_953_888_559_454_8e-5,
    8.713_058_471_401_169e-6,
    -3.147_474_310_002_691_6e-6,
    1.110_755_113_490_897_2e-6,
    -3.859_498_371_639_083_7e-7,
    1.359_689_033_915_281e-7,
    -4.542_548_917_995_401e-8,
    1.171_504_726_464_121_6e-8,
    -3.860_090_986_652_424e-9,
    2.602_482_034_286_532_3e-9,
    -8.055_209_130_345_835e-10,
];

/// Σ c[j]·u^j by Estrin's scheme: neighbours paired as `c[2i] + c[2i+1]·u`, then the pairs
/// the same way in u², and so on. The chain of dependent operations is about 2·log₂ N long
/// instead of Horner's 2N, so a vectorized loop is not held up by latency.
#[inline(always)]
fn poly<const N: usize>(c: &[f64; N], u: f64) -> f64 {
    let mut t = *c;
    let (mut n, mut x) = (N, u);
    while n > 1 {
        let m = n.div_ceil(2);
        for i in 0..m {
            t[i] = if 2 * i + 1 < n {
                t[2 * i] + t[2 * i + 1] * x
            } else {
                t[2 * i]
            };
        }
        n = m;
        x = x * x;
    }
    t[0]
}

/// erf of an f32, computed in f64 and rounded once (the device's `(float)erf((double)x)`):
/// `a·P(2a² − 1)` for |x| ≤ 1, `1 − e^(−a²)·Q((2a − 5)/3)` above (a² is exact in f64);
/// beyond 4 erf rounds to ±1 in f32.
#[inline(always)]
pub fn erf_f32(x: f32) -> f32 {
    let a = (x as f64).abs();
    let a = if a > 4.0 { 4.0 } else { a };
    let small = a * poly(&ERF_SMALL, 2.0 * (a * a) - 1.0);
    let (m, s, _) = exp_reduced(-(a * a));
    let large = 1.0 - (m + 1.0) * s * poly(&ERFC_SCALED, (2.0 * a - 5.0) * (1.0 / 3.0));
    let r = if a <= 1.0 { small } else { large } as f32;
    if x.is_nan() {
        x
    } else {
        r.copysign(x)
    }
}

#[cfg(test)]
mod tests {
    use super::{erf_f32, exp_f32, tanh_f32};

    /// Checks `got` against `want` (the f64 function rounded once) over every `step`th f32
    /// bit pattern below `end`, both signs: at most one ulp apart, and apart at all for
    /// fewer than one input in a million.
    fn sweep(name: &str, end: f32, step: usize, got: fn(f32) -> f32, want: fn(f64) -> f64) {
        let (mut n, mut off) = (0u64, 0u64);
        for bits in (0..end.to_bits()).step_by(step) {
            for x in [f32::from_bits(bits), -f32::from_bits(bits)] {
                let w = want(x as f64) as f32;
                let g = got(x);
                let ulps = (g.to_bits() as i64 - w.to_bits() as i64).abs();
                assert!(ulps <= 1, "{name}({x:e}) = {g:e}, rounded f64 gives {w:e}");
                off += (ulps != 0) as u64;
                n += 1;
            }
        }
        assert!(
            off * 1_000_000 < n,
            "{name}: {off} of {n} values one ulp off"
        );
    }

    #[test]
    fn tanh_f32_is_tanh_rounded_once() {
        sweep("tanh", 21.0, 29, tanh_f32, f64::tanh);
        assert!(tanh_f32(f32::NAN).is_nan());
        assert_eq!(tanh_f32(f32::INFINITY), 1.0);
        assert_eq!(tanh_f32(f32::NEG_INFINITY), -1.0);
        assert_eq!(tanh_f32(f32::MAX), 1.0);
        assert_eq!(tanh_f32(-0.0).to_bits(), (-0.0f32).to_bits());
        let tiny = f32::from_bits(1);
        assert_eq!(tanh_f32(tiny), tiny);
    }

    /// Over every 23rd bit pattern up to 120 in magnitude: the results that overflow to
    /// inf and those that round into the subnormals or to 0 included.
    #[test]
    fn exp_f32_is_exp_rounded_once() {
        sweep("exp", 120.0, 23, exp_f32, f64::exp);
        assert!(exp_f32(f32::NAN).is_nan());
        assert_eq!(exp_f32(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp_f32(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_f32(0.0), 1.0);
        assert_eq!(exp_f32(-0.0), 1.0);
        assert_eq!(exp_f32(88.8), f32::INFINITY);
        assert_eq!(exp_f32(-104.0), 0.0);
        assert!(exp_f32(-100.0) > 0.0);
    }

    /// Over every 23rd bit pattern up to 5 (past where erf rounds to 1), against libm's
    /// f64 erf rounded once.
    #[test]
    fn erf_f32_is_erf_rounded_once() {
        sweep("erf", 5.0, 23, erf_f32, libm::erf);
        assert!(erf_f32(f32::NAN).is_nan());
        assert_eq!(erf_f32(f32::INFINITY), 1.0);
        assert_eq!(erf_f32(f32::NEG_INFINITY), -1.0);
        assert_eq!(erf_f32(1e30), 1.0);
        assert_eq!(erf_f32(-0.0).to_bits(), (-0.0f32).to_bits());
        let tiny = f32::from_bits(1);
        assert_eq!(erf_f32(tiny), (libm::erf(tiny as f64)) as f32);
    }
}
