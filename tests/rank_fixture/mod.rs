//! Small rank traces as the PyTorch companion writes them under torchrun, for the tests
//! of the summary over several ranks.
#![allow(dead_code)]

use amprobe::diagnose::ranks::{rank_path, read_rank_traces, summary_of_ranks};
use amprobe::diagnose::summary::RunSummary;
use amprobe::diagnose::DiagnoseOptions;
use amprobe::trace::record::{EndRecord, Header, StepRecord};
use amprobe::trace::TraceWriter;
use serde_json::{json, Value};
use std::path::Path;

/// A rank trace's header as the companion writes it (its scaler config, its source).
pub fn header(rank: u32, world: u32) -> Header {
    Header {
        model: "Net".into(),
        precision: "fp16".into(),
        policy_device: "cpu".into(),
        backend: "cpu".into(),
        command_line: vec!["python".into(), "train.py".into()],
        scaler: json!({"init_scale": 65536.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                       "growth_interval": 2000}),
        source: serde_json::from_value(json!({
            "kind": "pytorch", "torch": "2.5.0", "rank": rank, "world_size": world,
            "sample_every": 0
        }))
        .unwrap(),
        ..Header::new()
    }
}

pub fn op_ref(step: u64, index: u64, op: &str, module: &str) -> Value {
    json!({"step": step, "micro": 0, "phase": "forward", "op_index": index, "op": op,
           "module": module, "forward_op": null})
}

/// A step; with `bad`, an Inf made at forward op #6 (`mul` in `fc`) that turns into a NaN
/// at op #7 (`sub` in `fc`), the chain between them.
pub fn step(n: u64, bad: bool) -> StepRecord {
    let (inf, nan, chain) = if bad {
        let (a, b) = (op_ref(n, 6, "mul", "fc"), op_ref(n, 7, "sub", "fc"));
        (a.clone(), b.clone(), json!([a, b]))
    } else {
        (Value::Null, Value::Null, json!([]))
    };
    serde_json::from_value(json!({
        "step": n, "micro_batches": 1, "loss": 2.0, "scaled_loss": 131072.0,
        "scale_before": 65536.0, "scale_after": if bad { 32768.0 } else { 65536.0 },
        "found_inf": bad, "skipped": bad, "growth_tracker": 0, "grad_norm": null,
        "clip_coef": null, "lr": 0.05, "weight_casts": 0,
        "origins": {"first_inf": inf, "first_nan": nan, "chain": chain},
        "params": [], "ops": null, "op_count": 0, "events": [], "wall_ms": 1.0
    }))
    .unwrap()
}

pub fn write(path: &Path, h: &Header, steps: &[StepRecord]) {
    let mut w = TraceWriter::create(path, h).unwrap();
    for s in steps {
        w.write_step(s).unwrap();
    }
    w.finish(&EndRecord {
        steps: steps.len() as u64,
        verdict: String::new(),
        wall_ms: 1.0,
    })
    .unwrap();
}

/// Two ranks: rank 0 clean through steps 0-2, rank 1 making an Inf then a NaN at step 2.
pub fn two_ranks(dir: &Path) -> RunSummary {
    let t = dir.join("t.jsonl");
    write(
        &rank_path(&t, 0),
        &header(0, 2),
        &[step(0, false), step(1, false), step(2, false)],
    );
    write(
        &rank_path(&t, 1),
        &header(1, 2),
        &[step(0, false), step(1, false), step(2, true)],
    );
    let ranks = read_rank_traces(&t).unwrap();
    summary_of_ranks(&ranks, DiagnoseOptions::default()).unwrap()
}

/// Two ranks with `steps` clean steps each.
pub fn clean_ranks(dir: &Path, steps: u64) -> RunSummary {
    let t = dir.join("t.jsonl");
    let clean: Vec<StepRecord> = (0..steps).map(|n| step(n, false)).collect();
    write(&rank_path(&t, 0), &header(0, 2), &clean);
    write(&rank_path(&t, 1), &header(1, 2), &clean);
    let ranks = read_rank_traces(&t).unwrap();
    summary_of_ranks(&ranks, DiagnoseOptions::default()).unwrap()
}
