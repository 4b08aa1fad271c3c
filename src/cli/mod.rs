//! Layer 13 of `amprobe::LAYERS`: may use layers 0–12 (`dtype` … `tui`).
//!
//! Subcommands. anyhow lives here, at the edge; the library has one error type.

mod baseline;
mod bisect;
mod companion;
mod compare;
mod diagnose_args;
mod doctor;
mod env_check;
mod export;
mod fix;
mod fix_script;
mod out;
mod report;
mod run;
mod scaler;
mod script;
mod shrink;
mod tui;

use clap::{Parser, Subcommand};

/// Finds where mixed-precision training goes numerically wrong, says why, and proves the fix.
#[derive(Parser, Debug)]
#[command(name = "amprobe", version, about)]
struct Cli {
    /// Run the host's matrix products with the fixed-order kernels, whose bits are the same
    /// on every machine, instead of the fastest for this one (also AMPROBE_REPRODUCIBLE=1).
    #[arg(long, global = true)]
    reproducible: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run AMP training steps with probes on every op.
    Run(Box<run::RunArgs>),
    /// Charts, summary.md and index.html of a trace.
    Report(report::ReportArgs),
    /// Watch a run live or replay a trace in a terminal UI.
    Tui(Box<tui::TuiArgs>),
    /// Find the first failing step, re-run it under each remedy (bf16, modules kept in fp32
    /// by bisection, the T5 clamp, a safe loss scale) and report which make it finite and
    /// what they cost in accuracy against fp32.
    Fix(Box<fix::FixArgs>),
    /// Find a minimal set of modules that, kept in fp32, makes the first failing step finite.
    Bisect(Box<bisect::BisectArgs>),
    /// Find the smallest batch (rows, sequence length, steps) that still makes the first
    /// Inf/NaN at the same op, and write it as an --inputs file.
    Shrink(Box<shrink::ShrinkArgs>),
    /// Write a numerics lockfile: every op's envelope in a run, for `--fail-on drift`.
    Baseline(Box<baseline::BaselineArgs>),
    /// Compare runs of one model in different precisions, op by op against fp32.
    Compare(compare::CompareArgs),
    /// Export a trace to another format (Chrome trace events for Perfetto).
    Export(export::ExportArgs),
    /// What this machine offers the CUDA backend (driver, device, NVRTC, cuBLAS), and a
    /// device self-test against the CPU emulator.
    Doctor(doctor::DoctorArgs),
    /// Loss-scaler tools.
    Scaler {
        #[command(subcommand)]
        command: scaler::ScalerCommand,
    },
}

/// Parses the command line and runs; returns the exit code.
pub fn main() -> anyhow::Result<i32> {
    let cli = Cli::parse();
    env_check::check()?;
    if cli.reproducible {
        amprobe::ops::linalg::host_gemm::set_reproducible(true);
    }
    match cli.command {
        Command::Run(a) => run::run(*a),
        Command::Report(a) => report::run(a),
        Command::Fix(a) => fix::run(*a),
        Command::Bisect(a) => bisect::run(*a),
        Command::Baseline(a) => baseline::run(*a),
        Command::Shrink(a) => shrink::run(*a),
        Command::Export(a) => export::run(a),
        Command::Compare(a) => compare::run(a),
        Command::Scaler { command } => scaler::run(command),
        Command::Tui(a) => tui::run(*a),
        Command::Doctor(a) => doctor::run(a),
    }
}
