//! The top offenders of precision loss, from the blamed op records of a run (`--blame`):
//! the ops (forward, backward and the optimizer phase's) that introduce the most error by
//! their own rounding and arithmetic, and the ones that magnify the error their inputs
//! carry the most. Each
//! (module, op, phase, gradient) is reported once, at its worst.

use crate::trace::record::{float_json, module_name, OpBlame, OpRecord, Phase};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Offenders listed per kind, at most.
pub const TOP: usize = 5;

/// One op of the report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BlameHit {
    /// Step of the worst occurrence.
    pub step: u64,
    /// Op index in that step.
    pub index: u64,
    /// Op name.
    pub op: String,
    /// Module path.
    pub module: String,
    /// Forward or backward.
    #[serde(default = "forward")]
    pub phase: Phase,
    /// For a backward op: the input its gradient is for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wrt: Option<String>,
    /// Its blame there.
    pub blame: OpBlame,
    /// The figure it is ranked by: the introduced error, or the amplification.
    #[serde(with = "float_json")]
    pub figure: f64,
}

fn forward() -> Phase {
    Phase::Forward
}

impl BlameHit {
    /// The op as people read it: `` `linear` in `fc1` ``, `` `linear` backward (gradient
    /// of `weight`) in `fc1` ``.
    pub fn label(&self) -> String {
        format!("{} in `{}`", self.op_label(), module_name(&self.module))
    }

    /// The op without its module: `` `linear` ``, `` `linear` backward (gradient of
    /// `weight`) ``, `` `optimizer_step` `` (the optimizer phase's ops have names of their
    /// own).
    pub fn op_label(&self) -> String {
        match (self.phase, &self.wrt) {
            (Phase::Backward, Some(w)) => format!("`{}` backward (gradient of `{w}`)", self.op),
            (Phase::Backward, None) => format!("`{}` backward", self.op),
            _ => format!("`{}`", self.op),
        }
    }
}

/// What `--blame` found over the run.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct BlameReport {
    /// Steps with blamed ops.
    pub steps: Vec<u64>,
    /// The ops introducing the most relative error, largest first.
    pub introduced: Vec<BlameHit>,
    /// The ops magnifying their inputs' error the most (amplification above 1), largest
    /// first.
    pub amplified: Vec<BlameHit>,
}

impl BlameReport {
    /// True when no op was blamed.
    pub fn is_empty(&self) -> bool {
        self.steps.is_empty()
    }
}

/// Collects the worst blame per (module, op) over steps.
#[derive(Debug, Default)]
pub struct BlameTracker {
    steps: Vec<u64>,
    introduced: BTreeMap<Key, BlameHit>,
    amplified: BTreeMap<Key, BlameHit>,
}

/// An op as ranked: module, op, phase and the input a gradient is for.
type Key = (String, String, &'static str, Option<String>);

impl BlameTracker {
    /// Takes the blamed ops of one step.
    pub fn observe(&mut self, step: u64, ops: &[OpRecord]) {
        let mut any = false;
        for o in ops {
            let Some(b) = o.blame else { continue };
            any = true;
            let hit = |figure: f64| BlameHit {
                step,
                index: o.index,
                op: o.op.clone(),
                module: o.module.clone(),
                phase: o.phase,
                wrt: o.wrt.clone(),
                blame: b,
                figure,
            };
            let key = (
                o.module.clone(),
                o.op.clone(),
                o.phase.name(),
                o.wrt.clone(),
            );
            let worse =
                |m: &BTreeMap<Key, BlameHit>, f: f64| m.get(&key).is_none_or(|h| f > h.figure);
            if b.introduced > 0.0
                && b.introduced.is_finite()
                && worse(&self.introduced, b.introduced)
            {
                self.introduced.insert(key.clone(), hit(b.introduced));
            }
            if let Some(a) = b.amplification().filter(|a| *a > 1.0 && a.is_finite()) {
                if worse(&self.amplified, a) {
                    self.amplified.insert(key, hit(a));
                }
            }
        }
        if any {
            self.steps.push(step);
        }
    }

    /// The report: the [`TOP`] of each kind.
    pub fn report(&self) -> BlameReport {
        let top = |m: &BTreeMap<Key, BlameHit>| {
            let mut v: Vec<BlameHit> = m.values().cloned().collect();
            v.sort_by(|a, b| b.figure.total_cmp(&a.figure).then(a.index.cmp(&b.index)));
            v.truncate(TOP);
            v
        };
        BlameReport {
            steps: self.steps.clone(),
            introduced: top(&self.introduced),
            amplified: top(&self.amplified),
        }
    }
}
