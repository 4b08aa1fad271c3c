//! `amprobe compare A.jsonl B.jsonl [C.jsonl ...] --out DIR`: runs of one model in
//! different precisions, op by op against the fp32 run. Without an fp32 trace (fp16 against
//! bf16, say), the fp32 reference is made by re-running the configuration recorded in the
//! first trace's header in fp32; when that cannot be done, the first trace is the reference.
//!
//! `amprobe compare [--out DIR] [--steps N] -- CMD ARGS...`: a PyTorch script that calls
//! `amprobe_torch.watch`, run from scratch in its own precision, in bf16 and in fp32 (the
//! companion forces autocast's dtype, or turns it off, in the script's process), then
//! compared as above against the fp32 run.

use super::out::outln;
use super::script::{Autocast, Ended, Plan, Script};
use amprobe::config::RunConfig;
use amprobe::diagnose::remedy::RemedyMode;
use amprobe::report::compare::{
    first_divergence_lines, write_compare, CompareOptions, DEFAULT_THRESHOLD,
};
use amprobe::report::TraceFile;
use amprobe::runner::RunOptions;
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
        let f = s.run_until(|st| steps.is_some_and(|n| st.step + 1 >= n))?;
        let summary = summary_of_trace(&f.trace, None, Default::default())?;
        let p = &f.trace.header.precision;
        let what = match s.plan.autocast {
            None => format!("{p}, its own precision"),
            Some(forced) if forced.name() != p => anyhow::bail!(
                "{}={} did not take: the trace of that run says {p}; does the script set \
                 autocast's state without torch.autocast (torch.set_autocast_enabled)?",
                super::script::AUTOCAST_VAR,
                forced.name()
            ),
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
            s.trace.display()
        )?;
        Ok(TraceFile::open(&s.trace)?)
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

/// Re-runs the configuration recorded in the first trace's header in fp32, writing the
/// trace into `out`; fails, saying why, when the traces do not share one configuration or
/// its files are not reachable.
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
