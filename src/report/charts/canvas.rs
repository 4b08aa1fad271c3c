//! The drawing kit every chart of `charts` shares: fonts, colours, the [`Chart`] trait,
//! legends, axis labels and ranges. A leaf: the chart files build on it (with the imports
//! below, which they take along), and `charts/mod.rs` re-exports it and renders charts to
//! files ([`super::render`]).

pub(super) use crate::dtype::{BF16, FP16};
pub(super) use crate::error::{Error, Result};
pub(super) use crate::numfmt::long as fmt_num;
pub(super) use crate::probe::tensor_stats::ExpHist;
pub(super) use crate::report::facts;
pub(super) use crate::trace::io::Trace;
pub(super) use crate::trace::record::{OpRef, Phase, StepRecord};
pub(super) use plotters::coord::Shift;
pub(super) use plotters::prelude::*;
pub(super) use plotters::style::text_anchor::{HPos, Pos, VPos};
pub(super) use std::path::PathBuf;
pub(super) use std::sync::OnceLock;

pub(super) use crate::numfmt::scale_long as scale_text;

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

pub(super) fn title_style() -> TextStyle<'static> {
    (FONT, 22, FontStyle::Bold).into_font().color(&BLACK)
}

pub(super) fn text(size: u32) -> TextStyle<'static> {
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
    pub(super) fn mark<DB: DrawingBackend>(
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

pub(super) const LEGEND_LINE: u32 = 22;

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
pub(super) fn pow_label(base: &str, v: f64) -> String {
    if (v - v.round()).abs() < 1e-9 {
        format!("{base}^{}", v.round() as i64)
    } else {
        format!("{base}^{v:.1}")
    }
}

/// `1e-5` style label of a log10 value.
pub(super) fn dec_label(v: f64) -> String {
    if (v - v.round()).abs() < 1e-9 {
        format!("1e{}", v.round() as i64)
    } else {
        String::new()
    }
}

/// Integral label of a step axis (no label between steps).
pub(super) fn step_label(v: f64) -> String {
    if (v - v.round()).abs() < 1e-9 {
        format!("{}", v.round() as i64)
    } else {
        String::new()
    }
}

/// A chart with linear f64 axes, as [`op_index_axes`] builds it.
pub type PlainChart<'a, DB> = ChartContext<
    'a,
    DB,
    Cartesian2d<plotters::coord::types::RangedCoordf64, plotters::coord::types::RangedCoordf64>,
>;

/// What a drawing call fails with on a backend.
pub(super) type DrawError<DB> = DrawingAreaErrorKind<<DB as DrawingBackend>::ErrorType>;

/// The y axis of an op-by-op chart: its description, about how many labels, and how a
/// label reads.
pub(super) struct LogAxis<'f> {
    pub desc: &'f str,
    pub labels: usize,
    pub label: &'f dyn Fn(&f64) -> String,
}

/// The axes an op-by-op chart shares: x the op index in execution order (`n` ops), y a
/// log10 magnitude over `y` as `axis` describes it; the mesh is drawn, the series are the
/// caller's.
pub(super) fn op_index_axes<'a, DB: DrawingBackend>(
    area: &'a DrawingArea<DB, Shift>,
    title: &str,
    n: u64,
    y: std::ops::Range<f64>,
    axis: LogAxis<'_>,
) -> std::result::Result<PlainChart<'a, DB>, DrawError<DB>> {
    let mut chart = ChartBuilder::on(area)
        .caption(title, title_style())
        .margin(12)
        .x_label_area_size(50)
        .y_label_area_size(80)
        .build_cartesian_2d(-0.5..n as f64 - 0.5, y)?;
    chart
        .configure_mesh()
        .x_desc("op index (execution order)")
        .y_desc(axis.desc)
        .axis_desc_style(text(16))
        .bold_line_style(C_GRID_BOLD)
        .light_line_style(C_GRID_LIGHT)
        .label_style(text(13))
        .x_labels((n as usize).min(16))
        .y_labels(axis.labels)
        .x_label_formatter(&|v| step_label(*v))
        .y_label_formatter(axis.label)
        .draw()?;
    Ok(chart)
}

/// A range padded on both sides, never empty.
pub(super) fn padded(lo: f64, hi: f64, pad_frac: f64, min_span: f64) -> (f64, f64) {
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

/// True for a number above zero (false for NaN).
pub(super) fn positive(x: f64) -> bool {
    x > 0.0
}

#[cfg(test)]
mod tests {
    use super::*;

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
