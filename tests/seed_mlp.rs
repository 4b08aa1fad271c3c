//! The seed MLP reproduces PyTorch's numbers (tests/golden/seed_mlp, made with PyTorch 2.15
//! CPU autocast): loss, unscaled gradients and parameters after one SGD step, per mode.

use amprobe::config::RunConfig;
use amprobe::models::weights::load_safetensors;
use amprobe::runner::build;
use amprobe::train::Trainer;
use std::path::Path;

fn expected() -> serde_json::Value {
    let text = std::fs::read_to_string("tests/golden/seed_mlp/expected.json").unwrap();
    serde_json::from_str(&text).unwrap()
}

/// Normwise relative difference max|a - b| / max|b|: elementwise ratios of values near zero
/// measure summation order, not correctness.
fn max_rel(a: &[f64], b: &[f64]) -> f64 {
    let scale = b.iter().fold(0f64, |m, x| m.max(x.abs()));
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
        / scale
}

fn run_mode(precision: &str) -> (Trainer, amprobe::trace::record::StepRecord) {
    let mut cfg = RunConfig::load(Path::new("samples/mlp.toml")).unwrap();
    cfg.train.precision = Some(precision.to_string());
    let train = cfg.train_config().unwrap();
    let (model, params, data) = build(&cfg, &train).unwrap();
    let mut t = Trainer::new(train, model, params, data).unwrap();
    let rec = t.step(0).unwrap();
    (t, rec)
}

fn check(precision: &str, mode: &str, grad_tol: f64, param_tol: f64) {
    let exp = expected();
    let m = &exp["modes"][mode];
    let (t, rec) = run_mode(precision);
    let loss = rec.loss.unwrap();
    let want = m["loss"].as_f64().unwrap();
    assert!(
        (loss - want).abs() <= 1e-5 * want.abs(),
        "{mode}: loss {loss} vs PyTorch {want}"
    );
    assert_eq!(rec.scale_before, m["scale_before"].as_f64().unwrap());
    assert_eq!(rec.scale_after, m["scale_after"].as_f64().unwrap());
    assert_eq!(rec.found_inf, m["found_inf"].as_bool().unwrap());
    let golden = load_safetensors(Path::new("tests/golden/seed_mlp/step.safetensors")).unwrap();
    for (i, p) in t.params().params.iter().enumerate() {
        let g = t.last_grads()[i].as_ref().unwrap().to_f64_vec().unwrap();
        let gref = golden[&format!("{mode}/grad/{}", p.name)]
            .to_f64_vec()
            .unwrap();
        let e = max_rel(&g, &gref);
        assert!(
            e <= grad_tol,
            "{mode}: gradient of {} differs by {e:e} (tolerance {grad_tol:e})",
            p.name
        );
        let after = p.value.to_f64_vec().unwrap();
        let pref = golden[&format!("{mode}/param_after/{}", p.name)]
            .to_f64_vec()
            .unwrap();
        let e = max_rel(&after, &pref);
        assert!(
            e <= param_tol,
            "{mode}: {} after the step differs by {e:e}",
            p.name
        );
        let scaled_max = m["grad_max_abs_scaled"][&p.name].as_f64().unwrap();
        let mine = g.iter().fold(0f64, |a, x| a.max(x.abs())) * rec.scale_before;
        assert!(
            (mine - scaled_max).abs() <= grad_tol * scaled_max,
            "{mode}: scaled max |grad| of {}",
            p.name
        );
    }
}

#[test]
fn fp32_matches_pytorch() {
    check("fp32", "fp32", 1e-5, 1e-6);
}

/// Low-precision gradients are compared within the per-dtype differences the fixture lists
/// against fp32 (bf16 ~5e-3, fp16 ~5e-4): our run must be at least that close to
/// PyTorch's run of the same mode.
#[test]
fn bf16_matches_pytorch() {
    let exp = expected();
    let tol = exp["checks"]["max_rel_grad_diff_vs_fp32"]["autocast_bf16"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_f64().unwrap())
        .fold(0.0, f64::max);
    check("bf16", "autocast_bf16", tol, 1e-6);
}

#[test]
fn fp16_matches_pytorch() {
    let exp = expected();
    let tol = exp["checks"]["max_rel_grad_diff_vs_fp32"]["autocast_fp16"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_f64().unwrap())
        .fold(0.0, f64::max);
    check("fp16", "autocast_fp16", tol, 1e-6);
}

#[test]
fn autocast_dtypes_match_pytorch() {
    for (precision, mode, dt) in [
        ("fp16", "autocast_fp16", "float16"),
        ("bf16", "autocast_bf16", "bfloat16"),
        ("fp32", "fp32", "float32"),
    ] {
        let (_, rec) = run_mode(precision);
        let ops = rec.ops.expect("the first step keeps its op records");
        let fwd = |m: &str| {
            ops.iter()
                .rfind(|o| o.module == m && o.phase == amprobe::trace::record::Phase::Forward)
                .unwrap()
                .clone()
        };
        for module in ["fc1", "relu", "fc2"] {
            let o = fwd(module);
            assert_eq!(o.output.dtype.name(), dt, "{mode}: {module} output dtype");
        }
        let exp = expected();
        let trace = exp["modes"][mode]["module_trace"].as_array().unwrap();
        for rec_m in trace.iter().filter(|r| r["module"] != "<root>") {
            let o = fwd(rec_m["module"].as_str().unwrap());
            let want = rec_m["output"]["max_abs"].as_f64().unwrap();
            assert!(
                (o.stats.max_abs - want).abs() <= 1e-6 * want,
                "{mode}: {} max|x| {} vs {want}",
                o.module,
                o.stats.max_abs
            );
        }
        let loss = ops.iter().find(|o| o.op == "cross_entropy_loss").unwrap();
        assert_eq!(
            loss.output.dtype.name(),
            exp["modes"][mode]["loss_dtype"].as_str().unwrap()
        );
    }
}
