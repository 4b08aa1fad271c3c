//! The command line: the summary JSON carries origins, skip causes, headroom and remedies;
//! the human summary says them in plain words; `fix` and `bisect` answer.

use std::process::{Command, Output};

fn amprobe(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_amprobe"))
        .args(args)
        .output()
        .expect("amprobe runs")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[test]
fn summary_json_and_human_summary_of_try_remedies() {
    let d = tempfile::tempdir().unwrap();
    let json = d.path().join("s.json");
    let o = amprobe(&[
        "run",
        "samples/t5_overflow.toml",
        "--try-remedies",
        "--summary-json",
        json.to_str().unwrap(),
    ]);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let s: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let wo = "encoder.block.3.layer.1.DenseReluDense.wo";
    assert_eq!(s["first_inf"]["module"], wo);
    assert_eq!(s["first_nan"]["module"], "encoder.final_layer_norm");
    let chain = s["chain"].as_array().unwrap();
    assert_eq!(chain.first().unwrap()["module"], wo);
    assert_eq!(chain.last().unwrap()["module"], "encoder.final_layer_norm");
    for st in s["steps"].as_array().unwrap() {
        assert_eq!(st["skip_cause"]["kind"], "forward-overflow");
        assert_eq!(st["skip_cause"]["op"]["module"], wo);
    }
    let warnings = s["headroom"]["warnings"].as_array().unwrap();
    assert!(warnings
        .iter()
        .any(|w| w["module"] == wo && w["kind"] == "near-overflow" && w["max_abs"] == "inf"));
    assert_eq!(s["headroom"]["thresholds"]["overflow_share"], 0.5);
    let rem = &s["remedies"];
    assert_eq!(rem["step"], 0);
    let list = rem["remedies"].as_array().unwrap();
    let wo_fix = list
        .iter()
        .find(|m| m["flags"] == serde_json::json!(["--keep-fp32", "wo"]))
        .unwrap();
    assert_eq!(wo_fix["finite"], true);
    assert!(wo_fix["loss_rel_err"].as_f64().unwrap() < 1e-3);
    assert!(wo_fix["hidden_rel_err"].as_f64().unwrap() < 1e-3);
    assert_eq!(rem["bisection"]["keep_fp32"], serde_json::json!(["wo"]));
    assert!(s["diagnosis_replays"].as_u64().unwrap() > 3);

    let text = stdout(&o);
    for want in [
        "SKIPPED (forward-overflow)",
        "steps 0–2 skipped (forward-overflow): `linear` in `encoder.block.3.layer.1.DenseReluDense.wo` went non-finite in the forward pass (float16)",
        "a lower loss scale cannot help",
        "Headroom:",
        "FIXES IT: keeping `wo` in fp32 makes step 0 finite; loss differs from fp32 by",
        "FIXES IT: bf16 autocast makes step 0 finite",
        "does not fix it: transformers' fp16 clamp",
        "keep_fp32 = [\"wo\"]",
        "Suggested fix:",
    ] {
        assert!(text.contains(want), "missing {want:?} in:\n{text}");
    }
}

#[test]
fn scale_too_high_in_plain_words() {
    let o = amprobe(&[
        "run",
        "samples/mlp.toml",
        "--init-scale",
        "1e30",
        "--steps",
        "2",
    ]);
    assert_eq!(o.status.code(), Some(0));
    let text = stdout(&o);
    for want in [
        "SKIPPED (scale-too-high)",
        "steps 0–1 skipped (scale-too-high): the forward pass was finite, but at loss scale 1.000e30 the backward op `to` in `loss`",
        "The same step at scale 1 is finite",
        "use --init-scale 262144",
    ] {
        assert!(text.contains(want), "missing {want:?} in:\n{text}");
    }
}

#[test]
fn fix_and_bisect_commands() {
    let o = amprobe(&["fix", "samples/t5_overflow.toml"]);
    assert_eq!(o.status.code(), Some(0));
    let text = stdout(&o);
    assert!(text.contains("step    0"), "{text}");
    assert!(
        !text.contains("step    1"),
        "fix stops at the failing step:\n{text}"
    );
    assert!(text.contains("Suggested fix:"), "{text}");

    let o = amprobe(&["bisect", "samples/t5_overflow.toml"]);
    assert_eq!(o.status.code(), Some(0));
    let text = stdout(&o);
    for want in [
        "keeping encoder.block.3.layer.1.DenseReluDense.wo in fp32 makes step 0 finite",
        "re-runs of the step over",
        "the pattern `wo` was verified",
        "Use: --keep-fp32 wo",
        "keep_fp32 = [\"wo\"]",
    ] {
        assert!(text.contains(want), "missing {want:?} in:\n{text}");
    }
    // Nothing to fix on a healthy run.
    let o = amprobe(&["fix", "samples/t5_overflow.toml", "--keep-fp32", "wo"]);
    assert_eq!(o.status.code(), Some(0));
    assert!(stdout(&o).contains("nothing to fix"));
    // Bad thresholds are refused with the flag's name.
    let o = amprobe(&["run", "samples/mlp.toml", "--underflow-threshold", "2"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("--underflow-threshold"));
}

#[test]
fn a_collapsing_scale_is_one_event() {
    let d = tempfile::tempdir().unwrap();
    let json = d.path().join("s.json");
    let o = amprobe(&[
        "run",
        "samples/t5_overflow.toml",
        "--precision",
        "fp16",
        "--steps",
        "12",
        "--summary-json",
        json.to_str().unwrap(),
    ]);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let s: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let events: Vec<&str> = s["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e.as_str().unwrap())
        .collect();
    let collapse: Vec<&&str> = events.iter().filter(|e| e.contains("scale")).collect();
    assert_eq!(collapse.len(), 1, "{events:#?}");
    assert!(
        collapse[0].starts_with("step 7: loss scale collapsing: it fell on 8 consecutive steps"),
        "{events:#?}"
    );
}

/// Under fp16 autocast the ops that ran in fp16 lead the headroom, the overflowed one shown
/// as inf with its Inf count; fp32 ops (T5LayerNorm's `pow`, `mean`, `add`) that would only
/// overflow if cast are apart: one line in the run's summary, collapsed in summary.md.
#[test]
fn headroom_leads_with_the_ops_that_ran_in_fp16() {
    let d = tempfile::tempdir().unwrap();
    let trace = d.path().join("t.jsonl");
    let o = amprobe(&[
        "run",
        "samples/t5_overflow.toml",
        "--precision",
        "fp16",
        "--steps",
        "1",
        "--trace",
        trace.to_str().unwrap(),
    ]);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let text = stdout(&o);
    let lines: Vec<&str> = text.lines().collect();
    let at = lines
        .iter()
        .position(|l| l.starts_with("Headroom:"))
        .expect("a headroom section");
    assert!(lines[at].contains("ran in 16 bits"), "{text}");
    let body: Vec<&str> = lines[at + 1..]
        .iter()
        .take_while(|l| l.starts_with("  "))
        .copied()
        .collect();
    let wo = "encoder.block.3.layer.1.DenseReluDense.wo";
    assert!(
        body.iter()
            .any(|l| l.contains(wo) && l.contains("overflowed float16 to inf (16 Inf values)")),
        "{text}"
    );
    let (last, listed) = body.split_last().unwrap();
    assert!(
        last.contains("fp32 ops") && last.contains("`pow` ×4"),
        "{text}"
    );
    assert!(listed.iter().all(|l| l.contains("float16")), "{text}");

    let out = d.path().join("rep");
    let r = amprobe(&[
        "report",
        trace.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert_eq!(
        r.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&r.stderr)
    );
    let md = std::fs::read_to_string(out.join("summary.md")).unwrap();
    let section = &md[md.find("## Headroom").unwrap()..];
    let section = &section[..section[3..].find("\n## ").map_or(section.len(), |i| i + 3)];
    let (shown, collapsed) = section
        .split_once("<details>")
        .expect("a collapsed fp32 list");
    let first_row = shown.lines().find(|l| l.starts_with("| 0 |")).unwrap();
    assert!(
        first_row.contains(wo) && first_row.contains("inf (16 Inf values)"),
        "{section}"
    );
    assert!(
        !shown.contains("`pow`") && !shown.contains("float32"),
        "{section}"
    );
    assert!(
        collapsed.contains("`pow`") && collapsed.contains("only if they were cast"),
        "{section}"
    );
}
