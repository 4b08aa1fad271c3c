//! Subcommands. anyhow lives here, at the edge; the library has one error type.

mod compare;
mod export;
mod report;
mod run;
mod scaler;

use clap::{Parser, Subcommand};

/// Finds where mixed-precision training goes numerically wrong, says why, and proves the fix.
#[derive(Parser, Debug)]
#[command(name = "amprobe", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run AMP training steps with probes on every op.
    Run(Box<run::RunArgs>),
    /// Charts, summary.md and index.html of a trace.
    Report(report::ReportArgs),
    /// Compare runs of one model in different precisions, op by op against fp32.
    Compare(compare::CompareArgs),
    /// Export a trace to another format (Chrome trace events for Perfetto).
    Export(export::ExportArgs),
    /// Loss-scaler tools.
    Scaler {
        #[command(subcommand)]
        command: scaler::ScalerCommand,
    },
}

/// Parses the command line and runs; returns the exit code.
pub fn main() -> anyhow::Result<i32> {
    let cli = Cli::parse();
    match cli.command {
        Command::Run(a) => run::run(*a),
        Command::Report(a) => report::run(a),
        Command::Export(a) => export::run(a),
        Command::Compare(a) => compare::run(a),
        Command::Scaler { command } => scaler::run(command),
    }
}
