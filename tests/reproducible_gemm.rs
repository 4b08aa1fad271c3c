//! The host's two GEMM kernel choices (the gemm crate's, fastest for the machine, and the
//! fixed-order ones of `--reproducible`) give every sample and every Hugging Face fixture of
//! tests/golden the same diagnosis: the first Inf and NaN (step, op, module), the chain
//! between them, each step's found-inf, skip and loss scales, and the verdict, in every
//! precision mode; and the trace header names the kernels that ran.

use std::process::Command;

/// One run's diagnosis from its summary JSON, and its trace header's `host_gemm`. `sample`
/// is a config file, or a fixture folder (its model with its inputs.safetensors).
fn diagnosis(sample: &str, precision: &str, reproducible: bool) -> (serde_json::Value, String) {
    let dir = tempfile::tempdir().unwrap();
    let (summary, trace) = (dir.path().join("s.json"), dir.path().join("t.jsonl"));
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_amprobe"));
    cmd.arg("run");
    if sample.ends_with(".toml") {
        cmd.arg(sample);
    } else {
        let (dir, inputs) = match sample.strip_suffix(":unplanted") {
            Some(d) => (d, "unplanted.safetensors"),
            None => (sample, "inputs.safetensors"),
        };
        let dir = std::path::Path::new(dir);
        cmd.arg("--hf")
            .arg(dir)
            .arg("--inputs")
            .arg(dir.join(inputs));
        cmd.args(["--steps", "3"]);
    }
    cmd.args(["--precision", precision, "--backend", "cpu"])
        .arg("--summary-json")
        .arg(&summary)
        .arg("--trace")
        .arg(&trace)
        .env_remove("AMPROBE_REPRODUCIBLE");
    if reproducible {
        cmd.arg("--reproducible");
    }
    let o = cmd.output().expect("amprobe runs");
    assert!(
        o.status.code().is_some_and(|c| c <= 1),
        "{sample} {precision}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let s: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&summary).unwrap()).unwrap();
    let header: serde_json::Value = serde_json::from_str(
        std::fs::read_to_string(&trace)
            .unwrap()
            .lines()
            .next()
            .unwrap(),
    )
    .unwrap();
    let kernels = header["host_gemm"].as_str().unwrap_or_default().to_string();
    let op = |v: &serde_json::Value| serde_json::json!({"step": v["step"], "phase": v["phase"], "op": v["op"], "module": v["module"], "op_index": v["op_index"]});
    let steps: Vec<serde_json::Value> = s["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|st| {
            serde_json::json!({
                "found_inf": st["found_inf"], "skipped": st["skipped"],
                "scale_before": st["scale_before"], "scale_after": st["scale_after"],
            })
        })
        .collect();
    let chain: Vec<serde_json::Value> = s["chain"].as_array().unwrap().iter().map(op).collect();
    let d = serde_json::json!({
        "verdict": s["verdict"],
        "first_inf": op(&s["first_inf"]),
        "first_nan": op(&s["first_nan"]),
        "chain": chain,
        "steps": steps,
        "skipped_steps": s["skipped_steps"],
    });
    (d, kernels)
}

#[test]
fn every_sample_and_fixture_has_the_same_diagnosis_with_either_gemm() {
    let samples: Vec<String> = std::fs::read_dir("samples")
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    assert!(samples.len() >= 6, "samples: {samples:?}");
    let mut samples = samples;
    for d in [
        "bert_tiny",
        "gpt2_tiny",
        "llama_tiny",
        "t5_seq2seq_tiny",
        "t5_variants/gated_gelu_block1",
        "t5_variants/relu_6_layers_block4",
    ] {
        samples.push(format!("tests/golden/{d}"));
    }
    let mut nonfinite = 0;
    for sample in &samples {
        for precision in ["fp16", "bf16", "fp32"] {
            let (fast, fast_kernels) = diagnosis(sample, precision, false);
            let (fixed, fixed_kernels) = diagnosis(sample, precision, true);
            assert!(fast_kernels.starts_with("gemm-crate:"), "{fast_kernels}");
            assert!(fixed_kernels.starts_with("fixed-order:"), "{fixed_kernels}");
            assert_eq!(fast, fixed, "{sample} {precision}");
            nonfinite += usize::from(!fast["first_inf"]["op"].is_null());
        }
    }
    // The samples overflow fp16: the comparison covers origins, not only clean runs.
    assert!(nonfinite >= 4, "only {nonfinite} runs met an Inf");
}
