//! Unit tests of `optim`.

use super::*;
use crate::dtype::{bf16_bits_to_f32, f16_bits_to_f32, round_to, DType};
use crate::optim::harness::step_f32;
use crate::Error;

#[test]
fn config_defaults_follow_pytorch() {
    let c: OptimizerConfig = serde_json::from_str(r#"{"kind":"adamw"}"#).unwrap();
    let OptimizerConfig::AdamW(w) = &c else {
        panic!("expected adamw, got {c:?}")
    };
    assert_eq!(w.weight_decay, 0.01);
    assert_eq!(w.lr, 1e-3);
    assert_eq!(w.betas, (0.9, 0.999));
    assert_eq!(w.eps, 1e-8);
    assert!(!w.amsgrad);
    let o = build_optimizer(&c).unwrap();
    assert_eq!(o.name(), "adamw");

    let c: OptimizerConfig = serde_json::from_str(r#"{"kind":"adam"}"#).unwrap();
    let OptimizerConfig::Adam(a) = &c else {
        panic!("expected adam, got {c:?}")
    };
    assert_eq!(a.weight_decay, 0.0);
    assert!(!a.decoupled);
    assert_eq!(build_optimizer(&c).unwrap().name(), "adam");

    let c: OptimizerConfig = toml::from_str("kind = \"sgd\"\nlr = 0.1\nmomentum = 0.9\n").unwrap();
    let OptimizerConfig::Sgd(s) = &c else {
        panic!("expected sgd, got {c:?}")
    };
    assert_eq!(
        (s.lr, s.momentum, s.dampening, s.weight_decay),
        (0.1, 0.9, 0.0, 0.0)
    );
    assert!(!s.nesterov && !s.maximize);
    let o = build_optimizer(&c).unwrap();
    assert_eq!(o.name(), "sgd");
    assert_eq!(o.lr_f64(), 0.1);
    assert_eq!(o.lr(), 0.1f32);

    let c: OptimizerConfig =
        toml::from_str("kind = \"adam\"\nbetas = [0.8, 0.99]\namsgrad = true\n").unwrap();
    let OptimizerConfig::Adam(a) = &c else {
        panic!("expected adam, got {c:?}")
    };
    assert_eq!(a.betas, (0.8, 0.99));
    assert!(a.amsgrad);
}

// Golden values from torch 2.15.0 on x86-64 CPU (AVX-512, MKL build), `foreach=False`,
// 5 steps on 19 elements with the inputs `golden_p0` / `golden_grad` make (computed in
// f64, rounded to f32, as `torch.tensor` of Python floats does). f32 bit patterns.
fn golden_p0(n: usize) -> Vec<f32> {
    (0..n)
        .map(|j| (((j * 37 % 101) as f64 - 50.0) * 0.0213 + 0.0007 * j as f64) as f32)
        .collect()
}

fn golden_grad(t: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|j| {
            let base = ((j * 53 + t * 19) % 97) as f64 * 0.0371 - 1.7 + 1e-3 * t as f64;
            (base * (4.0 / (1.0 + t as f64))) as f32
        })
        .collect()
}

fn golden_run(cfg: &OptimizerConfig) -> (Vec<f32>, Box<dyn Optimizer>) {
    let mut opt = build_optimizer(cfg).unwrap();
    let mut p = golden_p0(19);
    for t in 0..5 {
        step_w(opt.as_mut(), &mut p, &golden_grad(t, 19));
    }
    (p, opt)
}

/// One step of f32 parameter `w` (now `p`) by gradient `g`.
fn step_w(opt: &mut dyn Optimizer, p: &mut [f32], g: &[f32]) {
    step_f32(opt, "w", p, g).unwrap();
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn sgd_matches_pytorch_bit_for_bit() {
    let cases: [(SgdConfig, [u32; 19], [u32; 19]); 2] = [
        (
            SgdConfig {
                lr: 0.013,
                momentum: 0.9,
                dampening: 0.25,
                weight_decay: 0.01,
                nesterov: false,
                maximize: true,
                ..SgdConfig::default()
            },
            [
                0xbfbe29ce, 0xbdf86e51, 0x3e509e35, 0xbf34fa7f, 0xbe82a2fc, 0x3f7b80a9, 0xbf3dfa1f,
                0x3e9087a3, 0x3f72810a, 0xbe34d4e4, 0x3ed7ee65, 0xbfb363d5, 0xbd181d96, 0x3e9366fb,
                0xbf1f6e8e, 0xbe2f1635, 0x3f88864d, 0xbf286e2f, 0x3ebb9f86,
            ],
            [
                0x40992077, 0xc0003151, 0x40399ad2, 0xbf8599c4, 0x3f72036e, 0xc03b72fe, 0x3f932f1c,
                0xbf738058, 0xbf3c3a3a, 0xc039fa0d, 0xbe85b0ac, 0x40925119, 0xc00dd00c, 0x402bfc17,
                0xbfa0d739, 0x3f3b8884, 0xc04911b8, 0x3f6fe34f, 0xbf94fda4,
            ],
        ),
        (
            SgdConfig {
                lr: 0.013,
                momentum: 0.85,
                dampening: 0.0,
                weight_decay: 0.02,
                nesterov: true,
                maximize: false,
                ..SgdConfig::default()
            },
            [
                0xbf1e4842, 0xbeefc836, 0x3f501656, 0xbf7b31e8, 0x3dcf7e99, 0x3ee6595b, 0xbf0a7d0b,
                0x3dadefee, 0x3f63e18c, 0xbf206885, 0x3e990f10, 0xbf100320, 0xbed33df7, 0x3f5e5b77,
                0xbf6cecc8, 0x3e20d3cd, 0x3f0171d0, 0xbef86fd4, 0x3e100c78,
            ],
            [
                0xc0769635, 0x3ff30f4c, 0xbfe170f0, 0x3ebd44bc, 0x3e2f2f90, 0x401d8657, 0xbf4689de,
                0xbc639280, 0x3fa87690, 0x3ff58fbe, 0x3e43e244, 0xc0683446, 0x4007e997, 0xbfc4ad10,
                0x3f182a20, 0x3ecaa748, 0x402be846, 0xbf0d021c, 0x3e57e5d0,
            ],
        ),
    ];
    for (c, p_bits, buf_bits) in cases {
        let (p, opt) = golden_run(&OptimizerConfig::Sgd(c.clone()));
        assert_eq!(bits(&p), p_bits, "{c:?}");
        assert_eq!(
            bits(opt.state_buffer("w", "momentum_buffer").unwrap()),
            buf_bits,
            "{c:?}"
        );
    }
}

#[test]
fn adam_matches_pytorch_up_to_its_mkl_sqrt() {
    let cases: [(OptimizerConfig, [[u32; 19]; 3]); 2] = [
        (
            OptimizerConfig::Adam(AdamConfig {
                lr: 0.007,
                amsgrad: true,
                ..AdamConfig::default()
            }),
            [
                [
                    0xbf8539bd, 0xbe9b5c46, 0x3f08dc08, 0xbf5e399e, 0xbd2f74f3, 0x3f3489ac,
                    0xbf1ed517, 0x3e1574d1, 0x3f71d413, 0xbeddad7d, 0x3eba0380, 0xbf782ba7,
                    0xbe6de139, 0x3f1b1ba2, 0xbf4c0ce8, 0x3ce6f042, 0x3f46c76c, 0xbf0cc3d8,
                    0x3e5e1b74,
                ],
                [
                    0xbefd4d8f, 0x3e78aba8, 0xbe87fc4f, 0x3daaa2c2, 0xbd155870, 0x3e9ff9f2,
                    0xbdc303a1, 0x3c8a6f83, 0x3e0920b1, 0x3e7bf073, 0x3d206cdc, 0xbef04489,
                    0x3e895edc, 0xbe75e691, 0x3ddec6e0, 0xbc3440fa, 0x3ead02f8, 0xbd8edf85,
                    0x3d2d7ffb,
                ],
                [
                    0x3d516991, 0x3c3cff1b, 0x3d08d4fb, 0x3c91dc9b, 0x3cab21cb, 0x3ce32b8b,
                    0x3c45dbc8, 0x3d1b0836, 0x3c0a1c5b, 0x3d470f14, 0x3c01b5f9, 0x3d484b98,
                    0x3c4924cf, 0x3d02154b, 0x3c98ca76, 0x3ca25efa, 0x3ceed5f4, 0x3c3b0276,
                    0x3d1edf0f,
                ],
            ],
        ),
        (
            OptimizerConfig::AdamW(AdamWConfig {
                lr: 0.007,
                weight_decay: 0.1,
                betas: (0.3, 0.95),
                ..AdamWConfig::default()
            }),
            [
                [
                    0xbf864e13, 0xbe972bc9, 0x3f05063f, 0xbf5abdc7, 0xbd6a1f68, 0x3f36a2e2,
                    0xbf20d499, 0x3e1bbad2, 0x3f6eb619, 0xbed91401, 0x3ebb318e, 0xbf7a6b46,
                    0xbe6589b5, 0x3f172c8e, 0xbf489d67, 0x3c5c786b, 0x3f48ce6a, 0xbf0ed2a5,
                    0x3e643fe1,
                ],
                [
                    0x3f1dd8ec, 0xbeb66877, 0x3f6c0401, 0xbeb4d82a, 0x3f9d178b, 0xbd440fff,
                    0xbef71d64, 0x3df8b94f, 0xbe358e76, 0x3eda847e, 0xbf20afdc, 0x3f268860,
                    0xbea5098e, 0x3f74b375, 0xbea37941, 0x3fa16f45, 0xbc6462e4, 0xbee5be7c,
                    0x3e1f1a77,
                ],
                [
                    0x4006e896, 0x3f033722, 0x3fb160a7, 0x3f445d7d, 0x3f61fa16, 0x3f95d8c6,
                    0x3f0614c2, 0x3fc9fca9, 0x3ec3a276, 0x4000808d, 0x3eb8ec53, 0x40011495,
                    0x3f0b2d22, 0x3fa8d688, 0x3f4d1363, 0x3f572198, 0x3f9d5199, 0x3efe900f,
                    0x3fceb6fe,
                ],
            ],
        ),
    ];
    for (c, [p_bits, m_bits, v_bits]) in cases {
        let (p, opt) = golden_run(&c);
        // The moments never pass through sqrt: bit-exact.
        assert_eq!(
            bits(opt.state_buffer("w", "exp_avg").unwrap()),
            m_bits,
            "{c:?}"
        );
        assert_eq!(
            bits(opt.state_buffer("w", "exp_avg_sq").unwrap()),
            v_bits,
            "{c:?}"
        );
        // Parameters: MKL's sqrt is 1 ulp off the correctly rounded one for about a fifth
        // of its inputs; that moves a parameter by at most an ulp or two over 5 steps.
        for (j, (a, b)) in bits(&p).into_iter().zip(p_bits).enumerate() {
            assert!(a.abs_diff(b) <= 2, "{c:?} elem {j}: {a:#x} vs {b:#x}");
        }
    }
}

#[test]
fn clip_matches_pytorch_up_to_its_f32_accumulation() {
    let mut a = golden_grad(3, 19);
    let mut b = golden_grad(5, 7);
    let out = clip_grad_norm(
        &mut [
            GradSlot {
                name: "a",
                data: &mut a,
                dtype: DType::F32,
            },
            GradSlot {
                name: "b",
                data: &mut b,
                dtype: DType::F32,
            },
        ],
        0.37,
        NormType::L2,
    )
    .unwrap();
    // PyTorch's f32 sum of squares puts the norm of `b` one ulp below the correctly
    // rounded value this crate returns; the total, the coefficient (through a reciprocal
    // and a product) and the scaled gradients move by an ulp or two.
    let torch_total = 0x4096b53fu32;
    assert!(
        out.total_norm.to_bits().abs_diff(torch_total) <= 1,
        "{out:?}"
    );
    let torch_a = [
        0x3d06699b,
        0xbdc370bd,
        0x3d71dbe0,
        0xbd8db79b,
        0x3daea712,
        0xbd2ffcf1,
        0x3de46034,
        0xbc89155a,
        0x3e0d0cab,
        0x3c1b9e5e,
        0xbdf331bf,
        0x3d1259dc,
        0xbdbd789d,
        0x3d7dcc20,
        0xbd87bf7b,
        0x3db49f32,
        0xbd240cb1,
        0x3dea5855,
        0xbc6269b1u32,
    ];
    let torch_b = [
        0x3dc43d51,
        0x3c292247,
        0xbd99f4bf,
        0x3ce3d429,
        0xbd6c47f9,
        0x3d398b98,
        0xbd24a677u32,
    ];
    for (x, t) in bits(&a)
        .into_iter()
        .chain(bits(&b))
        .zip(torch_a.into_iter().chain(torch_b))
    {
        assert!(x.abs_diff(t) <= 2, "{x:#x} vs {t:#x}");
    }
}

// torch 2.15.0 CPU, `foreach=False`, parameters made with `.half()` / `.bfloat16()`:
// state in the parameter's dtype. 64 elements is two whole AVX-512 vectors of fp16, so
// every element takes ATen's vectorized path (see `StatePrecision::Param`). Gradients of
// every fifth element are 1000x smaller.
fn param_state_grads(t: usize, dtype: DType) -> Vec<f32> {
    (0..64)
        .map(|j| {
            let base = ((j * 53 + t * 19) % 97) as f64 * 0.0371 - 1.7 + 1e-3 * t as f64;
            let small = if j % 5 == 0 { 1e-3 } else { 1.0 };
            round_to(dtype, (base * (4.0 / (1.0 + t as f64)) * small) as f32)
        })
        .collect()
}

fn same_bits(ours: &[f32], torch: &[u16], decode: fn(u16) -> f32, what: &str) {
    for (j, (&a, &b)) in ours.iter().zip(torch).enumerate() {
        let b = decode(b);
        assert!(
            a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
            "{what} elem {j}: {a} vs {b}"
        );
    }
}

/// fp16 parameters after the five Adam steps.
const PARAM_F16_P: [u16; 64] = [
    0xbc20, 0xb4da, 0x3847, 0xbaf1, 0xa97b, 0x398c, 0xb8f6, 0x30ac, 0x3b8d, 0xb6ed, 0x355f, 0xbbc1,
    0xb36e, 0x38d8, 0xba5f, 0xfe00, 0x3a36, 0xb865, 0x32f1, 0x3c0f, 0xfe00, 0x36b4, 0xbb30, 0xb128,
    0x396b, 0xb961, 0x2e58, 0x3ac9, 0xb7ab, 0x349a, 0x3c35, 0xb4a7, 0x37d5, 0xba9d, 0xadc1, 0x398c,
    0xb93d, 0x3185, 0x3b5b, 0xb68a, 0x3564, 0xbbfb, 0xb307, 0x387c, 0xba0b, 0xfe00, 0x3a8d, 0xb8ab,
    0x33cb, 0x3bec, 0xb50c, 0x36e0, 0xbb57, 0xb0bf, 0x390c, 0xb961, 0x2abe, 0x3b1f, 0xb819, 0x3509,
    0x3c35, 0xb44b, 0x3802, 0xbaca,
];

/// Their `exp_avg`.
const PARAM_F16_EXP_AVG: [u16; 64] = [
    0xa2dc, 0x33a9, 0xb426, 0x2ca8, 0xa8b2, 0x20a4, 0xae95, 0x24b2, 0x30a8, 0x33b5, 0x1c7f, 0xb7b5,
    0x3441, 0xb377, 0x2e55, 0xfe00, 0x358f, 0xace7, 0x29bc, 0x3180, 0xfe00, 0x2c79, 0xb749, 0x34ac,
    0xb29e, 0xa048, 0x23ed, 0x35fa, 0xaa74, 0x2c8e, 0x22d4, 0x34b2, 0x2e27, 0xb6dd, 0x3518, 0x2062,
    0x30dd, 0xb3de, 0x3666, 0xa626, 0x1c8e, 0x3256, 0x351e, 0x2fd8, 0xb670, 0xfe00, 0xb0ea, 0x31b2,
    0xb307, 0x36d2, 0x9c32, 0x2feb, 0xae5b, 0x358a, 0x30c4, 0xa08a, 0x35ee, 0xb012, 0x328a, 0xb22e,
    0x22f6, 0x275f, 0x30d1, 0xacae,
];

/// Their `exp_avg_sq`.
const PARAM_F16_EXP_AVG_SQ: [u16; 64] = [
    0x005c, 0x21e2, 0x2842, 0x2489, 0x255a, 0x002a, 0x2238, 0x28d8, 0x205d, 0x2a35, 0x000b, 0x2a52,
    0x2244, 0x280c, 0x24bf, 0xfe00, 0x2786, 0x21df, 0x28f8, 0x2056, 0xfe00, 0x2031, 0x2a07, 0x22ae,
    0x27af, 0x0024, 0x24d1, 0x27eb, 0x218d, 0x2919, 0x0059, 0x2a9b, 0x2059, 0x29c4, 0x2322, 0x0024,
    0x253b, 0x2472, 0x2829, 0x2145, 0x000c, 0x2037, 0x2acf, 0x208a, 0x297f, 0xfe00, 0x26ea, 0x2580,
    0x242d, 0x285f, 0x0009, 0x2962, 0x1ffb, 0x2b09, 0x20c3, 0x0029, 0x2412, 0x2690, 0x25c8, 0x23d6,
    0x005f, 0x20d0, 0x298a, 0x1fdc,
];

/// bf16 parameters after the five SGD steps.
const PARAM_BF16_P: [u16; 64] = [
    0xbf88, 0xbeef, 0x3f50, 0xbf7d, 0x3dcf, 0x3f3a, 0xbf0b, 0x3db0, 0x3f64, 0xbf21, 0x3ebd, 0xbf10,
    0xbed5, 0x3f5e, 0xbf6e, 0x3c2d, 0x3f02, 0xbef7, 0x3e10, 0x3f72, 0xbeb2, 0x3eb7, 0xbf01, 0xbeb7,
    0x3f6e, 0xbf35, 0x3e59, 0x3f10, 0xbedc, 0x3e4a, 0x3f8b, 0xbf04, 0x3ed2, 0xbee9, 0xbe9a, 0x3f3a,
    0xbf50, 0x3eae, 0x3f1d, 0xbec0, 0x3ebd, 0xbf8b, 0xbeec, 0x3eed, 0xbecb, 0x3c21, 0x3f85, 0xbf41,
    0x3ec9, 0x3f2c, 0xbeb2, 0x3e9e, 0xbf69, 0xbece, 0x3f06, 0xbf35, 0xbe42, 0x3f8c, 0xbf34, 0x3ee7,
    0x3f8b, 0xbe86, 0x3eb9, 0xbf5b,
];

/// Their `momentum_buffer`.
const PARAM_BF16_MOMENTUM: [u16; 64] = [
    0xbda9, 0x3ff5, 0xbfe5, 0x3ec4, 0x3e28, 0x3d67, 0xbf46, 0xbc90, 0x3fa8, 0x3ff5, 0x3ce1, 0xc067,
    0x4009, 0xbfc3, 0x3f17, 0x3a9a, 0x402d, 0xbf0b, 0x3e5b, 0x3fc8, 0xbcc2, 0x3ed6, 0xc05a, 0x4016,
    0xbfa5, 0xbd53, 0x3f21, 0x403a, 0xbeaa, 0x3ede, 0x3da9, 0x4019, 0x3f24, 0xc04b, 0x4023, 0x3d58,
    0x3f84, 0xc003, 0x404b, 0xbdc0, 0x3ce6, 0x3fea, 0x4026, 0x3f5c, 0xc03c, 0x3b68, 0xbf5a, 0x3fa2,
    0xbfe6, 0x4058, 0xbcd2, 0x3f60, 0xbf80, 0x4034, 0x3f8d, 0xbd63, 0x4040, 0xbf1a, 0x3fbf, 0xbfcb,
    0x3dac, 0x3eac, 0x3f8c, 0xbf44,
];

#[test]
fn param_state_precision_matches_pytorch_low_precision_training() {
    type Case<'a> = (OptimizerConfig, DType, Vec<(&'a str, &'a [u16])>);
    let cases: [Case<'_>; 2] = [
        (
            OptimizerConfig::Adam(AdamConfig {
                lr: 0.007,
                weight_decay: 0.03,
                amsgrad: true,
                state_precision: StatePrecision::Param,
                ..AdamConfig::default()
            }),
            DType::F16,
            vec![
                ("exp_avg", &PARAM_F16_EXP_AVG[..]),
                ("exp_avg_sq", &PARAM_F16_EXP_AVG_SQ[..]),
            ],
        ),
        (
            OptimizerConfig::Sgd(SgdConfig {
                lr: 0.013,
                momentum: 0.85,
                nesterov: true,
                weight_decay: 0.02,
                state_precision: StatePrecision::Param,
                ..SgdConfig::default()
            }),
            DType::BF16,
            vec![("momentum_buffer", &PARAM_BF16_MOMENTUM[..])],
        ),
    ];
    for (cfg, dtype, state) in cases {
        let decode = if dtype == DType::F16 {
            f16_bits_to_f32
        } else {
            bf16_bits_to_f32
        };
        let mut opt = build_optimizer(&cfg).unwrap();
        let mut p: Vec<f32> = golden_p0(64)
            .into_iter()
            .map(|x| round_to(dtype, x))
            .collect();
        for t in 0..5 {
            let g = param_state_grads(t, dtype);
            opt.step(&mut [ParamSlot {
                name: "w",
                data: &mut p,
                grad: Some(&g),
                dtype,
            }])
            .unwrap();
        }
        let torch_p = if dtype == DType::F16 {
            &PARAM_F16_P
        } else {
            &PARAM_BF16_P
        };
        same_bits(&p, torch_p, decode, &format!("{cfg:?} param"));
        for (key, bits) in state {
            same_bits(
                opt.state_buffer("w", key).unwrap(),
                bits,
                decode,
                &format!("{cfg:?} {key}"),
            );
        }
        if dtype == DType::F16 {
            // fp16 Adam: exp_avg_sq underflows and eps = 1e-8 rounds to 0 in fp16, so three
            // small-gradient parameters became NaN, as in PyTorch.
            assert_eq!(p.iter().filter(|x| !x.is_finite()).count(), 3);
        }
    }
}

#[test]
fn config_rejects_unknown_kind_and_field() {
    assert!(serde_json::from_str::<OptimizerConfig>(r#"{"kind":"rmsprop"}"#).is_err());
    assert!(serde_json::from_str::<OptimizerConfig>(r#"{"kind":"adam","lr_":0.1}"#).is_err());
    assert!(serde_json::from_str::<OptimizerConfig>(r#"{"lr":0.1}"#).is_err());
}

#[test]
fn config_round_trips() {
    for c in [
        OptimizerConfig::Sgd(SgdConfig {
            nesterov: true,
            momentum: 0.9,
            ..SgdConfig::default()
        }),
        OptimizerConfig::Adam(AdamConfig {
            amsgrad: true,
            ..AdamConfig::default()
        }),
        OptimizerConfig::default(),
    ] {
        let s = serde_json::to_string(&c).unwrap();
        assert_eq!(
            serde_json::from_str::<OptimizerConfig>(&s).unwrap(),
            c,
            "{s}"
        );
    }
}

#[test]
fn build_rejects_bad_hyperparameters() {
    let bad = [
        OptimizerConfig::Sgd(SgdConfig {
            lr: -1.0,
            ..SgdConfig::default()
        }),
        OptimizerConfig::Sgd(SgdConfig {
            nesterov: true,
            ..SgdConfig::default()
        }),
        OptimizerConfig::Sgd(SgdConfig {
            nesterov: true,
            momentum: 0.9,
            dampening: 0.1,
            ..SgdConfig::default()
        }),
        OptimizerConfig::Adam(AdamConfig {
            betas: (1.0, 0.999),
            ..AdamConfig::default()
        }),
        OptimizerConfig::Adam(AdamConfig {
            eps: f64::NAN,
            ..AdamConfig::default()
        }),
        OptimizerConfig::AdamW(AdamWConfig {
            weight_decay: -0.1,
            ..AdamWConfig::default()
        }),
    ];
    for c in bad {
        match build_optimizer(&c) {
            Err(Error::Config { context, .. }) => assert!(context.starts_with("optimizer.")),
            Err(e) => panic!("{c:?}: wrong error {e}"),
            Ok(_) => panic!("{c:?} accepted"),
        }
    }
}

#[test]
fn rejects_mismatched_grad_naming_the_parameter() {
    for cfg in [
        OptimizerConfig::Sgd(SgdConfig::default()),
        OptimizerConfig::Adam(AdamConfig::default()),
    ] {
        let mut opt = build_optimizer(&cfg).unwrap();
        let mut a = vec![1.0f32; 3];
        let mut b = vec![1.0f32; 4];
        let ga = [0.5f32; 3];
        let gb = [0.5f32; 3];
        let mut slots = [
            ParamSlot {
                name: "layer.a",
                data: &mut a,
                grad: Some(&ga),
                dtype: DType::F32,
            },
            ParamSlot {
                name: "layer.b",
                data: &mut b,
                grad: Some(&gb),
                dtype: DType::F32,
            },
        ];
        let err = opt.step(&mut slots).unwrap_err().to_string();
        assert!(
            err.contains("layer.b") && err.contains('3') && err.contains('4'),
            "{err}"
        );
        // Validation comes first: the valid parameter was not updated either.
        assert_eq!(a, vec![1.0; 3]);
        assert_eq!(opt.step_count("layer.a"), None);
    }
}

#[test]
fn rejects_duplicate_names_and_integer_params() {
    let mut opt = build_optimizer(&OptimizerConfig::default()).unwrap();
    let mut a = vec![1.0f32; 2];
    let mut b = vec![1.0f32; 2];
    let g = [0.5f32; 2];
    let mut slots = [
        ParamSlot {
            name: "w",
            data: &mut a,
            grad: Some(&g),
            dtype: DType::F32,
        },
        ParamSlot {
            name: "w",
            data: &mut b,
            grad: Some(&g),
            dtype: DType::F32,
        },
    ];
    let err = opt.step(&mut slots).unwrap_err().to_string();
    assert!(err.contains("`w`") && err.contains("twice"), "{err}");

    let mut c = vec![1.0f32; 2];
    let mut slots = [ParamSlot {
        name: "idx",
        data: &mut c,
        grad: Some(&g),
        dtype: DType::I64,
    }];
    let err = opt.step(&mut slots).unwrap_err().to_string();
    assert!(err.contains("idx") && err.contains("int64"), "{err}");
}

#[test]
fn exact_steps_are_the_f32_steps_without_their_rounding() {
    // Five steps of each optimizer variant on the golden inputs: before each, the f64 step
    // from the same state; after it, the f32 step is within f32's rounding of it.
    let cfgs = [
        r#"{"kind":"sgd","lr":0.1}"#,
        r#"{"kind":"sgd","lr":0.1,"momentum":0.9,"dampening":0.1,"weight_decay":0.01}"#,
        r#"{"kind":"sgd","lr":0.1,"momentum":0.9,"nesterov":true,"maximize":true}"#,
        r#"{"kind":"adam","lr":0.01,"weight_decay":0.1}"#,
        r#"{"kind":"adamw","lr":0.01,"amsgrad":true}"#,
        r#"{"kind":"adam","lr":0.01,"maximize":true,"betas":[0.5,0.9]}"#,
    ];
    for text in cfgs {
        let cfg: OptimizerConfig = serde_json::from_str(text).unwrap();
        let mut opt = build_optimizer(&cfg).unwrap();
        let mut p = golden_p0(19);
        for t in 0..5 {
            let g = golden_grad(t, 19);
            let wide = |v: &[f32]| v.iter().map(|&x| f64::from(x)).collect::<Vec<f64>>();
            let exact = opt.exact_step("w", &wide(&p), &wide(&g)).unwrap();
            let before = p.clone();
            step_w(opt.as_mut(), &mut p, &g);
            // The state stays as the f32 step left it: the next exact step starts there.
            for j in 0..19 {
                let (ours, x, p0) = (f64::from(p[j]), exact[j], f64::from(before[j]));
                // f32's rounding of the parameter, of the update and of its parts.
                let bound = 2.0 * f64::from(f32::EPSILON) * (x.abs() + (x - p0).abs() * 8.0);
                assert!(
                    (ours - x).abs() <= bound,
                    "{text} step {t} [{j}]: f32 {ours}, f64 {x}, before {p0}"
                );
            }
        }
        // A state of another length does not fit, nor a gradient of another length.
        let stateful = ["momentum_buffer", "exp_avg"]
            .iter()
            .any(|k| opt.state_buffer("w", k).is_some());
        let other = opt.exact_step("w", &[0.0; 3], &[0.0; 3]);
        assert_eq!(other.is_none(), stateful, "{text}");
        assert!(
            opt.exact_step("w", &[0.0; 3], &[0.0; 2]).is_none(),
            "{text}"
        );
    }
}
