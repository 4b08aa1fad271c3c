//! The exponent histogram of an op's output, banded by the fp16 limits.

use super::canvas::*;

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
}
