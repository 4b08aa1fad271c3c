//! The T5 overflow fixture (tests/golden/t5_overflow_small, made with PyTorch 2.15 and
//! transformers 5.23): the fp32 forward matches module by module, and the first Inf / first
//! NaN land in the modules PyTorch names, for every scenario.

use amprobe::config::RunConfig;
use amprobe::runner::build;
use amprobe::trace::record::{OpRecord, Phase};
use amprobe::train::Trainer;
use std::path::Path;

fn golden(name: &str) -> serde_json::Value {
    let text = std::fs::read_to_string(format!("tests/golden/t5_overflow_small/{name}")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// Forward op records of step 0 under a precision mode and options.
fn forward_ops(
    precision: &str,
    keep_fp32: &[&str],
    clamp: bool,
) -> (Vec<OpRecord>, amprobe::trace::record::StepRecord) {
    let mut cfg = RunConfig::load(Path::new("samples/t5_overflow.toml")).unwrap();
    cfg.train.precision = Some(precision.into());
    cfg.train.keep_fp32 = Some(keep_fp32.iter().map(|s| s.to_string()).collect());
    cfg.model.t5_clamp = Some(clamp);
    let train = cfg.train_config().unwrap();
    let (m, p, d) = build(&cfg, &train).unwrap();
    let mut t = Trainer::new(train, m, p, d).unwrap();
    let mut rec = t.step(0).unwrap();
    let ops = rec.ops.take().expect("step 0 keeps its op records");
    (
        ops.into_iter()
            .filter(|o| o.phase == Phase::Forward)
            .collect(),
        rec,
    )
}

/// True when `path` is `module` or inside it.
fn within(path: &str, module: &str) -> bool {
    path == module || path.starts_with(&format!("{module}."))
}

#[test]
fn fp32_forward_matches_module_by_module() {
    let trace = golden("expected_forward_trace.json");
    let (ops, _) = forward_ops("fp32", &[], false);
    let mut checked = 0;
    for m in trace["scenarios"]["fp32"]["module_trace"]
        .as_array()
        .unwrap()
    {
        let module = m["module"].as_str().unwrap();
        if module.is_empty() || module.starts_with('<') {
            continue;
        }
        // A module's output is the last op that ran inside it (dropout with p = 0 runs none).
        let Some(op) = ops
            .iter()
            .rfind(|o| within(&o.module, module) && !o.module.starts_with("lm_head"))
        else {
            assert!(module.ends_with("dropout"), "no op ran inside {module}");
            continue;
        };
        let want = m["output"]["max_abs"].as_f64().unwrap();
        let got = op.stats.max_abs;
        assert!(
            (got - want).abs() <= 1e-5 * want.abs().max(1e-30),
            "{module}: max|x| {got} vs PyTorch {want} (op {} {})",
            op.op,
            op.module
        );
        assert_eq!(
            op.output.shape,
            m["output"]["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as usize)
                .collect::<Vec<_>>(),
            "{module}"
        );
        checked += 1;
    }
    assert!(checked >= 60, "only {checked} modules compared");
}

/// The first forward op whose output holds an (unmasked) Inf, and the first holding a NaN.
fn origins(ops: &[OpRecord]) -> (Option<&OpRecord>, Option<&OpRecord>) {
    (
        ops.iter()
            .find(|o| o.stats.pos_inf + o.stats.neg_inf > o.masked_neg_inf),
        ops.iter().find(|o| o.stats.nan > 0),
    )
}

fn check_scenario(name: &str, precision: &str, keep: &[&str], clamp: bool) {
    let exp = golden("expected.json");
    let sc = &exp["scenarios"][name];
    let (ops, rec) = forward_ops(precision, keep, clamp);
    let (inf, nan) = origins(&ops);
    match sc["first_inf"]["module"].as_str() {
        Some(m) => {
            let o =
                inf.unwrap_or_else(|| panic!("{name}: expected the first Inf in {m}, found none"));
            assert!(
                within(&o.module, m),
                "{name}: first Inf at `{}` in `{}`, PyTorch says `{m}`",
                o.op,
                o.module
            );
            // The trace's origin agrees with the op records.
            let origin = rec.origins.first_inf.as_ref().unwrap();
            assert_eq!(
                (origin.op_index, origin.phase),
                (o.index, Phase::Forward),
                "{name}"
            );
        }
        None => assert!(
            inf.is_none(),
            "{name}: unexpected Inf at `{}` in `{}`",
            inf.unwrap().op,
            inf.unwrap().module
        ),
    }
    match sc["first_nan"]["module"].as_str() {
        Some(m) => {
            let o =
                nan.unwrap_or_else(|| panic!("{name}: expected the first NaN in {m}, found none"));
            assert!(
                within(&o.module, m),
                "{name}: first NaN at `{}` in `{}`, PyTorch says `{m}`",
                o.op,
                o.module
            );
            let n = sc["first_nan"]["output_n_nan"].as_u64().unwrap();
            let last_in_module = ops.iter().rfind(|x| within(&x.module, m)).unwrap();
            assert_eq!(
                last_in_module.stats.nan, n,
                "{name}: NaN count of {m}'s output"
            );
        }
        None => assert!(
            nan.is_none(),
            "{name}: unexpected NaN at `{}` in `{}`",
            nan.unwrap().op,
            nan.unwrap().module
        ),
    }
    // The encoder's final output: NaN count as PyTorch's.
    let last = ops
        .iter()
        .rfind(|o| within(&o.module, "encoder.final_layer_norm"))
        .unwrap();
    assert_eq!(
        last.stats.nan,
        sc["final_output_n_nan"].as_u64().unwrap(),
        "{name}: NaNs in the final output"
    );
    assert_eq!(
        last.stats.pos_inf + last.stats.neg_inf,
        sc["final_output_n_inf"].as_u64().unwrap(),
        "{name}: Infs in the final output"
    );
}

#[test]
fn fp32_has_no_origin() {
    check_scenario("fp32", "fp32", &[], false);
}

#[test]
fn autocast_fp16_overflows_at_wo_and_nans_at_the_final_norm() {
    check_scenario("autocast_fp16", "fp16", &[], false);
}

#[test]
fn pure_fp16_without_clamp_overflows_at_the_residual_add() {
    check_scenario("fp16_half_clamp_disabled", "half", &[], false);
}

#[test]
fn pure_fp16_with_clamp_has_a_finite_output() {
    check_scenario("fp16_half", "half", &[], true);
}

#[test]
fn bf16_autocast_and_pure_bf16_stay_finite() {
    check_scenario("autocast_bf16", "bf16", &[], false);
    check_scenario("bf16_pure", "bfloat16-pure", &[], false);
}

#[test]
fn keeping_wo_in_fp32_stays_finite() {
    check_scenario("fp16_from_pretrained_keep_wo_fp32", "half", &["wo"], true);
    // Under autocast too.
    let (ops, _) = forward_ops("fp16", &["wo"], false);
    assert!(origins(&ops).0.is_none() && origins(&ops).1.is_none());
}
