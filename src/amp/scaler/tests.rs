//! Unit tests of `amp::scaler`.

use super::*;
use crate::dtype::{round_bf16, round_f16};

fn cfg(init: f32, interval: u32) -> ScalerConfig {
    ScalerConfig {
        init_scale: init,
        growth_interval: interval,
        ..ScalerConfig::default()
    }
}

/// One full step on optimizer 0 with a single fp32 gradient that is inf when
/// `overflow`; returns (skipped, outcome).
fn run_step(s: &mut GradScaler, overflow: bool) -> (bool, UpdateOutcome) {
    let mut g = [if overflow { f32::INFINITY } else { 0.5 }, 3.0];
    let mut v = [GradView::new("w", &mut g, DType::F32)];
    let d = s.should_step(0, &mut v).expect("step");
    let o = s.update(None).expect("update");
    (d.skip, o)
}

/// Drives `pattern` (true = overflow) and checks (scale, tracker) after every update.
fn check_sequence(s: &mut GradScaler, pattern: &[bool], expected: &[(f32, i32)]) {
    assert_eq!(pattern.len(), expected.len());
    for (i, (&ovf, &(scale, tracker))) in pattern.iter().zip(expected).enumerate() {
        let before = s.scale();
        let (skipped, o) = run_step(s, ovf);
        assert_eq!(skipped, ovf, "step {i}: skip");
        assert_eq!(o.found_inf, ovf, "step {i}: found_inf");
        assert_eq!(o.scale_before, before, "step {i}: scale_before");
        assert_eq!(o.scale_after, scale, "step {i}: scale");
        assert_eq!(o.growth_tracker, tracker, "step {i}: tracker");
        assert_eq!(s.scale(), scale);
        assert_eq!(s.growth_tracker(), tracker);
    }
}

const C: bool = false;
const X: bool = true;

#[test]
fn pytorch_update_scale_test_port() {
    // test_grad_scaling_update_scale: growth 2, backoff 0.25, interval 2, scale 4.
    let mut s = GradScaler::new(ScalerConfig {
        backoff_factor: 0.25,
        ..cfg(4.0, 2)
    })
    .unwrap();
    check_sequence(&mut s, &[C, C, X], &[(4.0, 1), (8.0, 0), (2.0, 0)]);
}

#[test]
fn mixed_pattern_interval_1() {
    let mut s = GradScaler::new(cfg(1024.0, 1)).unwrap();
    check_sequence(
        &mut s,
        &[C, C, X, C, X, X, C],
        &[
            (2048.0, 0),
            (4096.0, 0),
            (2048.0, 0),
            (4096.0, 0),
            (2048.0, 0),
            (1024.0, 0),
            (2048.0, 0),
        ],
    );
}

#[test]
fn mixed_pattern_interval_2() {
    let mut s = GradScaler::new(cfg(1024.0, 2)).unwrap();
    check_sequence(
        &mut s,
        &[C, C, C, X, C, C, X, C, C, C],
        &[
            (1024.0, 1),
            (2048.0, 0),
            (2048.0, 1),
            (1024.0, 0),
            (1024.0, 1),
            (2048.0, 0),
            (1024.0, 0),
            (1024.0, 1),
            (2048.0, 0),
            (2048.0, 1),
        ],
    );
}

#[test]
fn three_unskipped_one_skipped_from_128() {
    // PyTorch's _run_scaling_case: init 128, growth_interval 1, inf injected at iter 2.
    let mut s = GradScaler::new(cfg(128.0, 1)).unwrap();
    let mut applied = 0;
    for i in 0..4 {
        let mut g = [1.0f32; 4];
        if i == 2 {
            g[3] = f32::INFINITY;
        }
        let mut v = [GradView::new("layer1.weight", &mut g, DType::F32)];
        let r = s
            .step(0, &mut v, |_| {
                applied += 1;
                Ok(())
            })
            .unwrap();
        assert_eq!(r.is_none(), i == 2);
        s.update(None).unwrap();
    }
    assert_eq!(applied, 3);
    assert_eq!(s.scale(), 128.0 * 8.0 * 0.5);
}

#[test]
fn scale_never_grows_to_inf() {
    for start in [f32::MAX, 2f32.powi(127), f32::MAX / 1.5] {
        let mut s = GradScaler::new(cfg(start, 1)).unwrap();
        let (_, o) = run_step(&mut s, false);
        assert_eq!(o.scale_after, start, "start {start:e}");
        assert_eq!(o.growth_tracker, 0, "tracker resets even without growth");
    }
    // Just below the threshold the growth happens: 2^126 * 2 = 2^127.
    let mut s = GradScaler::new(cfg(2f32.powi(126), 1)).unwrap();
    assert_eq!(run_step(&mut s, false).1.scale_after, 2f32.powi(127));
}

#[test]
fn factor_product_is_f64_then_rounded_for_default_and_f32_for_megatron() {
    // 3 * 1.1 in f64 is 3.3000000000000003; the nearest f32 is 3.2999999523162841796875.
    // In f32, 1.1f32 = 1.10000002384185791015625, 3 * that = 3.30000007152557373046875,
    // a tie between 3.2999999523.. and 3.3000001907..; RNE picks the even 3.3000001907..
    let mut s = GradScaler::new(ScalerConfig {
        growth_factor: 1.1,
        ..cfg(3.0, 1)
    })
    .unwrap();
    assert_eq!(
        run_step(&mut s, false).1.scale_after,
        f32::from_bits(0x4053_3333) // 3.299999952316284
    );
    let mut m = GradScaler::new(ScalerConfig {
        growth_factor: 1.1,
        kind: ScalerKind::Hysteresis {
            hysteresis: 1,
            min_scale: 1.0,
            error_at_floor: false,
        },
        ..cfg(3.0, 1)
    })
    .unwrap();
    assert_eq!(
        run_step(&mut m, false).1.scale_after,
        f32::from_bits(0x4053_3334) // 3.300000190734863
    );
    // Backoff 0.9: 2.7 in f64 rounds to 2.700000047683716; in f32 0.9f32*3 rounds to
    // 2.6999998092651367.
    let mut s = GradScaler::new(ScalerConfig {
        backoff_factor: 0.9,
        ..cfg(3.0, 1)
    })
    .unwrap();
    assert_eq!(
        run_step(&mut s, true).1.scale_after,
        f32::from_bits(0x402c_cccd) // 2.700000047683716
    );
}

fn view<'a>(name: &'a str, data: &'a mut [f32], dtype: DType) -> GradView<'a> {
    GradView::new(name, data, dtype)
}

#[test]
fn unscale_twice_is_an_error() {
    let mut s = GradScaler::default();
    let mut g = [1.0f32];
    s.unscale_(0, &mut [view("w", &mut g, DType::F32)]).unwrap();
    let before = g[0];
    let e = s
        .unscale_(0, &mut [view("w", &mut g, DType::F32)])
        .unwrap_err();
    assert!(
        e.to_string().contains("unscale_() has already been called"),
        "{e}"
    );
    assert_eq!(
        g[0], before,
        "a refused unscale_ must not touch the gradients"
    );
    // The step still works and uses the first unscale's result.
    let d = s.should_step(0, &mut []).unwrap();
    assert!(!d.unscaled_here && !d.skip);
}

#[test]
fn unscale_after_step_is_an_error() {
    let mut s = GradScaler::default();
    let mut g = [1.0f32];
    s.should_step(0, &mut [view("w", &mut g, DType::F32)])
        .unwrap();
    let e = s
        .unscale_(0, &mut [view("w", &mut g, DType::F32)])
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("unscale_() is being called after step()"),
        "{e}"
    );
}

#[test]
fn step_twice_is_an_error_and_update_resets() {
    let mut s = GradScaler::default();
    let mut g = [1.0f32];
    s.should_step(0, &mut [view("w", &mut g, DType::F32)])
        .unwrap();
    let e = s
        .should_step(0, &mut [view("w", &mut g, DType::F32)])
        .unwrap_err();
    assert!(
        e.to_string().contains("step() has already been called"),
        "{e}"
    );
    let e = s.step(0, &mut [], |_| Ok(())).unwrap_err();
    assert!(
        e.to_string().contains("step() has already been called"),
        "{e}"
    );
    s.update(None).unwrap();
    assert_eq!(s.stage(0), Stage::Ready);
    s.should_step(0, &mut [view("w", &mut g, DType::F32)])
        .unwrap();
}

#[test]
fn failed_apply_leaves_optimizer_unscaled() {
    let mut s = GradScaler::default();
    let mut g = [65536.0f32];
    let e = s
        .step(0, &mut [view("w", &mut g, DType::F32)], |_| {
            Err::<(), _>(Error::Invalid("boom".into()))
        })
        .unwrap_err();
    assert!(e.to_string().contains("boom"));
    assert_eq!(s.stage(0), Stage::Unscaled);
    assert_eq!(g[0], 1.0);
    // Retrying the step does not unscale a second time.
    let r = s
        .step(0, &mut [view("w", &mut g, DType::F32)], |gv| {
            Ok(gv[0].data[0])
        })
        .unwrap();
    assert_eq!(r, Some(1.0));
}

#[test]
fn update_needs_inf_checks_unless_scale_given() {
    let mut s = GradScaler::default();
    let e = s.update(None).unwrap_err();
    assert!(e
        .to_string()
        .contains("no inf checks were recorded prior to update"));
    // An optimizer without gradients records no check either.
    let e = s.should_step(3, &mut []).unwrap_err();
    assert!(e
        .to_string()
        .contains("no inf checks were recorded for this optimizer"));
    assert!(s.update(None).is_err());
    // update(new_scale) sets the scale and keeps the tracker.
    let mut s = GradScaler::new(cfg(64.0, 3)).unwrap();
    run_step(&mut s, false);
    assert_eq!(s.growth_tracker(), 1);
    let o = s.update(Some(5.0)).unwrap();
    assert_eq!((o.scale_after, o.growth_tracker), (5.0, 1));
    assert!(s.update(Some(f32::NAN)).is_err());
    assert!(s.update(Some(-1.0)).is_err());
    assert_eq!(s.scale(), 5.0);
}

#[test]
fn disabled_scaler_passes_values_through() {
    for c in [
        ScalerConfig {
            enabled: false,
            ..ScalerConfig::default()
        },
        ScalerConfig {
            kind: ScalerKind::None,
            ..ScalerConfig::default()
        },
    ] {
        let mut s = GradScaler::new(c).unwrap();
        assert!(!s.is_enabled());
        assert_eq!(s.scale(), 1.0);
        assert_eq!(s.scale_loss(3.25), 3.25);
        let mut g = [2.5f32, f32::INFINITY, f32::NAN];
        assert!(!s.unscale_(0, &mut [view("w", &mut g, DType::F32)]).unwrap());
        assert_eq!(g[0], 2.5);
        assert!(g[1].is_infinite() && g[2].is_nan());
        // Non-finite gradients are applied (PyTorch semantics for enabled=False).
        let mut applied = false;
        let r = s
            .step(0, &mut [view("w", &mut g, DType::F32)], |_| {
                applied = true;
                Ok(7)
            })
            .unwrap();
        assert!(applied && r == Some(7));
        let d = s
            .should_step(0, &mut [view("w", &mut g, DType::F32)])
            .unwrap();
        assert!(!d.skip && !d.found_inf);
        let o = s.update(None).unwrap();
        assert_eq!((o.scale_after, o.collapse), (1.0, None));
        assert!(!s.state().enabled);
    }
}

#[test]
fn inv_scale_is_f64_reciprocal_and_unscale_multiplies_by_it() {
    // For IEEE division, 1/x rounded via f64 equals the correctly rounded f32 quotient
    // (f64 has more than 2*24+2 bits, so double rounding is harmless; a strided sweep
    // of 3e8 normal f32 values found no difference). PyTorch's f64 detour guards against
    // non-IEEE fast-math division, so the check here is the formula itself.
    for sc in [
        3.0f32,
        65536.0 * 3.0,
        1e-3,
        0.1,
        7.0,
        1.0e30,
        2f32.powi(-126),
    ] {
        let s = GradScaler::new(cfg(sc, 10)).unwrap();
        assert_eq!(s.inv_scale(), (1.0f64 / sc as f64) as f32, "scale {sc:e}");
    }
    // Multiplying by the rounded inverse is not dividing by the scale: find gradients
    // where the two differ and check we match the multiply (exact product in f64,
    // rounded once to f32 = IEEE f32 multiply).
    let mut s = GradScaler::new(cfg(3.0, 10)).unwrap();
    let inv = (1.0f64 / 3.0) as f32;
    let mut g: Vec<f32> = (1..2000).map(|i| i as f32 * 0.37).collect();
    let orig = g.clone();
    s.unscale_(0, &mut [view("w", &mut g, DType::F32)]).unwrap();
    let mut differ = 0;
    for (&o, &u) in orig.iter().zip(&g) {
        assert_eq!(u, (o as f64 * inv as f64) as f32);
        differ += (u != o / 3.0) as usize;
    }
    assert!(differ > 0, "the sample must distinguish g*inv from g/scale");
}

#[test]
fn fp16_and_bf16_grads_are_rounded_once_after_unscale() {
    let mut s = GradScaler::new(cfg(3.0, 10)).unwrap();
    let inv = (1.0f64 / 3.0) as f32;
    let raw: Vec<f32> = (1..500).map(|i| round_f16(i as f32 * 1.7)).collect();
    let mut h = raw.clone();
    let mut b: Vec<f32> = raw.iter().map(|&x| round_bf16(x)).collect();
    let b0 = b.clone();
    let mut f = raw.clone();
    s.unscale_(
        0,
        &mut [
            view("h", &mut h, DType::F16),
            view("b", &mut b, DType::BF16),
            view("f", &mut f, DType::F32),
        ],
    )
    .unwrap();
    let mut rounded = 0;
    for i in 0..raw.len() {
        // ATen: f32 product, then cast to the grad dtype.
        let p = (raw[i] as f64 * inv as f64) as f32;
        assert_eq!(h[i], half::f16::from_f32(p).to_f32());
        assert_eq!(f[i], p);
        let pb = (b0[i] as f64 * inv as f64) as f32;
        assert_eq!(b[i], half::bf16::from_f32(pb).to_f32());
        rounded += (h[i] != p) as usize;
    }
    assert!(rounded > 0, "fp16 results must show rounding");
    assert_eq!(s.warnings().len(), 1);
    assert!(s.warnings()[0].contains("`h`"), "{:?}", s.warnings());
}

#[test]
fn fp16_unscale_flushes_small_grads_and_counts_them() {
    // 2^-10 / 2^16 = 2^-26 is below half the fp16 subnormal 2^-24: flushes to 0.
    // 2^-8 / 2^16 = 2^-24 survives as the smallest subnormal.
    let mut s = GradScaler::default();
    let mut g = [2f32.powi(-10), 2f32.powi(-8), 0.0];
    s.unscale_(0, &mut [view("w", &mut g, DType::F16)]).unwrap();
    assert_eq!(g, [0.0, 2f32.powi(-24), 0.0]);
    let r = s.unscale_rounding(0).unwrap();
    assert_eq!((r.underflow, r.overflow), (1, 0));
}

#[test]
fn reject_fp16_grads_refuses_like_pytorch() {
    let mut s = GradScaler::new(ScalerConfig {
        reject_fp16_grads: true,
        ..ScalerConfig::default()
    })
    .unwrap();
    let mut a = [65536.0f32];
    let mut h = [65536.0f32];
    let e = s
        .unscale_(
            0,
            &mut [view("a", &mut a, DType::F32), view("h", &mut h, DType::F16)],
        )
        .unwrap_err();
    assert!(e
        .to_string()
        .contains("Attempting to unscale FP16 gradients"));
    assert!(e.to_string().contains("`h`"));
    assert_eq!((a[0], h[0]), (65536.0, 65536.0), "nothing touched");
    assert_eq!(s.stage(0), Stage::Ready);
    let mut i = [1.0f32];
    assert!(s
        .unscale_(0, &mut [view("idx", &mut i, DType::I64)])
        .is_err());
}

#[test]
fn nan_is_found_and_checked_before_multiplying() {
    let mut s = GradScaler::default();
    let mut g = [1.0f32, f32::NAN];
    assert!(s.unscale_(0, &mut [view("w", &mut g, DType::F32)]).unwrap());
    // A finite fp16 gradient that overflows when rounded is not "found": the check
    // looks at the input. Scale 0.5 doubles 65504 to 131008 -> inf in fp16.
    let mut s = GradScaler::new(cfg(0.5, 10)).unwrap();
    let mut g = [65504.0f32];
    assert!(!s.unscale_(0, &mut [view("w", &mut g, DType::F16)]).unwrap());
    assert!(g[0].is_infinite());
    assert_eq!(s.unscale_rounding(0).unwrap().overflow, 1);
}

#[test]
fn two_optimizers_share_the_backoff_but_skip_separately() {
    let mut s = GradScaler::new(cfg(1024.0, 1)).unwrap();
    let mut g0 = [2048.0f32];
    let mut g1 = [f32::INFINITY];
    let d0 = s
        .should_step(0, &mut [view("a", &mut g0, DType::F32)])
        .unwrap();
    let d1 = s
        .should_step(1, &mut [view("b", &mut g1, DType::F32)])
        .unwrap();
    assert!(!d0.skip && d1.skip);
    assert_eq!(g0[0], 2.0);
    let o = s.update(None).unwrap();
    assert!(o.found_inf);
    assert_eq!(o.scale_after, 512.0);
    // An optimizer only unscaled (never stepped) still votes in the update.
    let mut g0 = [1.0f32];
    let mut g1 = [f32::NAN];
    s.should_step(0, &mut [view("a", &mut g0, DType::F32)])
        .unwrap();
    assert!(s
        .unscale_(1, &mut [view("b", &mut g1, DType::F32)])
        .unwrap());
    assert_eq!(s.update(None).unwrap().scale_after, 256.0);
    // Both clean: grows.
    let mut g0 = [1.0f32];
    let mut g1 = [1.0f32];
    s.should_step(0, &mut [view("a", &mut g0, DType::F32)])
        .unwrap();
    s.should_step(1, &mut [view("b", &mut g1, DType::F32)])
        .unwrap();
    assert_eq!(s.update(None).unwrap().scale_after, 512.0);
}

#[test]
fn max_clip_sequence() {
    let kind = ScalerKind::MaxClip { max_scale: 64.0 };
    let mut s = GradScaler::new(ScalerConfig {
        kind,
        ..cfg(16.0, 1)
    })
    .unwrap();
    check_sequence(
        &mut s,
        &[C, C, C, C, X, C, C],
        &[
            (32.0, 0),
            (64.0, 0),
            (64.0, 0),
            (64.0, 0),
            (32.0, 0),
            (64.0, 0),
            (64.0, 0),
        ],
    );
    // 48 * 2 = 96 lands on the cap; an initial scale above the cap is clipped.
    let mut s = GradScaler::new(ScalerConfig {
        kind,
        ..cfg(48.0, 1)
    })
    .unwrap();
    assert_eq!(run_step(&mut s, false).1.scale_after, 64.0);
    let mut s = GradScaler::new(ScalerConfig {
        kind,
        ..cfg(1000.0, 1)
    })
    .unwrap();
    assert_eq!(s.scale(), 64.0);
    assert_eq!(s.update(Some(500.0)).unwrap().scale_after, 64.0);
}

fn hyst(h: u32, min: f32, err: bool) -> ScalerKind {
    ScalerKind::Hysteresis {
        hysteresis: h,
        min_scale: min,
        error_at_floor: err,
    }
}

#[test]
fn hysteresis_sequence() {
    let mut s = GradScaler::new(ScalerConfig {
        kind: hyst(2, 8.0, false),
        ..cfg(64.0, 3)
    })
    .unwrap();
    // (overflow, scale, growth tracker, hysteresis tracker), derived from Megatron's
    // DynamicGradScaler.update by hand.
    let table: [(bool, f32, i32, i32); 11] = [
        (X, 64.0, 0, 1), // first overflow only uses up hysteresis
        (C, 64.0, 1, 1), // a clean step does not refill it
        (X, 32.0, 0, 0), // counter reaches 0: back off
        (X, 16.0, 0, -1),
        (X, 8.0, 0, -2),
        (X, 8.0, 0, -3), // floor at min_scale
        (C, 8.0, 1, -3),
        (C, 8.0, 2, -3),
        (C, 16.0, 0, 2), // growth interval: grow and refill hysteresis
        (X, 16.0, 0, 1),
        (X, 8.0, 0, 0),
    ];
    for (i, &(ovf, scale, gt, ht)) in table.iter().enumerate() {
        let (skipped, o) = run_step(&mut s, ovf);
        assert_eq!(skipped, ovf, "step {i}");
        assert_eq!(
            (o.scale_after, o.growth_tracker, o.hysteresis_tracker),
            (scale, gt, Some(ht)),
            "step {i}"
        );
    }
}

#[test]
fn hysteresis_error_at_floor() {
    let mut s = GradScaler::new(ScalerConfig {
        kind: hyst(1, 4.0, true),
        ..cfg(8.0, 1000)
    })
    .unwrap();
    assert_eq!(run_step(&mut s, true).1.scale_after, 4.0);
    let mut g = [f32::INFINITY];
    s.should_step(0, &mut [view("w", &mut g, DType::F32)])
        .unwrap();
    let e = s.update(None).unwrap_err();
    assert!(e.to_string().contains("minimum 4e0"), "{e}");
    assert_eq!(s.scale(), 4.0);
    assert_eq!(s.hysteresis_tracker(), Some(0));
    // Without error_at_floor the same overflow just stays at the floor.
    let mut s = GradScaler::new(ScalerConfig {
        kind: hyst(1, 4.0, false),
        ..cfg(8.0, 1000)
    })
    .unwrap();
    run_step(&mut s, true);
    assert_eq!(run_step(&mut s, true).1.scale_after, 4.0);
}

#[test]
fn fixed_scale_skips_but_never_changes() {
    let mut s = GradScaler::new(ScalerConfig {
        kind: ScalerKind::Fixed,
        ..cfg(256.0, 1)
    })
    .unwrap();
    check_sequence(&mut s, &[C, X, C, C, X, X], &[(256.0, 0); 6]);
    assert_eq!(s.scale_loss(0.5), 128.0);
}

#[test]
fn collapse_detection_down_to_zero() {
    let mut s = GradScaler::default(); // 2^16, streak alarm at 8
    for k in 1..=166u32 {
        let (_, o) = run_step(&mut s, true);
        let expect = if k <= 165 {
            2f64.powi(16 - k as i32) as f32
        } else {
            0.0 // 2^-149 * 0.5 = 2^-150 ties to even: 0
        };
        assert_eq!(o.scale_after, expect, "overflow {k}");
        let c = o.collapse;
        match k {
            1..=7 => assert_eq!(c, None, "overflow {k}"),
            8..=16 => {
                let c = c.unwrap();
                assert!(c.streak_alarm && !c.below_one && c.falling_streak == k);
            }
            17 => assert!(c.unwrap().below_one && !c.unwrap().inv_scale_infinite),
            143 => assert!(!c.unwrap().inv_scale_infinite), // 2^-127: 1/s = 2^127 fits
            144 => assert!(c.unwrap().inv_scale_infinite && !c.unwrap().zero), // 2^-128
            166 => {
                let c = c.unwrap();
                assert!(c.zero && c.below_one && c.inv_scale_infinite);
                assert_eq!(c.falling_streak, 166);
            }
            _ => {}
        }
    }
    // At 0, the backoff no longer lowers the scale: the streak ends, zero stays.
    let c = run_step(&mut s, true).1.collapse.unwrap();
    assert!(c.zero && c.falling_streak == 0 && !c.streak_alarm);
    // And unscaling finite gradients yields inf/NaN without any inf being "found":
    // the step is not skipped, so PyTorch would write these into the weights.
    let mut g = [1.0f32, 0.0, -2.0];
    let d = s
        .should_step(0, &mut [view("w", &mut g, DType::F32)])
        .unwrap();
    assert!(!d.skip && !d.found_inf);
    assert!(g[0] == f32::INFINITY && g[1].is_nan() && g[2] == f32::NEG_INFINITY);
    assert!(format!("{c}").contains("is 0"));
}

#[test]
fn streak_breaks_on_a_clean_update_and_can_be_turned_off() {
    let mut s = GradScaler::new(ScalerConfig {
        collapse_streak: 2,
        ..cfg(1024.0, 100)
    })
    .unwrap();
    assert_eq!(run_step(&mut s, true).1.collapse, None);
    assert!(run_step(&mut s, true).1.collapse.unwrap().streak_alarm);
    assert_eq!(run_step(&mut s, false).1.collapse, None);
    assert_eq!(run_step(&mut s, true).1.collapse, None);
    let mut s = GradScaler::new(ScalerConfig {
        collapse_streak: 0,
        ..cfg(1024.0, 100)
    })
    .unwrap();
    for _ in 0..9 {
        assert_eq!(run_step(&mut s, true).1.collapse, None);
    }
}

fn roundtrip_continues_identically(c: ScalerConfig, pattern: &[bool], cut: usize) {
    let mut a = GradScaler::new(c.clone()).unwrap();
    let full: Vec<UpdateOutcome> = pattern.iter().map(|&o| run_step(&mut a, o).1).collect();
    let mut b = GradScaler::new(c.clone()).unwrap();
    for &o in &pattern[..cut] {
        run_step(&mut b, o);
    }
    let json = serde_json::to_string(&b.state()).unwrap();
    let st: ScalerState = serde_json::from_str(&json).unwrap();
    assert_eq!(st, b.state());
    let mut r = GradScaler::new(c).unwrap();
    r.load_state(st).unwrap();
    for (i, &o) in pattern[cut..].iter().enumerate() {
        assert_eq!(run_step(&mut r, o).1, full[cut + i], "step {}", cut + i);
    }
}

#[test]
fn state_round_trip_mid_sequence() {
    let p = [C, C, C, X, C, X, X, C, C, C, X, C, C, C, C];
    roundtrip_continues_identically(cfg(1024.0, 2), &p, 5);
    roundtrip_continues_identically(cfg(1024.0, 3), &p, 2); // tracker 2 at the cut
    roundtrip_continues_identically(
        ScalerConfig {
            kind: hyst(3, 16.0, false),
            ..cfg(1024.0, 3)
        },
        &p,
        6, // hysteresis counter 1 at the cut
    );
    roundtrip_continues_identically(
        ScalerConfig {
            kind: ScalerKind::MaxClip { max_scale: 2048.0 },
            ..cfg(1024.0, 1)
        },
        &p,
        4,
    );
}

#[test]
fn loads_pytorch_state_dict_and_refuses_bad_states() {
    let js = r#"{"scale": 32768.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                 "growth_interval": 2000, "_growth_tracker": 1999}"#;
    let st: ScalerState = serde_json::from_str(js).unwrap();
    let mut s = GradScaler::default();
    s.load_state(st.clone()).unwrap();
    assert_eq!((s.scale(), s.growth_tracker()), (32768.0, 1999));
    assert_eq!(run_step(&mut s, false).1.scale_after, 65536.0);

    let bad = |f: &dyn Fn(&mut ScalerState)| {
        let mut b = st.clone();
        f(&mut b);
        GradScaler::default().load_state(b).unwrap_err().to_string()
    };
    assert!(bad(&|b| b.growth_tracker = 2000).contains("growth_tracker"));
    assert!(bad(&|b| b.scale = f32::NAN).contains("scale"));
    assert!(bad(&|b| b.backoff_factor = 1.0).contains("backoff_factor"));
    assert!(bad(&|b| b.enabled = false).contains("disabled"));
    assert!(bad(&|b| b.kind = ScalerKind::Fixed).contains("`fixed`"));
    // A disabled scaler ignores any state.
    let mut d = GradScaler::new(ScalerConfig {
        enabled: false,
        ..ScalerConfig::default()
    })
    .unwrap();
    d.load_state(st).unwrap();
    assert_eq!(d.scale(), 1.0);
}

#[test]
fn config_validation_names_the_field() {
    let err = |c: ScalerConfig| GradScaler::new(c).unwrap_err().to_string();
    let d = ScalerConfig::default;
    assert!(err(ScalerConfig {
        growth_factor: 1.0,
        ..d()
    })
    .contains("growth_factor"));
    assert!(err(ScalerConfig {
        backoff_factor: 0.0,
        ..d()
    })
    .contains("backoff_factor"));
    assert!(err(ScalerConfig {
        growth_interval: 0,
        ..d()
    })
    .contains("growth_interval"));
    assert!(err(ScalerConfig {
        init_scale: f32::INFINITY,
        ..d()
    })
    .contains("init_scale"));
    assert!(err(ScalerConfig {
        kind: hyst(0, 1.0, false),
        ..d()
    })
    .contains("hysteresis"));
    assert!(err(ScalerConfig {
        kind: hyst(2, 1e6, false),
        ..d()
    })
    .contains("min_scale"));
    assert!(err(ScalerConfig {
        kind: ScalerKind::MaxClip { max_scale: -1.0 },
        ..d()
    })
    .contains("max_scale"));
    // Serde: defaults fill gaps, unknown fields are refused.
    let c: ScalerConfig =
        serde_json::from_str(r#"{"kind": {"type": "max_clip", "max_scale": 1024}}"#).unwrap();
    assert_eq!(c.kind, ScalerKind::MaxClip { max_scale: 1024.0 });
    assert_eq!(c.growth_interval, 2000);
    assert!(serde_json::from_str::<ScalerConfig>(r#"{"growth_intervall": 5}"#).is_err());
}

#[test]
fn scale_loss_and_outputs() {
    let s = GradScaler::new(cfg(3.0, 10)).unwrap();
    assert_eq!(s.scale_loss(0.1), 0.1f32 * 3.0);
    let mut t = [0.1f32, 30000.0];
    let r = s.scale_outputs(&mut t, DType::F16);
    assert_eq!(t[0], round_f16(0.1f32 * 3.0));
    assert!(t[1].is_infinite());
    assert_eq!(r.overflow, 1);
}
