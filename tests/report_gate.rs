//! The CI gate: every rule passing and failing through the binary (exit codes and the
//! printed lines), plain output when stdout is not a terminal, bad rules refused, and the
//! library API fed from a live run.

mod report_util;

use amprobe::report::gate::{self, Gate, Rule};
use amprobe::runner::{run, RunOptions};
use amprobe::trace::read_trace;
use amprobe::trace::record::{Phase, Record};
use report_util::{inject, mlp_trace};
use std::path::{Path, PathBuf};
use std::process::Command;

struct Traces {
    _dir: tempfile::TempDir,
    root: PathBuf,
    /// fp16, 3 clean steps.
    clean: PathBuf,
    /// fp16, 3 steps, a forward Inf in `fc2` at step 1 (skipped).
    forward_inf: PathBuf,
    /// fp16, 4 steps, a backward Inf in `relu` at step 2 (skipped).
    backward_inf: PathBuf,
    /// fp16, fixed loss scale 2^-20: gradients flush to zero, and the scale is below 1.
    tiny_scale: PathBuf,
}

fn traces() -> Traces {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().to_path_buf();
    let clean = mlp_trace(&root, "clean", "fp16", 3, vec![], |_| {});
    let forward_inf = mlp_trace(
        &root,
        "fwd",
        "fp16",
        3,
        vec![inject(1, "linear", "fc2", Phase::Forward, f32::INFINITY)],
        |_| {},
    );
    let backward_inf = mlp_trace(
        &root,
        "bwd",
        "fp16",
        4,
        vec![inject(2, "relu", "relu", Phase::Backward, f32::INFINITY)],
        |_| {},
    );
    let tiny_scale = mlp_trace(&root, "tiny", "fp16", 2, vec![], |c| {
        c.scaler.kind = Some("fixed".into());
        c.scaler.init_scale = Some(2f32.powi(-20));
    });
    Traces {
        _dir: dir,
        root,
        clean,
        forward_inf,
        backward_inf,
        tiny_scale,
    }
}

/// Runs `amprobe report TRACE --out DIR --fail-on RULES`: exit code and stdout lines.
fn gate_cli(t: &Traces, trace: &Path, rules: &str) -> (i32, Vec<String>) {
    let out = t.root.join(format!(
        "rep_{}",
        trace.file_stem().unwrap().to_string_lossy()
    ));
    let o = Command::new(env!("CARGO_BIN_EXE_amprobe"))
        .args([
            "report",
            trace.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--fail-on",
            rules,
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8(o.stdout).unwrap();
    assert!(
        !stdout.contains('\x1b'),
        "no colour codes when stdout is a pipe: {stdout:?}"
    );
    (
        o.status.code().unwrap(),
        stdout.lines().map(str::to_string).collect(),
    )
}

fn has(lines: &[String], want: &str) -> bool {
    lines.iter().any(|l| l == want)
}

fn json_lines(p: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(p)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn nonfinite_rule() {
    let t = traces();
    let (code, out) = gate_cli(&t, &t.clean, "nonfinite");
    assert_eq!(code, 0);
    assert!(
        has(&out, "ok   nonfinite: no forward Inf/NaN in 3 steps"),
        "{out:#?}"
    );
    assert!(has(&out, "gate: passed (1 rules)"));

    // A backward Inf (a normal overflow the scaler handles) does not break it.
    let (code, out) = gate_cli(&t, &t.backward_inf, "nonfinite");
    assert_eq!(code, 0, "{out:#?}");

    let (code, out) = gate_cli(&t, &t.forward_inf, "nonfinite");
    assert_eq!(code, 1);
    let k = json_lines(&t.forward_inf)[2]["ops"]
        .as_array()
        .unwrap()
        .iter()
        .find(|o| o["op"] == "linear" && o["module"] == "fc2" && o["phase"] == "forward")
        .unwrap()["index"]
        .as_u64()
        .unwrap();
    assert!(
        has(
            &out,
            &format!(
                "FAIL nonfinite: forward Inf first at step 1 forward op #{k} `linear` in `fc2` \
                 (1 of 3 steps with a forward Inf/NaN)"
            )
        ),
        "{out:#?}"
    );
    assert!(has(&out, "gate: 1 of 1 rules broken"));
}

#[test]
fn skip_rate_rule() {
    let t = traces();
    // One skipped step of three: 33.3%.
    let (code, out) = gate_cli(&t, &t.forward_inf, "skip-rate>33%");
    assert_eq!(code, 1);
    assert!(
        has(&out, "FAIL skip-rate>33%: 1 of 3 steps skipped (33.3%)"),
        "{out:#?}"
    );
    let (code, out) = gate_cli(&t, &t.forward_inf, "skip-rate>34%");
    assert_eq!(code, 0);
    assert!(has(
        &out,
        "ok   skip-rate>34%: 1 of 3 steps skipped (33.3%)"
    ));
    // One of four: 25%.
    let (code, out) = gate_cli(&t, &t.backward_inf, "skip-rate>20%");
    assert_eq!(code, 1);
    assert!(
        has(&out, "FAIL skip-rate>20%: 1 of 4 steps skipped (25.0%)"),
        "{out:#?}"
    );
    let (code, _) = gate_cli(&t, &t.clean, "skip-rate>0%");
    assert_eq!(code, 0);
}

#[test]
fn headroom_rule() {
    let t = traces();
    // The largest forward output of the clean fp16 run that ran in 16 bits (fp32 ops would
    // reach fp16's limits only if cast), scaler bookkeeping left out, from the trace JSON.
    let step0 = &json_lines(&t.clean)[1];
    let (m, op, module, idx) = step0["ops"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|o| {
            o["phase"] == "forward"
                && o["module"] != "scaler"
                && ["float16", "bfloat16"].contains(&o["output"]["dtype"].as_str().unwrap())
        })
        .map(|o| {
            (
                o["stats"]["max_abs"].as_f64().unwrap(),
                o["op"].as_str().unwrap().to_string(),
                o["module"].as_str().unwrap().to_string(),
                o["index"].as_u64().unwrap(),
            )
        })
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .unwrap();
    let pct = m / 65504.0 * 100.0;
    let below = format!("headroom>{}%", pct * 0.99);
    let above = format!("headroom>{}%", pct * 1.01);
    let (code, out) = gate_cli(&t, &t.clean, &below);
    assert_eq!(code, 1, "{out:#?}");
    let line = out
        .iter()
        .find(|l| l.starts_with("FAIL headroom>"))
        .unwrap();
    assert!(
        line.contains(&format!("at step 0 forward op #{idx} `{op}` in `{module}`")),
        "{line}"
    );
    let (code, out) = gate_cli(&t, &t.clean, &above);
    assert_eq!(code, 0);
    assert!(out.iter().any(|l| l.starts_with("ok   headroom>")));
    // An overflow in the forward pass is over any threshold.
    let (code, out) = gate_cli(&t, &t.forward_inf, "headroom>100%");
    assert_eq!(code, 1, "{out:#?}");
    assert!(
        out.iter().any(|l| l.starts_with(
            "FAIL headroom>100%: largest 16-bit forward output is over 100% (overflowed) of fp16's max at step 1 forward op"
        ) && l.contains("`linear` in `fc2`")),
        "{out:#?}"
    );
}

#[test]
fn underflow_rule() {
    let t = traces();
    // The worst backward op of the tiny-scale run: flushed / nonzero before rounding.
    let step0 = &json_lines(&t.tiny_scale)[1];
    let (share, idx, op, module) = step0["ops"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|o| o["phase"] == "backward")
        .map(|o| {
            let st = &o["stats"];
            let u = o["rounding"]["underflow"].as_u64().unwrap();
            let nonzero_after = st["numel"].as_u64().unwrap()
                - st["zeros"].as_u64().unwrap()
                - st["nan"].as_u64().unwrap()
                - st["pos_inf"].as_u64().unwrap()
                - st["neg_inf"].as_u64().unwrap();
            let before = nonzero_after + u;
            let share = if before == 0 {
                0.0
            } else {
                u as f64 / before as f64
            };
            (
                share,
                o["index"].as_u64().unwrap(),
                o["op"].as_str().unwrap().to_string(),
                o["module"].as_str().unwrap().to_string(),
            )
        })
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .unwrap();
    assert!(share > 0.5, "2^-20 flushes most gradients: {share}");
    let (code, out) = gate_cli(&t, &t.tiny_scale, "underflow>1%");
    assert_eq!(code, 1);
    assert!(
        has(
            &out,
            &format!(
                "FAIL underflow>1%: {:.1}% of the nonzero results of step 0 backward op #{idx} \
                 `{op}` in `{module}` flushed to zero in fp16",
                share * 100.0
            )
        ),
        "{out:#?}"
    );
    let (code, out) = gate_cli(&t, &t.clean, "underflow>0%");
    assert_eq!(code, 0);
    assert!(has(
        &out,
        "ok   underflow>0%: no gradient value lost to fp16 underflow in 3 steps"
    ));
}

#[test]
fn scale_collapse_rule() {
    let t = traces();
    let (code, out) = gate_cli(&t, &t.clean, "scale-collapse");
    assert_eq!(code, 0);
    assert!(has(&out, "ok   scale-collapse: no collapse in 3 steps"));
    let (code, out) = gate_cli(&t, &t.tiny_scale, "scale-collapse");
    assert_eq!(code, 1);
    let ev = json_lines(&t.tiny_scale)[1]["events"][0]
        .as_str()
        .unwrap()
        .to_string();
    assert!(ev.starts_with("loss scale collapsed below 1"), "{ev}");
    assert_eq!(
        json_lines(&t.tiny_scale)[1]["events"]
            .as_array()
            .unwrap()
            .len(),
        1
    );
    assert!(
        has(&out, &format!("FAIL scale-collapse: step 0: {ev}")),
        "{out:#?}"
    );
}

#[test]
fn several_rules_print_every_outcome_in_order() {
    let t = traces();
    let (code, out) = gate_cli(&t, &t.forward_inf, "scale-collapse,nonfinite,skip-rate>50%");
    assert_eq!(code, 1);
    let gate_lines: Vec<&String> = out
        .iter()
        .filter(|l| l.starts_with("ok ") || l.starts_with("FAIL"))
        .collect();
    assert_eq!(gate_lines.len(), 3);
    assert!(gate_lines[0].starts_with("ok   scale-collapse"));
    assert!(gate_lines[1].starts_with("FAIL nonfinite"));
    assert!(gate_lines[2].starts_with("ok   skip-rate>50%"));
    assert_eq!(out.last().unwrap(), "gate: 1 of 3 rules broken");
    // The report is still written.
    assert!(t.root.join("rep_fwd/index.html").exists());
}

#[test]
fn bad_rules_are_an_error_before_any_work() {
    let t = traces();
    for bad in ["nan", "skip-rate>lots", "headroom", "nonfinite>1%"] {
        let out = t.root.join("never");
        let o = Command::new(env!("CARGO_BIN_EXE_amprobe"))
            .args(["report", t.clean.to_str().unwrap(), "--out"])
            .arg(&out)
            .args(["--fail-on", bad])
            .output()
            .unwrap();
        assert_eq!(o.status.code(), Some(2), "{bad}");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains(&format!("--fail-on rule `{bad}`")), "{err}");
        assert!(!out.exists(), "nothing written for a bad rule");
    }
}

#[test]
fn library_evaluate_and_a_gate_fed_from_a_live_run_agree() {
    let t = traces();
    let trace = read_trace(&t.forward_inf).unwrap();
    let broken = gate::evaluate("nonfinite,skip-rate>10%,scale-collapse", &trace).unwrap();
    assert_eq!(
        broken.iter().map(|b| b.rule.clone()).collect::<Vec<_>>(),
        [Rule::NonFinite, Rule::SkipRate(10.0)]
    );
    assert!(broken[1]
        .message
        .starts_with("skip-rate>10%: 1 of 3 steps skipped"));

    // The same run, its records taken from the live channel while it trains.
    let mut cfg = amprobe::config::RunConfig::load(Path::new("samples/mlp.toml")).unwrap();
    cfg.train.precision = Some("fp16".into());
    cfg.train.steps = Some(3);
    let (tx, rx) = std::sync::mpsc::channel();
    let opts = RunOptions {
        injections: vec![inject(1, "linear", "fc2", Phase::Forward, f32::INFINITY)],
        live: Some(tx),
        ..RunOptions::default()
    };
    run(&cfg, &opts).unwrap();
    let rules =
        gate::parse_rules("nonfinite,skip-rate>10%,headroom>0.001%,underflow>0%,scale-collapse")
            .unwrap();
    let mut g = Gate::new(rules.clone()).unwrap();
    for r in rx.try_iter() {
        if let Record::Step(s) = r {
            g.observe(&s);
        }
    }
    assert_eq!(
        g.outcomes(),
        gate::evaluate_steps(&rules, &trace.steps).unwrap()
    );
}

/// `run --fail-on` gates the run it makes, with the same rules and exit codes as `report`.
#[test]
fn run_fail_on_gates_the_run() {
    let bin = env!("CARGO_BIN_EXE_amprobe");
    let ok = std::process::Command::new(bin)
        .args([
            "run",
            "samples/mlp.toml",
            "--fail-on",
            "nonfinite,skip-rate>10%",
        ])
        .output()
        .unwrap();
    assert_eq!(
        ok.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    let bad = std::process::Command::new(bin)
        .args([
            "run",
            "samples/t5_overflow.toml",
            "--steps",
            "1",
            "--fail-on",
            "nonfinite",
        ])
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(1));
    let out = String::from_utf8_lossy(&bad.stdout);
    assert!(out.contains("nonfinite"), "{out}");
    assert!(
        !out.contains('\u{1b}'),
        "no colours when stdout is not a terminal"
    );
    let typo = std::process::Command::new(bin)
        .args(["run", "samples/mlp.toml", "--fail-on", "nonfinit"])
        .output()
        .unwrap();
    assert_eq!(typo.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&typo.stderr).contains("nonfinit"));
}
