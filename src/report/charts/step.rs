//! The step charts: loss scale and loss over the steps, with marks for skipped and failing steps.

use super::canvas::*;

/// One line of a per-step chart.
#[derive(Debug, Clone)]
pub struct StepSeries {
    /// Legend text.
    pub label: String,
    /// Line colour.
    pub color: RGBColor,
    /// `(step, value)`; non-finite values leave a gap.
    pub points: Vec<(u64, f64)>,
    /// Draw as a staircase (a value holds over its whole step) instead of a polyline
    /// through the step centres.
    pub staircase: bool,
}

/// A group of markers on a per-step chart (e.g. skipped steps with one cause).
#[derive(Debug, Clone)]
pub struct MarkGroup {
    /// Legend text.
    pub label: String,
    /// Marker.
    pub symbol: Symbol,
    /// `(step, value)`. A value of NaN or +inf is drawn at the top edge, -inf at the
    /// bottom edge.
    pub points: Vec<(u64, f64)>,
}

/// Values over steps: loss, loss scale (log2 axis), overlays of several runs.
#[derive(Debug, Clone)]
pub struct StepChart {
    /// Title.
    pub title: String,
    /// Y axis description.
    pub y_desc: String,
    /// Plot log2 of the values with `2^k` labels.
    pub log2: bool,
    /// Lines.
    pub series: Vec<StepSeries>,
    /// Markers.
    pub marks: Vec<MarkGroup>,
}

impl StepChart {
    fn y(&self, v: f64) -> f64 {
        if self.log2 {
            if v > 0.0 {
                v.log2()
            } else if v == 0.0 {
                f64::NEG_INFINITY
            } else {
                f64::NAN
            }
        } else {
            v
        }
    }

    fn legend(&self) -> Legend {
        let mut l = Legend::default();
        for s in &self.series {
            l.0.push((Symbol::Line(s.color), s.label.clone()));
        }
        for m in &self.marks {
            l.0.push((m.symbol, m.label.clone()));
        }
        l
    }

    fn x_range(&self) -> (f64, f64) {
        let steps = self
            .series
            .iter()
            .flat_map(|s| s.points.iter().map(|p| p.0))
            .chain(self.marks.iter().flat_map(|m| m.points.iter().map(|p| p.0)));
        let (lo, hi) = steps.fold((u64::MAX, 0), |(a, b), s| (a.min(s), b.max(s)));
        if lo > hi {
            (-0.5, 0.5)
        } else {
            (lo as f64 - 0.5, hi as f64 + 0.5)
        }
    }
}

impl Chart for StepChart {
    fn size(&self) -> (u32, u32) {
        (1000, 480 + self.legend().height())
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult<DB> {
        let legend = self.legend();
        let (_, h) = root.dim_in_pixel();
        let (top, bottom) = root.split_vertically(h - legend.height());
        let (x0, x1) = self.x_range();
        let ys: Vec<f64> = self
            .series
            .iter()
            .flat_map(|s| s.points.iter().map(|p| self.y(p.1)))
            .chain(
                self.marks
                    .iter()
                    .flat_map(|m| m.points.iter().map(|p| self.y(p.1))),
            )
            .filter(|v| v.is_finite())
            .collect();
        let lo = ys.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = ys.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let (y0, y1) = if self.log2 {
            let (a, b) = padded(lo.floor(), hi.ceil(), 0.0, 2.0);
            (a - 1.0, b + 1.0)
        } else {
            padded(lo, hi, 0.08, hi.abs().max(1e-6) * 1e-3)
        };
        let mut chart = ChartBuilder::on(&top)
            .caption(&self.title, title_style())
            .margin(12)
            .x_label_area_size(50)
            .y_label_area_size(80)
            .build_cartesian_2d(x0..x1, y0..y1)?;
        let nx = ((x1 - x0).round() as usize).min(12);
        let ny = if self.log2 {
            ((y1 - y0).round() as usize + 1).min(12)
        } else {
            8
        };
        let log2 = self.log2;
        chart
            .configure_mesh()
            .x_desc("step")
            .y_desc(self.y_desc.as_str())
            .axis_desc_style(text(16))
            .bold_line_style(C_GRID_BOLD)
            .light_line_style(C_GRID_LIGHT)
            .label_style(text(13))
            .x_labels(nx)
            .y_labels(ny)
            .x_label_formatter(&|v| step_label(*v))
            .y_label_formatter(&|v| {
                if log2 {
                    pow_label("2", *v)
                } else {
                    fmt_num(*v)
                }
            })
            .draw()?;
        let n_series = self.series.len();
        for (si, s) in self.series.iter().enumerate() {
            // Runs that coincide stay visible: earlier lines are drawn wider, underneath.
            let width = 2 + 2 * (n_series - 1 - si) as u32;
            // Split the line at non-finite values.
            let mut runs: Vec<Vec<(f64, f64)>> = vec![Vec::new()];
            for &(st, v) in &s.points {
                let y = self.y(v);
                if !y.is_finite() {
                    runs.push(Vec::new());
                    continue;
                }
                let run = runs.last_mut().expect("runs is never empty");
                if s.staircase {
                    run.push((st as f64 - 0.5, y));
                    run.push((st as f64 + 0.5, y));
                } else {
                    run.push((st as f64, y));
                }
            }
            for run in runs.into_iter().filter(|r| !r.is_empty()) {
                if !s.staircase && s.points.len() <= 200 {
                    chart.draw_series(run.iter().map(|&p| Circle::new(p, 3, s.color.filled())))?;
                }
                chart.draw_series(LineSeries::new(run, s.color.stroke_width(width)))?;
            }
        }
        let area = chart.plotting_area().strip_coord_spec();
        let edge = (y1 - y0) * 0.03;
        for m in &self.marks {
            for &(st, v) in &m.points {
                let y = self.y(v);
                let y = if y.is_finite() {
                    y
                } else if y == f64::NEG_INFINITY {
                    y0 + edge
                } else {
                    y1 - edge
                };
                let p = chart.backend_coord(&(st as f64, y));
                let (ox, oy) = chart.plotting_area().get_base_pixel();
                m.symbol.mark(&area, (p.0 - ox, p.1 - oy))?;
            }
        }
        let (l, _) = chart.plotting_area().get_pixel_range();
        legend.draw(&bottom, l.start)?;
        Ok(())
    }
}

/// The loss-scale history of a trace: a staircase on a log2 axis, skipped steps marked
/// and grouped by cause.
pub fn scale_chart(title: &str, steps: &[StepRecord], causes: &[(u64, String)]) -> StepChart {
    const OTHER: &str = "skipped step: other causes";
    let mut marks: Vec<MarkGroup> = Vec::new();
    let sym = [
        Symbol::Triangle(C_INF),
        Symbol::Triangle(C_NAN),
        Symbol::Triangle(PALETTE[5]),
        Symbol::Triangle(C_BACKWARD),
        Symbol::Triangle(C_OPTIMIZER),
    ];
    for s in steps.iter().filter(|s| s.skipped) {
        let cause = causes
            .iter()
            .find(|c| c.0 == s.step)
            .map_or("cause unknown", |c| c.1.as_str());
        let cause = cause.replace('`', "");
        let label = format!("skipped step: {cause}");
        let idx = match marks.iter().position(|m| m.label == label) {
            Some(i) => i,
            None if marks.len() < sym.len() => {
                marks.push(MarkGroup {
                    label,
                    symbol: sym[marks.len()],
                    points: Vec::new(),
                });
                marks.len() - 1
            }
            None => {
                if marks.last().is_none_or(|m| m.label != OTHER) {
                    marks.push(MarkGroup {
                        label: OTHER.into(),
                        symbol: Symbol::Cross(C_GREY),
                        points: Vec::new(),
                    });
                }
                marks.len() - 1
            }
        };
        marks[idx].points.push((s.step, s.scale_before));
    }
    let bad: Vec<(u64, f64)> = steps
        .iter()
        .filter(|s| !(s.scale_before.is_finite() && s.scale_before > 0.0))
        .map(|s| (s.step, s.scale_before))
        .collect();
    if !bad.is_empty() {
        marks.push(MarkGroup {
            label: "scale 0 or not finite".into(),
            symbol: Symbol::Cross(BLACK),
            points: bad,
        });
    }
    StepChart {
        title: title.to_string(),
        y_desc: "loss scale (log2 axis)".into(),
        log2: true,
        series: vec![StepSeries {
            label: "loss scale used in the step".into(),
            color: C_FORWARD,
            points: steps.iter().map(|s| (s.step, s.scale_before)).collect(),
            staircase: true,
        }],
        marks,
    }
}

/// The loss per step, skipped steps and non-finite losses marked.
pub fn loss_chart(title: &str, steps: &[StepRecord]) -> StepChart {
    let mut marks = Vec::new();
    let skipped: Vec<(u64, f64)> = steps
        .iter()
        .filter(|s| s.skipped && s.loss.is_some_and(f64::is_finite))
        .map(|s| (s.step, s.loss.unwrap_or(f64::NAN)))
        .collect();
    if !skipped.is_empty() {
        marks.push(MarkGroup {
            label: "skipped step (update not applied)".into(),
            symbol: Symbol::Triangle(C_INF),
            points: skipped,
        });
    }
    let bad: Vec<(u64, f64)> = steps
        .iter()
        .filter_map(|s| s.loss.filter(|l| !l.is_finite()).map(|l| (s.step, l)))
        .collect();
    if !bad.is_empty() {
        marks.push(MarkGroup {
            label: "loss is Inf or NaN (drawn at the top edge)".into(),
            symbol: Symbol::Cross(C_NAN),
            points: bad.into_iter().map(|(s, _)| (s, f64::NAN)).collect(),
        });
    }
    StepChart {
        title: title.to_string(),
        y_desc: "loss".into(),
        log2: false,
        series: vec![StepSeries {
            label: "loss (unscaled)".into(),
            color: C_FORWARD,
            points: steps
                .iter()
                .filter_map(|s| s.loss.map(|l| (s.step, l)))
                .collect(),
            staircase: false,
        }],
        marks,
    }
}
