//! `amprobe fix CONFIG [run flags]`: run to the first failing step, re-run it under each
//! remedy, and report which make it finite and at what cost in accuracy. `amprobe fix
//! [--out DIR] -- CMD ARGS...` does the same for a PyTorch script ([`super::fix_script`]).

use super::out::outln;
use super::run::{config, print_human, run_with, RunArgs};
use amprobe::diagnose::remedy::RemedyMode;
use clap::{ArgGroup, Args};
use std::path::PathBuf;

#[derive(Args, Debug)]
#[command(group(ArgGroup::new("what_to_fix").args(["config", "command"]).multiple(false)))]
pub struct FixArgs {
    #[command(flatten)]
    run: RunArgs,
    /// With a script (after `--`): the folder for the traces and logs of its runs (default
    /// amprobe-fix).
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
}

/// Exit code 0 when nothing failed or a remedy fixes the failing step, 1 when none does.
pub fn run(a: FixArgs) -> anyhow::Result<i32> {
    if a.run.fail_on.is_some() {
        anyhow::bail!("--fail-on gates `run` and `report`; `fix` has its own exit code");
    }
    if !a.run.command.is_empty() {
        let f = &a.run.flags;
        if f.configures_a_run() || f.trace.is_some() || a.run.compare_out.is_some() {
            anyhow::bail!(
                "a script given after `--` trains itself: of the run flags only --out DIR (its \
                 runs' traces and logs), --bisect-budget and the diagnosis flags apply to \
                 `fix -- CMD`"
            );
        }
        let opts = a.run.diag.options()?;
        let budget = opts.bisect_budget;
        return super::fix_script::run(&a.run.command, a.out, budget, opts);
    }
    if a.out.is_some() {
        anyhow::bail!("fix: --out applies to a script given after `--`");
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
