//! The per-op chart: largest |x| of every op of a step against the fp16 limits.

use super::canvas::*;

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
                    o.phase.name()
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
                    o.phase.name()
                ),
            ));
        }
        l
    }
}

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
        let (x0, x1) = (-0.5, n as f64 - 0.5);
        // Nothing lives above bf16's max but the non-finite markers.
        let y_label = |v: &f64| {
            if *v > BF16.max.log10() {
                String::new()
            } else {
                dec_label(*v)
            }
        };
        let mut chart = op_index_axes(
            &top,
            &self.title,
            n,
            y0..y1,
            LogAxis {
                desc: "max |x| of the output (log scale)",
                labels: 12,
                label: &y_label,
            },
        )?;
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
