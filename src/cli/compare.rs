//! `amprobe compare A.jsonl B.jsonl [C.jsonl ...] --out DIR`: runs of one model in
//! different precisions, op by op against the fp32 run.

use super::out::outln;
use amprobe::report::compare::{
    first_divergence_lines, write_compare, CompareOptions, DEFAULT_THRESHOLD,
};
use amprobe::report::TraceFile;
use clap::Args;
use std::path::PathBuf;

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
    let traces = a
        .traces
        .iter()
        .map(TraceFile::open)
        .collect::<amprobe::Result<Vec<_>>>()?;
    let reference = match a.reference {
        Some(0) => anyhow::bail!("compare --reference: positions start at 1"),
        r => r.map(|r| r - 1),
    };
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
