//! LLaMA held to PyTorch: a tiny LlamaForCausalLM with grouped-query attention and an fp16
//! overflow planted at layer 1's MLP output (tests/golden/llama_tiny, made by
//! scripts/make_llama.py with PyTorch and transformers). The fp32 forward matches module by
//! module, the loss and every gradient match, and the first Inf / NaN land where
//! transformers finds them.

mod hf_golden;

use hf_golden::{forward_ops, origins, rel, within};

const DIR: &str = "tests/golden/llama_tiny";

#[test]
fn fp32_forward_loss_and_gradients_match_pytorch() {
    // The rotary embedding's cos and sin are constants amprobe makes on the host.
    hf_golden::fp32_step_matches(DIR, |m| m.ends_with("rotary_emb"));
}

#[test]
fn the_first_inf_and_nan_are_where_transformers_finds_them() {
    let exp = hf_golden::expected(DIR);
    let tmp = tempfile::tempdir().unwrap();
    for (scenario, precision) in [
        ("fp32", "fp32"),
        ("autocast_fp16", "fp16"),
        ("autocast_bf16", "bf16"),
        ("fp16_half", "half"),
    ] {
        let sc = &exp["scenarios"][scenario];
        let rec = hf_golden::trainer(DIR, precision, None, tmp.path())
            .step(0)
            .unwrap();
        let ops = forward_ops(&rec);
        let (inf, nan) = origins(&ops);
        for (what, got, want) in [
            ("Inf", inf, sc["first_inf"].as_str()),
            ("NaN", nan, sc["first_nan"].as_str()),
        ] {
            match want {
                Some(m) => {
                    let o = got.unwrap_or_else(|| {
                        panic!("{scenario}: no {what}, transformers finds one in {m}")
                    });
                    assert!(
                        within(&o.module, m),
                        "{scenario}: first {what} in `{}` ({}), transformers says `{m}`",
                        o.module,
                        o.op
                    );
                }
                None => assert!(
                    got.is_none(),
                    "{scenario}: unexpected {what} in `{}`",
                    got.unwrap().module
                ),
            }
        }
        match sc["loss"].as_f64() {
            Some(want) => {
                let got = rec.loss.expect("a finite loss");
                let tol = if scenario == "fp32" { 1e-5 } else { 2e-3 };
                assert!(
                    rel(got, want) <= tol,
                    "{scenario}: loss {got} vs PyTorch {want}"
                );
            }
            None => assert!(
                rec.loss.is_none_or(f64::is_nan),
                "{scenario}: loss {:?}",
                rec.loss
            ),
        }
    }
}

/// `run --hf DIR` takes the architecture from the checkpoint's config.json, for each
/// supported one, even over a config file that names another kind.
#[test]
fn run_hf_picks_the_architecture_of_the_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let mlp = tmp.path().join("mlp.toml");
    std::fs::write(&mlp, "[model]\nkind = \"mlp\"\n").unwrap();
    for (dir, describes) in [
        ("tests/golden/llama_tiny", "amprobe: llama hidden 32"),
        ("tests/golden/gpt2_tiny", "amprobe: gpt2 n_embd 32"),
        (
            "samples/t5_overflow_small",
            "amprobe: t5-encoder d_model 32",
        ),
    ] {
        for config in [None, Some(mlp.to_str().unwrap())] {
            let inputs = format!("{dir}/inputs.safetensors");
            let mut args = vec!["run"];
            args.extend(config);
            args.extend([
                "--hf",
                dir,
                "--inputs",
                &inputs,
                "--steps",
                "1",
                "--no-probes",
            ]);
            let out = std::process::Command::new(env!("CARGO_BIN_EXE_amprobe"))
                .args(&args)
                .output()
                .unwrap();
            let text = String::from_utf8_lossy(&out.stdout);
            assert!(
                out.status.success() && text.starts_with(describes),
                "{args:?}: {text}{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
}

/// compare and report take the traces of the LLaMA, GPT-2, BERT and full T5 samples: the fp16 run diverges
/// from fp32 first at the op where the overflow starts.
#[test]
fn compare_and_report_work_on_the_samples() {
    let bin = env!("CARGO_BIN_EXE_amprobe");
    let tmp = tempfile::tempdir().unwrap();
    for (sample, origin) in [
        (
            "llama_overflow",
            "`linear` in `model.layers.1.mlp.down_proj`",
        ),
        ("gpt2_overflow", "`matmul` in `transformer.h.1.attn`"),
        (
            "bert_overflow",
            "`linear` in `bert.encoder.layer.1.output.dense`",
        ),
        (
            "t5_seq2seq",
            "`linear` in `decoder.block.1.layer.2.DenseReluDense.wo`",
        ),
    ] {
        let trace = |p: &str| tmp.path().join(format!("{sample}-{p}.jsonl"));
        for p in ["fp32", "fp16"] {
            let t = trace(p);
            let out = std::process::Command::new(bin)
                .args([
                    "run",
                    &format!("samples/{sample}.toml"),
                    "--precision",
                    p,
                    "--steps",
                    "1",
                ])
                .arg("--trace")
                .arg(&t)
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "{sample} {p}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let out = std::process::Command::new(bin)
            .arg("compare")
            .arg(trace("fp32"))
            .arg(trace("fp16"))
            .arg("--out")
            .arg(tmp.path().join(format!("{sample}-compare")))
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success()
                && text.contains("first divergence at step 0 forward")
                && text.contains(origin),
            "{sample}: {text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let rep = tmp.path().join(format!("{sample}-report"));
        let out = std::process::Command::new(bin)
            .arg("report")
            .arg(trace("fp16"))
            .arg("--out")
            .arg(&rep)
            .output()
            .unwrap();
        assert!(
            out.status.success() && rep.join("index.html").is_file(),
            "{sample} report"
        );
    }
}

/// `bisect` on each Hugging Face sample finds the planted module as the minimal set to keep
/// in fp32.
#[test]
fn bisect_finds_the_planted_module_in_each_sample() {
    let bin = env!("CARGO_BIN_EXE_amprobe");
    for (sample, module) in [
        ("llama_overflow", "model.layers.1.mlp.down_proj"),
        ("gpt2_overflow", "transformer.h.1.attn"),
        ("bert_overflow", "bert.encoder.layer.1.output.dense"),
        ("t5_seq2seq", "decoder.block.1.layer.2.DenseReluDense.wo"),
    ] {
        let out = std::process::Command::new(bin)
            .args(["bisect", &format!("samples/{sample}.toml")])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success()
                && text.contains(&format!("keeping {module} in fp32 makes step 0 finite")),
            "{sample}: {text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
