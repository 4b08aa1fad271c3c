//! Unit tests of `optim::adam`.

use super::*;
use crate::dtype::{round_bf16, round_f16, DType};
use crate::optim::harness::{
    kernel_test_data, resized_step, run_against_reference, step_f32, RefRun, Reference,
};
use crate::optim::update::{run_kernel, Kernel};
use crate::optim::StatePrecision;

#[test]
fn the_fma_copy_of_the_update_loop_gives_the_plain_loops_bits() {
    let n = 5000;
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for od in [DType::F32, DType::F16, DType::BF16] {
        for (decoupled, amsgrad) in [(false, false), (true, true), (false, true)] {
            let grad = kernel_test_data(n, 1);
            let mut a: Vec<Vec<f32>> = (2..6).map(|s| kernel_test_data(n, s)).collect();
            for v in &mut a[2..] {
                v.iter_mut().for_each(|x| *x = x.abs());
            }
            let mut b = a.clone();
            fn k<'a>(
                s: &'a mut [Vec<f32>],
                grad: &'a [f32],
                (od, decoupled, amsgrad): (DType, bool, bool),
            ) -> AdamKernel<'a> {
                let [p, m, v, vm] = s else { unreachable!() };
                AdamKernel {
                    data: p,
                    grad,
                    exp_avg: m,
                    exp_avg_sq: v,
                    vmax: amsgrad.then_some(vm.as_mut_slice()),
                    maximize: false,
                    use_wd: true,
                    decoupled,
                    od,
                    decay_factor: 0.9999,
                    wd: 0.01,
                    lerp_weight: 0.1,
                    beta2: 0.999,
                    one_minus_beta2: 0.001,
                    bc2_sqrt: 0.0447,
                    eps: 1e-8,
                    neg_step_size: -0.01,
                }
            }
            run_kernel(k(&mut a, &grad, (od, decoupled, amsgrad)));
            k(&mut b, &grad, (od, decoupled, amsgrad)).run();
            for (x, y) in a.iter().zip(&b) {
                assert_eq!(
                    bits(x),
                    bits(y),
                    "{od} decoupled={decoupled} amsgrad={amsgrad}"
                );
            }
        }
    }
}

/// Independent f64 model of Adam/AdamW/AMSGrad in the textbook form of PyTorch's docs.
struct RefAdam {
    c: AdamConfig,
    t: i32,
    m: Vec<f64>,
    v: Vec<f64>,
    vmax: Vec<f64>,
}

impl RefAdam {
    fn new(c: AdamConfig, n: usize) -> Self {
        RefAdam {
            c,
            t: 0,
            m: vec![0.0; n],
            v: vec![0.0; n],
            vmax: vec![0.0; n],
        }
    }
}

impl Reference for RefAdam {
    fn step(&mut self, p: &mut [f64], grad: &[f64]) {
        let c = &self.c;
        let (b1, b2) = c.betas;
        self.t += 1;
        for j in 0..p.len() {
            let mut g = if c.maximize { -grad[j] } else { grad[j] };
            if c.decoupled {
                p[j] *= 1.0 - c.lr * c.weight_decay;
            } else {
                g += c.weight_decay * p[j];
            }
            self.m[j] = b1 * self.m[j] + (1.0 - b1) * g;
            self.v[j] = b2 * self.v[j] + (1.0 - b2) * g * g;
            let m_hat = self.m[j] / (1.0 - b1.powi(self.t));
            self.vmax[j] = self.vmax[j].max(self.v[j]);
            let v = if c.amsgrad { self.vmax[j] } else { self.v[j] };
            let v_hat = v / (1.0 - b2.powi(self.t));
            p[j] -= c.lr * m_hat / (v_hat.sqrt() + c.eps);
        }
    }
}

/// Gradients whose magnitude shrinks over time, so that AMSGrad's maximum matters.
fn grads(step: usize, n: usize) -> Vec<f32> {
    let scale = 4.0 / (1.0 + step as f32);
    (0..n)
        .map(|j| ((((step * 5 + j * 3) % 7) as f32 - 3.0) * 0.41 + 0.05) * scale)
        .collect()
}

fn run(c: &AdamConfig, steps: usize, n: usize) -> (Vec<f32>, Vec<f64>) {
    run_against_reference(
        &mut Adam::new(c.clone()).unwrap(),
        &mut RefAdam::new(c.clone(), n),
        RefRun {
            what: format!("{c:?}"),
            p0: (0..n).map(|j| 0.8 + 0.17 * j as f32).collect(),
            steps,
            grads: &|s| grads(s, n),
            tol: |b| 1e-6 * b.abs(),
        },
    )
}

#[test]
fn hand_computed_first_step() {
    // First step: m = 0.1 g, v = 0.001 g^2, m_hat = g, v_hat = g^2, so
    // p -= lr * g / (|g| + eps) = lr * sign(g) (up to eps/|g| = 5e-9).
    let mut opt = Adam::new(AdamConfig {
        lr: 0.1,
        ..AdamConfig::default()
    })
    .unwrap();
    let mut p = [1.0f32, 1.0, 1.0];
    let g = [2.0f32, -0.5, 0.0];
    step_f32(&mut opt, "w", &mut p, &g).unwrap();
    assert!((p[0] - 0.9).abs() < 1e-6, "{}", p[0]);
    assert!((p[1] - 1.1).abs() < 1e-6, "{}", p[1]);
    assert_eq!(p[2], 1.0, "zero gradient, zero moment: no update");
    let m = opt.state_buffer("w", "exp_avg").unwrap();
    // lerp from 0 with weight f32(0.1): one rounding of 0.1f * g.
    assert_eq!(m, &[0.1f32 * 2.0, 0.1f32 * -0.5, 0.0][..]);
    let v = opt.state_buffer("w", "exp_avg_sq").unwrap();
    assert_eq!(v[0], (0.001f32 * 2.0) * 2.0);
    assert_eq!(opt.state_buffer("w", "max_exp_avg_sq"), None);
}

#[test]
fn update_matches_pytorch_op_order_bit_for_bit() {
    // Second step of Adam on one element, replayed op by op from the documented order
    // with f64 arithmetic that is exact before each single rounding to f32.
    let c = AdamConfig {
        lr: 0.01,
        weight_decay: 0.1,
        ..AdamConfig::default()
    };
    let mut opt = Adam::new(c).unwrap();
    let (g1, g2) = (0.3f32, -0.7f32);
    let mut p = [1.25f32];
    step_f32(&mut opt, "w", &mut p, &[g1]).unwrap();
    let (p1, m1, v1) = (
        p[0],
        opt.state_buffer("w", "exp_avg").unwrap()[0],
        opt.state_buffer("w", "exp_avg_sq").unwrap()[0],
    );
    step_f32(&mut opt, "w", &mut p, &[g2]).unwrap();

    let x = f64::from;
    let g = (x(p1) * x(0.1f32) + x(g2)) as f32; // fma(p, wd, g)
    let diff = g - m1;
    let m = (x(0.1f32) * x(diff) + x(m1)) as f32; // fma(w, end - start, start)
    let v_scaled = v1 * 0.999f32;
    let v = (x(0.001f32 * g) * x(g) + x(v_scaled)) as f32; // fma((1-b2) g, g, v b2)
    let bc1 = 1.0 - 0.9f64.powf(2.0);
    let bc2 = 1.0 - 0.999f64.powf(2.0);
    let denom = v.sqrt() / (bc2.powf(0.5) as f32) + 1e-8f32;
    let expect = p1 + ((-(0.01 / bc1)) as f32 * m) / denom;
    assert_eq!(opt.state_buffer("w", "exp_avg").unwrap()[0], m);
    assert_eq!(opt.state_buffer("w", "exp_avg_sq").unwrap()[0], v);
    assert_eq!(p[0].to_bits(), expect.to_bits());
}

/// ATen's CPU kernels as whole-tensor passes, for replaying PyTorch's op sequence.
mod aten {
    /// `a.add_(b, alpha=s)`: `vec::fmadd(b, s, a)`.
    pub fn add_(a: &mut [f32], b: &[f32], alpha: f32) {
        a.iter_mut()
            .zip(b)
            .for_each(|(a, &b)| *a = b.mul_add(alpha, *a));
    }
    /// `a.add_(s)` with a Python scalar: alpha is 1, so a plain addition.
    pub fn add_scalar_(a: &mut [f32], s: f32) {
        a.iter_mut().for_each(|a| *a += s);
    }
    pub fn mul_(a: &mut [f32], s: f32) {
        a.iter_mut().for_each(|a| *a *= s);
    }
    pub fn div_(a: &mut [f32], s: f32) {
        a.iter_mut().for_each(|a| *a /= s);
    }
    pub fn sqrt(a: &[f32]) -> Vec<f32> {
        a.iter().map(|a| a.sqrt()).collect()
    }
    pub fn lerp_(a: &mut [f32], b: &[f32], w: f32) {
        for (a, &b) in a.iter_mut().zip(b) {
            let coeff = if w.abs() < 0.5 { w } else { w - 1.0 };
            let base = if w.abs() < 0.5 { *a } else { b };
            *a = coeff.mul_add(b - *a, base);
        }
    }
    /// `a + s * b * c` with the final multiply-add contracted.
    pub fn addcmul_(a: &mut [f32], b: &[f32], c: &[f32], s: f32) {
        for ((a, &b), &c) in a.iter_mut().zip(b).zip(c) {
            *a = (s * b).mul_add(c, *a);
        }
    }
    pub fn addcdiv_(a: &mut [f32], b: &[f32], c: &[f32], s: f32) {
        for ((a, &b), &c) in a.iter_mut().zip(b).zip(c) {
            *a += s * b / c;
        }
    }
    pub fn maximum_(a: &mut [f32], b: &[f32]) {
        a.iter_mut()
            .zip(b)
            .for_each(|(a, &b)| *a = if b > *a { b } else { *a });
    }
}

#[test]
fn replays_pytorch_op_sequence_bit_for_bit() {
    for (wd, decoupled, amsgrad, betas) in [
        (0.0, false, false, (0.9, 0.999)),
        (0.03, false, true, (0.9, 0.999)),
        (0.03, true, false, (0.8, 0.99)),
        (0.1, true, true, (0.3, 0.95)),
    ] {
        let c = AdamConfig {
            lr: 0.007,
            betas,
            weight_decay: wd,
            decoupled,
            amsgrad,
            ..AdamConfig::default()
        };
        let n = 300;
        let mut opt = Adam::new(c.clone()).unwrap();
        let mut p: Vec<f32> = (0..n)
            .map(|j| ((j * 37 % 101) as f32 - 50.0) * 0.0213)
            .collect();
        let mut q = p.clone();
        let (mut m, mut v, mut vmax) = (vec![0f32; n], vec![0f32; n], vec![0f32; n]);
        for t in 1..=6 {
            let g: Vec<f32> = (0..n)
                .map(|j| ((j * 53 + t * 19) % 97) as f32 * 0.0371 - 1.7 + 1e-3 * t as f32)
                .collect();
            step_f32(&mut opt, "w", &mut p, &g).unwrap();

            let mut g = g.clone();
            if wd != 0.0 {
                if decoupled {
                    aten::mul_(&mut q, (1.0 - c.lr * wd) as f32);
                } else {
                    let mut gw = g.clone();
                    aten::add_(&mut gw, &q, wd as f32);
                    g = gw;
                }
            }
            aten::lerp_(&mut m, &g, (1.0 - betas.0) as f32);
            aten::mul_(&mut v, betas.1 as f32);
            aten::addcmul_(&mut v, &g, &g, (1.0 - betas.1) as f32);
            let bc1 = 1.0 - betas.0.powf(f64::from(t as u8));
            let bc2 = 1.0 - betas.1.powf(f64::from(t as u8));
            let step_size = c.lr / bc1;
            let mut denom = if amsgrad {
                aten::maximum_(&mut vmax, &v);
                aten::sqrt(&vmax)
            } else {
                aten::sqrt(&v)
            };
            aten::div_(&mut denom, bc2.powf(0.5) as f32);
            aten::add_scalar_(&mut denom, 1e-8f64 as f32);
            aten::addcdiv_(&mut q, &m, &denom, (-step_size) as f32);

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
            assert_eq!(opt.state_buffer("w", "exp_avg").unwrap(), &m[..]);
            assert_eq!(opt.state_buffer("w", "exp_avg_sq").unwrap(), &v[..]);
        }
    }
}

#[test]
fn adam_matches_f64_reference() {
    let c = AdamConfig {
        lr: 0.01,
        ..AdamConfig::default()
    };
    run(&c, 15, 7);
    run(
        &AdamConfig {
            weight_decay: 0.05,
            ..c.clone()
        },
        15,
        7,
    );
    run(
        &AdamConfig {
            maximize: true,
            betas: (0.5, 0.9),
            ..c.clone()
        },
        15,
        7,
    );
    // beta1 <= 0.5 takes lerp's other branch.
    run(
        &AdamConfig {
            betas: (0.3, 0.99),
            weight_decay: 0.01,
            ..c
        },
        15,
        7,
    );
}

#[test]
fn adamw_matches_f64_reference() {
    let c = AdamConfig::from(AdamWConfig {
        lr: 0.01,
        ..AdamWConfig::default()
    });
    assert!(c.decoupled && c.weight_decay == 0.01);
    run(&c, 15, 7);
    run(
        &AdamConfig {
            weight_decay: 0.2,
            ..c
        },
        15,
        7,
    );
}

#[test]
fn amsgrad_matches_f64_reference_and_differs_from_adam() {
    for decoupled in [false, true] {
        let c = AdamConfig {
            lr: 0.01,
            weight_decay: 0.02,
            decoupled,
            ..AdamConfig::default()
        };
        let (plain, _) = run(&c, 15, 7);
        let (ams, _) = run(&AdamConfig { amsgrad: true, ..c }, 15, 7);
        assert_ne!(plain, ams, "shrinking gradients must make AMSGrad differ");
    }
    let mut opt = Adam::new(AdamConfig {
        amsgrad: true,
        ..AdamConfig::default()
    })
    .unwrap();
    let mut p = vec![0.0f32; 2];
    for g in [[3.0f32, 1.0], [0.0, 2.0]] {
        step_f32(&mut opt, "w", &mut p, &g).unwrap();
    }
    let v = opt.state_buffer("w", "exp_avg_sq").unwrap();
    let vmax = opt.state_buffer("w", "max_exp_avg_sq").unwrap();
    assert!(vmax[0] > v[0], "max keeps the larger first value");
    assert_eq!(vmax[1], v[1]);
}

#[test]
fn adamw_decays_before_the_moment_update() {
    // Zero gradient: moments stay zero, so the whole change is p * (1 - lr*wd).
    let mut opt = Adam::new(AdamConfig::from(AdamWConfig {
        lr: 0.1,
        weight_decay: 0.5,
        ..AdamWConfig::default()
    }))
    .unwrap();
    assert_eq!(opt.name(), "adamw");
    let mut p = [2.0f32, -4.0];
    step_f32(&mut opt, "w", &mut p, &[0.0, 0.0]).unwrap();
    assert_eq!(p, [1.9, -3.8f32]);
    // Adam's coupled decay feeds the decay into the moments instead.
    let mut opt = Adam::new(AdamConfig {
        lr: 0.1,
        weight_decay: 0.5,
        ..AdamConfig::default()
    })
    .unwrap();
    let mut q = [2.0f32, -4.0];
    step_f32(&mut opt, "w", &mut q, &[0.0, 0.0]).unwrap();
    assert!(
        (q[0] - 1.9).abs() < 1e-6 && (q[1] + 3.9).abs() < 1e-6,
        "{q:?}"
    );
}

#[test]
fn low_precision_params_are_rounded_once() {
    for (dtype, round) in [
        (DType::F16, round_f16 as fn(f32) -> f32),
        (DType::BF16, round_bf16),
    ] {
        let c = AdamConfig::from(AdamWConfig {
            lr: 0.003,
            ..AdamWConfig::default()
        });
        let mut low = Adam::new(c.clone()).unwrap();
        let mut full = Adam::new(c).unwrap();
        let mut h: Vec<f32> = (0..32).map(|j| round(0.3 + j as f32 * 0.021)).collect();
        for s in 0..4 {
            let g: Vec<f32> = grads(s, 32).iter().map(|&x| round(x)).collect();
            let mut f = h.clone();
            low.step(&mut [ParamSlot {
                name: "w",
                data: &mut h,
                grad: Some(&g),
                dtype,
            }])
            .unwrap();
            step_f32(&mut full, "w", &mut f, &g).unwrap();
            let expect: Vec<f32> = f.iter().map(|&x| round(x)).collect();
            assert_eq!(h, expect, "{dtype} step {s}");
            assert!(f != expect, "{dtype} step {s}: rounding must be visible");
        }
        // State is f32: identical to the f32 run's state for identical inputs.
        assert!(low
            .state_buffer("w", "exp_avg")
            .unwrap()
            .iter()
            .any(|&m| round(m) != m));
    }
}

#[test]
fn fp16_state_reproduces_pytorchs_small_gradient_blow_up() {
    // torch 2.15: Adam(lr=1e-3) on fp16 ones with grads (1e-4, 1e-2, 1) gives
    // params (-inf, 0.999, 0.999) and exp_avg_sq (0, 2^-23, 1.0004e-3), all fp16.
    // In fp16, 1e-3 * g^2 = 1e-11 underflows to 0 and 0 + 1e-8 rounds to 0, so the first
    // denominator is 0 and the update -lr * m / 0 is -inf.
    let g: Vec<f32> = [1e-4f32, 1e-2, 1.0].iter().map(|&x| round_f16(x)).collect();
    let run = |state_precision| {
        let mut opt = Adam::new(AdamConfig {
            state_precision,
            ..AdamConfig::default()
        })
        .unwrap();
        let mut p = vec![1.0f32; 3];
        opt.step(&mut [ParamSlot {
            name: "w",
            data: &mut p,
            grad: Some(&g),
            dtype: DType::F16,
        }])
        .unwrap();
        (p, opt.state_buffer("w", "exp_avg_sq").unwrap().to_vec())
    };
    let (p, v) = run(StatePrecision::Param);
    assert_eq!(p, [f32::NEG_INFINITY, 0.99902344, 0.99902344]);
    assert_eq!(v[..2], [0.0, 2f32.powi(-23)]);
    assert_eq!(v[2], round_f16(v[2]));
    // f32 state: the small gradient gives an ordinary first Adam step.
    let (p, v) = run(StatePrecision::F32);
    assert_eq!(p, [0.99902344; 3]);
    assert!(v[0] > 0.0);
}

#[test]
fn state_is_kept_per_name() {
    let c = AdamConfig {
        lr: 0.01,
        ..AdamConfig::default()
    };
    let mut joint = Adam::new(c.clone()).unwrap();
    let mut solo = Adam::new(c).unwrap();
    let mut a = vec![0.5f32; 4];
    let mut b = vec![-0.5f32; 4];
    let mut a2 = a.clone();
    for s in 0..5 {
        let ga = grads(s, 4);
        let gb = grads(s + 9, 4);
        let b_grad = if s < 2 { Some(&gb[..]) } else { None };
        let frozen = b.clone();
        joint
            .step(&mut [
                ParamSlot {
                    name: "b",
                    data: &mut b,
                    grad: b_grad,
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
        if b_grad.is_none() {
            assert_eq!(b, frozen);
        }
        step_f32(&mut solo, "a", &mut a2, &ga).unwrap();
    }
    assert_eq!(a, a2);
    assert_eq!(joint.step_count("a"), Some(5.0));
    assert_eq!(joint.step_count("b"), Some(2.0));
}

#[test]
fn resized_parameter_is_an_error() {
    let mut opt = Adam::new(AdamConfig::default()).unwrap();
    let (err, _) = resized_step(&mut opt, "enc.w", 2, 5);
    assert!(
        err.contains("enc.w") && err.contains("state has 2"),
        "{err}"
    );
    assert_eq!(opt.step_count("enc.w"), Some(1.0));
}

#[test]
fn nan_gradient_poisons_only_its_elements() {
    let mut opt = Adam::new(AdamConfig {
        amsgrad: true,
        ..AdamConfig::default()
    })
    .unwrap();
    let mut p = [1.0f32, 1.0];
    step_f32(&mut opt, "w", &mut p, &[f32::NAN, 1.0]).unwrap();
    assert!(p[0].is_nan());
    assert!((p[1] - 0.999).abs() < 1e-6);
    assert!(opt.state_buffer("w", "max_exp_avg_sq").unwrap()[0].is_nan());
}
