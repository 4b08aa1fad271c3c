//! The CI gate: rules a run must keep (`--fail-on nonfinite,skip-rate>5%,...`), checked over
//! step records, one step at a time so a running training loop can feed it too.
//!
//! Rules:
//! - `nonfinite`: no Inf or NaN may originate in the forward pass (any step's first Inf or
//!   first NaN in phase forward breaks it).
//! - `skip-rate>X%`: more than X% of the steps skipped breaks it.
//! - `headroom>X%`: a forward op whose largest finite |output| exceeds X% of fp16's max
//!   (65504) breaks it; an op whose rounding overflowed, or where an Inf originated, counts
//!   as infinitely over. Only steps with op records are checked; scaler bookkeeping is
//!   left out. In a run some of whose ops ran in 16 bits (fp16, bf16) only the 16-bit
//!   forward ops count: an fp32 op there would reach fp16's limits only if it were cast
//!   (one that made an Inf is the `nonfinite` rule's). In a run with none (fp32) every
//!   forward op counts: the rule then asks whether the values would fit fp16.
//! - `underflow>X%`: gradients losing more than X% of their values to fp16 underflow break
//!   it: a backward op whose rounding flushed more than X% of its nonzero results to zero
//!   (steps with op records), or a parameter whose unscaled gradient would lose more than X%
//!   of its nonzero values when multiplied by the loss scale and rounded to fp16.
//! - `scale-collapse`: a step reporting a loss-scale collapse (an event starting with
//!   "scale collapse" from the step, or "loss scale collaps…" from the diagnosis), or a scale
//!   that became 0 or non-finite, breaks it.
//! - `drift[=FILE]`: an op leaving the envelope a numerics lockfile (default
//!   `amprobe.lock`, written by `amprobe baseline`) holds it to, beyond the file's
//!   tolerances, breaks it; so do ops the lock lacks or has that the run lacks, and a step
//!   off its loss-scale path (see [`super::drift`]). The path may hold no comma.

use super::drift::DriftCheck;
use super::facts::{self, describe_op, fmt_num, fmt_pct, plural};
use super::lockfile::DEFAULT_LOCK;
use crate::error::{Error, Result};
use crate::trace::io::Trace;
use crate::trace::record::{Header, OpRecord, OpRef, Phase, StepRecord};
use std::fmt;
use std::path::PathBuf;

/// One rule of the gate.
#[derive(Debug, Clone, PartialEq)]
pub enum Rule {
    /// No forward Inf/NaN origin.
    NonFinite,
    /// Skipped steps at most this percentage.
    SkipRate(f64),
    /// Forward ops at most this percentage of fp16's max.
    Headroom(f64),
    /// Gradient values flushed by fp16 underflow at most this percentage.
    Underflow(f64),
    /// No loss-scale collapse.
    ScaleCollapse,
    /// Every op within the envelope of this lockfile.
    Drift(PathBuf),
}

const RULES_HELP: &str =
    "nonfinite, skip-rate>X%, headroom>X%, underflow>X%, scale-collapse, drift[=FILE] \
     (comma-separated)";

impl Rule {
    /// Parses one rule: `nonfinite`, `skip-rate>5%`, `headroom>50%`, `underflow>1%`,
    /// `scale-collapse`, `drift` or `drift=FILE`. Spaces are ignored (but in a drift
    /// rule's path); the `%` is optional (X is a percentage).
    pub fn parse(s: &str) -> Result<Rule> {
        let trimmed = s.trim();
        if trimmed == "drift" {
            return Ok(Rule::Drift(PathBuf::from(DEFAULT_LOCK)));
        }
        if let Some(path) = trimmed.strip_prefix("drift") {
            if let Some(path) = path.trim_start().strip_prefix('=') {
                let path = path.trim();
                if path.is_empty() {
                    return Err(Error::Invalid(format!(
                        "--fail-on rule `{s}`: no lockfile after `=` (rules: {RULES_HELP})"
                    )));
                }
                return Ok(Rule::Drift(PathBuf::from(path)));
            }
        }
        let t: String = s.chars().filter(|c| !c.is_whitespace()).collect();
        let bad = |why: String| {
            Error::Invalid(format!("--fail-on rule `{s}`: {why} (rules: {RULES_HELP})"))
        };
        match t.as_str() {
            "nonfinite" => return Ok(Rule::NonFinite),
            "scale-collapse" => return Ok(Rule::ScaleCollapse),
            _ => {}
        }
        let Some((name, value)) = t.split_once('>') else {
            return Err(bad("unknown rule".into()));
        };
        let value = value.strip_suffix('%').unwrap_or(value);
        let x: f64 = value.parse().map_err(|_| {
            bad(format!(
                "`{value}` is not a number (expected a percentage such as 5%)"
            ))
        })?;
        if !x.is_finite() || x < 0.0 {
            return Err(bad(format!("{x} is not a percentage (expected 0 or more)")));
        }
        match name {
            "skip-rate" => Ok(Rule::SkipRate(x)),
            "headroom" => Ok(Rule::Headroom(x)),
            "underflow" => Ok(Rule::Underflow(x)),
            "nonfinite" | "scale-collapse" => Err(bad(format!("`{name}` takes no threshold"))),
            _ => Err(bad("unknown rule".into())),
        }
    }
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Rule::NonFinite => f.write_str("nonfinite"),
            Rule::SkipRate(x) => write!(f, "skip-rate>{x}%"),
            Rule::Headroom(x) => write!(f, "headroom>{x}%"),
            Rule::Underflow(x) => write!(f, "underflow>{x}%"),
            Rule::ScaleCollapse => f.write_str("scale-collapse"),
            Rule::Drift(p) => write!(f, "drift={}", p.display()),
        }
    }
}

/// Parses a comma-separated rule list; an empty list is an error.
pub fn parse_rules(s: &str) -> Result<Vec<Rule>> {
    let rules: Vec<Rule> = s
        .split(',')
        .filter(|r| !r.trim().is_empty())
        .map(Rule::parse)
        .collect::<Result<_>>()?;
    if rules.is_empty() {
        return Err(Error::Invalid(format!(
            "--fail-on: no rule given (rules: {RULES_HELP})"
        )));
    }
    Ok(rules)
}

/// What one rule found.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    /// The rule.
    pub rule: Rule,
    /// True when the run broke it.
    pub broken: bool,
    /// What was found, as a sentence starting with the rule.
    pub message: String,
    /// Line by line, what the rule found (the drift rule's findings; empty for the others).
    pub details: Vec<String>,
}

/// A rule the run broke, with what broke it.
#[derive(Debug, Clone, PartialEq)]
pub struct Broken {
    /// The rule.
    pub rule: Rule,
    /// What broke it, as a sentence starting with the rule.
    pub message: String,
}

/// The worst gradient underflow seen: share, and where.
#[derive(Debug, Clone, PartialEq)]
enum UnderflowAt {
    Op(OpRef),
    Param(String, u64),
}

/// Checks rules over step records fed one at a time ([`Gate::observe`]), keeping only
/// what the rules need (no op records are held).
#[derive(Debug, Clone)]
pub struct Gate {
    rules: Vec<Rule>,
    steps: u64,
    skipped: u64,
    forward_origins: u64,
    first_forward: Option<(&'static str, OpRef)>,
    steps_with_ops: u64,
    /// The largest headroom ratio of any forward op, and of those that ran in 16 bits:
    /// `(ratio, op, max |x|)`.
    worst_headroom: Option<(f64, OpRef, f64)>,
    worst_headroom_16: Option<(f64, OpRef, f64)>,
    ran_16bit: bool,
    worst_underflow: Option<(f64, UnderflowAt)>,
    collapse: Option<(u64, String)>,
    /// One check per drift rule, in rule order.
    drift: Vec<DriftCheck>,
}

impl Gate {
    /// A gate checking `rules`; a drift rule's lockfile is read here, so a missing or bad
    /// one is an error before any work is done.
    pub fn new(rules: Vec<Rule>) -> Result<Gate> {
        let drift = rules
            .iter()
            .filter_map(|r| match r {
                Rule::Drift(p) => Some(DriftCheck::open(p)),
                _ => None,
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Gate {
            rules,
            steps: 0,
            skipped: 0,
            forward_origins: 0,
            first_forward: None,
            steps_with_ops: 0,
            worst_headroom: None,
            worst_headroom_16: None,
            ran_16bit: false,
            worst_underflow: None,
            collapse: None,
            drift,
        })
    }

    /// True when a rule holds the run to a lockfile (which needs op records in every
    /// step it checks).
    pub fn has_drift(&self) -> bool {
        !self.drift.is_empty()
    }

    /// Takes the run's header into account (the drift rule checks that the run is of the
    /// lock's model and precision).
    pub fn observe_header(&mut self, h: &Header) {
        for d in &mut self.drift {
            d.observe_header(h);
        }
    }

    /// The rules checked.
    pub fn rules(&self) -> &[Rule] {
        &self.rules
    }

    /// Takes one step record into account. Call it before dropping the step's op
    /// records: `headroom` and the op part of `underflow` read them.
    pub fn observe(&mut self, s: &StepRecord) {
        for d in &mut self.drift {
            d.observe(s);
        }
        self.steps += 1;
        self.skipped += u64::from(s.skipped);
        let fwd: Vec<(&'static str, &OpRef)> =
            [("Inf", &s.origins.first_inf), ("NaN", &s.origins.first_nan)]
                .into_iter()
                .filter_map(|(k, o)| {
                    o.as_ref()
                        .filter(|o| o.phase == Phase::Forward)
                        .map(|o| (k, o))
                })
                .collect();
        if !fwd.is_empty() {
            self.forward_origins += 1;
            if self.first_forward.is_none() {
                let (k, o) = fwd
                    .iter()
                    .min_by_key(|(_, o)| o.op_index)
                    .copied()
                    .unwrap_or(fwd[0]);
                self.first_forward = Some((k, o.clone()));
            }
        }
        if let Some(ops) = &s.ops {
            self.steps_with_ops += 1;
            for op in ops {
                self.observe_headroom(s, op);
                if op.phase == Phase::Backward && op.rounding.underflow > 0 {
                    // Results that were nonzero before rounding: the finite nonzero ones
                    // plus those rounding flushed.
                    let before = op.stats.finite_nonzero() + op.rounding.underflow;
                    self.note_underflow(
                        op.rounding.underflow as f64 / before as f64,
                        UnderflowAt::Op(OpRef::from_op(s.step, op)),
                    );
                }
            }
        }
        for p in &s.params {
            self.note_underflow(
                p.f16_underflow_frac_scaled,
                UnderflowAt::Param(p.name.clone(), s.step),
            );
        }
        self.observe_collapse(s);
    }

    fn note_underflow(&mut self, share: f64, at: UnderflowAt) {
        if share > self.worst_underflow.as_ref().map_or(0.0, |w| w.0) {
            self.worst_underflow = Some((share, at));
        }
    }

    /// The headroom of one op of step `s`.
    fn observe_headroom(&mut self, s: &StepRecord, op: &OpRecord) {
        let sixteen = facts::ran_in_16_bits(op);
        self.ran_16bit |= sixteen;
        if facts::headroom_checked(op) {
            let r = facts::headroom_ratio(s, op);
            let hit = || Some((r, OpRef::from_op(s.step, op), op.stats.max_abs));
            if self.worst_headroom.as_ref().is_none_or(|w| r > w.0) {
                self.worst_headroom = hit();
            }
            if sixteen && self.worst_headroom_16.as_ref().is_none_or(|w| r > w.0) {
                self.worst_headroom_16 = hit();
            }
        }
    }

    /// The first collapse: an event saying so, or a scale that became 0 or non-finite.
    fn observe_collapse(&mut self, s: &StepRecord) {
        if self.collapse.is_none() {
            if let Some(e) = s.events.iter().find(|e| {
                let e = e.to_ascii_lowercase();
                e.starts_with("scale collapse") || e.starts_with("loss scale collaps")
            }) {
                self.collapse = Some((s.step, e.clone()));
            } else if s.scale_after == 0.0 || !s.scale_after.is_finite() {
                self.collapse = Some((
                    s.step,
                    format!("the loss scale became {}", fmt_num(s.scale_after)),
                ));
            }
        }
    }

    /// The outcome of every rule over the steps observed so far, in rule order.
    pub fn outcomes(&self) -> Vec<Outcome> {
        let mut drift = self.drift.iter();
        self.rules
            .iter()
            .map(|r| match r {
                Rule::Drift(_) => {
                    let (broken, detail, details) = drift.next().map(|d| d.outcome()).unwrap_or((
                        true,
                        "no lockfile".into(),
                        Vec::new(),
                    ));
                    Outcome {
                        rule: r.clone(),
                        broken,
                        message: format!("{r}: {detail}"),
                        details,
                    }
                }
                r => self.outcome(r.clone()),
            })
            .collect()
    }

    /// The broken rules over the steps observed so far.
    pub fn broken(&self) -> Vec<Broken> {
        self.outcomes()
            .into_iter()
            .filter(|o| o.broken)
            .map(|o| Broken {
                rule: o.rule,
                message: o.message,
            })
            .collect()
    }

    /// Whether `headroom>X%` breaks, and what it found: over the 16-bit forward ops in a
    /// run that has any, else over every forward op.
    fn headroom_outcome(&self, x: f64) -> (bool, String) {
        let (worst, what, fp32) = if self.ran_16bit {
            (
                &self.worst_headroom_16,
                "largest 16-bit forward output",
                "; fp32 ops not counted",
            )
        } else {
            (&self.worst_headroom, "largest forward output", "")
        };
        match worst {
            None if self.steps_with_ops == 0 => {
                (false, "not checked: no step has op records".to_string())
            }
            None => (
                false,
                format!(
                    "no forward op ran in 16 bits ({} with op records{fp32})",
                    plural(self.steps_with_ops, "step")
                ),
            ),
            Some((r, o, max)) => (
                *r * 100.0 > x,
                format!(
                    "{what} is {} of fp16's max at {} (max |x| {}; {} with op records{fp32})",
                    fmt_pct(*r),
                    describe_op(o),
                    fmt_num(*max),
                    plural(self.steps_with_ops, "step")
                ),
            ),
        }
    }

    /// Whether `underflow>X%` breaks, and what it found.
    fn underflow_outcome(&self, x: f64) -> (bool, String) {
        let n = self.steps;
        match &self.worst_underflow {
            None => (
                false,
                format!(
                    "no gradient value lost to fp16 underflow in {}",
                    plural(n, "step")
                ),
            ),
            Some((f, at)) => (
                *f * 100.0 > x,
                match at {
                    UnderflowAt::Op(o) => format!(
                        "{} of the nonzero results of {} flushed to zero in fp16",
                        fmt_pct(*f),
                        describe_op(o)
                    ),
                    UnderflowAt::Param(p, s) => format!(
                        "{} of `{p}`'s nonzero gradient values flush to zero in fp16 after loss scaling, step {s}",
                        fmt_pct(*f)
                    ),
                },
            ),
        }
    }

    fn outcome(&self, rule: Rule) -> Outcome {
        let n = self.steps;
        let (broken, detail) = match rule {
            Rule::NonFinite => match &self.first_forward {
                Some((k, o)) => (
                    true,
                    format!(
                        "forward {k} first at {} ({} of {} with a forward Inf/NaN)",
                        describe_op(o),
                        self.forward_origins,
                        plural(n, "step")
                    ),
                ),
                None => (
                    false,
                    format!("no forward Inf/NaN in {}", plural(n, "step")),
                ),
            },
            Rule::SkipRate(x) => {
                let rate = if n == 0 {
                    0.0
                } else {
                    self.skipped as f64 / n as f64 * 100.0
                };
                (
                    rate > x,
                    format!(
                        "{} of {} skipped ({rate:.1}%)",
                        self.skipped,
                        plural(n, "step")
                    ),
                )
            }
            Rule::Headroom(x) => self.headroom_outcome(x),
            Rule::Underflow(x) => self.underflow_outcome(x),
            Rule::ScaleCollapse => match &self.collapse {
                Some((s, e)) => (true, format!("step {s}: {e}")),
                None => (false, format!("no collapse in {}", plural(n, "step"))),
            },
            Rule::Drift(_) => (true, "checked by the drift check".into()),
        };
        Outcome {
            message: format!("{rule}: {detail}"),
            rule,
            broken,
            details: Vec::new(),
        }
    }
}

/// Every rule's outcome over `steps`.
pub fn evaluate_steps(rules: &[Rule], steps: &[StepRecord]) -> Result<Vec<Outcome>> {
    let mut g = Gate::new(rules.to_vec())?;
    for s in steps {
        g.observe(s);
    }
    Ok(g.outcomes())
}

/// The rules of `rules` (comma-separated, see the module docs) that `trace` breaks.
pub fn evaluate(rules: &str, trace: &Trace) -> Result<Vec<Broken>> {
    let rules = parse_rules(rules)?;
    let mut g = Gate::new(rules)?;
    g.observe_header(&trace.header);
    for s in &trace.steps {
        g.observe(s);
    }
    Ok(g.broken())
}

/// True when stdout is a terminal and `NO_COLOR` is not set.
pub fn stdout_color() -> bool {
    use std::io::IsTerminal;
    std::io::stdout().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}

/// Details printed under a rule's line at most; the rest are counted.
pub const MAX_DETAILS: usize = 20;

/// The outcomes as lines (`FAIL rule: ...` / `ok   rule: ...`, a broken rule's details
/// indented under it, at most [`MAX_DETAILS`]) and a closing line; ANSI colours only when
/// `color`.
pub fn format_outcomes(outcomes: &[Outcome], color: bool) -> String {
    let mut o = String::new();
    for x in outcomes {
        let tag = match (x.broken, color) {
            (true, true) => "\x1b[1;31mFAIL\x1b[0m",
            (true, false) => "FAIL",
            (false, true) => "\x1b[32mok  \x1b[0m",
            (false, false) => "ok  ",
        };
        o.push_str(&format!("{tag} {}\n", x.message));
        if x.broken {
            for d in x.details.iter().take(MAX_DETAILS) {
                o.push_str(&format!("       {d}\n"));
            }
            if x.details.len() > MAX_DETAILS {
                o.push_str(&format!(
                    "       ... and {} more\n",
                    x.details.len() - MAX_DETAILS
                ));
            }
        }
    }
    let n = outcomes.iter().filter(|x| x.broken).count();
    o.push_str(&if n == 0 {
        format!("gate: passed ({} rules)\n", outcomes.len())
    } else {
        format!("gate: {n} of {} rules broken\n", outcomes.len())
    });
    o
}

/// The process exit code for outcomes: 1 when a rule is broken, else 0.
pub fn exit_code(outcomes: &[Outcome]) -> i32 {
    i32::from(outcomes.iter().any(|o| o.broken))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_rules_and_their_text() {
        let r = parse_rules("nonfinite, skip-rate>5%,headroom > 50 %,underflow>0.5,scale-collapse")
            .unwrap();
        assert_eq!(
            r,
            [
                Rule::NonFinite,
                Rule::SkipRate(5.0),
                Rule::Headroom(50.0),
                Rule::Underflow(0.5),
                Rule::ScaleCollapse
            ]
        );
        let text: Vec<String> = r.iter().map(|r| r.to_string()).collect();
        assert_eq!(
            text,
            [
                "nonfinite",
                "skip-rate>5%",
                "headroom>50%",
                "underflow>0.5%",
                "scale-collapse"
            ]
        );
        for bad in [
            "",
            "nan-check",
            "skip-rate",
            "skip-rate>x%",
            "skip-rate>-1%",
            "nonfinite>3%",
            "headroom>inf",
        ] {
            let e = parse_rules(bad).unwrap_err().to_string();
            assert!(e.contains("rules: nonfinite, skip-rate>X%"), "{bad}: {e}");
        }
    }

    #[test]
    fn skip_rate_is_strictly_greater() {
        let steps: Vec<StepRecord> = (0..4)
            .map(|i| StepRecord {
                step: i,
                skipped: i == 0,
                scale_after: 1.0,
                ..StepRecord::default()
            })
            .collect();
        let o = evaluate_steps(&[Rule::SkipRate(25.0), Rule::SkipRate(24.9)], &steps).unwrap();
        assert!(!o[0].broken, "25% is not more than 25%");
        assert!(o[1].broken);
        assert_eq!(
            o[1].message,
            "skip-rate>24.9%: 1 of 4 steps skipped (25.0%)"
        );
    }

    #[test]
    fn zero_scale_is_a_collapse_without_an_event() {
        let s = StepRecord {
            scale_after: 0.0,
            ..StepRecord::default()
        };
        let o = evaluate_steps(&[Rule::ScaleCollapse], &[s]).unwrap();
        assert!(o[0].broken);
        assert_eq!(
            o[0].message,
            "scale-collapse: step 0: the loss scale became 0"
        );
    }

    #[test]
    fn formatting_with_and_without_colour() {
        let o = vec![
            Outcome {
                rule: Rule::NonFinite,
                broken: true,
                message: "nonfinite: x".into(),
                details: vec!["one".into()],
            },
            Outcome {
                rule: Rule::ScaleCollapse,
                broken: false,
                message: "scale-collapse: y".into(),
                details: vec!["not shown: the rule holds".into()],
            },
        ];
        assert_eq!(
            format_outcomes(&o, false),
            "FAIL nonfinite: x\n       one\nok   scale-collapse: y\ngate: 1 of 2 rules broken\n"
        );
        assert!(format_outcomes(&o, true).contains("\x1b[1;31mFAIL\x1b[0m nonfinite: x"));
        assert_eq!(exit_code(&o), 1);
        assert_eq!(exit_code(&o[1..]), 0);
    }

    fn forward_op(index: u64, dtype: crate::dtype::DType, max_abs: f32) -> OpRecord {
        OpRecord {
            micro: 0,
            index,
            phase: Phase::Forward,
            op: "pow".into(),
            module: format!("layer{index}"),
            inputs: vec![],
            output: crate::trace::record::TensorMeta {
                dtype,
                shape: vec![1],
            },
            stats: crate::probe::TensorStats::compute(dtype, &[max_abs]),
            rounding: Default::default(),
            forward_op: None,
            wrt: None,
            masked_neg_inf: 0,
            additive_mask: false,
            blame: None,
        }
    }

    #[test]
    fn headroom_counts_fp32_ops_only_in_a_run_without_16_bit_ones() {
        use crate::dtype::DType;
        let step = |ops: Vec<OpRecord>| StepRecord {
            ops: Some(ops),
            scale_after: 1.0,
            ..StepRecord::default()
        };
        // An fp32 RMSNorm `pow` past fp16's max beside fp16 ops: only if cast.
        let mixed = step(vec![
            forward_op(0, DType::F16, 30.0),
            forward_op(1, DType::F32, 100000.0),
        ]);
        let o = evaluate_steps(&[Rule::Headroom(50.0)], &[mixed]).unwrap();
        assert!(!o[0].broken, "{}", o[0].message);
        assert!(
            o[0].message.starts_with(
                "headroom>50%: largest 16-bit forward output is 0.0458% of fp16's max at \
                 step 0 forward op #0 `pow` in `layer0`"
            ) && o[0].message.contains("fp32 ops not counted"),
            "{}",
            o[0].message
        );
        // In an fp32 run the same op is the answer.
        let fp32 = step(vec![
            forward_op(0, DType::F32, 30.0),
            forward_op(1, DType::F32, 100000.0),
        ]);
        let o = evaluate_steps(&[Rule::Headroom(50.0)], &[fp32]).unwrap();
        assert!(o[0].broken, "{}", o[0].message);
        assert!(
            o[0].message
                .contains("largest forward output is 152.7% of fp16's max")
                && o[0].message.contains("`pow` in `layer1`"),
            "{}",
            o[0].message
        );
    }
}
