//! Layer 10 of `amprobe::LAYERS`: may use layers 0–9 (`dtype` … `train`).
//!
//! Diagnosis of a run: why steps were skipped, which ops come close to fp16's limits, which
//! changes of recipe make a failing step finite (each proven by re-running the step), and a
//! minimal set of modules to keep in fp32 (delta debugging).
//!
//! Every answer that needs a counterfactual is measured with [`Trainer::replay`]: the step
//! is re-run from the weights, loss scale and batches it started from under another recipe.
//! Re-runs cost a whole step each, so their number is bounded and reported:
//! - skip causes: at most two re-runs per skipped step (fp32 at scale 1; the run's own
//!   recipe at scale 1 when the forward pass was finite and the scale above 1), one more
//!   when the step kept no op records (probes off), for the first
//!   [`DiagnoseOptions::classify_limit`] skipped steps;
//! - remedies: one fp32 reference (shared with the cause of the same step), one re-run per
//!   remedy, and the bisection's re-runs (capped by [`DiagnoseOptions::bisect_budget`]).

pub mod accuracy;
pub mod align;
pub mod blame;
pub mod capture;
pub mod cause;
pub mod collapse;
pub mod headroom;
pub mod module_bisect;
mod outcome;
pub mod rank_summary;
pub mod ranks;
pub mod remedy;
pub mod summary;
pub mod text;

use crate::error::Result;
use crate::trace::record::StepRecord;
use crate::train::{Replay, Trainer};
use collapse::{CollapseFlag, CollapseTracker};
use headroom::{Headroom, HeadroomReport, HeadroomThresholds};
use remedy::{RemedyMode, RemedyReport};

pub use outcome::{any_origin, failed, finite, forward_origin, nonfinite_anywhere};

/// What to diagnose during a run, and how much re-running it may cost.
#[derive(Debug, Clone, PartialEq)]
pub struct DiagnoseOptions {
    /// Skipped steps whose cause is found by re-running (0: none). Later skipped steps keep
    /// no cause, and the summary says how many were left out.
    pub classify_limit: u32,
    /// Flag a collapse once the scale has fallen on this many consecutive steps
    /// (0: only the fall below 1 is flagged).
    pub collapse_steps: u32,
    /// Headroom thresholds.
    pub headroom: HeadroomThresholds,
    /// What to try at the first failing step.
    pub remedies: RemedyMode,
    /// Stop the run after the first failing step (after its remedies).
    pub stop_at_failure: bool,
    /// Most re-runs the precision bisection may use.
    pub bisect_budget: u32,
}

impl Default for DiagnoseOptions {
    fn default() -> Self {
        DiagnoseOptions {
            classify_limit: 16,
            collapse_steps: 8,
            headroom: HeadroomThresholds::default(),
            remedies: RemedyMode::Off,
            stop_at_failure: false,
            bisect_budget: 64,
        }
    }
}

/// What the diagnosis of a whole run found (see the fields of the run summary).
#[derive(Debug, Clone, Default)]
pub struct RunDiagnosis {
    /// Headroom warnings.
    pub headroom: HeadroomReport,
    /// The top offenders of precision loss (`--blame`).
    pub blame: blame::BlameReport,
    /// The scale collapse flag, if raised.
    pub scale_collapse: Option<CollapseFlag>,
    /// Remedies tried at the first failing step.
    pub remedies: Option<RemedyReport>,
    /// Skipped steps left without a cause (past the classification limit).
    pub unclassified_skips: u64,
    /// Re-runs used by the whole diagnosis.
    pub replays: u32,
}

/// Diagnoses a run step by step: call [`Diagnoser::after_step`] right after each
/// `Trainer::step` (before the record is written), then [`Diagnoser::finish`].
pub struct Diagnoser {
    opts: DiagnoseOptions,
    headroom: Headroom,
    blame: blame::BlameTracker,
    collapse: CollapseTracker,
    classified: u32,
    out: RunDiagnosis,
    failed_at: Option<u64>,
}

impl Diagnoser {
    /// A diagnoser with these options.
    pub fn new(opts: DiagnoseOptions) -> Diagnoser {
        Diagnoser {
            headroom: Headroom::new(opts.headroom),
            blame: blame::BlameTracker::default(),
            collapse: CollapseTracker::new(opts.collapse_steps),
            opts,
            classified: 0,
            out: RunDiagnosis::default(),
            failed_at: None,
        }
    }

    /// Looks at the step `trainer` just ran: collects headroom from its op records,
    /// classifies a skip (into `rec.skip_cause`), flags a scale collapse (into
    /// `rec.events`), and tries remedies at the first failing step when asked to.
    pub fn after_step(&mut self, trainer: &Trainer, rec: &mut StepRecord) -> Result<()> {
        if let Some(ops) = &rec.ops {
            self.headroom.observe(rec.step, rec.scale_before, ops);
            self.blame.observe(rec.step, ops);
        }
        let mut reference: Option<Replay> = None;
        if rec.skipped {
            if self.classified < self.opts.classify_limit {
                self.classified += 1;
                let (c, fp32) = cause::classify(trainer, rec)?;
                self.out.replays += c.replays;
                rec.skip_cause = Some(Box::new(c));
                reference = Some(fp32);
            } else {
                self.out.unclassified_skips += 1;
            }
        }
        self.note_collapse(rec);
        if self.failed_at.is_none() && failed(rec) {
            self.failed_at = Some(rec.step);
            if self.opts.remedies != RemedyMode::Off {
                let r = remedy::try_remedies(
                    trainer,
                    rec,
                    reference,
                    self.opts.remedies,
                    self.opts.bisect_budget,
                )?;
                self.out.replays += r.replays;
                self.out.remedies = Some(r);
            }
        }
        Ok(())
    }

    /// Looks at a step that ran elsewhere (a trace captured from a PyTorch script): the
    /// headroom from its op records and the collapse flag, as [`Diagnoser::after_step`]
    /// does; a skip keeps the cause its record gives, as nothing here can re-run it (and
    /// no limit left it unclassified).
    pub fn after_recorded_step(&mut self, rec: &mut StepRecord) {
        if let Some(ops) = &rec.ops {
            self.headroom.observe(rec.step, rec.scale_before, ops);
            self.blame.observe(rec.step, ops);
        }
        self.note_collapse(rec);
        if self.failed_at.is_none() && failed(rec) {
            self.failed_at = Some(rec.step);
        }
    }

    /// Raises the collapse flag in `rec.events` (and the run's diagnosis, the first time)
    /// when the scale has been falling long enough.
    fn note_collapse(&mut self, rec: &mut StepRecord) {
        if let Some(flag) = self.collapse.observe(rec) {
            rec.events.push(flag.sentence());
            if self.out.scale_collapse.is_none() {
                self.out.scale_collapse = Some(flag);
            }
        }
    }

    /// True once the run should stop ([`DiagnoseOptions::stop_at_failure`] and a step
    /// failed).
    pub fn should_stop(&self) -> bool {
        self.opts.stop_at_failure && self.failed_at.is_some()
    }

    /// The first failing step, if any.
    pub fn failed_at(&self) -> Option<u64> {
        self.failed_at
    }

    /// The diagnosis of the run.
    pub fn finish(mut self) -> RunDiagnosis {
        self.out.headroom = self.headroom.report();
        self.out.blame = self.blame.report();
        self.out
    }
}
