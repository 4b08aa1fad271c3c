//! The reduction and softmax kernels on the host: f64 accumulators, one rounding.

use super::kernels::{Kernels, Lines, MaxIdx};
use crate::dtype::DType;
use crate::engine::Computed;
use crate::error::{Error, Result};
use crate::ops::shape::{gather, scatter};
use crate::ops::Pattern;
use crate::ops::{bstrides, for_each_offset, sum_to_f64, Finish};
use crate::ops::{fdata, with_float, FData};
use crate::tensor::Tensor;
use crate::tensor::{numel, Real};

/// Sums `x` (shape `full`) down to `kept` in f64, divides by `count` when given (mean),
/// rounds once.
pub(super) fn sum_fwd<T: Finish>(
    x: &[T],
    full: &[usize],
    kept: &[usize],
    count: Option<f64>,
    out_shape: &[usize],
    dtype: crate::DType,
) -> Result<Computed> {
    let mut acc = sum_to_f64(x, full, kept);
    if let Some(c) = count {
        acc.iter_mut().for_each(|a| *a /= c);
    }
    T::finish_acc(acc, out_shape, dtype)
}

/// Broadcasts `g` (shape `kept`, same rank as `full`) back to `full`, dividing by `count`
/// when given (mean), rounding once.
pub(super) fn expand_grad<T: Finish>(
    g: &[T],
    kept: &[usize],
    full: &[usize],
    count: Option<f64>,
    dtype: crate::DType,
) -> Result<Computed> {
    if let Pattern::Repeat(r) = Pattern::of(kept, full) {
        // A per-row value (a reduction over the trailing dims): each row is filled with it.
        let c = count.map(T::of);
        return crate::ops::produce(numel(full), full, dtype, |s, piece: &mut [T]| {
            for (k, y) in piece.iter_mut().enumerate() {
                let v = g[(s + k) / r];
                *y = match c {
                    Some(c) => v / c,
                    None => v,
                };
            }
        });
    }
    let s = bstrides(kept, full);
    let mut out = Vec::with_capacity(numel(full));
    match count {
        Some(c) => {
            let c = T::of(c);
            for_each_offset(full, [&s], |[j]| out.push(g[j] / c));
        }
        None => for_each_offset(full, [&s], |[j]| out.push(g[j])),
    }
    T::finish(out, full, dtype)
}

/// Flat offsets of the first maximal element of every line (a NaN counts as maximal).
pub(super) fn argmax_lines<T: Real>(x: &[T], outer: usize, n: usize, inner: usize) -> Vec<usize> {
    let mut idx = Vec::with_capacity(outer * inner);
    for_each_line(outer, n, inner, |base, st| {
        let mut best = base;
        for i in 1..n {
            let (v, b) = (x[base + i * st], x[best]);
            if b.is_nan() {
                break;
            }
            if v > b || v.is_nan() {
                best = base + i * st;
            }
        }
        idx.push(best);
    });
    idx
}

/// `y = exp(x − m)`, apart from the line's sum so that the loop vectorizes, in the AVX2
/// copy where the CPU has it (the values are the same either way).
fn exp_shifted<T: Real>(x: &[T], m: T, y: &mut [T]) {
    crate::ops::run_wide(&ExpShifted { x, m }, 0, y)
}

struct ExpShifted<'a, T> {
    x: &'a [T],
    m: T,
}

impl<T: Real> crate::ops::PieceKernel<T> for ExpShifted<'_, T> {
    #[inline(always)]
    fn run(&self, s: usize, y: &mut [T]) {
        for (yi, &xi) in y.iter_mut().zip(&self.x[s..]) {
            *yi = (xi - self.m).exp_op();
        }
    }
}

pub(super) fn softmax_fwd<T: Finish>(
    x: &[T],
    (outer, n, inner): (usize, usize, usize),
    log: bool,
    shape: &[usize],
    dtype: crate::DType,
) -> Result<Computed> {
    if inner == 1 {
        return crate::ops::produce_lines(outer, n, shape, dtype, |l, y| {
            let x = &x[l * n..(l + 1) * n];
            let m = x
                .iter()
                .fold(T::neg_infinity(), |a, &b| if b > a { b } else { a });
            exp_shifted(x, m, y);
            let s = y.iter().fold(0f64, |s, v| s + v.f64());
            if log {
                let l = T::of(s.ln());
                for (yi, &xi) in y.iter_mut().zip(x) {
                    *yi = xi - m - l;
                }
            } else {
                let s = T::of(s);
                for yi in y.iter_mut() {
                    *yi = *yi / s;
                }
            }
        });
    }
    let mut y = vec![T::zero(); x.len()];
    let mut e = vec![T::zero(); n];
    for_each_line(outer, n, inner, |base, st| {
        // A NaN in the line need not win here: exp(NaN) makes the whole line NaN anyway.
        let m = (0..n)
            .map(|i| x[base + i * st])
            .fold(T::neg_infinity(), |a, b| if b > a { b } else { a });
        let mut s = 0f64;
        for (i, ei) in e.iter_mut().enumerate() {
            *ei = (x[base + i * st] - m).exp_op();
            s += ei.f64();
        }
        if log {
            let l = T::of(s.ln());
            for i in 0..n {
                y[base + i * st] = x[base + i * st] - m - l;
            }
        } else {
            let s = T::of(s);
            for (i, &ei) in e.iter().enumerate() {
                y[base + i * st] = ei / s;
            }
        }
    });
    T::finish(y, shape, dtype)
}

/// Softmax backward `y·(g − Σ g·y)`, log-softmax backward `g − exp(y)·Σ g`, with the
/// line sums in f64.
pub(super) fn softmax_bwd<T: Finish>(
    y: &[T],
    g: &[T],
    (outer, n, inner): (usize, usize, usize),
    log: bool,
    shape: &[usize],
    dtype: crate::DType,
) -> Result<Computed> {
    if inner == 1 {
        return crate::ops::produce_lines(outer, n, shape, dtype, |l, gx| {
            let (y, g) = (&y[l * n..(l + 1) * n], &g[l * n..(l + 1) * n]);
            if log {
                let s = T::of(g.iter().map(|v| v.f64()).sum::<f64>());
                for ((d, &gv), &yv) in gx.iter_mut().zip(g).zip(y) {
                    *d = gv - yv.exp_op() * s;
                }
            } else {
                let s = T::of(
                    g.iter()
                        .zip(y)
                        .map(|(&gv, &yv)| (gv * yv).f64())
                        .sum::<f64>(),
                );
                for ((d, &gv), &yv) in gx.iter_mut().zip(g).zip(y) {
                    *d = yv * (gv - s);
                }
            }
        });
    }
    let mut gx = vec![T::zero(); y.len()];
    for_each_line(outer, n, inner, |base, st| {
        let at = |i: usize| base + i * st;
        if log {
            let s = T::of((0..n).map(|i| g[at(i)].f64()).sum::<f64>());
            for i in 0..n {
                gx[at(i)] = g[at(i)] - y[at(i)].exp_op() * s;
            }
        } else {
            let s = T::of((0..n).map(|i| (g[at(i)] * y[at(i)]).f64()).sum::<f64>());
            for i in 0..n {
                gx[at(i)] = y[at(i)] * (g[at(i)] - s);
            }
        }
    });
    T::finish(gx, shape, dtype)
}

/// Calls `f(base, stride)` for every line along the reduced dim: its elements are at
/// `base + i * stride` for `i < n`.
fn for_each_line(outer: usize, n: usize, inner: usize, mut f: impl FnMut(usize, usize)) {
    for o in 0..outer {
        for k in 0..inner {
            f(o * n * inner + k, inner);
        }
    }
}

/// The host's reduction and softmax kernels.
pub(super) struct Host;

impl Kernels for Host {
    fn sum(
        &self,
        op: &'static str,
        x: &Tensor,
        kept: &[usize],
        div: Option<f64>,
        out_shape: &[usize],
    ) -> Result<Computed> {
        let dtype = x.dtype();
        with_float!(x, op, |d| sum_fwd(
            d,
            x.shape(),
            kept,
            div,
            out_shape,
            dtype
        ))
    }

    fn sum_backward(
        &self,
        op: &'static str,
        g: &Tensor,
        (kept, full): (&[usize], &[usize]),
        div: Option<f64>,
        dtype: DType,
    ) -> Result<Computed> {
        with_float!(g, op, |gd| expand_grad(gd, kept, full, div, dtype))
    }

    fn argmax(
        &self,
        x: &Tensor,
        (outer, n, inner): Lines,
        out_shape: &[usize],
    ) -> Result<(Tensor, MaxIdx)> {
        let idx = with_float!(x, "max", |d| argmax_lines(d, outer, n, inner));
        let y = Tensor::from_storage(gather(x.storage(), &idx, "max")?, out_shape, x.dtype())?;
        Ok((y, MaxIdx::Host(idx)))
    }

    fn argmax_backward(
        &self,
        g: &Tensor,
        idx: &MaxIdx,
        _lines: Lines,
        in_shape: &[usize],
        dtype: DType,
    ) -> Result<Tensor> {
        match idx {
            MaxIdx::Host(i) => {
                let s = scatter(&[(g.storage(), i)], numel(in_shape), "max")?;
                Tensor::from_storage(s, in_shape, dtype)
            }
            MaxIdx::Device(_) => Err(Error::Device(
                "max backward: the forward's index is in device memory".into(),
            )),
        }
    }

    fn softmax(&self, op: &'static str, x: &Tensor, lines: Lines, log: bool) -> Result<Computed> {
        let (shape, dtype) = (x.shape(), x.dtype());
        with_float!(x, op, |d| softmax_fwd(d, lines, log, shape, dtype))
    }

    fn softmax_backward(
        &self,
        op: &'static str,
        y: &Tensor,
        g: &Tensor,
        lines: Lines,
        log: bool,
        dtype: DType,
    ) -> Result<Computed> {
        let shape = y.shape();
        match (fdata(y, op)?, fdata(g, op)?) {
            (FData::F32(y), FData::F32(g)) => softmax_bwd(y, g, lines, log, shape, dtype),
            (FData::F64(y), FData::F64(g)) => softmax_bwd(y, g, lines, log, shape, dtype),
            _ => Err(Error::shape(op, "gradient dtype differs from the output")),
        }
    }
}
