//! Charts, drawn with plotters into PNG and SVG from the same code. Text uses DejaVu Sans
//! compiled into the binary (registered as `sans-serif`), so no system font is needed.
//!
//! Each chart is a value holding its data and implementing [`Chart`]; [`render`] writes
//! `STEM.png` and `STEM.svg`. Legends sit in a strip below the plot, one entry per line,
//! so they never cover data.

use super::facts;
use crate::dtype::{BF16, FP16};
use crate::error::{Error, Result};
use crate::numfmt::long as fmt_num;
use crate::probe::stats::ExpHist;
use crate::trace::io::Trace;
use crate::trace::record::{OpRef, Phase, StepRecord};
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// Result of drawing on a backend.
pub type DrawResult<DB> =
    std::result::Result<(), DrawingAreaErrorKind<<DB as DrawingBackend>::ErrorType>>;

/// Font family every chart uses; DejaVu Sans is registered under it.
pub const FONT: &str = "sans-serif";

/// Forward ops.
pub const C_FORWARD: RGBColor = RGBColor(31, 119, 180);
/// Backward ops.
pub const C_BACKWARD: RGBColor = RGBColor(230, 120, 0);
/// Optimizer ops.
pub const C_OPTIMIZER: RGBColor = RGBColor(44, 160, 44);
/// First Inf, overflow.
pub const C_INF: RGBColor = RGBColor(214, 39, 40);
/// First NaN.
pub const C_NAN: RGBColor = RGBColor(148, 60, 189);
/// Neutral lines and labels.
pub const C_GREY: RGBColor = RGBColor(120, 120, 120);
/// bf16 limits.
pub const C_BF16: RGBColor = RGBColor(20, 60, 140);
/// Major grid lines.
pub const C_GRID_BOLD: RGBColor = RGBColor(205, 205, 205);
/// Minor grid lines.
pub const C_GRID_LIGHT: RGBColor = RGBColor(242, 242, 242);
/// Colours of series and marker groups, in order.
pub const PALETTE: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(230, 120, 0),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 60, 189),
    RGBColor(140, 86, 75),
];

/// Registers the embedded DejaVu Sans (regular and bold) as `sans-serif`, once.
pub fn ensure_fonts() -> Result<()> {
    static DONE: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    DONE.get_or_init(|| {
        for (style, bytes) in [
            (FontStyle::Normal, dejavu::sans::regular()),
            (FontStyle::Bold, dejavu::sans::bold()),
        ] {
            plotters::style::register_font(FONT, style, bytes)
                .map_err(|_| "embedded DejaVu Sans: not a valid font file".to_string())?;
        }
        Ok(())
    })
    .clone()
    .map_err(Error::Invalid)
}

/// A chart: its pixel size and how to draw it on any backend.
pub trait Chart {
    /// Width and height in pixels.
    fn size(&self) -> (u32, u32);
    /// Draws the chart on `root` (already filled white).
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult<DB>;
}

/// The files one chart was written to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rendered {
    /// File stem (`scale`, `loss`, …).
    pub stem: String,
    /// The PNG.
    pub png: PathBuf,
    /// The SVG.
    pub svg: PathBuf,
}

/// Draws `chart` into `DIR/STEM.png` and `DIR/STEM.svg`.
pub fn render(chart: &impl Chart, dir: &Path, stem: &str) -> Result<Rendered> {
    ensure_fonts()?;
    let err = |what: &str, e: String| Error::Invalid(format!("chart {stem} ({what}): {e}"));
    let png = dir.join(format!("{stem}.png"));
    let svg = dir.join(format!("{stem}.svg"));
    {
        let root = BitMapBackend::new(&png, chart.size()).into_drawing_area();
        root.fill(&WHITE).map_err(|e| err("png", e.to_string()))?;
        chart.draw(&root).map_err(|e| err("png", e.to_string()))?;
        root.present()
            .map_err(|e| err(&png.display().to_string(), e.to_string()))?;
    }
    {
        let root = SVGBackend::new(&svg, chart.size()).into_drawing_area();
        root.fill(&WHITE).map_err(|e| err("svg", e.to_string()))?;
        chart.draw(&root).map_err(|e| err("svg", e.to_string()))?;
        root.present()
            .map_err(|e| err(&svg.display().to_string(), e.to_string()))?;
    }
    Ok(Rendered {
        stem: stem.to_string(),
        png,
        svg,
    })
}

/// Draws `chart` into an SVG string (for tests and inline HTML).
pub fn render_svg_string(chart: &impl Chart) -> Result<String> {
    ensure_fonts()?;
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, chart.size()).into_drawing_area();
        let e = |e: String| Error::Invalid(format!("chart (svg): {e}"));
        root.fill(&WHITE).map_err(|x| e(x.to_string()))?;
        chart.draw(&root).map_err(|x| e(x.to_string()))?;
        root.present().map_err(|x| e(x.to_string()))?;
    }
    Ok(out)
}

fn title_style() -> TextStyle<'static> {
    (FONT, 22, FontStyle::Bold).into_font().color(&BLACK)
}

fn text(size: u32) -> TextStyle<'static> {
    (FONT, size).into_font().color(&BLACK)
}

/// Shortens `s` to at most `max` characters, keeping the end (module paths differ at the
/// end) when `keep_end`, else the start.
pub fn shorten(s: &str, max: usize, keep_end: bool) -> String {
    let n = s.chars().count();
    if n <= max || max < 2 {
        return s.to_string();
    }
    if keep_end {
        let tail: String = s.chars().skip(n - (max - 1)).collect();
        format!("…{tail}")
    } else {
        let head: String = s.chars().take(max - 1).collect();
        format!("{head}…")
    }
}

/// How a legend entry or a marker group is drawn.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Symbol {
    /// A solid line.
    Line(RGBColor),
    /// A dashed line.
    Dashed(RGBColor),
    /// A filled circle.
    Circle(RGBColor),
    /// A filled triangle.
    Triangle(RGBColor),
    /// A cross.
    Cross(RGBColor),
    /// A filled box (areas, heatmap classes).
    Swatch(RGBColor),
    /// A filled box drawn light (shaded bands).
    Shade(RGBColor),
}

impl Symbol {
    fn draw_at<DB: DrawingBackend>(
        self,
        area: &DrawingArea<DB, Shift>,
        (x, y): (i32, i32),
        w: i32,
    ) -> DrawResult<DB> {
        let mid = (x + w / 2, y);
        match self {
            Symbol::Line(c) => area.draw(&PathElement::new(
                vec![(x, y), (x + w, y)],
                c.stroke_width(3),
            )),
            Symbol::Dashed(c) => {
                let mut s = x;
                while s < x + w {
                    area.draw(&PathElement::new(
                        vec![(s, y), ((s + 6).min(x + w), y)],
                        c.stroke_width(2),
                    ))?;
                    s += 10;
                }
                Ok(())
            }
            Symbol::Circle(c) => area.draw(&Circle::new(mid, 5, c.filled())),
            Symbol::Triangle(c) => area.draw(&TriangleMarker::new(mid, 7, c.filled())),
            Symbol::Cross(c) => area.draw(&Cross::new(mid, 5, c.stroke_width(2))),
            Symbol::Swatch(c) => area.draw(&Rectangle::new(
                [(x + 4, y - 7), (x + w - 4, y + 7)],
                c.filled(),
            )),
            Symbol::Shade(c) => area.draw(&Rectangle::new(
                [(x + 4, y - 7), (x + w - 4, y + 7)],
                c.mix(0.35).filled(),
            )),
        }
    }

    /// Draws the symbol as a data marker centred at `p` (pixels).
    fn mark<DB: DrawingBackend>(
        self,
        area: &DrawingArea<DB, Shift>,
        p: (i32, i32),
    ) -> DrawResult<DB> {
        match self {
            Symbol::Circle(c) => area.draw(&Circle::new(p, 4, c.filled())),
            Symbol::Triangle(c) => area.draw(&TriangleMarker::new(p, 7, c.filled())),
            Symbol::Cross(c) => area.draw(&Cross::new(p, 6, c.stroke_width(2))),
            other => other.draw_at(area, (p.0 - 10, p.1), 20),
        }
    }
}

/// Legend entries, drawn one per line below a plot.
#[derive(Debug, Clone, Default)]
pub struct Legend(pub Vec<(Symbol, String)>);

const LEGEND_LINE: u32 = 22;

impl Legend {
    /// Pixels the legend needs.
    pub fn height(&self) -> u32 {
        if self.0.is_empty() {
            0
        } else {
            14 + LEGEND_LINE * self.0.len() as u32
        }
    }

    /// Draws the legend into `area`, starting `left` pixels in.
    pub fn draw<DB: DrawingBackend>(
        &self,
        area: &DrawingArea<DB, Shift>,
        left: i32,
    ) -> DrawResult<DB> {
        let (w, _) = area.dim_in_pixel();
        let max_chars = ((w as i32 - left - 60).max(80) / 8) as usize;
        for (i, (sym, label)) in self.0.iter().enumerate() {
            let y = 8 + (LEGEND_LINE as i32) * i as i32 + LEGEND_LINE as i32 / 2;
            sym.draw_at(area, (left, y), 28)?;
            area.draw(&Text::new(
                shorten(label, max_chars, false),
                (left + 38, y),
                text(14).pos(Pos::new(HPos::Left, VPos::Center)),
            ))?;
        }
        Ok(())
    }
}

/// `2^k` for an integral `k`, else `2^k` with one decimal.
fn pow_label(base: &str, v: f64) -> String {
    if (v - v.round()).abs() < 1e-9 {
        format!("{base}^{}", v.round() as i64)
    } else {
        format!("{base}^{v:.1}")
    }
}

/// `1e-5` style label of a log10 value.
fn dec_label(v: f64) -> String {
    if (v - v.round()).abs() < 1e-9 {
        format!("1e{}", v.round() as i64)
    } else {
        String::new()
    }
}

/// Integral label of a step axis (no label between steps).
fn step_label(v: f64) -> String {
    if (v - v.round()).abs() < 1e-9 {
        format!("{}", v.round() as i64)
    } else {
        String::new()
    }
}

/// A range padded on both sides, never empty.
fn padded(lo: f64, hi: f64, pad_frac: f64, min_span: f64) -> (f64, f64) {
    let (mut lo, mut hi) = if lo.is_finite() && hi.is_finite() && lo <= hi {
        (lo, hi)
    } else {
        (0.0, 1.0)
    };
    // A span computed from values that were not finite (no finite point at all) is no span.
    let min_span = if min_span.is_finite() { min_span } else { 0.0 };
    if hi - lo < min_span {
        let c = (lo + hi) / 2.0;
        lo = c - min_span / 2.0;
        hi = c + min_span / 2.0;
    }
    let p = (hi - lo) * pad_frac;
    (lo - p, hi + p)
}

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

/// How one heatmap cell is coloured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Cell {
    /// log10 of max|g| inside fp16's range.
    Value(f64),
    /// max|g| below fp16's smallest subnormal.
    Underflow(f64),
    /// max|g| above fp16's max.
    Overflow(f64),
    /// The gradient held an Inf or NaN.
    NonFinite,
    /// No gradient, or an all-zero one.
    Zero,
    /// The parameter has no record in the step.
    Missing,
}

const C_UNDER: RGBColor = RGBColor(120, 180, 230);
const C_OVER: RGBColor = RGBColor(230, 30, 30);
const C_NONFIN: RGBColor = RGBColor(0, 0, 0);
const C_ZERO: RGBColor = RGBColor(215, 215, 215);
const C_MISSING: RGBColor = RGBColor(255, 255, 255);
const C_NODATA: RGBColor = RGBColor(240, 240, 240);

/// Per-parameter gradient magnitudes over steps (log10 of max|unscaled gradient|), fp16's
/// underflow and overflow bands marked.
#[derive(Debug, Clone)]
pub struct GradHeatmap {
    /// Title.
    pub title: String,
    /// Row names (parameters), top to bottom.
    pub rows: Vec<String>,
    /// Step numbers, left to right.
    pub steps: Vec<u64>,
    /// `cells[row][column]`.
    pub cells: Vec<Vec<Cell>>,
}

impl GradHeatmap {
    /// Builds the heatmap of a trace's parameter records.
    pub fn from_steps(title: &str, steps: &[StepRecord]) -> GradHeatmap {
        let rows: Vec<String> = facts::param_table(steps)
            .into_iter()
            .map(|r| r.name)
            .collect();
        let lo = FP16.min_subnormal;
        let cells = rows
            .iter()
            .map(|name| {
                steps
                    .iter()
                    .map(|s| match s.params.iter().find(|p| &p.name == name) {
                        None => Cell::Missing,
                        Some(p) if p.nonfinite > 0 => Cell::NonFinite,
                        Some(p) if !positive(p.max_abs_grad) => Cell::Zero,
                        Some(p) if p.max_abs_grad < lo => Cell::Underflow(p.max_abs_grad.log10()),
                        Some(p) if p.max_abs_grad > FP16.max => {
                            Cell::Overflow(p.max_abs_grad.log10())
                        }
                        Some(p) => Cell::Value(p.max_abs_grad.log10()),
                    })
                    .collect()
            })
            .collect();
        GradHeatmap {
            title: title.to_string(),
            rows,
            steps: steps.iter().map(|s| s.step).collect(),
            cells,
        }
    }

    fn row_height(&self) -> u32 {
        match self.rows.len() {
            0..=8 => 30,
            9..=40 => 18,
            41..=160 => 13,
            n => (2400 / n as u32).max(2),
        }
    }

    /// Range of the colour scale (log10): the in-range values, clipped to fp16's range.
    fn value_range(&self) -> (f64, f64) {
        let vals = self.cells.iter().flatten().filter_map(|c| match c {
            Cell::Value(v) => Some(*v),
            _ => None,
        });
        let (lo, hi) = vals.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), v| {
            (a.min(v), b.max(v))
        });
        if lo.is_finite() {
            if hi - lo < 1e-9 {
                (lo - 0.5, hi + 0.5)
            } else {
                (lo, hi)
            }
        } else {
            (FP16.min_subnormal.log10(), FP16.max.log10())
        }
    }

    fn legend(&self) -> Legend {
        Legend(vec![
            (Symbol::Swatch(C_UNDER), "max|g| below 2^-24, fp16's smallest subnormal: the whole gradient flushes to 0 in fp16 without loss scaling".into()),
            (Symbol::Swatch(C_OVER), "max|g| above 65504, fp16's largest value: overflows fp16".into()),
            (Symbol::Swatch(C_NONFIN), "gradient holds Inf or NaN (step skipped or diverged)".into()),
            (Symbol::Swatch(C_ZERO), "no gradient, or all zero".into()),
        ])
    }
}

/// Three significant digits, plain or scientific.
fn sig3(x: f64) -> String {
    if x != 0.0 && !(1e-3..1e4).contains(&x.abs()) {
        format!("{x:.2e}")
    } else {
        let d = if x == 0.0 {
            0
        } else {
            (2 - x.abs().log10().floor() as i32).max(0) as usize
        };
        format!("{x:.d$}")
    }
}

/// True for a number above zero (false for NaN).
fn positive(x: f64) -> bool {
    x > 0.0
}

/// A viridis-like colour for `t` in [0, 1] (dark blue → green → yellow).
pub fn colormap(t: f64) -> RGBColor {
    const STOPS: [(f64, f64, f64); 5] = [
        (68.0, 1.0, 84.0),
        (59.0, 82.0, 139.0),
        (33.0, 145.0, 140.0),
        (94.0, 201.0, 98.0),
        (253.0, 231.0, 37.0),
    ];
    let t = if t.is_finite() {
        t.clamp(0.0, 1.0)
    } else {
        0.0
    };
    let x = t * (STOPS.len() - 1) as f64;
    let i = (x.floor() as usize).min(STOPS.len() - 2);
    let f = x - i as f64;
    let (a, b) = (STOPS[i], STOPS[i + 1]);
    let m = |u: f64, v: f64| (u + (v - u) * f).round() as u8;
    RGBColor(m(a.0, b.0), m(a.1, b.1), m(a.2, b.2))
}

impl GradHeatmap {
    fn color(&self, c: Cell, (lo, hi): (f64, f64)) -> RGBColor {
        match c {
            Cell::Value(v) => colormap((v - lo) / (hi - lo)),
            Cell::Underflow(_) => C_UNDER,
            Cell::Overflow(_) => C_OVER,
            Cell::NonFinite => C_NONFIN,
            Cell::Zero => C_ZERO,
            Cell::Missing => C_MISSING,
        }
    }

    /// The colour of a log10 value on the colour bar: the colour scale over the range of
    /// the data, fp16's bands outside fp16's range, light grey where there is no data.
    fn bar_color(&self, v: f64, range: (f64, f64)) -> RGBColor {
        if v < FP16.min_subnormal.log10() {
            C_UNDER
        } else if v > FP16.max.log10() {
            C_OVER
        } else if v < range.0 || v > range.1 {
            C_NODATA
        } else {
            self.color(Cell::Value(v), range)
        }
    }
}

impl Chart for GradHeatmap {
    fn size(&self) -> (u32, u32) {
        let plot = (self.rows.len().max(1) as u32 * self.row_height()).max(220);
        let label_w = self
            .rows
            .iter()
            .map(|r| r.chars().count())
            .max()
            .unwrap_or(4)
            .min(60) as u32;
        (1000 + label_w * 7, plot + 150 + self.legend().height())
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult<DB> {
        let legend = self.legend();
        let (w, h) = root.dim_in_pixel();
        let (top, bottom) = root.split_vertically(h - legend.height());
        let (left, right) = top.split_horizontally(w - 270);
        let range = self.value_range();
        let nrows = self.rows.len().max(1);
        let ncols = self.steps.len().max(1);
        let label_font = if self.row_height() >= 16 { 13 } else { 11 };
        let label_w = self
            .rows
            .iter()
            .map(|r| {
                top.estimate_text_size(&shorten(r, 60, true), &text(label_font))
                    .map(|s| s.0)
                    .unwrap_or(200)
            })
            .max()
            .unwrap_or(40)
            + 16;
        let mut chart = ChartBuilder::on(&left)
            .caption(&self.title, title_style())
            .margin(12)
            .x_label_area_size(50)
            .y_label_area_size(label_w)
            .build_cartesian_2d(-0.5..(ncols as f64 - 0.5), 0.0..nrows as f64)?;
        let steps = self.steps.clone();
        chart
            .configure_mesh()
            .disable_mesh()
            .x_desc("step")
            .y_desc("")
            .axis_desc_style(text(16))
            .bold_line_style(C_GRID_BOLD)
            .light_line_style(C_GRID_LIGHT)
            .label_style(text(13))
            .x_labels(ncols.min(12))
            .y_labels(0)
            .x_label_formatter(&|v| {
                let i = v.round();
                if (v - i).abs() < 1e-9 && i >= 0.0 {
                    steps
                        .get(i as usize)
                        .map_or_else(String::new, |s| s.to_string())
                } else {
                    String::new()
                }
            })
            .draw()?;
        for (r, row) in self.cells.iter().enumerate() {
            let y = (nrows - 1 - r) as f64;
            chart.draw_series(row.iter().enumerate().map(|(c, &cell)| {
                Rectangle::new(
                    [(c as f64 - 0.5, y), (c as f64 + 0.5, y + 1.0)],
                    self.color(cell, range).filled(),
                )
            }))?;
        }
        // Values written into the cells when there is room for them.
        let (px0, px1) = chart.plotting_area().get_pixel_range();
        let cell_w = (px0.end - px0.start) / ncols as i32;
        let cell_h = (px1.end - px1.start) / nrows as i32;
        if cell_w >= 64 && cell_h >= 16 {
            let (ox, oy) = top.get_base_pixel();
            for (r, row) in self.cells.iter().enumerate() {
                let y = (nrows - 1 - r) as f64 + 0.5;
                for (c, &cell) in row.iter().enumerate() {
                    let (label, dark) = match cell {
                        Cell::Value(v) => (
                            sig3(10f64.powf(v)),
                            (v - range.0) / (range.1 - range.0) < 0.55,
                        ),
                        Cell::Underflow(v) | Cell::Overflow(v) => (sig3(10f64.powf(v)), false),
                        Cell::NonFinite => ("Inf/NaN".to_string(), true),
                        Cell::Zero => ("0".to_string(), false),
                        Cell::Missing => continue,
                    };
                    let p = chart.backend_coord(&(c as f64, y));
                    let color = if dark { WHITE } else { BLACK };
                    top.draw(&Text::new(
                        label,
                        (p.0 - ox, p.1 - oy),
                        (FONT, 12)
                            .into_font()
                            .color(&color)
                            .pos(Pos::new(HPos::Center, VPos::Center)),
                    ))?;
                }
            }
        }
        // Row labels, thinned to one per 11 pixels.
        let rh = self.row_height().max(1);
        let every = (11 / rh + 1) as usize;
        let (ox, oy) = top.get_base_pixel();
        for (r, name) in self.rows.iter().enumerate() {
            if r % every != 0 {
                continue;
            }
            let y = (nrows - 1 - r) as f64 + 0.5;
            let p = chart.backend_coord(&(-0.5, y));
            top.draw(&Text::new(
                shorten(name, 60, true),
                (p.0 - ox - 6, p.1 - oy),
                text(label_font).pos(Pos::new(HPos::Right, VPos::Center)),
            ))?;
        }
        // Colour bar with fp16's limits.
        let uf = FP16.min_subnormal.log10();
        let mn = FP16.min_normal.log10();
        let of = FP16.max.log10();
        let b0 = range.0.min(uf - 0.6).floor();
        let b1 = range.1.max(of + 0.6).ceil();
        let mut bar = ChartBuilder::on(&right)
            .margin_top(50)
            .margin_bottom(60)
            .margin_right(150)
            .margin_left(8)
            .y_label_area_size(50)
            .build_cartesian_2d(0.0..1.0, b0..b1)?;
        bar.configure_mesh()
            .disable_mesh()
            .disable_x_axis()
            .y_labels(((b1 - b0) as usize / 2).clamp(2, 14))
            .y_label_formatter(&|v| dec_label(*v))
            .label_style(text(12))
            .draw()?;
        let n = 240;
        bar.draw_series((0..n).map(|i| {
            let a = b0 + (b1 - b0) * i as f64 / n as f64;
            let b = b0 + (b1 - b0) * (i + 1) as f64 / n as f64;
            Rectangle::new(
                [(0.0, a), (1.0, b)],
                self.bar_color((a + b) / 2.0, range).filled(),
            )
        }))?;
        let (rx, ry) = right.get_base_pixel();
        for (v, label) in [
            (of, "fp16 max 65504"),
            (mn, "fp16 min normal 2^-14"),
            (uf, "fp16 min subnormal 2^-24"),
        ] {
            bar.draw_series(LineSeries::new(
                vec![(0.0, v), (1.0, v)],
                BLACK.stroke_width(2),
            ))?;
            let p = bar.backend_coord(&(1.0, v));
            right.draw(&Text::new(
                label,
                (p.0 - rx + 6, p.1 - ry),
                text(12).pos(Pos::new(HPos::Left, VPos::Center)),
            ))?;
        }
        let p = bar.backend_coord(&(0.0, b1));
        right.draw(&Text::new(
            "max |g|",
            (p.0 - rx - 40, p.1 - ry - 24),
            text(13).pos(Pos::new(HPos::Left, VPos::Center)),
        ))?;
        let p = bar.backend_coord(&(0.0, b0));
        right.draw(&Text::new(
            format!(
                "colours span {} … {}",
                sig3(10f64.powf(range.0)),
                sig3(10f64.powf(range.1))
            ),
            (p.0 - rx - 40, p.1 - ry + 24),
            text(12).pos(Pos::new(HPos::Left, VPos::Center)),
        ))?;
        let (l, _) = chart.plotting_area().get_pixel_range();
        legend.draw(&bottom, l.start)?;
        Ok(())
    }
}

/// Per-op max|x| of one step in execution order, against fp16's and bf16's limits, with
/// the first Inf and first NaN marked.
#[derive(Debug, Clone)]
pub struct OpMaxChart {
    /// Title.
    pub title: String,
    /// `(op index, phase, max|x|, output holds Inf/NaN)`.
    pub ops: Vec<(u64, Phase, f64, bool)>,
    /// The step's first Inf origin.
    pub first_inf: Option<OpRef>,
    /// The step's first NaN origin.
    pub first_nan: Option<OpRef>,
    /// Loss scale of the step (backward values carry it).
    pub scale: f64,
}

impl OpMaxChart {
    /// The chart of step `step` of `trace`; `None` when that step has no op records.
    pub fn for_step(trace: &Trace, step: u64) -> Option<OpMaxChart> {
        let s = trace.steps.iter().find(|s| s.step == step)?;
        let ops = s.ops.as_ref()?;
        Some(OpMaxChart {
            title: format!(
                "Largest |output| of every op, step {step} ({} {})",
                trace.header.model, trace.header.precision
            ),
            ops: ops
                .iter()
                .map(|o| {
                    (
                        o.index,
                        o.phase,
                        o.stats.max_abs,
                        facts::unmasked_nonfinite(o) > 0,
                    )
                })
                .collect(),
            first_inf: s.origins.first_inf.clone(),
            first_nan: s.origins.first_nan.clone(),
            scale: s.scale_before,
        })
    }

    fn legend(&self) -> Legend {
        let mut l = Legend::default();
        for (ph, c, what) in [
            (Phase::Forward, C_FORWARD, "forward op".to_string()),
            (
                Phase::Backward,
                C_BACKWARD,
                format!(
                    "backward op (values carry the loss scale {})",
                    scale_text(self.scale)
                ),
            ),
            (Phase::Optimizer, C_OPTIMIZER, "optimizer op".to_string()),
        ] {
            if self.ops.iter().any(|o| o.1 == ph && !o.3 && o.2 > 0.0) {
                l.0.push((Symbol::Circle(c), what));
            }
        }
        l.0.push((Symbol::Line(C_INF), "fp16 max 65504".into()));
        l.0.push((Symbol::Line(C_BF16), "bf16 max 3.39e38".into()));
        l.0.push((Symbol::Dashed(C_GREY), "fp16 min subnormal 2^-24".into()));
        if self.ops.iter().any(|o| o.3) {
            l.0.push((
                Symbol::Cross(C_INF),
                "output holds Inf or NaN (drawn at the top)".into(),
            ));
        }
        if self.ops.iter().any(|o| !o.3 && !positive(o.2)) {
            l.0.push((
                Symbol::Cross(C_GREY),
                "all-zero output (drawn at the bottom)".into(),
            ));
        }
        if let Some(o) = &self.first_inf {
            l.0.push((
                Symbol::Dashed(C_INF),
                format!(
                    "first Inf: op #{} {} in {} ({})",
                    o.op_index,
                    o.op,
                    facts::module_name(&o.module),
                    facts::phase_name(o.phase)
                ),
            ));
        }
        if let Some(o) = &self.first_nan {
            l.0.push((
                Symbol::Dashed(C_NAN),
                format!(
                    "first NaN: op #{} {} in {} ({})",
                    o.op_index,
                    o.op,
                    facts::module_name(&o.module),
                    facts::phase_name(o.phase)
                ),
            ));
        }
        l
    }
}

pub use crate::numfmt::scale_long as scale_text;

impl Chart for OpMaxChart {
    fn size(&self) -> (u32, u32) {
        (1200, 560 + self.legend().height())
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult<DB> {
        let legend = self.legend();
        let (_, h) = root.dim_in_pixel();
        let (top, bottom) = root.split_vertically(h - legend.height());
        let logs: Vec<f64> = self
            .ops
            .iter()
            .filter(|o| o.2 > 0.0)
            .map(|o| o.2.log10())
            .collect();
        let lo = logs
            .iter()
            .copied()
            .fold(FP16.min_subnormal.log10(), f64::min);
        let y0 = lo.floor() - 1.0;
        // Room above bf16's max for the row of non-finite markers.
        let y1 =
            (BF16.max.log10().ceil() + 4.0).max(logs.iter().copied().fold(0.0, f64::max) + 4.0);
        let n = self.ops.iter().map(|o| o.0).max().map_or(1, |m| m + 1);
        let x0 = -0.5;
        let x1 = n as f64 - 0.5;
        let mut chart = ChartBuilder::on(&top)
            .caption(&self.title, title_style())
            .margin(12)
            .x_label_area_size(50)
            .y_label_area_size(80)
            .build_cartesian_2d(x0..x1, y0..y1)?;
        chart
            .configure_mesh()
            .x_desc("op index (execution order)")
            .y_desc("max |x| of the output (log scale)")
            .axis_desc_style(text(16))
            .bold_line_style(C_GRID_BOLD)
            .light_line_style(C_GRID_LIGHT)
            .label_style(text(13))
            .x_labels((n as usize).min(16))
            .y_labels(12)
            .x_label_formatter(&|v| step_label(*v))
            // Nothing lives above bf16's max but the non-finite markers.
            .y_label_formatter(&|v| {
                if *v > BF16.max.log10() {
                    String::new()
                } else {
                    dec_label(*v)
                }
            })
            .draw()?;
        for (v, style) in [
            (FP16.max.log10(), C_INF.stroke_width(2)),
            (BF16.max.log10(), C_BF16.stroke_width(2)),
        ] {
            chart.draw_series(LineSeries::new(vec![(x0, v), (x1, v)], style))?;
        }
        chart.draw_series(DashedLineSeries::new(
            vec![
                (x0, FP16.min_subnormal.log10()),
                (x1, FP16.min_subnormal.log10()),
            ],
            8,
            6,
            C_GREY.stroke_width(2),
        ))?;
        for (o, c) in [(&self.first_inf, C_INF), (&self.first_nan, C_NAN)] {
            if let Some(o) = o {
                let x = o.op_index as f64;
                chart.draw_series(DashedLineSeries::new(
                    vec![(x, y0), (x, y1)],
                    10,
                    6,
                    c.stroke_width(2),
                ))?;
            }
        }
        // Smaller markers when thousands of ops share the width.
        let radius = match self.ops.len() {
            0..=150 => 4,
            151..=600 => 3,
            _ => 2,
        };
        for (ph, c) in [
            (Phase::Forward, C_FORWARD),
            (Phase::Backward, C_BACKWARD),
            (Phase::Optimizer, C_OPTIMIZER),
        ] {
            chart.draw_series(
                self.ops
                    .iter()
                    .filter(|o| o.1 == ph && !o.3 && o.2 > 0.0)
                    .map(|o| Circle::new((o.0 as f64, o.2.log10()), radius, c.filled())),
            )?;
        }
        let edge = 1.5;
        chart.draw_series(
            self.ops
                .iter()
                .filter(|o| o.3)
                .map(|o| Cross::new((o.0 as f64, y1 - edge), radius + 2, C_INF.stroke_width(2))),
        )?;
        chart.draw_series(
            self.ops
                .iter()
                .filter(|o| !o.3 && !positive(o.2))
                .map(|o| Cross::new((o.0 as f64, y0 + edge), radius + 1, C_GREY.stroke_width(2))),
        )?;
        let (l, _) = chart.plotting_area().get_pixel_range();
        legend.draw(&bottom, l.start)?;
        Ok(())
    }
}

/// Exponent histogram (`floor(log2|x|)`) of a set of values, with fp16's normal and
/// subnormal ranges shaded: the "Mixed Precision Training" figure.
#[derive(Debug, Clone)]
pub struct ExpHistChart {
    /// Title.
    pub title: String,
    /// What the values are (legend of the bars).
    pub what: String,
    /// Histogram of the values as recorded.
    pub hist: ExpHist,
    /// The same values with the loss scale divided out, when that is exact (all scales
    /// powers of two).
    pub unscaled: Option<ExpHist>,
    /// Non-finite values left out of the histogram.
    pub nonfinite: u64,
    /// Zeros left out of the histogram.
    pub zeros: u64,
}

/// Where a value with exponent `e` lands in fp16.
fn f16_band(e: i32) -> usize {
    if e < -24 {
        0
    } else if e < -14 {
        1
    } else if e < 16 {
        2
    } else {
        3
    }
}

/// Shares of a histogram's values below 2^-24, in fp16's subnormal range, in its normal
/// range, and at 2^16 or above.
pub fn f16_band_shares(h: &ExpHist) -> [f64; 4] {
    let mut c = [0u64; 4];
    for (e, n) in h.iter() {
        c[f16_band(e)] += n;
    }
    let t = h.total().max(1) as f64;
    c.map(|x| x as f64 / t)
}

impl ExpHistChart {
    /// Aggregates the op outputs of every step with op records that `select` picks. The
    /// unscaled histogram (`scaled` ops only) divides out each step's loss scale when every
    /// such step's scale is a power of two; `scaled` picks the ops whose values carry it.
    pub fn from_steps(
        title: &str,
        what: &str,
        steps: &[StepRecord],
        select: impl Fn(&crate::trace::record::OpRecord) -> bool,
        scaled: bool,
    ) -> ExpHistChart {
        let mut hist = ExpHist::default();
        let mut unscaled = Some(ExpHist::default());
        let (mut nonfinite, mut zeros) = (0, 0);
        let mut any_scale = false;
        for s in steps {
            let k = s.scale_before.log2();
            let exact = s.scale_before > 0.0 && s.scale_before.is_finite() && k.fract() == 0.0;
            for o in s.ops.iter().flatten().filter(|o| select(o)) {
                hist.merge(&o.stats.exp_hist);
                nonfinite += o.stats.nonfinite();
                zeros += o.stats.zeros;
                if scaled {
                    any_scale |= s.scale_before != 1.0;
                    if let (Some(u), true) = (unscaled.as_mut(), exact) {
                        let h = &o.stats.exp_hist;
                        if !h.counts.is_empty() {
                            u.merge(&ExpHist {
                                lo: h.lo - k as i32,
                                counts: h.counts.clone(),
                            });
                        }
                    } else {
                        unscaled = None;
                    }
                }
            }
        }
        ExpHistChart {
            title: title.to_string(),
            what: what.to_string(),
            hist,
            unscaled: unscaled.filter(|_| scaled && any_scale),
            nonfinite,
            zeros,
        }
    }

    fn legend(&self) -> Legend {
        let s = f16_band_shares(&self.hist);
        let pct = |f: f64| format!("{:.2}%", f * 100.0);
        let mut l = Legend(vec![(
            Symbol::Swatch(C_FORWARD),
            format!(
                "{}: {} values ({} zeros, {} Inf/NaN left out)",
                self.what,
                self.hist.total(),
                self.zeros,
                self.nonfinite
            ),
        )]);
        if let Some(u) = &self.unscaled {
            let su = f16_band_shares(u);
            l.0.push((
                Symbol::Line(C_BACKWARD),
                format!(
                    "the same values with the loss scale divided out: {} below 2^-24",
                    pct(su[0])
                ),
            ));
        }
        l.0.push((
            Symbol::Shade(C_OPTIMIZER),
            format!("fp16 normal range [2^-14, 65504]: {}", pct(s[2])),
        ));
        l.0.push((
            Symbol::Shade(RGBColor(230, 190, 20)),
            format!("fp16 subnormal range [2^-24, 2^-14): {}", pct(s[1])),
        ));
        l.0.push((
            Symbol::Shade(C_INF),
            format!(
                "outside fp16: below 2^-24 {}, at or above 2^16 {}",
                pct(s[0]),
                pct(s[3])
            ),
        ));
        l
    }
}

impl Chart for ExpHistChart {
    fn size(&self) -> (u32, u32) {
        (1100, 480 + self.legend().height())
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult<DB> {
        let legend = self.legend();
        let (_, h) = root.dim_in_pixel();
        let (top, bottom) = root.split_vertically(h - legend.height());
        let total = self.hist.total().max(1) as f64;
        let utotal = self
            .unscaled
            .as_ref()
            .map_or(1.0, |u| u.total().max(1) as f64);
        let mut lo = -30;
        let mut hi = 18;
        for h in std::iter::once(&self.hist).chain(self.unscaled.as_ref()) {
            if let (Some(a), Some(b)) = (h.min_exp(), h.max_exp()) {
                lo = lo.min(a - 2);
                hi = hi.max(b + 3);
            }
        }
        let peak = self
            .hist
            .counts
            .iter()
            .map(|&c| c as f64 / total)
            .chain(
                self.unscaled
                    .iter()
                    .flat_map(|u| u.counts.iter().map(move |&c| c as f64 / utotal)),
            )
            .fold(0.0, f64::max);
        let y1 = (peak * 100.0 * 1.12).max(1.0);
        let mut chart = ChartBuilder::on(&top)
            .caption(&self.title, title_style())
            .margin(12)
            .x_label_area_size(50)
            .y_label_area_size(80)
            .build_cartesian_2d(lo as f64..hi as f64, 0.0..y1)?;
        let bands = [
            (lo as f64, -24.0, C_INF),
            (-24.0, -14.0, RGBColor(230, 190, 20)),
            (-14.0, FP16.max.log2(), C_OPTIMIZER),
            (FP16.max.log2(), hi as f64, C_INF),
        ];
        chart.draw_series(
            bands
                .iter()
                .filter(|b| b.0 < b.1)
                .map(|&(a, b, c)| Rectangle::new([(a, 0.0), (b, y1)], c.mix(0.12).filled())),
        )?;
        chart
            .configure_mesh()
            .x_desc("exponent: floor(log2 |x|)")
            .y_desc("share of values (%)")
            .axis_desc_style(text(16))
            .bold_line_style(C_GRID_BOLD)
            .light_line_style(C_GRID_LIGHT)
            .label_style(text(13))
            .x_labels(((hi - lo) / 2) as usize)
            .y_labels(8)
            .x_label_formatter(&|v| step_label(*v))
            .draw()?;
        chart.draw_series(self.hist.iter().filter(|e| e.1 > 0).map(|(e, c)| {
            Rectangle::new(
                [
                    (e as f64 + 0.08, 0.0),
                    (e as f64 + 0.92, c as f64 / total * 100.0),
                ],
                C_FORWARD.mix(0.85).filled(),
            )
        }))?;
        if let Some(u) = &self.unscaled {
            let mut pts = Vec::new();
            for (e, c) in u.iter() {
                let y = c as f64 / utotal * 100.0;
                pts.push((e as f64, y));
                pts.push((e as f64 + 1.0, y));
            }
            if let (Some(f), Some(l)) = (pts.first().copied(), pts.last().copied()) {
                pts.insert(0, (f.0, 0.0));
                pts.push((l.0, 0.0));
            }
            chart.draw_series(LineSeries::new(pts, C_BACKWARD.stroke_width(3)))?;
        }
        if self.hist.total() == 0 {
            let (ox, oy) = top.get_base_pixel();
            let p = chart.backend_coord(&(((lo + hi) / 2) as f64, y1 / 2.0));
            top.draw(&Text::new(
                "no finite nonzero values",
                (p.0 - ox, p.1 - oy),
                text(18).pos(Pos::new(HPos::Center, VPos::Center)),
            ))?;
        }
        let (l, _) = chart.plotting_area().get_pixel_range();
        legend.draw(&bottom, l.start)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn band_shares_split_at_fp16_limits() {
        // exponents -26, -24, -15, -14, 15, 16
        let h = ExpHist::from_bins(-26, &{
            let mut b = vec![0u64; 43];
            b[0] = 1; // -26
            b[2] = 2; // -24
            b[11] = 3; // -15
            b[12] = 4; // -14
            b[41] = 5; // 15
            b[42] = 6; // 16
            b
        });
        let s = f16_band_shares(&h);
        let t = 21.0;
        assert_eq!(s, [1.0 / t, 5.0 / t, 9.0 / t, 6.0 / t]);
    }

    #[test]
    fn colormap_ends_and_clamps() {
        assert_eq!(colormap(0.0), RGBColor(68, 1, 84));
        assert_eq!(colormap(1.0), RGBColor(253, 231, 37));
        assert_eq!(colormap(2.0), colormap(1.0));
        assert_eq!(colormap(f64::NAN), colormap(0.0));
    }

    #[test]
    fn labels() {
        assert_eq!(pow_label("2", 16.0), "2^16");
        assert_eq!(pow_label("2", -3.0), "2^-3");
        assert_eq!(dec_label(-8.0), "1e-8");
        assert_eq!(dec_label(-7.5), "");
        assert_eq!(shorten("encoder.block.0.layer", 10, true), "…k.0.layer");
        assert_eq!(shorten("abcdef", 4, false), "abc…");
        assert_eq!(scale_text(65536.0), "2^16");
        assert_eq!(scale_text(1e30), "1.000e30");
    }
}

#[cfg(test)]
mod padded_tests {
    use super::padded;

    /// A chart with no finite value at all (a run whose every loss is NaN) still gets a
    /// finite axis; an infinite one makes plotters' tick search loop forever.
    #[test]
    fn no_finite_value_gives_a_finite_range() {
        let lo = f64::INFINITY;
        let hi = f64::NEG_INFINITY;
        let (a, b) = padded(lo, hi, 0.08, hi.abs().max(1e-6) * 1e-3);
        assert!(a.is_finite() && b.is_finite() && a < b, "{a}..{b}");
        let (a, b) = padded(2.0, 2.0, 0.0, 1.0);
        assert_eq!((a, b), (1.5, 2.5));
    }
}
