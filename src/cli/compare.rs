//! `amprobe compare A.jsonl B.jsonl [C.jsonl ...] --out DIR`: runs of one model in
//! different precisions, op by op against the fp32 run. Without an fp32 trace (fp16 against
//! bf16, say), the fp32 reference is made by re-running the configuration recorded in the
//! first trace's header in fp32; when that cannot be done, the first trace is the reference.

use super::out::outln;
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
    #[arg(num_args = 2..=6, required = true)]
    traces: Vec<PathBuf>,
    /// Output folder (created if missing).
    #[arg(long)]
    out: PathBuf,
    /// Relative difference of an op's max |x| or L2 norm above which it diverged.
    #[arg(long, default_value_t = DEFAULT_THRESHOLD)]
    threshold: f64,
    /// Position (1-based) of the reference trace; default: the fp32 run.
    #[arg(long, value_name = "N")]
    reference: Option<usize>,
}

pub fn run(a: CompareArgs) -> anyhow::Result<i32> {
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
        match rerun_fp32(&traces, &a.out) {
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
    let out = write_compare(
        &traces,
        &CompareOptions {
            out_dir: a.out.clone(),
            threshold: a.threshold,
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
