//! `amprobe ... | head`: a reader that closes stdout early ends the command quietly with
//! exit code 0 instead of a panic.

#![cfg(unix)]

use std::path::Path;
use std::process::{Command, Stdio};

/// Runs amprobe with stdout a pipe whose read end is closed at once, and checks that it
/// exits 0 with nothing on stderr about the pipe. Each command prints well over a pipe
/// buffer (64 KiB on Linux), so it hits the closed pipe even if it wrote before the close.
fn survives_closed_stdout(args: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_amprobe"))
        .args(args)
        .current_dir(dir.path())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("amprobe starts");
    drop(child.stdout.take());
    let o = child.wait_with_output().expect("amprobe ends");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{args:?}: {:?}\n{err}", o.status);
    assert!(!err.contains("panicked"), "{args:?}:\n{err}");
    assert!(
        !err.to_lowercase().contains("broken pipe"),
        "{args:?}:\n{err}"
    );
}

#[test]
fn scaler_simulate_into_a_closed_pipe_exits_quietly() {
    survives_closed_stdout(&[
        "scaler",
        "simulate",
        "--overflow-steps",
        "3",
        "--steps",
        "200000",
    ]);
}

#[test]
fn run_into_a_closed_pipe_exits_quietly() {
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("samples/mlp.toml");
    survives_closed_stdout(&[
        "run",
        config.to_str().unwrap(),
        "--steps",
        "2000",
        "--trace",
        "t.jsonl",
    ]);
}
