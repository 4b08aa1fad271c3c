//! The gradient heatmap: per-parameter gradient magnitudes over the steps.

use super::canvas::*;

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
    /// The colour bar beside the heatmap, with fp16's max, smallest normal and smallest
    /// subnormal marked.
    fn draw_colour_bar<DB: DrawingBackend>(
        &self,
        right: &DrawingArea<DB, Shift>,
        range: (f64, f64),
    ) -> DrawResult<DB> {
        let uf = FP16.min_subnormal.log10();
        let mn = FP16.min_normal.log10();
        let of = FP16.max.log10();
        let b0 = range.0.min(uf - 0.6).floor();
        let b1 = range.1.max(of + 0.6).ceil();
        let mut bar = ChartBuilder::on(right)
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
        Ok(())
    }

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
        self.draw_colour_bar(&right, range)?;
        let (l, _) = chart.plotting_area().get_pixel_range();
        legend.draw(&bottom, l.start)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn colormap_ends_and_clamps() {
        assert_eq!(colormap(0.0), RGBColor(68, 1, 84));
        assert_eq!(colormap(1.0), RGBColor(253, 231, 37));
        assert_eq!(colormap(2.0), colormap(1.0));
        assert_eq!(colormap(f64::NAN), colormap(0.0));
    }
}
