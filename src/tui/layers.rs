//! Layers panel: each layer's largest gradient for the selected step as a bar on a log2
//! axis with fp16's flush and overflow thresholds drawn, the share of its values fp16
//! would flush to zero, and a sparkline of its history.

use super::format::{self, num, pad, pct, rpad};
use super::panel::{Ctx, Panel, Reply, Scene, StepCursor};
use super::scale::step_jump;
use super::view_model::{LayerStat, Model};
use ratatui::buffer::Buffer;
use ratatui::crossterm::event::{KeyCode, KeyEvent};
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::Style;
use ratatui::text::{Line, Span};
use ratatui::widgets::{Paragraph, Widget};
use std::cell::Cell;

/// log2 of the largest value fp16 flushes to zero: |x| ≤ 2^-25 rounds to 0.
pub const F16_FLUSH_LOG2: f64 = -25.0;
/// log2 of the smallest magnitude that overflows fp16: |x| ≥ 65520 rounds to inf.
pub fn f16_overflow_log2() -> f64 {
    65520f64.log2()
}

/// State of the Layers panel: the selected row and whether rows are layers (modules) or
/// single parameters.
#[derive(Debug, Default)]
pub struct LayersState {
    selected: usize,
    offset: Cell<usize>,
    /// One row per parameter instead of per module.
    pub by_param: bool,
}

impl LayersState {
    /// Row of the selected layer.
    pub fn selected(&self) -> usize {
        self.selected
    }

    /// Handles a key of the Layers panel: j/k move, p toggles layers / parameters,
    /// n / N jump between anomalous steps.
    pub fn handle_key(&mut self, key: KeyEvent, model: &Model, cursor: &mut StepCursor) -> Reply {
        let rows = cursor
            .idx
            .map_or(0, |i| model.layers(i, self.by_param).len());
        match key.code {
            KeyCode::Char('j') | KeyCode::Down => {
                self.selected = (self.selected + 1).min(rows.saturating_sub(1))
            }
            KeyCode::Char('k') | KeyCode::Up => self.selected = self.selected.saturating_sub(1),
            KeyCode::Char('g') => self.selected = 0,
            KeyCode::Char('G') => self.selected = rows.saturating_sub(1),
            KeyCode::Char('p') => {
                self.by_param = !self.by_param;
                self.selected = 0;
            }
            _ => return step_jump(key, model, cursor),
        }
        Reply::Handled
    }
}

/// Renders the Layers panel.
pub struct LayersView<'a> {
    /// The panel's state.
    pub state: &'a LayersState,
    /// Model, selected step, theme.
    pub ctx: Ctx<'a>,
}

/// Maps exponents to bar columns.
struct Axis {
    lo: f64,
    hi: f64,
    width: usize,
}

impl Axis {
    fn col(&self, e: f64) -> usize {
        let t = ((e - self.lo) / (self.hi - self.lo)).clamp(0.0, 1.0);
        (t * (self.width.saturating_sub(1)) as f64).round() as usize
    }
}

/// Groups consecutive characters of one style into spans.
fn spans(cells: Vec<(char, Style)>) -> Vec<Span<'static>> {
    let mut out: Vec<Span> = Vec::new();
    let mut cur = String::new();
    let mut style = Style::new();
    for (c, s) in cells {
        if s != style && !cur.is_empty() {
            out.push(Span::styled(std::mem::take(&mut cur), style));
        }
        style = s;
        cur.push(c);
    }
    if !cur.is_empty() {
        out.push(Span::styled(cur, style));
    }
    out
}

impl LayersView<'_> {
    fn bar(&self, l: &LayerStat, scale: f64, ax: &Axis) -> Vec<Span<'static>> {
        let th = self.ctx.theme;
        let mut cells: Vec<(char, Style)> = vec![(' ', th.normal()); ax.width];
        let thresholds = [ax.col(F16_FLUSH_LOG2), ax.col(f16_overflow_log2())];
        if l.nonfinite > 0 {
            let text = format!("{} non-finite", l.nonfinite);
            for (i, c) in text.chars().take(ax.width).enumerate() {
                cells[i] = (c, th.bad());
            }
        } else if l.max_abs_grad > 0.0 {
            let e = l.max_abs_grad.log2();
            let style = if l.underflow_scaled > 0.0 {
                th.warn()
            } else {
                th.series()
            };
            for cell in cells.iter_mut().take(ax.col(e) + 1) {
                *cell = ('█', style);
            }
        } else {
            cells[0] = ('0', th.dim());
        }
        // Thresholds stay visible inside a bar (a heavy line) and outside it (dashed).
        for c in thresholds {
            cells[c] = match cells[c].0 {
                '█' => ('┃', th.dim()),
                ' ' => ('┆', th.dim()),
                _ => cells[c],
            };
        }
        let scaled = l.max_abs_grad * scale;
        if l.nonfinite == 0 && scaled > 0.0 && scaled.is_finite() && scale != 1.0 {
            let c = ax.col(scaled.log2());
            let st = if scaled >= 65520.0 {
                th.bad()
            } else {
                th.accent()
            };
            cells[c] = ('◆', st);
        }
        spans(cells)
    }

    fn axis_line(&self, name_w: usize, ax: &Axis, cols: (usize, usize, usize)) -> Line<'static> {
        let mut label = vec![' '; ax.width + 8];
        let mut free = 0usize;
        let lo = ax.lo.ceil() as i32;
        let hi = ax.hi.floor() as i32;
        let span = (hi - lo).max(1) as usize;
        // Label every k-th exponent so that labels (about 6 cells) do not touch.
        let k = (span * 7).div_ceil(ax.width.max(1)).max(1) as i32;
        let k = [1, 2, 4, 5, 8, 10, 16, 20, 32, 50, 64, 100]
            .into_iter()
            .find(|&s| s >= k)
            .unwrap_or(k);
        let mut e = lo + (lo.rem_euclid(k) != 0) as i32 * (k - lo.rem_euclid(k));
        while e <= hi {
            let c = ax.col(e as f64);
            let t: Vec<char> = format::log2_label(e).chars().collect();
            if c >= free && c + t.len() <= ax.width {
                label[c..c + t.len()].copy_from_slice(&t);
                free = c + t.len() + 1;
            }
            e += k;
        }
        let label: String = label.into_iter().take(ax.width).collect();
        let (max_w, uf_w, hist_w) = cols;
        Line::from(vec![
            Span::raw(" ".repeat(name_w + 3)),
            Span::styled(label, self.ctx.theme.dim()),
            Span::styled(
                format!(
                    " {} {} {}",
                    rpad("max|g|", max_w),
                    rpad("uf→scaled", uf_w),
                    pad("history", hist_w)
                ),
                self.ctx.theme.header(),
            ),
        ])
    }
}

impl Widget for LayersView<'_> {
    fn render(self, area: Rect, buf: &mut Buffer) {
        let th = self.ctx.theme;
        let m = self.ctx.model;
        let st = self.state;
        let Some(si) = self.ctx.step else {
            Paragraph::new(Line::styled(m.no_step_note(), th.dim())).render(area, buf);
            return;
        };
        let step = &m.steps[si];
        let rows = m.layers(si, st.by_param);
        let [info, axis_area, body, legend] = Layout::vertical([
            Constraint::Length(1),
            Constraint::Length(1),
            Constraint::Min(1),
            Constraint::Length(1),
        ])
        .areas(area);
        let w = area.width as usize;
        let longest = rows
            .iter()
            .map(|r| format::width(&r.name))
            .max()
            .unwrap_or(4);
        let name_w = longest.clamp(6, (w / 4).max(6));
        let max_w = 8;
        let uf_w = 13;
        let hist_w = (w / 6).clamp(6, 40);
        let bar_w = w.saturating_sub(name_w + max_w + uf_w + hist_w + 6).max(10);
        // The axis spans the data (unscaled and scaled) and both fp16 thresholds.
        let scale = step.scale_before;
        let mut lo = F16_FLUSH_LOG2;
        let mut hi = f16_overflow_log2();
        for r in &rows {
            if r.max_abs_grad > 0.0 && r.max_abs_grad.is_finite() {
                lo = lo.min(r.max_abs_grad.log2());
                hi = hi.max(r.max_abs_grad.log2());
                let s = r.max_abs_grad * scale;
                if s > 0.0 && s.is_finite() {
                    lo = lo.min(s.log2());
                    hi = hi.max(s.log2());
                }
            }
        }
        let ax = Axis {
            lo: lo.floor() - 1.0,
            hi: hi.ceil() + 1.0,
            width: bar_w,
        };
        Paragraph::new(Line::from(vec![Span::raw(format!(
            " step {} · scale {} · {} {} · bar: max|g| unscaled, ◆ ×scale",
            step.step,
            format::pow2(scale),
            rows.len(),
            if st.by_param { "parameters" } else { "layers" }
        ))]))
        .render(info, buf);
        Paragraph::new(self.axis_line(name_w, &ax, (max_w, uf_w, hist_w))).render(axis_area, buf);
        let h = body.height as usize;
        let sel = st.selected.min(rows.len().saturating_sub(1));
        let mut off = st.offset.get();
        if sel < off {
            off = sel;
        } else if h > 0 && sel >= off + h {
            off = sel + 1 - h;
        }
        st.offset.set(off);
        let mut lines = Vec::new();
        for (i, r) in rows.iter().enumerate().skip(off).take(h) {
            let mut spans = vec![Span::raw(format!(
                "{} {} ",
                if i == sel { "▸" } else { " " },
                pad(&format::short_path(&r.name, name_w), name_w)
            ))];
            spans.extend(self.bar(r, scale, &ax));
            spans.push(Span::raw(format!(" {}", rpad(&num(r.max_abs_grad), max_w))));
            let uf = format!("{}→{}", pct(r.underflow_unscaled), pct(r.underflow_scaled));
            spans.push(Span::styled(
                format!(" {}", rpad(&uf, uf_w)),
                if r.underflow_scaled > 0.0 {
                    th.warn()
                } else {
                    th.normal()
                },
            ));
            let hist = m.layer_history(&r.name, st.by_param, si, hist_w);
            spans.push(Span::styled(
                format!(" {}", rpad(&format::sparkline(&hist), hist_w)),
                th.series2(),
            ));
            let mut line = Line::from(spans);
            if i == sel {
                line = line.patch_style(th.selected());
            }
            lines.push(line);
        }
        if rows.is_empty() {
            lines.push(Line::styled(
                " no parameter statistics in this step",
                th.dim(),
            ));
        }
        Paragraph::new(lines).render(body, buf);
        Paragraph::new(Line::styled(
            format!(
                " ┆ fp16 flush 2^-25, overflow 65520 · uf: share fp16 flushes · history {hist_w} steps · p: {}",
                if st.by_param { "by layer" } else { "by parameter" }
            ),
            th.dim(),
        ))
        .render(legend, buf);
    }
}

impl Panel for LayersState {
    fn handle_key(&mut self, key: KeyEvent, scene: &Scene<'_>, cursor: &mut StepCursor) -> Reply {
        LayersState::handle_key(self, key, scene.model, cursor)
    }

    fn render(&self, scene: &Scene<'_>, step: Option<usize>, area: Rect, buf: &mut Buffer) {
        LayersView {
            state: self,
            ctx: scene.ctx(step),
        }
        .render(area, buf)
    }
}
