//! The command line: exit codes and error messages for bad input, the scaler simulator,
//! and a trace that survives SIGKILL.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn amprobe(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_amprobe"))
        .args(args)
        .output()
        .expect("amprobe runs")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

/// A config like samples/mlp.toml whose weights and batch point at `weights` and `batch`.
fn config(dir: &Path, weights: &Path, batch: &Path, extra: &str) -> PathBuf {
    let p = dir.join("run.toml");
    std::fs::write(
        &p,
        format!(
            "[model]\nkind = \"mlp\"\ninputs = 100\nhidden = 50\nclasses = 10\nweights = {:?}\n[data]\nbatch_file = {:?}\n{extra}",
            weights.canonicalize().unwrap_or(weights.to_path_buf()),
            batch.canonicalize().unwrap_or(batch.to_path_buf())
        ),
    )
    .unwrap();
    p
}

fn write_st(path: &Path, tensors: Vec<(&str, safetensors::Dtype, Vec<usize>, Vec<u8>)>) {
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, d, s, b)| {
            (
                n.to_string(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::tensor::serialize_to_file(views, None, path).unwrap();
}

fn f32s(n: usize, v: f32) -> Vec<u8> {
    (0..n).flat_map(|_| v.to_le_bytes()).collect()
}

#[test]
fn seed_run_succeeds_and_writes_summary() {
    let d = tmp();
    let summary = d.path().join("s.json");
    let o = amprobe(&[
        "run",
        "samples/mlp.toml",
        "--precision",
        "fp16",
        "--summary-json",
        summary.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let s: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&summary).unwrap()).unwrap();
    assert_eq!(s["verdict"], "clean");
    assert!(s["first_inf"].is_null() && s["first_nan"].is_null());
    let st = &s["steps"][0];
    for k in [
        "loss",
        "scale_before",
        "scale_after",
        "found_inf",
        "skipped",
        "grad_norm",
    ] {
        assert!(!st[k].is_null(), "steps[0].{k} missing");
    }
    for p in ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"] {
        assert!(s["params"][p]["max_abs_grad"].as_f64().unwrap() > 0.0);
        assert!(s["params"][p]["grad_norm"].as_f64().unwrap() > 0.0);
    }
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("verdict: clean"), "{out}");
}

#[test]
fn missing_config_file() {
    let o = amprobe(&["run", "no/such/config.toml"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("no/such/config.toml"), "{}", stderr(&o));
}

#[test]
fn bad_toml_names_the_file_and_field() {
    let d = tmp();
    let p = d.path().join("bad.toml");
    std::fs::write(&p, "[train]\nprecision = fp16\n").unwrap();
    let o = amprobe(&["run", p.to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("bad.toml"), "{}", stderr(&o));
    std::fs::write(&p, "[train]\nprecison = \"fp16\"\n").unwrap();
    let o = amprobe(&["run", p.to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("precison"), "{}", stderr(&o));
}

#[test]
fn unknown_precision_is_refused() {
    let o = amprobe(&["run", "samples/mlp.toml", "--precision", "fp8"]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("fp8") && stderr(&o).contains("expected"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn missing_weights_file() {
    let d = tmp();
    let c = config(
        d.path(),
        &d.path().join("nope.safetensors"),
        Path::new("samples/seed_mlp/batch.safetensors"),
        "",
    );
    let o = amprobe(&["run", c.to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("nope.safetensors"), "{}", stderr(&o));
}

#[test]
fn weights_with_wrong_shape_name_the_tensor() {
    let d = tmp();
    let w = d.path().join("w.safetensors");
    write_st(
        &w,
        vec![
            (
                "fc1.weight",
                safetensors::Dtype::F32,
                vec![50, 99],
                f32s(50 * 99, 0.01),
            ),
            ("fc1.bias", safetensors::Dtype::F32, vec![50], f32s(50, 0.0)),
            (
                "fc2.weight",
                safetensors::Dtype::F32,
                vec![10, 50],
                f32s(500, 0.01),
            ),
            ("fc2.bias", safetensors::Dtype::F32, vec![10], f32s(10, 0.0)),
        ],
    );
    let c = config(
        d.path(),
        &w,
        Path::new("samples/seed_mlp/batch.safetensors"),
        "",
    );
    let o = amprobe(&["run", c.to_str().unwrap()]);
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(
        e.contains("fc1.weight") && e.contains("[50, 99]") && e.contains("[50, 100]"),
        "{e}"
    );
}

#[test]
fn weights_with_wrong_dtype_name_the_tensor() {
    let d = tmp();
    let w = d.path().join("w.safetensors");
    write_st(
        &w,
        vec![
            (
                "fc1.weight",
                safetensors::Dtype::I64,
                vec![50, 100],
                vec![0u8; 50 * 100 * 8],
            ),
            ("fc1.bias", safetensors::Dtype::F32, vec![50], f32s(50, 0.0)),
            (
                "fc2.weight",
                safetensors::Dtype::F32,
                vec![10, 50],
                f32s(500, 0.01),
            ),
            ("fc2.bias", safetensors::Dtype::F32, vec![10], f32s(10, 0.0)),
        ],
    );
    let c = config(
        d.path(),
        &w,
        Path::new("samples/seed_mlp/batch.safetensors"),
        "",
    );
    let o = amprobe(&["run", c.to_str().unwrap()]);
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(e.contains("fc1.weight") && e.contains("int64"), "{e}");
}

#[test]
fn label_out_of_range_is_named() {
    let d = tmp();
    let b = d.path().join("b.safetensors");
    let mut y: Vec<u8> = Vec::new();
    for v in [1i64, 2, 10, 3] {
        y.extend(v.to_le_bytes());
    }
    write_st(
        &b,
        vec![
            ("x", safetensors::Dtype::F32, vec![4, 100], f32s(400, 0.5)),
            ("y", safetensors::Dtype::I64, vec![4], y),
        ],
    );
    let c = config(
        d.path(),
        Path::new("samples/seed_mlp/init.safetensors"),
        &b,
        "",
    );
    let o = amprobe(&["run", c.to_str().unwrap()]);
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(
        e.contains("label 10") && e.contains("position 2") && e.contains("10 classes"),
        "{e}"
    );
}

#[test]
fn corrupt_safetensors_is_named() {
    let d = tmp();
    let w = d.path().join("w.safetensors");
    std::fs::write(&w, b"not a safetensors file").unwrap();
    let c = config(
        d.path(),
        &w,
        Path::new("samples/seed_mlp/batch.safetensors"),
        "",
    );
    let o = amprobe(&["run", c.to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("w.safetensors"), "{}", stderr(&o));
}

#[test]
fn scaler_simulate_prints_the_sequence() {
    let o = amprobe(&[
        "scaler",
        "simulate",
        "--overflow-steps",
        "3",
        "--init-scale",
        "128",
        "--growth-interval",
        "1",
        "--steps",
        "4",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let scales: Vec<f64> = v
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["scale_after"].as_f64().unwrap())
        .collect();
    assert_eq!(scales, vec![256.0, 512.0, 1024.0, 512.0]);
    assert_eq!(v[3]["skipped"], true);
    for k in [
        "step",
        "scale_before",
        "found_inf",
        "skipped",
        "scale_after",
        "growth_tracker",
    ] {
        assert!(!v[0][k].is_null(), "{k}");
    }
    let bad = amprobe(&["scaler", "simulate", "--overflow-steps", "3,x"]);
    assert!(!bad.status.success());
    assert!(stderr(&bad).contains('x'), "{}", stderr(&bad));
    // No flag: no step overflows, the scale grows every interval.
    let none = amprobe(&[
        "scaler",
        "simulate",
        "--steps",
        "5",
        "--growth-interval",
        "2",
        "--json",
    ]);
    assert!(none.status.success(), "{}", stderr(&none));
    let v: serde_json::Value = serde_json::from_slice(&none.stdout).unwrap();
    let scales: Vec<f64> = (0..5)
        .map(|i| v[i]["scale_after"].as_f64().unwrap())
        .collect();
    assert_eq!(scales, [65536.0, 131072.0, 131072.0, 262144.0, 262144.0]);
}

#[cfg(unix)]
#[test]
fn sigkill_keeps_every_finished_step() {
    use std::time::{Duration, Instant};
    let d = tmp();
    let trace = d.path().join("t.jsonl");
    let cfg = d.path().join("long.toml");
    std::fs::write(
        &cfg,
        "[model]\nkind = \"mlp\"\ninputs = 256\nhidden = 256\nclasses = 10\n[data]\nbatch = 64\n[train]\nprecision = \"fp16\"\nsteps = 1000\n[probe]\nsample_every = 1\n",
    )
    .unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_amprobe"))
        .args([
            "run",
            cfg.to_str().unwrap(),
            "--trace",
            trace.to_str().unwrap(),
        ])
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    loop {
        let lines = std::fs::read_to_string(&trace)
            .map(|s| s.lines().count())
            .unwrap_or(0);
        if lines >= 6 || t0.elapsed() > Duration::from_secs(60) {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    let t = amprobe::trace::io::read_trace(&trace).expect("a killed run's trace loads");
    assert!(t.steps.len() >= 5, "only {} steps", t.steps.len());
    assert!(
        t.steps.len() < 1000,
        "the run finished before it was killed"
    );
    assert!(t.end.is_none());
    for (i, s) in t.steps.iter().enumerate() {
        assert_eq!(s.step, i as u64);
        assert!(s.ops.as_ref().is_some_and(|o| !o.is_empty()));
    }
}

#[test]
fn a_missing_config_is_named_once() {
    let out = amprobe(&["run", "/nonexistent/amprobe.toml"]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("/nonexistent/amprobe.toml"), "{err}");
    assert_eq!(err.matches("os error 2").count(), 1, "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
}

#[test]
fn simulator_json_numbers_read_back_exactly() {
    // 2^16 halved on 28 overflowing steps is 2^-12.
    let out = amprobe(&[
        "scaler",
        "simulate",
        "--overflow-steps",
        "0-27",
        "--steps",
        "28",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("0.000244140625"), "{text}");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let last = v.as_array().unwrap().last().unwrap();
    assert_eq!(last["scale_after"].as_f64(), Some(2f64.powi(-12)));
}
