//! Gradient-norm clipping as `torch.nn.utils.clip_grad_norm_` (per-tensor path,
//! `foreach=False`, `error_if_nonfinite=False`).
//!
//! PyTorch computes one norm per gradient with `torch.linalg.vector_norm` (result in the
//! gradient's dtype), the total norm as the norm of those norms (in their promoted dtype),
//! then `clip_coef = max_norm / (total_norm + 1e-6)`, which Python evaluates as
//! `(total_norm + 1e-6).reciprocal() * max_norm`, clamps it to at most 1 and multiplies
//! every gradient by it, even when it is 1.
//!
//! Deliberate choices, documented because they decide bits:
//!
//! * Per-tensor L2 norms accumulate the squares in `f64` and round the square root to `f32`
//!   once, so they are at least as accurate as PyTorch's `f32` reduction (whose summation
//!   order is an implementation detail). Like PyTorch, which keeps the sum of squares in
//!   `f32` and does not rescale, a sum of squares beyond the `f32` range gives an infinite
//!   norm even when the norm itself would fit. The norm is then rounded to the gradient's
//!   dtype: an fp16 gradient whose norm exceeds 65504 has an infinite norm, as in PyTorch.
//! * A non-finite total norm is reported in [`ClipOutcome::nonfinite`] and the gradients
//!   are still multiplied, as PyTorch's default `error_if_nonfinite=False` does: an infinite
//!   norm gives a coefficient of 0 (finite gradients become 0, infinite ones NaN) and a NaN
//!   norm writes NaN into every gradient. That is what a user of `clip_grad_norm_` sees.

use serde::{Deserialize, Serialize};

use crate::dtype::{round_to, DType};
use crate::{Error, Result};

/// One gradient to clip.
#[derive(Debug)]
pub struct GradSlot<'a> {
    /// Parameter name, for error messages.
    pub name: &'a str,
    /// Gradient values, scaled in place (each value representable in `dtype`).
    pub data: &'a mut [f32],
    /// Storage dtype of the gradient.
    pub dtype: DType,
}

/// Which vector norm measures the gradients.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub enum NormType {
    /// Euclidean norm (`norm_type=2.0`).
    #[default]
    #[serde(rename = "l2", alias = "2")]
    L2,
    /// Largest absolute value (`norm_type=inf`).
    #[serde(rename = "inf")]
    Inf,
}

/// What [`clip_grad_norm`] measured and applied.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct ClipOutcome {
    /// Total norm of all gradients before clipping (the value `clip_grad_norm_` returns).
    #[serde(serialize_with = "crate::trace::float_json::f32_exact::serialize")]
    pub total_norm: f32,
    /// The coefficient every gradient was multiplied by: `min(max_norm / (total + 1e-6), 1)`.
    #[serde(serialize_with = "crate::trace::float_json::f32_exact::serialize")]
    pub clip_coef: f32,
    /// The total norm was infinite or NaN.
    pub nonfinite: bool,
}

/// Clips the gradients in place so that their total norm is at most about `max_norm`,
/// exactly as `torch.nn.utils.clip_grad_norm_(..., foreach=False)` on CPU (see the module
/// docs for the accumulation and non-finite behaviour).
///
/// Errors: a negative or NaN `max_norm`, or an infinity norm of an empty gradient (which
/// PyTorch refuses too).
pub fn clip_grad_norm(
    grads: &mut [GradSlot<'_>],
    max_norm: f32,
    norm_type: NormType,
) -> Result<ClipOutcome> {
    if max_norm.is_nan() || max_norm < 0.0 {
        return Err(Error::Invalid(format!(
            "clip_grad_norm: max_norm must be a non-negative number, got {max_norm}"
        )));
    }
    let Some(first) = grads.first() else {
        // PyTorch returns tensor(0.) and scales nothing.
        return Ok(ClipOutcome {
            total_norm: 0.0,
            clip_coef: 1.0,
            nonfinite: false,
        });
    };

    // torch.stack promotes the per-tensor norms to one dtype; the total norm and the
    // coefficient are computed in it.
    let norm_dtype = grads
        .iter()
        .fold(first.dtype, |d, g| DType::promote(d, g.dtype));
    let mut norms = Vec::with_capacity(grads.len());
    for g in grads.iter() {
        let n = match norm_type {
            NormType::L2 => l2_norm(g.data),
            NormType::Inf => {
                if g.data.is_empty() {
                    return Err(Error::tensor(
                        g.name,
                        "clip_grad_norm: the inf norm of an empty gradient is undefined",
                    ));
                }
                max_abs(g.data)
            }
        };
        norms.push(round_to(g.dtype, n));
    }
    let total = round_to(
        norm_dtype,
        match norm_type {
            NormType::L2 => l2_norm(&norms),
            NormType::Inf => max_abs(&norms),
        },
    );

    // (total + 1e-6).reciprocal() * max_norm, then clamp(max=1.0); each op in norm_dtype.
    let shifted = round_to(norm_dtype, total + 1e-6f32);
    let recip = round_to(norm_dtype, 1.0 / shifted);
    let coef = round_to(norm_dtype, recip * max_norm);
    let clamped = if coef > 1.0 { 1.0 } else { coef };

    for g in grads.iter_mut() {
        for x in g.data.iter_mut() {
            *x *= clamped;
        }
        if g.dtype != DType::F32 {
            for x in g.data.iter_mut() {
                *x = round_to(g.dtype, *x);
            }
        }
    }
    Ok(ClipOutcome {
        total_norm: total,
        clip_coef: clamped,
        nonfinite: !total.is_finite(),
    })
}

/// Euclidean norm: squares summed in f64, infinite when that sum leaves the f32 range (as
/// PyTorch's f32 accumulation overflows), square root rounded once to f32.
fn l2_norm(data: &[f32]) -> f32 {
    let sum: f64 = data.iter().map(|&x| f64::from(x) * f64::from(x)).sum();
    if (sum as f32).is_infinite() {
        return f32::INFINITY;
    }
    sum.sqrt() as f32
}

/// Largest absolute value, NaN if any value is NaN (PyTorch's inf-norm propagates NaN).
fn max_abs(data: &[f32]) -> f32 {
    let mut m = 0.0f32;
    for &x in data {
        if x.is_nan() {
            return f32::NAN;
        }
        m = m.max(x.abs());
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::round_f16;

    fn slots<'a>(a: &'a mut [f32], b: &'a mut [f32]) -> [GradSlot<'a>; 2] {
        [
            GradSlot {
                name: "a",
                data: a,
                dtype: DType::F32,
            },
            GradSlot {
                name: "b",
                data: b,
                dtype: DType::F32,
            },
        ]
    }

    fn sample(n: usize, seed: usize) -> Vec<f32> {
        (0..n)
            .map(|j| (((j * 13 + seed * 7) % 17) as f32 - 8.0) * 0.731 + 0.003 * j as f32)
            .collect()
    }

    #[test]
    fn l2_total_norm_and_coefficient_against_f64() {
        let mut a = sample(37, 1);
        let mut b = sample(1000, 2);
        let (a0, b0) = (a.clone(), b.clone());
        let total64 = a0
            .iter()
            .chain(&b0)
            .map(|&x| f64::from(x).powi(2))
            .sum::<f64>()
            .sqrt();
        let max_norm = 5.0f32;
        let out = clip_grad_norm(&mut slots(&mut a, &mut b), max_norm, NormType::L2).unwrap();
        assert!(
            (f64::from(out.total_norm) - total64).abs() <= 1e-6 * total64,
            "{out:?} vs {total64}"
        );
        assert!(!out.nonfinite);
        let coef64 = 5.0 / (total64 + 1e-6);
        assert!(coef64 < 1.0);
        assert!(
            (f64::from(out.clip_coef) - coef64).abs() <= 1e-6 * coef64,
            "{out:?}"
        );
        // The coefficient is PyTorch's: reciprocal of (total + 1e-6), times max_norm, in f32.
        assert_eq!(out.clip_coef, (1.0 / (out.total_norm + 1e-6f32)) * max_norm);
        for (x, x0) in a.iter().zip(&a0).chain(b.iter().zip(&b0)) {
            assert_eq!(*x, x0 * out.clip_coef);
        }
        // After clipping the total norm is max_norm (up to the 1e-6 and rounding).
        let after = a
            .iter()
            .chain(&b)
            .map(|&x| f64::from(x).powi(2))
            .sum::<f64>()
            .sqrt();
        assert!((after - 5.0).abs() < 1e-5, "{after}");
    }

    #[test]
    fn inf_norm_is_the_largest_magnitude() {
        let mut a = vec![0.5f32, -3.25, 1.0];
        let mut b = vec![2.0f32, -7.5, 0.0, 4.0];
        let out = clip_grad_norm(&mut slots(&mut a, &mut b), 1.5, NormType::Inf).unwrap();
        assert_eq!(out.total_norm, 7.5);
        let coef = (1.0 / (7.5f32 + 1e-6)) * 1.5;
        assert_eq!(out.clip_coef, coef);
        assert!((f64::from(coef) - 0.2).abs() < 1e-6);
        assert_eq!(b[1], -7.5 * coef);
        assert_eq!(a[1], -3.25 * coef);
    }

    #[test]
    fn never_scales_up() {
        let mut a = sample(10, 3);
        let mut b = sample(5, 4);
        let (a0, b0) = (a.clone(), b.clone());
        let out = clip_grad_norm(&mut slots(&mut a, &mut b), 1000.0, NormType::L2).unwrap();
        assert_eq!(out.clip_coef, 1.0);
        assert!(out.total_norm < 1000.0);
        assert_eq!((a, b), (a0, b0));
    }

    #[test]
    fn nonfinite_norm_is_reported_and_applied_like_pytorch() {
        // An infinite gradient: total inf, coefficient 0, finite grads zeroed, inf -> NaN.
        let mut a = vec![1.0f32, f32::INFINITY];
        let mut b = vec![2.0f32, -3.0];
        let out = clip_grad_norm(&mut slots(&mut a, &mut b), 1.0, NormType::L2).unwrap();
        assert!(out.nonfinite && out.total_norm.is_infinite());
        assert_eq!(out.clip_coef, 0.0);
        assert_eq!(a[0], 0.0);
        assert!(a[1].is_nan());
        assert_eq!(b, vec![0.0, -0.0]);

        // A NaN gradient: NaN everywhere, for both norm types.
        for nt in [NormType::L2, NormType::Inf] {
            let mut a = vec![1.0f32, f32::NAN];
            let mut b = vec![2.0f32, -3.0];
            let out = clip_grad_norm(&mut slots(&mut a, &mut b), 1.0, nt).unwrap();
            assert!(
                out.nonfinite && out.total_norm.is_nan() && out.clip_coef.is_nan(),
                "{nt:?}"
            );
            assert!(a.iter().chain(&b).all(|x| x.is_nan()), "{nt:?}");
        }
    }

    #[test]
    fn f32_sum_of_squares_overflow_gives_infinity() {
        // |g| = 1e20 fits f32, but 1e40 does not: PyTorch's f32 norm is inf.
        let mut a = vec![1e20f32, 1.0];
        let mut b = vec![1.0f32];
        let out = clip_grad_norm(&mut slots(&mut a, &mut b), 1.0, NormType::L2).unwrap();
        assert!(out.nonfinite && out.total_norm.is_infinite());
        // The inf norm has no squares and stays finite.
        let mut a = vec![1e20f32, 1.0];
        let mut b = vec![1.0f32];
        let out = clip_grad_norm(&mut slots(&mut a, &mut b), 1.0, NormType::Inf).unwrap();
        assert_eq!(out.total_norm, 1e20);
    }

    #[test]
    fn f16_gradients_use_f16_norms() {
        // Norm of (600, 800) is 1000: rounded to f16 it is exact; grads scaled and rounded.
        let mut g = vec![600.0f32, 800.0];
        let out = clip_grad_norm(
            &mut [GradSlot {
                name: "h",
                data: &mut g,
                dtype: DType::F16,
            }],
            10.0,
            NormType::L2,
        )
        .unwrap();
        assert_eq!(out.total_norm, 1000.0);
        // 1000 + 1e-6 rounds back to 1000 in f16; 1/1000 and *10 are rounded to f16 too.
        let coef = round_f16(round_f16(1.0 / 1000.0) * 10.0);
        assert_eq!(out.clip_coef, coef);
        assert_eq!(g, vec![round_f16(600.0 * coef), round_f16(800.0 * coef)]);

        // Norm 84852 exceeds f16's 65504: the f16 norm is inf and the grads are zeroed.
        let mut g = vec![60000.0f32, 60000.0];
        let out = clip_grad_norm(
            &mut [GradSlot {
                name: "h",
                data: &mut g,
                dtype: DType::F16,
            }],
            1.0,
            NormType::L2,
        )
        .unwrap();
        assert!(out.nonfinite && out.total_norm.is_infinite());
        assert_eq!(g, vec![0.0, 0.0]);

        // Mixed f16 and f32 gradients: the total is computed in f32 and may exceed 65504.
        let mut h = vec![60000.0f32];
        let mut f = vec![60000.0f32];
        let out = clip_grad_norm(
            &mut [
                GradSlot {
                    name: "h",
                    data: &mut h,
                    dtype: DType::F16,
                },
                GradSlot {
                    name: "f",
                    data: &mut f,
                    dtype: DType::F32,
                },
            ],
            1.0,
            NormType::L2,
        )
        .unwrap();
        let total64 = (2.0f64 * 60000.0 * 60000.0).sqrt();
        assert!(!out.nonfinite);
        assert!((f64::from(out.total_norm) - total64).abs() <= 1e-6 * total64);
        assert_eq!(h[0], round_f16(60000.0 * out.clip_coef));
        assert_eq!(f[0], 60000.0 * out.clip_coef);
    }

    #[test]
    fn empty_inputs() {
        let out = clip_grad_norm(&mut [], 1.0, NormType::L2).unwrap();
        assert_eq!(
            out,
            ClipOutcome {
                total_norm: 0.0,
                clip_coef: 1.0,
                nonfinite: false
            }
        );
        let mut e: Vec<f32> = vec![];
        let mut x = vec![3.0f32, 4.0];
        let out = clip_grad_norm(&mut slots(&mut e, &mut x), 1.0, NormType::L2).unwrap();
        assert_eq!(out.total_norm, 5.0);
        let mut e: Vec<f32> = vec![];
        let mut x = vec![3.0f32, 4.0];
        let err = clip_grad_norm(&mut slots(&mut e, &mut x), 1.0, NormType::Inf).unwrap_err();
        assert!(err.to_string().contains("`a`"), "{err}");
        assert_eq!(x, vec![3.0, 4.0]);
    }

    #[test]
    fn rejects_bad_max_norm() {
        let mut a = vec![1.0f32];
        let mut b = vec![1.0f32];
        assert!(clip_grad_norm(&mut slots(&mut a, &mut b), -1.0, NormType::L2).is_err());
        assert!(clip_grad_norm(&mut slots(&mut a, &mut b), f32::NAN, NormType::L2).is_err());
        assert_eq!((a[0], b[0]), (1.0, 1.0));
    }

    #[test]
    fn norm_type_serde_names() {
        assert_eq!(
            serde_json::from_str::<NormType>("\"l2\"").unwrap(),
            NormType::L2
        );
        assert_eq!(
            serde_json::from_str::<NormType>("\"inf\"").unwrap(),
            NormType::Inf
        );
        assert!(serde_json::from_str::<NormType>("\"l1\"").is_err());
    }
}
