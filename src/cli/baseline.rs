//! `amprobe baseline CONFIG [run flags] [--out amprobe.lock]`, `amprobe baseline [--out
//! FILE] -- CMD ARGS...` and `amprobe baseline --from TRACE`: the numerics lockfile of a
//! run (every step's op records kept), for `--fail-on drift` to hold later runs to.

use super::out::outln;
use super::run::{capture_script, config, print_human, RunArgs};
use amprobe::report::lockfile::{Lock, LockBuilder, DEFAULT_LOCK};
use amprobe::runner::{run as run_training, RunOptions};
use amprobe::trace::record::Record;
use anyhow::Context;
use clap::Args;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct BaselineArgs {
    #[command(flatten)]
    run: RunArgs,
    /// Where the lockfile goes.
    #[arg(long, value_name = "FILE", default_value = DEFAULT_LOCK)]
    out: PathBuf,
    /// Make the lock from this trace instead of running (its steps with op records).
    #[arg(long, value_name = "TRACE", conflicts_with = "command")]
    from: Option<PathBuf>,
}

pub fn run(a: BaselineArgs) -> anyhow::Result<i32> {
    let r = &a.run;
    if r.fail_on.is_some() || r.compare_out.is_some() {
        anyhow::bail!("--fail-on and --compare-out do not apply to `baseline`");
    }
    if r.flags
        .precision
        .as_deref()
        .is_some_and(|p| p.contains(','))
    {
        anyhow::bail!("a lockfile holds one run: give one --precision");
    }
    let lock = if let Some(t) = &a.from {
        if r.flags.configures_a_run() || r.flags.trace.is_some() {
            anyhow::bail!("--from reads a trace: run flags do not apply to it");
        }
        let t = amprobe::trace::io::read_trace(t)?;
        let mut b = LockBuilder::new(&t.header);
        for s in &t.steps {
            b.observe(s);
        }
        b.finish()
    } else if !r.command.is_empty() {
        if r.flags.configures_training() {
            anyhow::bail!(
                "a script given after `--` trains itself: only --trace and --sample-every apply"
            );
        }
        let run = capture_script(
            &r.command,
            r.flags.trace.as_deref(),
            r.flags.sample_every.or(Some(1)),
            r.diag.options()?,
        )?;
        print_human(&run.summary)?;
        if !run.status.success() {
            anyhow::bail!(
                "`{}` failed ({}): no lockfile written",
                r.command.join(" "),
                run.status
            );
        }
        let mut b = LockBuilder::new(&run.header);
        for s in &run.steps {
            b.observe(s);
        }
        b.finish()
    } else {
        let mut cfg = config(r)?;
        // The envelope covers every step unless the flag or file says otherwise.
        if cfg.probe.sample_every.is_none() {
            cfg.probe.sample_every = Some(1);
        }
        let (tx, rx) = std::sync::mpsc::channel();
        let opts = RunOptions {
            command_line: std::env::args().collect(),
            progress: true,
            diagnose: r.diag.options()?,
            live: Some(tx),
            ..RunOptions::default()
        };
        let summary = run_training(&cfg, &opts)?;
        drop(opts);
        print_human(&summary)?;
        let mut builder = None;
        for rec in rx.try_iter() {
            match rec {
                Record::Header(h) => builder = Some(LockBuilder::new(&h)),
                Record::Step(s) => {
                    if let Some(b) = builder.as_mut() {
                        b.observe(&s);
                    }
                }
                Record::End(_) => {}
            }
        }
        builder.context("the run sent no header record")?.finish()
    };
    write(&lock, &a.out)
}

fn write(lock: &Lock, out: &std::path::Path) -> anyhow::Result<i32> {
    if lock.steps_with_ops == 0 {
        anyhow::bail!(
            "no step of the run kept op records ({} step(s)): a lockfile needs them \
             (--sample-every 1)",
            lock.steps
        );
    }
    lock.write(out)?;
    let nonfinite = lock
        .envelopes
        .ops
        .iter()
        .filter(|e| e.nonfinite > 0)
        .count();
    outln!(
        "lockfile: {} ({} ops over {} step(s) with op records{})",
        out.display(),
        lock.envelopes.ops.len(),
        lock.steps_with_ops,
        if nonfinite > 0 {
            format!(
                "; {nonfinite} op(s) already hold NaN/Inf values, which the lock accepts from now on"
            )
        } else {
            String::new()
        }
    )?;
    Ok(0)
}
