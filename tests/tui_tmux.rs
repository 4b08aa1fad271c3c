//! The real binary: `amprobe tui` driven in tmux by `scripts/tui-tmux-test.sh` (a live run,
//! panels, the jump to the first non-finite op, quitting, a panic), and refusing to start
//! without a terminal.

#[path = "device_step/common.rs"]
mod common;
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_amprobe");

fn has_tmux() -> bool {
    Command::new("tmux")
        .arg("-V")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Runs `scripts/tui-tmux-test.sh` with `extra` after the binary; fails with its output
/// unless it says ok.
fn run_script(extra: &[&str]) {
    let out = Command::new("bash")
        .arg("scripts/tui-tmux-test.sh")
        .arg(BIN)
        .args(extra)
        .env_remove("NO_COLOR")
        .output()
        .expect("running scripts/tui-tmux-test.sh");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "tui-tmux-test {extra:?} failed:\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains("tui-tmux-test: ok"), "{stdout}");
}

/// The live T5 overflow run on the device (the simulated one in CI): the UI names the
/// device and shows the emulator's first Inf and first NaN.
#[test]
#[ignore = "needs a GPU or the simulated device: scripts/test.sh runs it on the simulated device"]
fn tmux_drives_a_live_session_on_the_device() {
    if !common::device_or_skip() {
        return;
    }
    assert!(
        has_tmux(),
        "tmux is missing: scripts/test.sh installs it (as root) or says so"
    );
    run_script(&["--device"]);
}

#[test]
fn tmux_drives_a_live_session() {
    assert!(
        has_tmux(),
        "tmux is missing: scripts/test.sh installs it (as root) or says so"
    );
    run_script(&[]);
}

#[test]
fn without_a_terminal_it_refuses_with_a_message() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("t.jsonl");
    let run = Command::new(BIN)
        .args(["run", "samples/mlp.toml", "--trace"])
        .arg(&trace)
        .output()
        .unwrap();
    assert!(run.status.success());
    // stdout is a pipe here: drawing into it would be garbage, and ratatui would panic.
    let out = Command::new(BIN)
        .args(["tui", "--trace"])
        .arg(&trace)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("needs a terminal"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(out.stdout.is_empty());
}

#[test]
fn replay_needs_a_trace_and_run_flags_need_a_config() {
    let out = Command::new(BIN).arg("tui").output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--trace FILE"), "{err}");
    let out = Command::new(BIN)
        .args(["tui", "--trace", "x.jsonl", "--precision", "fp16"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("<CONFIG>"), "{err}");
    // A missing trace is named before the screen is taken over.
    let out = Command::new(BIN)
        .args(["tui", "--trace", "no/such/trace.jsonl"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no/such/trace.jsonl"), "{err}");
}
