//! `amprobe report`: the charts of one trace, `summary.md` and a self-contained
//! `index.html`.

use super::charts::{
    loss_chart, render, scale_chart, scale_text, BlameChart, ExpHistChart, GradHeatmap, OpMaxChart,
    Rendered,
};
use super::doc::{Block, Doc};
use super::facts::{self, fmt_num, fmt_pct, Facts, HeadroomHit, HEADROOM_WARN};
use super::trace_file::TraceFile;
use crate::error::{Error, Result};
use crate::trace::io::Trace;
use crate::trace::record::{Header, StepRecord};
use std::path::{Path, PathBuf};

/// What to put in a report.
#[derive(Debug, Clone, Default)]
pub struct ReportOptions {
    /// Output folder (created if missing).
    pub out_dir: PathBuf,
    /// Step of the per-op chart; default: the first step with op records and a
    /// non-finite value, else the first step with op records.
    pub step: Option<u64>,
    /// The CI gate's outcomes, when the report is gated (`--fail-on`): a section of their
    /// own, with every finding of a broken drift rule.
    pub gate: Vec<super::gate::Outcome>,
}

/// What a report wrote and found.
#[derive(Debug, Clone)]
pub struct ReportOutput {
    /// `summary.md`.
    pub summary_md: PathBuf,
    /// `index.html`.
    pub index_html: PathBuf,
    /// The charts, in the order shown.
    pub charts: Vec<Rendered>,
    /// Step of the per-op chart and the histograms' step, if any step had op records.
    pub op_step: Option<u64>,
    /// The facts the summary states.
    pub facts: Facts,
}

/// The largest magnitude of a headroom hit: `inf` with its Inf count when the output
/// overflowed, else its largest finite |x|.
fn headroom_max(x: &HeadroomHit) -> String {
    if x.inf > 0 {
        format!("inf ({})", facts::plural(x.inf, "Inf value"))
    } else {
        fmt_num(x.max_abs)
    }
}

/// Most rows a long table shows before saying how many it left out.
const MAX_ROWS: usize = 40;

fn capped<T>(items: &[T], max: usize) -> (&[T], Option<String>) {
    if items.len() > max {
        (
            &items[..max],
            Some(format!("… and {} more not shown.", items.len() - max)),
        )
    } else {
        (items, None)
    }
}

/// Writes the charts, `summary.md` and `index.html` of `tf` into `opts.out_dir`.
pub fn write_report(tf: &TraceFile, opts: &ReportOptions) -> Result<ReportOutput> {
    let trace = &tf.trace;
    let dir = &opts.out_dir;
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let facts = Facts::new(trace, &tf.skip_causes);
    let op_step = op_step(tf, opts.step, &facts)?;
    let h = &trace.header;
    // Chart titles carry the model's short name (its first word) so they fit the image;
    // summary.md gives the whole description.
    let short = h.model.split_whitespace().next().unwrap_or("");
    let run = format!("{short} {}", h.precision);
    let mut charts = step_charts(trace, dir, &run, &facts)?;
    if let Some(s) = op_step {
        charts.extend(op_charts(trace, dir, &run, s)?);
    }
    charts.extend(blame_chart(trace, dir)?);
    let doc = build_doc(tf, &facts, op_step, &charts, &opts.gate);
    let summary_md = dir.join("summary.md");
    std::fs::write(&summary_md, doc.to_markdown()).map_err(|e| Error::io(&summary_md, e))?;
    let index_html = dir.join("index.html");
    let html = doc.to_html(dir)?;
    std::fs::write(&index_html, html).map_err(|e| Error::io(&index_html, e))?;
    Ok(ReportOutput {
        summary_md,
        index_html,
        charts: charts.into_iter().map(|c| c.0).collect(),
        op_step,
        facts,
    })
}

/// The step whose ops the report shows: `--step`, which must have op records, or the
/// default one.
fn op_step(tf: &TraceFile, step: Option<u64>, facts: &Facts) -> Result<Option<u64>> {
    let trace = &tf.trace;
    match step {
        Some(s) => {
            if !trace.steps.iter().any(|r| r.step == s && r.ops.is_some()) {
                return Err(Error::Invalid(format!(
                    "report --step {s}: that step has no op records in {} (steps with op \
                     records: {})",
                    tf.path.display(),
                    list_steps(&facts.steps_with_ops)
                )));
            }
            Ok(Some(s))
        }
        None => Ok(facts::default_step(&trace.steps)),
    }
}

/// A rendered chart and its caption.
type Chart = (Rendered, String);

/// The per-step charts: loss scale, loss, and the gradient heatmap where there are
/// parameter records.
fn step_charts(trace: &Trace, dir: &Path, run: &str, facts: &Facts) -> Result<Vec<Chart>> {
    let mut charts = Vec::new();
    let causes: Vec<(u64, String)> = facts
        .skipped
        .iter()
        .map(|(s, _, _, c)| (*s, c.clone()))
        .collect();
    charts.push((
        render(
            &scale_chart(
                &format!("Loss scale per step ({run})"),
                &trace.steps,
                &causes,
            ),
            dir,
            "scale",
        )?,
        "Loss scale per step (log2 axis); skipped steps marked by cause".to_string(),
    ));
    charts.push((
        render(
            &loss_chart(&format!("Loss per step ({run})"), &trace.steps),
            dir,
            "loss",
        )?,
        "Loss per step".to_string(),
    ));
    if trace.steps.iter().any(|s| !s.params.is_empty()) {
        charts.push((
            render(
                &GradHeatmap::from_steps(
                    &format!("Gradient magnitude per parameter ({run})"),
                    &trace.steps,
                ),
                dir,
                "grad_heatmap",
            )?,
            "log10 of the largest |unscaled gradient| per parameter and step, fp16 bands marked"
                .to_string(),
        ));
    }
    Ok(charts)
}

/// The op charts of step `s`, and the exponent histograms of every step with op records.
fn op_charts(trace: &Trace, dir: &Path, run: &str, s: u64) -> Result<Vec<Chart>> {
    let mut charts = Vec::new();
    if let Some(c) = OpMaxChart::for_step(trace, s) {
        charts.push((
            render(&c, dir, "ops")?,
            format!("Largest |output| of every op in step {s}, against fp16 and bf16 limits"),
        ));
    }
    let with_ops: Vec<_> = trace
        .steps
        .iter()
        .filter(|s| s.ops.is_some())
        .cloned()
        .collect();
    let n = with_ops.len();
    charts.push((
        render(
            &ExpHistChart::from_steps(
                &format!("Exponents of activation gradients ({run}, {n} step(s) with op records)"),
                "activation gradients as stored (scaled by the loss scale)",
                &with_ops,
                facts::is_activation_grad,
                true,
            ),
            dir,
            "hist_act_grads",
        )?,
        "Exponent histogram of activation gradients, fp16 ranges shaded".to_string(),
    ));
    charts.push((
        render(
            &ExpHistChart::from_steps(
                &format!("Exponents of activations ({run}, {n} step(s) with op records)"),
                "activations (forward op outputs)",
                &with_ops,
                facts::is_activation,
                false,
            ),
            dir,
            "hist_activations",
        )?,
        "Exponent histogram of activations, fp16 ranges shaded".to_string(),
    ));
    Ok(charts)
}

/// The blame chart of the first step with blame records, if any.
fn blame_chart(trace: &Trace, dir: &Path) -> Result<Option<Chart>> {
    let blamed = trace
        .steps
        .iter()
        .find(|s| s.ops.iter().flatten().any(|o| o.blame.is_some()))
        .map(|s| s.step);
    let Some(c) = blamed.and_then(|s| BlameChart::for_step(trace, s)) else {
        return Ok(None);
    };
    Ok(Some((
        render(&c, dir, "blame")?,
        format!(
            "Relative error of every op of step {} against f64: introduced by the op, and \
             in all",
            blamed.unwrap_or(0)
        ),
    )))
}

/// Step numbers as ranges: `0–4, 7, 9–10 (8 steps)`.
pub fn step_ranges(s: &[u64]) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut i = 0;
    while i < s.len() {
        let mut j = i;
        while j + 1 < s.len() && s[j + 1] == s[j] + 1 {
            j += 1;
        }
        parts.push(if j > i {
            format!("{}–{}", s[i], s[j])
        } else {
            s[i].to_string()
        });
        i = j + 1;
    }
    let total = parts.len();
    if total > 12 {
        parts.truncate(12);
        parts.push("…".into());
    }
    if s.len() > 1 {
        format!("{} ({} steps)", parts.join(", "), s.len())
    } else {
        parts.join(", ")
    }
}

fn list_steps(s: &[u64]) -> String {
    if s.is_empty() {
        return "none".into();
    }
    step_ranges(s)
}

fn file_name(p: &Path) -> String {
    p.file_name()
        .map(|f| f.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// The sentence about how complete the trace is; `None` for a finished, whole trace.
pub fn completeness(tf: &TraceFile) -> Option<String> {
    let t = &tf.trace;
    let n = t.steps.len();
    match (&t.truncated, &t.end) {
        (Some(c), _) => Some(format!(
            "The trace was cut: line {} holds only {} bytes of an unfinished record (the \
             run was killed or is still writing). This report covers the {n} finished \
             step(s).",
            c.line, c.bytes
        )),
        (None, None) => Some(format!(
            "The run did not finish (no end record): this report covers the {n} step(s) \
             written so far."
        )),
        (None, Some(_)) => None,
    }
}

fn build_doc(
    tf: &TraceFile,
    facts: &Facts,
    op_step: Option<u64>,
    charts: &[(Rendered, String)],
    gate: &[super::gate::Outcome],
) -> Doc {
    let t = &tf.trace;
    let h = &t.header;
    let steps = &t.steps;
    let mut d = Doc::new(format!("amprobe report: {} ({})", h.model, h.precision));
    d.push(Block::Para(format!(
        "Trace `{}`: {} step(s){}; written by {} {}.",
        tf.path.display(),
        steps.len(),
        match &t.end {
            Some(e) => format!(", run finished in {:.1} ms", e.wall_ms),
            None => String::new(),
        },
        h.tool,
        h.tool_version
    )));
    if let Some(w) = completeness(tf) {
        d.push(Block::Warning(w));
    }
    section_verdict(&mut d, facts);
    section_origins(&mut d, facts);
    section_skipped(&mut d, facts, steps);
    section_events(&mut d, facts);
    section_headroom(&mut d, facts);
    section_blame(&mut d, steps);
    section_remedies(&mut d, facts, h);
    section_charts(&mut d, facts, op_step, charts);
    section_parameters(&mut d, facts);
    section_gate(&mut d, gate);
    section_run(&mut d, h);
    d
}

/// The top offenders of precision loss, when the run blamed its ops (`--blame`).
fn section_blame(d: &mut Doc, steps: &[StepRecord]) {
    let mut t = crate::diagnose::blame::BlameTracker::default();
    for s in steps {
        if let Some(ops) = &s.ops {
            t.observe(s.step, ops);
        }
    }
    let r = t.report();
    if r.is_empty() {
        return;
    }
    d.push(Block::Heading(1, "Blame".into()));
    d.push(Block::Para(
        "Every op of the blamed steps (forward, backward and the optimizer phase's), \
         computed again in f64 from its own inputs (the error it introduces by its own rounding and arithmetic) and from an \
         all-f64 shadow of the step (the error its inputs carry in). Relative errors, ‖a − b‖₂ / ‖b‖₂; \
         the amplification is inherited / input, a norm-wise estimate of the op's condition \
         number."
            .into(),
    ));
    let cols = |first: &[&str]| -> Vec<String> {
        ["op", "module", "step, op"]
            .iter()
            .chain(first)
            .chain(&["inherited", "total"])
            .map(|c| c.to_string())
            .collect()
    };
    let row = |h: &crate::diagnose::blame::BlameHit, figs: Vec<String>| {
        let mut v = vec![
            h.op_label(),
            format!("`{}`", facts::module_name(&h.module)),
            format!("{} #{}", h.step, h.index),
        ];
        v.extend(figs);
        v.push(format!("{:.2e}", h.blame.inherited));
        v.push(format!("{:.2e}", h.blame.total));
        v
    };
    d.push(Block::Heading(2, "Most error introduced".into()));
    d.push(Block::Table(
        cols(&["introduced"]),
        r.introduced
            .iter()
            .map(|x| row(x, vec![format!("{:.2e}", x.blame.introduced)]))
            .collect(),
    ));
    if !r.amplified.is_empty() {
        d.push(Block::Heading(2, "Most amplified".into()));
        d.push(Block::Table(
            cols(&["amplification", "input"]),
            r.amplified
                .iter()
                .map(|x| {
                    row(
                        x,
                        vec![
                            format!("×{:.3}", x.figure),
                            format!("{:.2e}", x.blame.input),
                        ],
                    )
                })
                .collect(),
        ));
    }
}

/// The CI gate's rules and what each found; a broken rule's findings in full.
fn section_gate(d: &mut Doc, gate: &[super::gate::Outcome]) {
    if gate.is_empty() {
        return;
    }
    d.push(Block::Heading(1, "CI gate".into()));
    let broken = gate.iter().filter(|o| o.broken).count();
    d.push(Block::Para(if broken == 0 {
        format!("Every rule holds ({} rules).", gate.len())
    } else {
        format!("{broken} of {} rules broken.", gate.len())
    }));
    d.push(Block::List(
        gate.iter()
            .map(|o| format!("**{}** {}", if o.broken { "FAIL" } else { "ok" }, o.message))
            .collect(),
    ));
    for o in gate.iter().filter(|o| o.broken && !o.details.is_empty()) {
        d.push(Block::Heading(2, format!("{}: findings", o.rule)));
        d.push(Block::List(o.details.clone()));
    }
}

/// The verdict and what it means.
fn section_verdict(d: &mut Doc, facts: &Facts) {
    d.push(Block::Heading(1, "Verdict".into()));
    d.push(Block::Para(format!(
        "**{}**: {}",
        facts.verdict,
        facts::verdict_explanation(&facts.verdict)
    )));
}

/// Where Infs and NaNs first appeared, one row per distinct origin, and the chain between them.
fn section_origins(d: &mut Doc, facts: &Facts) {
    d.push(Block::Heading(1, "Origins".into()));
    if facts.origins.is_empty() {
        d.push(Block::Para("No op produced an Inf or NaN.".into()));
    } else {
        // The same origin usually repeats step after step: one row per distinct origin.
        let mut groups: Vec<(&str, &crate::trace::record::OpRef, Vec<u64>)> = Vec::new();
        for (k, o) in &facts.origins {
            match groups.iter_mut().find(|g| {
                g.0 == *k
                    && g.1.phase == o.phase
                    && g.1.op_index == o.op_index
                    && g.1.op == o.op
                    && g.1.module == o.module
            }) {
                Some(g) => g.2.push(o.step),
                None => groups.push((k, o, vec![o.step])),
            }
        }
        let (shown, more) = capped(&groups, MAX_ROWS);
        d.push(Block::Table(
            ["first", "phase", "op #", "op", "module", "steps"]
                .map(String::from)
                .to_vec(),
            shown
                .iter()
                .map(|(k, o, steps)| {
                    vec![
                        k.to_string(),
                        o.phase.name().into(),
                        o.op_index.to_string(),
                        format!("`{}`", o.op),
                        format!("`{}`", facts::module_name(&o.module)),
                        step_ranges(steps),
                    ]
                })
                .collect(),
        ));
        if let Some(m) = more {
            d.push(Block::Para(m));
        }
        if facts.chain.len() > 1 {
            let c: Vec<String> = facts
                .chain
                .iter()
                .map(|o| {
                    format!(
                        "`{}` in `{}` (#{})",
                        o.op,
                        facts::module_name(&o.module),
                        o.op_index
                    )
                })
                .collect();
            d.push(Block::Para(format!(
                "Chain in step {}: {}.",
                facts.chain[0].step,
                c.join(" → ")
            )));
        }
    }
}

/// The skipped steps with their scales and causes.
fn section_skipped(d: &mut Doc, facts: &Facts, steps: &[StepRecord]) {
    d.push(Block::Heading(1, "Skipped steps".into()));
    let n = steps.len().max(1);
    d.push(Block::Para(format!(
        "{} of {} step(s) skipped ({:.1}%).",
        facts.skipped.len(),
        steps.len(),
        facts.skipped.len() as f64 / n as f64 * 100.0
    )));
    if !facts.skipped.is_empty() {
        let (shown, more) = capped(&facts.skipped, MAX_ROWS);
        d.push(Block::Table(
            ["step", "scale before", "scale after", "cause"]
                .map(String::from)
                .to_vec(),
            shown
                .iter()
                .map(|(s, a, b, c)| vec![s.to_string(), scale_text(*a), scale_text(*b), c.clone()])
                .collect(),
        ));
        if let Some(m) = more {
            d.push(Block::Para(m));
        }
    }
}

/// The run's events.
fn section_events(d: &mut Doc, facts: &Facts) {
    d.push(Block::Heading(1, "Events".into()));
    if facts.events.is_empty() {
        d.push(Block::Para("None.".into()));
    } else {
        let (shown, more) = capped(&facts.events, MAX_ROWS);
        let mut items: Vec<String> = shown
            .iter()
            .map(|(s, e)| format!("step {s}: {e}"))
            .collect();
        items.extend(more);
        d.push(Block::List(items));
    }
}

/// The headroom table of `hits` (capped at [`MAX_ROWS`], the rest counted).
fn headroom_table(hits: &[HeadroomHit]) -> Vec<Block> {
    let (shown, more) = capped(hits, MAX_ROWS);
    let t = Block::Table(
        [
            "step",
            "op #",
            "op",
            "module",
            "dtype",
            "max |x|",
            "of fp16 max",
            "would overflow fp16",
        ]
        .map(String::from)
        .to_vec(),
        shown
            .iter()
            .map(|x| {
                vec![
                    x.op.step.to_string(),
                    x.op.op_index.to_string(),
                    format!("`{}`", x.op.op),
                    format!("`{}`", facts::module_name(&x.op.module)),
                    x.dtype.to_string(),
                    headroom_max(x),
                    fmt_pct(x.ratio),
                    x.f16_overflow.to_string(),
                ]
            })
            .collect(),
    );
    let mut blocks = vec![t];
    blocks.extend(more.map(Block::Para));
    blocks
}

/// Parameters whose gradient values fp16 flushes even after loss scaling.
fn section_grad_underflow(d: &mut Doc, facts: &Facts) {
    if !facts.underflow.is_empty() {
        d.push(Block::Para(
            "Parameters whose gradient values flush to zero in fp16 even after loss scaling \
             (worst step):"
                .into(),
        ));
        let (shown, more) = capped(&facts.underflow, MAX_ROWS);
        let mut items: Vec<String> = shown
            .iter()
            .map(|(n, f, s)| format!("`{n}`: {} at step {s}", fmt_pct(*f)))
            .collect();
        items.extend(more);
        d.push(Block::List(items));
    }
}

/// Forward ops close to fp16's limits, and gradients fp16 flushes even after scaling.
fn section_headroom(d: &mut Doc, facts: &Facts) {
    d.push(Block::Heading(1, "Headroom".into()));
    let checked = facts.steps_with_ops.len();
    let low = &facts.headroom;
    let wide = &facts.headroom_fp32;
    if low.is_empty() && wide.is_empty() {
        d.push(Block::Para(format!(
            "No forward op went above {} of fp16's max (65504) in the {checked} step(s) with \
             op records.",
            fmt_pct(HEADROOM_WARN)
        )));
    } else if !facts.ran_16bit {
        // An fp32 run: what would overflow if the ops ran in fp16 is the whole answer.
        d.push(Block::Para(format!(
            "No op ran in a 16-bit type; these fp32 forward ops would go above {} of fp16's \
             max (65504), or overflow it, if they ran in fp16 ({checked} step(s) with op \
             records, worst step of each op):",
            fmt_pct(HEADROOM_WARN)
        )));
        d.blocks_extend(headroom_table(low));
    } else {
        if low.is_empty() {
            d.push(Block::Para(format!(
                "No forward op that ran in a 16-bit type went above {} of fp16's max \
                 (65504) in the {checked} step(s) with op records.",
                fmt_pct(HEADROOM_WARN)
            )));
        } else {
            d.push(Block::Para(format!(
                "Forward ops that ran in a 16-bit type and went above {} of fp16's max \
                 (65504), or overflowed it, in the {checked} step(s) with op records (worst \
                 step of each op):",
                fmt_pct(HEADROOM_WARN)
            )));
            d.blocks_extend(headroom_table(low));
        }
        if !wide.is_empty() {
            d.push(Block::Details(
                format!(
                    "{} fp32 op(s) that the precision mode keeps in fp32 would overflow or \
                     come close to the fp16 max only if they were cast",
                    wide.len()
                ),
                headroom_table(wide),
            ));
        }
    }
    section_grad_underflow(d, facts);
}

/// What to try, for the run's precision.
fn section_remedies(d: &mut Doc, facts: &Facts, h: &Header) {
    d.push(Block::Heading(1, "Remedies".into()));
    d.push(Block::List(facts.remedies(&h.precision)));
}

/// The charts, with the step the per-op chart shows.
fn section_charts(d: &mut Doc, facts: &Facts, op_step: Option<u64>, charts: &[(Rendered, String)]) {
    d.push(Block::Heading(1, "Charts".into()));
    match op_step {
        Some(s) => d.push(Block::Para(format!(
            "The per-op chart shows step {s}; the histograms cover the steps with op \
             records: {}.",
            list_steps(&facts.steps_with_ops)
        ))),
        None => d.push(Block::Para(
            "No step has op records, so there is no per-op chart and no histogram.".into(),
        )),
    }
    for (r, caption) in charts {
        d.push(Block::Image {
            title: caption.clone(),
            png: file_name(&r.png),
            svg: file_name(&r.svg),
        });
    }
}

/// One row per parameter: gradient magnitudes, zeros, underflow, Inf/NaN steps.
fn section_parameters(d: &mut Doc, facts: &Facts) {
    d.push(Block::Heading(1, "Parameters".into()));
    if facts.params.is_empty() {
        d.push(Block::Para("No parameter records.".into()));
    } else {
        d.push(Block::Para(
            "Gradients are unscaled. \"Underflow\" is the worst share, over all steps, of a \
             parameter's nonzero gradient values that fp16 flushes to zero: unscaled, and \
             after multiplying by the loss scale."
                .into(),
        ));
        d.push(Block::Table(
            [
                "parameter",
                "dtype / grad",
                "numel",
                "max |g| last",
                "max |g| range",
                "‖g‖ last",
                "zeros last",
                "underflow unscaled",
                "underflow scaled",
                "Inf/NaN steps",
                "max |p| last",
            ]
            .map(String::from)
            .to_vec(),
            facts
                .params
                .iter()
                .map(|r| {
                    vec![
                        format!("`{}`", r.name),
                        format!(
                            "{} / {}",
                            r.dtype,
                            if r.grad_dtype.is_empty() {
                                "-"
                            } else {
                                &r.grad_dtype
                            }
                        ),
                        r.numel.to_string(),
                        fmt_num(r.last_max_abs_grad),
                        match r.min_max_abs_grad {
                            Some(m) => format!("{} … {}", fmt_num(m), fmt_num(r.max_max_abs_grad)),
                            None => "0".into(),
                        },
                        fmt_num(r.last_grad_l2),
                        fmt_pct(r.last_zero_frac),
                        fmt_pct(r.worst_underflow_unscaled),
                        fmt_pct(r.worst_underflow_scaled),
                        r.nonfinite_steps.to_string(),
                        fmt_num(r.last_param_max_abs),
                    ]
                })
                .collect(),
        ));
    }
}

/// How the run was configured.
fn section_run(d: &mut Doc, h: &Header) {
    d.push(Block::Heading(1, "Run".into()));
    let json = |v: &serde_json::Value| serde_json::to_string(v).unwrap_or_default();
    d.push(Block::List(vec![
        format!("model: `{}`", h.model),
        format!(
            "precision: `{}` (autocast dtype {}; policy table `{}`)",
            h.precision,
            h.autocast_dtype
                .map_or("none".to_string(), |d| d.to_string()),
            h.policy_device
        ),
        format!("scaler: `{}`", json(&h.scaler)),
        format!("optimizer: `{}`", json(&h.optimizer)),
        match h.device.as_deref() {
            Some(d) if d.contains("(simulated)") => format!(
                "backend: `{}` on {d} — a simulated device: it checks the CUDA path on a \
                 CPU; its results are not a GPU's; seed {}",
                h.backend, h.seed
            ),
            Some(d) => format!("backend: `{}` on {d}, seed {}", h.backend, h.seed),
            None => format!("backend: `{}`, seed {}", h.backend, h.seed),
        },
        format!("command line: `{}`", h.command_line.join(" ")),
    ]));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_of_steps() {
        assert_eq!(step_ranges(&[0, 1, 2, 3, 4]), "0–4 (5 steps)");
        assert_eq!(step_ranges(&[3]), "3");
        assert_eq!(step_ranges(&[0, 2, 3, 7]), "0, 2–3, 7 (4 steps)");
        let many: Vec<u64> = (0..40).map(|i| i * 2).collect();
        assert!(step_ranges(&many).ends_with(", … (40 steps)"));
    }
}
