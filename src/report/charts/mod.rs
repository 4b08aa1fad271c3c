//! Charts, drawn with plotters into PNG and SVG from the same code. Text uses DejaVu Sans
//! compiled into the binary (registered as `sans-serif`), so no system font is needed.
//!
//! Each chart is a value holding its data and implementing [`Chart`]; [`render`] writes
//! `STEM.png` and `STEM.svg`. Legends sit in a strip below the plot, one entry per line,
//! so they never cover data.

mod blame;
mod canvas;
mod exphist;
mod heatmap;
mod opmax;
pub mod raster;
mod step;

pub use canvas::{
    ensure_fonts, shorten, Chart, DrawResult, Legend, PlainChart, Rendered, Symbol, C_BACKWARD,
    C_BF16, C_FORWARD, C_GREY, C_GRID_BOLD, C_GRID_LIGHT, C_INF, C_NAN, C_OPTIMIZER, FONT, PALETTE,
};

use crate::error::{Error, Result};
pub use crate::numfmt::scale_long as scale_text;
pub use blame::BlameChart;
pub use exphist::{f16_band_shares, ExpHistChart};
pub use heatmap::{colormap, Cell, GradHeatmap};
pub use opmax::OpMaxChart;
use plotters::prelude::*;
use std::path::Path;
pub use step::{loss_chart, scale_chart, MarkGroup, StepChart, StepSeries};

/// Draws `chart` into `DIR/STEM.png` and `DIR/STEM.svg`.
pub fn render(chart: &impl Chart, dir: &Path, stem: &str) -> Result<Rendered> {
    ensure_fonts()?;
    let err = |what: &str, e: String| Error::Invalid(format!("chart {stem} ({what}): {e}"));
    let png = dir.join(format!("{stem}.png"));
    let svg = dir.join(format!("{stem}.svg"));
    {
        let root =
            raster::TextBackend::new(BitMapBackend::new(&png, chart.size()))?.into_drawing_area();
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
