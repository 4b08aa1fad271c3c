//! `amprobe shrink`: on the T5, GPT-2, BERT and LLaMA samples (their own inputs and seeded
//! batches of 8 × 24) and on a failure that needs six steps of training, the smallest batch
//! it writes reproduces the first Inf/NaN at the same op, module and phase when run with
//! the command it prints; and it is 1-minimal — one row fewer, one position fewer, one step
//! fewer: none of them fails there. Each check is a plain `amprobe run` of its own.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

fn amprobe(dir: &Path, args: &[&str]) -> (i32, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_amprobe"))
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap();
    let out = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    (o.status.code().unwrap_or(-1), out)
}

fn sample(name: &str) -> String {
    std::path::absolute(Path::new("samples").join(name))
        .unwrap()
        .to_string_lossy()
        .into_owned()
}

/// (step, phase, op, module) of a run's first Inf/NaN origin, from its summary JSON.
fn first_origin(dir: &Path, args: &[String]) -> Option<(u64, String, String, String)> {
    let json = dir.join("origin.json");
    let _ = std::fs::remove_file(&json);
    let mut a: Vec<&str> = args.iter().map(String::as_str).collect();
    a.extend(["--summary-json", json.to_str().unwrap()]);
    let (code, out) = amprobe(dir, &a);
    assert_eq!(code, 0, "{a:?}: {out}");
    let s: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    ["first_inf", "first_nan"]
        .iter()
        .filter_map(|k| s[k].as_object())
        .map(|o| {
            (
                o["step"].as_u64().unwrap(),
                o["op_index"].as_u64().unwrap(),
                o["phase"].as_str().unwrap().to_string(),
                o["op"].as_str().unwrap().to_string(),
                o["module"].as_str().unwrap().to_string(),
            )
        })
        .min_by_key(|o| (o.0, o.1))
        .map(|(s, _, p, op, m)| (s, p, op, m))
}

/// The tensors of an inputs file: name → (shape, int64 values).
type Inputs = BTreeMap<String, (Vec<usize>, Vec<i64>)>;

fn read_inputs(path: &Path) -> Inputs {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(n, v)| {
            assert_eq!(v.dtype(), safetensors::Dtype::I64, "{n}");
            let vals = v
                .data()
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
                .collect();
            (n, (v.shape().to_vec(), vals))
        })
        .collect()
}

/// `inputs` without row `drop_row`, or cut to `seq` positions (tensors as long as
/// input_ids; an encoder–decoder's labels keep theirs).
fn cut(inputs: &Inputs, drop_row: Option<usize>, seq: Option<usize>, path: &Path) {
    let ids_shape = inputs["input_ids"].0.clone();
    let mut bufs: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, (shape, v)) in inputs {
        let width = shape[1];
        let along = shape == &ids_shape && name != "decoder_input_ids";
        let keep = if along { seq.unwrap_or(width) } else { width };
        let mut out = Vec::new();
        for r in (0..shape[0]).filter(|r| Some(*r) != drop_row) {
            out.extend(
                v[r * width..r * width + keep]
                    .iter()
                    .flat_map(|x| x.to_le_bytes()),
            );
        }
        let rows = shape[0] - usize::from(drop_row.is_some());
        bufs.push((name.clone(), vec![rows, keep], out));
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = bufs
        .iter()
        .map(|(n, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::I64, s.clone(), b)
                    .unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

/// Shrinks with `args`, then checks what the module docs promise; returns the shrunk
/// file's rows, sequence length and steps.
fn shrink_and_check(dir: &Path, args: &[&str]) -> (usize, usize, u64) {
    let out_file = dir.join("shrunk.safetensors");
    let mut a: Vec<&str> = vec!["shrink"];
    a.extend(args);
    a.extend(["--out", out_file.to_str().unwrap()]);
    let (code, out) = amprobe(dir, &a);
    assert_eq!(code, 0, "{out}");
    let original = {
        let mut r: Vec<String> = vec!["run".into()];
        r.extend(args.iter().map(|s| s.to_string()));
        first_origin(dir, &r).expect("the original run fails")
    };
    let line = out
        .lines()
        .skip_while(|l| !l.ends_with("reproduce with:"))
        .nth(1)
        .unwrap_or_else(|| panic!("no command in {out}"))
        .trim()
        .to_string();
    let words: Vec<String> = line.split_whitespace().map(str::to_string).collect();
    assert_eq!(words[0], "amprobe");
    let rerun = words[1..].to_vec();
    let got = first_origin(dir, &rerun).unwrap_or_else(|| panic!("`{line}` ran clean"));
    assert_eq!(
        (&got.1, &got.2, &got.3),
        (&original.1, &original.2, &original.3),
        "{line}"
    );
    let steps: u64 = words.last().unwrap().parse().unwrap();
    assert_eq!(got.0, steps - 1, "the failure is in the last step: {line}");

    let inputs = read_inputs(&out_file);
    let (rows, seq) = (inputs["input_ids"].0[0], inputs["input_ids"].0[1]);
    let same = |o: Option<(u64, String, String, String)>| {
        o.is_some_and(|o| {
            (o.1, o.2, o.3) == (original.1.clone(), original.2.clone(), original.3.clone())
        })
    };
    // With `--inputs FILE --steps N` last, a smaller file or count goes in their place.
    let with = |file: &Path, n: u64| {
        let mut w = rerun.clone();
        let k = w.len();
        w[k - 3] = file.to_string_lossy().into_owned();
        w[k - 1] = n.to_string();
        w
    };
    let smaller = dir.join("smaller.safetensors");
    if rows > 1 {
        for r in 0..rows {
            cut(&inputs, Some(r), None, &smaller);
            assert!(
                !same(first_origin(dir, &with(&smaller, steps))),
                "without row {r} it still fails: {line}"
            );
        }
    }
    if seq > 1 {
        cut(&inputs, None, Some(seq - 1), &smaller);
        assert!(
            !same(first_origin(dir, &with(&smaller, steps))),
            "with {} positions it still fails: {line}",
            seq - 1
        );
    }
    if steps > 1 {
        assert!(
            !same(first_origin(dir, &with(&out_file, steps - 1))),
            "in {} steps it still fails: {line}",
            steps - 1
        );
    }
    (rows, seq, steps)
}

#[test]
fn the_samples_shrink_to_a_minimal_batch_that_fails_at_the_same_op() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    for s in ["t5_overflow", "gpt2_overflow", "bert_overflow"] {
        let cfg = sample(&format!("{s}.toml"));
        let (rows, seq, steps) = shrink_and_check(d, &[&cfg]);
        assert_eq!(rows, 1, "{s}");
        assert!(
            seq < 12 && steps == 1,
            "{s}: {seq} positions, {steps} steps"
        );
    }
}

#[test]
fn seeded_batches_of_eight_rows_shrink_too() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    for s in [
        "t5_overflow_small",
        "gpt2_overflow_tiny",
        "bert_overflow_tiny",
        "llama_overflow_tiny",
    ] {
        let hf = sample(s);
        let (rows, seq, _) = shrink_and_check(
            d,
            &[
                "--hf",
                &hf,
                "--batch",
                "8",
                "--seq",
                "24",
                "--precision",
                "fp16",
            ],
        );
        assert!(rows < 8 && seq < 24, "{s}: {rows} × {seq}");
    }
}

#[test]
fn a_failure_that_needs_training_keeps_its_steps() {
    // GPT-2 with its fp16 fix and a learning rate of 1: the first Inf comes in the
    // backward of step 5, after training on the batch; fewer steps or a smaller batch do
    // not make it.
    let dir = tempfile::tempdir().unwrap();
    let cfg = sample("gpt2_overflow.toml");
    let (_, _, steps) = shrink_and_check(
        dir.path(),
        &[
            &cfg,
            "--switch",
            "reorder_and_upcast_attn",
            "--lr",
            "1",
            "--steps",
            "6",
        ],
    );
    assert_eq!(steps, 6);
}

#[test]
fn what_shrink_cannot_do_is_said() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (code, out) = amprobe(
        d,
        &["shrink", &sample("t5_overflow.toml"), "--precision", "bf16"],
    );
    assert_eq!(code, 2, "{out}");
    assert!(
        out.contains("no Inf or NaN in 3 step(s): nothing to shrink"),
        "{out}"
    );
    let (code, out) = amprobe(d, &["shrink", &sample("mlp.toml")]);
    assert_eq!(code, 2, "{out}");
    assert!(
        out.contains(
            "shrink cuts token batches (int64 [batch, seq] input ids); this model's \
             inputs are float32 [16, 100]"
        ),
        "{out}"
    );
    let (code, out) = amprobe(
        d,
        &["shrink", &sample("t5_overflow.toml"), "--accumulate", "2"],
    );
    assert_eq!(code, 2, "{out}");
    assert!(out.contains("--accumulate 1"), "{out}");
}
