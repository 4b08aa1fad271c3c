//! `amprobe shrink CONFIG [run flags] [--out FILE] [--max-runs N]`: the smallest batch (rows,
//! sequence length, steps) that still makes the run's first Inf/NaN at the same op, written
//! as an `--inputs` file, with the command that reproduces it.

use super::out::outln;
use super::run::{config, RunArgs};
use amprobe::shrink::{shrink, write_inputs, Progress, ShrinkOptions};
use clap::Args;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};

#[derive(Args, Debug)]
pub struct ShrinkArgs {
    #[command(flatten)]
    run: RunArgs,
    /// Where the smallest batch goes (an `--inputs` safetensors file).
    #[arg(
        long,
        value_name = "FILE",
        default_value = "amprobe-shrunk.safetensors"
    )]
    out: PathBuf,
    /// Most candidate runs before the search stops with what it has.
    #[arg(long, value_name = "N", default_value_t = ShrinkOptions::default().max_runs)]
    max_runs: usize,
}

/// Flags of `shrink` that the reproducing `run` does not take, or sets itself.
const NOT_REPEATED: &[&str] = &[
    "--out",
    "--max-runs",
    "--inputs",
    "--batch",
    "--seq",
    "--steps",
    "--trace",
    "--summary-json",
    "--sample-every",
];

/// A word as a POSIX shell reads it back.
fn quote(s: &str) -> String {
    if !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./=:,+@%".contains(c))
    {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

/// The `amprobe run` command line that reproduces the failure from `out`: this command's
/// own arguments with `shrink` turned into `run`, its data and output flags left out.
fn reproduce_command(args: &[String], out: &Path, steps: u64) -> String {
    let mut v = vec!["amprobe".to_string()];
    let mut i = 1;
    let mut command_seen = false;
    while i < args.len() {
        let a = &args[i];
        if !command_seen && a == "shrink" {
            command_seen = true;
            v.push("run".into());
        } else if NOT_REPEATED.contains(&a.as_str()) {
            i += 1;
        } else if !NOT_REPEATED.iter().any(|f| a.starts_with(&format!("{f}="))) {
            v.push(a.clone());
        }
        i += 1;
    }
    v.extend([
        "--inputs".into(),
        out.display().to_string(),
        "--steps".into(),
        steps.to_string(),
    ]);
    v.iter().map(|s| quote(s)).collect::<Vec<_>>().join(" ")
}

/// Exit code 0 when a batch was written; an error when the run does not fail.
pub fn run(a: ShrinkArgs) -> anyhow::Result<i32> {
    let r = &a.run;
    if r.fail_on.is_some() || r.compare_out.is_some() || !r.command.is_empty() {
        anyhow::bail!(
            "`shrink` takes a run configuration and run flags (not --fail-on, --compare-out \
             or a script)"
        );
    }
    if r.flags
        .precision
        .as_deref()
        .is_some_and(|p| p.contains(','))
    {
        anyhow::bail!("`shrink` holds one run: give one --precision");
    }
    let cfg = config(r)?;
    let bar = std::io::stdout().is_terminal().then(|| {
        let b = indicatif::ProgressBar::new_spinner();
        b.enable_steady_tick(std::time::Duration::from_millis(120));
        b
    });
    let mut on_run = |p: Progress| {
        if let Some(b) = &bar {
            b.set_message(format!(
                "run {}: smallest so far {} row(s) × {} position(s), {} step(s)",
                p.runs, p.rows, p.seq, p.steps
            ));
        }
    };
    let s = shrink(
        &cfg,
        ShrinkOptions {
            max_runs: a.max_runs,
        },
        &mut on_run,
    );
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    let s = s?;
    write_inputs(&s.batch, &a.out)?;
    let (b, q) = s.original_shape;
    outln!(
        "amprobe shrink: first {} (step {} of the run, its batch {b} × {q})",
        s.target.describe(),
        s.original_step
    )?;
    let rows: Vec<String> = s.rows.iter().map(usize::to_string).collect();
    outln!(
        "smallest: {} row(s) (row {} of that batch) × {} position(s), {} step(s), after {} runs{}",
        s.rows.len(),
        rows.join(", "),
        s.seq,
        s.steps,
        s.runs,
        if s.hit_limit {
            format!(" (stopped at --max-runs {}: smaller may exist)", a.max_runs)
        } else {
            String::new()
        }
    )?;
    outln!("wrote {}; reproduce with:", a.out.display())?;
    let args: Vec<String> = std::env::args().collect();
    outln!("  {}", reproduce_command(&args, &a.out, s.steps))?;
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_command_drops_data_and_output_flags() {
        let args: Vec<String> = [
            "target/release/amprobe",
            "--reproducible",
            "shrink",
            "samples/t5 x.toml",
            "--batch",
            "8",
            "--seq=32",
            "--out",
            "s.safetensors",
            "--precision",
            "fp16",
            "--max-runs=50",
        ]
        .map(str::to_string)
        .to_vec();
        assert_eq!(
            reproduce_command(&args, Path::new("s.safetensors"), 2),
            "amprobe --reproducible run 'samples/t5 x.toml' --precision fp16 --inputs \
             s.safetensors --steps 2"
        );
    }
}
