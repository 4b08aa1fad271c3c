//! Scale panel: the loss-scale history on a log2 axis with skipped steps marked, the
//! causes of the skips, and the loss curve beneath.

use super::format::{self, clip, num, pow2};
use super::panel::{Ctx, Panel, Reply, Scene, StepCursor};
use super::view_model::{step_is_anomaly, Model};
use ratatui::buffer::Buffer;
use ratatui::crossterm::event::{KeyCode, KeyEvent};
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::symbols::Marker;
use ratatui::text::{Line, Span};
use ratatui::widgets::{Axis, Block, Borders, Chart, Dataset, GraphType, Paragraph, Widget};

/// State of the Scale panel (it has no data of its own beyond the shared step cursor).
#[derive(Debug, Default)]
pub struct ScaleState;

/// The next (`forward`) or previous anomalous step from `cur` (skipped, non-finite
/// gradients or loss, an origin).
pub fn anomalous_step(model: &Model, cur: Option<usize>, forward: bool) -> Option<usize> {
    let n = model.steps.len();
    if forward {
        let from = cur.map_or(0, |c| c + 1);
        (from..n).find(|&i| step_is_anomaly(&model.steps[i]))
    } else {
        (0..cur.unwrap_or(n))
            .rev()
            .find(|&i| step_is_anomaly(&model.steps[i]))
    }
}

/// n / N: moves the cursor to the next / previous anomalous step.
pub fn step_jump(key: KeyEvent, model: &Model, cursor: &mut StepCursor) -> Reply {
    let forward = match key.code {
        KeyCode::Char('n') => true,
        KeyCode::Char('N') => false,
        _ => return Reply::Ignored,
    };
    match anomalous_step(model, cursor.idx, forward) {
        Some(i) => {
            cursor.set(i);
            Reply::Handled
        }
        None => Reply::Message(format!(
            "no anomalous step {} this one",
            if forward { "after" } else { "before" }
        )),
    }
}

impl ScaleState {
    /// Handles a key of the Scale panel: n / N jump between anomalous steps.
    pub fn handle_key(&mut self, key: KeyEvent, model: &Model, cursor: &mut StepCursor) -> Reply {
        step_jump(key, model, cursor)
    }
}

/// Keeps at most `max` points of a series by taking, for each run of consecutive points,
/// the lowest and the highest in step order (so spikes survive).
pub fn downsample(points: &[(f64, f64)], max: usize) -> Vec<(f64, f64)> {
    if points.len() <= max || max < 4 {
        return points.to_vec();
    }
    let per = points.len().div_ceil(max / 2);
    let mut out = Vec::with_capacity(max);
    for chunk in points.chunks(per) {
        let lo = chunk
            .iter()
            .copied()
            .fold(chunk[0], |a, b| if b.1 < a.1 { b } else { a });
        let hi = chunk
            .iter()
            .copied()
            .fold(chunk[0], |a, b| if b.1 > a.1 { b } else { a });
        if lo.0 <= hi.0 {
            out.push(lo);
            if hi != lo {
                out.push(hi);
            }
        } else {
            out.push(hi);
            out.push(lo);
        }
    }
    out
}

/// `0-5, 9, 11-12`: step numbers as ranges.
pub fn ranges(steps: &[u64]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < steps.len() {
        let mut j = i;
        while j + 1 < steps.len() && steps[j + 1] == steps[j] + 1 {
            j += 1;
        }
        out.push(if j > i {
            format!("{}-{}", steps[i], steps[j])
        } else {
            steps[i].to_string()
        });
        i = j + 1;
    }
    out.join(", ")
}

/// Renders the Scale panel.
pub struct ScaleView<'a> {
    /// The panel's state.
    pub state: &'a ScaleState,
    /// Model, selected step, theme.
    pub ctx: Ctx<'a>,
}

impl ScaleView<'_> {
    fn x_axis(&self, lo: f64, hi: f64) -> Axis<'static> {
        let mid = ((lo + hi) / 2.0).round();
        let mut labels = vec![Span::raw(format!("{lo}"))];
        if mid > lo && mid < hi {
            labels.push(Span::raw(format!("{mid}")));
        }
        labels.push(Span::raw(format!("{hi}")));
        Axis::default()
            .bounds([lo, hi])
            .labels(labels)
            .style(self.ctx.theme.dim())
    }

    fn selected_line(&self, y0: f64, y1: f64) -> Vec<(f64, f64)> {
        match self.ctx.step.and_then(|i| self.ctx.model.steps.get(i)) {
            Some(s) => vec![(s.step as f64, y0), (s.step as f64, y1)],
            None => Vec::new(),
        }
    }

    fn scale_chart(&self, area: Rect, buf: &mut Buffer, xb: (f64, f64)) {
        let th = self.ctx.theme;
        let m = self.ctx.model;
        let pts: Vec<(f64, f64)> = m
            .steps
            .iter()
            .filter(|s| s.scale_before > 0.0 && s.scale_before.is_finite())
            .map(|s| (s.step as f64, s.scale_before.log2()))
            .collect();
        let skipped: Vec<(f64, f64)> = m
            .steps
            .iter()
            .filter(|s| s.skipped && s.scale_before > 0.0 && s.scale_before.is_finite())
            .map(|s| (s.step as f64, s.scale_before.log2()))
            .collect();
        let (ymin, ymax) = pts
            .iter()
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), p| {
                (a.min(p.1), b.max(p.1))
            });
        let ticks_wanted = (area.height as usize / 3).clamp(2, 6);
        let (lo, hi, ticks) = format::log2_ticks(ymin, ymax, ticks_wanted);
        let width = area.width as usize * 2;
        let line = downsample(&pts, width);
        let marks = downsample(&skipped, width);
        let sel = self.selected_line(lo as f64, hi as f64);
        let unplotted = m.steps.len() - pts.len();
        let title = format!(
            " loss scale (log2){} · • skipped step ",
            if unplotted > 0 {
                format!(" · {unplotted} zero/non-finite scales not drawn")
            } else {
                String::new()
            }
        );
        let datasets = vec![
            Dataset::default()
                .name("scale")
                .marker(Marker::Braille)
                .graph_type(GraphType::Line)
                .style(th.series())
                .data(&line),
            Dataset::default()
                .marker(Marker::Braille)
                .graph_type(GraphType::Line)
                .style(th.dim())
                .data(&sel),
            Dataset::default()
                .name("skipped")
                .marker(Marker::Dot)
                .graph_type(GraphType::Scatter)
                .style(th.bad())
                .data(&marks),
        ];
        let chart = Chart::new(datasets)
            .block(
                Block::default()
                    .borders(Borders::ALL)
                    .border_style(th.dim())
                    .title(Span::styled(title, th.accent())),
            )
            .x_axis(self.x_axis(xb.0, xb.1))
            .y_axis(
                Axis::default()
                    .bounds([lo as f64, hi as f64])
                    .labels(ticks.into_iter().map(|k| Span::raw(format::log2_label(k))))
                    .style(th.dim()),
            )
            .legend_position(None);
        chart.render(area, buf);
    }

    fn loss_chart(&self, area: Rect, buf: &mut Buffer, xb: (f64, f64)) {
        let th = self.ctx.theme;
        let m = self.ctx.model;
        let pts: Vec<(f64, f64)> = m
            .steps
            .iter()
            .filter_map(|s| Some((s.step as f64, s.loss.filter(|l| l.is_finite())?)))
            .collect();
        let (mut lo, mut hi) = pts
            .iter()
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), p| {
                (a.min(p.1), b.max(p.1))
            });
        if !lo.is_finite() {
            (lo, hi) = (0.0, 1.0);
        }
        if hi - lo < 1e-12 * hi.abs().max(1.0) {
            let pad = lo.abs().max(1.0) * 1e-3;
            lo -= pad;
            hi += pad;
        }
        let bad: Vec<(f64, f64)> = m
            .steps
            .iter()
            .filter(|s| s.loss.is_some_and(|l| !l.is_finite()))
            .map(|s| (s.step as f64, hi))
            .collect();
        let width = area.width as usize * 2;
        let line = downsample(&pts, width);
        let sel = self.selected_line(lo, hi);
        let title = format!(
            " loss{} ",
            if bad.is_empty() {
                String::new()
            } else {
                format!(" · • at the top: {} non-finite", bad.len())
            }
        );
        let datasets = vec![
            Dataset::default()
                .marker(Marker::Braille)
                .graph_type(GraphType::Line)
                .style(th.series2())
                .data(&line),
            Dataset::default()
                .marker(Marker::Braille)
                .graph_type(GraphType::Line)
                .style(th.dim())
                .data(&sel),
            Dataset::default()
                .marker(Marker::Dot)
                .graph_type(GraphType::Scatter)
                .style(th.bad())
                .data(&bad),
        ];
        Chart::new(datasets)
            .block(
                Block::default()
                    .borders(Borders::ALL)
                    .border_style(th.dim())
                    .title(Span::styled(title, th.accent())),
            )
            .x_axis(self.x_axis(xb.0, xb.1))
            .y_axis(
                Axis::default()
                    .bounds([lo, hi])
                    .labels([Span::raw(num(lo)), Span::raw(num(hi))])
                    .style(th.dim()),
            )
            .legend_position(None)
            .render(area, buf);
    }

    /// Skipped steps grouped by cause, the most frequent causes first.
    fn causes(&self) -> Vec<(String, Vec<u64>)> {
        let m = self.ctx.model;
        let mut groups: Vec<(String, Vec<u64>)> = Vec::new();
        for (i, s) in m.steps.iter().enumerate() {
            if let Some(c) = m.skip_cause(i) {
                match groups.iter_mut().find(|g| g.0 == c) {
                    Some(g) => g.1.push(s.step),
                    None => groups.push((c, vec![s.step])),
                }
            }
        }
        groups.sort_by_key(|g| std::cmp::Reverse(g.1.len()));
        groups
    }
}

impl Widget for ScaleView<'_> {
    fn render(self, area: Rect, buf: &mut Buffer) {
        let th = self.ctx.theme;
        let m = self.ctx.model;
        let Some(si) = self.ctx.step else {
            Paragraph::new(Line::styled(m.no_step_note(), th.dim())).render(area, buf);
            return;
        };
        let s = &m.steps[si];
        let causes = self.causes();
        let cause_rows = causes.len().clamp(1, 4) as u16;
        let [info, top, bottom, why] = Layout::vertical([
            Constraint::Length(1),
            Constraint::Percentage(60),
            Constraint::Min(5),
            Constraint::Length(cause_rows),
        ])
        .areas(area);
        let mut spans = vec![Span::raw(format!(
            " step {} · scale {} → {} · loss {} · ",
            s.step,
            pow2(s.scale_before),
            pow2(s.scale_after),
            s.loss.map_or("-".into(), num)
        ))];
        match m.skip_cause(si) {
            Some(c) if s.skipped => spans.push(Span::styled(format!("SKIPPED: {c}"), th.bad())),
            Some(c) => spans.push(Span::styled(c, th.warn())),
            None => spans.push(Span::styled("applied", th.good())),
        }
        Paragraph::new(Line::from(spans)).render(info, buf);
        let first = m.steps.first().map_or(0.0, |s| s.step as f64);
        let last = m.steps.last().map_or(1.0, |s| s.step as f64);
        let xb = (first, last.max(first + 1.0));
        self.scale_chart(top, buf, xb);
        self.loss_chart(bottom, buf, xb);
        let w = why.width as usize;
        let lines: Vec<Line> = if causes.is_empty() {
            vec![Line::styled(" no skipped step", th.good())]
        } else {
            let n = causes.len();
            causes
                .into_iter()
                .take(cause_rows as usize)
                .enumerate()
                .map(|(i, (c, steps))| {
                    let more = if i + 1 == cause_rows as usize && n > cause_rows as usize {
                        format!(" (+{} other causes)", n - cause_rows as usize)
                    } else {
                        String::new()
                    };
                    Line::from(vec![
                        Span::styled(
                            format!(
                                " {} step{}: ",
                                steps.len(),
                                if steps.len() == 1 { "" } else { "s" }
                            ),
                            th.warn(),
                        ),
                        Span::raw(clip(
                            &format!("{c} · steps {}{more}", ranges(&steps)),
                            w.saturating_sub(14),
                        )),
                    ])
                })
                .collect()
        };
        Paragraph::new(lines).render(why, buf);
    }
}

impl Panel for ScaleState {
    fn handle_key(&mut self, key: KeyEvent, scene: &Scene<'_>, cursor: &mut StepCursor) -> Reply {
        ScaleState::handle_key(self, key, scene.model, cursor)
    }

    fn render(&self, scene: &Scene<'_>, step: Option<usize>, area: Rect, buf: &mut Buffer) {
        ScaleView {
            state: self,
            ctx: scene.ctx(step),
        }
        .render(area, buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_ranges() {
        assert_eq!(ranges(&[0, 1, 2, 3, 5, 9, 10]), "0-3, 5, 9-10");
        assert_eq!(ranges(&[7]), "7");
        assert_eq!(ranges(&[]), "");
    }

    #[test]
    fn downsampling_keeps_spikes_and_order() {
        let pts: Vec<(f64, f64)> = (0..1000)
            .map(|i| {
                (
                    i as f64,
                    if i == 501 {
                        40.0
                    } else if i == 777 {
                        -9.0
                    } else {
                        16.0
                    },
                )
            })
            .collect();
        let d = downsample(&pts, 100);
        assert!(d.len() <= 100, "{}", d.len());
        assert!(d.contains(&(501.0, 40.0)) && d.contains(&(777.0, -9.0)));
        assert!(d.windows(2).all(|w| w[0].0 < w[1].0));
        assert_eq!(downsample(&pts[..10], 100), pts[..10].to_vec());
    }
}
