//! `amprobe report TRACE --out DIR`: charts, `summary.md` and `index.html` of a trace.

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
}

pub fn run(a: ReportArgs) -> anyhow::Result<i32> {
    let tf = TraceFile::open(&a.trace)?;
    let out = write_report(
        &tf,
        &ReportOptions {
            out_dir: a.out.clone(),
            step: a.step,
        },
    )?;
    if let Some(w) = amprobe::report::summary::completeness(&tf) {
        println!("note: {w}");
    }
    println!("verdict: {}", out.facts.verdict);
    println!("report: {}", out.index_html.display());
    println!("summary: {}", out.summary_md.display());
    Ok(0)
}
