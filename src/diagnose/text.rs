//! The diagnosis in plain words, for the human summary.

use super::cause::{SkipCause, SkipKind};
use super::collapse::short;
use super::headroom::{HeadroomKind, HeadroomReport, HeadroomWarning};
use super::module_bisect::Bisection;
use super::rank_summary::{RankOrigin, RanksSummary};
use super::remedy::RemedyReport;
use super::summary::RunSummary;
use crate::dtype::FP16;
use crate::trace::record::{OpRef, Phase};

fn ranks_words(rs: &[u32]) -> String {
    let list: Vec<String> = rs.iter().map(|r| r.to_string()).collect();
    match rs.len() {
        1 => format!("rank {}", list[0]),
        _ => format!("ranks {}", list.join(", ")),
    }
}

/// `rank R, step S phase op #I `op` in `module``, and whether it was made there.
fn rank_origin_words(o: &RankOrigin) -> String {
    let at = format!(
        "rank {}, step {} {} op #{} {}",
        o.rank,
        o.op.step,
        phase(o.op.phase),
        o.op.op_index,
        op_words(&o.op)
    );
    if o.received {
        format!(
            "{at}, after {} collective(s) of the step: received from another rank, where no \
             origin was recorded",
            o.collectives_before
        )
    } else {
        format!("{at}, made on rank {}", o.rank)
    }
}

/// The lines of a run over several ranks: the first Inf and NaN with their rank, which
/// ranks made and which received the first failing step's values, and the agreement on
/// found_inf.
pub fn rank_lines(r: &RanksSummary) -> Vec<String> {
    let mut out = Vec::new();
    let files: Vec<String> = r
        .ranks
        .iter()
        .map(|f| f.trace.display().to_string())
        .collect();
    out.push(format!(
        "Ranks: {} (the steps above are rank {}'s); traces: {}.",
        r.world_size,
        r.shown_rank,
        files.join(", ")
    ));
    for (what, o) in [("Inf", &r.first_inf), ("NaN", &r.first_nan)] {
        if let Some(o) = o {
            out.push(format!("  first {what}: {}.", rank_origin_words(o)));
        }
    }
    if let Some(f) = &r.first_failure {
        let mut line = format!("  step {}: ", f.step);
        if f.made_by.is_empty() {
            line.push_str("no rank made its non-finite values itself");
        } else {
            line.push_str(&format!("made on {}", ranks_words(&f.made_by)));
        }
        if !f.received_by.is_empty() {
            let through: Vec<String> = f.through.iter().map(|n| format!("`{n}`")).collect();
            line.push_str(&format!(
                "; {} received them through a collective{}",
                ranks_words(&f.received_by),
                if through.is_empty() {
                    String::new()
                } else {
                    format!(" ({})", through.join(", "))
                }
            ));
        }
        out.push(line + ".");
    }
    if r.found_inf_agreed {
        let found: Vec<String> = r.found_inf.iter().map(|s| s.step.to_string()).collect();
        out.push(if found.is_empty() {
            "  found_inf: the ranks agreed at every step (none found an Inf or NaN).".into()
        } else {
            format!(
                "  found_inf: the ranks agreed at every step (all found an Inf or NaN at \
                 step(s) {}).",
                found.join(", ")
            )
        });
    }
    for s in r.found_inf.iter().filter(|s| !s.agreed) {
        let mut parts = Vec::new();
        if !s.found.is_empty() {
            parts.push(format!("found by {}", ranks_words(&s.found)));
        }
        if !s.not_found.is_empty() {
            parts.push(format!("not by {}", ranks_words(&s.not_found)));
        }
        if !s.missing.is_empty() {
            parts.push(format!("no record from {}", ranks_words(&s.missing)));
        }
        let tail = if !s.found.is_empty() && !s.not_found.is_empty() {
            ": the ranks that found none stepped and the others skipped, so their weights \
             differ from here on"
        } else {
            ""
        };
        out.push(format!(
            "  found_inf: the ranks DISAGREED at step {} ({}){tail}.",
            s.step,
            parts.join(", ")
        ));
    }
    let each: Vec<String> = r
        .ranks
        .iter()
        .map(|f| {
            format!(
                "rank {} {} ({} steps, {} skipped)",
                f.rank, f.verdict, f.steps, f.skipped_steps
            )
        })
        .collect();
    out.push(format!("  each: {}.", each.join("; ")));
    out
}

/// The line the human summary prints above its step lines: over several ranks, whose steps
/// they are; `None` for one trace.
pub fn steps_heading(s: &RunSummary) -> Option<String> {
    let r = s.ranks.as_ref()?;
    Some(format!(
        "  steps of rank {} of {} ranks (the other ranks' are in their own traces; each \
         rank's counts: `Ranks:` below and --summary-json's `ranks`)",
        r.shown_rank, r.world_size
    ))
}

/// `step S phase op #I `op` in `module``, or `none`.
fn origin_words(o: Option<&OpRef>) -> String {
    match o {
        None => "none".into(),
        Some(o) => format!(
            "step {} {} op #{} {}",
            o.step,
            phase(o.phase),
            o.op_index,
            op_words(o)
        ),
    }
}

/// The human summary's first Inf, first NaN and chain lines (under the verdict). Over
/// several ranks each names the rank it was recorded on (the first over all ranks,
/// [`RanksSummary::first_inf`], [`RanksSummary::chain_rank`]).
pub fn origin_lines(s: &RunSummary) -> Vec<String> {
    let ranked = |o: Option<&RankOrigin>| match o {
        Some(o) => format!("rank {}, {}", o.rank, origin_words(Some(&o.op))),
        None => "none on any rank".into(),
    };
    let (inf, nan, chain_rank) = match &s.ranks {
        Some(r) => (
            ranked(r.first_inf.as_ref()),
            ranked(r.first_nan.as_ref()),
            r.chain_rank.map(|r| format!("rank {r}, ")),
        ),
        None => (
            origin_words(s.first_inf.as_ref()),
            origin_words(s.first_nan.as_ref()),
            None,
        ),
    };
    let mut out = vec![format!("  first Inf: {inf}"), format!("  first NaN: {nan}")];
    if s.chain.len() > 1 {
        let c: Vec<String> = s
            .chain
            .iter()
            .map(|o| format!("{}@{}", o.op, module(&o.module)))
            .collect();
        out.push(format!(
            "  chain: {}{}",
            chain_rank.unwrap_or_default(),
            c.join(" -> ")
        ));
    }
    out
}

/// Modules shown per headroom kind in the text (the JSON has all).
const SHOWN: usize = 12;

use crate::trace::record::module_name as module;

fn phase(p: Phase) -> &'static str {
    match p {
        Phase::Forward => "forward",
        Phase::Backward => "backward",
        Phase::Optimizer => "optimizer",
    }
}

/// `` `op` in `module` ``.
pub fn op_words(o: &OpRef) -> String {
    format!("`{}` in `{}`", o.op, module(&o.module))
}

fn steps_words(a: u64, b: u64) -> String {
    if a == b {
        format!("step {a}")
    } else {
        format!("steps {a}–{b}")
    }
}

fn pow2(s: f64) -> String {
    format!("{} (2^{})", short(s), s.log2().round() as i64)
}

fn dtype_name(c: &SkipCause) -> &'static str {
    c.dtype.map_or("its dtype", |d| d.name())
}

/// One sentence on a skip cause covering steps `a..=b`.
pub fn cause_sentence(a: u64, b: u64, c: &SkipCause) -> String {
    let head = format!("{} skipped ({})", steps_words(a, b), c.kind);
    let op = c.op.as_ref().map(op_words);
    let bop =
        c.op.as_ref()
            .map(|o| format!("the backward op {}", op_words(o)))
            .unwrap_or_else(|| "a backward op".into());
    let fwd = c
        .forward_op
        .as_ref()
        .map(|f| format!(" (the gradient of forward op {})", op_words(f)))
        .unwrap_or_default();
    match c.kind {
        SkipKind::ForwardOverflow => format!(
            "{head}: {} went non-finite in the forward pass ({}), before any gradient existed; a lower loss scale cannot help, the activation itself leaves the range.",
            op.unwrap_or_else(|| "a forward op".into()),
            dtype_name(c)
        ),
        SkipKind::ScaleTooHigh => {
            let mut s = format!(
                "{head}: the forward pass was finite, but at loss scale {} {bop}{fwd} overflowed {}",
                short(c.scale),
                dtype_name(c)
            );
            if let Some(m) = c.unscaled_max_abs {
                s += &format!("; unscaled its largest |g| is {}, which fits", num(m));
                if let Some(o) = c.op_safe_scale {
                    s += &format!(" up to scale {}", pow2(o));
                }
            }
            s += ". The same step at scale 1 is finite";
            if let Some(safe) = c.safe_scale {
                s += &format!(
                    "; every gradient of the step fits at scale {}: use --init-scale {safe}",
                    pow2(safe)
                );
            }
            s + "."
        }
        SkipKind::BackwardOverflow => format!(
            "{head}: the forward pass was finite, but {bop}{fwd} overflows {} even without loss scaling (fp32 is finite): the gradient itself is too large for the low dtype.",
            dtype_name(c)
        ),
        SkipKind::Divergence => format!(
            "{head}: the step is non-finite in fp32 too{}; this is not a precision problem (look at the data, the learning rate, the model).",
            c.op
                .as_ref()
                .map(|o| format!(" (first at {} in the {} pass)", op_words(o), phase(o.phase)))
                .unwrap_or_default()
        ),
    }
}

fn same_cause(a: &SkipCause, b: &SkipCause) -> bool {
    let key = |c: &SkipCause| {
        (
            c.kind,
            c.op.as_ref()
                .map(|o| (o.op.clone(), o.module.clone(), o.phase)),
        )
    };
    key(a) == key(b)
}

/// A value in short form: plain for ordinary magnitudes, scientific for huge or tiny ones.
pub fn num(x: f64) -> String {
    let a = x.abs();
    if !x.is_finite() {
        format!("{x}")
    } else if a == 0.0 {
        "0".into()
    } else if !(1e-3..1e6).contains(&a) {
        format!("{x:.3e}")
    } else if a >= 1000.0 {
        format!("{x:.0}")
    } else {
        format!("{x:.4}")
    }
}

/// `x` against the fp16 max, as a share (below it) or a multiple (above it).
fn share(x: f64) -> String {
    let m = x / FP16.max;
    if m < 1.0 {
        format!("{:.0}% of the fp16 max", m * 100.0)
    } else if m >= 1e6 {
        format!("{m:.1e}× the fp16 max")
    } else if m >= 10.0 {
        format!("{m:.0}× the fp16 max")
    } else {
        format!("{m:.2}× the fp16 max")
    }
}

fn headroom_value(w: &HeadroomWarning) -> String {
    match w.kind {
        HeadroomKind::NearOverflow if w.max_abs.is_infinite() => format!(
            "`{}` overflowed {} to inf ({} Inf value{})",
            w.op,
            w.dtype.name(),
            w.inf,
            if w.inf == 1 { "" } else { "s" }
        ),
        // A gradient judged without the loss scale it carries says so.
        HeadroomKind::NearOverflow if w.judged_max_abs() != w.max_abs => format!(
            "`{}` max |x| {} ({} without the loss scale: {}, {})",
            w.op,
            num(w.max_abs),
            num(w.judged_max_abs()),
            share(w.judged_max_abs()),
            w.dtype.name()
        ),
        HeadroomKind::NearOverflow => format!(
            "`{}` max |x| {} ({}, {})",
            w.op,
            num(w.max_abs),
            share(w.max_abs),
            w.dtype.name()
        ),
        HeadroomKind::Underflow => format!(
            "`{}` {:.1}% ({} of {}, {})",
            w.op,
            w.underflow_share * 100.0,
            w.fp16_underflow,
            w.finite_nonzero,
            w.dtype.name()
        ),
    }
}

/// Headroom warnings of one kind, one line per (module, phase): in execution order for
/// near overflow (the first op that comes close is the warning before the NaN), worst
/// first for underflow.
fn headroom_lines(ws: &[&HeadroomWarning], kind: HeadroomKind) -> Vec<String> {
    let mut groups: Vec<(String, Phase, Vec<&HeadroomWarning>)> = Vec::new();
    for w in ws {
        match groups
            .iter_mut()
            .find(|(m, p, _)| *m == w.module && *p == w.phase)
        {
            Some(g) => g.2.push(w),
            None => groups.push((w.module.clone(), w.phase, vec![w])),
        }
    }
    if kind == HeadroomKind::Underflow {
        let worst = |g: &Vec<&HeadroomWarning>| g.iter().map(|w| w.severity()).fold(0.0, f64::max);
        groups.sort_by(|a, b| worst(&b.2).total_cmp(&worst(&a.2)));
    }
    let n = groups.len();
    let mut out: Vec<String> = groups
        .iter()
        .take(SHOWN)
        .map(|(m, p, g)| {
            let scale = g[0]
                .loss_scale
                .map(|s| format!(", loss scale {}", short(s)))
                .unwrap_or_default();
            let vals: Vec<String> = g.iter().map(|w| headroom_value(w)).collect();
            format!(
                "  `{}` ({}, step {}{scale}): {}",
                module(m),
                phase(*p),
                g[0].step,
                vals.join("; ")
            )
        })
        .collect();
    if n > SHOWN {
        out.push(format!(
            "  ({} more modules in the summary JSON)",
            n - SHOWN
        ));
    }
    out
}

fn rel(x: Option<f64>) -> String {
    x.map_or("?".into(), |v| format!("{v:.1e}"))
}

/// The remedies in plain words.
pub fn remedy_lines(r: &RemedyReport) -> Vec<String> {
    let mut out = vec![format!(
        "Remedies at step {} ({}), each proven by re-running the step from the same weights and data{}:",
        r.step,
        r.failure,
        r.reference_loss
            .map(|l| format!("; fp32 loss {l:.6}"))
            .unwrap_or_default()
    )];
    for m in &r.remedies {
        if m.finite {
            out.push(format!(
                "  FIXES IT: {} makes step {} finite; loss differs from fp32 by {}, final hidden state by {} (relative). Flags: {}",
                m.remedy,
                r.step,
                rel(m.loss_rel_err),
                rel(m.hidden_rel_err),
                m.flags.join(" ")
            ));
        } else {
            let why = match (&m.first_nonfinite, m.skipped) {
                (Some(o), _) => format!("; first non-finite: {} ({})", op_words(o), phase(o.phase)),
                (None, true) => "; the step is still skipped".into(),
                _ => String::new(),
            };
            out.push(format!(
                "  does not fix it: {} leaves step {} non-finite{why}.",
                m.remedy, r.step
            ));
        }
    }
    if let Some(b) = &r.bisection {
        out.extend(bisection_lines(b));
    }
    if let Some(n) = &r.note {
        out.push(format!("  {n}."));
    }
    if let Some(best) = r.best() {
        out.push(format!(
            "Suggested fix: {} (closest to fp32 among those that work): {}",
            best.remedy,
            best.flags.join(" ")
        ));
    }
    out
}

/// The bisection in plain words, with the ready flags and TOML snippet.
pub fn bisection_lines(b: &Bisection) -> Vec<String> {
    let mut out = Vec::new();
    if !b.found {
        out.push(format!(
            "  Bisection ({} re-runs of the step over {} candidate modules): keeping modules in fp32 does not make step {} finite.",
            b.replays, b.candidates, b.step
        ));
        return out;
    }
    out.push(format!(
        "  Bisection ({} re-runs of the step over {} candidate modules{}): keeping {} in fp32 makes step {} finite{}.",
        b.replays,
        b.candidates,
        if b.coarse { ", parent modules included" } else { "" },
        b.modules.join(", "),
        b.step,
        if b.minimal {
            " (1-minimal: dropping any one of them fails again)"
        } else {
            " (the re-run budget ran out before the set was minimal)"
        }
    ));
    if let (Some(p), Some(ok)) = (&b.pattern, b.pattern_finite) {
        out.push(format!(
            "  All of them are `{p}` modules: the pattern `{p}` {}.",
            if ok {
                "was verified by one more re-run: finite"
            } else {
                "does NOT make the step finite (verified by one more re-run); use the exact paths"
            }
        ));
    }
    out.push(format!("  Use: {}", b.flags()));
    out.push("  or in the config:".into());
    out.extend(b.toml().lines().map(|l| format!("    {l}")));
    out
}

/// The top offenders of precision loss (`--blame`), as lines: a heading per kind, one
/// line per op.
pub fn blame_lines(b: &super::blame::BlameReport) -> Vec<String> {
    let mut out = Vec::new();
    if b.is_empty() {
        return out;
    }
    let steps: Vec<String> = b.steps.iter().map(u64::to_string).collect();
    out.push(format!(
        "Blame (every op of step {} against f64): most error introduced by the op's own \
         rounding and arithmetic:",
        steps.join(", ")
    ));
    for h in &b.introduced {
        out.push(format!(
            "  {} (step {} op #{}): introduces {:.2e}, inherits {:.2e}, total {:.2e}",
            h.label(),
            h.step,
            h.index,
            h.blame.introduced,
            h.blame.inherited,
            h.blame.total
        ));
    }
    let lost = |h: &&super::blame::BlameHit| h.op == "optimizer_step" && h.blame.introduced >= 0.5;
    if b.introduced.iter().any(|h| lost(&h)) {
        out.push(
            "  (an `optimizer_step` that introduces about 1 lost its update: the change it \
             should make is below half the spacing of the parameter's values, so each new \
             value rounds back to the old)"
                .into(),
        );
    }
    if !b.amplified.is_empty() {
        out.push("  most amplified (the error its inputs carry, magnified):".into());
        for h in &b.amplified {
            out.push(format!(
                "  {} (step {} op #{}): ×{:.3} ({:.2e} in, {:.2e} out)",
                h.label(),
                h.step,
                h.index,
                h.figure,
                h.blame.input,
                h.blame.inherited
            ));
        }
    }
    out
}

/// The headroom lines of each kind. In a run whose model ran in 16 bits its 16-bit ops are
/// the finding and its fp32 ops, which reach fp16's limits only if cast, one line after
/// them (or alone, under a line saying no 16-bit op came close); in a run with none (fp32)
/// the fp32 ops are the finding (the JSON has them all).
fn headroom_section(h: &HeadroomReport) -> Vec<String> {
    let mut out = Vec::new();
    let limit = h.thresholds.overflow_share;
    let under = h.thresholds.underflow_share * 100.0;
    for (kind, head, none) in [
        (
            HeadroomKind::NearOverflow,
            format!(
                "exceed {:.0}% of the fp16 maximum ({}): in fp16 they overflow or are close to it",
                limit * 100.0,
                limit * FP16.max
            ),
            format!(
                "exceeds {:.0}% of the fp16 maximum ({})",
                limit * 100.0,
                limit * FP16.max
            ),
        ),
        (
            HeadroomKind::Underflow,
            format!("would flush more than {under}% of their nonzero values to zero in fp16"),
            format!("would flush more than {under}% of its nonzero values to zero in fp16"),
        ),
    ] {
        let ws: Vec<&HeadroomWarning> = h.warnings.iter().filter(|w| w.kind == kind).collect();
        if ws.is_empty() {
            continue;
        }
        let (low, wide): (Vec<&HeadroomWarning>, Vec<&HeadroomWarning>) =
            ws.iter().partition(|w| w.low_precision());
        if !h.ran_16bit && low.is_empty() {
            out.push(format!("Headroom: {} ops {head}:", ws.len()));
            out.extend(headroom_lines(&ws, kind));
            continue;
        }
        if low.is_empty() {
            out.push(format!("Headroom: no op that ran in 16 bits {none}."));
        } else {
            out.push(format!(
                "Headroom: {} ops that ran in 16 bits {head}:",
                low.len()
            ));
            out.extend(headroom_lines(&low, kind));
        }
        if !wide.is_empty() {
            out.push(fp32_aside(&wide, !low.is_empty()));
        }
    }
    out
}

/// The one line for the fp32 ops of a run whose model ran in 16 bits: their op names,
/// each with its count.
fn fp32_aside(wide: &[&HeadroomWarning], after_16_bit: bool) -> String {
    let mut names: Vec<(String, usize)> = Vec::new();
    for w in wide {
        match names.iter_mut().find(|(n, _)| *n == w.op) {
            Some(e) => e.1 += 1,
            None => names.push((w.op.clone(), 1)),
        }
    }
    let list: Vec<String> = names
        .iter()
        .map(|(n, c)| {
            if *c > 1 {
                format!("`{n}` ×{c}")
            } else {
                format!("`{n}`")
            }
        })
        .collect();
    format!(
        "  {}{} fp32 ops, kept in fp32 by the precision mode, would do so only if cast: {} \
         (all in the summary JSON)",
        if after_16_bit { "and " } else { "" },
        wide.len(),
        list.join(", ")
    )
}

/// The whole diagnosis of a run in plain words: skip causes, collapse, headroom, blame,
/// remedies.
pub fn diagnosis_lines(s: &RunSummary) -> Vec<String> {
    let mut out = Vec::new();
    if let Some(r) = &s.ranks {
        out.extend(rank_lines(r));
    }
    // Skip causes, consecutive steps with the same cause and op together.
    let mut i = 0;
    let steps = &s.steps;
    while i < steps.len() {
        let Some(c) = steps[i].skip_cause.as_ref() else {
            i += 1;
            continue;
        };
        let mut j = i;
        while j + 1 < steps.len()
            && steps[j + 1]
                .skip_cause
                .as_ref()
                .is_some_and(|d| same_cause(c, d))
        {
            j += 1;
        }
        out.push(cause_sentence(steps[i].step, steps[j].step, c));
        i = j + 1;
    }
    if s.unclassified_skips > 0 {
        out.push(format!(
            "{} more skipped steps were not classified (raise --classify-limit).",
            s.unclassified_skips
        ));
    }
    if let Some(f) = &s.scale_collapse {
        out.push(format!("Step {}: {}.", f.step, f.sentence()));
    }
    out.extend(headroom_section(&s.headroom));
    out.extend(blame_lines(&s.blame));
    if let Some(r) = &s.remedies {
        out.extend(remedy_lines(r));
    }
    if s.diagnosis_replays > 0 {
        out.push(format!(
            "The diagnosis re-ran a step {} times.",
            s.diagnosis_replays
        ));
    }
    out
}
