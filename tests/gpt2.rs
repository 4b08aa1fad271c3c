//! GPT-2 held to PyTorch: a tiny GPT2LMHeadModel with an fp16 overflow planted in block 1's
//! attention scores (tests/golden/gpt2_tiny, made by scripts/make_gpt2.py with PyTorch and
//! transformers). The fp32 forward matches module by module, the fp32 loss and every
//! parameter's gradient match, and the first Inf / NaN land where transformers finds them,
//! with and without each of transformers' fp16 switches.

mod hf_golden;

use amprobe::config::RunConfig;
use amprobe::runner::build;
use amprobe::train::Trainer;
use hf_golden::{forward_ops, origins, rel, within};
use std::path::{Path, PathBuf};

const DIR: &str = "tests/golden/gpt2_tiny";

fn expected() -> serde_json::Value {
    hf_golden::expected(DIR)
}

fn step(precision: &str, switch: Option<&str>, tmp: &Path) -> amprobe::trace::record::StepRecord {
    hf_golden::trainer(DIR, precision, switch, tmp)
        .step(0)
        .unwrap()
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
    // Dropout with p = 0 runs no op.
    hf_golden::fp32_step_matches(DIR, |m| m.ends_with("drop") || m.ends_with("dropout"));
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
            let (inf, nan) = origins(&ops);
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

#[test]
fn the_activation_is_one_of_transformers_gelus() {
    use amprobe::models::gpt2::{Gpt2Activation, Gpt2Config};
    let text = std::fs::read_to_string(Path::new(DIR).join("config.json")).unwrap();
    assert!(text.contains("\"activation_function\": \"gelu_new\""));
    let with = |act: &str| {
        Gpt2Config::parse(
            &text.replace(
                "\"activation_function\": \"gelu_new\"",
                &format!("\"activation_function\": \"{act}\""),
            ),
            Path::new("c.json"),
        )
    };
    assert_eq!(
        with("gelu_new").unwrap().activation,
        Gpt2Activation::GeluNew
    );
    assert_eq!(with("gelu").unwrap().activation, Gpt2Activation::Gelu);
    assert_eq!(
        with("gelu_pytorch_tanh").unwrap().activation,
        Gpt2Activation::GeluPytorchTanh
    );
    let err = with("relu").unwrap_err().to_string();
    assert!(
        err.contains("c.json: activation_function")
            && err.contains(
                "`relu` is not supported (expected `gelu_new`, `gelu` or `gelu_pytorch_tanh`)"
            ),
        "{err}"
    );
}
