//! The `drift` rule of the CI gate: a run held to a numerics lockfile
//! ([`super::lockfile`]). Each step with op records is checked op by op against the
//! lock's envelopes and tolerances, and every step against the lock's loss-scale path; a
//! finding names the op, module and step, the lock's figure, the run's and by how much.

use super::facts::fmt_num;
use super::lockfile::{
    figures, keys, sixteen_bit_max, Lock, OpEnvelope, OpFigures, OpKey, Tolerances, UnmatchedOps,
};
use crate::dtype::DType;
use crate::error::Result;
use crate::trace::record::{Header, StepRecord};
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

/// What left the envelope.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DriftKind {
    /// The run is of another model or precision than the lock's.
    Run,
    /// An op's output dtype changed.
    DType,
    /// A NaN or Inf where the envelope has none.
    NonFinite,
    /// Largest |x| grew past the factor.
    MaxAbs,
    /// Headroom to the 16-bit maximum fell under the margin.
    Headroom,
    /// A flush to zero where the envelope has none.
    Flush,
    /// The flushed share grew past the tolerance.
    FlushShare,
    /// The share of zeros left its range.
    ZeroShare,
    /// The share of subnormals left its range.
    SubnormalShare,
    /// The smallest binade fell too far.
    MinExp,
    /// An op the lock does not have.
    NewOp,
    /// An op of the lock the run did not run.
    MissingOp,
    /// A step's loss scale or skip differs from the lock's.
    Scale,
}

/// One way the run left the lock.
#[derive(Debug, Clone, PartialEq)]
pub struct Finding {
    /// What left the envelope.
    pub kind: DriftKind,
    /// The op, when the finding is about one.
    pub op: Option<OpKey>,
    /// The step it was seen in (the worst one, for an op).
    pub step: Option<u64>,
    /// Whether it breaks the rule (an unmatched op under `unmatched_ops = "ignore"` does
    /// not).
    pub breaks: bool,
    /// The finding as a sentence.
    pub message: String,
}

/// Checks a run against one lockfile, step by step.
#[derive(Debug, Clone)]
pub struct DriftCheck {
    path: PathBuf,
    lock: Lock,
    index: HashMap<OpKey, usize>,
    max16: f64,
    seen: Vec<bool>,
    steps: u64,
    steps_with_ops: u64,
    /// Per lock op and kind: the worst finding and how bad it was.
    worst: HashMap<(usize, DriftKind), (f64, Finding)>,
    /// Ops the lock lacks, each with the lock's op it ran after (`None`: before any).
    new_ops: Vec<(Option<usize>, Finding)>,
    new_keys: HashSet<OpKey>,
    scale: Vec<Finding>,
    run: Vec<Finding>,
}

impl DriftCheck {
    /// A check against the lockfile at `path`.
    pub fn open(path: &Path) -> Result<DriftCheck> {
        Ok(DriftCheck::new(path, Lock::read(path)?))
    }

    /// A check against `lock` (read from `path`, which messages name).
    pub fn new(path: &Path, lock: Lock) -> DriftCheck {
        let index = lock
            .envelopes
            .ops
            .iter()
            .enumerate()
            .map(|(i, e)| (e.key(), i))
            .collect();
        let sixteen = if lock.sixteen_bit == DType::BF16.name() {
            DType::BF16
        } else {
            DType::F16
        };
        DriftCheck {
            path: path.to_path_buf(),
            seen: vec![false; lock.envelopes.ops.len()],
            lock,
            index,
            max16: sixteen_bit_max(sixteen),
            steps: 0,
            steps_with_ops: 0,
            worst: HashMap::new(),
            new_ops: Vec::new(),
            new_keys: HashSet::new(),
            scale: Vec::new(),
            run: Vec::new(),
        }
    }

    /// The lockfile's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Checks the run's header: the same model and precision as the lock's.
    pub fn observe_header(&mut self, h: &Header) {
        for (what, lock, run) in [
            ("precision", &self.lock.precision, &h.precision),
            ("model", &self.lock.model, &h.model),
        ] {
            if lock != run {
                self.run.push(Finding {
                    kind: DriftKind::Run,
                    op: None,
                    step: None,
                    breaks: true,
                    message: format!("the run's {what} is `{run}`, the lock's `{lock}`"),
                });
            }
        }
    }

    /// Checks one step.
    pub fn observe(&mut self, s: &StepRecord) {
        self.steps += 1;
        self.check_scale(s);
        let Some(ops) = &s.ops else { return };
        self.steps_with_ops += 1;
        let mut last = None;
        for (key, op) in keys(ops).into_iter().zip(ops) {
            let f = figures(op, self.max16);
            match self.index.get(&key) {
                Some(&i) => {
                    self.seen[i] = true;
                    last = Some(i);
                    self.check_op(i, s.step, &f);
                }
                None => {
                    if self.new_keys.insert(key.clone()) {
                        self.new_ops.push((
                            last,
                            Finding {
                                kind: DriftKind::NewOp,
                                message: format!(
                                    "step {}: {} is not in the lock",
                                    s.step,
                                    key.describe()
                                ),
                                op: Some(key),
                                step: Some(s.step),
                                breaks: self.lock.tolerances.unmatched_ops == UnmatchedOps::Fail,
                            },
                        ));
                    }
                }
            }
        }
    }

    fn check_scale(&mut self, s: &StepRecord) {
        if !self.lock.tolerances.scale_path {
            return;
        }
        let Some(p) = self.lock.envelopes.scale.iter().find(|p| p.step == s.step) else {
            return;
        };
        let mut diffs = Vec::new();
        if p.skipped != s.skipped {
            diffs.push(if s.skipped {
                "skipped, where the lock's step was not".to_string()
            } else {
                "not skipped, where the lock's step was".to_string()
            });
        }
        // (bits, not values: a NaN scale equals only itself)
        if p.before.to_bits() != s.scale_before.to_bits() {
            diffs.push(format!(
                "loss scale {} (the lock's {})",
                fmt_num(s.scale_before),
                fmt_num(p.before)
            ));
        }
        if p.after.to_bits() != s.scale_after.to_bits() {
            diffs.push(format!(
                "scale after the update {} (the lock's {})",
                fmt_num(s.scale_after),
                fmt_num(p.after)
            ));
        }
        if !diffs.is_empty() {
            self.scale.push(Finding {
                kind: DriftKind::Scale,
                op: None,
                step: Some(s.step),
                breaks: true,
                message: format!("step {}: {}", s.step, diffs.join("; ")),
            });
        }
    }

    fn check_op(&mut self, i: usize, step: u64, f: &OpFigures) {
        let e: &OpEnvelope = &self.lock.envelopes.ops[i];
        let t = &self.lock.tolerances;
        let found = OP_RULES.iter().filter_map(|rule| rule(e, f, t));
        let key = e.key();
        for (kind, how_bad, what) in found {
            let slot = self.worst.entry((i, kind));
            let finding = Finding {
                kind,
                op: Some(key.clone()),
                step: Some(step),
                breaks: true,
                message: format!("step {step}: {}: {what}", key.describe()),
            };
            match slot {
                std::collections::hash_map::Entry::Occupied(mut o) => {
                    if how_bad > o.get().0 {
                        o.insert((how_bad, finding));
                    }
                }
                std::collections::hash_map::Entry::Vacant(v) => {
                    v.insert((how_bad, finding));
                }
            }
        }
    }

    /// Every finding so far: the run's, then the ops' in the order they ran (the lock's
    /// order, an op the lock lacks after the lock's op it followed: the first op to leave
    /// its envelope is where to look first), then the loss-scale path.
    pub fn findings(&self) -> Vec<Finding> {
        // Position 2i + 1 is the lock's op i; 2i + 2 what ran after it, 0 before any.
        let mut placed: Vec<(usize, Finding)> = Vec::new();
        let mut ops: Vec<_> = self.worst.iter().collect();
        ops.sort_by_key(|(k, _)| **k);
        placed.extend(
            ops.into_iter()
                .map(|((i, _), (_, f))| (2 * i + 1, f.clone())),
        );
        placed.extend(
            self.new_ops
                .iter()
                .map(|(after, f)| (after.map_or(0, |i| 2 * i + 2), f.clone())),
        );
        if self.steps_with_ops >= self.lock.steps_with_ops {
            for (i, e) in self.lock.envelopes.ops.iter().enumerate() {
                if self.seen[i] {
                    continue;
                }
                let key = e.key();
                placed.push((
                    2 * i + 1,
                    Finding {
                        kind: DriftKind::MissingOp,
                        message: format!("{} of the lock did not run", key.describe()),
                        op: Some(key),
                        step: None,
                        breaks: self.lock.tolerances.unmatched_ops == UnmatchedOps::Fail,
                    },
                ));
            }
        }
        placed.sort_by_key(|(p, _)| *p);
        let mut out = self.run.clone();
        out.extend(placed.into_iter().map(|(_, f)| f));
        out.extend(self.scale.iter().cloned());
        out
    }

    /// Whether the rule is broken, a one-line account, and the findings as lines.
    pub fn outcome(&self) -> (bool, String, Vec<String>) {
        let path = self.path.display();
        if self.steps_with_ops == 0 {
            return (
                true,
                format!(
                    "no step has op records to hold to {path} ({} checked): keep them with \
                     --sample-every 1",
                    plural(self.steps, "step")
                ),
                Vec::new(),
            );
        }
        let all = self.findings();
        let breaking: Vec<&Finding> = all.iter().filter(|f| f.breaks).collect();
        let ops_out: HashSet<&OpKey> = breaking
            .iter()
            .filter(|f| {
                !matches!(
                    f.kind,
                    DriftKind::NewOp | DriftKind::MissingOp | DriftKind::Scale | DriftKind::Run
                )
            })
            .filter_map(|f| f.op.as_ref())
            .collect();
        let checked = format!(
            "{} of the lock's {} checked over {} with op records",
            self.seen.iter().filter(|s| **s).count(),
            plural(self.lock.envelopes.ops.len() as u64, "op"),
            plural(self.steps_with_ops, "step")
        );
        let details = detail_lines(&all);
        if breaking.is_empty() {
            return (
                false,
                format!("every op within its envelope in {path} ({checked})"),
                details,
            );
        }
        let count = |k: DriftKind| breaking.iter().filter(|f| f.kind == k).count() as u64;
        let mut parts = Vec::new();
        if !ops_out.is_empty() {
            parts.push(format!(
                "{} left {} envelope",
                plural(ops_out.len() as u64, "op"),
                if ops_out.len() == 1 { "its" } else { "their" }
            ));
        }
        for (k, one, many) in [
            (DriftKind::NewOp, "new op", "new ops"),
            (
                DriftKind::MissingOp,
                "op of the lock missing",
                "ops of the lock missing",
            ),
            (
                DriftKind::Scale,
                "step off the loss-scale path",
                "steps off the loss-scale path",
            ),
        ] {
            match count(k) {
                0 => {}
                1 => parts.push(format!("1 {one}")),
                n => parts.push(format!("{n} {many}")),
            }
        }
        if count(DriftKind::Run) > 0 {
            parts.push("another model or precision".into());
        }
        (
            true,
            format!(
                "{} against {path} ({checked}); first: {}",
                parts.join(", "),
                breaking[0].message
            ),
            details,
        )
    }
}

/// One way an op can leave its envelope: what, by how much (the worst step is kept), and
/// the figures as a phrase.
type OpFinding = (DriftKind, f64, String);

/// An op's rule: its figures against the lock's envelope under the lock's tolerances.
type OpRule = fn(&OpEnvelope, &OpFigures, &Tolerances) -> Option<OpFinding>;

/// The op rules, in the order their findings are listed.
const OP_RULES: [OpRule; 8] = [
    dtype_rule,
    nonfinite_rule,
    max_abs_rule,
    headroom_rule,
    flush_rule,
    zero_share_rule,
    subnormal_share_rule,
    min_exp_rule,
];

fn dtype_rule(e: &OpEnvelope, f: &OpFigures, _: &Tolerances) -> Option<OpFinding> {
    (f.dtype != e.dtype).then(|| {
        (
            DriftKind::DType,
            1.0,
            format!("output dtype {} (the lock's {})", f.dtype, e.dtype),
        )
    })
}

fn nonfinite_rule(e: &OpEnvelope, f: &OpFigures, t: &Tolerances) -> Option<OpFinding> {
    (t.new_nonfinite && e.nonfinite == 0 && f.nonfinite > 0).then(|| {
        (
            DriftKind::NonFinite,
            f.nonfinite as f64,
            format!("{} NaN/Inf value(s), where the lock has none", f.nonfinite),
        )
    })
}

fn max_abs_rule(e: &OpEnvelope, f: &OpFigures, t: &Tolerances) -> Option<OpFinding> {
    (f.max_abs > e.max_abs * t.max_abs_factor).then(|| {
        let r = if e.max_abs == 0.0 {
            f64::INFINITY
        } else {
            f.max_abs / e.max_abs
        };
        (
            DriftKind::MaxAbs,
            r,
            format!(
                "max |x| {} (the lock's {}: ×{}, the lock allows ×{})",
                fmt_num(f.max_abs),
                fmt_num(e.max_abs),
                fmt_ratio(r),
                fmt_num(t.max_abs_factor)
            ),
        )
    })
}

fn headroom_rule(e: &OpEnvelope, f: &OpFigures, t: &Tolerances) -> Option<OpFinding> {
    let (eh, fh) = (e.headroom_binades?, f.headroom_binades?);
    (fh < t.headroom_binades && eh >= t.headroom_binades).then(|| {
        (
            DriftKind::Headroom,
            eh - fh,
            format!(
                "headroom to the 16-bit max {fh:.2} binades (the lock's {}; the margin is {})",
                fmt_binades(eh),
                fmt_num(t.headroom_binades)
            ),
        )
    })
}

/// A first flush (where the lock has none), else a flushed share grown past the tolerance.
fn flush_rule(e: &OpEnvelope, f: &OpFigures, t: &Tolerances) -> Option<OpFinding> {
    if t.new_flush && e.flushed == 0 && f.flushed > 0 && f.flush_share > t.new_flush_share {
        Some((
            DriftKind::Flush,
            f.flushed as f64,
            format!(
                "{} value(s) flushed to zero by rounding ({} of the nonzero results), where the lock has none",
                f.flushed,
                pct(f.flush_share)
            ),
        ))
    } else if f.flush_share > e.flush_share + t.flush_share_delta {
        Some((
            DriftKind::FlushShare,
            f.flush_share - e.flush_share,
            format!(
                "{} of the nonzero results flushed to zero (the lock's at most {}, allowed +{})",
                pct(f.flush_share),
                pct(e.flush_share),
                pct(t.flush_share_delta)
            ),
        ))
    } else {
        None
    }
}

fn zero_share_rule(e: &OpEnvelope, f: &OpFigures, t: &Tolerances) -> Option<OpFinding> {
    share_rule(
        DriftKind::ZeroShare,
        "zeros",
        f.zero_share,
        e.zero_share,
        t.zero_share_delta,
    )
}

fn subnormal_share_rule(e: &OpEnvelope, f: &OpFigures, t: &Tolerances) -> Option<OpFinding> {
    share_rule(
        DriftKind::SubnormalShare,
        "subnormal values",
        f.subnormal_share,
        e.subnormal_share,
        t.subnormal_share_delta,
    )
}

/// A share `v` further than `d` outside the lock's `range`.
fn share_rule(kind: DriftKind, what: &str, v: f64, range: [f64; 2], d: f64) -> Option<OpFinding> {
    let by = (range[0] - v).max(v - range[1]);
    (by > d).then(|| {
        (
            kind,
            by,
            format!(
                "{} {what} (the lock's {}–{}, allowed ±{})",
                pct(v),
                pct(range[0]),
                pct(range[1]),
                pct(d)
            ),
        )
    })
}

fn min_exp_rule(e: &OpEnvelope, f: &OpFigures, t: &Tolerances) -> Option<OpFinding> {
    let (le, fe) = (e.exp?, f.exp?);
    let drop = f64::from(le[0]) - f64::from(fe[0]);
    (drop > t.min_exp_drop).then(|| {
        (
            DriftKind::MinExp,
            drop,
            format!(
                "smallest binade 2^{} (the lock's 2^{}: {drop} binades lower, allowed {})",
                fe[0],
                le[0],
                fmt_num(t.min_exp_drop)
            ),
        )
    })
}

/// The findings as lines, a run of ops the lock lacks (or the run lacks) in one module and
/// phase on one line.
fn detail_lines(all: &[Finding]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < all.len() {
        let f = &all[i];
        let ignored = if f.breaks {
            ""
        } else {
            " (ignored: unmatched_ops = \"ignore\")"
        };
        let group = |g: &Finding| {
            g.kind == f.kind
                && g.op.as_ref().map(|k| (&k.module, k.phase, k.micro))
                    == f.op.as_ref().map(|k| (&k.module, k.phase, k.micro))
        };
        let unmatched = matches!(f.kind, DriftKind::NewOp | DriftKind::MissingOp);
        let n = if unmatched {
            all[i..].iter().take_while(|g| group(g)).count()
        } else {
            1
        };
        if n > 1 {
            let k = f.op.as_ref().expect("an unmatched op has a key");
            let names: Vec<String> = all[i..i + n]
                .iter()
                .filter_map(|g| g.op.as_ref())
                .map(|k| format!("`{}`", k.op))
                .collect();
            let module = crate::trace::record::module_name(&k.module);
            let phase = k.phase.name();
            out.push(if f.kind == DriftKind::NewOp {
                format!(
                    "step {}: {n} {phase} ops in `{module}` are not in the lock: {}{ignored}",
                    f.step.unwrap_or(0),
                    names.join(", ")
                )
            } else {
                format!(
                    "{n} {phase} ops of the lock in `{module}` did not run: {}{ignored}",
                    names.join(", ")
                )
            });
        } else {
            out.push(format!("{}{ignored}", f.message));
        }
        i += n;
    }
    out
}

fn plural(n: u64, what: &str) -> String {
    super::facts::plural(n, what)
}

fn pct(f: f64) -> String {
    if f == 0.0 {
        "0%".into()
    } else {
        super::facts::fmt_pct(f)
    }
}

fn fmt_ratio(r: f64) -> String {
    if r.is_infinite() {
        "∞".into()
    } else if r >= 100.0 {
        format!("{r:.0}")
    } else {
        // (three decimals: a ratio just past the factor must not print as the factor)
        format!("{r:.3}")
    }
}

fn fmt_binades(b: f64) -> String {
    if b.is_infinite() {
        "unbounded".into()
    } else {
        format!("{b:.2}")
    }
}
