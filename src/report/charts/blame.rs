//! The blame chart: every op of a blamed step (`--blame`), the relative error its own
//! rounding introduces against the error its output carries in all.

use super::canvas::*;
use crate::trace::record::Phase;

/// One blamed step's ops in execution order: introduced and total relative error.
#[derive(Debug, Clone)]
pub struct BlameChart {
    /// Title.
    pub title: String,
    /// `(op index, introduced, total)`.
    pub ops: Vec<(u64, f64, f64)>,
    /// The index of the first blamed op of the backward and of the optimizer phase, where
    /// the chart marks each.
    pub phases_from: Vec<(Phase, u64)>,
}

impl BlameChart {
    /// The chart of step `step` of `trace`; `None` when no op of that step was blamed.
    pub fn for_step(trace: &Trace, step: u64) -> Option<BlameChart> {
        let s = trace.steps.iter().find(|s| s.step == step)?;
        let records = s.ops.as_ref()?;
        let ops: Vec<(u64, f64, f64)> = records
            .iter()
            .filter_map(|o| o.blame.map(|b| (o.index, b.introduced, b.total)))
            .collect();
        let phases_from = [Phase::Backward, Phase::Optimizer]
            .into_iter()
            .filter_map(|p| {
                let first = records.iter().find(|o| o.blame.is_some() && o.phase == p)?;
                Some((p, first.index))
            })
            .collect();
        (!ops.is_empty()).then(|| BlameChart {
            // (the model's short name, its first word, so that the title fits)
            title: format!(
                "Relative error of every op against f64, step {step} ({} {})",
                trace.header.model.split_whitespace().next().unwrap_or(""),
                trace.header.precision
            ),
            ops,
            phases_from,
        })
    }

    fn legend(&self) -> Legend {
        Legend(vec![
            (
                Symbol::Circle(C_INF),
                "introduced: the op's output against the op computed in f64 from its own inputs"
                    .into(),
            ),
            (
                Symbol::Circle(C_FORWARD),
                "total: the op's output against the all-f64 shadow of the step".into(),
            ),
            (
                Symbol::Cross(C_GREY),
                "no error (drawn at the bottom)".into(),
            ),
        ])
    }
}

impl Chart for BlameChart {
    fn size(&self) -> (u32, u32) {
        (1200, 520 + self.legend().height())
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult<DB> {
        let legend = self.legend();
        let (_, h) = root.dim_in_pixel();
        let (top, bottom) = root.split_vertically(h - legend.height());
        let logs: Vec<f64> = self
            .ops
            .iter()
            .flat_map(|o| [o.1, o.2])
            .filter(|v| positive(*v))
            .map(f64::log10)
            .collect();
        let y0 = logs.iter().copied().fold(-8.0, f64::min).floor() - 1.0;
        let y1 = logs.iter().copied().fold(-1.0, f64::max).ceil() + 0.5;
        let n = self.ops.iter().map(|o| o.0).max().map_or(1, |m| m + 1);
        let (x0, x1) = (-0.5, n as f64 - 0.5);
        let mut chart = op_index_axes(
            &top,
            &self.title,
            n,
            y0..y1,
            LogAxis {
                desc: "relative error (log scale)",
                labels: 10,
                label: &|v| dec_label(*v),
            },
        )?;
        let radius = match self.ops.len() {
            0..=150 => 4,
            151..=600 => 3,
            _ => 2,
        };
        chart.draw_series(
            self.ops
                .iter()
                .filter(|o| positive(o.2))
                .map(|o| Circle::new((o.0 as f64, o.2.log10()), radius + 1, C_FORWARD.filled())),
        )?;
        chart.draw_series(
            self.ops
                .iter()
                .filter(|o| positive(o.1))
                .map(|o| Circle::new((o.0 as f64, o.1.log10()), radius, C_INF.filled())),
        )?;
        chart.draw_series(
            self.ops
                .iter()
                .filter(|o| !positive(o.2))
                .map(|o| Cross::new((o.0 as f64, y0 + 0.3), radius + 1, C_GREY.stroke_width(2))),
        )?;
        for &(phase, from) in &self.phases_from {
            // (the phases run one after the other: a line where each starts)
            let color = match phase {
                Phase::Optimizer => C_OPTIMIZER,
                _ => C_BACKWARD,
            };
            let x = from as f64 - 0.5;
            chart.draw_series(std::iter::once(PathElement::new(
                vec![(x, y0), (x, y1)],
                color.stroke_width(2),
            )))?;
            chart.draw_series(std::iter::once(Text::new(
                format!("{} →", phase.name()),
                (x + (x1 - x0) * 0.005, y1 - 0.15),
                text(14).color(&color),
            )))?;
        }
        let (l, _) = chart.plotting_area().get_pixel_range();
        legend.draw(&bottom, l.start)?;
        Ok(())
    }
}
