//! T5-mini training step on the CPU: fp32, emulated fp16 and bf16 autocast, probes on and
//! off. T5EncoderModel with the relu FFN, d_model 256, d_ff 1024, 4 layers, 4 heads,
//! d_kv 64, vocab 512, batch 8, seq 128, the LM objective on the tied embedding, SGD.
//! Run with `cargo bench --bench t5_step`; `scripts/bench_t5_torch.py` measures PyTorch
//! on the same workload, and `scripts/bench-cpu.py` prints both side by side.
//!
//! `AMPROBE_BENCH_ONLY=fp32:off` (mode fp32|fp16|bf16, probes on|off) runs one
//! configuration alone; with `AMPROBE_BENCH_JSON=1` as well it also prints one JSON line
//! (`{"side":"amprobe","config":"fp32:off",...,"times_ms":[...]}`) for `bench-cpu.py`.

use amprobe::amp::mode::Precision;
use amprobe::models::t5::{synthetic_ids, T5Config, T5Encoder};
use amprobe::optim::{OptimizerConfig, SgdConfig};
use amprobe::train::{Synthetic, TrainConfig, Trainer};
use std::time::Instant;

mod pairs;
use pairs::{median, paired_ms, step_ms};

fn trainer(precision: Precision, probes: bool) -> Trainer {
    let cfg = T5Config::relu(256, 1024, (4, 64), 4, 512);
    let model = T5Encoder::new(cfg);
    let params = model.init(0).expect("init");
    let train = TrainConfig {
        precision,
        probes,
        optimizer: OptimizerConfig::Sgd(SgdConfig {
            lr: 0.01,
            ..SgdConfig::default()
        }),
        sampling: amprobe::train::OpSampling {
            every: 0,
            first: false,
            nonfinite: true,
        },
        ..TrainConfig::default()
    };
    let data = Synthetic(|step, micro| synthetic_ids(512, 8, 128, 0, step * 1024 + micro as u64));
    Trainer::new(train, Box::new(model), params, Box::new(data)).expect("trainer")
}

/// Wall time of each of `reps` steps, in milliseconds, in step order.
fn step_times_ms(t: &mut Trainer, start: u64, reps: u64) -> Vec<f64> {
    (0..reps).map(|s| step_ms(t, start + s)).collect()
}

fn main() {
    amprobe::host_memory::keep_freed_memory();
    let reps = std::env::var("AMPROBE_BENCH_REPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5)
        .max(1);
    // AMPROBE_BENCH_ONLY=fp32:off (or fp16:on, ...) runs one configuration alone, for a
    // profiler; it prints its median and nothing else, unless AMPROBE_BENCH_JSON is set
    // (and not 0), which adds one JSON line with every step's time.
    if let Ok(only) = std::env::var("AMPROBE_BENCH_ONLY") {
        let (mode, probes) = only.split_once(':').unwrap_or((&only, "off"));
        let m = Precision::parse(mode).expect("AMPROBE_BENCH_ONLY: a precision mode");
        let mut t = trainer(m, probes == "on");
        let t0 = Instant::now();
        t.step(0).expect("warm-up");
        let warmup_ms = t0.elapsed().as_secs_f64() * 1e3;
        let times = step_times_ms(&mut t, 1, reps);
        let med = median(times.clone());
        println!("{only}: {med:.1} ms");
        if std::env::var("AMPROBE_BENCH_JSON").is_ok_and(|v| !v.is_empty() && v != "0") {
            let line = serde_json::json!({
                "side": "amprobe",
                "config": only,
                "mode": m.name(),
                "probes": probes == "on",
                "reps": reps,
                "warmup_ms": warmup_ms,
                "median_ms": med,
                "times_ms": times,
            });
            println!("{line}");
        }
        return;
    }
    let modes = [Precision::Fp32, Precision::Fp16, Precision::Bf16];
    let mut rows = Vec::new();
    for &m in &modes {
        let mut on = trainer(m, true);
        let mut off = trainer(m, false);
        on.step(0).expect("warm-up");
        off.step(0).expect("warm-up");
        let (probed, unprobed, ratio) = paired_ms(&mut on, &mut off, 3 * reps);
        rows.push((m, probed, unprobed, ratio));
    }
    let fp32_off = rows[0].2;
    println!(
        "{:<6} {:>12} {:>12} {:>22} {:>16}",
        "mode", "probed ms", "unprobed ms", "probes on/off (pairs)", "unprobed / fp32"
    );
    for (m, on, off, ratio) in &rows {
        println!(
            "{:<6} {:>12.1} {:>12.1} {:>22.3} {:>16.3}",
            m.name(),
            on,
            off,
            ratio,
            off / fp32_off
        );
    }
    let gflop = 22.0;
    println!(
        "fp32 unprobed: {:.1} GFLOP/s (about {gflop} GFLOP per step)",
        gflop / (fp32_off / 1e3)
    );
}
