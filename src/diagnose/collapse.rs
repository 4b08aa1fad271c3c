//! Early warning of a loss-scale collapse: the scale falls on K consecutive steps, or goes
//! below 1.
//!
//! A step *falls* when its scale after the update is below its scale before. A skipped step
//! whose scale stayed put (a hysteresis scaler absorbing an overflow) neither counts nor
//! breaks the streak; any other step breaks it.

use crate::trace::record::{float_json, StepRecord};
use serde::{Deserialize, Serialize};

/// Why the collapse flag was raised.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CollapseReason {
    /// The scale fell on `falling_steps` consecutive steps.
    Falling,
    /// The scale went below 1 (scaling now shrinks gradients).
    BelowOne,
}

/// A raised collapse flag.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CollapseFlag {
    /// Step at which it was raised.
    pub step: u64,
    /// Why.
    pub reason: CollapseReason,
    /// Consecutive falling steps, ending with `step`.
    pub falling_steps: u32,
    /// Scale before the first step of the streak.
    #[serde(with = "float_json")]
    pub scale_from: f64,
    /// Scale after `step`.
    #[serde(with = "float_json")]
    pub scale_to: f64,
}

impl CollapseFlag {
    /// The flag as an event sentence.
    pub fn sentence(&self) -> String {
        match self.reason {
            CollapseReason::Falling => format!(
                "loss scale collapsing: it fell on {} consecutive steps, from {} to {}",
                self.falling_steps,
                short(self.scale_from),
                short(self.scale_to)
            ),
            CollapseReason::BelowOne => format!(
                "loss scale collapsed below 1 (now {}): scaling shrinks the gradients and every skipped step halves it again",
                short(self.scale_to)
            ),
        }
    }
}

/// A scale in short form (plain up to 2^24, else scientific).
pub(crate) fn short(x: f64) -> String {
    if x != 0.0 && !(1e-3..=16777216.0).contains(&x.abs()) {
        format!("{x:.3e}")
    } else {
        format!("{x}")
    }
}

/// Watches the scale step by step; raises each kind of flag once.
#[derive(Debug, Clone)]
pub struct CollapseTracker {
    k: u32,
    streak: u32,
    from: f64,
    raised_falling: bool,
    raised_below: bool,
}

impl CollapseTracker {
    /// Flags a streak of `k` falling steps (0: streaks are not flagged).
    pub fn new(k: u32) -> CollapseTracker {
        CollapseTracker {
            k,
            streak: 0,
            from: 0.0,
            raised_falling: false,
            raised_below: false,
        }
    }

    /// Takes the next step; returns a flag when one is raised at this step.
    pub fn observe(&mut self, rec: &StepRecord) -> Option<CollapseFlag> {
        let (before, after) = (rec.scale_before, rec.scale_after);
        if after < before {
            if self.streak == 0 {
                self.from = before;
            }
            self.streak += 1;
        } else if !(rec.skipped && after == before) {
            self.streak = 0;
        }
        let flag = |reason| CollapseFlag {
            step: rec.step,
            reason,
            falling_steps: self.streak,
            scale_from: if self.streak > 0 { self.from } else { before },
            scale_to: after,
        };
        if !self.raised_below && after < 1.0 {
            self.raised_below = true;
            return Some(flag(CollapseReason::BelowOne));
        }
        if !self.raised_falling && self.k > 0 && self.streak >= self.k {
            self.raised_falling = true;
            return Some(flag(CollapseReason::Falling));
        }
        None
    }
}

/// The first collapse flag over a run's step records.
pub fn first_collapse(records: &[StepRecord], k: u32) -> Option<CollapseFlag> {
    let mut t = CollapseTracker::new(k);
    records.iter().find_map(|r| t.observe(r))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(n: u64, before: f64, after: f64, skipped: bool) -> StepRecord {
        StepRecord {
            step: n,
            scale_before: before,
            scale_after: after,
            skipped,
            ..StepRecord::default()
        }
    }

    #[test]
    fn streak_of_k_falls_is_flagged_once() {
        let mut s = 65536.0;
        let mut recs = Vec::new();
        for n in 0..10 {
            recs.push(step(n, s, s / 2.0, true));
            s /= 2.0;
        }
        let f = first_collapse(&recs, 8).unwrap();
        assert_eq!(f.step, 7);
        assert_eq!(f.reason, CollapseReason::Falling);
        assert_eq!(f.falling_steps, 8);
        assert_eq!((f.scale_from, f.scale_to), (65536.0, 256.0));
        let mut t = CollapseTracker::new(8);
        let raised: Vec<u64> = recs
            .iter()
            .filter_map(|r| t.observe(r))
            .map(|f| f.step)
            .collect();
        assert_eq!(raised, vec![7]);
    }

    #[test]
    fn a_clean_step_breaks_the_streak_and_a_held_skip_does_not() {
        let mut recs = vec![
            step(0, 8.0, 4.0, true),
            step(1, 4.0, 4.0, true), // hysteresis held the scale
            step(2, 4.0, 2.0, true),
        ];
        assert_eq!(first_collapse(&recs, 2).map(|f| f.step), Some(2));
        recs[1].skipped = false; // a clean step at the same scale breaks it
        assert_eq!(first_collapse(&recs, 2), None);
        assert_eq!(first_collapse(&recs, 0), None);
    }

    #[test]
    fn below_one_is_flagged_at_once() {
        let recs = vec![step(0, 4.0, 8.0, false), step(1, 1.0, 0.5, true)];
        let f = first_collapse(&recs, 8).unwrap();
        assert_eq!((f.step, f.reason), (1, CollapseReason::BelowOne));
        assert!(f.sentence().contains("below 1"), "{}", f.sentence());
    }
}
