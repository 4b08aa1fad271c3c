//! BERT held to PyTorch: a tiny BertForMaskedLM with padding, token types and -100 labels,
//! and an fp16 overflow planted at layer 1's FFN output (tests/golden/bert_tiny, made by
//! scripts/make_bert.py with PyTorch and transformers). The fp32 forward matches module by
//! module, the fp32 loss and every parameter's gradient match (the padding row of the word
//! embeddings gets none), and the first Inf / NaN land where transformers finds them; the
//! same weights before the plant stay finite in every mode, padded fp16 included.

mod hf_golden;

use amprobe::config::RunConfig;
use amprobe::runner::build;
use amprobe::train::Trainer;
use hf_golden::{forward_ops, origins, rel, within};
use std::path::PathBuf;

const DIR: &str = "tests/golden/bert_tiny";

fn trainer(precision: &str, weights: &str) -> Trainer {
    let dir = PathBuf::from(DIR);
    let mut cfg = RunConfig::default();
    cfg.model.hf = Some(dir.clone());
    cfg.model.weights = Some(dir.join(weights));
    cfg.data.inputs = Some(dir.join("inputs.safetensors"));
    cfg.train.precision = Some(precision.into());
    cfg.train.policy = Some("cpu".into());
    let train = cfg.train_config().unwrap();
    let (m, p, d) = build(&cfg, &train).unwrap();
    Trainer::new(train, m, p, d).unwrap()
}

#[test]
fn the_architecture_comes_from_config_json() {
    let t = trainer("fp32", "model.safetensors");
    assert!(
        t.model().describe().starts_with("bert hidden 32"),
        "{}",
        t.model().describe()
    );
}

#[test]
fn fp32_forward_and_loss_match_pytorch() {
    // Dropout with p = 0 runs no op.
    hf_golden::fp32_step_checks(DIR, |m| m.ends_with("dropout"), false);
}

/// Gradients are compared on the weights before the plant: the planted outlier (1.2e5 into
/// a LayerNorm) leaves PyTorch's own fp32 gradients up to ~1e-3 off the exact ones, which
/// says nothing about amprobe. The word embeddings' padding row gets no gradient from the
/// lookup (PyTorch's `padding_idx`), only from the tied MLM decoder.
#[test]
fn fp32_gradients_match_pytorch() {
    hf_golden::unplanted_step_matches(DIR);
}

#[test]
fn the_first_inf_and_nan_are_where_transformers_finds_them() {
    let exp = hf_golden::expected(DIR);
    let planted = exp["planted"]["module"].as_str().unwrap();
    let norm = planted.replace(".dense", ".LayerNorm");
    for (variant, weights) in [
        ("plain", "model.safetensors"),
        ("unplanted", "unplanted.safetensors"),
    ] {
        for (scenario, precision) in [
            ("fp32", "fp32"),
            ("autocast_fp16", "fp16"),
            ("autocast_bf16", "bf16"),
            ("fp16_half", "half"),
        ] {
            let tag = format!("{variant}/{scenario}");
            let sc = &exp["variants"][variant][scenario];
            let rec = trainer(precision, weights).step(0).unwrap();
            let ops = forward_ops(&rec);
            let (inf, nan) = origins(&ops);
            match (sc["first_inf"].as_str(), sc["first_nan"].as_str()) {
                (Some(i), Some(n)) => {
                    let oi = inf.unwrap_or_else(|| panic!("{tag}: no Inf, transformers has {i}"));
                    let on = nan.unwrap_or_else(|| panic!("{tag}: no NaN, transformers has {n}"));
                    assert_eq!((i, n), (planted, norm.as_str()), "{tag}: the golden");
                    assert_eq!(
                        (oi.op.as_str(), oi.module.as_str()),
                        ("linear", planted),
                        "{tag}"
                    );
                    assert!(within(&on.module, n), "{tag}: first NaN in {}", on.module);
                    assert!(
                        rec.loss.is_none_or(f64::is_nan),
                        "{tag}: loss {:?}",
                        rec.loss
                    );
                }
                (None, None) => {
                    assert!(nan.is_none(), "{tag}: NaN in `{}`", nan.unwrap().module);
                    // A padded fp16 score (−65504 plus a negative score) may round to
                    // −inf: the mask's, not an origin.
                    assert!(inf.is_none(), "{tag}: Inf in `{}`", inf.unwrap().module);
                    let want = sc["loss"].as_f64().unwrap();
                    let tol = if scenario == "fp32" { 1e-5 } else { 2e-3 };
                    let got = rec.loss.expect("a finite loss");
                    assert!(rel(got, want) <= tol, "{tag}: loss {got} vs PyTorch {want}");
                }
                other => panic!("{tag}: golden has {other:?}"),
            }
        }
    }
}

/// The padded positions change the result: with the attention mask dropped the fp32 loss
/// moves away from PyTorch's, and an all-ones mask is the same as none.
#[test]
fn the_attention_mask_is_applied() {
    let exp = hf_golden::expected(DIR);
    let want = exp["fp32_loss"].as_f64().unwrap();
    let dir = PathBuf::from(DIR);
    let batch = amprobe::models::tokens::load_inputs(&dir.join("inputs.safetensors")).unwrap();
    let loss_with = |mask: Option<amprobe::tensor::Tensor>| -> f64 {
        let mut cfg = RunConfig::default();
        cfg.model.hf = Some(dir.clone());
        cfg.train.precision = Some("fp32".into());
        let train = cfg.train_config().unwrap();
        let (m, p, _) = build(&cfg, &train).unwrap();
        let b = amprobe::models::Batch {
            attention_mask: mask,
            ..batch.clone()
        };
        let data = Box::new(amprobe::train::FixedBatch(b));
        let mut t = Trainer::new(train, m, p, data).unwrap();
        t.step(0).unwrap().loss.unwrap()
    };
    let none = loss_with(None);
    assert!(rel(none, want) > 1e-4, "no mask {none}, PyTorch {want}");
    let shape = batch.inputs.shape().to_vec();
    let ones = amprobe::tensor::Tensor::from_i64(vec![1; shape[0] * shape[1]], &shape).unwrap();
    assert_eq!(loss_with(Some(ones)).to_bits(), none.to_bits());
    assert!(rel(loss_with(batch.attention_mask.clone()), want) <= 1e-5);
}
