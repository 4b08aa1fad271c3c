//! GPT-2-mini, LLaMA-mini, BERT-mini and T5-mini (the whole encoder–decoder) training
//! steps on the CPU, the T5-mini workload's sizes for the other architectures: hidden 256,
//! MLP 1024, 4 layers (the full T5: 4 + 4), 4 heads of 64 (LLaMA: 2 key/value heads),
//! vocab 512, batch 8, seq 128, each model's own loss on labels = the ids, SGD; fp32 and
//! emulated fp16 and bf16 autocast, probes off and on, median of `AMPROBE_BENCH_REPS`
//! steps (default 5) after one warm-up step. The table pairs single probed and unprobed
//! steps taken in turn and gives the probe ratio as the median of the pairs' ratios.
//! `scripts/bench_hf_torch.py` runs PyTorch on the same workloads.
//!
//! ```text
//! cargo bench --bench hf_step                              # every configuration, a table
//! AMPROBE_BENCH_ONLY=llama:bf16:off cargo bench --bench hf_step   # one alone
//! ```
//!
//! `AMPROBE_BENCH_ONLY=MODEL:MODE:on|off` (model gpt2|llama|bert|t5, mode fp32|fp16|bf16)
//! runs one configuration alone and prints its median; with `AMPROBE_BENCH_JSON=1` as well
//! it also prints one JSON line, as `benches/t5_step.rs` does
//! (`{"side":"amprobe","config":"gpt2:fp32:off","model":"gpt2",...,"times_ms":[...]}`), for
//! `scripts/bench-cpu.py --models`.

use amprobe::amp::mode::Precision;
use amprobe::models::bert::{Bert, BertConfig};
use amprobe::models::gpt2::{Gpt2, Gpt2Config};
use amprobe::models::llama::{Llama, LlamaConfig};
use amprobe::models::pretrained::Pretrained;
use amprobe::models::t5::synthetic_ids;
use amprobe::models::t5_seq2seq::T5Seq2Seq;
use amprobe::models::Model;
use amprobe::optim::{OptimizerConfig, SgdConfig};
use amprobe::train::{Synthetic, TrainConfig, Trainer};
use std::path::Path;
use std::time::Instant;

mod pairs;
use pairs::{median, paired_ms, step_ms};

const GPT2: &str = r#"{"model_type": "gpt2", "vocab_size": 512, "n_positions": 128,
    "n_embd": 256, "n_layer": 4, "n_head": 4, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
    "attn_pdrop": 0.0}"#;
const BERT: &str = r#"{"model_type": "bert", "vocab_size": 512, "hidden_size": 256,
    "intermediate_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 4,
    "max_position_embeddings": 128, "hidden_dropout_prob": 0.0,
    "attention_probs_dropout_prob": 0.0}"#;
const T5: &str = r#"{"model_type": "t5", "architectures": ["T5ForConditionalGeneration"],
    "vocab_size": 512, "d_model": 256, "d_ff": 1024, "d_kv": 64, "num_heads": 4,
    "num_layers": 4, "feed_forward_proj": "relu", "dropout_rate": 0.0}"#;
const LLAMA: &str = r#"{"model_type": "llama", "vocab_size": 512, "hidden_size": 256,
    "intermediate_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 128}"#;

/// The models `trainer` builds, in table order.
const MODELS: [&str; 4] = ["gpt2", "llama", "bert", "t5"];

fn trainer(model: &str, precision: Precision, probes: bool) -> Trainer {
    let here = Path::new("bench");
    let (m, params): (Box<dyn Model>, _) = match model {
        "gpt2" => {
            let m = Gpt2::new(Gpt2Config::parse(GPT2, here).expect("config"));
            let p = m.seeded(0).expect("init");
            (Box::new(m), p)
        }
        "bert" => {
            let m = Bert::new(BertConfig::parse(BERT, here).expect("config"));
            let p = m.seeded(0).expect("init");
            (Box::new(m), p)
        }
        "t5" => {
            let m = T5Seq2Seq::parse_config(T5, here).expect("config");
            let p = m.seeded(0).expect("init");
            (Box::new(m), p)
        }
        _ => {
            let m = Llama::new(LlamaConfig::parse(LLAMA, here).expect("config"));
            let p = m.seeded(0).expect("init");
            (Box::new(m), p)
        }
    };
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
    Trainer::new(train, m, params, Box::new(data)).expect("trainer")
}

/// The warm-up step's wall time and that of each of the `reps` steps after it, in
/// milliseconds, in step order.
fn step_times_ms(model: &str, precision: Precision, probes: bool, reps: u64) -> (f64, Vec<f64>) {
    let mut t = trainer(model, precision, probes);
    let t0 = Instant::now();
    t.step(0).expect("warm-up step");
    let warmup_ms = t0.elapsed().as_secs_f64() * 1e3;
    let times = (1..=reps).map(|s| step_ms(&mut t, s)).collect();
    (warmup_ms, times)
}

fn main() {
    amprobe::host_memory::keep_freed_memory();
    let reps = std::env::var("AMPROBE_BENCH_REPS")
        .ok()
        .and_then(|r| r.parse().ok())
        .filter(|&r: &u64| r > 0)
        .unwrap_or(5);
    if let Ok(only) = std::env::var("AMPROBE_BENCH_ONLY") {
        let parts: Vec<&str> = only.split(':').collect();
        let [model, mode, probes] = parts[..] else {
            panic!("AMPROBE_BENCH_ONLY: MODEL:MODE:on|off, got {only:?}");
        };
        assert!(
            MODELS.contains(&model),
            "AMPROBE_BENCH_ONLY: the model is one of {MODELS:?}, got {model:?}"
        );
        let p = Precision::parse(mode).expect("AMPROBE_BENCH_ONLY: a precision mode");
        let (warmup_ms, times) = step_times_ms(model, p, probes == "on", reps);
        let med = median(times.clone());
        println!("{only}: {med:.1} ms");
        // AMPROBE_BENCH_JSON (set and not 0) adds one JSON line with every step's time,
        // the line scripts/bench-cpu.py reads (the fields of benches/t5_step.rs's, plus
        // the model).
        if std::env::var("AMPROBE_BENCH_JSON").is_ok_and(|v| !v.is_empty() && v != "0") {
            let line = serde_json::json!({
                "side": "amprobe",
                "config": only,
                "model": model,
                "mode": p.name(),
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
    println!("model  mode  probes off ms  probes on ms  on/off (pairs)");
    for model in MODELS {
        for mode in ["fp32", "fp16", "bf16"] {
            let p = Precision::parse(mode).expect("mode");
            let mut on = trainer(model, p, true);
            let mut off = trainer(model, p, false);
            on.step(0).expect("warm-up step");
            off.step(0).expect("warm-up step");
            let (on, off, ratio) = paired_ms(&mut on, &mut off, reps);
            println!("{model:<6} {mode:<5} {off:>13.1} {on:>13.1} {ratio:>15.3}");
        }
    }
}
