//! `amprobe fix [--out DIR] [--bisect-budget N] -- CMD ARGS...`: a PyTorch script that calls
//! `amprobe_torch.watch`, run to its first failing step, then re-run from scratch up to that
//! step under each remedy that fits the failure (the companion applies the plan in the
//! script's process):
//!
//! - a value that left the range (a forward origin, or a gradient that overflows even at
//!   loss scale 1): bf16 instead of fp16, and the modules to keep in fp32, found by
//!   bisection (ddmin over the modules that own parameters, as in amprobe's own runs, each
//!   test a run of the script);
//! - a gradient that overflows only because of the loss scale (finite at scale 1): bf16,
//!   and the largest initial scale at which the failing step's gradients stay in range.
//!
//! Each remedy that makes every step up to the failing one finite is ranked by what it
//! costs against the script forced to fp32 (the relative difference of the failing step's
//! loss), and the best is printed as code to paste. A script that is not seeded runs
//! differently each time; the costs then include that noise. A run whose plan the companion
//! refused or that did not take (the fp32 reference still 16-bit, say) stops the fix with
//! why ([`super::compare::run_planned`]): its figures would not be the remedy's.

use super::out::outln;
use super::script::{header_of, Autocast, Finished, Plan, Script};
use amprobe::diagnose::cause::safe_pow2_scale;
use amprobe::diagnose::remedy::{RemedyKind, RemedyResult};
use amprobe::diagnose::text::op_words;
use amprobe::diagnose::{any_origin, forward_origin, nonfinite_anywhere, DiagnoseOptions};
use amprobe::dtype::DType;
use amprobe::engine::module_matches;
use amprobe::trace::record::{Phase, StepRecord};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// A step that went wrong: skipped, found an inf/NaN gradient, has a non-finite loss or
/// gradient, or made a non-finite value in any phase.
fn failing(s: &StepRecord) -> bool {
    nonfinite_anywhere(s)
}

/// The runs of one `fix`: the command, where their traces and logs go, and the step they
/// run to.
struct Runner<'a> {
    command: &'a [String],
    out: &'a Path,
    runs: u32,
}

/// What a run up to the failing step showed.
struct Outcome {
    /// Every step up to `step` was written, and none failed.
    finite: bool,
    /// The first failing step's record (when one failed).
    failed: Option<StepRecord>,
    /// The loss of `step` (when it was written).
    loss: Option<f64>,
    /// The run as it ended.
    run: Finished,
}

impl Runner<'_> {
    /// Runs the script with `plan` (traces and logs `NAME.jsonl`, `NAME.log`) up to `step`
    /// (stopping at a failing step before it), keeping op records of `step`.
    fn run(&mut self, name: &str, plan: Plan, step: u64) -> anyhow::Result<Outcome> {
        self.runs += 1;
        let mut s = Script::new(self.command, &self.out.join(format!("{name}.jsonl")))?;
        s.log = Some(self.out.join(format!("{name}.log")));
        s.sample_every = Some(step);
        s.plan = plan;
        let run = super::compare::run_planned(&s, |st| st.step >= step || failing(st))?;
        let failed = run.trace.steps.iter().find(|s| failing(s)).cloned();
        let at = run.trace.steps.iter().find(|s| s.step == step);
        Ok(Outcome {
            finite: failed.is_none() && at.is_some(),
            loss: at.and_then(|s| s.loss),
            failed,
            run,
        })
    }
}

/// The relative difference of `x` from `reference`.
fn rel_err(x: Option<f64>, reference: Option<f64>) -> Option<f64> {
    match (x, reference) {
        (Some(x), Some(r)) if r != 0.0 => Some((x - r).abs() / r.abs()),
        (Some(x), Some(_)) => Some(x.abs()),
        _ => None,
    }
}

fn result(
    kind: RemedyKind,
    remedy: String,
    plan: &Plan,
    o: &Outcome,
    reference: Option<f64>,
) -> RemedyResult {
    RemedyResult {
        kind,
        remedy,
        flags: plan.env().iter().map(|(k, v)| format!("{k}={v}")).collect(),
        finite: o.finite,
        skipped: o.failed.as_ref().is_some_and(|s| s.skipped),
        first_nonfinite: o.failed.as_ref().and_then(|s| any_origin(s).cloned()),
        loss: o.loss,
        loss_rel_err: if o.finite {
            rel_err(o.loss, reference)
        } else {
            None
        },
        hidden_rel_err: None,
    }
}

fn result_line(r: &RemedyResult, step: u64) -> String {
    let plan = r.flags.join(" ");
    if r.finite {
        format!(
            "  FIXES IT: {} ({plan}) makes every step to {step} finite; loss at step {step} differs from fp32 by {}",
            r.remedy,
            r.loss_rel_err.map_or("?".into(), |v| format!("{v:.1e}"))
        )
    } else {
        let why = match (&r.first_nonfinite, r.skipped) {
            (Some(o), _) => format!(
                "; first non-finite: step {} {} ({})",
                o.step,
                op_words(o),
                phase(o.phase)
            ),
            (None, true) => "; a step is still skipped".into(),
            _ => String::new(),
        };
        format!("  does not fix it: {} ({plan}){why}", r.remedy)
    }
}

fn phase(p: Phase) -> &'static str {
    match p {
        Phase::Forward => "forward",
        Phase::Backward => "backward",
        Phase::Optimizer => "optimizer",
    }
}

/// The modules that own parameters, in the order of the parameters (the root's own
/// parameters aside).
fn param_modules<'a>(names: impl Iterator<Item = &'a str>) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for name in names {
        if let Some((m, _)) = name.rsplit_once('.') {
            if !out.iter().any(|x| x == m) {
                out.push(m.to_string());
            }
        }
    }
    out
}

/// The ancestors of a dotted path, nearest first.
fn ancestors(path: &str) -> Vec<&str> {
    let mut v: Vec<&str> = path.match_indices('.').map(|(i, _)| &path[..i]).collect();
    v.reverse();
    v
}

/// The bisection over module sets: the answer and the runs of its sets.
struct Bisected {
    universe: Vec<String>,
    coarse: bool,
    modules: Vec<String>,
    minimal: bool,
    tests: u32,
    /// The run with exactly `modules` kept.
    modules_run: Option<Outcome>,
}

/// Runs of the script with module sets kept in fp32, each set run once.
struct Tester<'r, 'a> {
    runner: &'r mut Runner<'a>,
    step: u64,
    budget: u32,
    memo: HashMap<Vec<usize>, bool>,
    passed: HashMap<Vec<usize>, Outcome>,
    tests: u32,
}

impl Tester<'_, '_> {
    /// Whether keeping `set` (indices into `universe`) makes every step to the failing one
    /// finite; `None` once the budget is spent.
    fn test(&mut self, universe: &[String], set: &[usize]) -> anyhow::Result<Option<bool>> {
        let mut key = set.to_vec();
        key.sort_unstable();
        if let Some(&b) = self.memo.get(&key) {
            return Ok(Some(b));
        }
        if self.tests >= self.budget {
            return Ok(None);
        }
        self.tests += 1;
        let plan = Plan {
            fp32_modules: key.iter().map(|&i| universe[i].clone()).collect(),
            ..Plan::default()
        };
        let o = self
            .runner
            .run(&format!("bisect-{}", self.tests), plan, self.step)?;
        let ok = o.finite;
        self.memo.insert(key.clone(), ok);
        if ok {
            self.passed.insert(key, o);
        }
        Ok(Some(ok))
    }
}

/// ddmin over the modules `fine` (then, when keeping all of them is not enough, their
/// parents and the modules where the step broke), as amprobe bisects its own runs; each
/// test is a run of the script to the failing step `fail`. None when no set works.
fn bisect(
    runner: &mut Runner,
    fail: &StepRecord,
    fine: Vec<String>,
    budget: u32,
) -> anyhow::Result<Option<Bisected>> {
    let mut t = Tester {
        runner,
        step: fail.step,
        budget,
        memo: HashMap::new(),
        passed: HashMap::new(),
        tests: 0,
    };
    let mut universe = fine.clone();
    let all: Vec<usize> = (0..universe.len()).collect();
    let mut coarse = false;
    let mut start = (!all.is_empty() && t.test(&universe, &all)? == Some(true)).then_some(all);
    if start.is_none() && t.tests < budget {
        // Coarser groups: where the step broke, and every parent module.
        let mut more: Vec<String> = Vec::new();
        for o in [&fail.origins.first_inf, &fail.origins.first_nan]
            .into_iter()
            .flatten()
        {
            more.push(o.module.clone());
        }
        let leaves: Vec<String> = fine.iter().chain(more.clone().iter()).cloned().collect();
        for m in &leaves {
            more.extend(ancestors(m).into_iter().map(str::to_string));
        }
        more.sort_by_key(|m| std::cmp::Reverse(m.matches('.').count()));
        for m in more {
            if !m.is_empty() && !universe.contains(&m) {
                universe.push(m);
            }
        }
        coarse = true;
        let all: Vec<usize> = (0..universe.len()).collect();
        if all.len() > fine.len() && t.test(&universe, &all)? == Some(true) {
            start = Some(all);
        }
    }
    let Some(start) = start else {
        return Ok(None);
    };
    let (mut set, minimal) =
        amprobe::diagnose::module_bisect::ddmin(|s| t.test(&universe, s).map_err(to_lib), start)?;
    set.sort_unstable();
    Ok(Some(Bisected {
        modules: set.iter().map(|&i| universe[i].clone()).collect(),
        modules_run: t.passed.remove(&set),
        universe,
        coarse,
        minimal,
        tests: t.tests,
    }))
}

/// An error of a test run, carried through the library's ddmin.
fn to_lib(e: anyhow::Error) -> amprobe::Error {
    amprobe::Error::Invalid(format!("{e:#}"))
}

/// A remedy tried: what it showed, the plan that applied it, and whether its modules are a
/// pattern (every module whose last segment it is) rather than exact paths.
struct Tried {
    result: RemedyResult,
    plan: Plan,
    pattern: bool,
}

/// The fix as code to paste, for the remedy `t` of a script whose model is of class
/// `model`, on `device`. `transformers`: the model is a transformers PreTrainedModel.
fn fix_code(t: &Tried, device: &str, model: &str, transformers: bool) -> Vec<String> {
    let (r, plan) = (&t.result, &t.plan);
    let mut out = Vec::new();
    match r.kind {
        RemedyKind::Bf16 => {
            out.push(
                "# Every autocast region in bf16, and no loss scaling (bf16 has fp32's range):"
                    .into(),
            );
            out.push(format!(
                "with torch.autocast(\"{device}\", dtype=torch.bfloat16):"
            ));
            out.push("    ...  # the forward pass and the loss, as before".into());
            out.push(format!(
                "scaler = torch.amp.GradScaler(\"{device}\", enabled=False)"
            ));
        }
        RemedyKind::LowerScale => {
            let s = plan.init_scale.unwrap_or(1.0);
            out.push(format!(
                "scaler = torch.amp.GradScaler(\"{device}\", init_scale={s:?})"
            ));
        }
        _ => {
            let names = &plan.fp32_modules;
            let list = names
                .iter()
                .map(|n| format!("\"{n}\""))
                .collect::<Vec<_>>()
                .join(", ");
            if transformers {
                out.push(
                    "# transformers: with the model loaded in half precision \
                     (from_pretrained(..., torch_dtype=torch.float16)), keep their weights in fp32:"
                        .to_string(),
                );
                out.push(format!("{model}._keep_in_fp32_modules = [{list}]"));
                out.push(
                    "# Under autocast (how this run trained, and what was tested), run them outside it:"
                        .into(),
                );
            }
            out.push("import torch".into());
            out.push(String::new());
            out.push(format!(
                "def run_in_fp32(module, device_type=\"{device}\"):"
            ));
            out.push("    \"\"\"Runs `module` outside autocast, on float32 inputs.\"\"\"".into());
            out.push("    forward = module.forward".into());
            out.push(String::new());
            out.push("    def fp32(x):".into());
            out.push(
                "        return x.float() if torch.is_tensor(x) and x.dtype in (torch.float16, torch.bfloat16) else x"
                    .into(),
            );
            out.push(String::new());
            out.push("    def fp32_forward(*args, **kwargs):".into());
            out.push("        with torch.autocast(device_type, enabled=False):".into());
            out.push(
                "            return forward(*map(fp32, args), **{k: fp32(v) for k, v in kwargs.items()})"
                    .into(),
            );
            out.push(String::new());
            out.push("    module.forward = fp32_forward".into());
            out.push(String::new());
            if model.contains(" + ") {
                // Several models given to `watch` are named under their keys: a ModuleDict
                // of them holds the same modules under the same names.
                out.push(
                    "# after the models are built (`model`: torch.nn.ModuleDict of the models \
                     given to watch, under the names given there; a list's are \"0\", \"1\", ...)"
                        .into(),
                );
            } else {
                out.push("# after the model is built (`model`: your model)".into());
            }
            if t.pattern {
                out.push(format!(
                    "for name, module in model.named_modules():  # every `{}` module",
                    names[0]
                ));
                out.push(format!("    if name.split(\".\")[-1] == \"{}\":", names[0]));
                out.push("        run_in_fp32(module)".into());
            } else {
                out.push(format!("for name in [{list}]:"));
                out.push("    run_in_fp32(model.get_submodule(name))".into());
            }
        }
    }
    out
}

/// `fix -- CMD`. Exit code 0 when nothing failed or a remedy makes the failing step
/// finite, 1 when none does.
pub fn run(
    command: &[String],
    out: Option<PathBuf>,
    budget: u32,
    diagnose: DiagnoseOptions,
) -> anyhow::Result<i32> {
    let out = out.unwrap_or_else(|| PathBuf::from("amprobe-fix"));
    std::fs::create_dir_all(&out)
        .map_err(|e| anyhow::anyhow!("creating {}: {e}", out.display()))?;
    let label = command.join(" ");
    let mut runner = Runner {
        command,
        out: &out,
        runs: 0,
    };
    outln!("amprobe fix: running `{label}` to its first failing step")?;
    let own = {
        let mut s = Script::new(command, &out.join("own.jsonl"))?;
        s.log = Some(out.join("own.log"));
        runner.runs += 1;
        s.run_until(failing)?
    };
    let own_trace = own.path.clone();
    let summary = amprobe::diagnose::summary::summary_of_trace(
        &own.trace,
        Some(own_trace.clone()),
        diagnose,
    )?;
    super::run::print_human(&summary)?;
    let Some(fail) = own.trace.steps.iter().find(|s| failing(s)).cloned() else {
        outln!(
            "No step failed in {} steps: nothing to fix.",
            own.trace.steps.len()
        )?;
        return Ok(0);
    };
    let h = &own.trace.header;
    let n = fail.step;
    let precision = h.precision.clone();
    let device = h.policy_device.clone();
    let has_scaler = !h.scaler.is_null();
    let how = match forward_origin(&fail).or_else(|| any_origin(&fail)) {
        Some(o) => format!("first non-finite: {} ({})", op_words(o), phase(o.phase)),
        None if fail.skipped => "skipped by the scaler".into(),
        None => "a non-finite loss or gradient".into(),
    };
    outln!()?;
    outln!("First failing step: {n} ({precision} on {device}; {how}).")?;
    if precision == "fp32" {
        outln!("  The run is fp32: there is no precision to change (look at the data, the learning rate and the model).")?;
        return Ok(1);
    }
    outln!(
        "Re-running `{label}` from scratch to step {n} under each remedy (traces and logs in {}):",
        out.display()
    )?;
    let fp32_plan = Plan {
        autocast: Some(Autocast::Fp32),
        ..Plan::default()
    };
    let reference = runner.run("fp32", fp32_plan, n)?;
    if !reference.finite {
        outln!(
            "  fp32 reference: {}. This is not a precision problem, so no precision remedy can fix it (look at the data, the learning rate and the model).",
            match reference.failed.as_ref() {
                Some(s) => format!("step {} fails in fp32 too", s.step),
                None => format!("the script ended before step {n}"),
            }
        )?;
        return Ok(1);
    }
    let ref_loss = reference.loss;
    outln!(
        "  fp32 reference (AMPROBE_AUTOCAST=fp32): finite to step {n}, loss {}",
        ref_loss.map_or("?".into(), |l| format!("{l:.6}"))
    )?;
    let mut tried = Tries {
        n,
        ref_loss,
        results: Vec::new(),
    };
    if precision == "fp16" {
        let plan = Plan {
            autocast: Some(Autocast::Bf16),
            ..Plan::default()
        };
        let o = runner.run("bf16", plan.clone(), n)?;
        tried.push(RemedyKind::Bf16, "bf16 autocast".into(), plan, &o, false)?;
    }
    // A gradient overflow that goes away at loss scale 1 is the scale's: a lower initial
    // scale fixes it. Anything else left the range: keep modules in fp32.
    let scale_was_the_cause = forward_origin(&fail).is_none()
        && has_scaler
        && fail.scale_before > 1.0
        && try_lower_scale(&mut runner, &own, &fail, &mut tried)?;
    if !scale_was_the_cause {
        try_keep_fp32(&mut runner, &own, &fail, budget, &mut tried)?;
    }
    outln!("The script ran {} times.", runner.runs)?;
    print_fix(&tried, &own_trace, &device, &h.model)
}

/// The remedies tried on failing step `n`, each against the fp32 reference's loss.
struct Tries {
    n: u64,
    ref_loss: Option<f64>,
    results: Vec<Tried>,
}

impl Tries {
    /// Records remedy `name` (run as `o` under `plan`) and prints its line.
    fn push(
        &mut self,
        kind: RemedyKind,
        name: String,
        plan: Plan,
        o: &Outcome,
        pattern: bool,
    ) -> anyhow::Result<()> {
        let result = result(kind, name, &plan, o, self.ref_loss);
        outln!("{}", result_line(&result, self.n))?;
        self.results.push(Tried {
            result,
            plan,
            pattern,
        });
        Ok(())
    }
}

/// Step `fail` re-run at loss scale 1: when that is finite the overflow was the scale's,
/// and the largest initial scale that keeps the step's gradients in range is tried.
/// True when the step is finite at scale 1 (the range is not the problem).
fn try_lower_scale(
    runner: &mut Runner<'_>,
    own: &Finished,
    fail: &StepRecord,
    tried: &mut Tries,
) -> anyhow::Result<bool> {
    let n = tried.n;
    let plan = Plan {
        init_scale: Some(1.0),
        ..Plan::default()
    };
    let one = runner.run("scale-1", plan, n)?;
    if !one.finite {
        return Ok(false);
    }
    let at = one.run.trace.steps.iter().find(|s| s.step == n);
    let safe = at.and_then(safe_scale_at);
    let first = own.trace.steps.first().map_or(1.0, |s| s.scale_before);
    // The scale at step n is the initial one times the growth since: no step before n
    // was skipped.
    let growth = fail.scale_before / first;
    match safe.map(|s| s / growth).filter(|&s| s >= 1.0) {
        Some(init) => {
            let init = 2f64.powi(init.log2().floor() as i32);
            let plan = Plan {
                init_scale: Some(init),
                ..Plan::default()
            };
            let o = runner.run(&format!("scale-{init}"), plan.clone(), n)?;
            let name = format!("initial loss scale {init} = 2^{}", init.log2().round());
            tried.push(RemedyKind::LowerScale, name, plan, &o, false)?;
        }
        None => outln!(
            "  At loss scale 1 step {n} is finite, but no initial scale of 1 or more keeps its gradients in range."
        )?,
    }
    Ok(true)
}

/// The modules kept in fp32 that make step `fail` finite, found by bisection over the
/// model's modules, tried as found and, when they share a last name segment that names
/// more modules, as that pattern.
fn try_keep_fp32(
    runner: &mut Runner<'_>,
    own: &Finished,
    fail: &StepRecord,
    budget: u32,
    tried: &mut Tries,
) -> anyhow::Result<()> {
    let n = tried.n;
    let fine = own
        .trace
        .steps
        .first()
        .map(|s| param_modules(s.params.iter().map(|p| p.name.as_str())))
        .unwrap_or_default();
    let Some(b) = bisect(runner, fail, fine, budget)? else {
        outln!("  Bisection: keeping the model's modules in fp32 does not make step {n} finite.")?;
        return Ok(());
    };
    outln!(
        "  Bisection ({} runs over {} candidate modules{}): keeping {} in fp32 makes step {n} finite{}.",
        b.tests,
        b.universe.len(),
        if b.coarse { ", parent modules included" } else { "" },
        b.modules.join(", "),
        if b.minimal {
            " (1-minimal: dropping any one of them fails again)"
        } else {
            " (the run budget ran out before the set was minimal)"
        }
    )?;
    let plan = Plan {
        fp32_modules: b.modules.clone(),
        ..Plan::default()
    };
    let o = match b.modules_run {
        Some(o) => o,
        None => runner.run("keep-fp32", plan.clone(), n)?,
    };
    let name = format!("keeping {} in fp32", b.modules.join(", "));
    tried.push(RemedyKind::KeepFp32, name, plan, &o, false)?;
    // Generalise to the shared last segment when it keeps more than the set.
    let last = |m: &str| m.rsplit('.').next().unwrap_or(m).to_string();
    let seg = last(&b.modules[0]);
    let shared = b.modules.iter().all(|m| last(m) == seg);
    let wider = b
        .universe
        .iter()
        .any(|m| module_matches(&seg, m) && !b.modules.contains(m));
    if shared && wider {
        let plan = Plan {
            fp32_modules: vec![seg.clone()],
            ..Plan::default()
        };
        let o = runner.run("keep-fp32-pattern", plan.clone(), n)?;
        let name = format!("keeping every `{seg}` module in fp32");
        tried.push(RemedyKind::KeepFp32, name, plan, &o, true)?;
    }
    Ok(())
}

/// The remedies that made the step finite, ranked by their loss's distance from fp32's,
/// and the best one as code to paste. Exit code 0, or 1 when none did.
fn print_fix(tried: &Tries, own_trace: &Path, device: &str, model: &str) -> anyhow::Result<i32> {
    let n = tried.n;
    let mut ranked: Vec<&Tried> = tried.results.iter().filter(|t| t.result.finite).collect();
    ranked.sort_by(|a, b| {
        let k = |t: &Tried| t.result.loss_rel_err.unwrap_or(f64::INFINITY);
        k(a).total_cmp(&k(b))
    });
    let Some(best) = ranked.first() else {
        outln!("No remedy makes step {n} finite.")?;
        return Ok(1);
    };
    outln!("Ranked by what they cost against fp32 (relative difference of the loss at step {n}):")?;
    let width = ranked
        .iter()
        .map(|t| t.result.remedy.len())
        .max()
        .unwrap_or(0);
    for (i, t) in ranked.iter().enumerate() {
        outln!(
            "  {}. {:<width$}  {}",
            i + 1,
            t.result.remedy,
            t.result
                .loss_rel_err
                .map_or("?".into(), |v| format!("{v:.1e}"))
        )?;
    }
    let transformers = header_of(own_trace).and_then(|h| h.source?.transformers) == Some(true);
    outln!()?;
    outln!(
        "Fix: {} (what {} did). Paste into the script:",
        best.result.remedy,
        best.plan.shell()
    )?;
    for line in fix_code(best, device, model, transformers) {
        if line.is_empty() {
            outln!()?;
        } else {
            outln!("    {line}")?;
        }
    }
    Ok(0)
}

/// The largest power-of-two loss scale at which every backward op of step `s` (run at its
/// own `scale_before`) stays below its dtype's largest value.
fn safe_scale_at(s: &StepRecord) -> Option<f64> {
    let ops = s.ops.as_deref()?;
    let backward = ops
        .iter()
        .filter(|o| o.phase == Phase::Backward)
        .map(|o| (o.output.dtype, o.stats.max_abs));
    safe_scale(backward, s.scale_before)
}

/// The smallest safe power-of-two scale over ops given as (dtype, largest |x| at `scale`).
fn safe_scale(ops: impl Iterator<Item = (DType, f64)>, scale: f64) -> Option<f64> {
    let mut safe: Option<f64> = None;
    for (dtype, max_abs) in ops {
        let Some(limit) = dtype.format().map(|f| f.max) else {
            continue;
        };
        if let Some(x) = safe_pow2_scale(max_abs / scale, limit) {
            if safe.is_none_or(|b| x < b) {
                safe = Some(x);
            }
        }
    }
    safe
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn candidates_are_the_modules_that_own_parameters() {
        let names = [
            "embed.weight",
            "embed.bias",
            "blocks.0.up.weight",
            "scale",
            "head.weight",
        ];
        assert_eq!(
            param_modules(names.into_iter()),
            ["embed", "blocks.0.up", "head"]
        );
        assert_eq!(ancestors("a.b.c"), ["a.b", "a"]);
        assert!(ancestors("a").is_empty());
    }

    #[test]
    fn the_fix_names_the_modules_as_code() {
        let tried = |kind, fp32_modules: &[&str], init_scale, pattern| Tried {
            result: RemedyResult {
                kind,
                remedy: String::new(),
                flags: vec![],
                finite: true,
                skipped: false,
                first_nonfinite: None,
                loss: Some(1.0),
                loss_rel_err: Some(1e-4),
                hidden_rel_err: None,
            },
            plan: Plan {
                autocast: None,
                fp32_modules: fp32_modules.iter().map(|m| m.to_string()).collect(),
                init_scale,
            },
            pattern,
        };
        let t = tried(RemedyKind::KeepFp32, &["blocks.1.down"], None, false);
        let code = fix_code(&t, "cuda", "Net", false).join("\n");
        assert!(code.contains("for name in [\"blocks.1.down\"]:"), "{code}");
        assert!(
            code.contains("torch.autocast(device_type, enabled=False)")
                && code.contains("device_type=\"cuda\"")
        );
        assert!(!code.contains("_keep_in_fp32_modules"));
        let t = tried(RemedyKind::KeepFp32, &["wo"], None, true);
        let code = fix_code(&t, "cuda", "T5ForConditionalGeneration", true).join("\n");
        assert!(
            code.contains("T5ForConditionalGeneration._keep_in_fp32_modules = [\"wo\"]"),
            "{code}"
        );
        assert!(
            code.contains("if name.split(\".\")[-1] == \"wo\":"),
            "{code}"
        );
        // Several models given to watch: their names are under a ModuleDict's keys.
        let t = tried(RemedyKind::KeepFp32, &["D.2"], None, false);
        let code = fix_code(&t, "cpu", "Sequential + Sequential", false).join("\n");
        assert!(
            code.contains("`model`: torch.nn.ModuleDict of the models given to watch")
                && code.contains("for name in [\"D.2\"]:"),
            "{code}"
        );
        let t = tried(RemedyKind::LowerScale, &[], Some(1024.0), false);
        let code = fix_code(&t, "cpu", "Net", false);
        assert_eq!(
            code,
            ["scaler = torch.amp.GradScaler(\"cpu\", init_scale=1024.0)"]
        );
    }

    #[test]
    fn the_safe_scale_is_the_smallest_over_the_ops() {
        // At scale 2: unscaled 1.0 and 4.0 in fp16 (4 · 2^13 = 32768 < 65504, not 2^14),
        // and 4.0 in fp32.
        let ops = [(DType::F16, 2.0), (DType::F16, 8.0), (DType::F32, 8.0)];
        assert_eq!(safe_scale(ops.into_iter(), 2.0), Some(8192.0));
        assert_eq!(safe_scale([(DType::F16, 0.0)].into_iter(), 1.0), None);
        assert_eq!(rel_err(Some(1.5), Some(1.0)), Some(0.5));
        assert_eq!(rel_err(Some(1.5), None), None);
    }
}
