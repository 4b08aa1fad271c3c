//! Loss-scale simulator: replays a pattern of overflowing steps through the real
//! [`GradScaler`] and records the scale trajectory, so a scaler configuration can be judged
//! (how often steps are skipped, whether the scale collapses) without training anything.
//!
//! Steps are numbered from 0: step `n` is the `n`-th call to `update`, and an overflow
//! listed as `n` makes the gradient of step `n` non-finite.

use std::collections::BTreeSet;
use std::path::Path;

use serde::Serialize;

use crate::amp::scaler::{GradScaler, GradView, ScalerConfig};
use crate::dtype::DType;
use crate::error::{Error, Result};

/// Longest run [`simulate`] accepts, so a typo cannot exhaust memory.
pub const MAX_SIM_STEPS: u64 = 10_000_000;

/// Step numbers as sorted, disjoint inclusive ranges: a list such as `0-9999999` costs one
/// range, not ten million entries, so a list's memory and time follow its length.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepSet {
    ranges: Vec<(u64, u64)>,
}

impl StepSet {
    /// Adds the steps `a..=b`, merging with touching ranges.
    pub fn insert_range(&mut self, a: u64, b: u64) {
        let i = self
            .ranges
            .partition_point(|&(_, e)| e.saturating_add(1) < a);
        let mut j = i;
        let (mut lo, mut hi) = (a, b);
        while j < self.ranges.len() && self.ranges[j].0 <= hi.saturating_add(1) {
            lo = lo.min(self.ranges[j].0);
            hi = hi.max(self.ranges[j].1);
            j += 1;
        }
        self.ranges.splice(i..j, [(lo, hi)]);
    }

    /// True when `step` is in the set.
    pub fn contains(&self, step: &u64) -> bool {
        let i = self.ranges.partition_point(|&(_, e)| e < *step);
        self.ranges.get(i).is_some_and(|&(a, _)| a <= *step)
    }

    /// Number of steps.
    pub fn len(&self) -> u64 {
        self.ranges.iter().map(|&(a, b)| b - a + 1).sum()
    }

    /// True when no step is in the set.
    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }

    /// The largest step, if any.
    pub fn last(&self) -> Option<u64> {
        self.ranges.last().map(|&(_, b)| b)
    }

    /// The steps in increasing order.
    pub fn iter(&self) -> impl Iterator<Item = u64> + '_ {
        self.ranges.iter().flat_map(|&(a, b)| a..=b)
    }
}

impl PartialEq<BTreeSet<u64>> for StepSet {
    fn eq(&self, other: &BTreeSet<u64>) -> bool {
        self.len() == other.len() as u64 && self.iter().eq(other.iter().copied())
    }
}

/// Whatever answers "does this step overflow?" for [`simulate`].
pub trait OverflowSteps {
    /// True when `step` overflows.
    fn overflows(&self, step: u64) -> bool;
}

impl OverflowSteps for StepSet {
    fn overflows(&self, step: u64) -> bool {
        self.contains(&step)
    }
}

impl OverflowSteps for BTreeSet<u64> {
    fn overflows(&self, step: u64) -> bool {
        self.contains(&step)
    }
}

/// One simulated training step.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct SimStep {
    /// Step number, from 0.
    pub step: u64,
    /// The step's gradient was made non-finite (the step is in the overflow list).
    pub overflow: bool,
    /// Scale used for this step's loss and unscaling.
    #[serde(serialize_with = "crate::trace::float_json::f32_exact::serialize")]
    pub scale_before: f32,
    /// The scaler found an inf/NaN gradient (never, when scaling is disabled).
    pub found_inf: bool,
    /// The optimizer step was skipped.
    pub skipped: bool,
    /// Scale after this step's update.
    #[serde(serialize_with = "crate::trace::float_json::f32_exact::serialize")]
    pub scale_after: f32,
    /// Growth tracker after this step's update.
    pub growth_tracker: i32,
}

/// Runs `steps` steps of a scaler built from `cfg`. Each step feeds one optimizer a
/// one-element fp32 gradient, `inf` on the steps in `overflow_steps` and `1.0` otherwise,
/// through the same `should_step` / `update` path the engine uses. Overflow steps at or
/// beyond `steps` are ignored. Fails on a bad configuration, on more than
/// [`MAX_SIM_STEPS`] steps, or when the scaler itself fails (e.g. `error_at_floor`), naming
/// the step.
pub fn simulate(
    cfg: &ScalerConfig,
    overflow_steps: &impl OverflowSteps,
    steps: u64,
) -> Result<Vec<SimStep>> {
    if steps > MAX_SIM_STEPS {
        return Err(Error::Invalid(format!(
            "simulate: {steps} steps requested, at most {MAX_SIM_STEPS} allowed"
        )));
    }
    let mut scaler = GradScaler::new(cfg.clone())?;
    let mut out = Vec::with_capacity(steps as usize);
    let at_step = |step: u64, e: Error| match e {
        Error::Scaler(m) => Error::Scaler(format!("simulated step {step}: {m}")),
        other => other,
    };
    for step in 0..steps {
        let overflow = overflow_steps.overflows(step);
        let scale_before = scaler.scale();
        let mut grad = [if overflow { f32::INFINITY } else { 1.0 }];
        let decision = scaler
            .should_step(0, &mut [GradView::new("sim.grad", &mut grad, DType::F32)])
            .map_err(|e| at_step(step, e))?;
        let outcome = scaler.update(None).map_err(|e| at_step(step, e))?;
        out.push(SimStep {
            step,
            overflow,
            scale_before,
            found_inf: decision.found_inf,
            skipped: decision.skip,
            scale_after: outcome.scale_after,
            growth_tracker: outcome.growth_tracker,
        });
    }
    Ok(out)
}

/// Parses one entry: a step number `7` or an inclusive range `10-12`.
fn parse_entry(tok: &str) -> std::result::Result<(u64, u64), String> {
    let num = |s: &str| {
        s.trim().parse::<u64>().map_err(|_| {
            format!(
                "bad entry `{tok}`: expected a step number (e.g. 7) or an inclusive range \
                 (e.g. 10-12) of non-negative integers"
            )
        })
    };
    match tok.split_once('-') {
        None => num(tok).map(|n| (n, n)),
        Some((a, b)) => {
            let (a, b) = (num(a)?, num(b)?);
            if b < a {
                return Err(format!("bad range `{tok}`: its end is below its start"));
            }
            Ok((a, b))
        }
    }
}

fn add_range(set: &mut StepSet, (a, b): (u64, u64), tok: &str) -> std::result::Result<(), String> {
    if b >= MAX_SIM_STEPS {
        return Err(format!(
            "entry `{tok}` names step {b}, but the simulator runs at most {MAX_SIM_STEPS} steps"
        ));
    }
    set.insert_range(a, b);
    Ok(())
}

/// Parses a list of overflow steps such as `3,5,10-12` (ranges inclusive; commas and/or
/// whitespace separate entries; an empty or blank list is empty). Errors name the bad entry.
pub fn parse_overflow_steps(spec: &str) -> Result<StepSet> {
    let ctx = || "overflow steps".to_string();
    let mut set = StepSet::default();
    if spec.trim().is_empty() {
        return Ok(set);
    }
    for (i, tok) in spec.split(',').enumerate() {
        let tok = tok.trim();
        if tok.is_empty() {
            return Err(Error::config(
                ctx(),
                format!("entry {} of `{spec}` is empty", i + 1),
            ));
        }
        for t in tok.split_whitespace() {
            let r = parse_entry(t).map_err(|m| Error::config(ctx(), m))?;
            add_range(&mut set, r, t).map_err(|m| Error::config(ctx(), m))?;
        }
    }
    Ok(set)
}

/// Reads overflow steps from a file: either a JSON array of step numbers (`[3, 5, 10]`),
/// or text with step numbers and inclusive ranges separated by commas and/or whitespace,
/// `#` starting a comment to the end of the line. Errors name the file, the line and the
/// bad token.
pub fn load_overflow_steps(path: impl AsRef<Path>) -> Result<StepSet> {
    let path = path.as_ref();
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    parse_overflow_steps_file(&text, path)
}

/// [`load_overflow_steps`] of a file's text; `path` names it in errors.
pub fn parse_overflow_steps_file(text: &str, path: &Path) -> Result<StepSet> {
    let shown = path.display();
    let mut set = StepSet::default();
    if text.trim_start().starts_with('[') {
        let values: Vec<serde_json::Value> = serde_json::from_str(text).map_err(|e| {
            Error::config(
                format!("overflow steps file {shown}"),
                format!("not a JSON array of step numbers: {e}"),
            )
        })?;
        for (i, v) in values.iter().enumerate() {
            let n = v.as_u64().ok_or_else(|| {
                Error::config(
                    format!("overflow steps file {shown}"),
                    format!("element {i} is `{v}`, expected a non-negative integer step number"),
                )
            })?;
            add_range(&mut set, (n, n), &v.to_string())
                .map_err(|m| Error::config(format!("overflow steps file {shown}"), m))?;
        }
        return Ok(set);
    }
    for (ln, line) in text.lines().enumerate() {
        let line = line.split_once('#').map_or(line, |(code, _)| code);
        let ctx = || format!("overflow steps file {shown}: line {}", ln + 1);
        for tok in line
            .split(|c: char| c == ',' || c.is_whitespace())
            .filter(|t| !t.is_empty())
        {
            let r = parse_entry(tok).map_err(|m| Error::config(ctx(), m))?;
            add_range(&mut set, r, tok).map_err(|m| Error::config(ctx(), m))?;
        }
    }
    Ok(set)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::amp::scaler::ScalerKind;

    fn steps(v: &[u64]) -> BTreeSet<u64> {
        v.iter().copied().collect()
    }

    fn cfg(init: f32, interval: u32) -> ScalerConfig {
        ScalerConfig {
            init_scale: init,
            growth_interval: interval,
            ..ScalerConfig::default()
        }
    }

    #[test]
    fn trajectory_matches_hand_derivation() {
        // init 1024, interval 2, overflows at steps 3 and 6 (numbered from 0).
        let out = simulate(&cfg(1024.0, 2), &steps(&[3, 6, 99]), 10).unwrap();
        let expected: [(f32, f32, i32); 10] = [
            (1024.0, 1024.0, 1),
            (1024.0, 2048.0, 0),
            (2048.0, 2048.0, 1),
            (2048.0, 1024.0, 0),
            (1024.0, 1024.0, 1),
            (1024.0, 2048.0, 0),
            (2048.0, 1024.0, 0),
            (1024.0, 1024.0, 1),
            (1024.0, 2048.0, 0),
            (2048.0, 2048.0, 1),
        ];
        assert_eq!(out.len(), 10);
        for (i, (s, &(before, after, tracker))) in out.iter().zip(&expected).enumerate() {
            let ovf = i == 3 || i == 6;
            assert_eq!(s.step, i as u64);
            assert_eq!(
                (s.overflow, s.found_inf, s.skipped),
                (ovf, ovf, ovf),
                "step {i}"
            );
            assert_eq!(
                (s.scale_before, s.scale_after, s.growth_tracker),
                (before, after, tracker)
            );
        }
    }

    /// The simulator must agree with driving the scaler by hand, here with different
    /// gradients (several tensors, NaN instead of inf, fp16), through `unscale_` + `step`.
    fn agrees_with_manual(c: ScalerConfig, ovf: &BTreeSet<u64>, n: u64) {
        let sim = simulate(&c, ovf, n).unwrap();
        let mut s = GradScaler::new(c).unwrap();
        for (step, rec) in sim.iter().enumerate() {
            let bad = ovf.contains(&(step as u64));
            let before = s.scale();
            let mut a = [s.scale_loss(0.25), 1.0];
            let mut b = [if bad { f32::NAN } else { 2.0 }];
            let mut v = [
                GradView::new("a", &mut a, DType::F32),
                GradView::new("b", &mut b, DType::F16),
            ];
            let found = s.unscale_(7, &mut v).unwrap();
            let applied = s.step(7, &mut v, |_| Ok(())).unwrap().is_some();
            let o = s.update(None).unwrap();
            assert_eq!(rec.scale_before, before, "step {step}");
            assert_eq!(rec.found_inf, found, "step {step}");
            assert_eq!(rec.skipped, !applied, "step {step}");
            assert_eq!(rec.scale_after, o.scale_after, "step {step}");
            assert_eq!(rec.growth_tracker, o.growth_tracker, "step {step}");
        }
    }

    #[test]
    fn simulator_equals_manual_stepping() {
        let ovf = steps(&[0, 1, 2, 7, 8, 20, 21, 22, 23, 40]);
        agrees_with_manual(cfg(65536.0, 3), &ovf, 60);
        agrees_with_manual(
            ScalerConfig {
                kind: ScalerKind::Hysteresis {
                    hysteresis: 2,
                    min_scale: 1024.0,
                    error_at_floor: false,
                },
                ..cfg(65536.0, 4)
            },
            &ovf,
            60,
        );
        agrees_with_manual(
            ScalerConfig {
                kind: ScalerKind::MaxClip { max_scale: 1e5 },
                ..cfg(65536.0, 2)
            },
            &ovf,
            60,
        );
    }

    #[test]
    fn disabled_and_fixed_simulations() {
        let ovf = steps(&[1, 2]);
        let off = simulate(
            &ScalerConfig {
                enabled: false,
                ..ScalerConfig::default()
            },
            &ovf,
            4,
        )
        .unwrap();
        assert!(off
            .iter()
            .all(|s| !s.skipped && !s.found_inf && s.scale_before == 1.0 && s.scale_after == 1.0));
        assert!(off[1].overflow);
        let fixed = simulate(
            &ScalerConfig {
                kind: ScalerKind::Fixed,
                ..cfg(8.0, 1)
            },
            &ovf,
            4,
        )
        .unwrap();
        let skipped: Vec<bool> = fixed.iter().map(|s| s.skipped).collect();
        assert_eq!(skipped, [false, true, true, false]);
        assert!(fixed.iter().all(|s| s.scale_after == 8.0));
    }

    #[test]
    fn scaler_errors_name_the_step() {
        let c = ScalerConfig {
            kind: ScalerKind::Hysteresis {
                hysteresis: 1,
                min_scale: 2.0,
                error_at_floor: true,
            },
            ..cfg(8.0, 100)
        };
        // 8 -> 4 (step 0) -> 2 (step 1) -> overflow at the floor (step 2).
        let e = simulate(&c, &steps(&[0, 1, 2]), 5).unwrap_err().to_string();
        assert!(e.contains("simulated step 2"), "{e}");
        assert!(simulate(&c, &BTreeSet::new(), MAX_SIM_STEPS + 1).is_err());
        assert!(simulate(&cfg(-1.0, 1), &BTreeSet::new(), 1).is_err());
    }

    #[test]
    fn parses_lists_and_ranges() {
        assert_eq!(
            parse_overflow_steps("3,5,10-12").unwrap(),
            steps(&[3, 5, 10, 11, 12])
        );
        assert_eq!(
            parse_overflow_steps(" 0 , 7-7 ,2 4").unwrap(),
            steps(&[0, 2, 4, 7])
        );
        assert!(parse_overflow_steps("  ").unwrap().is_empty());
        // A long range is one range: cheap whatever its length.
        let long = parse_overflow_steps("5-9999999,3,0-2,4").unwrap();
        assert_eq!((long.len(), long.ranges.len()), (10_000_000, 1));
        assert!(long.contains(&9_999_999) && !long.contains(&10_000_000));
        for (bad, needle) in [
            ("3,x,5", "`x`"),
            ("3,,5", "entry 2"),
            ("12-10", "`12-10`"),
            ("-3", "`-3`"),
            ("1.5", "`1.5`"),
            ("4-", "`4-`"),
            ("0-99999999999", "`0-99999999999`"),
            ("10000000", "`10000000`"),
        ] {
            let e = parse_overflow_steps(bad).unwrap_err().to_string();
            assert!(e.contains(needle), "{bad}: {e}");
        }
    }

    #[test]
    fn loads_json_and_text_files_with_clear_errors() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.json");
        std::fs::write(&p, "[3, 5, 10]").unwrap();
        assert_eq!(load_overflow_steps(&p).unwrap(), steps(&[3, 5, 10]));
        std::fs::write(&p, "[3, -5]").unwrap();
        let e = load_overflow_steps(&p).unwrap_err().to_string();
        assert!(e.contains("a.json") && e.contains("`-5`"), "{e}");
        std::fs::write(&p, "[3, 5").unwrap();
        let e = load_overflow_steps(&p).unwrap_err().to_string();
        assert!(e.contains("a.json") && e.contains("JSON"), "{e}");

        let t = dir.path().join("b.txt");
        std::fs::write(&t, "# overflow steps\n1, 2\n10-12 # burst\n\n40\n").unwrap();
        assert_eq!(
            load_overflow_steps(&t).unwrap(),
            steps(&[1, 2, 10, 11, 12, 40])
        );
        std::fs::write(&t, "1 2\n3 seven 9\n").unwrap();
        let e = load_overflow_steps(&t).unwrap_err().to_string();
        assert!(
            e.contains("b.txt") && e.contains("line 2") && e.contains("`seven`"),
            "{e}"
        );

        let e = load_overflow_steps(dir.path().join("missing"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("missing"), "{e}");
    }
}
