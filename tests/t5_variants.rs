//! The code locates, it does not remember: T5 checkpoints with the overflow planted at other
//! blocks, with the gated-gelu FFN and other depths (made by scripts/make_t5_variants.py with
//! PyTorch and transformers), give the first Inf / NaN modules transformers gives.

use amprobe::config::RunConfig;
use amprobe::runner::build;
use amprobe::trace::record::Phase;
use amprobe::train::Trainer;
use std::path::PathBuf;

fn within(path: &str, module: &str) -> bool {
    path == module || path.starts_with(&format!("{module}."))
}

fn check(variant: &str) {
    let dir = PathBuf::from("tests/golden/t5_variants").join(variant);
    let exp: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    for (scenario, precision, clamp) in [
        ("fp32", "fp32", false),
        ("autocast_fp16", "fp16", false),
        ("autocast_bf16", "bf16", false),
        ("fp16_half", "half", true),
    ] {
        let mut cfg = RunConfig::default();
        cfg.model.hf = Some(dir.clone());
        cfg.model.t5_clamp = Some(clamp);
        cfg.data.inputs = Some(dir.join("inputs.safetensors"));
        cfg.train.precision = Some(precision.into());
        cfg.train.policy = Some("cpu".into());
        let train = cfg.train_config().unwrap();
        let (m, p, d) = build(&cfg, &train).unwrap();
        let mut t = Trainer::new(train, m, p, d).unwrap();
        let rec = t.step(0).unwrap();
        let ops: Vec<_> = rec
            .ops
            .unwrap()
            .into_iter()
            .filter(|o| o.phase == Phase::Forward)
            .collect();
        let inf = ops
            .iter()
            .find(|o| o.stats.pos_inf + o.stats.neg_inf > o.masked_neg_inf);
        let nan = ops.iter().find(|o| o.stats.nan > 0);
        let sc = &exp["scenarios"][scenario];
        let tag = format!("{variant}/{scenario}");
        match sc["first_inf"].as_str() {
            Some(m) => {
                let o =
                    inf.unwrap_or_else(|| panic!("{tag}: no Inf, transformers finds one in {m}"));
                assert!(
                    within(&o.module, m),
                    "{tag}: first Inf in `{}`, transformers says `{m}`",
                    o.module
                );
            }
            None => assert!(
                inf.is_none(),
                "{tag}: unexpected Inf in `{}`",
                inf.unwrap().module
            ),
        }
        match sc["first_nan"].as_str() {
            Some(m) => {
                let o =
                    nan.unwrap_or_else(|| panic!("{tag}: no NaN, transformers finds one in {m}"));
                assert!(
                    within(&o.module, m),
                    "{tag}: first NaN in `{}`, transformers says `{m}`",
                    o.module
                );
            }
            None => assert!(
                nan.is_none(),
                "{tag}: unexpected NaN in `{}`",
                nan.unwrap().module
            ),
        }
        let last = ops
            .iter()
            .rfind(|o| within(&o.module, "encoder.final_layer_norm"))
            .unwrap();
        assert_eq!(
            last.stats.nan,
            sc["final_output_n_nan"].as_u64().unwrap(),
            "{tag}: NaNs in the output"
        );
    }
}

#[test]
fn gated_gelu_overflow_in_block_1() {
    check("gated_gelu_block1");
}

#[test]
fn relu_six_layers_overflow_in_block_4() {
    check("relu_6_layers_block4");
}
