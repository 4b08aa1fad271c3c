//! `amprobe report TRACE --out DIR [--step N] [--fail-on RULES]`: charts, `summary.md`
//! and `index.html` of a trace, and the CI gate.

use super::out::{out, outln};
use amprobe::report::gate::{self, Gate};
use amprobe::report::{write_report, ReportOptions, TraceFile};
use anyhow::Context;
use clap::Args;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct ReportArgs {
    /// Trace file (JSON Lines) written by `amprobe run --trace`.
    trace: PathBuf,
    /// Output folder (created if missing).
    #[arg(long)]
    out: PathBuf,
    /// Step of the per-op chart (default: the first step with op records and an Inf/NaN,
    /// else the first step with op records).
    #[arg(long)]
    step: Option<u64>,
    /// Exit 1 when the trace breaks one of these rules (comma-separated): nonfinite,
    /// skip-rate>X%, headroom>X%, underflow>X%, scale-collapse, drift[=FILE] (a lockfile
    /// written by `amprobe baseline`, default amprobe.lock); summary.md gets a section.
    #[arg(long, value_name = "RULES")]
    fail_on: Option<String>,
}

pub fn run(a: ReportArgs) -> anyhow::Result<i32> {
    // Bad rules and lockfiles are an error before any work is done.
    let gate = a
        .fail_on
        .as_deref()
        .map(|r| Gate::new(gate::parse_rules(r)?))
        .transpose()
        .context("--fail-on")?;
    let tf = TraceFile::open(&a.trace)?;
    let outcomes = gate.map(|mut g| {
        g.observe_header(&tf.trace.header);
        for s in &tf.trace.steps {
            g.observe(s);
        }
        g.outcomes()
    });
    let out = write_report(
        &tf,
        &ReportOptions {
            out_dir: a.out.clone(),
            step: a.step,
            gate: outcomes.clone().unwrap_or_default(),
        },
    )?;
    if let Some(w) = amprobe::report::summary_doc::completeness(&tf) {
        outln!("note: {w}")?;
    }
    outln!("verdict: {}", out.facts.verdict)?;
    outln!("report: {}", out.index_html.display())?;
    outln!("summary: {}", out.summary_md.display())?;
    let Some(outcomes) = outcomes else {
        return Ok(0);
    };
    out!("{}", gate::format_outcomes(&outcomes, gate::stdout_color()))?;
    Ok(gate::exit_code(&outcomes))
}
