//! Compare panel: the same step of two traces side by side, ops aligned by what they are
//! (phase, op, module, gradient input), differing ops highlighted.

use super::format::{self, clip, clip_left, num, pad, pow2, rpad};
use super::model::{op_nonfinite, Model};
use super::panel::{Ctx, Reply, StepCursor};
use crate::trace::record::OpRecord;
use ratatui::buffer::Buffer;
use ratatui::crossterm::event::{KeyCode, KeyEvent};
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Paragraph, Widget};
use std::cell::Cell;

/// Relative difference of two ops' largest output magnitudes above which they differ.
pub const MAX_ABS_REL_TOL: f64 = 1e-2;

/// Largest `len(a) × len(b)` aligned by longest common subsequence; longer steps are
/// paired by position.
const LCS_MAX_CELLS: usize = 4_000_000;

/// One row of the comparison: an op of A, of B, or of both.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pair {
    /// Position of the op in A's step.
    pub a: Option<usize>,
    /// Position of the op in B's step.
    pub b: Option<usize>,
}

fn same_kind(a: &OpRecord, b: &OpRecord) -> bool {
    a.phase == b.phase && a.op == b.op && a.module == b.module && a.wrt == b.wrt
}

/// Aligns two op lists: a longest common subsequence of ops of the same kind (phase, op
/// name, module, gradient input); the rest appear on one side only. Ops a precision mode
/// adds (casts) thus show as one-sided rows instead of shifting every later pair.
pub fn align(a: &[OpRecord], b: &[OpRecord]) -> Vec<Pair> {
    let (n, m) = (a.len(), b.len());
    if n.saturating_mul(m) > LCS_MAX_CELLS {
        return (0..n.max(m))
            .map(|i| Pair {
                a: (i < n).then_some(i),
                b: (i < m).then_some(i),
            })
            .collect();
    }
    // lcs[i][j]: length of the LCS of a[i..] and b[j..].
    let w = m + 1;
    let mut lcs = vec![0u32; (n + 1) * w];
    for i in (0..n).rev() {
        for j in (0..m).rev() {
            lcs[i * w + j] = if same_kind(&a[i], &b[j]) {
                lcs[(i + 1) * w + j + 1] + 1
            } else {
                lcs[(i + 1) * w + j].max(lcs[i * w + j + 1])
            };
        }
    }
    let (mut i, mut j) = (0, 0);
    let mut out = Vec::with_capacity(n.max(m));
    while i < n || j < m {
        if i < n && j < m && same_kind(&a[i], &b[j]) {
            out.push(Pair {
                a: Some(i),
                b: Some(j),
            });
            i += 1;
            j += 1;
        } else if j >= m || (i < n && lcs[(i + 1) * w + j] >= lcs[i * w + j + 1]) {
            out.push(Pair {
                a: Some(i),
                b: None,
            });
            i += 1;
        } else {
            out.push(Pair {
                a: None,
                b: Some(j),
            });
            j += 1;
        }
    }
    out
}

/// Why two aligned ops differ numerically, or `None` when they agree: non-finite counts,
/// rounding overflow or underflow present on one side only, or largest magnitudes more
/// than [`MAX_ABS_REL_TOL`] apart. Output dtypes are shown but do not count: comparing
/// precision modes they differ by design.
pub fn difference(a: &OpRecord, b: &OpRecord) -> Option<String> {
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
    let (x, y) = (a.stats.max_abs, b.stats.max_abs);
    let rel = (x - y).abs() / x.abs().max(y.abs());
    if rel > MAX_ABS_REL_TOL {
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

    fn sides<'m>(
        a: &'m Model,
        b: &'m Model,
        step: Option<usize>,
    ) -> (Option<&'m [OpRecord]>, Option<&'m [OpRecord]>) {
        let Some(si) = step else { return (None, None) };
        let oa = a.ops(si);
        let ob = a
            .steps
            .get(si)
            .and_then(|s| b.step_index(s.step))
            .and_then(|j| b.ops(j));
        (oa, ob)
    }

    /// Re-aligns when the step or either side's ops changed.
    pub fn sync(&mut self, a: &Model, b: &Model, step: Option<usize>) {
        let (oa, ob) = Self::sides(a, b, step);
        let key = (
            step.unwrap_or(usize::MAX),
            oa.map_or(0, <[_]>::len),
            ob.map_or(0, <[_]>::len),
        );
        if self.built_for == Some(key) {
            return;
        }
        self.rows = match (oa, ob) {
            (Some(x), Some(y)) => align(x, y),
            _ => Vec::new(),
        };
        self.selected = self.selected.min(self.rows.len().saturating_sub(1));
        self.built_for = Some(key);
    }

    fn differs(&self, a: &Model, b: &Model, step: Option<usize>, r: usize) -> bool {
        let (Some(oa), Some(ob)) = Self::sides(a, b, step) else {
            return false;
        };
        match self.rows[r] {
            Pair {
                a: Some(i),
                b: Some(j),
            } => difference(&oa[i], &ob[j]).is_some(),
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

impl Widget for CompareView<'_> {
    fn render(self, area: Rect, buf: &mut Buffer) {
        let th = self.ctx.theme;
        let a = self.ctx.model;
        let Some(b) = self.other else {
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
        let (Some(oa), Some(ob)) = (oa, ob) else {
            Paragraph::new(Line::styled(
                " op records missing on one side for this step (←/→ to another step)",
                th.dim(),
            ))
            .render(body, buf);
            return;
        };
        let st = self.state;
        // mark #A ph op module │ dt max nf │ dt max nf
        let fixed = 2 + 5 + 3 + 4 + 9 + 5 + 4 + 9 + 5 + 12;
        let rest = w.saturating_sub(fixed);
        let op_w = (rest / 2).clamp(6, 22);
        let mod_w = rest.saturating_sub(op_w).max(4);
        let header = format!(
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
        );
        let h = (body.height as usize).saturating_sub(1);
        st.page.set(h);
        let sel = st.selected.min(st.rows.len().saturating_sub(1));
        let mut off = st.offset.get();
        if sel < off {
            off = sel;
        } else if h > 0 && sel >= off + h {
            off = sel + 1 - h;
        }
        st.offset.set(off);
        let side = |o: Option<&OpRecord>| match o {
            Some(o) => format!(
                "{} {} {}",
                pad(format::dtype(o.output.dtype), 4),
                rpad(&num(o.stats.max_abs), 9),
                rpad(&op_nonfinite(o).to_string(), 5)
            ),
            None => format!("{} {} {}", pad("", 4), rpad("—", 9), rpad("", 5)),
        };
        let mut lines = vec![Line::styled(header, th.header())];
        let (mut differing, mut only_a, mut only_b) = (0, 0, 0);
        let mut sel_reason = None;
        for (r, p) in st.rows.iter().enumerate() {
            let (xa, xb) = (p.a.map(|i| &oa[i]), p.b.map(|j| &ob[j]));
            let reason = match (xa, xb) {
                (Some(x), Some(y)) => {
                    let d = difference(x, y);
                    differing += d.is_some() as usize;
                    d
                }
                (Some(_), None) => {
                    only_a += 1;
                    Some("only in A".to_string())
                }
                (None, Some(_)) => {
                    only_b += 1;
                    Some("only in B".to_string())
                }
                (None, None) => None,
            };
            if r == sel {
                sel_reason = reason.clone();
            }
            if r < off || r >= off + h {
                continue;
            }
            let Some(any) = xa.or(xb) else { continue };
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
                side(xa),
                side(xb)
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
            lines.push(line);
        }
        Paragraph::new(lines).render(body, buf);
        let foot_text = match sel_reason {
            Some(r) => format!(
                " ≠ {differing} differ (n/N) · < {only_a} only in A · > {only_b} only in B · ▸ {r}"
            ),
            None => {
                format!(" ≠ {differing} differ (n/N) · < {only_a} only in A · > {only_b} only in B")
            }
        };
        Paragraph::new(Line::styled(clip(&foot_text, w), th.dim())).render(foot, buf);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::record::Phase;
    use crate::tui::model::tests::op;

    #[test]
    fn alignment_pairs_same_ops_and_leaves_casts_one_sided() {
        let f = Phase::Forward;
        let a = vec![
            op(0, f, "to", "fc1", &[1.0]),
            op(1, f, "linear", "fc1", &[1.0]),
            op(2, f, "relu", "relu", &[1.0]),
            op(3, f, "to", "fc2", &[1.0]),
            op(4, f, "linear", "fc2", &[1.0]),
        ];
        let b = vec![
            op(0, f, "linear", "fc1", &[1.0]),
            op(1, f, "relu", "relu", &[1.0]),
            op(2, f, "linear", "fc2", &[1.0]),
            op(3, Phase::Backward, "linear", "fc2", &[1.0]),
        ];
        let p = |a: Option<usize>, b: Option<usize>| Pair { a, b };
        assert_eq!(
            align(&a, &b),
            vec![
                p(Some(0), None),
                p(Some(1), Some(0)),
                p(Some(2), Some(1)),
                p(Some(3), None),
                p(Some(4), Some(2)),
                p(None, Some(3)),
            ]
        );
        assert_eq!(align(&[], &b).len(), 4);
    }

    #[test]
    fn differences_are_numeric_not_dtype() {
        let f = Phase::Forward;
        let x = op(0, f, "linear", "fc1", &[1.0, 2.0]);
        let mut y = op(0, f, "linear", "fc1", &[1.0, 2.0]);
        y.output.dtype = crate::dtype::DType::F32;
        assert_eq!(difference(&x, &y), None);
        // 2.0 vs 2.015625 (fp16 neighbours 8 apart): 0.78% < 1%.
        let y = op(0, f, "linear", "fc1", &[1.0, 2.015625]);
        assert_eq!(difference(&x, &y), None);
        let y = op(0, f, "linear", "fc1", &[1.0, 2.03125]);
        assert!(difference(&x, &y).unwrap().starts_with("max|x|"));
        let y = op(0, f, "linear", "fc1", &[f32::NAN, 2.0]);
        assert_eq!(difference(&x, &y).unwrap(), "non-finite 0 vs 1");
        let zero = op(0, f, "linear", "fc1", &[0.0]);
        assert_eq!(difference(&zero, &zero), None);
    }
}
