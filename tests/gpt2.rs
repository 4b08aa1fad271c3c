//! GPT-2 held to PyTorch: a tiny GPT2LMHeadModel with an fp16 overflow planted in block 1's
//! attention scores (tests/golden/gpt2_tiny, made by scripts/make_gpt2.py with PyTorch and
//! transformers). The fp32 forward matches module by module, the fp32 loss and every
//! parameter's gradient match, and the first Inf / NaN land where transformers finds them,
//! with and without each of transformers' fp16 switches.

use amprobe::config::RunConfig;
use amprobe::runner::build;
use amprobe::trace::record::{OpRecord, Phase, StepRecord};
use amprobe::train::Trainer;
use std::path::{Path, PathBuf};

const DIR: &str = "tests/golden/gpt2_tiny";

fn expected() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(Path::new(DIR).join("expected.json")).unwrap())
        .unwrap()
}

fn within(path: &str, module: &str) -> bool {
    path == module || path.starts_with(&format!("{module}."))
}

fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs().max(1e-30)
}

/// One training step of the tiny GPT-2 in `precision`, with `switch` set in its config.json
/// (written to a temporary copy) when given.
fn step(precision: &str, switch: Option<&str>, tmp: &Path) -> StepRecord {
    let dir = PathBuf::from(DIR);
    let mut cfg = RunConfig::default();
    match switch {
        None => cfg.model.hf = Some(dir.clone()),
        Some(flag) => {
            let mut c: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap())
                    .unwrap();
            c[flag] = serde_json::Value::Bool(true);
            let path = tmp.join(format!("config-{flag}.json"));
            std::fs::write(&path, c.to_string()).unwrap();
            cfg.model.hf_config = Some(path);
            cfg.model.weights = Some(dir.join("model.safetensors"));
        }
    }
    cfg.data.inputs = Some(dir.join("inputs.safetensors"));
    cfg.train.precision = Some(precision.into());
    cfg.train.policy = Some("cpu".into());
    let train = cfg.train_config().unwrap();
    let (m, p, d) = build(&cfg, &train).unwrap();
    let mut t = Trainer::new(train, m, p, d).unwrap();
    t.step(0).unwrap()
}

fn forward_ops(rec: &StepRecord) -> Vec<OpRecord> {
    rec.ops
        .clone()
        .unwrap()
        .into_iter()
        .filter(|o| o.phase == Phase::Forward)
        .collect()
}

#[test]
fn the_architecture_comes_from_config_json() {
    let cfg = RunConfig {
        model: amprobe::config::ModelSection {
            hf: Some(DIR.into()),
            ..Default::default()
        },
        ..Default::default()
    };
    let train = cfg.train_config().unwrap();
    let (m, _, _) = build(&cfg, &train).unwrap();
    assert!(
        m.describe().starts_with("gpt2 n_embd 32"),
        "{}",
        m.describe()
    );
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("config.json");
    std::fs::write(&path, r#"{"model_type": "mamba", "vocab_size": 8}"#).unwrap();
    let err = amprobe::runner::architecture(&path)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("`mamba` is not supported") && err.contains("`gpt2`") && err.contains("`t5`"),
        "{err}"
    );
}

#[test]
fn fp32_forward_loss_and_gradients_match_pytorch() {
    let exp = expected();
    let tmp = tempfile::tempdir().unwrap();
    let rec = step("fp32", None, tmp.path());
    let ops = forward_ops(&rec);
    let mut checked = 0;
    for m in exp["fp32_module_trace"].as_array().unwrap() {
        let module = m["module"].as_str().unwrap();
        // A module's output is the last op that ran inside it (dropout with p = 0 runs none).
        let Some(op) = ops.iter().rfind(|o| within(&o.module, module)) else {
            assert!(
                module.ends_with("drop") || module.ends_with("dropout"),
                "no op ran inside {module}"
            );
            continue;
        };
        let shape: Vec<usize> = m["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as usize)
            .collect();
        assert_eq!(op.output.shape, shape, "{module}");
        let (max, l2) = (m["max_abs"].as_f64().unwrap(), m["l2"].as_f64().unwrap());
        assert!(
            rel(op.stats.max_abs, max) <= 1e-5,
            "{module}: max|x| {} vs PyTorch {max} (op {})",
            op.stats.max_abs,
            op.op
        );
        assert!(
            rel(op.stats.sum_sq.sqrt(), l2) <= 1e-5,
            "{module}: L2 {} vs PyTorch {l2} (op {})",
            op.stats.sum_sq.sqrt(),
            op.op
        );
        checked += 1;
    }
    let modules = exp["fp32_module_trace"].as_array().unwrap();
    let outside_dropout = modules
        .iter()
        .filter(|m| {
            !m["module"].as_str().unwrap().ends_with("drop")
                && !m["module"].as_str().unwrap().ends_with("dropout")
        })
        .count();
    assert_eq!(checked, outside_dropout, "modules compared");
    let loss = exp["fp32_loss"].as_f64().unwrap();
    let got = rec.loss.expect("a finite fp32 loss");
    assert!(rel(got, loss) <= 1e-5, "loss {got} vs PyTorch {loss}");
    let grads = exp["fp32_grads"].as_object().unwrap();
    let mut seen = 0;
    for p in &rec.params {
        let g = &grads[&p.name];
        let (l2, max) = (g["l2"].as_f64().unwrap(), g["max_abs"].as_f64().unwrap());
        assert!(
            rel(p.grad_l2, l2) <= 1e-4,
            "{}: |g| {} vs PyTorch {l2}",
            p.name,
            p.grad_l2
        );
        assert!(
            rel(p.max_abs_grad, max) <= 1e-4,
            "{}: max|g| {} vs PyTorch {max}",
            p.name,
            p.max_abs_grad
        );
        seen += 1;
    }
    // PyTorch's named_parameters lists the tied head once, as wte.
    assert_eq!(seen, grads.len(), "parameters compared");
}

#[test]
fn the_first_inf_and_nan_are_where_transformers_finds_them() {
    let exp = expected();
    let tmp = tempfile::tempdir().unwrap();
    let block = exp["planted"]["block"].as_u64().unwrap();
    let attn = format!("transformer.h.{block}.attn");
    for (variant, switch) in [
        ("plain", None),
        ("reorder_and_upcast_attn", Some("reorder_and_upcast_attn")),
        (
            "scale_attn_by_inverse_layer_idx",
            Some("scale_attn_by_inverse_layer_idx"),
        ),
    ] {
        for (scenario, precision) in [
            ("fp32", "fp32"),
            ("autocast_fp16", "fp16"),
            ("autocast_bf16", "bf16"),
            ("fp16_half", "half"),
        ] {
            let tag = format!("{variant}/{scenario}");
            let sc = &exp["variants"][variant][scenario];
            let rec = step(precision, switch, tmp.path());
            let ops = forward_ops(&rec);
            let inf = ops
                .iter()
                .find(|o| o.stats.pos_inf + o.stats.neg_inf > o.masked_neg_inf);
            let nan = ops.iter().find(|o| o.stats.nan > 0);
            match sc["first_nan"].as_str() {
                // transformers' hooks see module outputs only: the first NaN surfaces at
                // the output projection, the Inf inside the attention function not at all.
                // amprobe names the op: the score product overflows, softmax makes NaN.
                Some(m) => {
                    let n = nan
                        .unwrap_or_else(|| panic!("{tag}: no NaN, transformers finds one in {m}"));
                    assert!(
                        within(m, &n.module),
                        "{tag}: first NaN in `{}`, transformers says `{m}`",
                        n.module
                    );
                    let i = inf.unwrap_or_else(|| panic!("{tag}: no Inf before the NaN"));
                    assert_eq!(
                        (i.op.as_str(), i.module.as_str()),
                        ("matmul", attn.as_str()),
                        "{tag}"
                    );
                    assert_eq!(
                        (n.op.as_str(), n.module.as_str()),
                        ("softmax", attn.as_str()),
                        "{tag}"
                    );
                    assert!(
                        rec.loss.is_none_or(f64::is_nan),
                        "{tag}: loss {:?}",
                        rec.loss
                    );
                }
                None => {
                    assert!(
                        nan.is_none(),
                        "{tag}: unexpected NaN in `{}`",
                        nan.unwrap().module
                    );
                    assert!(
                        inf.is_none(),
                        "{tag}: unexpected Inf in `{}`",
                        inf.unwrap().module
                    );
                    let want = sc["loss"].as_f64().unwrap();
                    let tol = if scenario == "fp32" { 1e-5 } else { 2e-3 };
                    let got = rec.loss.expect("a finite loss");
                    assert!(rel(got, want) <= tol, "{tag}: loss {got} vs PyTorch {want}");
                }
            }
            assert!(
                sc["first_inf"].is_null(),
                "{tag}: the golden's hooks saw an Inf"
            );
        }
    }
}

/// A re-run of a step (as `fix` and `bisect` make) sees the labels shifted once, as the
/// step did: same loss, bit for bit.
#[test]
fn a_replayed_step_has_the_steps_loss() {
    let dir = PathBuf::from(DIR);
    let mut cfg = RunConfig::default();
    cfg.model.hf = Some(dir.clone());
    cfg.data.inputs = Some(dir.join("inputs.safetensors"));
    cfg.train.precision = Some("bf16".into());
    cfg.train.policy = Some("cpu".into());
    let train = cfg.train_config().unwrap();
    let (m, p, d) = build(&cfg, &train).unwrap();
    let mut t = Trainer::new(train, m, p, d).unwrap();
    let rec = t.step(0).unwrap();
    let again = t.replay(&amprobe::train::Variant::default()).unwrap();
    let (a, b) = (rec.loss.unwrap(), again.record.loss.unwrap());
    assert_eq!(a.to_bits(), b.to_bits(), "step loss {a}, replayed {b}");
}

/// transformers' two fp16 switches as remedies: a re-run of the failing fp16 step with each
/// turned on is finite exactly where PyTorch's forward with it is (reorder_and_upcast_attn
/// computes the scores in fp32; scale_attn_by_inverse_layer_idx divides them only after the
/// product has overflowed).
#[test]
fn each_switch_fixes_the_step_where_it_fixes_pytorchs_forward() {
    let exp = expected();
    let dir = PathBuf::from(DIR);
    let mut cfg = RunConfig::default();
    cfg.model.hf = Some(dir.clone());
    cfg.data.inputs = Some(dir.join("inputs.safetensors"));
    cfg.train.precision = Some("fp16".into());
    cfg.train.policy = Some("cpu".into());
    let train = cfg.train_config().unwrap();
    let (m, p, d) = build(&cfg, &train).unwrap();
    let mut t = Trainer::new(train, m, p, d).unwrap();
    assert!(t.step(0).unwrap().skipped, "the plain fp16 step overflows");
    let switches = t.model().fp16_switches();
    assert_eq!(switches.len(), 2);
    for (name, _) in switches {
        let r = t
            .replay(&amprobe::train::Variant {
                switches: vec![name.to_string()],
                ..Default::default()
            })
            .unwrap();
        let pytorch_finite = exp["variants"][name]["autocast_fp16"]["first_nan"].is_null();
        let finite = !r.record.skipped && r.record.loss.is_some_and(f64::is_finite);
        assert_eq!(
            finite, pytorch_finite,
            "{name}: amprobe finite {finite}, PyTorch {pytorch_finite}"
        );
    }
}

#[test]
fn fix_tries_the_switches_and_run_takes_them() {
    let bin = env!("CARGO_BIN_EXE_amprobe");
    let out = std::process::Command::new(bin)
        .args(["fix", "samples/gpt2_overflow.toml"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("FIXES IT: transformers' `reorder_and_upcast_attn`")
            && text.contains("does not fix it: transformers' `scale_attn_by_inverse_layer_idx`")
            && text.contains("Flags: --switch reorder_and_upcast_attn"),
        "{text}"
    );
    let out = std::process::Command::new(bin)
        .args([
            "run",
            "samples/gpt2_overflow.toml",
            "--switch",
            "reorder_and_upcast_attn",
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("verdict: clean"),
        "{text}"
    );
    let out = std::process::Command::new(bin)
        .args(["run", "samples/gpt2_overflow.toml", "--switch", "flash"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("`flash` is not a switch of gpt2")
            && err.contains("`reorder_and_upcast_attn`"),
        "{err}"
    );
}
