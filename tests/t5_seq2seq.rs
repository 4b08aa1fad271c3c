//! The full T5 held to PyTorch: a tiny T5ForConditionalGeneration (gated-gelu, untied head,
//! a padded encoder batch, labels with -100) with an fp16 overflow planted at decoder block
//! 1's `wo` (tests/golden/t5_seq2seq_tiny, made by scripts/make_t5_seq2seq.py with PyTorch
//! and transformers). The fp32 forward matches module by module, the loss and every
//! parameter's gradient (on the weights before the plant) match, and the first Inf / NaN
//! land where transformers finds them,
//! with transformers' fp16 clamp in the decoder blocks and without it.

mod hf_golden;

use amprobe::config::RunConfig;
use amprobe::runner::build;
use amprobe::train::Trainer;
use hf_golden::{forward_ops, origins, rel, within};
use std::path::PathBuf;

const DIR: &str = "tests/golden/t5_seq2seq_tiny";

fn trainer(precision: &str, clamp: bool) -> Trainer {
    let dir = PathBuf::from(DIR);
    let mut cfg = RunConfig::default();
    cfg.model.hf = Some(dir.clone());
    cfg.model.t5_clamp = Some(clamp);
    cfg.data.inputs = Some(dir.join("inputs.safetensors"));
    cfg.train.precision = Some(precision.into());
    cfg.train.policy = Some("cpu".into());
    let train = cfg.train_config().unwrap();
    let (m, p, d) = build(&cfg, &train).unwrap();
    Trainer::new(train, m, p, d).unwrap()
}

#[test]
fn the_whole_model_comes_from_architectures() {
    let t = trainer("fp32", false);
    assert!(
        t.model()
            .describe()
            .starts_with("t5 d_model 32 d_ff 64 layers 2 + 2"),
        "{}",
        t.model().describe()
    );
    assert!(t.model().describe().contains("untied head"));
}

#[test]
fn fp32_forward_and_loss_match_pytorch() {
    // Dropout with p = 0 runs no op.
    hf_golden::fp32_step_checks(DIR, |m| m.ends_with("dropout"), false);
}

/// Gradients are compared on the weights before the plant, as BERT's are: with the planted
/// 1.2e5 channel PyTorch's own fp32 gradients are 1e-4 off the exact ones (shared.weight's
/// norm), so a second fp32 implementation summing in another order can be as far off
/// without being wrong.
#[test]
fn fp32_gradients_match_pytorch() {
    hf_golden::unplanted_step_matches(DIR);
}

#[test]
fn the_first_inf_and_nan_are_where_transformers_finds_them() {
    let exp = hf_golden::expected(DIR);
    let planted = exp["planted"]["module"].as_str().unwrap();
    for (variant, clamp) in [("plain", true), ("no_clamp", false)] {
        for (scenario, precision) in [
            ("fp32", "fp32"),
            ("autocast_fp16", "fp16"),
            ("autocast_bf16", "bf16"),
            ("fp16_half", "half"),
        ] {
            let tag = format!("{variant}/{scenario}");
            let sc = &exp["variants"][variant][scenario];
            let rec = trainer(precision, clamp).step(0).unwrap();
            let ops = forward_ops(&rec);
            let (inf, nan) = origins(&ops);
            match sc["first_inf"].as_str() {
                Some(i) => {
                    assert_eq!(i, planted, "{tag}: the golden");
                    let oi = inf.unwrap_or_else(|| panic!("{tag}: no Inf, transformers has {i}"));
                    assert_eq!(
                        (oi.op.as_str(), oi.module.as_str()),
                        ("linear", planted),
                        "{tag}"
                    );
                }
                None => assert!(inf.is_none(), "{tag}: Inf in `{}`", inf.unwrap().module),
            }
            match sc["first_nan"].as_str() {
                Some(n) => {
                    let on = nan.unwrap_or_else(|| panic!("{tag}: no NaN, transformers has {n}"));
                    assert!(within(&on.module, n), "{tag}: first NaN in {}", on.module);
                    assert!(
                        rec.loss.is_none_or(f64::is_nan),
                        "{tag}: loss {:?}",
                        rec.loss
                    );
                }
                None => {
                    assert!(nan.is_none(), "{tag}: NaN in `{}`", nan.unwrap().module);
                    let want = sc["loss"].as_f64().unwrap();
                    let tol = if scenario == "fp32" { 1e-5 } else { 2e-3 };
                    let got = rec.loss.expect("a finite loss");
                    assert!(rel(got, want) <= tol, "{tag}: loss {got} vs PyTorch {want}");
                }
            }
        }
    }
}

/// Decoder inputs are the labels shifted right as transformers makes them, once: a
/// replayed step (as `fix` and `bisect` run) has the step's loss bit for bit, and given
/// `decoder_input_ids` equal to the shifted labels give the same loss too.
#[test]
fn decoder_inputs_are_the_shifted_labels() {
    let mut t = trainer("bf16", false);
    let rec = t.step(0).unwrap();
    let again = t.replay(&amprobe::train::Variant::default()).unwrap();
    let (a, b) = (rec.loss.unwrap(), again.record.loss.unwrap());
    assert_eq!(a.to_bits(), b.to_bits(), "step loss {a}, replayed {b}");
    let labels = amprobe::tensor::Tensor::from_i64(vec![5, 6, -100, 7, 8, 9], &[2, 3]).unwrap();
    let s = amprobe::models::t5_seq2seq::shift_right(&labels, 0, 0).unwrap();
    assert_eq!(s.i64s().unwrap(), &[0, 5, 6, 0, 7, 8]);
    let dir = PathBuf::from(DIR);
    let batch = amprobe::models::tokens::load_inputs(&dir.join("inputs.safetensors")).unwrap();
    let given = amprobe::models::Batch {
        decoder_input_ids: Some(
            amprobe::models::t5_seq2seq::shift_right(&batch.labels, 0, 0).unwrap(),
        ),
        ..batch
    };
    let mut cfg = RunConfig::default();
    cfg.model.hf = Some(dir);
    cfg.train.precision = Some("bf16".into());
    cfg.train.policy = Some("cpu".into());
    let train = cfg.train_config().unwrap();
    let (m, p, _) = build(&cfg, &train).unwrap();
    let mut t = Trainer::new(train, m, p, Box::new(amprobe::train::FixedBatch(given))).unwrap();
    assert_eq!(t.step(0).unwrap().loss.unwrap().to_bits(), a.to_bits());
}
