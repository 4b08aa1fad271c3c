//! Overview panel: what runs and how, the verdict, the first Inf / first NaN card with the
//! chain between them, and the run's progress.

use super::format::{self, clip, num, pow2};
use super::panel::{Ctx, Panel, Reply, Scene, StepCursor};
use super::view_model::{Model, RunState, SourceKind};
use ratatui::buffer::Buffer;
use ratatui::crossterm::event::{KeyCode, KeyEvent};
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Borders, Paragraph, Widget, Wrap};
use serde_json::Value;

/// Most event lines the card shows at once (j/k scroll through the rest).
const MAX_EVENT_LINES: usize = 4;

/// State of the Overview panel: how far the events list is scrolled.
#[derive(Debug, Default)]
pub struct OverviewState {
    /// Events scrolled past.
    pub scroll: usize,
}

impl OverviewState {
    /// Handles a key of the Overview panel: j/k scroll the events.
    pub fn handle_key(&mut self, key: KeyEvent, model: &Model, _cursor: &mut StepCursor) -> Reply {
        let events = events(model).len();
        match key.code {
            KeyCode::Char('j') | KeyCode::Down => {
                self.scroll = (self.scroll + 1).min(events.saturating_sub(1))
            }
            KeyCode::Char('k') | KeyCode::Up => self.scroll = self.scroll.saturating_sub(1),
            _ => return Reply::Ignored,
        }
        Reply::Handled
    }
}

/// Every step's events, as `step N: text`.
fn events(model: &Model) -> Vec<String> {
    model
        .steps
        .iter()
        .flat_map(|s| {
            s.events
                .iter()
                .map(move |e| format!("step {}: {e}", s.step))
        })
        .collect()
}

/// `{"type": "default"}` or `"default"` → `default`.
fn kind(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("type").and_then(|t| t.as_str()).map(str::to_string),
        _ => None,
    }
}

/// The scaler configuration in one line: amprobe's own (`kind`, `enabled` and the figures),
/// or the PyTorch companion's, a GradScaler's figures without a `kind` (`init_scale`,
/// `growth_factor`, `backoff_factor`, `growth_interval`), null without an enabled scaler.
pub fn scaler_line(v: &Value) -> String {
    if v.is_null() || v.get("enabled").and_then(Value::as_bool) == Some(false) {
        return "off (no loss scaling)".into();
    }
    let f = |k: &str| v.get(k).and_then(Value::as_f64);
    let mut parts = Vec::new();
    match kind(v.get("kind")) {
        Some(k) => parts.push(k),
        None if f("init_scale").is_some() => parts.push("GradScaler".into()),
        None => {}
    }
    if let Some(s) = f("init_scale") {
        parts.push(format!("init {}", pow2(s)));
    }
    if let (Some(g), Some(i)) = (f("growth_factor"), f("growth_interval")) {
        parts.push(format!("×{} after {} clean steps", num(g), num(i)));
    }
    if let Some(b) = f("backoff_factor") {
        parts.push(format!("backoff ×{}", num(b)));
    }
    if parts.is_empty() {
        // A configuration of another shape: as the header gives it.
        return v.to_string();
    }
    parts.join(" · ")
}

/// The optimizer configuration in one line.
pub fn optimizer_line(v: &Value) -> String {
    let mut parts = vec![kind(v.get("kind")).unwrap_or_else(|| "?".into())];
    for (k, label) in [
        ("lr", "lr"),
        ("momentum", "momentum"),
        ("weight_decay", "wd"),
    ] {
        match v.get(k).and_then(Value::as_f64) {
            Some(x) if x != 0.0 || k == "lr" => parts.push(format!("{label} {}", num(x))),
            _ => {}
        }
    }
    parts.join(" · ")
}

/// Renders the Overview panel.
pub struct OverviewView<'a> {
    /// The panel's state.
    pub state: &'a OverviewState,
    /// Model, selected step, theme.
    pub ctx: Ctx<'a>,
}

impl OverviewView<'_> {
    fn block<'b>(&self, title: &'b str) -> Block<'b> {
        Block::default()
            .borders(Borders::ALL)
            .border_style(self.ctx.theme.dim())
            .title(Span::styled(title, self.ctx.theme.accent()))
    }

    fn run_lines(&self) -> Vec<Line<'static>> {
        let th = &self.ctx.theme;
        let kv = |k: &str, v: String| {
            Line::from(vec![
                Span::styled(format!(" {k:<10}"), th.dim()),
                Span::raw(v),
            ])
        };
        let Some(h) = &self.ctx.model.header else {
            return vec![Line::styled(" waiting for the run to start…", th.dim())];
        };
        vec![
            kv("model", h.model.clone()),
            kv(
                "precision",
                format!(
                    "{} · autocast {} · policy {}",
                    h.precision,
                    h.autocast_dtype
                        .map_or("off".to_string(), |d| d.name().to_string()),
                    h.policy_device
                ),
            ),
            kv("scaler", scaler_line(&h.scaler)),
            kv("optimizer", optimizer_line(&h.optimizer)),
            kv(
                "backend",
                match &h.device {
                    Some(d) => format!(
                        "{} on {d} · seed {} · {} {}",
                        h.backend, h.seed, h.tool, h.tool_version
                    ),
                    None => format!(
                        "{} · seed {} · {} {}",
                        h.backend, h.seed, h.tool, h.tool_version
                    ),
                },
            ),
        ]
    }

    fn status_lines(&self, width: usize) -> Vec<Line<'static>> {
        let th = &self.ctx.theme;
        let m = self.ctx.model;
        let (verdict, is_final) = m.verdict();
        let vstyle = if verdict == "clean" {
            th.good()
        } else {
            th.bad()
        };
        let mut lines = vec![Line::from(vec![
            Span::styled(" verdict   ", th.dim()),
            Span::styled(verdict.to_uppercase(), vstyle),
            Span::styled(if is_final { "" } else { "  (so far)" }, th.dim()),
        ])];
        let n = m.steps.len() as u64;
        let skipped = m.steps.iter().filter(|s| s.skipped).count();
        let total = m.expected_steps().filter(|&t| t >= n);
        let (state, sstyle) = match &m.state {
            RunState::Waiting => ("waiting".to_string(), th.dim()),
            RunState::Running if m.source == SourceKind::Follow => (
                "following the trace (no end record yet)".to_string(),
                th.accent(),
            ),
            RunState::Running => ("running".to_string(), th.accent()),
            RunState::Finished => ("finished".to_string(), th.good()),
            RunState::Incomplete => (
                "incomplete: no end record (killed, crashed or still running)".to_string(),
                th.warn(),
            ),
            RunState::Failed(e) => (format!("FAILED: {e}"), th.bad()),
        };
        let progress = match total {
            Some(t) if t > 0 => {
                let bar_w = 20usize;
                let filled = ((n as f64 / t as f64) * bar_w as f64).round() as usize;
                format!(
                    "{n}/{t} {}{} ",
                    "█".repeat(filled.min(bar_w)),
                    "░".repeat(bar_w - filled.min(bar_w))
                )
            }
            _ => format!("{n} "),
        };
        lines.push(Line::from(vec![
            Span::styled(" steps     ", th.dim()),
            Span::raw(progress),
            Span::styled(
                format!("{skipped} skipped"),
                if skipped > 0 { th.warn() } else { th.normal() },
            ),
            Span::raw(match m.steps.last() {
                Some(s) => format!(" · scale now {}", pow2(s.scale_after)),
                None => String::new(),
            }),
        ]));
        lines.push(Line::from(vec![
            Span::styled(" status    ", th.dim()),
            Span::styled(clip(&state, width.saturating_sub(11)), sstyle),
        ]));
        if let Some(t) = m.truncated {
            lines.push(Line::from(vec![
                Span::styled(" trace     ", th.dim()),
                Span::styled(
                    format!(
                        "cut mid-line: line {} ({} bytes) dropped, {} whole steps shown",
                        t.line,
                        t.bytes,
                        m.steps.len()
                    ),
                    th.warn(),
                ),
            ]));
        }
        lines
    }

    fn card_lines(&self, width: usize, rows: usize) -> Vec<Line<'static>> {
        let th = &self.ctx.theme;
        let m = self.ctx.model;
        let kv = |k: &str, v: String, style| {
            Line::from(vec![
                Span::styled(format!(" {k:<10}"), th.dim()),
                Span::styled(v, style),
            ])
        };
        let mut lines = Vec::new();
        if m.first_inf().is_none() && m.first_nan().is_none() {
            lines.push(Line::styled(
                if m.steps.is_empty() {
                    " no step yet"
                } else {
                    " no Inf or NaN appeared"
                },
                th.good(),
            ));
        }
        if let Some(o) = m.first_inf() {
            lines.push(kv("first Inf", format::op_ref(o), th.bad()));
        }
        if let Some(o) = m.first_nan() {
            lines.push(kv("first NaN", format::op_ref(o), th.bad()));
        }
        let chain = m.chain();
        if !chain.is_empty() {
            // Keep the chain to about three lines: its head and its tail.
            let names: Vec<String> = chain
                .iter()
                .map(|o| format::op_at(&o.op, &o.module))
                .collect();
            let budget = width.saturating_sub(12) * 3;
            let mut text = names.join(" → ");
            if format::width(&text) > budget && names.len() > 2 {
                let mut head = Vec::new();
                let mut used = 0;
                let tail = names.last().cloned().unwrap_or_default();
                for n in &names[..names.len() - 1] {
                    if used + n.len() + 3 + tail.len() + 16 > budget {
                        break;
                    }
                    used += n.len() + 3;
                    head.push(n.clone());
                }
                text = format!(
                    "{} → … {} more → {tail}",
                    head.join(" → "),
                    names.len() - 1 - head.len()
                );
            }
            lines.push(kv(
                "chain",
                format!("{text} ({} ops)", chain.len()),
                th.normal(),
            ));
        }
        if let Some(i) = m.steps.iter().position(|s| s.skipped) {
            let skipped = m.steps.iter().filter(|s| s.skipped).count();
            lines.push(kv(
                "skipped",
                format!(
                    "{skipped} of {} steps; first: step {} ({})",
                    m.steps.len(),
                    m.steps[i].step,
                    m.skip_cause(i).unwrap_or_default()
                ),
                th.warn(),
            ));
        }
        if m.first_nonfinite().is_some() {
            lines.push(Line::styled(
                " f: jump to the first non-finite op (Ops panel)",
                th.dim(),
            ));
        }
        let ev = events(m);
        if !ev.is_empty() {
            lines.push(Line::styled(
                format!(" events ({}, j/k scroll)", ev.len()),
                th.dim(),
            ));
            let room = rows.saturating_sub(lines.len()).clamp(1, MAX_EVENT_LINES);
            let start = self.state.scroll.min(ev.len().saturating_sub(1));
            for e in ev.iter().skip(start).take(room) {
                lines.push(Line::styled(
                    format!("  {}", clip(e, width.saturating_sub(3))),
                    th.warn(),
                ));
            }
        }
        lines
    }
}

impl OverviewView<'_> {
    /// Up to `rows - 1` steps around the selected one, one per line, under a header line.
    fn step_lines(&self, rows: usize) -> Vec<Line<'static>> {
        let th = &self.ctx.theme;
        let m = self.ctx.model;
        if rows < 2 || m.steps.is_empty() {
            return Vec::new();
        }
        // A window around the selected step (the newest when following a live run).
        let n = m.steps.len();
        let shown = (rows - 1).min(n);
        let sel = self.ctx.step.unwrap_or(n - 1);
        let start = sel.saturating_sub(shown / 2).min(n - shown);
        let end = start + shown;
        let mut lines = vec![Line::styled(
            format!(
                "  {:>6} {:>10} {:>17} {:>10}  outcome",
                "step", "loss", "scale", "grad norm"
            ),
            th.header(),
        )];
        for (i, s) in m.steps.iter().enumerate().take(end).skip(start) {
            let scale = format!("{}→{}", pow2(s.scale_before), pow2(s.scale_after));
            let (what, style) = match m.skip_cause(i) {
                Some(c) if s.skipped => (format!("skipped: {c}"), th.warn()),
                Some(c) => (c, th.bad()),
                None => ("applied".to_string(), th.normal()),
            };
            lines.push(Line::from(vec![
                Span::raw(format!(
                    "{} {:>6} {:>10} {:>17} {:>10}  ",
                    if Some(i) == self.ctx.step { "▸" } else { " " },
                    s.step,
                    s.loss.map_or("-".into(), num),
                    scale,
                    s.grad_norm.map_or("-".into(), num)
                )),
                Span::styled(what, style),
            ]));
        }
        lines
    }
}

impl Widget for OverviewView<'_> {
    fn render(self, area: Rect, buf: &mut Buffer) {
        let run = self.run_lines();
        let status = self.status_lines(area.width as usize);
        let card = if area.width >= 120 {
            let h = (run.len().max(status.len()) + 2) as u16;
            let [top, card] =
                Layout::vertical([Constraint::Length(h), Constraint::Min(3)]).areas(area);
            let [a, b] =
                Layout::horizontal([Constraint::Percentage(55), Constraint::Percentage(45)])
                    .areas(top);
            Paragraph::new(run)
                .block(self.block(" Run "))
                .render(a, buf);
            Paragraph::new(status.clone())
                .block(self.block(" Verdict "))
                .render(b, buf);
            card
        } else {
            let [a, b, card] = Layout::vertical([
                Constraint::Length(run.len() as u16 + 2),
                Constraint::Length(status.len() as u16 + 2),
                Constraint::Min(3),
            ])
            .areas(area);
            Paragraph::new(run)
                .block(self.block(" Run "))
                .render(a, buf);
            Paragraph::new(status)
                .block(self.block(" Verdict "))
                .render(b, buf);
            card
        };
        // The card takes what it needs; the recent steps get the rest when it is enough
        // for a few rows.
        let card_lines = self.card_lines(card.width.saturating_sub(2) as usize, usize::MAX);
        let need = card_lines.len() as u16 + 2;
        let (card_h, steps_h) = if card.height >= need + 4 {
            (need, card.height - need)
        } else {
            (card.height, 0)
        };
        let [card, steps] =
            Layout::vertical([Constraint::Length(card_h), Constraint::Length(steps_h)]).areas(card);
        Paragraph::new(card_lines)
            .block(self.block(" First non-finite "))
            .wrap(Wrap { trim: false })
            .render(card, buf);
        if steps_h > 0 {
            let block = self.block(" Steps ");
            let inner = block.inner(steps);
            let lines = self.step_lines(inner.height as usize);
            Paragraph::new(lines).block(block).render(steps, buf);
        }
    }
}

impl Panel for OverviewState {
    fn handle_key(&mut self, key: KeyEvent, scene: &Scene<'_>, cursor: &mut StepCursor) -> Reply {
        OverviewState::handle_key(self, key, scene.model, cursor)
    }

    fn render(&self, scene: &Scene<'_>, step: Option<usize>, area: Rect, buf: &mut Buffer) {
        OverviewView {
            state: self,
            ctx: scene.ctx(step),
        }
        .render(area, buf)
    }
}
