//! `amprobe export --perfetto TRACE --out FILE.json`: a trace in the Chrome trace-event
//! format (opens in Perfetto and chrome://tracing).

use super::out::outln;
use amprobe::report::perfetto::write_perfetto;
use amprobe::report::TraceFile;
use clap::Args;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct ExportArgs {
    /// Write Chrome trace-event JSON (Perfetto, chrome://tracing).
    #[arg(long)]
    perfetto: bool,
    /// Trace file (JSON Lines) written by `amprobe run --trace`.
    trace: PathBuf,
    /// Output file.
    #[arg(long)]
    out: PathBuf,
}

pub fn run(a: ExportArgs) -> anyhow::Result<i32> {
    if !a.perfetto {
        anyhow::bail!("export: choose a format (--perfetto)");
    }
    let tf = TraceFile::open(&a.trace)?;
    write_perfetto(&tf, &a.out)?;
    if let Some(w) = amprobe::report::summary_doc::completeness(&tf) {
        outln!("note: {w}")?;
    }
    outln!(
        "wrote {} ({} steps); open it in https://ui.perfetto.dev or chrome://tracing",
        a.out.display(),
        tf.trace.steps.len()
    )?;
    Ok(0)
}
