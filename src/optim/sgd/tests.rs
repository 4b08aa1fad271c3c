//! Unit tests of `optim::sgd`.

use super::*;
use crate::dtype::{round_f16, DType};
use crate::optim::harness::{
    kernel_test_data, resized_step, run_against_reference, step_f32, RefRun, Reference,
};
use crate::optim::update::{run_kernel, Kernel};

#[test]
fn the_fma_copy_of_the_update_loop_gives_the_plain_loops_bits() {
    let n = 5000;
    for od in [DType::F32, DType::F16, DType::BF16] {
        for (first, nesterov, use_wd) in [
            (true, false, true),
            (false, true, true),
            (false, false, false),
        ] {
            let grad = kernel_test_data(n, 1);
            let (mut p1, mut b1) = (kernel_test_data(n, 2), kernel_test_data(n, 3));
            let (mut p2, mut b2) = (p1.clone(), b1.clone());
            let k = |data, buf| SgdKernel {
                data,
                grad: &grad,
                buf: Some(buf),
                first,
                maximize: false,
                use_wd,
                nesterov,
                od,
                neg_lr: -0.0123,
                wd: 0.031,
                momentum_alpha: 0.9,
                momentum: 0.9,
                one_minus_damp: 0.75,
            };
            run_kernel(k(&mut p1, &mut b1));
            k(&mut p2, &mut b2).run();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&p1),
                bits(&p2),
                "{od} first={first} nesterov={nesterov}"
            );
            assert_eq!(
                bits(&b1),
                bits(&b2),
                "{od} first={first} nesterov={nesterov}"
            );
        }
    }
}

/// Independent f64 model of PyTorch's SGD (the documented algorithm, no f32 rounding).
struct RefSgd {
    c: SgdConfig,
    buf: Option<Vec<f64>>,
}

impl Reference for RefSgd {
    fn step(&mut self, p: &mut [f64], grad: &[f64]) {
        let c = &self.c;
        let g: Vec<f64> = grad
            .iter()
            .zip(p.iter())
            .map(|(&g, &p)| (if c.maximize { -g } else { g }) + c.weight_decay * p)
            .collect();
        let d: Vec<f64> = if c.momentum != 0.0 {
            let b: Vec<f64> = match &self.buf {
                None => g.clone(),
                Some(b) => b
                    .iter()
                    .zip(&g)
                    .map(|(b, g)| c.momentum * b + (1.0 - c.dampening) * g)
                    .collect(),
            };
            let d = if c.nesterov {
                g.iter().zip(&b).map(|(g, b)| g + c.momentum * b).collect()
            } else {
                b.clone()
            };
            self.buf = Some(b);
            d
        } else {
            g
        };
        for (p, d) in p.iter_mut().zip(d) {
            *p -= c.lr * d;
        }
    }
}

fn grads(step: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|j| (((step * 7 + j * 3) % 11) as f32 - 5.0) * 0.37 + 0.01 * j as f32)
        .collect()
}

fn run_against_f64(c: SgdConfig, steps: usize) {
    let n = 9;
    run_against_reference(
        &mut Sgd::new(c.clone()).unwrap(),
        &mut RefSgd {
            c: c.clone(),
            buf: None,
        },
        RefRun {
            what: format!("{c:?}"),
            p0: (0..n).map(|j| 1.5 - 0.3 * j as f32).collect(),
            steps,
            grads: &|s| grads(s, n),
            tol: |b| 1e-6 * b.abs().max(1.0),
        },
    );
}

#[test]
fn plain_step_is_one_fused_multiply_add() {
    // p - lr*g with one rounding: p + (-lr_f32 * g) exactly, then rounded to f32.
    let p0 = 1.0f32;
    let lr = 0.1f64;
    let neg_lr = (-lr) as f32;
    // The first g = 0.3 + k*1e-6 where one rounding and two roundings disagree. The f64
    // sum is exact: every bit of it lies within 2^-1..2^-52.
    let (g, fused) = (1..1000)
        .map(|k| 0.3f32 + k as f32 * 1e-6)
        .map(|g| (g, (f64::from(p0) + f64::from(neg_lr) * f64::from(g)) as f32))
        .find(|&(g, fused)| fused != p0 + neg_lr * g)
        .expect("some g tells fused from unfused");

    let mut opt = Sgd::new(SgdConfig {
        lr,
        ..SgdConfig::default()
    })
    .unwrap();
    let mut p = [p0];
    let gs = [g];
    step_f32(&mut opt, "w", &mut p, &gs).unwrap();
    assert_eq!(p[0].to_bits(), fused.to_bits());
    assert!((f64::from(p[0]) - (1.0 - 0.1 * f64::from(g))).abs() < 1e-7);
    assert_eq!(opt.state_buffer("w", "momentum_buffer"), None);
}

#[test]
fn replays_pytorch_op_sequence_bit_for_bit() {
    // PyTorch's single-tensor SGD as whole-tensor passes of ATen's CPU kernels:
    // add(alpha) is fmadd(other, alpha, self), mul by a scalar is one rounding.
    fn add_(a: &mut [f32], b: &[f32], alpha: f32) {
        a.iter_mut()
            .zip(b)
            .for_each(|(a, &b)| *a = b.mul_add(alpha, *a));
    }
    for (momentum, dampening, wd, nesterov, maximize) in [
        (0.9, 0.0, 0.0, false, false),
        (0.9, 0.25, 0.01, false, true),
        (0.85, 0.0, 0.02, true, false),
        (0.0, 0.0, 0.05, false, false),
    ] {
        let c = SgdConfig {
            lr: 0.013,
            momentum,
            dampening,
            weight_decay: wd,
            nesterov,
            maximize,
            ..SgdConfig::default()
        };
        let n = 300;
        let mut opt = Sgd::new(c.clone()).unwrap();
        let mut p: Vec<f32> = (0..n)
            .map(|j| ((j * 37 % 101) as f32 - 50.0) * 0.0213)
            .collect();
        let mut q = p.clone();
        let mut buf: Option<Vec<f32>> = None;
        for t in 0..6 {
            let g = grads(t, n);
            step_f32(&mut opt, "w", &mut p, &g).unwrap();

            let mut g: Vec<f32> = if maximize {
                g.iter().map(|x| -x).collect()
            } else {
                g
            };
            if wd != 0.0 {
                add_(&mut g, &q, wd as f32);
            }
            if momentum != 0.0 {
                let b = match buf.take() {
                    None => g.clone(),
                    Some(mut b) => {
                        b.iter_mut().for_each(|b| *b *= momentum as f32);
                        add_(&mut b, &g, (1.0 - dampening) as f32);
                        b
                    }
                };
                if nesterov {
                    add_(&mut g, &b, momentum as f32);
                } else {
                    g = b.clone();
                }
                buf = Some(b);
            }
            add_(&mut q, &g, (-c.lr) as f32);

            let same = p
                .iter()
                .zip(&q)
                .filter(|(a, b)| a.to_bits() == b.to_bits())
                .count();
            assert_eq!(
                same,
                n,
                "{c:?} step {t}: {} of {n} elements differ",
                n - same
            );
            assert_eq!(opt.state_buffer("w", "momentum_buffer"), buf.as_deref());
        }
    }
}

#[test]
fn hand_computed_momentum_steps() {
    // lr 0.5, momentum 0.5, dampening 0.5; g = 2 then 4 on p = 1.
    // step 1: buf = 2 (no dampening), p = 1 - 0.5*2 = 0
    // step 2: buf = 0.5*2 + 0.5*4 = 3, p = 0 - 0.5*3 = -1.5
    let c = SgdConfig {
        lr: 0.5,
        momentum: 0.5,
        dampening: 0.5,
        ..SgdConfig::default()
    };
    let mut opt = Sgd::new(c).unwrap();
    let mut p = [1.0f32];
    step_f32(&mut opt, "w", &mut p, &[2.0]).unwrap();
    assert_eq!(p[0], 0.0);
    assert_eq!(
        opt.state_buffer("w", "momentum_buffer"),
        Some(&[2.0f32][..])
    );
    step_f32(&mut opt, "w", &mut p, &[4.0]).unwrap();
    assert_eq!(
        opt.state_buffer("w", "momentum_buffer"),
        Some(&[3.0f32][..])
    );
    assert_eq!(p[0], -1.5);
}

#[test]
fn first_momentum_buffer_is_the_gradient() {
    let c = SgdConfig {
        lr: 0.1,
        momentum: 0.9,
        dampening: 0.3,
        weight_decay: 0.0,
        ..SgdConfig::default()
    };
    let mut opt = Sgd::new(c).unwrap();
    let g = grads(3, 5);
    let mut p = vec![0.25f32; 5];
    step_f32(&mut opt, "w", &mut p, &g).unwrap();
    assert_eq!(opt.state_buffer("w", "momentum_buffer"), Some(&g[..]));
}

#[test]
fn matches_f64_reference() {
    let base = SgdConfig {
        lr: 0.05,
        ..SgdConfig::default()
    };
    run_against_f64(base.clone(), 12);
    run_against_f64(
        SgdConfig {
            momentum: 0.9,
            dampening: 0.1,
            ..base.clone()
        },
        12,
    );
    run_against_f64(
        SgdConfig {
            momentum: 0.9,
            nesterov: true,
            ..base.clone()
        },
        12,
    );
    run_against_f64(
        SgdConfig {
            weight_decay: 0.01,
            ..base.clone()
        },
        12,
    );
    run_against_f64(
        SgdConfig {
            weight_decay: 0.1,
            momentum: 0.8,
            nesterov: true,
            ..base.clone()
        },
        12,
    );
    run_against_f64(
        SgdConfig {
            maximize: true,
            momentum: 0.5,
            ..base.clone()
        },
        12,
    );
    run_against_f64(
        SgdConfig {
            maximize: true,
            weight_decay: 0.05,
            dampening: 0.5,
            momentum: 0.7,
            ..base
        },
        12,
    );
}

#[test]
fn maximize_equals_descending_on_the_negated_gradient() {
    let c = SgdConfig {
        lr: 0.03,
        momentum: 0.9,
        weight_decay: 0.02,
        ..SgdConfig::default()
    };
    let mut up = Sgd::new(SgdConfig {
        maximize: true,
        ..c.clone()
    })
    .unwrap();
    let mut down = Sgd::new(c).unwrap();
    let mut a: Vec<f32> = (0..6).map(|j| j as f32 * 0.7 - 2.0).collect();
    let mut b = a.clone();
    for s in 0..5 {
        let g = grads(s, 6);
        let neg: Vec<f32> = g.iter().map(|x| -x).collect();
        step_f32(&mut up, "w", &mut a, &g).unwrap();
        step_f32(&mut down, "w", &mut b, &neg).unwrap();
    }
    assert_eq!(a, b);
    let start: Vec<f32> = (0..6).map(|j| j as f32 * 0.7 - 2.0).collect();
    assert_ne!(a, start);
}

#[test]
fn f16_params_are_rounded_once_to_f16() {
    let c = SgdConfig {
        lr: 0.01,
        momentum: 0.9,
        ..SgdConfig::default()
    };
    let mut half = Sgd::new(c.clone()).unwrap();
    let mut full = Sgd::new(c).unwrap();
    let start: Vec<f32> = (0..16).map(|j| round_f16(0.1 + j as f32 * 0.013)).collect();
    let mut h = start.clone();
    for s in 0..3 {
        let g: Vec<f32> = grads(s, 16).iter().map(|&x| round_f16(x)).collect();
        // The f32 reference starts from the f16 values the half run holds.
        let mut f = h.clone();
        half.step(&mut [ParamSlot {
            name: "w",
            data: &mut h,
            grad: Some(&g),
            dtype: DType::F16,
        }])
        .unwrap();
        step_f32(&mut full, "w", &mut f, &g).unwrap();
        let expect: Vec<f32> = f.iter().map(|&x| round_f16(x)).collect();
        assert_eq!(h, expect, "step {s}");
        assert!(
            f.iter().zip(&h).any(|(a, b)| a != b),
            "f16 rounding must show at step {s}"
        );
    }
    // The momentum buffer stays in f32: not every value of it is f16-representable.
    let buf = half.state_buffer("w", "momentum_buffer").unwrap();
    assert!(buf.iter().any(|&b| round_f16(b) != b));
}

#[test]
fn state_follows_names_and_missing_grads_are_skipped() {
    let c = SgdConfig {
        lr: 0.1,
        momentum: 0.9,
        ..SgdConfig::default()
    };
    let mut joint = Sgd::new(c.clone()).unwrap();
    let mut only_a = Sgd::new(c.clone()).unwrap();
    let mut only_b = Sgd::new(c).unwrap();
    let (mut a, mut b) = (vec![1.0f32, -1.0], vec![2.0f32, 0.5, 3.0]);
    let (mut a2, mut b2) = (a.clone(), b.clone());
    for s in 0..6 {
        let ga = grads(s, 2);
        let gb = grads(s + 100, 3);
        // Alternate the slot order, and give `b` no gradient on odd steps.
        let gb_opt = if s % 2 == 0 { Some(&gb[..]) } else { None };
        let before_b = b.clone();
        if s % 3 == 0 {
            joint
                .step(&mut [
                    ParamSlot {
                        name: "a",
                        data: &mut a,
                        grad: Some(&ga),
                        dtype: DType::F32,
                    },
                    ParamSlot {
                        name: "b",
                        data: &mut b,
                        grad: gb_opt,
                        dtype: DType::F32,
                    },
                ])
                .unwrap();
        } else {
            joint
                .step(&mut [
                    ParamSlot {
                        name: "b",
                        data: &mut b,
                        grad: gb_opt,
                        dtype: DType::F32,
                    },
                    ParamSlot {
                        name: "a",
                        data: &mut a,
                        grad: Some(&ga),
                        dtype: DType::F32,
                    },
                ])
                .unwrap();
        }
        if gb_opt.is_none() {
            assert_eq!(b, before_b, "parameter without gradient must not move");
        }
        step_f32(&mut only_a, "a", &mut a2, &ga).unwrap();
        if let Some(gb) = gb_opt {
            step_f32(&mut only_b, "b", &mut b2, gb).unwrap();
        }
    }
    assert_eq!(a, a2);
    assert_eq!(b, b2);
    assert_eq!(joint.step_count("a"), Some(6.0));
    assert_eq!(joint.step_count("b"), Some(3.0));
    assert_eq!(joint.step_count("c"), None);
}

#[test]
fn resized_parameter_is_an_error() {
    let mut opt = Sgd::new(SgdConfig {
        momentum: 0.9,
        ..SgdConfig::default()
    })
    .unwrap();
    let (err, q) = resized_step(&mut opt, "w", 3, 4);
    assert!(err.contains("`w`") && err.contains("state has 3"), "{err}");
    assert_eq!(q, vec![1.0; 4]);
}

#[test]
fn set_lr_applies_to_the_next_step() {
    let mut opt = Sgd::new(SgdConfig {
        lr: 0.1,
        ..SgdConfig::default()
    })
    .unwrap();
    opt.set_lr(0.5);
    assert_eq!(opt.lr(), 0.5);
    let mut p = [1.0f32];
    step_f32(&mut opt, "w", &mut p, &[1.0]).unwrap();
    assert_eq!(p[0], 0.5);
    opt.set_lr_f64(0.25);
    step_f32(&mut opt, "w", &mut p, &[1.0]).unwrap();
    assert_eq!(p[0], 0.25);
}
