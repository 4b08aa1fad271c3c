//! `amprobe tui|compare|fix -- CMD`: the arguments each form takes and refuses, and a
//! command that writes no trace, checked without PyTorch (the runs of real scripts are in
//! python/tests/test_script_forms.py).

use std::process::{Command, Output, Stdio};

fn amprobe(dir: &std::path::Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_amprobe"))
        .args(args)
        .current_dir(dir)
        .stdin(Stdio::null())
        .output()
        .expect("amprobe runs")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Refused with exit code 2 and a message containing `words`.
fn refused(args: &[&str], words: &str) {
    let d = tempfile::tempdir().unwrap();
    let o = amprobe(d.path(), args);
    let e = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{args:?}: {e}");
    assert!(e.contains(words), "{args:?}: {e}");
}

#[test]
fn each_form_refuses_what_does_not_apply_to_a_script() {
    let cmd = ["--", "sh", "-c", "exit 0"];
    let with =
        |pre: &[&'static str]| -> Vec<&'static str> { pre.iter().chain(&cmd).copied().collect() };
    refused(
        &with(&["compare", "a.jsonl", "b.jsonl", "--out", "x"]),
        "cannot be used with",
    );
    refused(
        &with(&["compare", "--reference", "1"]),
        "cannot be used with",
    );
    refused(
        &[
            "compare", "a.jsonl", "b.jsonl", "--out", "x", "--steps", "3",
        ],
        "--steps",
    );
    refused(
        &with(&["compare", "--steps", "0"]),
        "expected at least 1 step",
    );
    refused(&with(&["fix", "run.toml"]), "cannot be used with");
    refused(&with(&["fix", "--steps", "3"]), "only --out DIR");
    refused(&with(&["fix", "--trace", "t.jsonl"]), "only --out DIR");
    refused(&["fix", "--out", "d", "run.toml"], "--out");
    refused(&with(&["fix", "--fail-on", "nonfinite"]), "--fail-on");
    refused(&with(&["tui", "run.toml"]), "cannot be used with");
    refused(
        &with(&["tui", "--follow", "--trace", "t.jsonl"]),
        "cannot be used with",
    );
    refused(&with(&["tui", "--precision", "bf16"]), "only --trace");
    refused(&with(&["tui", "--summary-json", "s.json"]), "only --trace");
}

#[test]
fn a_command_that_writes_no_trace_says_what_is_missing() {
    let d = tempfile::tempdir().unwrap();
    for form in [&["compare"][..], &["fix"]] {
        let args: Vec<&str> = form
            .iter()
            .copied()
            .chain(["--", "sh", "-c", "echo planted output; exit 0"])
            .collect();
        let o = amprobe(d.path(), &args);
        let e = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{form:?}: {e}");
        assert!(
            e.contains("wrote no trace") && e.contains("amprobe_torch.watch"),
            "{form:?}: {e}"
        );
        // Its output went to its log, and the message shows it.
        assert!(e.contains("planted output"), "{form:?}: {e}");
    }
    let o = amprobe(d.path(), &["compare", "--", "/nonexistent/python"]);
    assert!(
        stderr(&o).contains("running `/nonexistent/python`"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn tui_without_a_terminal_refuses_before_starting_the_script() {
    let d = tempfile::tempdir().unwrap();
    let marker = d.path().join("started");
    let body = format!("touch '{}'", marker.display());
    let o = amprobe(d.path(), &["tui", "--", "sh", "-c", &body]);
    assert_ne!(o.status.code(), Some(0));
    assert!(stderr(&o).contains("needs a terminal"), "{}", stderr(&o));
    // --sample-every is for the script: taken, not refused.
    let o = amprobe(
        d.path(),
        &["tui", "--sample-every", "2", "--", "sh", "-c", &body],
    );
    assert!(stderr(&o).contains("needs a terminal"), "{}", stderr(&o));
    assert!(!marker.exists(), "the script was not started");
}
