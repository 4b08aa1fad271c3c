//! `amprobe bisect CONFIG [run flags]`: run to the first failing step and find a minimal
//! set of modules that, kept in fp32, makes it finite.

use super::out::outln;
use super::run::{config, run_with, RunArgs};
use amprobe::diagnose::remedy::RemedyMode;
use amprobe::diagnose::text::{op_words, remedy_lines};
use clap::Args;

#[derive(Args, Debug)]
pub struct BisectArgs {
    #[command(flatten)]
    run: RunArgs,
}

/// Exit code 0 when a set was found (or nothing failed), 1 when none makes the step finite.
pub fn run(a: BisectArgs) -> anyhow::Result<i32> {
    if a.run.fail_on.is_some() {
        anyhow::bail!("--fail-on gates `run` and `report`; `bisect` has its own exit code");
    }
    let cfg = config(&a.run)?;
    let mut opts = a.run.diag.options()?;
    opts.remedies = RemedyMode::BisectOnly;
    opts.stop_at_failure = true;
    let s = run_with(&cfg, opts)?;
    outln!("amprobe bisect: {} under {}", s.model, s.precision)?;
    let Some(r) = &s.remedies else {
        outln!(
            "No step failed in {} steps: nothing to bisect.",
            s.steps.len()
        )?;
        return Ok(0);
    };
    for (what, o) in [("first Inf", &s.first_inf), ("first NaN", &s.first_nan)] {
        if let Some(o) = o {
            outln!("  {what}: step {} {}", o.step, op_words(o))?;
        }
    }
    for line in remedy_lines(r) {
        outln!("{line}")?;
    }
    Ok(match &r.bisection {
        Some(b) if b.found => 0,
        _ => 1,
    })
}
