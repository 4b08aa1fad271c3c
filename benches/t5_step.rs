//! T5-mini training step on the CPU: fp32, emulated fp16 and bf16 autocast, probes on and
//! off. T5EncoderModel with the relu FFN, d_model 256, d_ff 1024, 4 layers, 4 heads,
//! d_kv 64, vocab 512, batch 8, seq 128, the LM objective on the tied embedding, SGD.
//! Run with `cargo bench --bench t5_step`; `scripts/bench_t5_torch.py` measures PyTorch
//! on the same workload, and `scripts/bench-cpu.py` prints both side by side.
//!
//! By default all six configurations step in the same rounds (three times
//! `AMPROBE_BENCH_REPS`, default 5, after one warm-up step each): a probed and an unprobed
//! step back to back, mode after mode, the starting mode moving on each round. The table
//! gives each ratio as the median of the ratios within a round: probes on / off, and each
//! mode's unprobed step against fp32's. Its last column is how many values the probes
//! computed statistics from in the probed step of each mode (the probes' work in a step).
//!
//! `AMPROBE_BENCH_ONLY=fp32:off` (mode fp32|fp16|bf16, probes on|off) runs one
//! configuration alone; with `AMPROBE_BENCH_JSON=1` as well it also prints one JSON line
//! (`{"side":"amprobe","config":"fp32:off",...,"times_ms":[...]}`, with
//! `"values_scanned_per_step"`) for `bench-cpu.py`.
//! `AMPROBE_BENCH_ONLY=rounds` takes `AMPROBE_BENCH_REPS` of the default's rounds and,
//! with `AMPROBE_BENCH_JSON=1`, prints them as one JSON line (`"config":"rounds"`,
//! `"modes"`, and per mode `"probed_ms"` and `"unprobed_ms"`, step times in round order).

use amprobe::amp::mode::Precision;
use amprobe::models::t5::{synthetic_ids, T5Config, T5Encoder};
use amprobe::optim::{OptimizerConfig, SgdConfig};
use amprobe::train::{Synthetic, TrainConfig, Trainer};
use std::time::Instant;

mod pairs;
use pairs::{median, median_ratio, rounds, step_ms};

const MODES: [Precision; 3] = [Precision::Fp32, Precision::Fp16, Precision::Bf16];

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

/// Step times in milliseconds of a mode's probed and unprobed trainer.
type StepTimes = (Vec<f64>, Vec<f64>);

/// The three modes, each probed and unprobed, stepped in the same `rounds` rounds (see
/// `pairs::rounds`), so that both the probe ratio and each mode's time against fp32 are
/// medians of ratios of steps taken seconds apart, not of separate stretches of a busy
/// machine: (probed, unprobed) step times in milliseconds per mode of `MODES`, and how
/// many values the probed step of each mode scanned in its last step.
fn interleaved(n: u64) -> (Vec<StepTimes>, Vec<u64>) {
    let mut trainers: Vec<(Trainer, Trainer)> = MODES
        .iter()
        .map(|&m| (trainer(m, true), trainer(m, false)))
        .collect();
    for (on, off) in &mut trainers {
        on.step(0).expect("warm-up");
        off.step(0).expect("warm-up");
    }
    let mut pairs: Vec<(&mut Trainer, &mut Trainer)> =
        trainers.iter_mut().map(|(on, off)| (on, off)).collect();
    let times = rounds(&mut pairs, n);
    let scanned = trainers
        .iter_mut()
        .map(|(on, _)| on.scanned_values())
        .collect();
    (times, scanned)
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
    // (and not 0), which adds one JSON line with every step's time. AMPROBE_BENCH_ONLY=rounds
    // does the same for the interleaved rounds of all six.
    let json = std::env::var("AMPROBE_BENCH_JSON").is_ok_and(|v| !v.is_empty() && v != "0");
    if std::env::var("AMPROBE_BENCH_ONLY").is_ok_and(|v| v == "rounds") {
        let (times, _) = interleaved(reps);
        let (probed, unprobed): (Vec<_>, Vec<_>) = times.into_iter().unzip();
        let all: Vec<f64> = probed.iter().chain(&unprobed).flatten().copied().collect();
        println!("rounds: {reps} in one process");
        if json {
            let line = serde_json::json!({
                "side": "amprobe",
                "config": "rounds",
                "modes": MODES.iter().map(|m| m.name()).collect::<Vec<_>>(),
                "reps": reps,
                "probed_ms": probed,
                "unprobed_ms": unprobed,
                "times_ms": all,
            });
            println!("{line}");
        }
        return;
    }
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
        let scanned = t.scanned_values();
        if json {
            let line = serde_json::json!({
                "side": "amprobe",
                "config": only,
                "mode": m.name(),
                "probes": probes == "on",
                "reps": reps,
                "warmup_ms": warmup_ms,
                "median_ms": med,
                "times_ms": times,
                "values_scanned_per_step": scanned,
            });
            println!("{line}");
        }
        return;
    }
    let (times, scanned) = interleaved(3 * reps);
    let fp32_off = &times[0].1;
    println!(
        "{:<6} {:>12} {:>12} {:>22} {:>22} {:>16}",
        "mode",
        "probed ms",
        "unprobed ms",
        "probes on/off (pairs)",
        "unprobed / fp32 (pairs)",
        "M values scanned"
    );
    for ((m, (on, off)), n) in MODES.iter().zip(&times).zip(scanned) {
        let (ratio, vs_fp32) = (median_ratio(on, off), median_ratio(off, fp32_off));
        println!(
            "{:<6} {:>12.1} {:>12.1} {:>22.3} {:>22.3} {:>16.1}",
            m.name(),
            median(on.clone()),
            median(off.clone()),
            ratio,
            vs_fp32,
            n as f64 / 1e6
        );
    }
    let fp32_off = median(fp32_off.clone());
    let gflop = 22.0;
    println!(
        "fp32 unprobed: {:.1} GFLOP/s (about {gflop} GFLOP per step)",
        gflop / (fp32_off / 1e3)
    );
}
