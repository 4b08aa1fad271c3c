//! Headroom on the T5 fixture: under fp32 (no overflow anywhere) the ops that would not fit
//! fp16 are named, with the values PyTorch's forward hooks recorded for the same modules.

use amprobe::config::RunConfig;
use amprobe::diagnose::headroom::{HeadroomKind, HeadroomThresholds, HeadroomWarning};
use amprobe::diagnose::DiagnoseOptions;
use amprobe::runner::{run, RunOptions, RunSummary};
use amprobe::trace::record::Phase;
use std::collections::BTreeMap;
use std::path::Path;

fn summary(precision: &str, t: HeadroomThresholds) -> RunSummary {
    let mut cfg = RunConfig::load(Path::new("samples/t5_overflow.toml")).unwrap();
    cfg.train.precision = Some(precision.into());
    cfg.train.steps = Some(1);
    let opts = RunOptions {
        diagnose: DiagnoseOptions {
            headroom: t,
            ..DiagnoseOptions::default()
        },
        ..RunOptions::default()
    };
    run(&cfg, &opts).unwrap()
}

/// PyTorch's max |output| per module, fp32 forward of the fixture.
fn pytorch_fp32() -> BTreeMap<String, f64> {
    let text =
        std::fs::read_to_string("tests/golden/t5_overflow_small/expected_forward_trace.json")
            .unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["scenarios"]["fp32"]["module_trace"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            (
                m["module"].as_str().unwrap().to_string(),
                m["output"]["max_abs"].as_f64().unwrap(),
            )
        })
        .collect()
}

fn find<'a>(
    ws: &'a [HeadroomWarning],
    module: &str,
    op: &str,
    kind: HeadroomKind,
) -> Option<&'a HeadroomWarning> {
    ws.iter()
        .find(|w| w.module == module && w.op == op && w.phase == Phase::Forward && w.kind == kind)
}

#[test]
fn fp32_fixture_lists_wo_outputs_and_residual_adds() {
    let s = summary("fp32", HeadroomThresholds::default());
    assert_eq!(s.verdict, "clean");
    let h = &s.headroom;
    assert_eq!(h.steps_scanned, vec![0]);
    let reference = pytorch_fp32();
    let limit = 0.5 * 65504.0;
    // The FFN outputs and the residual adds, by PyTorch's numbers: listed exactly when
    // PyTorch's max |x| is above half the fp16 max.
    let mut listed = 0;
    for b in 0..4 {
        for (module, op) in [
            (
                format!("encoder.block.{b}.layer.1.DenseReluDense.wo"),
                "linear",
            ),
            (format!("encoder.block.{b}.layer.0"), "add"),
            (format!("encoder.block.{b}.layer.1"), "add"),
        ] {
            let want = reference[&module];
            let got = find(&h.warnings, &module, op, HeadroomKind::NearOverflow);
            if want > limit {
                let w = got.unwrap_or_else(|| panic!("{module} ({want}) not listed"));
                assert!(
                    (w.max_abs - want).abs() <= 1e-5 * want,
                    "{module}: {} vs PyTorch {want}",
                    w.max_abs
                );
                assert_eq!(w.fp16_max_share, w.max_abs / 65504.0);
                assert_eq!(w.dtype, amprobe::DType::F32);
                assert_eq!(w.step, 0);
                listed += 1;
            } else {
                assert!(got.is_none(), "{module} ({want}) listed: {got:?}");
            }
        }
    }
    // Blocks 1–3's wo, block 1–3's FFN residual adds, blocks 2–3's attention adds.
    assert_eq!(listed, 8);
    // Block 3's wo would overflow fp16: its values past 65520 are counted.
    let w3 = find(
        &h.warnings,
        "encoder.block.3.layer.1.DenseReluDense.wo",
        "linear",
        HeadroomKind::NearOverflow,
    )
    .unwrap();
    assert!(w3.fp16_overflow > 0 && w3.fp16_max_share > 1.8);
    // Underflow warnings: each above the 1% share, consistent with its counts.
    let under: Vec<_> = h
        .warnings
        .iter()
        .filter(|w| w.kind == HeadroomKind::Underflow)
        .collect();
    assert!(!under.is_empty());
    for w in under {
        assert!(w.underflow_share > 0.01);
        assert_eq!(
            w.underflow_share,
            w.fp16_underflow as f64 / w.finite_nonzero as f64
        );
        assert!(w.phase != Phase::Optimizer);
    }
    // Each (kind, module, op, phase) once.
    let mut keys: Vec<_> = h
        .warnings
        .iter()
        .map(|w| (w.kind, &w.module, &w.op, w.phase == Phase::Forward))
        .collect();
    let n = keys.len();
    keys.sort();
    keys.dedup();
    assert_eq!(keys.len(), n);
}

#[test]
fn thresholds_are_respected_and_bf16_runs_warn_too() {
    let t = HeadroomThresholds {
        overflow_share: 0.7,
        underflow_share: 1.0,
    };
    let s = summary("bf16", t);
    let ws = &s.headroom.warnings;
    assert!(ws.iter().all(|w| w.kind == HeadroomKind::NearOverflow));
    assert!(ws.iter().all(|w| w.max_abs > 0.7 * 65504.0));
    // 39992 (block 1–2 wo) is below 70% of 65504 = 45853; block 3's wo (bf16) is above.
    assert!(find(
        ws,
        "encoder.block.1.layer.1.DenseReluDense.wo",
        "linear",
        HeadroomKind::NearOverflow
    )
    .is_none());
    let w = find(
        ws,
        "encoder.block.3.layer.1.DenseReluDense.wo",
        "linear",
        HeadroomKind::NearOverflow,
    )
    .unwrap();
    assert_eq!(w.dtype, amprobe::DType::BF16);
    assert!((w.max_abs - 120072.0).abs() < 1024.0, "{}", w.max_abs);
}

#[test]
fn fp16_run_reports_the_overflowing_op_as_inf() {
    let s = summary("fp16", HeadroomThresholds::default());
    let w = find(
        &s.headroom.warnings,
        "encoder.block.3.layer.1.DenseReluDense.wo",
        "linear",
        HeadroomKind::NearOverflow,
    )
    .unwrap();
    assert_eq!(w.max_abs, f64::INFINITY);
    assert!(w.fp16_overflow > 0);
    assert_eq!(w.dtype, amprobe::DType::F16);
}
