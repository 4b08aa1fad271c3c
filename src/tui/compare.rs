//! Compare panel: the same step of two traces side by side, ops aligned by what they are
//! (phase, op, module, gradient input), differing ops highlighted.

use super::format::{self, clip, clip_left, num, pad, pow2, rpad};
use super::panel::{Ctx, Panel, Reply, Scene, StepCursor};
use super::view_model::{op_nonfinite, Model};
pub use crate::diagnose::align::{align, Pair};
use crate::diagnose::align::{rel_diff, scale_of, DEFAULT_THRESHOLD};
use crate::trace::record::{OpRecord, StepRecord};
use ratatui::buffer::Buffer;
use ratatui::crossterm::event::{KeyCode, KeyEvent};
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Paragraph, Widget};
use std::cell::Cell;

/// Why two aligned ops differ numerically, or `None` when they agree: non-finite counts,
/// rounding overflow or underflow present on one side only, or largest magnitudes (with the
/// loss scale divided out) further apart than the comparison report's threshold. Output
/// dtypes are shown but do not count: comparing precision modes they differ by design.
pub fn difference(a: &OpRecord, sa: &StepRecord, b: &OpRecord, sb: &StepRecord) -> Option<String> {
    let (na, nb) = (op_nonfinite(a), op_nonfinite(b));
    if na != nb {
        return Some(format!("non-finite {na} vs {nb}"));
    }
    if (a.rounding.overflow > 0) != (b.rounding.overflow > 0) {
        return Some(format!(
            "rounding overflow {} vs {}",
            a.rounding.overflow, b.rounding.overflow
        ));
    }
    if (a.rounding.underflow > 0) != (b.rounding.underflow > 0) {
        return Some(format!(
            "rounding underflow {} vs {}",
            a.rounding.underflow, b.rounding.underflow
        ));
    }
    let (x, y) = (
        a.stats.max_abs / scale_of(sa, a),
        b.stats.max_abs / scale_of(sb, b),
    );
    let rel = rel_diff(x, y);
    if rel > DEFAULT_THRESHOLD && x.is_finite() && y.is_finite() {
        return Some(format!(
            "max|x| {} vs {} ({:.1}% apart)",
            num(x),
            num(y),
            rel * 100.0
        ));
    }
    None
}

/// State of the Compare panel: the aligned rows of the selected step and the selection.
#[derive(Debug, Default)]
pub struct CompareState {
    selected: usize,
    offset: Cell<usize>,
    page: Cell<usize>,
    rows: Vec<Pair>,
    built_for: Option<(usize, usize, usize)>,
}

impl CompareState {
    /// The aligned rows of the selected step.
    pub fn rows(&self) -> &[Pair] {
        &self.rows
    }

    /// Row of the selection.
    pub fn selected(&self) -> usize {
        self.selected
    }

    /// The selected step of each side (B's with the same step number) and its ops.
    #[allow(clippy::type_complexity)]
    fn sides<'m>(
        a: &'m Model,
        b: &'m Model,
        step: Option<usize>,
    ) -> (
        Option<(&'m StepRecord, &'m [OpRecord])>,
        Option<(&'m StepRecord, &'m [OpRecord])>,
    ) {
        let Some(si) = step else { return (None, None) };
        let Some(sa) = a.steps.get(si) else {
            return (None, None);
        };
        let oa = a.ops(si).map(|o| (sa, o));
        let ob = b
            .step_index(sa.step)
            .and_then(|j| Some((b.steps.get(j)?, b.ops(j)?)));
        (oa, ob)
    }

    /// Re-aligns when the step or either side's ops changed.
    pub fn sync(&mut self, a: &Model, b: &Model, step: Option<usize>) {
        let (oa, ob) = Self::sides(a, b, step);
        let key = (
            step.unwrap_or(usize::MAX),
            oa.map_or(0, |(_, o)| o.len()),
            ob.map_or(0, |(_, o)| o.len()),
        );
        if self.built_for == Some(key) {
            return;
        }
        self.rows = match (oa, ob) {
            (Some((_, x)), Some((_, y))) => align(x, y),
            _ => Vec::new(),
        };
        self.selected = self.selected.min(self.rows.len().saturating_sub(1));
        self.built_for = Some(key);
    }

    fn differs(&self, a: &Model, b: &Model, step: Option<usize>, r: usize) -> bool {
        let (Some((sa, oa)), Some((sb, ob))) = Self::sides(a, b, step) else {
            return false;
        };
        match self.rows[r] {
            Pair {
                a: Some(i),
                b: Some(j),
            } => difference(&oa[i], sa, &ob[j], sb).is_some(),
            _ => false,
        }
    }

    /// Handles a key of the Compare panel: j/k move, n / N jump to the next / previous op
    /// present on both sides whose values differ.
    pub fn handle_key(
        &mut self,
        key: KeyEvent,
        a: &Model,
        b: Option<&Model>,
        cursor: &mut StepCursor,
    ) -> Reply {
        let Some(b) = b else { return Reply::Ignored };
        self.sync(a, b, cursor.idx);
        let last = self.rows.len().saturating_sub(1);
        let page = self.page.get().max(1);
        match key.code {
            KeyCode::Char('j') | KeyCode::Down => self.selected = (self.selected + 1).min(last),
            KeyCode::Char('k') | KeyCode::Up => self.selected = self.selected.saturating_sub(1),
            KeyCode::PageDown => self.selected = (self.selected + page).min(last),
            KeyCode::PageUp => self.selected = self.selected.saturating_sub(page),
            KeyCode::Char('g') => self.selected = 0,
            KeyCode::Char('G') => self.selected = last,
            KeyCode::Char('n') => {
                match (self.selected + 1..self.rows.len())
                    .find(|&r| self.differs(a, b, cursor.idx, r))
                {
                    Some(r) => self.selected = r,
                    None => return Reply::Message("no differing op after this one".into()),
                }
            }
            KeyCode::Char('N') => {
                match (0..self.selected)
                    .rev()
                    .find(|&r| self.differs(a, b, cursor.idx, r))
                {
                    Some(r) => self.selected = r,
                    None => return Reply::Message("no differing op before this one".into()),
                }
            }
            _ => return Reply::Ignored,
        }
        Reply::Handled
    }
}

/// Renders the Compare panel.
pub struct CompareView<'a> {
    /// The panel's state.
    pub state: &'a CompareState,
    /// Side A (the main trace or run), selected step, theme.
    pub ctx: Ctx<'a>,
    /// Side B.
    pub other: Option<&'a Model>,
}

impl CompareView<'_> {
    fn side_line(&self, tag: &str, m: &Model, step: Option<u64>, w: usize) -> Line<'static> {
        let th = self.ctx.theme;
        let prec = m
            .header
            .as_ref()
            .map_or("?".to_string(), |h| h.precision.clone());
        let s = step.and_then(|n| m.step_index(n)).map(|i| &m.steps[i]);
        let text = match s {
            Some(s) => format!(
                "{tag} {} ({prec}) · loss {} · scale {} · {}",
                clip_left(&m.label, 24),
                s.loss.map_or("-".into(), num),
                pow2(s.scale_before),
                if s.skipped { "SKIPPED" } else { "applied" }
            ),
            None => format!("{tag} {} ({prec}) · no such step", clip_left(&m.label, 24)),
        };
        let style = if s.is_some_and(|s| s.skipped) {
            th.warn()
        } else {
            th.normal()
        };
        Line::styled(clip(&text, w), style)
    }
}

/// Widths of the op and module columns for a panel `w` wide.
fn column_widths(w: usize) -> (usize, usize) {
    // mark #A ph op module │ dt max nf │ dt max nf
    let fixed = 2 + 5 + 3 + 4 + 9 + 5 + 4 + 9 + 5 + 12;
    let rest = w.saturating_sub(fixed);
    let op_w = (rest / 2).clamp(6, 22);
    (op_w, rest.saturating_sub(op_w).max(4))
}

fn header_text(op_w: usize, mod_w: usize) -> String {
    format!(
        "  {} {} {} {} │{} {} {} │{} {} {}",
        rpad("#A", 5),
        pad("ph", 3),
        pad("op", op_w),
        pad("module", mod_w),
        pad("A dt", 4),
        rpad("max|x|", 9),
        rpad("nonf", 5),
        pad("B dt", 4),
        rpad("max|x|", 9),
        rpad("nonf", 5)
    )
}

/// One side's dtype, largest magnitude and non-finite count, or blanks for a missing op.
fn side_cells(o: Option<&OpRecord>) -> String {
    match o {
        Some(o) => format!(
            "{} {} {}",
            pad(format::dtype(o.output.dtype), 4),
            rpad(&num(o.stats.max_abs), 9),
            rpad(&op_nonfinite(o).to_string(), 5)
        ),
        None => format!("{} {} {}", pad("", 4), rpad("—", 9), rpad("", 5)),
    }
}

/// The two steps compared, with their ops.
struct Sides<'m> {
    sa: &'m StepRecord,
    oa: &'m [OpRecord],
    sb: &'m StepRecord,
    ob: &'m [OpRecord],
}

/// How many aligned rows differ, or are on one side only.
#[derive(Default)]
struct Tally {
    differing: usize,
    only_a: usize,
    only_b: usize,
}

impl Tally {
    /// Why row `(xa, xb)` is marked, counted.
    fn reason(
        &mut self,
        sides: &Sides<'_>,
        xa: Option<&OpRecord>,
        xb: Option<&OpRecord>,
    ) -> Option<String> {
        match (xa, xb) {
            (Some(x), Some(y)) => {
                let d = difference(x, sides.sa, y, sides.sb);
                self.differing += d.is_some() as usize;
                d
            }
            (Some(_), None) => {
                self.only_a += 1;
                Some("only in A".to_string())
            }
            (None, Some(_)) => {
                self.only_b += 1;
                Some("only in B".to_string())
            }
            (None, None) => None,
        }
    }

    fn footer(&self, sel_reason: Option<String>) -> String {
        let Tally {
            differing,
            only_a,
            only_b,
        } = self;
        match sel_reason {
            Some(r) => format!(
                " ≠ {differing} differ (n/N) · < {only_a} only in A · > {only_b} only in B · ▸ {r}"
            ),
            None => {
                format!(" ≠ {differing} differ (n/N) · < {only_a} only in A · > {only_b} only in B")
            }
        }
    }
}

impl CompareView<'_> {
    fn render_no_second_trace(&self, area: Rect, buf: &mut Buffer) {
        let th = self.ctx.theme;
        Paragraph::new(vec![
            Line::raw(" Compare needs a second trace:"),
            Line::styled(
                "   amprobe tui --trace A.jsonl --compare B.jsonl",
                th.accent(),
            ),
            Line::styled(
                "   amprobe tui CONFIG [run flags] --compare B.jsonl",
                th.accent(),
            ),
        ])
        .render(area, buf);
    }

    /// The first visible row for a body `h` rows high, kept so the selection shows.
    fn scroll_to(&self, sel: usize, h: usize) -> usize {
        let st = self.state;
        st.page.set(h);
        let mut off = st.offset.get();
        if sel < off {
            off = sel;
        } else if h > 0 && sel >= off + h {
            off = sel + 1 - h;
        }
        st.offset.set(off);
        off
    }

    /// Row `r`'s line: ops `xa`/`xb` (at least one present), marked by `reason`.
    fn row_line(
        &self,
        r: usize,
        sel: usize,
        (xa, xb): (Option<&OpRecord>, Option<&OpRecord>),
        any: &OpRecord,
        reason: &Option<String>,
        (op_w, mod_w): (usize, usize),
    ) -> Line<'static> {
        let th = self.ctx.theme;
        let mark = match (xa, xb) {
            (Some(_), None) => "<",
            (None, Some(_)) => ">",
            _ if reason.is_some() => "≠",
            _ => " ",
        };
        let text = format!(
            "{} {} {} {} │{} │{}",
            rpad(&xa.map_or("".into(), |o| format!("#{}", o.index)), 5),
            pad(format::phase(any.phase), 3),
            pad(&clip(&any.op, op_w), op_w),
            pad(
                &format::short_path(format::module(&any.module), mod_w),
                mod_w
            ),
            side_cells(xa),
            side_cells(xb)
        );
        let nonfinite =
            xa.is_some_and(|o| op_nonfinite(o) > 0) || xb.is_some_and(|o| op_nonfinite(o) > 0);
        let style = if reason.is_none() {
            th.normal()
        } else if nonfinite {
            th.bad()
        } else {
            th.warn()
        };
        let mut line = Line::from(vec![
            Span::raw(if r == sel { "▸" } else { " " }),
            Span::styled(mark, style),
            Span::styled(text, style),
        ]);
        if r == sel {
            line = line.patch_style(th.selected());
        }
        line
    }

    /// The aligned rows into `body`, and the tally under them into `foot`.
    fn render_rows(&self, sides: &Sides<'_>, body: Rect, foot: Rect, w: usize, buf: &mut Buffer) {
        let th = self.ctx.theme;
        let st = self.state;
        let widths = column_widths(w);
        let h = (body.height as usize).saturating_sub(1);
        let sel = st.selected.min(st.rows.len().saturating_sub(1));
        let off = self.scroll_to(sel, h);
        let mut lines = vec![Line::styled(header_text(widths.0, widths.1), th.header())];
        let mut tally = Tally::default();
        let mut sel_reason = None;
        for (r, p) in st.rows.iter().enumerate() {
            let (xa, xb) = (p.a.map(|i| &sides.oa[i]), p.b.map(|j| &sides.ob[j]));
            let reason = tally.reason(sides, xa, xb);
            if r == sel {
                sel_reason = reason.clone();
            }
            if r < off || r >= off + h {
                continue;
            }
            let Some(any) = xa.or(xb) else { continue };
            lines.push(self.row_line(r, sel, (xa, xb), any, &reason, widths));
        }
        Paragraph::new(lines).render(body, buf);
        let foot_text = tally.footer(sel_reason);
        Paragraph::new(Line::styled(clip(&foot_text, w), th.dim())).render(foot, buf);
    }
}

impl Widget for CompareView<'_> {
    fn render(self, area: Rect, buf: &mut Buffer) {
        let th = self.ctx.theme;
        let a = self.ctx.model;
        let Some(b) = self.other else {
            self.render_no_second_trace(area, buf);
            return;
        };
        let w = area.width as usize;
        let step_no = self.ctx.step.and_then(|i| a.steps.get(i)).map(|s| s.step);
        let [ha, hb, body, foot] = Layout::vertical([
            Constraint::Length(1),
            Constraint::Length(1),
            Constraint::Min(1),
            Constraint::Length(1),
        ])
        .areas(area);
        Paragraph::new(self.side_line(" A", a, step_no, w)).render(ha, buf);
        Paragraph::new(self.side_line(" B", b, step_no, w)).render(hb, buf);
        let (oa, ob) = CompareState::sides(a, b, self.ctx.step);
        let (Some((sa, oa)), Some((sb, ob))) = (oa, ob) else {
            Paragraph::new(Line::styled(
                " op records missing on one side for this step (←/→ to another step)",
                th.dim(),
            ))
            .render(body, buf);
            return;
        };
        self.render_rows(&Sides { sa, oa, sb, ob }, body, foot, w, buf);
    }
}

impl Panel for CompareState {
    fn sync(&mut self, scene: &Scene<'_>, step: Option<usize>) {
        if let Some(o) = scene.other {
            CompareState::sync(self, scene.model, o, step);
        }
    }
    fn handle_key(&mut self, key: KeyEvent, scene: &Scene<'_>, cursor: &mut StepCursor) -> Reply {
        CompareState::handle_key(self, key, scene.model, scene.other, cursor)
    }

    fn render(&self, scene: &Scene<'_>, step: Option<usize>, area: Rect, buf: &mut Buffer) {
        CompareView {
            state: self,
            ctx: scene.ctx(step),
            other: scene.other,
        }
        .render(area, buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::record::Phase;
    use crate::tui::view_model::tests::op;

    #[test]
    fn differences_are_numeric_not_dtype() {
        let f = Phase::Forward;
        let st = StepRecord {
            scale_before: 1024.0,
            ..StepRecord::default()
        };
        let x = op(0, f, "linear", "fc1", &[1.0, 2.0]);
        let mut y = op(0, f, "linear", "fc1", &[1.0, 2.0]);
        y.output.dtype = crate::dtype::DType::F32;
        assert_eq!(difference(&x, &st, &y, &st), None);
        // 2.0 vs 2.09375: 4.5% apart, within the report's 5%.
        let y = op(0, f, "linear", "fc1", &[1.0, 2.09375]);
        assert_eq!(difference(&x, &st, &y, &st), None);
        let y = op(0, f, "linear", "fc1", &[1.0, 2.125]);
        assert!(difference(&x, &st, &y, &st).unwrap().starts_with("max|x|"));
        let y = op(0, f, "linear", "fc1", &[f32::NAN, 2.0]);
        assert_eq!(difference(&x, &st, &y, &st).unwrap(), "non-finite 0 vs 1");
        let zero = op(0, f, "linear", "fc1", &[0.0]);
        assert_eq!(difference(&zero, &st, &zero, &st), None);
        // A backward op carries its step's loss scale: 2048 at scale 1024 equals 2 unscaled.
        let b = Phase::Backward;
        let scaled = op(0, b, "linear", "fc1", &[2048.0]);
        let plain = op(0, b, "linear", "fc1", &[2.0]);
        let unscaled = StepRecord {
            scale_before: 1.0,
            ..StepRecord::default()
        };
        assert_eq!(difference(&scaled, &st, &plain, &unscaled), None);
        assert!(difference(&scaled, &unscaled, &plain, &unscaled).is_some());
    }
}
