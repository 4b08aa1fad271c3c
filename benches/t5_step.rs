//! T5-mini training step on the CPU: fp32, emulated fp16 and bf16 autocast, probes on and
//! off. T5EncoderModel with the relu FFN, d_model 256, d_ff 1024, 4 layers, 4 heads,
//! d_kv 64, vocab 512, batch 8, seq 128, the LM objective on the tied embedding, SGD.
//! Run with `cargo bench --bench t5_step`; `scripts/bench_t5_torch.py` measures PyTorch
//! on the same workload, and `scripts/bench-cpu.py` prints both side by side.
//!
//! The probed trainers keep op records for a step with a non-finite value only (the
//! steps here are all finite), so a probed step checks its forward and backward outputs
//! for non-finite values and computes full statistics of its optimizer-phase ones; a
//! third trainer per mode ("kept") computes the full statistics of every op in every
//! step, which is what a step whose records are kept costs
//! (`Trainer::set_full_statistics`).
//!
//! By default all nine configurations step in the same rounds (three times
//! `AMPROBE_BENCH_REPS`, default 5, after one warm-up step each): a probed, a kept and an
//! unprobed step back to back, mode after mode, which goes first and the starting mode
//! moving on each round. The table gives each ratio as the median of the ratios within a
//! round: probed / unprobed, kept / unprobed, and each mode's unprobed step against
//! fp32's. Its last columns are how many values the probed step of each mode only
//! checked, and how many the probed and the kept step computed statistics from (the
//! probes' work in a step).
//!
//! `AMPROBE_BENCH_ONLY=fp32:off` (mode fp32|fp16|bf16, probes on|off|kept) runs one
//! configuration alone; with `AMPROBE_BENCH_JSON=1` as well it also prints one JSON line
//! (`{"side":"amprobe","config":"fp32:off",...,"times_ms":[...]}`, with
//! `"values_scanned_per_step"` and `"values_checked_per_step"`) for `bench-cpu.py`.
//! `AMPROBE_BENCH_ONLY=rounds` takes `AMPROBE_BENCH_REPS` of the default's rounds and,
//! with `AMPROBE_BENCH_JSON=1`, prints them as one JSON line (`"config":"rounds"`,
//! `"modes"`, and per mode `"probed_ms"`, `"kept_ms"` and `"unprobed_ms"`, step times in
//! round order).

use amprobe::amp::mode::Precision;
use amprobe::models::pretrained::Pretrained;
use amprobe::models::t5::{synthetic_ids, T5Config, T5Encoder};
use amprobe::optim::{OptimizerConfig, SgdConfig};
use amprobe::train::{Synthetic, TrainConfig, Trainer};
use std::time::Instant;

mod pairs;
use pairs::{median, median_ratio, rounds, step_ms};

const MODES: [Precision; 3] = [Precision::Fp32, Precision::Fp16, Precision::Bf16];

/// What a bench trainer probes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Probes {
    /// Nothing.
    Off,
    /// Every op, op records kept for a non-finite value only.
    On,
    /// Every op, with the full statistics of a step whose records are kept, every step.
    Kept,
}

impl Probes {
    fn parse(s: &str) -> Option<Probes> {
        match s {
            "off" => Some(Probes::Off),
            "on" => Some(Probes::On),
            "kept" => Some(Probes::Kept),
            _ => None,
        }
    }
}

fn trainer(precision: Precision, probes: Probes) -> Trainer {
    let cfg = T5Config::relu(256, 1024, (4, 64), 4, 512);
    let model = T5Encoder::new(cfg);
    let params = model.seeded(0).expect("init");
    let train = TrainConfig {
        precision,
        probes: probes != Probes::Off,
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
    let mut t = Trainer::new(train, Box::new(model), params, Box::new(data)).expect("trainer");
    t.set_full_statistics(probes == Probes::Kept);
    t
}

/// Wall time of each of `reps` steps, in milliseconds, in step order.
fn step_times_ms(t: &mut Trainer, start: u64, reps: u64) -> Vec<f64> {
    (0..reps).map(|s| step_ms(t, start + s)).collect()
}

/// Step times in milliseconds of a mode's probed, kept and unprobed trainer.
struct ModeTimes {
    on: Vec<f64>,
    kept: Vec<f64>,
    off: Vec<f64>,
    /// Values the probed trainer's last step only checked, and computed statistics from.
    on_values: (u64, u64),
    /// Values the kept trainer's last step computed statistics from.
    kept_scanned: u64,
}

/// The three modes, each probed, kept and unprobed, stepped in the same `rounds` rounds
/// (see `pairs::rounds`), so that every ratio is a median of ratios of steps taken
/// seconds apart, not of separate stretches of a busy machine.
fn interleaved(n: u64) -> Vec<ModeTimes> {
    let kinds = [Probes::On, Probes::Kept, Probes::Off];
    let mut trainers: Vec<Vec<Trainer>> = MODES
        .iter()
        .map(|&m| kinds.iter().map(|&p| trainer(m, p)).collect())
        .collect();
    for t in trainers.iter_mut().flatten() {
        t.step(0).expect("warm-up");
    }
    let mut groups: Vec<Vec<&mut Trainer>> = trainers
        .iter_mut()
        .map(|g| g.iter_mut().collect())
        .collect();
    let times = rounds(&mut groups, n);
    times
        .into_iter()
        .zip(&mut trainers)
        .map(|(mut t, g)| ModeTimes {
            off: t.pop().unwrap_or_default(),
            kept: t.pop().unwrap_or_default(),
            on: t.pop().unwrap_or_default(),
            on_values: (g[0].checked_values(), g[0].scanned_values()),
            kept_scanned: g[1].scanned_values(),
        })
        .collect()
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
        let times = interleaved(reps);
        println!("rounds: {reps} in one process");
        if json {
            let all: Vec<f64> = times
                .iter()
                .flat_map(|t| t.on.iter().chain(&t.kept).chain(&t.off))
                .copied()
                .collect();
            let line = serde_json::json!({
                "side": "amprobe",
                "config": "rounds",
                "modes": MODES.iter().map(|m| m.name()).collect::<Vec<_>>(),
                "reps": reps,
                "probed_ms": times.iter().map(|t| &t.on).collect::<Vec<_>>(),
                "kept_ms": times.iter().map(|t| &t.kept).collect::<Vec<_>>(),
                "unprobed_ms": times.iter().map(|t| &t.off).collect::<Vec<_>>(),
                "times_ms": all,
            });
            println!("{line}");
        }
        return;
    }
    if let Ok(only) = std::env::var("AMPROBE_BENCH_ONLY") {
        let (mode, probes) = only.split_once(':').unwrap_or((&only, "off"));
        let m = Precision::parse(mode).expect("AMPROBE_BENCH_ONLY: a precision mode");
        let p = Probes::parse(probes).expect("AMPROBE_BENCH_ONLY: probes on, off or kept");
        let mut t = trainer(m, p);
        let t0 = Instant::now();
        t.step(0).expect("warm-up");
        let warmup_ms = t0.elapsed().as_secs_f64() * 1e3;
        let times = step_times_ms(&mut t, 1, reps);
        let med = median(times.clone());
        println!("{only}: {med:.1} ms");
        if json {
            let line = serde_json::json!({
                "side": "amprobe",
                "config": only,
                "mode": m.name(),
                "probes": p != Probes::Off,
                "full_statistics": p == Probes::Kept,
                "reps": reps,
                "warmup_ms": warmup_ms,
                "median_ms": med,
                "times_ms": times,
                "values_scanned_per_step": t.scanned_values(),
                "values_checked_per_step": t.checked_values(),
            });
            println!("{line}");
        }
        return;
    }
    let times = interleaved(3 * reps);
    let fp32_off = times[0].off.clone();
    println!(
        "{:<6} {:>10} {:>10} {:>12} {:>10} {:>10} {:>14} {:>10} {:>12} {:>12}",
        "mode",
        "probed ms",
        "kept ms",
        "unprobed ms",
        "probed/off",
        "kept/off",
        "unprobed/fp32",
        "M checked",
        "M stats (on)",
        "M stats (kept)"
    );
    for (m, t) in MODES.iter().zip(&times) {
        println!(
            "{:<6} {:>10.1} {:>10.1} {:>12.1} {:>10.3} {:>10.3} {:>14.3} {:>10.1} {:>12.1} {:>12.1}",
            m.name(),
            median(t.on.clone()),
            median(t.kept.clone()),
            median(t.off.clone()),
            median_ratio(&t.on, &t.off),
            median_ratio(&t.kept, &t.off),
            median_ratio(&t.off, &fp32_off),
            t.on_values.0 as f64 / 1e6,
            t.on_values.1 as f64 / 1e6,
            t.kept_scanned as f64 / 1e6
        );
    }
    println!("(ratios: medians of the ratios of steps in the same round)");
    let fp32_off = median(fp32_off);
    let gflop = 22.0;
    println!(
        "fp32 unprobed: {:.1} GFLOP/s (about {gflop} GFLOP per step)",
        gflop / (fp32_off / 1e3)
    );
}
