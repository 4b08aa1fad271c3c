//! Ops panel: every op of the selected step in a scrollable table, a text filter, jumps
//! between anomalies and to the first non-finite op, and a details pane with the op's
//! output statistics and exponent histogram.

use super::format::{self, clip, num, pad, rpad};
use super::panel::{Ctx, Panel, Reply, Scene, StepCursor};
use super::theme::Theme;
use super::view_model::{is_anomaly, op_nonfinite, Model};
use crate::probe::tensor_stats::ExpHist;
use crate::trace::record::OpRecord;
use ratatui::buffer::Buffer;
use ratatui::crossterm::event::{KeyCode, KeyEvent};
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::Style;
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Borders, Paragraph, Widget};
use std::cell::Cell;

/// Below this width the details pane replaces the table instead of sitting beside it.
const SIDE_BY_SIDE_MIN_WIDTH: u16 = 120;

/// State of the Ops panel: the selected op, the filter, the details pane.
#[derive(Debug, Default)]
pub struct OpsState {
    /// Row (position in `rows`) of the selected op.
    selected: usize,
    /// First visible row, kept by the view so that the selection stays visible.
    offset: Cell<usize>,
    /// Visible rows at the last draw (for page up / down).
    page: Cell<usize>,
    filter: String,
    editing: bool,
    details: bool,
    /// Positions (in the step's op list) of the ops the filter lets through.
    rows: Vec<usize>,
    /// What `rows` was built for: step index, op count, filter.
    built_for: Option<(usize, usize, String)>,
}

/// True when every whitespace-separated word of `filter` occurs (ignoring case) in the op's
/// phase, name, module, output dtype or `#index`.
pub fn matches(op: &OpRecord, filter: &str) -> bool {
    if filter.trim().is_empty() {
        return true;
    }
    let hay = format!(
        "{} {:?} {} {} {} #{}",
        format::phase(op.phase),
        op.phase,
        op.op,
        op.module,
        format::dtype(op.output.dtype),
        op.index
    )
    .to_lowercase();
    filter
        .to_lowercase()
        .split_whitespace()
        .all(|w| hay.contains(w))
}

impl OpsState {
    /// The text filter.
    pub fn filter(&self) -> &str {
        &self.filter
    }

    /// True while the filter is being typed (keys go to it).
    pub fn editing(&self) -> bool {
        self.editing
    }

    /// True while the details pane is open.
    pub fn details_open(&self) -> bool {
        self.details
    }

    /// Position (in the step's op list) of the selected op.
    pub fn selected_position(&self) -> Option<usize> {
        self.rows.get(self.selected).copied()
    }

    /// The selected op of the step at `step`.
    pub fn selected_op<'m>(&self, model: &'m Model, step: Option<usize>) -> Option<&'m OpRecord> {
        model.ops(step?)?.get(self.selected_position()?)
    }

    /// Positions of the ops the filter lets through.
    pub fn rows(&self) -> &[usize] {
        &self.rows
    }

    /// Rebuilds the filtered rows when the step, its ops or the filter changed. A new step
    /// keeps the selection on the same op position when it exists.
    pub fn sync(&mut self, model: &Model, step: Option<usize>) {
        let ops = step.and_then(|s| model.ops(s)).unwrap_or(&[]);
        let key = (step.unwrap_or(usize::MAX), ops.len(), self.filter.clone());
        if self.built_for.as_ref() == Some(&key) {
            return;
        }
        let keep = self.selected_position();
        self.rows = (0..ops.len())
            .filter(|&i| matches(&ops[i], &self.filter))
            .collect();
        self.selected = keep
            .and_then(|p| self.rows.iter().position(|&r| r >= p))
            .unwrap_or(0)
            .min(self.rows.len().saturating_sub(1));
        self.built_for = Some(key);
    }

    /// Selects op position `pos` of step `step` (moving the cursor there), clearing a
    /// filter that would hide it.
    pub fn select(&mut self, model: &Model, cursor: &mut StepCursor, step: usize, pos: usize) {
        cursor.set(step);
        self.sync(model, Some(step));
        if !self.rows.contains(&pos) {
            self.filter.clear();
            self.sync(model, Some(step));
        }
        if let Some(r) = self.rows.iter().position(|&p| p == pos) {
            self.selected = r;
        }
    }

    fn move_by(&mut self, delta: isize) {
        if self.rows.is_empty() {
            return;
        }
        let last = self.rows.len() - 1;
        self.selected = (self.selected as isize + delta).clamp(0, last as isize) as usize;
    }

    /// The next (or previous) anomalous op after the selection, searching on into later
    /// (earlier) steps that kept their ops; only ops the filter lets through count.
    fn find_anomaly(&self, model: &Model, cur: usize, forward: bool) -> Option<(usize, usize)> {
        let in_step = |s: usize, from: Option<usize>| -> Option<usize> {
            let ops = model.ops(s)?;
            let ok = |&p: &usize| matches(&ops[p], &self.filter) && is_anomaly(&ops[p]);
            if forward {
                (from.map_or(0, |f| f + 1)..ops.len()).find(ok)
            } else {
                (0..from.unwrap_or(ops.len())).rev().find(ok)
            }
        };
        if let Some(p) = in_step(cur, self.selected_position()) {
            return Some((cur, p));
        }
        if forward {
            (cur + 1..model.steps.len()).find_map(|s| in_step(s, None).map(|p| (s, p)))
        } else {
            (0..cur)
                .rev()
                .find_map(|s| in_step(s, None).map(|p| (s, p)))
        }
    }

    /// Handles a key of the Ops panel.
    pub fn handle_key(&mut self, key: KeyEvent, model: &Model, cursor: &mut StepCursor) -> Reply {
        if self.editing {
            match key.code {
                KeyCode::Enter => self.editing = false,
                KeyCode::Esc => {
                    self.editing = false;
                    self.filter.clear();
                }
                KeyCode::Backspace => {
                    self.filter.pop();
                }
                KeyCode::Char(c) => self.filter.push(c),
                _ => return Reply::Ignored,
            }
            self.sync(model, cursor.idx);
            return Reply::Handled;
        }
        let page = self.page.get().max(1) as isize;
        match key.code {
            KeyCode::Char('j') | KeyCode::Down => self.move_by(1),
            KeyCode::Char('k') | KeyCode::Up => self.move_by(-1),
            KeyCode::PageDown => self.move_by(page),
            KeyCode::PageUp => self.move_by(-page),
            KeyCode::Char('g') => self.selected = 0,
            KeyCode::Char('G') => self.selected = self.rows.len().saturating_sub(1),
            KeyCode::Char('/') => {
                self.editing = true;
                self.details = false;
            }
            KeyCode::Enter => self.details = !self.details,
            KeyCode::Esc if self.details => self.details = false,
            KeyCode::Esc if !self.filter.is_empty() => {
                self.filter.clear();
                self.sync(model, cursor.idx);
            }
            KeyCode::Char('n') | KeyCode::Char('N') => {
                let forward = key.code == KeyCode::Char('n');
                let Some(cur) = cursor.idx else {
                    return Reply::Message("no step yet".into());
                };
                match self.find_anomaly(model, cur, forward) {
                    Some((s, p)) => self.select(model, cursor, s, p),
                    None => {
                        return Reply::Message(if forward {
                            "no anomalous op after this one".into()
                        } else {
                            "no anomalous op before this one".into()
                        })
                    }
                }
            }
            _ => return Reply::Ignored,
        }
        Reply::Handled
    }
}

/// Renders the Ops panel.
pub struct OpsView<'a> {
    /// The panel's state.
    pub state: &'a OpsState,
    /// Model, selected step, theme.
    pub ctx: Ctx<'a>,
}

/// A count in at most 5 characters (`12k`, `3.4M`).
fn count(n: u64) -> String {
    match n {
        0..=99_999 => n.to_string(),
        100_000..=9_999_999 => format!("{}k", n / 1000),
        _ => format!("{:.1}M", n as f64 / 1e6),
    }
}

/// Binades between an op's largest finite output magnitude and its dtype's largest finite
/// value; `None` when there is nothing to measure (all zero, non-float).
pub fn headroom(op: &OpRecord) -> Option<f64> {
    let max = op.output.dtype.format()?.max;
    (op.stats.max_abs > 0.0).then(|| (max / op.stats.max_abs).log2())
}

struct Cols {
    op: usize,
    module: usize,
    /// The step's ops were blamed (`--blame`): a column for the error each introduces.
    blame: bool,
}

impl Cols {
    // mark #idx ph op module dt max inf nan uf head
    const FIXED: usize = 2 + 5 + 3 + 4 + 9 + 5 + 5 + 5 + 6 + 10;
    // intro
    const BLAME: usize = 8;

    fn for_width(w: usize, blame: bool) -> Cols {
        let fixed = Self::FIXED + if blame { Self::BLAME } else { 0 };
        let rest = w.saturating_sub(fixed);
        let op = (rest / 2).clamp(6, 24);
        Cols {
            op,
            module: rest.saturating_sub(op).max(4),
            blame,
        }
    }
}

/// The relative error an op introduced, in 7 characters (`1.8e-03`); `-` when unblamed.
fn introduced(op: &OpRecord) -> String {
    match op.blame {
        Some(b) if b.introduced == 0.0 => "0".into(),
        Some(b) => format!("{:.1e}", b.introduced),
        None => "-".into(),
    }
}

impl OpsView<'_> {
    fn header(&self, c: &Cols) -> Line<'static> {
        let t = format!(
            "  {} {} {} {} {} {} {} {} {} {}",
            rpad("#", 5),
            pad("ph", 3),
            pad("op", c.op),
            pad("module", c.module),
            pad("dt", 4),
            rpad("max|x|", 9),
            rpad("inf", 5),
            rpad("nan", 5),
            rpad("uf", 5),
            rpad("head", 6)
        );
        let t = if c.blame {
            format!("{t} {}", rpad("intro", 7))
        } else {
            t
        };
        Line::styled(t, self.ctx.theme.header())
    }

    fn row(&self, op: &OpRecord, c: &Cols, selected: bool) -> Line<'static> {
        let th = &self.ctx.theme;
        let step = self.ctx.step.and_then(|s| self.ctx.model.steps.get(s));
        let origin =
            |o: Option<&crate::trace::record::OpRef>| o.is_some_and(|o| o.op_index == op.index);
        let (mark, mstyle) = match step.map(|s| &s.origins) {
            Some(o) if origin(o.first_inf.as_ref()) => ("I", th.bad()),
            Some(o) if origin(o.first_nan.as_ref()) => ("N", th.bad()),
            _ if is_anomaly(op) => ("!", th.bad()),
            _ if op.rounding.underflow > 0 => ("~", th.warn()),
            _ => (" ", th.normal()),
        };
        let inf = op.stats.pos_inf + op.stats.neg_inf.saturating_sub(op.masked_neg_inf);
        let head = match headroom(op) {
            _ if op.stats.has_inf() && inf > 0 => "ovf".to_string(),
            Some(h) => format!("{h:.1}"),
            None => "-".to_string(),
        };
        let text = format!(
            "{} {} {} {} {} {} {} {} {} {}",
            rpad(&format!("#{}", op.index), 5),
            pad(format::phase(op.phase), 3),
            pad(&clip(&op.op, c.op), c.op),
            pad(
                &format::short_path(format::module(&op.module), c.module),
                c.module
            ),
            pad(format::dtype(op.output.dtype), 4),
            // An output holding Inf has max |x| = inf (its Inf count is the next column).
            rpad(
                &if inf > 0 {
                    "inf".to_string()
                } else {
                    num(op.stats.max_abs)
                },
                9
            ),
            rpad(&count(inf), 5),
            rpad(&count(op.stats.nan), 5),
            rpad(&count(op.rounding.underflow), 5),
            rpad(&head, 6)
        );
        let text = if c.blame {
            format!("{text} {}", rpad(&introduced(op), 7))
        } else {
            text
        };
        let style = if op_nonfinite(op) > 0 || op.rounding.overflow > 0 {
            th.bad()
        } else if op.rounding.underflow > 0 {
            th.warn()
        } else {
            th.normal()
        };
        let mut line = Line::from(vec![
            Span::raw(if selected { "▸" } else { " " }),
            Span::styled(mark, mstyle),
            Span::styled(text, style),
        ]);
        if selected {
            line = line.patch_style(th.selected());
        }
        line
    }

    fn render_table(&self, area: Rect, buf: &mut Buffer, ops: &[OpRecord]) {
        let th = &self.ctx.theme;
        let st = self.state;
        let c = Cols::for_width(area.width as usize, ops.iter().any(|o| o.blame.is_some()));
        let h = (area.height as usize).saturating_sub(1);
        st.page.set(h);
        let mut lines = vec![self.header(&c)];
        let sel = st.selected;
        let mut off = st.offset.get();
        if sel < off {
            off = sel;
        } else if h > 0 && sel >= off + h {
            off = sel + 1 - h;
        }
        off = off.min(st.rows.len().saturating_sub(h.max(1)));
        st.offset.set(off);
        for (r, &p) in st.rows.iter().enumerate().skip(off).take(h) {
            lines.push(self.row(&ops[p], &c, r == sel));
        }
        if st.rows.is_empty() {
            lines.push(Line::styled(
                format!(" no op matches the filter \"{}\"", st.filter),
                th.dim(),
            ));
        }
        Paragraph::new(lines).render(area, buf);
    }

    fn render_details(&self, area: Rect, buf: &mut Buffer, ops: &[OpRecord], op: &OpRecord) {
        let th = &self.ctx.theme;
        let block = Block::default()
            .borders(Borders::ALL)
            .border_style(th.dim())
            .title(Span::styled(
                format!(
                    " op #{} · Enter/Esc closes · j/k next/previous op ",
                    op.index
                ),
                th.accent(),
            ));
        let inner = block.inner(area);
        block.render(area, buf);
        let mut lines = self.identity_lines(ops, op);
        lines.extend(self.value_lines(op, inner.width as usize));
        let used = lines.len() as u16;
        let [text, hist] =
            Layout::vertical([Constraint::Length(used), Constraint::Min(0)]).areas(inner);
        Paragraph::new(lines).render(text, buf);
        if hist.height >= 4 {
            let hl = histogram_lines(
                &op.stats.exp_hist,
                hist.width as usize,
                hist.height as usize - 1,
                th,
            );
            let mut all = vec![Line::styled(
                "exponent histogram of finite nonzero |x| (bar height ~ log count)",
                th.dim(),
            )];
            all.extend(hl);
            Paragraph::new(all).render(hist, buf);
        }
    }

    /// Which op this is: its phase, name and module, whether it is its step's first Inf or
    /// NaN, and the forward op it is a gradient of.
    fn identity_lines(&self, ops: &[OpRecord], op: &OpRecord) -> Vec<Line<'static>> {
        let th = &self.ctx.theme;
        let mut lines = vec![Line::from(vec![
            Span::styled(
                format!("{} {}", format::phase(op.phase), op.op),
                th.accent(),
            ),
            Span::raw(format!(" @ {}", format::module(&op.module))),
            Span::styled(format!("  micro {}", op.micro), th.dim()),
        ])];
        let step = self.ctx.step.and_then(|i| self.ctx.model.steps.get(i));
        let is =
            |o: Option<&crate::trace::record::OpRef>| o.is_some_and(|o| o.op_index == op.index);
        if let Some(st) = step {
            for (o, what) in [
                (st.origins.first_inf.as_ref(), "Inf"),
                (st.origins.first_nan.as_ref(), "NaN"),
            ] {
                if is(o) {
                    lines.push(Line::from(vec![
                        Span::styled(format!("{:<9}", "origin"), th.dim()),
                        Span::styled(
                            format!("first {what} of step {}: its inputs had none", st.step),
                            th.bad(),
                        ),
                    ]));
                }
            }
        }
        if let Some(f) = op.forward_op {
            let fwd = ops.iter().find(|o| o.index == f);
            let what = match fwd {
                Some(o) => format!(
                    "#{f} {} → {} max|x| {}",
                    o.op,
                    format::dtype(o.output.dtype),
                    num(o.stats.max_abs)
                ),
                None => format!("#{f}"),
            };
            let wrt = op.wrt.as_deref().unwrap_or("?");
            lines.push(detail_line(
                th,
                "grad of",
                format!("{wrt} of forward {what}"),
            ));
        }
        lines
    }

    /// What the op made, in lines `w` columns wide: its operands' shapes, its output's
    /// value counts, range and headroom, its own rounding, and what a cast to fp16 or bf16
    /// would do to it.
    fn value_lines(&self, op: &OpRecord, w: usize) -> Vec<Line<'static>> {
        let th = &self.ctx.theme;
        let s = &op.stats;
        let metas: Vec<String> = op
            .inputs
            .iter()
            .map(|m| format!("{}{:?}", format::dtype(m.dtype), m.shape))
            .collect();
        let mut lines = vec![detail_line(
            th,
            "inputs",
            clip(
                &format!("{} (statistics are kept for outputs)", metas.join(" ")),
                w.saturating_sub(9),
            ),
        )];
        lines.push(detail_line(
            th,
            "output",
            format!(
                "{}{:?}  numel {}",
                format::dtype(op.output.dtype),
                op.output.shape,
                s.numel
            ),
        ));
        let nf = op_nonfinite(op);
        lines.push(Line::from(vec![
            Span::styled(format!("{:<9}", "values"), th.dim()),
            Span::styled(
                format!("NaN {}  +inf {}  -inf {}", s.nan, s.pos_inf, s.neg_inf),
                if nf > 0 { th.bad() } else { th.normal() },
            ),
            Span::raw(format!("  zero {}  subnormal {}", s.zeros, s.subnormal)),
        ]));
        lines.push(detail_line(
            th,
            "range",
            format!(
                "max|x| {}  min|x|>0 {}  L2 {}  headroom {}",
                num(s.max_abs),
                s.min_abs_nonzero.map_or("-".into(), num),
                num(s.l2()),
                headroom(op).map_or("-".into(), |h| format!("{h:.1} binades"))
            ),
        ));
        lines.push(Line::from(vec![
            Span::styled(format!("{:<9}", "rounding"), th.dim()),
            Span::styled(
                format!(
                    "overflow {}  underflow {}",
                    op.rounding.overflow, op.rounding.underflow
                ),
                if op.rounding.overflow > 0 {
                    th.bad()
                } else if op.rounding.underflow > 0 {
                    th.warn()
                } else {
                    th.normal()
                },
            ),
            Span::raw(if op.masked_neg_inf > 0 {
                format!("  masked -inf {}", op.masked_neg_inf)
            } else {
                String::new()
            }),
        ]));
        lines.push(detail_line(
            th,
            "as fp16",
            format!(
                "overflow {}  underflow {}   as bf16: overflow {}  underflow {}",
                s.to_f16.overflow, s.to_f16.underflow, s.to_bf16.overflow, s.to_bf16.underflow
            ),
        ));
        if let Some(b) = op.blame {
            // (`run --blame`: the op against f64, and what it does to its inputs' error)
            let amp = b
                .amplification()
                .map_or(String::new(), |a| format!("  amplifies ×{a:.3}"));
            lines.push(detail_line(
                th,
                "vs f64",
                clip(
                    &format!(
                        "introduced {:.2e}  inherited {:.2e}  total {:.2e}  inputs {:.2e}{amp}",
                        b.introduced, b.inherited, b.total, b.input
                    ),
                    w.saturating_sub(9),
                ),
            ));
        }
        lines
    }
}

/// A line of the op details: a dim nine-column key, then its value.
fn detail_line(th: &Theme, k: &str, v: String) -> Line<'static> {
    Line::from(vec![
        Span::styled(format!("{k:<9}"), th.dim()),
        Span::raw(v),
    ])
}

/// fp16's limits in binades: values with `floor(log2|x|)` below -24 flush to zero (all of
/// them but the ones rounding up to 2^-24), -24..=-15 are subnormal, 16 and above overflow.
const F16_SUBNORMAL_LO: i32 = -24;
const F16_NORMAL_LO: i32 = -14;
const F16_OVERFLOW: i32 = 16;
/// Tallest histogram bar, in rows.
const HIST_MAX_ROWS: usize = 10;

/// Draws an exponent histogram in `width` columns and `height` rows: bars (height grows
/// with log2(1 + count)), a band row placing each column against fp16's range, tick labels
/// and a legend. The exponent range always includes fp16's subnormal and overflow edges.
pub fn histogram_lines(h: &ExpHist, width: usize, height: usize, th: &Theme) -> Vec<Line<'static>> {
    let (Some(dmin), Some(dmax)) = (h.min_exp(), h.max_exp()) else {
        return vec![Line::styled("  (no finite nonzero value)", th.dim())];
    };
    if width < 8 || height < 4 {
        return Vec::new();
    }
    let lo = dmin.min(F16_SUBNORMAL_LO - 1);
    let hi = dmax.max(F16_OVERFLOW);
    let span = (hi - lo + 1) as usize;
    let per = span.div_ceil(width); // binades per column
    let cols = span.div_ceil(per);
    let bins: Vec<u64> = (0..cols)
        .map(|c| {
            let e0 = lo + (c * per) as i32;
            (e0..e0 + per as i32).map(|e| h.get(e)).sum()
        })
        .collect();
    let bar_rows = (height - 3).min(HIST_MAX_ROWS);
    let top = bins.iter().copied().max().unwrap_or(0);
    let scale = |n: u64| -> usize {
        if n == 0 || top == 0 {
            0
        } else {
            let t = (1.0 + n as f64).log2() / (1.0 + top as f64).log2();
            ((t * (bar_rows * 8) as f64).round() as usize).max(1)
        }
    };
    let heights: Vec<usize> = bins.iter().map(|&n| scale(n)).collect();
    let band = |c: usize| {
        let e = lo + (c * per) as i32;
        if e + per as i32 - 1 < F16_SUBNORMAL_LO {
            '<'
        } else if e < F16_NORMAL_LO {
            's'
        } else if e >= F16_OVERFLOW {
            '>'
        } else {
            '─'
        }
    };
    let mut out = Vec::new();
    for r in (0..bar_rows).rev() {
        let row: String = heights
            .iter()
            .map(|&hgt| {
                let fill = hgt.saturating_sub(r * 8).min(8);
                if fill == 0 {
                    ' '
                } else {
                    ['▁', '▂', '▃', '▄', '▅', '▆', '▇', '█'][fill - 1]
                }
            })
            .collect();
        out.push(Line::styled(row, th.series()));
    }
    let band_row: Vec<Span> = (0..cols)
        .map(|c| {
            let ch = band(c);
            let style = match ch {
                '<' | '>' => th.bad(),
                's' => th.warn(),
                _ => th.dim(),
            };
            Span::styled(ch.to_string(), style)
        })
        .collect();
    out.push(Line::from(band_row));
    // Tick labels at the data's ends first, then fp16's edges and 2^0 where they fit.
    let mut label = vec![' '; cols + 8];
    let mut taken = vec![false; cols + 9];
    for t in [dmin, dmax, F16_SUBNORMAL_LO, F16_NORMAL_LO, F16_OVERFLOW, 0] {
        let c = ((t - lo) as usize) / per;
        let text: Vec<char> = format::log2_label(t).chars().collect();
        let end = c + text.len();
        let lo_guard = c.saturating_sub(1);
        if end <= label.len() && !taken[lo_guard..=end].iter().any(|&b| b) {
            label[c..end].copy_from_slice(&text);
            taken[c..end].iter_mut().for_each(|b| *b = true);
        }
    }
    let label: String = label.into_iter().collect();
    out.push(Line::styled(clip(label.trim_end(), width), th.dim()));
    out.push(Line::styled(
        clip(
            &format!(
                "{}fp16: < flushes to 0, s subnormal, ─ normal, > overflows",
                if per > 1 {
                    format!("{per} binades/column · ")
                } else {
                    String::new()
                }
            ),
            width,
        ),
        th.dim(),
    ));
    out
}

impl Widget for OpsView<'_> {
    fn render(self, area: Rect, buf: &mut Buffer) {
        let th = self.ctx.theme;
        let m = self.ctx.model;
        let st = self.state;
        let Some(si) = self.ctx.step else {
            Paragraph::new(Line::styled(m.no_step_note(), th.dim())).render(area, buf);
            return;
        };
        let step = &m.steps[si];
        let [info, body, foot] = Layout::vertical([
            Constraint::Length(1),
            Constraint::Min(1),
            Constraint::Length(1),
        ])
        .areas(area);
        let Some(ops) = m.ops(si) else {
            let kept: Vec<String> = m
                .steps
                .iter()
                .filter(|s| s.ops.is_some())
                .map(|s| s.step.to_string())
                .take(12)
                .collect();
            let lines = vec![
                Line::styled(
                    format!(
                        " step {}: {} ops ran; their records were not kept (sampled steps and \
                         steps with a non-finite value keep them)",
                        step.step, step.op_count
                    ),
                    th.normal(),
                ),
                Line::styled(
                    format!(
                        " steps with op records: {} · ←/→ or n to move",
                        if kept.is_empty() {
                            "none".into()
                        } else {
                            kept.join(", ")
                        }
                    ),
                    th.dim(),
                ),
            ];
            Paragraph::new(lines)
                .wrap(ratatui::widgets::Wrap { trim: false })
                .render(body, buf);
            return;
        };
        let anomalies = ops.iter().filter(|o| is_anomaly(o)).count();
        let info_text = format!(
            " step {} · {} ops{} · {} anomalous (n/N) · f: first non-finite",
            step.step,
            ops.len(),
            if st.filter.is_empty() {
                String::new()
            } else {
                format!(" · {} match", st.rows.len())
            },
            anomalies
        );
        Paragraph::new(Line::styled(
            clip(&info_text, area.width as usize),
            th.dim(),
        ))
        .render(info, buf);
        let sel = st.selected_position().and_then(|p| ops.get(p));
        match (st.details, sel) {
            (true, Some(op)) if area.width >= SIDE_BY_SIDE_MIN_WIDTH => {
                let [t, d] =
                    Layout::horizontal([Constraint::Percentage(55), Constraint::Percentage(45)])
                        .areas(body);
                self.render_table(t, buf, ops);
                self.render_details(d, buf, ops, op);
            }
            (true, Some(op)) => self.render_details(body, buf, ops, op),
            _ => self.render_table(body, buf, ops),
        }
        let foot_line = if st.editing {
            Line::from(vec![
                Span::styled(" filter: ", th.accent()),
                Span::raw(format!("{}▏", st.filter)),
                Span::styled("  Enter keeps · Esc clears", th.dim()),
            ])
        } else if !st.filter.is_empty() {
            Line::from(vec![
                Span::styled(" filter: ", th.dim()),
                Span::raw(st.filter.clone()),
                Span::styled("  / edit · Esc clears", th.dim()),
            ])
        } else {
            Line::styled(
                " I/N first Inf/NaN · ! non-finite/overflow · ~ underflow · / filter · ⏎ details",
                th.dim(),
            )
        };
        Paragraph::new(foot_line)
            .style(Style::new())
            .render(foot, buf);
    }
}

impl Panel for OpsState {
    fn sync(&mut self, scene: &Scene<'_>, step: Option<usize>) {
        OpsState::sync(self, scene.model, step);
    }
    fn handle_key(&mut self, key: KeyEvent, scene: &Scene<'_>, cursor: &mut StepCursor) -> Reply {
        OpsState::sync(self, scene.model, cursor.idx);
        OpsState::handle_key(self, key, scene.model, cursor)
    }

    fn render(&self, scene: &Scene<'_>, step: Option<usize>, area: Rect, buf: &mut Buffer) {
        OpsView {
            state: self,
            ctx: scene.ctx(step),
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
    fn histogram_places_values_against_fp16_range() {
        // 2^-30 (flushes in fp16), 2^-20 (subnormal), 100 × 0.5, 2^17 (overflows).
        let mut v = vec![0.5f32; 100];
        v.extend([2f32.powi(-30), 2f32.powi(-20), 2f32.powi(17)]);
        let s = crate::probe::TensorStats::compute(crate::dtype::DType::F32, &v);
        let lines = histogram_lines(&s.exp_hist, 80, 8, &Theme::plain());
        let text: Vec<String> = lines.iter().map(|l| l.to_string()).collect();
        // 5 bar rows, the band, the labels, the legend.
        assert_eq!(text.len(), 8);
        let lo = -30; // the data's lowest exponent, below fp16's edge
        let band: Vec<char> = text[5].chars().collect();
        let at = |e: i32| band[(e - lo) as usize];
        assert_eq!(
            (
                at(-30),
                at(-25),
                at(-24),
                at(-15),
                at(-14),
                at(15),
                at(16),
                at(17)
            ),
            ('<', '<', 's', 's', '─', '─', '>', '>')
        );
        let col = |e: i32| (e - lo) as usize;
        let top: Vec<char> = text[0].chars().collect();
        let bottom: Vec<char> = text[4].chars().collect();
        // 100 values at 2^-1 fill the column; single values reach the bottom rows only.
        assert_eq!(top[col(-1)], '█');
        assert_eq!(top[col(-20)], ' ');
        for e in [-30, -20, 17] {
            assert_ne!(bottom[col(e)], ' ', "exponent {e}");
        }
        assert_eq!(bottom[col(-5)], ' ');
        assert!(text[6].contains("2^-30") && text[6].contains("2^17"));
        // Narrow: several binades per column, said in the legend.
        let narrow = histogram_lines(&s.exp_hist, 20, 8, &Theme::plain());
        // 48 binades (2^-30 to 2^17) in 20 columns: 3 per column.
        assert!(narrow[7].to_string().starts_with("3 binades/column"));
    }

    #[test]
    fn headroom_in_binades_of_the_output_dtype() {
        let o = op(0, Phase::Forward, "linear", "fc", &[1.0, -0.5]);
        assert!((headroom(&o).unwrap() - 65504f64.log2()).abs() < 1e-12);
        let z = op(0, Phase::Forward, "linear", "fc", &[0.0]);
        assert_eq!(headroom(&z), None);
    }

    #[test]
    fn filter_words_all_match() {
        let o = op(
            12,
            Phase::Backward,
            "matmul_backward",
            "encoder.block.3.layer.0.SelfAttention.q",
            &[1.0],
        );
        assert!(matches(&o, ""));
        assert!(matches(&o, "bwd selfattention"));
        assert!(matches(&o, "MATMUL q f16"));
        assert!(matches(&o, "#12"));
        assert!(!matches(&o, "fwd selfattention"));
    }
}
