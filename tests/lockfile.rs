//! The numerics lockfile: `amprobe baseline` writes it, `--fail-on drift` holds later runs
//! to it. Rerunning the same config passes; dependency-like changes — a larger init, a
//! GELU with another formula, attention without the 1/√d scale, another loss scale, a
//! planted Inf — break the rule and the findings name the op and module where the run
//! first left its envelope. Tolerances are read from the file.

mod report_util;

use amprobe::report::drift::{DriftCheck, DriftKind};
use amprobe::report::lockfile::{Lock, LockBuilder, UnmatchedOps};
use amprobe::trace::read_trace;
use amprobe::trace::record::Phase;
use report_util::{inject, mlp_trace};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Runs amprobe with `args` in `dir`: exit code and stdout.
fn amprobe(dir: &Path, args: &[&str]) -> (i32, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_amprobe"))
        .args(args)
        .current_dir(dir)
        .env("NO_COLOR", "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8(o.stdout).unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    (o.status.code().unwrap_or(-1), format!("{stdout}{stderr}"))
}

fn sample(name: &str) -> String {
    std::path::absolute(Path::new("samples").join(name))
        .unwrap()
        .to_string_lossy()
        .into_owned()
}

/// The `drift=` gate line and the detail lines under it.
fn drift_lines(out: &str) -> Vec<&str> {
    let mut lines = out.lines().skip_while(|l| !l.contains("drift="));
    let mut v: Vec<&str> = lines.next().into_iter().collect();
    v.extend(
        lines
            .take_while(|l| l.starts_with("       "))
            .map(str::trim),
    );
    v
}

/// A copy of a sample checkpoint folder with its config.json edited.
fn edited_checkpoint(dir: &Path, sample_dir: &str, from: &str, to: &str) -> PathBuf {
    let out = dir.join(format!("{sample_dir}-edited"));
    std::fs::create_dir_all(&out).unwrap();
    for f in ["config.json", "model.safetensors", "inputs.safetensors"] {
        std::fs::copy(Path::new("samples").join(sample_dir).join(f), out.join(f)).unwrap();
    }
    let cfg = std::fs::read_to_string(out.join("config.json")).unwrap();
    assert!(cfg.contains(from), "{from} not in {sample_dir}/config.json");
    std::fs::write(out.join("config.json"), cfg.replace(from, to)).unwrap();
    out
}

/// The seed MLP's initial weights with every weight matrix times `k`.
fn scaled_init(dir: &Path, k: f32) -> PathBuf {
    let bytes = std::fs::read("samples/seed_mlp/init.safetensors").unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut data: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, view) in st.tensors() {
        assert_eq!(view.dtype(), safetensors::Dtype::F32);
        let vals: Vec<u8> = view
            .data()
            .chunks_exact(4)
            .flat_map(|c| {
                let x = f32::from_le_bytes(c.try_into().unwrap());
                let y = if name.ends_with("weight") { x * k } else { x };
                y.to_le_bytes()
            })
            .collect();
        data.push((name.clone(), view.shape().to_vec(), vals));
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = data
        .iter()
        .map(|(n, s, d)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), d)
                    .unwrap(),
            )
        })
        .collect();
    let path = dir.join(format!("init-x{k}.safetensors"));
    safetensors::serialize_to_file(views, None, &path).unwrap();
    path
}

#[test]
fn rerunning_the_same_config_passes_and_a_larger_init_does_not() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let mlp = sample("mlp.toml");
    let (code, out) = amprobe(d, &["baseline", &mlp, "--steps", "3"]);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("lockfile: amprobe.lock (32 ops over 3 step(s)"),
        "{out}"
    );
    let lock = Lock::read(&d.join("amprobe.lock")).unwrap();
    assert_eq!(lock.precision, "fp16");
    assert_eq!(lock.envelopes.scale.len(), 3);

    let (code, out) = amprobe(d, &["run", &mlp, "--steps", "3", "--fail-on", "drift"]);
    assert_eq!(code, 0, "{out}");
    assert!(
        drift_lines(&out)[0].starts_with(
            "ok   drift=amprobe.lock: every op within its envelope in amprobe.lock (32 of the \
             lock's 32 ops checked over 3 steps"
        ),
        "{out}"
    );

    // Weights four times larger: the first op out of its envelope is fc1's weight cast.
    let big = scaled_init(d, 4.0);
    let big = big.to_str().unwrap();
    let (code, out) = amprobe(
        d,
        &[
            "run",
            &mlp,
            "--steps",
            "3",
            "--weights",
            big,
            "--fail-on",
            "drift",
        ],
    );
    assert_eq!(code, 1, "{out}");
    let lines = drift_lines(&out);
    assert!(lines[0].starts_with("FAIL drift=amprobe.lock: "), "{out}");
    assert!(
        lines[1].contains("forward `to` in `fc1` #2: max |x|")
            && lines[1].contains("the lock allows ×2"),
        "{out}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.contains("forward `linear` in `fc2`: max |x|")),
        "{out}"
    );

    // Twice larger breaks the default factor 2, not a factor of 4 written into the file.
    let twice = scaled_init(d, 2.0);
    let twice = twice.to_str().unwrap();
    let args = |lock: &'static str| {
        [
            "run",
            &mlp,
            "--steps",
            "3",
            "--weights",
            twice,
            "--fail-on",
            lock,
        ]
        .map(str::to_string)
    };
    let run = |lock| {
        let a = args(lock);
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        amprobe(d, &a)
    };
    assert_eq!(run("drift").0, 1);
    let text = std::fs::read_to_string(d.join("amprobe.lock")).unwrap();
    assert!(text.contains("\nmax_abs_factor = 2.0\n"));
    std::fs::write(
        d.join("loose.lock"),
        text.replace("\nmax_abs_factor = 2.0\n", "\nmax_abs_factor = 4.0\n"),
    )
    .unwrap();
    let (code, out) = run("drift=loose.lock");
    assert_eq!(code, 0, "{out}");
}

#[test]
fn a_trace_gives_the_same_lock_as_the_run_and_a_report_gets_a_section() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let mlp = sample("mlp.toml");
    let (code, out) = amprobe(
        d,
        &[
            "run",
            &mlp,
            "--steps",
            "2",
            "--sample-every",
            "1",
            "--trace",
            "t.jsonl",
        ],
    );
    assert_eq!(code, 0, "{out}");
    let (code, out) = amprobe(d, &["baseline", "--from", "t.jsonl", "--out", "a.lock"]);
    assert_eq!(code, 0, "{out}");
    let (code, out) = amprobe(d, &["baseline", &mlp, "--steps", "2", "--out", "b.lock"]);
    assert_eq!(code, 0, "{out}");
    let a = std::fs::read_to_string(d.join("a.lock")).unwrap();
    assert_eq!(a, std::fs::read_to_string(d.join("b.lock")).unwrap());

    // Another loss scale: every step off the lock's path, in the report's section too.
    let (code, out) = amprobe(
        d,
        &[
            "run",
            &mlp,
            "--steps",
            "2",
            "--init-scale",
            "1024",
            "--trace",
            "s.jsonl",
        ],
    );
    assert_eq!(code, 0, "{out}");
    let (code, out) = amprobe(
        d,
        &[
            "report",
            "s.jsonl",
            "--out",
            "rep",
            "--fail-on",
            "drift=a.lock",
        ],
    );
    assert_eq!(code, 1, "{out}");
    let lines = drift_lines(&out);
    assert!(
        lines[0].contains("2 steps off the loss-scale path"),
        "{out}"
    );
    assert_eq!(
        lines[1],
        "step 0: loss scale 1024 (the lock's 65536); scale after the update 1024 (the lock's 65536)"
    );
    let md = std::fs::read_to_string(d.join("rep/summary.md")).unwrap();
    assert!(md.contains("# CI gate"), "{md}");
    assert!(md.contains("drift=a.lock: findings"), "{md}");
    assert!(
        md.contains("step 1: loss scale 1024 (the lock's 65536)"),
        "{md}"
    );
}

#[test]
fn gpt2_attention_without_its_scale_and_another_gelu_are_caught() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let gpt2 = sample("gpt2_overflow.toml");
    // bf16: the sample's clean precision.
    let (code, out) = amprobe(d, &["baseline", &gpt2, "--precision", "bf16"]);
    assert_eq!(code, 0, "{out}");
    let (code, out) = amprobe(
        d,
        &["run", &gpt2, "--precision", "bf16", "--fail-on", "drift"],
    );
    assert_eq!(code, 0, "{out}");

    // The sample's checkpoint with one field of config.json edited, held to the lock.
    let edited_run = |from: &str, to: &str| {
        let hf = edited_checkpoint(d, "gpt2_overflow_tiny", from, to);
        let hf = hf.to_str().unwrap();
        let args = [
            "run",
            &gpt2,
            "--hf",
            hf,
            "--precision",
            "bf16",
            "--fail-on",
            "drift",
        ];
        amprobe(d, &args)
    };

    // Scores without 1/√8: the first op out of its envelope is block 0's score scaling.
    let (code, out) = edited_run(
        "\"scale_attn_weights\": true",
        "\"scale_attn_weights\": false",
    );
    assert_eq!(code, 1, "{out}");
    let lines = drift_lines(&out);
    assert!(
        lines[1].starts_with("step 0: forward `mul` in `transformer.h.0.attn`: max |x|"),
        "{out}"
    );

    // The exact GELU in one op instead of GPT-2's tanh formula op by op: the activation's
    // ops change, and its output stays bf16 where the formula's `pow` made it fp32.
    let (code, out) = edited_run(
        "\"activation_function\": \"gelu_new\"",
        "\"activation_function\": \"gelu\"",
    );
    assert_eq!(code, 1, "{out}");
    let lines = drift_lines(&out);
    assert_eq!(
        lines[1],
        "step 0: forward `gelu` in `transformer.h.0.mlp.act` is not in the lock"
    );
    assert!(
        lines[2].starts_with("11 forward ops of the lock in `transformer.h.0.mlp.act` did not run"),
        "{out}"
    );
    assert!(
        lines.contains(
            &"step 0: forward `view` in `transformer.h.0.mlp.c_proj`: output dtype bfloat16 \
              (the lock's float32)"
        ),
        "{out}"
    );
}

#[test]
fn an_overflowing_baseline_reproduces_and_a_new_inf_breaks_its_envelope() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // T5's fp16 overflow: the lock holds the Inf and NaN; the same run matches it.
    let t5 = sample("t5_overflow.toml");
    let (code, out) = amprobe(d, &["baseline", &t5]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("already hold NaN/Inf values"), "{out}");
    let (code, out) = amprobe(d, &["run", &t5, "--fail-on", "drift"]);
    assert_eq!(code, 0, "{out}");

    // A planted Inf in fc2's forward at step 1 of the MLP, held to a clean lock.
    let clean = mlp_trace(d, "clean", "fp16", 3, vec![], |c| {
        c.probe.sample_every = Some(1)
    });
    let inf = mlp_trace(
        d,
        "inf",
        "fp16",
        3,
        vec![inject(1, "linear", "fc2", Phase::Forward, f32::INFINITY)],
        |c| c.probe.sample_every = Some(1),
    );
    let t = read_trace(&clean).unwrap();
    let mut b = LockBuilder::new(&t.header);
    for s in &t.steps {
        b.observe(s);
    }
    let mut lock = b.finish();
    let run = read_trace(&inf).unwrap();
    let check = |lock: Lock| {
        let mut c = DriftCheck::new(Path::new("x.lock"), lock);
        c.observe_header(&run.header);
        for s in &run.steps {
            c.observe(s);
        }
        c
    };
    let c = check(lock.clone());
    let f = c.findings();
    let first = &f[0];
    assert_eq!(first.kind, DriftKind::NonFinite);
    let k = first.op.as_ref().unwrap();
    assert_eq!((k.op.as_str(), k.module.as_str()), ("linear", "fc2"));
    assert_eq!(first.step, Some(1));
    assert!(
        first.message.contains("where the lock has none"),
        "{first:?}"
    );
    // The skipped step is off the scale path.
    assert!(f
        .iter()
        .any(|x| x.kind == DriftKind::Scale && x.message.starts_with("step 1: skipped")));
    let (broken, line, _) = c.outcome();
    assert!(broken, "{line}");

    // With Inf allowed and the scale path not checked, what remains is the ops' figures.
    lock.tolerances.new_nonfinite = false;
    lock.tolerances.scale_path = false;
    lock.tolerances.unmatched_ops = UnmatchedOps::Ignore;
    let c = check(lock);
    assert!(c
        .findings()
        .iter()
        .all(|x| !matches!(x.kind, DriftKind::NonFinite | DriftKind::Scale)));
}

#[test]
fn bad_lockfiles_and_rules_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let mlp = sample("mlp.toml");
    let (code, out) = amprobe(d, &["run", &mlp, "--fail-on", "drift=missing.lock"]);
    assert_eq!(code, 2, "{out}");
    assert!(
        out.contains("lockfile missing.lock: cannot be read")
            && out.contains("`amprobe baseline` writes one"),
        "{out}"
    );
    let (code, out) = amprobe(d, &["run", &mlp, "--fail-on", "drift="]);
    assert_eq!(code, 2, "{out}");
    assert!(out.contains("no lockfile after `=`"), "{out}");
    std::fs::write(d.join("bad.lock"), "lock_version = 1\nmodel = 3\n").unwrap();
    let (code, out) = amprobe(d, &["run", &mlp, "--fail-on", "drift=bad.lock"]);
    assert_eq!(code, 2, "{out}");
    assert!(
        out.contains("lockfile bad.lock") && out.contains("model"),
        "{out}"
    );
    // A run that keeps no op records cannot be held to a lock.
    let (code, out) = amprobe(d, &["baseline", &mlp, "--steps", "1"]);
    assert_eq!(code, 0, "{out}");
    let (code, out) = amprobe(d, &["run", &mlp, "--no-probes", "--fail-on", "drift"]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("no step has op records"), "{out}");
}

#[test]
fn a_lock_holds_across_the_machines_kernels_and_the_fixed_order_ones() {
    // T5-mini (the CPU bench's size): products large enough for the machine's fastest
    // kernels, whose last bits differ from the fixed-order ones — the difference another
    // machine makes. Single fp16 values then flush on one side and not the other, which
    // `new_flush_share` is above.
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let text = std::fs::read_to_string("samples/t5_overflow_small/config.json").unwrap();
    let mut cfg: serde_json::Value = serde_json::from_str(&text).unwrap();
    for (k, v) in [
        ("d_model", 256),
        ("d_ff", 1024),
        ("num_layers", 4),
        ("num_heads", 4),
        ("d_kv", 64),
        ("vocab_size", 512),
    ] {
        cfg[k] = v.into();
    }
    std::fs::write(d.join("t5mini.json"), cfg.to_string()).unwrap();
    for p in ["fp32", "fp16", "bf16"] {
        let mut ops = Vec::new();
        for (lock_mode, run_mode) in [(false, true), (true, false)] {
            let args = |reproducible: bool, rest: &[&str]| {
                let mut a: Vec<String> = Vec::new();
                if reproducible {
                    a.push("--reproducible".into());
                }
                a.extend(rest.iter().map(|s| s.to_string()));
                a.extend(
                    [
                        "--hf-config",
                        "t5mini.json",
                        "--batch",
                        "8",
                        "--seq",
                        "128",
                        "--steps",
                        "2",
                        "--precision",
                        p,
                    ]
                    .map(str::to_string),
                );
                a
            };
            let a = args(lock_mode, &["baseline", "--out", "m.lock"]);
            let (code, out) = amprobe(d, &a.iter().map(String::as_str).collect::<Vec<_>>());
            assert_eq!(code, 0, "{out}");
            let trace = format!("r{lock_mode}.jsonl");
            let a = args(
                run_mode,
                &["run", "--fail-on", "drift=m.lock", "--trace", &trace],
            );
            let (code, out) = amprobe(d, &a.iter().map(String::as_str).collect::<Vec<_>>());
            assert_eq!(code, 0, "{p}, lock reproducible {lock_mode}: {out}");
            let t = read_trace(d.join(&trace)).unwrap();
            ops.push(t.steps.into_iter().map(|s| s.ops).collect::<Vec<_>>());
        }
        assert_ne!(
            ops[0], ops[1],
            "{p}: the two kinds of kernels gave the same op records: the test shows nothing"
        );
    }
}
