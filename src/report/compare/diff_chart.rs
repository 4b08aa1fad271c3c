//! The per-op difference chart of a comparison: each aligned op's relative difference from
//! the reference, on a log scale, marked by class.

use super::comparison::{Class, OpDiff};
use crate::report::charts::{
    Chart, DrawResult, Legend, PlainChart, Symbol, C_GREY, C_GRID_BOLD, C_GRID_LIGHT, PALETTE,
};
use crate::report::facts::{fmt_pct, module_name};
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use std::collections::HashMap;

/// Relative differences of aligned ops: one point per op, runs by colour, range failures
/// as crosses, the threshold and each run's first divergence marked.
#[derive(Debug, Clone)]
pub struct DiffChart {
    /// Title.
    pub title: String,
    /// Per run: label and its matched ops.
    pub runs: Vec<(String, Vec<OpDiff>)>,
    /// Threshold of divergence.
    pub threshold: f64,
}

/// Floor of the y axis (log10): identical statistics are drawn here.
const DIFF_FLOOR: f64 = -8.0;

impl DiffChart {
    /// Positions of `(step, reference op index)` on the x axis, in order.
    fn positions(&self) -> Vec<(u64, u64)> {
        let mut p: Vec<(u64, u64)> = self
            .runs
            .iter()
            .flat_map(|r| r.1.iter().map(|o| (o.step, o.ref_index)))
            .collect();
        p.sort_unstable();
        p.dedup();
        p
    }

    fn y(rel: f64) -> f64 {
        if rel > 0.0 {
            rel.log10().max(DIFF_FLOOR)
        } else {
            DIFF_FLOOR
        }
    }

    fn legend(&self) -> Legend {
        let mut l = Legend::default();
        for (i, (label, ops)) in self.runs.iter().enumerate() {
            let c = PALETTE[i % PALETTE.len()];
            l.0.push((
                Symbol::Circle(c),
                format!("{label}: op within range (rounding)"),
            ));
            if ops.iter().any(|o| o.class == Class::Range) {
                l.0.push((
                    Symbol::Cross(c),
                    format!("{label}: range failure (Inf/NaN, overflow, underflow)"),
                ));
            }
            if let Some(o) = ops.iter().find(|o| o.diverged) {
                l.0.push((
                    Symbol::Dashed(c),
                    format!(
                        "{label}: first divergence, step {} op #{} {} in {} ({})",
                        o.step,
                        o.run_index,
                        o.op,
                        module_name(&o.module),
                        o.class.name()
                    ),
                ));
            }
        }
        l.0.push((
            Symbol::Dashed(C_GREY),
            format!("threshold {}", fmt_pct(self.threshold)),
        ));
        l
    }
}

impl Chart for DiffChart {
    fn size(&self) -> (u32, u32) {
        (1200, 560 + self.legend().height())
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult<DB> {
        let legend = self.legend();
        let (_, h) = root.dim_in_pixel();
        let (top, bottom) = root.split_vertically(h - legend.height());
        let pos = self.positions();
        let frame = self.frame(&pos);
        let mut chart = ChartBuilder::on(&top)
            .caption(
                &self.title,
                ("sans-serif", 22, FontStyle::Bold)
                    .into_font()
                    .color(&BLACK),
            )
            .margin(12)
            .x_label_area_size(50)
            .y_label_area_size(80)
            .build_cartesian_2d(-0.5..frame.x1, frame.y0..frame.y1)?;
        draw_mesh(&mut chart, &pos, &frame)?;
        draw_step_boundaries(&mut chart, &top, &pos, &frame)?;
        self.draw_runs(&mut chart, &pos, &frame)?;
        let (l, _) = chart.plotting_area().get_pixel_range();
        legend.draw(&bottom, l.start)?;
        Ok(())
    }
}

/// The plot's extent and how its points are drawn, from the x positions.
struct Frame {
    x1: f64,
    y0: f64,
    y1: f64,
    /// Where non-finite differences are drawn.
    top_row: f64,
    /// Whether the positions span more than one step.
    multi_step: bool,
    radius: i32,
}

impl DiffChart {
    fn frame(&self, pos: &[(u64, u64)]) -> Frame {
        let finite_hi = self
            .runs
            .iter()
            .flat_map(|r| r.1.iter().map(|o| o.rel()))
            .filter(|r| r.is_finite())
            .map(Self::y)
            .fold(self.threshold.log10().max(DIFF_FLOOR) + 1.0, f64::max);
        let y1 = finite_hi.ceil() + 2.0;
        Frame {
            x1: pos.len().max(1) as f64 - 0.5,
            y0: DIFF_FLOOR - 0.5,
            y1,
            top_row: y1 - 0.8,
            multi_step: pos.first().map(|p| p.0) != pos.last().map(|p| p.0),
            radius: match pos.len() {
                0..=300 => 4,
                301..=1000 => 3,
                _ => 2,
            },
        }
    }

    /// The threshold line, then each run: its first divergence and its ops by class.
    fn draw_runs<DB: DrawingBackend>(
        &self,
        chart: &mut PlainChart<'_, DB>,
        pos: &[(u64, u64)],
        frame: &Frame,
    ) -> DrawResult<DB> {
        let at: HashMap<(u64, u64), usize> = pos.iter().enumerate().map(|(i, p)| (*p, i)).collect();
        let (x1, y0, y1, top_row, radius) =
            (frame.x1, frame.y0, frame.y1, frame.top_row, frame.radius);
        let t = self.threshold.log10().max(DIFF_FLOOR);
        chart.draw_series(DashedLineSeries::new(
            vec![(-0.5, t), (x1, t)],
            8,
            6,
            C_GREY.stroke_width(2),
        ))?;
        for (i, (_, ops)) in self.runs.iter().enumerate() {
            let c = PALETTE[i % PALETTE.len()];
            if let Some(o) = ops.iter().find(|o| o.diverged) {
                let x = at[&(o.step, o.ref_index)] as f64;
                chart.draw_series(DashedLineSeries::new(
                    vec![(x, y0), (x, y1)],
                    10,
                    6,
                    c.stroke_width(2),
                ))?;
            }
            let y = |o: &OpDiff| {
                if o.rel().is_finite() {
                    Self::y(o.rel())
                } else {
                    top_row
                }
            };
            chart.draw_series(ops.iter().filter(|o| o.class == Class::Rounding).map(|o| {
                Circle::new(
                    (at[&(o.step, o.ref_index)] as f64, y(o)),
                    radius,
                    c.filled(),
                )
            }))?;
            chart.draw_series(ops.iter().filter(|o| o.class == Class::Range).map(|o| {
                Cross::new(
                    (at[&(o.step, o.ref_index)] as f64, y(o)),
                    radius + 2,
                    c.stroke_width(2),
                )
            }))?;
        }
        Ok(())
    }
}

/// Axes, grid and labels: x the aligned ops (with their steps when there are several), y
/// the log10 difference.
fn draw_mesh<DB: DrawingBackend>(
    chart: &mut PlainChart<'_, DB>,
    pos: &[(u64, u64)],
    frame: &Frame,
) -> DrawResult<DB> {
    let (multi_step, top_row) = (frame.multi_step, frame.top_row);
    chart
        .configure_mesh()
        .x_desc(if multi_step {
            "aligned op (step:reference op index, in execution order)"
        } else {
            "aligned op (reference op index, in execution order)"
        })
        .y_desc("relative difference from the reference (log)")
        .axis_desc_style(("sans-serif", 16).into_font().color(&BLACK))
        .label_style(("sans-serif", 13).into_font().color(&BLACK))
        .bold_line_style(C_GRID_BOLD)
        .light_line_style(C_GRID_LIGHT)
        .x_labels(pos.len().clamp(2, 16))
        .y_labels(12)
        .x_label_formatter(&|v| {
            let i = v.round();
            if (v - i).abs() < 1e-9 && i >= 0.0 {
                pos.get(i as usize).map_or_else(String::new, |p| {
                    if multi_step {
                        format!("{}:#{}", p.0, p.1)
                    } else {
                        format!("#{}", p.1)
                    }
                })
            } else {
                String::new()
            }
        })
        .y_label_formatter(&|v| {
            if (v - v.round()).abs() > 1e-9 || *v > top_row - 1.0 {
                String::new()
            } else if *v <= DIFF_FLOOR {
                "≤1e-8".to_string()
            } else {
                format!("1e{}", v.round() as i64)
            }
        })
        .draw()?;
    Ok(())
}

/// Step boundaries; labels thinned so they never overlap.
fn draw_step_boundaries<DB: DrawingBackend>(
    chart: &mut PlainChart<'_, DB>,
    top: &DrawingArea<DB, Shift>,
    pos: &[(u64, u64)],
    frame: &Frame,
) -> DrawResult<DB> {
    let (y0, y1) = (frame.y0, frame.y1);
    let (ox, oy) = top.get_base_pixel();
    let mut prev_step = None;
    let mut label_end = i32::MIN;
    for (i, p) in pos.iter().enumerate() {
        if prev_step != Some(p.0) {
            let x = i as f64 - 0.5;
            chart.draw_series(LineSeries::new(
                vec![(x, y0), (x, y1)],
                C_GREY.mix(0.5).stroke_width(1),
            ))?;
            let q = chart.backend_coord(&(x, y1));
            if q.0 >= label_end {
                let label = format!("step {}", p.0);
                label_end = q.0 + 8 * label.len() as i32 + 12;
                top.draw(&Text::new(
                    label,
                    (q.0 - ox + 4, q.1 - oy + 4),
                    ("sans-serif", 13)
                        .into_font()
                        .color(&C_GREY)
                        .pos(Pos::new(HPos::Left, VPos::Top)),
                ))?;
            }
            prev_step = Some(p.0);
        }
    }
    Ok(())
}
