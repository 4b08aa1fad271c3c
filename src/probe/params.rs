//! Per-parameter gradient records, computed from a parameter's unscaled gradient and its
//! values after the update.

use crate::dtype::DType;
use crate::trace::record::ParamRecord;
use crate::trace::stats::TensorStats;
use rayon::prelude::*;

impl ParamRecord {
    /// Builds the record of parameter `name` from its unscaled gradient, the loss scale
    /// used in the step, and its values after the update. The fractions are defined on
    /// the fields; none is NaN.
    pub fn from_grad(
        name: &str,
        dtype: DType,
        grad_dtype: DType,
        unscaled_grad: &[f32],
        scale: f32,
        param_after: &[f32],
    ) -> Self {
        let g = TensorStats::compute(grad_dtype, unscaled_grad);
        let p = TensorStats::compute(dtype, param_after);
        let flushes = scaled_f16_flushes(unscaled_grad, scale);
        ParamRecord::from_stats(name, dtype, grad_dtype, &g, flushes, &p)
    }

    /// The record from the statistics of the unscaled gradient `g`, the count of its finite
    /// nonzero values whose scaled value flushes to zero in fp16, and the statistics of the
    /// parameter after the update `p` (what a device gathers for the step's one read).
    pub fn from_stats(
        name: &str,
        dtype: DType,
        grad_dtype: DType,
        g: &TensorStats,
        scaled_flushes: u64,
        p: &TensorStats,
    ) -> Self {
        let nonzero = g.finite_nonzero();
        let frac = |n: u64, d: u64| if d == 0 { 0.0 } else { n as f64 / d as f64 };
        ParamRecord {
            name: name.to_string(),
            dtype,
            grad_dtype: Some(grad_dtype),
            numel: g.numel,
            grad_l2: g.l2(),
            max_abs_grad: g.max_abs,
            zero_frac: frac(g.zeros, g.numel),
            f16_underflow_frac_unscaled: frac(g.to_f16.underflow, nonzero),
            f16_underflow_frac_scaled: frac(scaled_flushes, nonzero),
            nonfinite: g.nonfinite(),
            param_max_abs_after: if p.has_inf() {
                f64::INFINITY
            } else {
                p.max_abs
            },
            param_nan_after: p.nan,
        }
    }
}

/// Finite nonzero values `g` for which `g * scale` (in f32) is zero in fp16: at most 2^-25
/// in magnitude (the tie rounds to zero), or zero already in f32.
fn scaled_f16_flushes(grad: &[f32], scale: f32) -> u64 {
    const FLUSH: u32 = 0x3300_0000; // 2^-25
    let count = |c: &[f32]| -> u64 {
        c.iter()
            .map(|&g| {
                let a = g.to_bits() & 0x7fff_ffff;
                let s = (g * scale).to_bits() & 0x7fff_ffff;
                (a != 0 && a < 0x7f80_0000 && s <= FLUSH) as u64
            })
            .sum()
    };
    if grad.len() < 64 * 1024 {
        count(grad)
    } else {
        grad.par_chunks(16 * 1024).map(count).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn param_record_from_grad() {
        let t = 2f32.powi(-25);
        // Finite nonzero: 1e-3, 2^-25 (flushes), 2^-30 (flushes), -3.0, 2^-40 (flushes).
        let grad = [
            0.0f32,
            1e-3,
            t,
            2f32.powi(-30),
            -3.0,
            f32::NAN,
            -0.0,
            2f32.powi(-40),
        ];
        let r = ParamRecord::from_grad(
            "w",
            DType::F32,
            DType::F32,
            &grad,
            1024.0,
            &[1.0, -7.5, f32::NAN],
        );
        assert_eq!(r.numel, 8);
        assert_eq!(r.zero_frac, 2.0 / 8.0);
        assert_eq!(r.nonfinite, 1);
        assert_eq!(r.max_abs_grad, 3.0);
        let sq = 1e-3f32 as f64 * 1e-3f32 as f64
            + 2f64.powi(-50)
            + 2f64.powi(-60)
            + 9.0
            + 2f64.powi(-80);
        assert!((r.grad_l2 - sq.sqrt()).abs() <= 1e-15 * sq.sqrt());
        assert_eq!(r.f16_underflow_frac_unscaled, 3.0 / 5.0);
        // Scaled by 2^10: 2^-15 and 2^-20 are representable, 2^-30 still flushes.
        assert_eq!(r.f16_underflow_frac_scaled, 1.0 / 5.0);
        assert_eq!(r.param_max_abs_after, 7.5);
        let inf = ParamRecord::from_grad("b", DType::F16, DType::F16, &[], 1.0, &[f32::INFINITY]);
        assert_eq!(inf.param_max_abs_after, f64::INFINITY);
        assert_eq!(inf.zero_frac, 0.0);
        assert_eq!(inf.f16_underflow_frac_scaled, 0.0);
    }

    #[test]
    fn scaled_flush_counts_large_and_tie() {
        // 3 * 2^-27 * 4 = 3 * 2^-25 stays; 2^-27 * 4 = 2^-25 is the tie and flushes.
        let mut g = vec![2f32.powi(-27); 100_000];
        g[7] = 3.0 * 2f32.powi(-27);
        assert_eq!(scaled_f16_flushes(&g, 4.0), 99_999);
        // A scale that underflows f32 itself flushes everything.
        assert_eq!(scaled_f16_flushes(&[1e-30], 1e-20), 1);
        assert_eq!(scaled_f16_flushes(&[1e-3], f32::NAN), 0);
    }
}
