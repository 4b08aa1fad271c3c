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
