//! What the tests of Hugging Face models held to PyTorch share: a run of a golden
//! checkpoint (made by scripts/make_*.py) and the comparisons of its fp32 step with
//! PyTorch's per-module outputs, loss and gradients.
#![allow(dead_code)]

use amprobe::config::RunConfig;
use amprobe::runner::build;
use amprobe::trace::record::{OpRecord, Phase, StepRecord};
use amprobe::train::Trainer;
use std::path::{Path, PathBuf};

/// The golden's expected.json.
pub fn expected(dir: &str) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(Path::new(dir).join("expected.json")).unwrap())
        .unwrap()
}

/// `path` is `module` or inside it.
pub fn within(path: &str, module: &str) -> bool {
    path == module || path.starts_with(&format!("{module}."))
}

/// |a − b| / |b|.
pub fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs().max(1e-30)
}

/// A trainer for the checkpoint in `dir` in `precision` (CPU autocast policy, the golden's
/// inputs), with `switch` set in a copy of its config.json (written under `tmp`) when given.
pub fn trainer(dir: &str, precision: &str, switch: Option<&str>, tmp: &Path) -> Trainer {
    let dir = PathBuf::from(dir);
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
    Trainer::new(train, m, p, d).unwrap()
}

/// The forward ops of a step's record.
pub fn forward_ops(rec: &StepRecord) -> Vec<OpRecord> {
    rec.ops
        .clone()
        .unwrap()
        .into_iter()
        .filter(|o| o.phase == Phase::Forward)
        .collect()
}

/// The first forward op with an (unmasked) Inf and the first with a NaN.
pub fn origins(ops: &[OpRecord]) -> (Option<&OpRecord>, Option<&OpRecord>) {
    (
        ops.iter()
            .find(|o| o.stats.pos_inf + o.stats.neg_inf > o.masked_neg_inf),
        ops.iter().find(|o| o.stats.nan > 0),
    )
}

/// An fp32 step against PyTorch: each module's output (the last op inside it: shape, max
/// |x| and L2 within 1e-5; modules where no op runs are named by `no_ops`), the loss
/// (1e-5) and every parameter's gradient (L2 and max |g| within 1e-4).
pub fn fp32_step_matches(dir: &str, no_ops: impl Fn(&str) -> bool) {
    fp32_step_checks(dir, no_ops, true)
}

/// [`fp32_step_matches`] with the gradients checked or not.
pub fn fp32_step_checks(dir: &str, no_ops: impl Fn(&str) -> bool, with_grads: bool) {
    let exp = expected(dir);
    let tmp = tempfile::tempdir().unwrap();
    let rec = trainer(dir, "fp32", None, tmp.path()).step(0).unwrap();
    let ops = forward_ops(&rec);
    let (mut checked, mut skipped) = (0, 0);
    for m in exp["fp32_module_trace"].as_array().unwrap() {
        let module = m["module"].as_str().unwrap();
        if no_ops(module) {
            skipped += 1;
            continue;
        }
        let op = ops
            .iter()
            .rfind(|o| within(&o.module, module))
            .unwrap_or_else(|| panic!("no op ran inside {module}"));
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
    assert!(
        checked > 3 * skipped,
        "{checked} modules compared, {skipped} skipped"
    );
    let loss = exp["fp32_loss"].as_f64().unwrap();
    let got = rec.loss.expect("a finite fp32 loss");
    assert!(rel(got, loss) <= 1e-5, "loss {got} vs PyTorch {loss}");
    if with_grads {
        grads_match(&rec, &exp["fp32_grads"], &exp["fp64_grads"]);
    }
}

/// An fp32 step from the golden's weights before the plant (`unplanted.safetensors`): its
/// loss (1e-5) and every parameter's gradient against PyTorch's for those weights.
pub fn unplanted_step_matches(dir: &str) {
    let exp = expected(dir);
    let dir_path = PathBuf::from(dir);
    let mut cfg = RunConfig::default();
    cfg.model.hf = Some(dir_path.clone());
    cfg.model.weights = Some(dir_path.join("unplanted.safetensors"));
    cfg.data.inputs = Some(dir_path.join("inputs.safetensors"));
    cfg.train.precision = Some("fp32".into());
    cfg.train.policy = Some("cpu".into());
    let train = cfg.train_config().unwrap();
    let (m, p, d) = build(&cfg, &train).unwrap();
    let rec = Trainer::new(train, m, p, d).unwrap().step(0).unwrap();
    let want = exp["unplanted_fp32_loss"].as_f64().unwrap();
    let got = rec.loss.expect("a finite fp32 loss");
    assert!(rel(got, want) <= 1e-5, "loss {got} vs PyTorch {want}");
    grads_match(
        &rec,
        &exp["unplanted_fp32_grads"],
        &exp["unplanted_fp64_grads"],
    );
}

/// Every parameter's gradient of a step's record against PyTorch's fp32 `grads` (L2 and max
/// |g|) and the float64 `exact` ones.
pub fn grads_match(rec: &StepRecord, grads: &serde_json::Value, exact: &serde_json::Value) {
    // Each gradient statistic within 1e-4 of PyTorch's fp32 one, or, where the model is
    // ill-conditioned (a planted outlier channel through RMSNorm), no further from the exact
    // (float64) gradient than twice PyTorch's own fp32 error.
    let grads = grads.as_object().unwrap();
    let exact = exact.as_object().unwrap();
    for p in &rec.params {
        for (field, got) in [("l2", p.grad_l2), ("max_abs", p.max_abs_grad)] {
            let t32 = grads[&p.name][field].as_f64().unwrap();
            let t64 = exact[&p.name][field].as_f64().unwrap();
            let (ours, theirs) = (rel(got, t64), rel(t32, t64));
            assert!(
                rel(got, t32) <= 1e-4 || ours <= 2.0 * theirs,
                "{} {field}: {got} vs PyTorch fp32 {t32} (exact {t64}: amprobe off by {ours:.2e}, \
                 PyTorch fp32 by {theirs:.2e})",
                p.name
            );
        }
    }
    // PyTorch's named_parameters lists a tied head once, as the embedding.
    assert_eq!(rec.params.len(), grads.len(), "parameters compared");
}
