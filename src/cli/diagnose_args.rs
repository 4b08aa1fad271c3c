//! The diagnosis flags every run takes (skip causes, collapse, headroom, remedies).

use amprobe::diagnose::headroom::HeadroomThresholds;
use amprobe::diagnose::remedy::RemedyMode;
use amprobe::diagnose::DiagnoseOptions;
use clap::Args;

/// Diagnosis flags (skip causes, collapse, headroom, remedies).
#[derive(Args, Debug, Clone, Default)]
pub struct DiagnoseArgs {
    /// At the first failing step, re-run it under each remedy and report which make it
    /// finite and what they cost in accuracy against fp32.
    #[arg(long)]
    pub try_remedies: bool,
    /// Report ops whose max |x| exceeds this share of fp16's max (default 0.5: 32752).
    #[arg(long, value_name = "SHARE")]
    pub headroom_threshold: Option<f64>,
    /// Report ops where more than this share of nonzero values would flush to zero in fp16
    /// (default 0.01).
    #[arg(long, value_name = "SHARE")]
    pub underflow_threshold: Option<f64>,
    /// Flag a loss-scale collapse once the scale has fallen on this many consecutive steps
    /// (default 8; 0: only a scale below 1 is flagged).
    #[arg(long, value_name = "K")]
    pub collapse_steps: Option<u32>,
    /// Skipped steps whose cause is found by re-running them (default 16; 0: none).
    #[arg(long, value_name = "N")]
    pub classify_limit: Option<u32>,
    /// Most re-runs the precision bisection may use (default 64).
    #[arg(long, value_name = "N")]
    pub bisect_budget: Option<u32>,
}

impl DiagnoseArgs {
    /// The diagnosis options, checked.
    pub fn options(&self) -> anyhow::Result<DiagnoseOptions> {
        let d = DiagnoseOptions::default();
        let share = |name: &str, v: Option<f64>, dflt: f64, max_incl: bool| {
            let x = v.unwrap_or(dflt);
            let ok = x.is_finite() && x > 0.0 && (!max_incl || x <= 1.0);
            if ok {
                Ok(x)
            } else {
                Err(anyhow::anyhow!(
                    "--{name} {x}: expected a share greater than 0{}",
                    if max_incl { " and at most 1" } else { "" }
                ))
            }
        };
        Ok(DiagnoseOptions {
            classify_limit: self.classify_limit.unwrap_or(d.classify_limit),
            collapse_steps: self.collapse_steps.unwrap_or(d.collapse_steps),
            headroom: HeadroomThresholds {
                overflow_share: share(
                    "headroom-threshold",
                    self.headroom_threshold,
                    d.headroom.overflow_share,
                    false,
                )?,
                underflow_share: share(
                    "underflow-threshold",
                    self.underflow_threshold,
                    d.headroom.underflow_share,
                    true,
                )?,
            },
            remedies: if self.try_remedies {
                RemedyMode::All
            } else {
                RemedyMode::Off
            },
            stop_at_failure: false,
            bisect_budget: self.bisect_budget.unwrap_or(d.bisect_budget),
        })
    }
}
