//! `amprobe scaler simulate`: the loss-scale sequence of an overflow pattern.

use super::out::outln;
use amprobe::amp::scaler::{ScalerConfig, ScalerKind};
use amprobe::amp::simulate::{load_overflow_steps, parse_overflow_steps, simulate};
use anyhow::Context;
use clap::{Args, Subcommand};
use std::path::Path;

#[derive(Subcommand, Debug)]
pub enum ScalerCommand {
    /// Prints, per step, the scale the training loop would use for an overflow pattern.
    Simulate(SimArgs),
}

#[derive(Args, Debug)]
pub struct SimArgs {
    /// Steps that overflow: a list like `3,5,10-12`, or a file (JSON array or list);
    /// default none.
    #[arg(long)]
    overflow_steps: Option<String>,
    /// Initial scale.
    #[arg(long, default_value_t = 65536.0)]
    init_scale: f32,
    /// Growth factor.
    #[arg(long, default_value_t = 2.0)]
    growth_factor: f64,
    /// Backoff factor.
    #[arg(long, default_value_t = 0.5)]
    backoff_factor: f64,
    /// Clean steps before the scale grows.
    #[arg(long, default_value_t = 2000)]
    growth_interval: u32,
    /// Scaler kind: default, maxclip, hysteresis, fixed, none.
    #[arg(long, default_value = "default")]
    scaler: String,
    /// Cap for `maxclip`.
    #[arg(long)]
    max_scale: Option<f32>,
    /// Number of steps (default: one past the last overflow step).
    #[arg(long)]
    steps: Option<u64>,
    /// Print JSON (one array) instead of a table.
    #[arg(long)]
    json: bool,
}

pub fn run(cmd: ScalerCommand) -> anyhow::Result<i32> {
    let ScalerCommand::Simulate(a) = cmd;
    let overflow = match a.overflow_steps.as_deref() {
        None => Default::default(),
        Some(p) if Path::new(p).is_file() => load_overflow_steps(Path::new(p))?,
        Some(list) => parse_overflow_steps(list).context("--overflow-steps")?,
    };
    let kind = match a.scaler.as_str() {
        "default" => ScalerKind::Default,
        "maxclip" | "max_clip" => ScalerKind::MaxClip { max_scale: a.max_scale.unwrap_or(16777216.0) },
        "hysteresis" => ScalerKind::Hysteresis { hysteresis: 2, min_scale: 1.0, error_at_floor: false },
        "fixed" => ScalerKind::Fixed,
        "none" => ScalerKind::None,
        other => anyhow::bail!("--scaler: unknown kind `{other}` (expected default, maxclip, hysteresis, fixed or none)"),
    };
    let cfg = ScalerConfig {
        enabled: !matches!(kind, ScalerKind::None),
        kind,
        init_scale: a.init_scale,
        growth_factor: a.growth_factor,
        backoff_factor: a.backoff_factor,
        growth_interval: a.growth_interval,
        ..ScalerConfig::default()
    };
    let steps = a
        .steps
        .unwrap_or_else(|| overflow.last().map_or(1, |s| s + 1));
    let seq = simulate(&cfg, &overflow, steps)?;
    if a.json {
        outln!("{}", serde_json::to_string_pretty(&seq)?)?;
    } else {
        outln!(
            "{:>6} {:>14} {:>9} {:>8} {:>14} {:>8}",
            "step",
            "scale_before",
            "found_inf",
            "skipped",
            "scale_after",
            "tracker"
        )?;
        for s in &seq {
            outln!(
                "{:>6} {:>14} {:>9} {:>8} {:>14} {:>8}",
                s.step,
                s.scale_before,
                s.found_inf,
                s.skipped,
                s.scale_after,
                s.growth_tracker
            )?;
        }
    }
    Ok(0)
}
