//! Speed of the statistics pass every probed output gets (`TensorStats::compute`), in
//! nanoseconds per value, over value distributions like a step's: activations (normal),
//! ReLU outputs (half zeros), uniform values and gradient-like values spread over many
//! binades. One 16K-value chunk stays in cache (one thread); a 4M-value tensor comes from
//! memory, on rayon's threads and on one thread alone.
//! Run with `cargo bench --bench probe_stats`.

use amprobe::dtype::DType;
use amprobe::probe::TensorStats;
use std::time::Instant;

/// Deterministic values: xorshift uniforms shaped by `kind`.
fn values(kind: &str, n: usize) -> Vec<f32> {
    let mut s = 0x9e37_79b9_7f4a_7c15u64;
    let mut u = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        ((s >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    };
    (0..n)
        .map(|_| {
            let normal = (-2.0 * u().ln()).sqrt() * (std::f64::consts::TAU * u()).cos();
            let x = match kind {
                "normal" => normal * 0.02,
                "relu" => (normal * 0.02).max(0.0),
                "uniform" => u() * 3.0 - 1.5,
                // |x| log-uniform over 2^-30..2^0, either sign.
                _ => (u() * 30.0 - 30.0).exp2() * if u() < 0.5 { -1.0 } else { 1.0 },
            };
            x as f32
        })
        .collect()
}

/// Median over `rounds` of the time per value of `reps` calls of `f`.
fn ns_per_value(n: usize, reps: usize, rounds: usize, f: impl Fn() -> TensorStats) -> f64 {
    let mut t: Vec<f64> = (0..rounds)
        .map(|_| {
            let t0 = Instant::now();
            for _ in 0..reps {
                std::hint::black_box(f());
            }
            t0.elapsed().as_secs_f64() * 1e9 / (reps * n) as f64
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

fn main() {
    println!(
        "{:<10} {:>22} {:>22} {:>22}",
        "values", "16K in cache, 1 thread", "4M, rayon's threads", "4M, 1 thread"
    );
    for kind in ["normal", "relu", "uniform", "gradient"] {
        let small = values(kind, 1 << 14);
        let big = values(kind, 1 << 22);
        let a = ns_per_value(small.len(), 2000, 7, || {
            TensorStats::compute(DType::F32, &small)
        });
        let b = ns_per_value(big.len(), 8, 7, || TensorStats::compute(DType::F32, &big));
        let c = ns_per_value(big.len(), 4, 7, || {
            TensorStats::compute_here(DType::F32, &big)
        });
        println!("{kind:<10} {a:>19.3} ns {b:>19.3} ns {c:>19.3} ns");
    }
}
