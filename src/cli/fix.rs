//! `amprobe fix CONFIG [run flags]`: run to the first failing step, re-run it under each
//! remedy, and report which make it finite and at what cost in accuracy.

use super::out::outln;
use super::run::{config, print_human, run_with, RunArgs};
use amprobe::diagnose::remedy::RemedyMode;
use clap::Args;

#[derive(Args, Debug)]
pub struct FixArgs {
    #[command(flatten)]
    run: RunArgs,
}

/// Exit code 0 when nothing failed or a remedy fixes the failing step, 1 when none does.
pub fn run(a: FixArgs) -> anyhow::Result<i32> {
    if a.run.fail_on.is_some() {
        anyhow::bail!("--fail-on gates `run` and `report`; `fix` has its own exit code");
    }
    let cfg = config(&a.run)?;
    let mut opts = a.run.diag.options()?;
    opts.remedies = RemedyMode::All;
    opts.stop_at_failure = true;
    let s = run_with(&cfg, opts)?;
    print_human(&s)?;
    Ok(match &s.remedies {
        None => {
            outln!("No step failed in {} steps: nothing to fix.", s.steps.len())?;
            0
        }
        Some(r) if r.best().is_some() => 0,
        Some(_) => 1,
    })
}
