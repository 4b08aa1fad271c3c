//! Every device op against the CPU emulator (bounds in `amprobe::backend_choice::parity`).
//! Skips where no GPU is usable; `AMPROBE_REQUIRE_GPU=1` turns the skip into a failure.

#[path = "device_step/common.rs"]
mod common;
use amprobe::backend_choice::parity;
use amprobe::device::cuda::CudaDevice;

/// The device, opened, or None where the test skips (see `common::device_or_skip`).
fn device_or_skip() -> Option<std::sync::Arc<CudaDevice>> {
    common::device_or_skip()
        .then(|| amprobe::backend::open_device(0, false).expect("open device 0"))
}

#[test]
#[ignore = "needs a GPU or the simulated device: scripts/test.sh runs it on the simulated device"]
fn device_ops_match_the_cpu_emulator() {
    let Some(dev) = device_or_skip() else {
        return;
    };
    let checks = parity::run_all(&dev, 7, 4099).expect("parity run");
    let failed: Vec<String> = checks
        .iter()
        .filter(|c| !c.ok())
        .map(|c| {
            format!(
                "{} [{}]: {}/{} outside the bound, max {} ulp; {}",
                c.name,
                c.dtype,
                c.failures,
                c.n,
                c.max_ulp,
                c.first.as_deref().unwrap_or("")
            )
        })
        .collect();
    assert!(checks.len() > 100, "only {} checks ran", checks.len());
    assert!(
        failed.is_empty(),
        "{} checks failed:\n{}",
        failed.len(),
        failed.join("\n")
    );
}

#[test]
#[ignore = "needs a GPU or the simulated device: scripts/test.sh runs it on the simulated device"]
fn opening_a_missing_device_is_an_error_not_a_panic() {
    let Some(_dev) = device_or_skip() else {
        // Without a GPU, opening any device must fail cleanly.
        let err = amprobe::backend::open_device(0, false).expect_err("no GPU here");
        assert!(err.to_string().contains("no usable GPU"), "{err}");
        return;
    };
    let err = amprobe::backend::open_device(999, false).expect_err("no device 999");
    assert!(err.to_string().contains("999"), "{err}");
}

#[test]
fn require_gpu_turns_the_skip_into_a_failure() {
    if amprobe::device::detect().is_available() || amprobe::device::gpu_required() {
        return; // Only meaningful where the GPU tests skip.
    }
    let me = std::env::current_exe().expect("test binary path");
    let o = std::process::Command::new(me)
        .args([
            "device_ops_match_the_cpu_emulator",
            "--exact",
            "--include-ignored",
            "--test-threads=1",
        ])
        .env("AMPROBE_REQUIRE_GPU", "1")
        .output()
        .expect("re-run the test binary");
    assert!(!o.status.success(), "the GPU test passed without a GPU");
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(
        all.contains("AMPROBE_REQUIRE_GPU=1 but no usable GPU"),
        "{all}"
    );
}

#[test]
#[ignore = "needs a GPU or the simulated device: scripts/test.sh runs it on the simulated device"]
fn a_launch_with_the_wrong_argument_count_is_refused_naming_the_kernel() {
    let Some(dev) = device_or_skip() else {
        return;
    };
    dev.check_args("amp_cast", 7)
        .expect("amp_cast takes seven arguments");
    let err = dev.check_args("amp_cast", 6).unwrap_err().to_string();
    assert!(err.contains("amp_cast") && err.contains("takes 7"), "{err}");
    let err = dev.check_args("no_such_kernel", 1).unwrap_err().to_string();
    assert!(err.contains("no_such_kernel"), "{err}");
}

/// The signs of zero gradients follow the emulator's sums bit for bit: a gradient that is
/// one term keeps its -0 (x·x with a zero output gradient and negative x), a per-row sum
/// starts from -0 as Rust's `Sum` does, and a bias-like sum from +0.
#[test]
#[ignore = "needs a GPU or the simulated device: scripts/test.sh runs it on the simulated device"]
fn zero_gradients_carry_the_emulators_signs() {
    use amprobe::dtype::DType;
    use amprobe::engine::Engine;
    use amprobe::tensor::Tensor;
    let Some(dev) = device_or_skip() else {
        return;
    };
    let t = |v: Vec<f32>, s: &[usize]| Tensor::from_f32(v, s, DType::F32).unwrap();
    let bits = |x: &Tensor| -> Vec<u32> {
        x.to_host()
            .unwrap()
            .f32s()
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect()
    };
    // (a, b, output gradient): x·x; a per-row scale [4,1]·[4,3]; a bias-like [3]·[4,3].
    let neg = t(vec![-1.0, -2.0, -0.5, -3.0], &[4]);
    let b43 = t((0..12).map(|i| -1.0 - i as f32).collect(), &[4, 3]);
    let cases = [
        ("x·x", neg.clone(), None, t(vec![0.0; 4], &[4])),
        (
            "per-row",
            t(vec![1.0; 4], &[4, 1]),
            Some(b43.clone()),
            t(vec![0.0; 12], &[4, 3]),
        ),
        (
            "bias",
            t(vec![1.0; 3], &[3]),
            Some(b43.clone()),
            t(vec![0.0; 12], &[4, 3]),
        ),
    ];
    for (what, a, b, g) in cases {
        let grads = |on_device: bool| {
            let put = |x: &Tensor| {
                if on_device {
                    x.to_device(&dev).unwrap()
                } else {
                    x.clone()
                }
            };
            let mut eng = Engine::new();
            let al = put(&a).as_leaf(true);
            let bl = b.as_ref().map(|b| put(b).as_leaf(true));
            let y = eng.mul(&al, bl.as_ref().unwrap_or(&al)).unwrap();
            let gr = eng.backward_with(&y, put(&g)).unwrap();
            bits(&gr[&al.id()])
        };
        assert_eq!(grads(false), grads(true), "{what}");
    }
}

/// A 16-bit product that nothing counts is rounded by cuBLAS as it writes it; one whose
/// rounding is counted goes through an f32 output and the counting cast. Both must hold
/// the same bits. The operands are small integers times a power of two per row of a and
/// per column of b, so every partial sum is exact in f32 (and a normal number) and any
/// order of accumulation, cuBLAS's on hardware included, gives the same f32 result; the
/// scales put fp16 results past its largest finite value, below its smallest subnormal,
/// among its subnormals and on rounding ties, and bf16 results on ties up to 2^127.
#[test]
#[ignore = "needs a GPU or the simulated device: scripts/test.sh runs it on the simulated device"]
fn a_16_bit_product_rounded_by_cublas_equals_the_counted_cast() {
    use amprobe::dtype::DType;
    use amprobe::ops::cuda::Out;
    use amprobe::ops::linalg::cuda::matmul;
    use amprobe::tensor::Tensor;
    let Some(dev) = device_or_skip() else {
        return;
    };
    let (m, k, n) = (24usize, 128usize, 40usize);
    let mut rng = amprobe::rng::Rng::new(11);
    let mut int = |r: u64| rng.below(2 * r + 1) as f32 - r as f32;
    // Integer sums reach 128·64·32 = 2^18 (exact in f32) and are typically some thousands:
    // past fp16's 11 significant bits and bf16's 8, so results round, many on ties.
    let cases: [(DType, &[i32], &[i32]); 2] = [
        (
            DType::F16,
            &[-24, -20, -14, -8, 0, 2, 4, 5],
            &[-24, -16, 0, 2, 4],
        ),
        (DType::BF16, &[-60, -20, 0, 20, 50, 56], &[-60, 0, 30, 53]),
    ];
    for (dt, sa, sb) in cases {
        let a: Vec<f32> = (0..m * k)
            .map(|i| int(64) * 2f32.powi(sa[(i / k) % sa.len()]))
            .collect();
        let b: Vec<f32> = (0..k * n)
            .map(|i| int(32) * 2f32.powi(sb[(i % n) % sb.len()]))
            .collect();
        let exact = |v: &[f32], t: &Tensor| {
            let got = t.f32s().unwrap();
            assert!(
                v.iter().zip(got).all(|(x, y)| x == y),
                "{dt}: operands not exact"
            );
        };
        let (ah, bh) = (
            Tensor::from_f32(a.clone(), &[m, k], dt).unwrap(),
            Tensor::from_f32(b.clone(), &[k, n], dt).unwrap(),
        );
        exact(&a, &ah);
        exact(&b, &bh);
        let (ad, bd) = (ah.to_device(&dev).unwrap(), bh.to_device(&dev).unwrap());
        dev.with_arena(|a| a.reset(&dev)).unwrap();
        let (slot, counts) = dev.counts_slot().unwrap();
        let counted = matmul(&ad, &bd, false, false, Out::new(slot, counts)).unwrap();
        let direct = matmul(&ad, &bd, false, false, Out::NONE).unwrap();
        let rounding = dev.with_arena(|a| a.read(&dev)).unwrap()[slot as usize].rounding;
        let bits = |t: &Tensor| -> Vec<u32> {
            let h = t.to_host().unwrap();
            assert_eq!(h.dtype(), dt);
            h.f32s().unwrap().iter().map(|v| v.to_bits()).collect()
        };
        let (c, d) = (bits(&counted), bits(&direct));
        // The exact sums (exact in f32 too), rounded once to nearest even on the host.
        let sums: Vec<f32> = (0..m * n)
            .map(|t| {
                let (i, j) = (t / n, t % n);
                (0..k)
                    .map(|p| f64::from(a[i * k + p]) * f64::from(b[p * n + j]))
                    .sum::<f64>() as f32
            })
            .collect();
        let host = Tensor::from_f32(sums, &[m, n], dt).unwrap();
        let want: Vec<u32> = host.f32s().unwrap().iter().map(|v| v.to_bits()).collect();
        let wrong = c.iter().zip(&want).filter(|(x, y)| x != y).count();
        assert_eq!(
            wrong, 0,
            "{dt}: {wrong} counted results differ from the host's rounding"
        );
        let differ = c.iter().zip(&d).filter(|(x, y)| x != y).count();
        assert_eq!(differ, 0, "{dt}: {differ} of {} values differ", c.len());
        if dt == DType::F16 {
            assert!(
                rounding.overflow > 0 && rounding.underflow > 0,
                "the operands must overflow and underflow fp16 somewhere, got {rounding:?}"
            );
            assert!(c
                .iter()
                .any(|&x| x != 0 && f32::from_bits(x).abs() < 6.2e-5));
        }
    }
}

/// A check-only step lets cuBLAS round 16-bit products as it writes them, and its re-run
/// with full statistics (when it keeps its records after all) rounds the f32 product by
/// the counting cast: the two must give the same bits for the re-run to describe the step.
/// With operands of general values (not the integers above, whose sums every order gives
/// exactly), only the same accumulation in both of cuBLAS's output types does that. On a
/// GPU the shapes are T5-base's products (batch 8 × seq 512 by d_model 768 and d_ff 3072,
/// and the attention's 96 batched 512 × 64 × 512), where cuBLAS's heuristics pick what the
/// step gets; on the simulated device, small ones.
#[test]
#[ignore = "needs a GPU or the simulated device: scripts/test.sh runs it on the simulated device"]
fn cublas_16_bit_products_equal_the_f32_product_rounded_on_general_values() {
    use amprobe::dtype::DType;
    use amprobe::ops::cuda::Out;
    use amprobe::ops::linalg::cuda::matmul;
    use amprobe::tensor::Tensor;
    let Some(dev) = device_or_skip() else {
        return;
    };
    let simulated = match amprobe::device::detect::detect() {
        amprobe::device::detect::Detection::Available(info) => {
            info.devices.first().is_some_and(|d| d.simulated)
        }
        _ => true,
    };
    // (batch, m, k, n, b transposed)
    let shapes: &[(usize, usize, usize, usize, bool)] = if simulated {
        &[(1, 64, 96, 48, true), (3, 32, 16, 40, false)]
    } else {
        &[
            (1, 4096, 768, 768, true),
            (1, 4096, 768, 3072, true),
            (1, 4096, 3072, 768, true),
            (96, 512, 64, 512, true),
            (96, 512, 512, 64, false),
        ]
    };
    let mut rng = amprobe::rng::Rng::new(5);
    for dt in [DType::F16, DType::BF16] {
        for &(batch, m, k, n, tb) in shapes {
            let mut values =
                |len: usize| -> Vec<f32> { (0..len).map(|_| rng.normal() as f32 * 0.5).collect() };
            let a_shape: Vec<usize> = if batch > 1 {
                vec![batch, m, k]
            } else {
                vec![m, k]
            };
            let b_dims = if tb { [n, k] } else { [k, n] };
            let b_shape: Vec<usize> = if batch > 1 {
                vec![batch, b_dims[0], b_dims[1]]
            } else {
                b_dims.to_vec()
            };
            let a = Tensor::from_f32(values(batch * m * k), &a_shape, dt).unwrap();
            let b = Tensor::from_f32(values(batch * k * n), &b_shape, dt).unwrap();
            let (ad, bd) = (a.to_device(&dev).unwrap(), b.to_device(&dev).unwrap());
            dev.with_arena(|a| a.reset(&dev)).unwrap();
            let (slot, counts) = dev.counts_slot().unwrap();
            let counted = matmul(&ad, &bd, false, tb, Out::new(slot, counts)).unwrap();
            let direct = matmul(&ad, &bd, false, tb, Out::NONE).unwrap();
            let bits = |t: &Tensor| -> Vec<u32> {
                let h = t.to_host().unwrap();
                h.f32s().unwrap().iter().map(|v| v.to_bits()).collect()
            };
            let (c, d) = (bits(&counted), bits(&direct));
            let differ = c.iter().zip(&d).filter(|(x, y)| x != y).count();
            assert_eq!(
                differ,
                0,
                "{dt} {batch}×{m}×{k}×{n}: {differ} of {} values differ",
                c.len()
            );
        }
    }
}
