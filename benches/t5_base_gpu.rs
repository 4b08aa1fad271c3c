//! amprobe's side of the GPU benchmark: the time of one training step of a T5-base-size
//! encoder on the CUDA device, probes on and off, in fp16, bf16 and fp32; with PyTorch's
//! figures from `scripts/bench_t5_gpu_torch.py --json` (`--torch FILE`) it prints the
//! ratios that say what amprobe costs:
//!
//! - (a) amprobe, probes off / PyTorch eager AMP: the price of the emulator-exact kernels;
//! - (b) amprobe, probes on / probes off: the price of the probes;
//! - (c) amprobe, probes on / PyTorch eager AMP: what a user pays to look;
//! - (d) amprobe, probes on / PyTorch under `detect_anomaly`: against today's way to look;
//! - (e) amprobe, probes on with full statistics in every step / probes off.
//!
//! "Probes on" is the default sampling, as a user runs it: the first step's op records are
//! kept, later steps only count their forward and backward outputs' non-finite values
//! (and would keep completed records for one); "full" keeps every step's records with full
//! statistics (as `--sample-every 1`).
//!
//! The workload is the PyTorch script's: T5EncoderModel with the relu FFN, d_model 768,
//! 12 layers, d_ff 3072, 12 heads, d_kv 64, vocab 32128, batch 8, seq 512, the LM objective
//! on the tied embedding, SGD(lr=0.01) and the default GradScaler in every mode (as the
//! script runs them). A step ends with amprobe's one device-to-host read, which waits
//! for the device, so the wall time of `Trainer::step` is the step's time, host work
//! included. After `--warmup` untimed steps, `--steps` steps are timed; the table gives the
//! median and the minimum.
//!
//! On the simulated device (`crates/cudasim`) it runs only with `--allow-simulated` (to check
//! the bench itself, at small sizes) and says that its figures are not hardware figures.
//!
//! ```text
//! cargo bench --bench t5_base_gpu -- [--model t5|llama] [--layers N] [--batch N] [--seq N] [--vocab N]
//!     [--warmup N] [--steps N] [--modes fp16,bf16,fp32] [--probes off,on,full] [--json FILE]
//!     [--torch FILE] [--allow-simulated]
//! ```
//!
//! `--model llama` times a LLaMA of about 1B parameters instead (hidden 2048, 16 layers,
//! intermediate 8192, 32 query and 8 key-value heads of 64, vocabulary 32000 tied, random
//! weights as transformers initialises them; batch 1, seq 2048, bf16, probes off and on by
//! default), to pair with `scripts/bench_t5_gpu_torch.py --model llama`.
//!
//! `--probes off` (or `on`, `full`) times one of them alone, for a profiler
//! (scripts/gpu-profile.sh).

mod common;
#[path = "common/llama.rs"]
mod llama;

use amprobe::amp::mode::Precision;
use amprobe::device::{detect, Detection};
use amprobe::train::Trainer;
use std::time::Instant;

/// The bench's settings (PyTorch script's defaults).
#[derive(Debug, Clone)]
struct Args {
    model: Model,
    layers: usize,
    batch: usize,
    seq: usize,
    vocab: usize,
    warmup: u64,
    steps: u64,
    modes: Vec<String>,
    probes: Vec<Probes>,
    json: Option<String>,
    torch: Option<String>,
    allow_simulated: bool,
}

/// The workload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Model {
    /// The T5-base-width encoder (the default).
    T5,
    /// The LLaMA of about 1B parameters (`llama::llama_1b_trainer`).
    Llama,
}

fn parse_args() -> Result<Args, String> {
    // `--model` picks the defaults of the sizes and modes; flags given set them anyway.
    let model = match std::env::args()
        .skip_while(|a| a != "--model")
        .nth(1)
        .as_deref()
    {
        None | Some("t5") => Model::T5,
        Some("llama") => Model::Llama,
        Some(other) => return Err(format!("--model: {other:?} is not t5 or llama")),
    };
    let mut a = match model {
        Model::T5 => Args {
            model,
            layers: 12,
            batch: 8,
            seq: 512,
            vocab: 32128,
            warmup: 3,
            steps: 10,
            modes: vec!["fp16".into(), "bf16".into(), "fp32".into()],
            probes: vec![Probes::Off, Probes::On, Probes::Full],
            json: None,
            torch: None,
            allow_simulated: false,
        },
        Model::Llama => Args {
            model,
            layers: 16,
            batch: 1,
            seq: 2048,
            vocab: 32000,
            warmup: 2,
            steps: 5,
            modes: vec!["bf16".into()],
            probes: vec![Probes::Off, Probes::On],
            json: None,
            torch: None,
            allow_simulated: false,
        },
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = |name: &str| it.next().ok_or(format!("{name} needs a value"));
        let num = |name: &str, v: String| -> Result<usize, String> {
            v.parse()
                .ok()
                .filter(|&n: &usize| n > 0)
                .ok_or(format!("{name} expects a positive integer, got {v:?}"))
        };
        match flag.as_str() {
            "--model" => {
                value("--model")?;
            }
            "--layers" => a.layers = num("--layers", value("--layers")?)?,
            "--batch" => a.batch = num("--batch", value("--batch")?)?,
            "--seq" => a.seq = num("--seq", value("--seq")?)?,
            "--vocab" => a.vocab = num("--vocab", value("--vocab")?)?,
            "--warmup" => a.warmup = num("--warmup", value("--warmup")?)? as u64,
            "--steps" => a.steps = num("--steps", value("--steps")?)? as u64,
            "--modes" => {
                a.modes = value("--modes")?
                    .split(',')
                    .map(|m| m.trim().to_string())
                    .collect();
                if let Some(m) = a
                    .modes
                    .iter()
                    .find(|m| !["fp16", "bf16", "fp32"].contains(&m.as_str()))
                {
                    return Err(format!("--modes: {m:?} is not fp16, bf16 or fp32"));
                }
            }
            "--probes" => {
                a.probes = value("--probes")?
                    .split(',')
                    .map(|p| match p.trim() {
                        "off" => Ok(Probes::Off),
                        "on" => Ok(Probes::On),
                        "full" => Ok(Probes::Full),
                        other => Err(format!("--probes: {other:?} is not off, on or full")),
                    })
                    .collect::<Result<_, _>>()?;
            }
            "--json" => a.json = Some(value("--json")?),
            "--torch" => a.torch = Some(value("--torch")?),
            "--allow-simulated" => a.allow_simulated = true,
            // cargo bench passes --bench to every bench binary.
            "--bench" => {}
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(a)
}

/// How a timed trainer probes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Probes {
    /// No probes.
    Off,
    /// The default sampling: records of the first step, checks only after it.
    On,
    /// Full statistics and kept records in every step.
    Full,
}

impl Probes {
    fn label(self) -> &'static str {
        match self {
            Probes::Off => "off",
            Probes::On => "on",
            Probes::Full => "full",
        }
    }
}

fn trainer(a: &Args, mode: &str, probes: Probes) -> amprobe::Result<Trainer> {
    let size = common::Size {
        layers: a.layers,
        batch: a.batch,
        seq: a.seq,
        vocab: a.vocab,
    };
    let (precision, on) = (Precision::parse(mode)?, probes != Probes::Off);
    let mut t = match a.model {
        Model::T5 => common::t5_base_trainer(precision, on, size)?,
        Model::Llama => llama::llama_1b_trainer(precision, on, size)?,
    };
    t.set_full_statistics(probes == Probes::Full);
    Ok(t)
}

/// Median and minimum step time (ms) of one mode with probes on or off.
struct Timed {
    mode: String,
    probes: Probes,
    median_ms: f64,
    min_ms: f64,
    skipped: usize,
    /// Device memory held at the end (the peak): tensors, live or cached, and the arena.
    peak_mib: f64,
    /// The most the tensors held live at once, plus the arena.
    live_mib: f64,
}

fn time_steps(a: &Args, mode: &str, probes: Probes) -> amprobe::Result<Timed> {
    // The last trainer's cached buffers go back to the device, so that what this one holds
    // is counted from zero.
    amprobe::device::cuda::buffer::pool::trim();
    amprobe::device::cuda::buffer::reset_peak_live();
    let mut t = trainer(a, mode, probes)?;
    for s in 0..a.warmup {
        t.step(s)?;
    }
    let mut ms = Vec::new();
    let mut skipped = 0;
    for s in a.warmup..a.warmup + a.steps {
        let t0 = Instant::now();
        let rec = t.step(s)?;
        ms.push(t0.elapsed().as_secs_f64() * 1e3);
        skipped += rec.skipped as usize;
    }
    ms.sort_by(f64::total_cmp);
    let dev = t.params().params[0].value.cuda("bench")?.dev.clone();
    let arena = dev.with_arena(|a| Ok(a.bytes()))?;
    let held = amprobe::device::cuda::buffer::held_bytes() + arena;
    let live = amprobe::device::cuda::buffer::peak_live_bytes() + arena;
    Ok(Timed {
        mode: mode.to_string(),
        probes,
        median_ms: ms[ms.len() / 2],
        min_ms: ms[0],
        skipped,
        peak_mib: held as f64 / (1u64 << 20) as f64,
        live_mib: live as f64 / (1u64 << 20) as f64,
    })
}

/// A number of PyTorch's row for `mode` and `variant` in the script's JSON (`median_ms`,
/// `peak_mem_mib`).
fn torch_figure(torch: &serde_json::Value, mode: &str, variant: &str, field: &str) -> Option<f64> {
    torch["steps"].as_array()?.iter().find_map(|s| {
        (s["mode"] == mode && s["variant"] == variant)
            .then(|| s[field].as_f64())
            .flatten()
    })
}

fn main() {
    let a = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    };
    let info = match detect() {
        Detection::Available(i) => i,
        Detection::Unavailable { reason } => {
            eprintln!("skipped: no CUDA device ({reason}); this bench times a real GPU");
            return;
        }
    };
    let Some(dev) = info.devices.first() else {
        eprintln!("skipped: the driver lists no device");
        return;
    };
    if dev.simulated && !a.allow_simulated {
        eprintln!(
            "skipped: {} is the simulated device, whose times are not GPU times \
             (--allow-simulated runs it anyway, to check the bench)",
            dev.name
        );
        return;
    }
    let torch: Option<serde_json::Value> = match &a.torch {
        None => None,
        Some(path) => match std::fs::read_to_string(path)
            .map_err(|e| e.to_string())
            .and_then(|s| serde_json::from_str(&s).map_err(|e| e.to_string()))
        {
            Ok(v) => Some(v),
            Err(e) => {
                eprintln!("error: --torch {path}: {e}");
                std::process::exit(2);
            }
        },
    };
    let workload = match a.model {
        Model::T5 => format!(
            "T5 encoder d_model 768, {} layers, d_ff 3072, 12 heads, vocab {}",
            a.layers, a.vocab
        ),
        Model::Llama => format!(
            "LLaMA hidden 2048, {} layers, intermediate 8192, 32 heads (8 key-value), vocab {} \
             (tied), {:.2}B parameters",
            a.layers,
            a.vocab,
            llama::llama_1b_config(a.layers, a.seq, a.vocab)
                .ok()
                .and_then(|c| c.param_count())
                .unwrap_or(0) as f64
                / 1e9
        ),
    };
    println!(
        "device {}{}; {workload}; batch {}, seq {}; {} warm-up + {} timed steps",
        dev.name,
        if dev.simulated {
            " — SIMULATED: these are not hardware figures"
        } else {
            ""
        },
        a.batch,
        a.seq,
        a.warmup,
        a.steps
    );
    println!();
    println!(
        "{:<6} {:<7} {:>11} {:>11} {:>10} {:>10}  note",
        "mode", "probes", "median ms", "min ms", "peak MiB", "live MiB"
    );
    let mut rows = Vec::new();
    for mode in &a.modes {
        for &probes in &a.probes {
            match time_steps(&a, mode, probes) {
                Ok(r) => {
                    println!(
                        "{:<6} {:<7} {:>11.2} {:>11.2} {:>10.0} {:>10.0}  {}",
                        r.mode,
                        probes.label(),
                        r.median_ms,
                        r.min_ms,
                        r.peak_mib,
                        r.live_mib,
                        if r.skipped > 0 {
                            format!("{} skipped", r.skipped)
                        } else {
                            String::new()
                        }
                    );
                    rows.push(r);
                }
                Err(e) => {
                    eprintln!("error: {mode}, probes {}: {e}", probes.label());
                    std::process::exit(1);
                }
            }
        }
    }
    let of = |mode: &str, probes: Probes| {
        rows.iter()
            .find(|r| r.mode == mode && r.probes == probes)
            .map(|r| r.median_ms)
    };
    let mut ratios = Vec::new();
    println!();
    println!(
        "{:<6} {:>22} {:>16} {:>22} {:>24} {:>16}",
        "mode",
        "(a) off/torch eager",
        "(b) on/off",
        "(c) on/torch eager",
        "(d) on/torch anomaly",
        "(e) full/off"
    );
    for mode in &a.modes {
        let (off, on, full) = (
            of(mode, Probes::Off),
            of(mode, Probes::On),
            of(mode, Probes::Full),
        );
        let t = |variant: &str| {
            torch
                .as_ref()
                .and_then(|j| torch_figure(j, mode, variant, "median_ms"))
        };
        let div = |x: Option<f64>, y: Option<f64>| x.zip(y).map(|(x, y)| x / y);
        let r = [
            div(off, t("eager")),
            div(on, off),
            div(on, t("eager")),
            div(on, t("anomaly")),
            div(full, off),
        ];
        let show = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.3}"));
        println!(
            "{:<6} {:>22} {:>16} {:>22} {:>24} {:>16}",
            mode,
            show(r[0]),
            show(r[1]),
            show(r[2]),
            show(r[3]),
            show(r[4])
        );
        ratios.push(serde_json::json!({
            "mode": mode, "a_off_over_torch_eager": r[0], "b_on_over_off": r[1],
            "c_on_over_torch_eager": r[2], "d_on_over_torch_anomaly": r[3],
            "e_full_over_off": r[4],
        }));
    }
    if let Some(j) = &torch {
        println!();
        println!("peak device memory, MiB (amprobe: tensors live or cached, and the probe arena; not cuBLAS's workspace)");
        for mode in &a.modes {
            let peak = |p: Probes| {
                rows.iter()
                    .find(|r| r.mode == *mode && r.probes == p)
                    .map_or("-".to_string(), |r| format!("{:.0}", r.peak_mib))
            };
            let theirs = torch_figure(j, mode, "eager", "peak_mem_mib");
            println!(
                "{:<6} off {:>7} on {:>7} full {:>7}  PyTorch eager {:>7}",
                mode,
                peak(Probes::Off),
                peak(Probes::On),
                peak(Probes::Full),
                theirs.map_or("-".to_string(), |v| format!("{v:.0}"))
            );
        }
    }
    if torch.is_none() {
        println!("(a), (c) and (d) need PyTorch's figures: --torch FILE from bench_t5_gpu_torch.py --json");
    }
    if let Some(path) = &a.json {
        let out = serde_json::json!({
            "bench": "t5_base_gpu",
            "device": dev.name,
            "simulated": dev.simulated,
            "config": {
                "model": match a.model { Model::T5 => "t5", Model::Llama => "llama" },
                "layers": a.layers, "batch": a.batch, "seq": a.seq, "vocab": a.vocab,
                "warmup": a.warmup, "steps": a.steps,
            },
            "steps": rows.iter().map(|r| serde_json::json!({
                "mode": r.mode, "probes": r.probes != Probes::Off,
                "full_statistics": r.probes == Probes::Full, "median_ms": r.median_ms,
                "min_ms": r.min_ms, "skipped_steps": r.skipped, "peak_mem_mib": r.peak_mib,
                "peak_live_mib": r.live_mib,
            })).collect::<Vec<_>>(),
            "ratios": ratios,
        });
        let text = serde_json::to_string_pretty(&out).expect("plain JSON");
        if let Err(e) = std::fs::write(path, text + "\n") {
            eprintln!("error: --json {path}: {e}");
            std::process::exit(1);
        }
        println!("wrote {path}");
    }
}
