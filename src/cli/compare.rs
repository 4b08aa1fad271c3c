//! `amprobe compare A.jsonl B.jsonl [C.jsonl ...] --out DIR`: runs of one model in
//! different precisions, op by op against the fp32 run. Without an fp32 trace (fp16 against
//! bf16, say), the fp32 reference is made by re-running the configuration recorded in the
//! first trace's header in fp32; when that cannot be done, the first trace is the reference.
//!
//! `amprobe compare [--out DIR] [--steps N] -- CMD ARGS...`: a PyTorch script that calls
//! `amprobe_torch.watch`, run from scratch in its own precision, in bf16 and in fp32 (the
//! companion forces autocast's dtype, or turns it off, in the script's process), then
//! compared as above against the fp32 run. Each forced run is held to its plan: one the
//! companion refused, or whose trace shows it did not take, is an error that says why.

use super::out::outln;
use super::script::{Autocast, Ended, Finished, Plan, Script};
use amprobe::config::RunConfig;
use amprobe::diagnose::remedy::RemedyMode;
use amprobe::report::compare::{
    first_divergence_lines, write_compare, CompareOptions, DEFAULT_THRESHOLD,
};
use amprobe::report::TraceFile;
use amprobe::runner::RunOptions;
use amprobe::trace::io::Trace;
use amprobe::trace::record::{Phase, StepRecord};
use clap::Args;
use std::path::{Path, PathBuf};

#[derive(Args, Debug)]
pub struct CompareArgs {
    /// Trace files (JSON Lines) of the same model in different precisions.
    #[arg(num_args = 2..=6, required_unless_present = "command")]
    traces: Vec<PathBuf>,
    /// Output folder (created if missing); for a script also its traces and logs (default
    /// amprobe-compare).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Relative difference of an op's max |x| or L2 norm above which it diverged.
    #[arg(long, default_value_t = DEFAULT_THRESHOLD)]
    threshold: f64,
    /// Position (1-based) of the reference trace; default: the fp32 run.
    #[arg(long, value_name = "N")]
    reference: Option<usize>,
    /// With a script: stop each run once it has written this many steps.
    #[arg(long, value_name = "N")]
    steps: Option<u64>,
    /// With a script: keep full op records every N steps (default 1: every step, which
    /// the op-by-op comparison needs).
    #[arg(long, value_name = "N")]
    sample_every: Option<u64>,
    /// A PyTorch training script (after `--`) that calls `amprobe_torch.watch(...)`: run
    /// in its own precision, in bf16 and in fp32, then compared.
    #[arg(last = true, value_name = "CMD", conflicts_with_all = ["traces", "reference"])]
    command: Vec<String>,
}

pub fn run(a: CompareArgs) -> anyhow::Result<i32> {
    if !a.command.is_empty() {
        return run_script(&a);
    }
    if a.steps.is_some() || a.sample_every.is_some() {
        anyhow::bail!("compare: --steps and --sample-every apply to a script given after `--`");
    }
    let Some(out_dir) = a.out.clone() else {
        anyhow::bail!("compare: give the output folder with --out DIR");
    };
    let mut traces = a
        .traces
        .iter()
        .map(TraceFile::open)
        .collect::<amprobe::Result<Vec<_>>>()?;
    let mut reference = match a.reference {
        Some(0) => anyhow::bail!("compare --reference: positions start at 1"),
        r => r.map(|r| r - 1),
    };
    let has_fp32 = traces.iter().any(|t| t.trace.header.precision == "fp32");
    if reference.is_none() && !has_fp32 {
        let first = &traces[0];
        match rerun_fp32(&traces, &out_dir) {
            Ok(path) => {
                outln!(
                    "no fp32 trace given: re-ran the configuration recorded in {} (model, \
                     weights, data, seed) in fp32 as the reference: {}",
                    first.path.display(),
                    path.display()
                )?;
                traces.push(TraceFile::open(&path)?);
                reference = Some(traces.len() - 1);
            }
            Err(why) => {
                outln!(
                    "no fp32 trace given, and the recorded configuration cannot be re-run \
                     ({why}): comparing directly against {} ({}) as the reference",
                    first.path.display(),
                    first.trace.header.precision
                )?;
                reference = Some(0);
            }
        }
    }
    write_and_tell(&traces, out_dir, a.threshold, reference)
}

/// `compare -- CMD`: the script run in its own precision, then forced to bf16 and to fp32
/// (a precision that is its own is not run twice), each with op records kept every
/// `--sample-every` steps, and the traces compared against the fp32 run.
fn run_script(a: &CompareArgs) -> anyhow::Result<i32> {
    use amprobe::diagnose::summary::summary_of_trace;
    if a.steps == Some(0) {
        anyhow::bail!("compare --steps: expected at least 1 step");
    }
    let out_dir = a
        .out
        .clone()
        .unwrap_or_else(|| PathBuf::from("amprobe-compare"));
    std::fs::create_dir_all(&out_dir)
        .map_err(|e| anyhow::anyhow!("creating {}: {e}", out_dir.display()))?;
    let sample_every = a.sample_every.unwrap_or(1);
    let steps = a.steps;
    let run = |name: &str, plan: Plan| -> anyhow::Result<TraceFile> {
        let mut s = Script::new(&a.command, &out_dir.join(format!("{name}.jsonl")))?;
        s.log = Some(out_dir.join(format!("{name}.log")));
        s.sample_every = Some(sample_every);
        s.plan = plan;
        let f = run_planned(&s, |st| steps.is_some_and(|n| st.step + 1 >= n))?;
        let summary = summary_of_trace(&f.trace, None, Default::default())?;
        let p = &f.trace.header.precision;
        let what = match s.plan.autocast {
            None => format!("{p}, its own precision"),
            Some(_) => format!("{p}, forced ({})", s.plan.shell()),
        };
        outln!(
            "  {what}: {} steps{}, {} skipped, verdict {} ({})",
            f.trace.steps.len(),
            if f.ended == Ended::Stopped {
                " (then stopped)"
            } else {
                ""
            },
            summary.skipped_steps,
            summary.verdict,
            f.path.display()
        )?;
        Ok(TraceFile::open(&f.path)?)
    };
    outln!(
        "amprobe compare: running `{}` in its own precision, in bf16 and in fp32{}",
        a.command.join(" "),
        steps.map_or(String::new(), |n| format!(", {n} steps each"))
    )?;
    let own = run("own", Plan::default())?;
    let own_precision = own.trace.header.precision.clone();
    let mut traces = vec![own];
    for forced in [Autocast::Bf16, Autocast::Fp32] {
        if own_precision == forced.name() {
            outln!("  {}: its own precision, run above", forced.name())?;
            continue;
        }
        let plan = Plan {
            autocast: Some(forced),
            ..Plan::default()
        };
        traces.push(run(forced.name(), plan)?);
    }
    let reference = traces
        .iter()
        .position(|t| t.trace.header.precision == "fp32");
    write_and_tell(&traces, out_dir, a.threshold, reference)
}

/// Runs `s` until `stop` says a step is the last one needed ([`Script::run_until`]), held
/// to its plan: a plan the companion refused (its `PlanError` in the run's output) or one
/// the trace shows did not take is an error naming why.
pub(super) fn run_planned(
    s: &Script,
    stop: impl FnMut(&StepRecord) -> bool,
) -> anyhow::Result<Finished> {
    let f = match s.run_until(stop) {
        Ok(f) => f,
        Err(e) => match refused(s) {
            Some(why) => anyhow::bail!(
                "the companion could not apply {} to `{}`: {why}{}",
                s.plan.shell(),
                s.label(),
                s.log
                    .as_ref()
                    .map_or(String::new(), |l| format!(" (its output: {})", l.display()))
            ),
            None => return Err(e),
        },
    };
    if let Some(why) = not_taken(&s.plan, &f.trace) {
        anyhow::bail!(
            "{} did not take in `{}` ({}): {why}",
            s.plan.shell(),
            s.label(),
            f.path.display()
        );
    }
    Ok(f)
}

/// The companion's reason for refusing the plan of run `s`: the message of the
/// `PlanError` in its output (where discovery met it, the script ran on unwatched).
fn refused(s: &Script) -> Option<String> {
    if s.plan == Plan::default() {
        return None;
    }
    let text = std::fs::read_to_string(s.log.as_ref()?).ok()?;
    text.lines().rev().find_map(|l| {
        l.split_once("PlanError: ")
            .map(|(_, m)| m.trim().to_string())
    })
}

/// Why `plan` did not take in the run that wrote `trace`, or None where it did: the
/// precision the trace says is not the one forced, or its first step's loss scale is not
/// the initial one asked for.
fn not_taken(plan: &Plan, trace: &Trace) -> Option<String> {
    let p = &trace.header.precision;
    if let Some(forced) = plan.autocast.filter(|f| f.name() != p) {
        let want = forced.name();
        return Some(match p.as_str() {
            "half" | "bfloat16-pure" => format!(
                "the run's trace says {p}: most of the model's parameters are 16-bit (the model \
                 itself was made so), which autocast's dtype does not change, not {want}"
            ),
            _ => {
                let (low, all) = forward_ops_in(trace, p);
                format!(
                    "the run's trace says {p}, not {want}: {low} of its first recorded step's {all} \
                     forward ops ran in {p} outside the torch.autocast regions the plan forces \
                     (values made {p} by the script or a library it calls: a cast by hand, or \
                     FSDP2's MixedPrecisionPolicy(param_dtype=...)), which the plan does not change"
                )
            }
        });
    }
    let want = plan.init_scale?;
    let first = trace.steps.first()?.scale_before;
    (first != want).then(|| {
        format!(
            "its first step's loss scale is {first}, not {want}: the GradScaler that scales the \
             loss is not the one the companion watched ({})",
            match trace.header.scaler.get("init_scale") {
                Some(v) => format!("that one's initial scale: {v}"),
                None => "it watched none enabled".into(),
            }
        )
    })
}

/// (how many, of how many) forward ops of the first step with op records made an output
/// in the dtype of precision `p` (`fp16`, `bf16`).
fn forward_ops_in(trace: &Trace, p: &str) -> (usize, usize) {
    let dtype = amprobe::dtype::DType::parse(p);
    let ops = trace
        .steps
        .iter()
        .find_map(|s| s.ops.as_deref())
        .unwrap_or(&[]);
    let forward: Vec<_> = ops.iter().filter(|o| o.phase == Phase::Forward).collect();
    let low = forward
        .iter()
        .filter(|o| Some(o.output.dtype) == dtype)
        .count();
    (low, forward.len())
}

/// Writes the comparison's report and prints its first divergences and where it went.
fn write_and_tell(
    traces: &[TraceFile],
    out_dir: PathBuf,
    threshold: f64,
    reference: Option<usize>,
) -> anyhow::Result<i32> {
    let out = write_compare(
        traces,
        &CompareOptions {
            out_dir,
            threshold,
            reference,
        },
    )?;
    for line in first_divergence_lines(&out.comparison) {
        outln!("{line}")?;
    }
    outln!("report: {}", out.index_html.display())?;
    outln!("summary: {}", out.summary_md.display())?;
    Ok(0)
}

/// Re-runs the configuration recorded in the first trace's header in fp32, writing the
/// trace into `out`; fails, saying why, when the traces do not share one configuration or
/// its files are not reachable.
fn rerun_fp32(traces: &[TraceFile], out: &Path) -> Result<PathBuf, String> {
    let h = &traces[0].trace.header;
    let same_run = |v: &serde_json::Value| {
        (
            v.get("model").cloned(),
            v.get("data").cloned(),
            v.pointer("/train/seed").cloned(),
            v.pointer("/train/steps").cloned(),
        )
    };
    if let Some(t) = traces[1..]
        .iter()
        .find(|t| same_run(&t.trace.header.config) != same_run(&h.config))
    {
        return Err(format!(
            "{} and {} record different models, data, seeds or step counts",
            traces[0].path.display(),
            t.path.display()
        ));
    }
    let mut cfg: RunConfig = serde_json::from_value(h.config.clone())
        .map_err(|e| format!("its header's configuration does not read back: {e}"))?;
    cfg.base_dir = h
        .config_dir
        .clone()
        .ok_or("its header does not say where the configuration's files are")?;
    std::fs::create_dir_all(out).map_err(|e| format!("{}: {e}", out.display()))?;
    let path = out.join("reference-fp32.jsonl");
    cfg.train.precision = Some("fp32".into());
    cfg.train.backend = Some("cpu".into());
    cfg.probe.trace = Some(path.clone());
    cfg.probe.summary_json = None;
    cfg.probe.enabled = Some(true);
    // Every step keeps its op records (when the run is short), so each step the other
    // traces kept has a reference.
    if cfg.steps() <= 100 {
        cfg.probe.sample_every = Some(1);
    }
    let mut opts = RunOptions {
        command_line: std::env::args().collect(),
        ..RunOptions::default()
    };
    // The reference needs no diagnosis of its own: no re-runs.
    opts.diagnose.classify_limit = 0;
    opts.diagnose.remedies = RemedyMode::Off;
    amprobe::runner::run(&cfg, &opts).map_err(|e| e.to_string())?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use amprobe::trace::record::Header;

    fn trace(precision: &str, init_scale: Option<f64>, first_scale: f64) -> Trace {
        let mut header = Header::new();
        header.precision = precision.into();
        if let Some(s) = init_scale {
            header.scaler = serde_json::json!({ "init_scale": s });
        }
        let step = StepRecord {
            scale_before: first_scale,
            ..StepRecord::default()
        };
        Trace {
            header,
            steps: vec![step],
            end: None,
            truncated: None,
        }
    }

    fn plan(autocast: Option<Autocast>, init_scale: Option<f64>) -> Plan {
        Plan {
            autocast,
            init_scale,
            ..Plan::default()
        }
    }

    #[test]
    fn a_plan_that_did_not_take_is_named_with_what_the_trace_shows() {
        let fp32 = plan(Some(Autocast::Fp32), None);
        assert_eq!(not_taken(&fp32, &trace("fp32", None, 1.0)), None);
        let why = not_taken(&fp32, &trace("bf16", None, 1.0)).unwrap();
        assert!(
            why.contains("says bf16, not fp32")
                && why.contains("outside the torch.autocast regions"),
            "{why}"
        );
        let why = not_taken(&plan(Some(Autocast::Bf16), None), &trace("half", None, 1.0)).unwrap();
        assert!(
            why.contains("parameters are 16-bit") && why.ends_with("not bf16"),
            "{why}"
        );
        let scale = plan(None, Some(1024.0));
        assert_eq!(
            not_taken(&scale, &trace("fp16", Some(1024.0), 1024.0)),
            None
        );
        let why = not_taken(&scale, &trace("fp16", Some(65536.0), 65536.0)).unwrap();
        assert!(
            why.contains("loss scale is 65536, not 1024") && why.contains("initial scale: 65536"),
            "{why}"
        );
        let why = not_taken(&scale, &trace("fp32", None, 1.0)).unwrap();
        assert!(why.contains("it watched none enabled"), "{why}");
    }

    #[test]
    fn a_refused_plan_is_read_from_the_runs_output() {
        let d =
            std::env::temp_dir().join(format!("amprobe-compare-refused-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let log = d.join("run.log");
        std::fs::write(
            &log,
            "Traceback (most recent call last):\n  ...\namprobe_torch._plan.PlanError: \
             AMPROBE_FP32_MODULES: no module of Net matches `nothing`\ntraining goes on\n",
        )
        .unwrap();
        let cmd: Vec<String> = vec!["python".into(), "train.py".into()];
        let mut s = Script::new(&cmd, &d.join("t.jsonl")).unwrap();
        s.log = Some(log);
        // Without a plan, nothing was refused.
        assert_eq!(refused(&s), None);
        s.plan.fp32_modules = vec!["nothing".into()];
        assert_eq!(
            refused(&s).as_deref(),
            Some("AMPROBE_FP32_MODULES: no module of Net matches `nothing`")
        );
    }
}
