//! Precision bisection: a minimal set of modules that, kept in fp32, makes a failing step
//! finite, found by delta debugging (Zeller and Hildebrandt's ddmin) over module sets.
//!
//! Candidates are the modules that own parameters (`Param.module`), minus those the run
//! already keeps in fp32. When keeping all of them does not make the step finite, their
//! parent modules and the modules where the step went non-finite are added as coarser
//! candidates (keeping a parent keeps every op inside it, residual adds included). Each set
//! is tested by re-running the step with the run's own patterns plus the set's exact paths
//! (an exact path matches only that module and its children). The result is 1-minimal:
//! removing any one module makes the step fail again. When all its members share a last
//! path segment (every `...DenseReluDense.wo`), the segment alone (`wo`) is proposed and
//! verified with one more re-run.

use super::outcome::{finite, forward_ref};
use crate::engine::module_matches;
use crate::error::Result;
use crate::trace::record::StepRecord;
use crate::train::{Replay, Trainer, Variant};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

/// What the bisection found.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Bisection {
    /// The step bisected.
    pub step: u64,
    /// Patterns the run already kept in fp32 (part of every re-run).
    pub base_keep_fp32: Vec<String>,
    /// Number of candidate modules searched.
    pub candidates: usize,
    /// Parent modules had to be added as candidates.
    pub coarse: bool,
    /// A set was found.
    pub found: bool,
    /// The set: exact module paths.
    pub modules: Vec<String>,
    /// The set is 1-minimal (false when the re-run budget ran out first).
    pub minimal: bool,
    /// The shared last segment of every member, when there is one and it keeps more
    /// modules than the set.
    pub pattern: Option<String>,
    /// Whether the step is finite with `pattern` (`null` when there is none).
    pub pattern_finite: Option<bool>,
    /// The answer to use: the run's patterns plus `pattern` when it was verified, else
    /// plus `modules` (empty when nothing was found).
    pub keep_fp32: Vec<String>,
    /// Re-runs used.
    pub replays: u32,
}

impl Bisection {
    /// The answer as command-line flags (`--keep-fp32 wo`).
    pub fn flags(&self) -> String {
        self.keep_fp32
            .iter()
            .map(|p| format!("--keep-fp32 {p}"))
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// The answer as a TOML snippet for the run configuration.
    pub fn toml(&self) -> String {
        let items: Vec<String> = self
            .keep_fp32
            .iter()
            .map(|p| format!("\"{}\"", p.replace('\\', "\\\\").replace('"', "\\\"")))
            .collect();
        format!("[train]\nkeep_fp32 = [{}]\n", items.join(", "))
    }
}

/// A bisection with the re-runs of its answers (for the accuracy of the remedies).
pub struct BisectRun {
    /// The report.
    pub report: Bisection,
    /// The step re-run with the module set.
    pub modules_replay: Option<Replay>,
    /// The step re-run with the generalised pattern.
    pub pattern_replay: Option<Replay>,
}

struct Tester<'a> {
    trainer: &'a Trainer,
    base: Vec<String>,
    universe: Vec<String>,
    memo: HashMap<Vec<usize>, bool>,
    passed: HashMap<Vec<usize>, Replay>,
    replays: u32,
    budget: u32,
}

impl Tester<'_> {
    fn keep(&self, set: &[usize]) -> Vec<String> {
        let mut k = self.base.clone();
        k.extend(set.iter().map(|&i| self.universe[i].clone()));
        k
    }

    fn run(&mut self, keep: Vec<String>) -> Result<Replay> {
        self.replays += 1;
        self.trainer.replay(&Variant {
            keep_fp32: Some(keep),
            probes: Some(true),
            ..Variant::default()
        })
    }

    /// Whether keeping `set` makes the step finite; `None` once the budget is spent.
    fn test(&mut self, set: &[usize]) -> Result<Option<bool>> {
        let mut key = set.to_vec();
        key.sort_unstable();
        if let Some(&b) = self.memo.get(&key) {
            return Ok(Some(b));
        }
        if self.replays >= self.budget {
            return Ok(None);
        }
        let r = self.run(self.keep(&key))?;
        let ok = finite(&r.record);
        self.memo.insert(key.clone(), ok);
        if ok {
            self.passed.insert(key, r);
        }
        Ok(Some(ok))
    }
}

/// Splits `c` into `n` contiguous chunks of nearly equal size.
fn split(c: &[usize], n: usize) -> Vec<Vec<usize>> {
    let mut out = Vec::with_capacity(n);
    let mut start = 0;
    for i in 0..n {
        let end = start + (c.len() - start) / (n - i);
        out.push(c[start..end].to_vec());
        start = end;
    }
    out
}

/// ddmin from a passing set `c` (the empty set is known to fail): a 1-minimal passing
/// subset, and whether the search finished within the budget. `test` says whether a
/// subset passes, `None` once the budget is spent; it is also how `amprobe fix -- CMD`
/// bisects a script, whose tests are whole runs of it.
pub fn ddmin(
    mut test: impl FnMut(&[usize]) -> Result<Option<bool>>,
    mut c: Vec<usize>,
) -> Result<(Vec<usize>, bool)> {
    let mut n = 2usize;
    while c.len() >= 2 {
        let chunks = split(&c, n);
        let mut next = None;
        for ch in &chunks {
            match test(ch)? {
                None => return Ok((c, false)),
                Some(true) => {
                    next = Some((ch.clone(), 2));
                    break;
                }
                Some(false) => {}
            }
        }
        if next.is_none() && n > 2 {
            for ch in &chunks {
                let comp: Vec<usize> = c.iter().copied().filter(|i| !ch.contains(i)).collect();
                match test(&comp)? {
                    None => return Ok((c, false)),
                    Some(true) => {
                        next = Some((comp, (n - 1).max(2)));
                        break;
                    }
                    Some(false) => {}
                }
            }
        }
        match next {
            Some((s, m)) => {
                c = s;
                n = m;
            }
            None if n >= c.len() => break,
            None => n = (2 * n).min(c.len()),
        }
    }
    Ok((c, true))
}

/// The ancestors of a dotted path, nearest first (`a.b.c` → `a.b`, `a`).
fn ancestors(path: &str) -> impl Iterator<Item = &str> {
    path.char_indices()
        .filter(|&(_, ch)| ch == '.')
        .map(|(i, _)| &path[..i])
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
}

/// Bisects the trainer's last step (`rec`, which failed) with at most `budget` re-runs for
/// the search itself (the pattern's verification is one more).
pub fn bisect(trainer: &Trainer, rec: &StepRecord, budget: u32) -> Result<BisectRun> {
    let base = trainer.config().keep_fp32.clone();
    let kept = |m: &str| m.is_empty() || base.iter().any(|p| module_matches(p, m));
    let mut fine: Vec<String> = Vec::new();
    for p in &trainer.params().params {
        if !kept(&p.module) && !fine.contains(&p.module) {
            fine.push(p.module.clone());
        }
    }
    let mut t = Tester {
        trainer,
        base: base.clone(),
        universe: fine.clone(),
        memo: HashMap::new(),
        passed: HashMap::new(),
        replays: 0,
        budget,
    };
    let mut report = Bisection {
        step: rec.step,
        base_keep_fp32: base.clone(),
        candidates: fine.len(),
        coarse: false,
        found: false,
        modules: Vec::new(),
        minimal: false,
        pattern: None,
        pattern_finite: None,
        keep_fp32: Vec::new(),
        replays: 0,
    };
    let all: Vec<usize> = (0..fine.len()).collect();
    let mut start = (!all.is_empty() && t.test(&all)? == Some(true)).then_some(all);
    if start.is_none() && t.replays < budget {
        // Coarser groups: where the step broke, and every parent module.
        let mut coarse: Vec<String> = Vec::new();
        let ops = rec.ops.as_deref().unwrap_or(&[]);
        let origins = [&rec.origins.first_inf, &rec.origins.first_nan];
        for o in origins.into_iter().flatten() {
            coarse.push(o.module.clone());
            if let Some(f) = forward_ref(rec.step, ops, o) {
                coarse.push(f.module);
            }
        }
        let leaves: Vec<String> = fine.iter().chain(coarse.clone().iter()).cloned().collect();
        for m in &leaves {
            coarse.extend(ancestors(m).map(str::to_string));
        }
        coarse.sort_by_key(|m| std::cmp::Reverse(m.matches('.').count()));
        for m in coarse {
            if !kept(&m) && !t.universe.contains(&m) {
                t.universe.push(m);
            }
        }
        report.coarse = true;
        report.candidates = t.universe.len();
        let all: Vec<usize> = (0..t.universe.len()).collect();
        if all.len() > fine.len() && t.test(&all)? == Some(true) {
            start = Some(all);
        }
    }
    let Some(start) = start else {
        report.replays = t.replays;
        return Ok(BisectRun {
            report,
            modules_replay: None,
            pattern_replay: None,
        });
    };
    let (mut set, minimal) = ddmin(|s| t.test(s), start)?;
    set.sort_unstable();
    let modules_replay = t.passed.remove(&set);
    report.found = true;
    report.minimal = minimal;
    report.modules = set.iter().map(|&i| t.universe[i].clone()).collect();
    // Generalise to the shared last segment when it keeps more than the set itself.
    let last = |m: &str| m.rsplit('.').next().unwrap_or(m).to_string();
    let mut pattern_replay = None;
    if let Some(first) = report.modules.first() {
        let seg = last(first);
        let shared = report.modules.iter().all(|m| last(m) == seg);
        let wider = t
            .universe
            .iter()
            .any(|m| module_matches(&seg, m) && !report.modules.contains(m));
        if shared && wider && !base.contains(&seg) {
            let mut keep = base.clone();
            keep.push(seg.clone());
            let r = t.run(keep)?;
            let ok = finite(&r.record);
            report.pattern = Some(seg);
            report.pattern_finite = Some(ok);
            pattern_replay = Some(r);
        }
    }
    report.keep_fp32 = base;
    match (&report.pattern, report.pattern_finite) {
        (Some(p), Some(true)) => report.keep_fp32.push(p.clone()),
        _ => report.keep_fp32.extend(report.modules.iter().cloned()),
    }
    report.replays = t.replays;
    Ok(BisectRun {
        report,
        modules_replay,
        pattern_replay,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_covers_in_order() {
        assert_eq!(split(&[1, 2, 3, 4, 5], 2), vec![vec![1, 2], vec![3, 4, 5]]);
        assert_eq!(split(&[1, 2, 3], 3), vec![vec![1], vec![2], vec![3]]);
        assert_eq!(
            split(&[0, 1, 2, 3, 4, 5, 6], 4),
            vec![vec![0], vec![1, 2], vec![3, 4], vec![5, 6]]
        );
    }

    /// ddmin against a known predicate: the result passes, is 1-minimal, and the tests
    /// stay far below the 2^n subsets.
    #[test]
    fn ddmin_finds_a_one_minimal_set() {
        let mut calls = 0;
        let needs = |s: &[usize]| s.contains(&3) && s.contains(&17);
        let (set, done) = ddmin(
            |s| {
                calls += 1;
                Ok(Some(needs(s)))
            },
            (0..32).collect(),
        )
        .unwrap();
        let mut set = set;
        set.sort_unstable();
        assert_eq!(set, vec![3, 17]);
        assert!(done);
        assert!(calls < 64, "{calls} tests");
        // Either of two modules suffices: one of them alone.
        let (set, _) = ddmin(
            |s| Ok(Some(s.contains(&5) || s.contains(&9))),
            (0..12).collect(),
        )
        .unwrap();
        assert!(set == vec![5] || set == vec![9], "{set:?}");
        // A budget that runs out returns the current (passing) set, not minimal.
        let mut left = 2;
        let (set, done) = ddmin(
            |s| {
                if left == 0 {
                    return Ok(None);
                }
                left -= 1;
                Ok(Some(s.contains(&1)))
            },
            (0..16).collect(),
        )
        .unwrap();
        assert!(!done);
        assert!(set.contains(&1) && set.len() > 1);
    }

    #[test]
    fn ancestors_nearest_first() {
        let a: Vec<&str> = ancestors("encoder.block.3.layer").collect();
        assert_eq!(a, vec!["encoder.block.3", "encoder.block", "encoder"]);
        assert_eq!(ancestors("wo").count(), 0);
    }

    #[test]
    fn snippets() {
        let b = Bisection {
            step: 0,
            base_keep_fp32: vec![],
            candidates: 3,
            coarse: false,
            found: true,
            modules: vec!["a.wo".into()],
            minimal: true,
            pattern: Some("wo".into()),
            pattern_finite: Some(true),
            keep_fp32: vec!["lm_head".into(), "wo".into()],
            replays: 4,
        };
        assert_eq!(b.flags(), "--keep-fp32 lm_head --keep-fp32 wo");
        assert_eq!(b.toml(), "[train]\nkeep_fp32 = [\"lm_head\", \"wo\"]\n");
    }
}
