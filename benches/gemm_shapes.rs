//! Speed of the host's matrix products on the shapes of a T5-mini step (fp32, then bf16
//! operands as bf16 autocast gives them; both threads): the attention's batched products (batch 8 × 4 heads: 32 products of 128×64
//! by 64×128, and of 128×128 by 128×64) and the projections' and feed-forward's products, each through the
//! engine as a step calls it. Median of 40 calls, in microseconds and GFLOP/s.
//! Run with `cargo bench --bench gemm_shapes`; `scripts/bench_gemm_torch.py` prints PyTorch's
//! figures for the same shapes.

use amprobe::engine::Engine;
use amprobe::{DType, Tensor};
use std::time::Instant;

fn filled(shape: &[usize], seed: u32, dtype: DType) -> Tensor {
    let n: usize = shape.iter().product();
    let v = (0..n)
        .map(|i| ((i as u32).wrapping_mul(2_654_435_761) ^ seed) as f32 / u32::MAX as f32 - 0.5)
        .collect();
    Tensor::from_f32(v, shape, dtype).expect("tensor")
}

fn main() {
    amprobe::host_memory::keep_freed_memory();
    let mut e = Engine::new();
    println!("{:<32} {:>10} {:>10}", "product", "median us", "GFLOP/s");
    // (label, a's shape, b's shape, batched)
    let shapes: [(&str, &[usize], &[usize], bool); 5] = [
        (
            "bmm 32x 128x64 . 64x128",
            &[32, 128, 64],
            &[32, 64, 128],
            true,
        ),
        (
            "bmm 32x 128x128 . 128x64",
            &[32, 128, 128],
            &[32, 128, 64],
            true,
        ),
        (
            "matmul 1024x256 . 256x256",
            &[1024, 256],
            &[256, 256],
            false,
        ),
        (
            "matmul 1024x256 . 256x1024",
            &[1024, 256],
            &[256, 1024],
            false,
        ),
        (
            "matmul 1024x1024 . 1024x256",
            &[1024, 1024],
            &[1024, 256],
            false,
        ),
    ];
    for (dtype, label, sa, sb, batched) in [DType::F32, DType::BF16]
        .into_iter()
        .flat_map(|d| shapes.map(|(l, a, b, bt)| (d, l, a, b, bt)))
    {
        let (a, b) = (filled(sa, 1, dtype), filled(sb, 2, dtype));
        let label = format!(
            "{} {label}",
            if dtype == DType::BF16 { "bf16" } else { "f32 " }
        );
        let mut t: Vec<f64> = (0..41)
            .map(|_| {
                let t0 = Instant::now();
                let y = if batched {
                    e.bmm(&a, &b)
                } else {
                    e.matmul(&a, &b)
                };
                std::hint::black_box(y.expect("product"));
                t0.elapsed().as_secs_f64()
            })
            .skip(1)
            .collect();
        t.sort_by(f64::total_cmp);
        let med = t[t.len() / 2];
        // 2·m·k·n per product: a's elements times b's column count.
        let flop = 2.0 * sa.iter().product::<usize>() as f64 * sb[sb.len() - 1] as f64;
        println!("{label:<32} {:>10.0} {:>10.1}", med * 1e6, flop / med / 1e9);
    }
}
