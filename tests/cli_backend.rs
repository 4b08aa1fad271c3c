//! Backend selection from the command line: `auto` falls back to the CPU without a word,
//! `cuda` fails clearly where the step cannot run on a GPU, bad values are named, and
//! `doctor` reports what it found. Nothing may panic or print to stderr on success.

use std::process::{Command, Output};

fn amprobe(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_amprobe"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("amprobe runs")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn auto_runs_on_the_cpu_quietly() {
    let o = amprobe(&[
        "run",
        "samples/mlp.toml",
        "--steps",
        "1",
        "--backend",
        "auto",
    ]);
    assert!(o.status.success(), "stderr: {}", text(&o.stderr));
    assert_eq!(text(&o.stderr), "", "auto must not print to stderr");
}

#[test]
fn cuda_fails_with_a_clear_message() {
    let o = amprobe(&[
        "run",
        "samples/mlp.toml",
        "--steps",
        "1",
        "--backend",
        "cuda",
    ]);
    assert_eq!(o.status.code(), Some(2));
    let err = text(&o.stderr);
    assert!(!err.contains("panicked"), "{err}");
    assert!(
        err.contains("--backend cuda needs a usable NVIDIA GPU")
            || err.contains("does not run on the CUDA backend yet"),
        "{err}"
    );
    assert!(err.contains("--backend cpu"), "names the way out: {err}");
}

#[test]
fn a_bad_backend_names_the_field_and_the_choices() {
    let o = amprobe(&[
        "run",
        "samples/mlp.toml",
        "--steps",
        "1",
        "--backend",
        "tpu",
    ]);
    assert_eq!(o.status.code(), Some(2));
    let err = text(&o.stderr);
    assert!(err.contains("train.backend"), "{err}");
    assert!(err.contains("auto, cpu or cuda"), "{err}");
}

#[test]
fn doctor_reports_and_picks_a_backend() {
    let o = amprobe(&["doctor"]);
    assert!(o.status.success(), "stderr: {}", text(&o.stderr));
    assert_eq!(text(&o.stderr), "");
    let out = text(&o.stdout);
    assert!(out.contains("backend auto -> "), "{out}");
    assert!(
        out.contains("GPU: ") || out.contains("CUDA driver: "),
        "{out}"
    );

    let j = amprobe(&["doctor", "--json"]);
    assert!(j.status.success());
    let v: serde_json::Value = serde_json::from_slice(&j.stdout).expect("doctor --json is JSON");
    let status = v["gpu"]["status"].as_str().expect("gpu.status");
    assert!(status == "available" || status == "unavailable");
    assert!(v["auto_backend"] == "cpu" || v["auto_backend"] == "cuda");
    if status == "unavailable" {
        assert_eq!(v["auto_backend"], "cpu");
        assert!(v["gpu"]["reason"].as_str().is_some_and(|r| !r.is_empty()));
    }
}

#[test]
fn selftest_without_a_gpu_is_an_error_not_a_panic() {
    if amprobe::device::detect().is_available() {
        return; // The GPU tests cover the self-test itself.
    }
    let o = amprobe(&["doctor", "--selftest"]);
    assert_eq!(o.status.code(), Some(2));
    let err = text(&o.stderr);
    assert!(err.contains("--selftest needs a usable GPU"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}
