//! `amprobe report TRACE --out DIR [--step N] [--fail-on RULES]`: charts, `summary.md`
//! and `index.html` of a trace, and the CI gate.

use super::out::{out, outln};
use amprobe::report::gate::{self, Gate};
use amprobe::report::{write_report, ReportOptions, TraceFile};
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
    /// skip-rate>X%, headroom>X%, underflow>X%, scale-collapse.
    #[arg(long, value_name = "RULES")]
    fail_on: Option<String>,
}

pub fn run(a: ReportArgs) -> anyhow::Result<i32> {
    // Bad rules are an error before any work is done.
    let rules = a.fail_on.as_deref().map(gate::parse_rules).transpose()?;
    let tf = TraceFile::open(&a.trace)?;
    let out = write_report(
        &tf,
        &ReportOptions {
            out_dir: a.out.clone(),
            step: a.step,
        },
    )?;
    if let Some(w) = amprobe::report::summary_doc::completeness(&tf) {
        outln!("note: {w}")?;
    }
    outln!("verdict: {}", out.facts.verdict)?;
    outln!("report: {}", out.index_html.display())?;
    outln!("summary: {}", out.summary_md.display())?;
    let Some(rules) = rules else {
        return Ok(0);
    };
    let mut g = Gate::new(rules);
    for s in &tf.trace.steps {
        g.observe(s);
    }
    let outcomes = g.outcomes();
    out!("{}", gate::format_outcomes(&outcomes, gate::stdout_color()))?;
    Ok(gate::exit_code(&outcomes))
}
