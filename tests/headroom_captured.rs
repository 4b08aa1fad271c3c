//! Headroom of captured runs through `amprobe run -- CMD`: in an fp16 run with a GradScaler
//! (HF Trainer with gradient accumulation), fp32 gradients that only carry the loss scale
//! are not listed, fp32 ops are never the finding nor trip `--fail-on headroom`, and an fp16
//! gradient near fp16's max is; in an fp32 run the fp32 ops are the finding.

use amprobe::dtype::DType;
use amprobe::probe::TensorStats;
use amprobe::trace::record::{EndRecord, Header, OpRecord, Phase, StepRecord, TensorMeta};
use amprobe::trace::TraceWriter;
use serde_json::{json, Value};
use std::path::Path;

const SCALE: f32 = 32768.0;

fn op(index: u64, phase: Phase, name: &str, module: &str, dtype: DType, v: &[f32]) -> OpRecord {
    OpRecord {
        micro: 0,
        index,
        phase,
        op: name.into(),
        module: module.into(),
        inputs: vec![],
        output: TensorMeta {
            dtype,
            shape: vec![v.len()],
        },
        stats: TensorStats::compute(dtype, v),
        rounding: Default::default(),
        forward_op: None,
        wrt: None,
        masked_neg_inf: 0,
        additive_mask: false,
        blame: None,
    }
}

/// One step of a Llama-like model under fp16 autocast: RMSNorm's `pow` runs in fp32 and
/// goes past fp16's max; the backward of `loss / accumulation_steps` (a `div`) and of the
/// RMSNorm run in fp32 and carry the scale; with `hot`, `lm_head`'s fp16 gradient is at
/// 92% of fp16's max.
fn fp16_ops(hot: bool) -> Vec<OpRecord> {
    let mut ops = vec![
        op(
            0,
            Phase::Forward,
            "mm",
            "model.layers.0.mlp.up_proj",
            DType::F16,
            &[3.0, -2.0],
        ),
        op(
            1,
            Phase::Forward,
            "pow",
            "model.norm",
            DType::F32,
            &[100000.0, 1.0],
        ),
        op(2, Phase::Forward, "div", "", DType::F32, &[0.6]),
        op(10, Phase::Backward, "div", "", DType::F32, &[SCALE]),
        op(
            11,
            Phase::Backward,
            "mul",
            "model.norm",
            DType::F32,
            &[3.0 * SCALE, 0.5],
        ),
    ];
    if hot {
        ops.push(op(
            12,
            Phase::Backward,
            "mm",
            "lm_head",
            DType::F16,
            &[60000.0, 1.0],
        ));
    }
    ops
}

fn write_trace(path: &Path, precision: &str, scale: f32, ops: Vec<OpRecord>) {
    let h = Header {
        model: "LlamaForCausalLM".into(),
        precision: precision.into(),
        policy_device: "cpu".into(),
        backend: "cpu".into(),
        command_line: vec!["python".into(), "train.py".into()],
        source: serde_json::from_value(json!({
            "kind": "pytorch", "torch": "2.5.0", "rank": 0, "world_size": 1,
            "sample_every": 0
        }))
        .unwrap(),
        ..Header::new()
    };
    let mut w = TraceWriter::create(path, &h).unwrap();
    w.write_step(&StepRecord {
        loss: Some(2.4),
        scale_before: scale as f64,
        scale_after: scale as f64,
        op_count: ops.len() as u64,
        ops: Some(ops),
        ..StepRecord::default()
    })
    .unwrap();
    w.finish(&EndRecord {
        steps: 1,
        verdict: String::new(),
        wall_ms: 1.0,
    })
    .unwrap();
}

/// `amprobe run --fail-on headroom>50% -- sh -c 'cp TRACE "$AMPROBE_TRACE"'`: its exit
/// code, its headroom lines, and the summary JSON's headroom warnings.
fn run_captured(dir: &Path, trace: &Path) -> (Option<i32>, Vec<String>, Vec<Value>) {
    let json = dir.join("s.json");
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_amprobe"))
        .args(["run", "--trace"])
        .arg(dir.join("captured.jsonl"))
        .arg("--summary-json")
        .arg(&json)
        .args(["--fail-on", "headroom>50%", "--", "sh", "-c"])
        .arg(format!("cp {} \"$AMPROBE_TRACE\"", trace.display()))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout).to_string();
    let lines: Vec<String> = stdout
        .lines()
        .skip_while(|l| !l.starts_with("Headroom:"))
        .take_while(|l| l.starts_with("Headroom:") || l.starts_with("  "))
        .map(String::from)
        .collect();
    let lines = if lines.is_empty() {
        vec![stdout.clone()]
    } else {
        lines
    };
    let s: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let ws = s["headroom"]["warnings"].as_array().unwrap().clone();
    let gate: Vec<String> = stdout
        .lines()
        .filter(|l| l.contains("headroom>50%"))
        .map(String::from)
        .collect();
    (o.status.code(), [lines, gate].concat(), ws)
}

fn names(ws: &[Value]) -> Vec<(String, String, String)> {
    ws.iter()
        .map(|w| {
            let s = |k: &str| w[k].as_str().unwrap().to_string();
            (s("phase"), s("module"), s("op"))
        })
        .collect()
}

#[test]
fn an_fp16_runs_finding_is_its_fp16_gradient_not_the_fp32_values_of_the_loss_scale() {
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("src.jsonl");
    write_trace(&src, "fp16", SCALE, fp16_ops(true));
    let (code, lines, ws) = run_captured(d.path(), &src);
    // The fp32 RMSNorm `pow` is past fp16's max, but fp32: the gate passes.
    assert_eq!(code, Some(0), "{lines:#?}");
    assert_eq!(
        names(&ws),
        vec![
            ("backward".into(), "lm_head".into(), "mm".into()),
            ("forward".into(), "model.norm".into(), "pow".into()),
        ]
    );
    assert_eq!(ws[0]["loss_scale"], 32768.0);
    assert_eq!(ws[0]["dtype"], "float16");
    assert!(
        lines[0].starts_with("Headroom: 1 ops that ran in 16 bits exceed 50%")
            && lines[1].contains("`lm_head` (backward, step 0, loss scale 32768)")
            && lines[1].contains("`mm` max |x| 60000 (92% of the fp16 max, float16)")
            && lines[2].contains("and 1 fp32 ops")
            && lines[2].contains("only if cast: `pow` ("),
        "{lines:#?}"
    );
    assert!(
        lines[3].starts_with("ok   headroom>50%: largest 16-bit forward output is"),
        "{lines:#?}"
    );
}

#[test]
fn an_fp16_run_whose_16_bit_ops_are_far_from_the_limit_says_so_first() {
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("src.jsonl");
    write_trace(&src, "fp16", SCALE, fp16_ops(false));
    let (code, lines, ws) = run_captured(d.path(), &src);
    assert_eq!(code, Some(0), "{lines:#?}");
    assert_eq!(
        names(&ws),
        vec![("forward".into(), "model.norm".into(), "pow".into())]
    );
    assert_eq!(
        lines[0],
        "Headroom: no op that ran in 16 bits exceeds 50% of the fp16 maximum (32752)."
    );
    assert!(
        lines[1].starts_with("  1 fp32 ops, kept in fp32 by the precision mode"),
        "{lines:#?}"
    );
}

#[test]
fn in_an_fp32_run_the_fp32_ops_are_the_finding_and_trip_the_gate() {
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("src.jsonl");
    let ops: Vec<OpRecord> = fp16_ops(false)
        .into_iter()
        .map(|mut o| {
            o.output.dtype = DType::F32;
            o
        })
        .collect();
    write_trace(&src, "fp32", 1.0, ops);
    let (code, lines, ws) = run_captured(d.path(), &src);
    assert_eq!(code, Some(1), "{lines:#?}");
    // No scaler: the backward `mul`'s 98304 is its own size, past fp16's max.
    assert_eq!(
        names(&ws),
        vec![
            ("forward".into(), "model.norm".into(), "pow".into()),
            ("backward".into(), "".into(), "div".into()),
            ("backward".into(), "model.norm".into(), "mul".into()),
        ]
    );
    assert!(
        lines[0].starts_with("Headroom: 3 ops exceed 50% of the fp16 maximum"),
        "{lines:#?}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l
                .starts_with("FAIL headroom>50%: largest forward output is 152.7% of fp16's max")),
        "{lines:#?}"
    );
}

#[test]
fn a_bf16_gradient_is_shown_with_its_size_without_the_loss_scale() {
    // bf16 with a scaler at 65536: 2^31 is 32768 without the scale, past half of fp16's max;
    // 2^17 is 2 without it.
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("src.jsonl");
    let ops = vec![
        op(0, Phase::Forward, "mm", "up", DType::BF16, &[3.0]),
        op(
            5,
            Phase::Backward,
            "mm",
            "up",
            DType::BF16,
            &[2f32.powi(31)],
        ),
        op(6, Phase::Backward, "mm", "down", DType::BF16, &[131072.0]),
    ];
    write_trace(&src, "bf16", 65536.0, ops);
    let (code, lines, ws) = run_captured(d.path(), &src);
    assert_eq!(code, Some(0), "{lines:#?}");
    assert_eq!(
        names(&ws),
        vec![("backward".into(), "up".into(), "mm".into())]
    );
    assert!(
        lines[1].ends_with(
            "`mm` max |x| 2.147e9 (32768 without the loss scale: 50% of the fp16 max, bfloat16)"
        ),
        "{lines:#?}"
    );
}
