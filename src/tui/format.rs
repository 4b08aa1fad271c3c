//! Short text forms of numbers, names and op references, shared by the panels.

use crate::dtype::DType;
use crate::trace::record::{OpRef, Phase};

pub use crate::numfmt::{scale_short as pow2, short as num};

/// Label of a log2 axis tick: `2^k`.
pub fn log2_label(k: i32) -> String {
    format!("2^{k}")
}

/// A share as a percentage with one decimal (`12.5%`); `<0.1%` for a small nonzero share.
pub fn pct(frac: f64) -> String {
    if frac.is_nan() {
        "NaN".into()
    } else if frac > 0.0 && frac < 0.0005 {
        "<0.1%".into()
    } else {
        format!("{:.1}%", frac * 100.0)
    }
}

/// `fwd`, `bwd` or `opt`.
pub fn phase(p: Phase) -> &'static str {
    match p {
        Phase::Forward => "fwd",
        Phase::Backward => "bwd",
        Phase::Optimizer => "opt",
    }
}

/// `f16`, `bf16`, `f32`, `f64`, `i64`.
pub fn dtype(d: DType) -> &'static str {
    match d {
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        DType::F32 => "f32",
        DType::F64 => "f64",
        DType::I64 => "i64",
    }
}

/// A module path, `<root>` for the empty one.
pub use crate::trace::record::module_name as module;

/// `op@module`, the short name of an op in a chain.
pub fn op_at(op: &str, m: &str) -> String {
    format!("{op}@{}", module(m))
}

/// `step 3 · bwd #13 to @ loss`: where an op ran.
pub fn op_ref(o: &OpRef) -> String {
    format!(
        "step {} · {} #{} {} @ {}",
        o.step,
        phase(o.phase),
        o.op_index,
        o.op,
        module(&o.module)
    )
}

/// Number of terminal cells `s` takes (every char one cell: the UI's own text and trace
/// names are narrow characters).
pub fn width(s: &str) -> usize {
    s.chars().count()
}

/// `s` cut to `w` cells from the right end, with `…` where text was dropped.
pub fn clip(s: &str, w: usize) -> String {
    let n = width(s);
    if n <= w {
        s.to_string()
    } else if w == 0 {
        String::new()
    } else {
        let mut out: String = s.chars().take(w - 1).collect();
        out.push('…');
        out
    }
}

/// `s` cut to `w` cells keeping its end (the informative part of a dotted module path),
/// with `…` in front where text was dropped.
pub fn clip_left(s: &str, w: usize) -> String {
    let n = width(s);
    if n <= w {
        s.to_string()
    } else if w == 0 {
        String::new()
    } else {
        let mut out = String::from("…");
        out.extend(s.chars().skip(n - (w - 1)));
        out
    }
}

/// A dotted module path shortened to `w` cells without losing which block it is: word
/// segments are abbreviated from the left (`encoder` → `e`, `DenseReluDense` → `DRD`),
/// numbers and the last segment kept, until it fits; then abbreviated words are dropped
/// from the left; then it is clipped from the left.
/// `encoder.block.11.layer.1.DenseReluDense.wo` in 20 cells is `e.b.11.l.1.DRD.wo`, in
/// 14 cells `11.l.1.DRD.wo`.
pub fn short_path(s: &str, w: usize) -> String {
    if width(s) <= w {
        return s.to_string();
    }
    let segs: Vec<&str> = s.split('.').collect();
    let mut out: Vec<String> = segs.iter().map(|x| x.to_string()).collect();
    let joined = |v: &[String]| v.join(".");
    for i in 0..segs.len().saturating_sub(1) {
        if width(&joined(&out)) <= w {
            break;
        }
        let seg = segs[i];
        if seg.is_empty() || seg.chars().all(|c| c.is_ascii_digit()) {
            continue;
        }
        let caps: String = seg.chars().filter(|c| c.is_uppercase()).collect();
        out[i] = if caps.chars().count() >= 2 {
            caps
        } else {
            seg.chars().take(1).collect()
        };
    }
    // Still too long: drop the abbreviated words from the left, keeping the numbers
    // (`0.l.1.DRD.fc1` still says block 0).
    let mut i = 0;
    while width(&joined(&out)) > w && i + 1 < out.len() {
        if out[i].chars().all(|c| c.is_ascii_digit()) {
            i += 1;
        } else {
            out.remove(i);
        }
    }
    clip_left(&joined(&out), w)
}

/// `s` padded with spaces (or clipped) to exactly `w` cells, left-aligned.
pub fn pad(s: &str, w: usize) -> String {
    let s = clip(s, w);
    let n = width(&s);
    format!("{s}{}", " ".repeat(w - n))
}

/// `s` padded with spaces (or clipped) to exactly `w` cells, right-aligned.
pub fn rpad(s: &str, w: usize) -> String {
    let s = clip(s, w);
    let n = width(&s);
    format!("{}{s}", " ".repeat(w - n))
}

const LEVELS: [char; 8] = ['▁', '▂', '▃', '▄', '▅', '▆', '▇', '█'];

/// One character per value: `▁`…`█` scaled between the smallest and largest finite value,
/// `×` for a non-finite value (`Some(NaN or inf)`), a space for a missing one (`None`).
pub fn sparkline(values: &[Option<f64>]) -> String {
    let finite = values.iter().flatten().filter(|v| v.is_finite());
    let (lo, hi) = finite.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &v| {
        (lo.min(v), hi.max(v))
    });
    values
        .iter()
        .map(|v| match v {
            None => ' ',
            Some(v) if !v.is_finite() => '×',
            Some(v) => {
                if hi > lo {
                    let t = (v - lo) / (hi - lo);
                    LEVELS[((t * 7.0).round() as usize).min(7)]
                } else {
                    LEVELS[3]
                }
            }
        })
        .collect()
}

/// Evenly spaced integer log2 ticks covering `[min, max]`: returns the axis bounds
/// `(lo, hi)` (integers, `hi > lo`) and the tick exponents from `lo` to `hi`, at most
/// `max_ticks` of them (at least 2), equally spaced so that labels placed evenly along
/// the axis sit on their values.
pub fn log2_ticks(min: f64, max: f64, max_ticks: usize) -> (i32, i32, Vec<i32>) {
    let max_ticks = max_ticks.max(2);
    let (mut lo, mut hi) = if min.is_finite() && max.is_finite() && min <= max {
        (min.floor() as i32, max.ceil() as i32)
    } else {
        (0, 1)
    };
    if hi <= lo {
        lo -= 1;
        hi += 1;
    }
    let span = (hi - lo) as usize;
    // The smallest step that needs at most max_ticks ticks, then widen the top so the
    // span is a multiple of it.
    let step = span.div_ceil(max_ticks - 1).max(1);
    let n = span.div_ceil(step);
    hi = lo + (n * step) as i32;
    let ticks = (0..=n).map(|i| lo + (i * step) as i32).collect();
    (lo, hi, ticks)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_are_short_and_exact_where_it_matters() {
        assert_eq!(num(f64::NAN), "NaN");
        assert_eq!(num(f64::NEG_INFINITY), "-inf");
        assert_eq!(num(0.0), "0");
        assert_eq!(num(2.2989702224731445), "2.299");
        assert_eq!(num(65504.0), "65504");
        assert_eq!(num(0.00123456), "0.001235");
        assert_eq!(num(1e30), "1e30");
        assert_eq!(num(-6.0098809810188945e28), "-6.01e28");
        assert_eq!(num(1.5e-7), "1.5e-7");
        assert!(num(-12345.678).len() <= 9);
    }

    #[test]
    fn powers_of_two_are_named() {
        assert_eq!(pow2(65536.0), "2^16");
        assert_eq!(pow2(0.5), "2^-1");
        assert_eq!(pow2(1.0000000150474662e30), "1e30");
        assert_eq!(pow2(0.0), "0");
        assert_eq!(pow2(f64::INFINITY), "inf");
    }

    #[test]
    fn clipping_keeps_the_requested_width() {
        let m = "encoder.block.11.layer.1.DenseReluDense.wo";
        assert_eq!(clip_left(m, 16), "…nseReluDense.wo");
        assert_eq!(width(&clip_left(m, 16)), 16);
        assert_eq!(clip("softmax_backward", 8), "softmax…");
        assert_eq!(pad("ab", 4), "ab  ");
        assert_eq!(rpad("ab", 4), "  ab");
        assert_eq!(pad("abcdef", 4), "abc…");
        assert_eq!(short_path(m, 20), "e.b.11.l.1.DRD.wo");
        assert_eq!(short_path(m, 30), "e.b.11.l.1.DenseReluDense.wo");
        assert_eq!(short_path(m, 100), m);
        assert_eq!(short_path(m, 14), "11.l.1.DRD.wo");
        assert_eq!(short_path("fc1", 2), "…1");
        assert_eq!(short_path(m, 8), "11.1.wo");
    }

    #[test]
    fn sparkline_scales_and_marks_nonfinite() {
        let s = sparkline(&[Some(0.0), Some(7.0), Some(f64::NAN), None, Some(3.5)]);
        assert_eq!(s, "▁█× ▅");
        assert_eq!(sparkline(&[Some(1.0), Some(1.0)]), "▄▄");
    }

    #[test]
    fn log2_ticks_are_even_and_cover_the_range() {
        let (lo, hi, t) = log2_ticks(18.0, 24.0, 4);
        assert_eq!((lo, hi), (18, 24));
        assert_eq!(t, vec![18, 20, 22, 24]);
        let (lo, hi, t) = log2_ticks(-3.2, 9.7, 5);
        assert!(lo <= -4 && hi >= 10, "{lo} {hi}");
        assert!(t.len() <= 5 && t.len() >= 2);
        assert_eq!(*t.first().unwrap(), lo);
        assert_eq!(*t.last().unwrap(), hi);
        let steps: Vec<i32> = t.windows(2).map(|w| w[1] - w[0]).collect();
        assert!(steps.iter().all(|&s| s == steps[0]));
        // A flat series still gets a span.
        let (lo, hi, _) = log2_ticks(16.0, 16.0, 5);
        assert!(lo < 16 && hi > 16);
    }
}
