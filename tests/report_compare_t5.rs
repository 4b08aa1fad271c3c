//! `compare` on the T5 fixture: the fp16 run's first divergence from fp32 is the
//! overflowing `wo` op, a range failure; bf16 differs from fp32 by rounding only.

use amprobe::config::RunConfig;
use amprobe::report::compare::{compare, Class};
use amprobe::report::TraceFile;
use amprobe::runner::{run, RunOptions};
use std::path::Path;

fn trace(dir: &Path, precision: &str) -> TraceFile {
    let mut cfg = RunConfig::load(Path::new("samples/t5_overflow.toml")).unwrap();
    cfg.train.precision = Some(precision.into());
    cfg.train.steps = Some(1);
    let p = dir.join(format!("{precision}.jsonl"));
    cfg.probe.trace = Some(p.clone());
    run(&cfg, &RunOptions::default()).unwrap();
    TraceFile::open(&p).unwrap()
}

#[test]
fn fp16_diverges_at_wo_by_range_and_bf16_by_rounding() {
    let d = tempfile::tempdir().unwrap();
    let runs = [
        trace(d.path(), "fp32"),
        trace(d.path(), "fp16"),
        trace(d.path(), "bf16"),
    ];
    let cmp = compare(&runs, 0.05, Some(0)).unwrap();
    let fp16 = cmp.diffs.iter().find(|r| r.run == 1).unwrap();
    let first = fp16.first_divergence().expect("fp16 diverges");
    assert_eq!(first.module, "encoder.block.3.layer.1.DenseReluDense.wo");
    assert_eq!(first.op, "linear");
    assert_eq!(first.class, Class::Range);
    let bf16 = cmp.diffs.iter().find(|r| r.run == 2).unwrap();
    assert!(
        bf16.ops
            .iter()
            .all(|o| !o.diverged || o.class == Class::Rounding),
        "bf16 vs fp32: rounding only"
    );
    assert!(!bf16.ops.is_empty());
}

/// `run --precision fp16,bf16,fp32` runs all three on the same weights and data, writes a
/// trace per precision and the comparison, and names the fp16 run's first divergence.
#[test]
fn run_with_several_precisions_compares_them() {
    let d = tempfile::tempdir().unwrap();
    let trace = d.path().join("t.jsonl");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_amprobe"))
        .args([
            "run",
            "samples/t5_overflow.toml",
            "--precision",
            "fp16,bf16,fp32",
            "--steps",
            "2",
            "--trace",
            trace.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("fp16 (t-fp16) vs fp32 (t-fp32): first divergence at step 0 forward"),
        "{text}"
    );
    assert!(
        text.contains("`encoder.block.3.layer.1.DenseReluDense.wo`: range failure"),
        "{text}"
    );
    // bf16 has fp32's range: where it first differs from fp32 is rounding, not a range
    // failure at `wo`.
    let bf16 = text
        .lines()
        .find(|l| l.starts_with("bf16 (t-bf16) vs fp32 (t-fp32)"))
        .unwrap_or_else(|| panic!("{text}"));
    assert!(
        bf16.contains("precision alone") && !bf16.contains("range failure"),
        "{bf16}"
    );
    for p in ["fp16", "bf16", "fp32"] {
        let t = amprobe::trace::io::read_trace(d.path().join(format!("t-{p}.jsonl"))).unwrap();
        assert_eq!(t.header.precision, p);
        assert!(
            t.steps.iter().all(|s| s.ops.is_some()),
            "every step keeps op records for the comparison"
        );
    }
    let md = std::fs::read_to_string(d.path().join("t-compare/summary.md")).unwrap();
    assert!(
        md.contains("| run | precision | steps | skipped | skip rate | final loss |"),
        "{md}"
    );
}
