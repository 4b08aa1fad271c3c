//! The elementwise kernels on the host: compute in `T` (f32, or f64 for the reference),
//! round once to the output dtype.
//!
//! Each kernel is instantiated per op variant (the `per_*` macros), so the loop over the
//! elements carries no dispatch and compiles to straight-line code; [`produce`] computes
//! and rounds the output piece by piece over rayon's threads.

use super::functions::{Binary, Unary};
use super::kernels::{Kernels, Side};
use crate::dtype::DType;
use crate::engine::Computed;
use crate::error::{Error, Result};
use crate::ops::{
    bstrides, fdata, for_each_offset, produce, produce_wide, sum_to, FData, Finish, Pattern,
    PieceKernel,
};
use crate::tensor::{erf_f32, exp_f32, Real, Storage, Tensor};

/// Runs `$body` with `$o` bound to a closure that returns `$op`: a closure type per
/// variant, so `$o().f(..)` and `$o().df(..)` inline to the one arm inside the loops (a
/// captured enum value would be matched on per element).
macro_rules! per_unary {
    ($op:expr, |$o:ident| $body:expr) => {
        match $op {
            Unary::Neg => {
                let $o = move || Unary::Neg;
                $body
            }
            Unary::Relu => {
                let $o = move || Unary::Relu;
                $body
            }
            Unary::GeluErf => {
                let $o = move || Unary::GeluErf;
                $body
            }
            Unary::GeluTanh => {
                let $o = move || Unary::GeluTanh;
                $body
            }
            Unary::Silu => {
                let $o = move || Unary::Silu;
                $body
            }
            Unary::Tanh => {
                let $o = move || Unary::Tanh;
                $body
            }
            Unary::Sigmoid => {
                let $o = move || Unary::Sigmoid;
                $body
            }
            Unary::Exp => {
                let $o = move || Unary::Exp;
                $body
            }
            Unary::Log => {
                let $o = move || Unary::Log;
                $body
            }
            Unary::Sqrt => {
                let $o = move || Unary::Sqrt;
                $body
            }
            Unary::Rsqrt => {
                let $o = move || Unary::Rsqrt;
                $body
            }
            Unary::Pow(p) => {
                let $o = move || Unary::Pow(p);
                $body
            }
            Unary::Clamp(lo, hi) => {
                let $o = move || Unary::Clamp(lo, hi);
                $body
            }
            Unary::MulScalar(s) => {
                let $o = move || Unary::MulScalar(s);
                $body
            }
            Unary::AddScalar(s) => {
                let $o = move || Unary::AddScalar(s);
                $body
            }
        }
    };
}

/// [`per_unary`] for the binary ops.
macro_rules! per_binary {
    ($op:expr, |$o:ident| $body:expr) => {
        match $op {
            Binary::Add => {
                let $o = move || Binary::Add;
                $body
            }
            Binary::Sub => {
                let $o = move || Binary::Sub;
                $body
            }
            Binary::Mul => {
                let $o = move || Binary::Mul;
                $body
            }
            Binary::Div => {
                let $o = move || Binary::Div;
                $body
            }
        }
    };
}

pub(super) fn unary<T: Finish>(
    x: &[T],
    op: Unary,
    shape: &[usize],
    dtype: DType,
) -> Result<Computed> {
    per_unary!(op, |o| produce_wide(
        x.len(),
        shape,
        dtype,
        UnaryFwd { x, o }
    ))
}

/// y = f(x), element by element.
struct UnaryFwd<'a, T, O> {
    x: &'a [T],
    o: O,
}

impl<T: Real, O: Fn() -> Unary + Sync + Send> PieceKernel<T> for UnaryFwd<'_, T, O> {
    #[inline(always)]
    fn run(&self, s: usize, out: &mut [T]) {
        for (y, &v) in out.iter_mut().zip(&self.x[s..]) {
            *y = (self.o)().f(v);
        }
    }
}

pub(super) fn unary_backward<T: Finish>(
    x: &[T],
    y: &[T],
    g: &[T],
    op: Unary,
    shape: &[usize],
    dtype: DType,
) -> Result<Computed> {
    let n = x.len().min(y.len()).min(g.len());
    per_unary!(op, |o| produce_wide(
        n,
        shape,
        dtype,
        UnaryBwd { x, y, g, o }
    ))
}

/// dL/dx = df(x, y, dL/dy), element by element.
struct UnaryBwd<'a, T, O> {
    x: &'a [T],
    y: &'a [T],
    g: &'a [T],
    o: O,
}

impl<T: Real, O: Fn() -> Unary + Sync + Send> PieceKernel<T> for UnaryBwd<'_, T, O> {
    #[inline(always)]
    fn run(&self, s: usize, out: &mut [T]) {
        let e = s + out.len();
        let (x, y, g) = (&self.x[s..e], &self.y[s..e], &self.g[s..e]);
        for (((d, &xv), &yv), &gv) in out.iter_mut().zip(x).zip(y).zip(g) {
            *d = (self.o)().df(xv, yv, gv);
        }
    }
}

/// The exact GELU's forward on f32 storage, keeping its `cdf = ½(1 + erf(x/√2))` (in f32)
/// for the backward, so that erf is evaluated once per element in a step instead of
/// twice. The output is `(½x)·(2·cdf)`: `2·cdf` is `1 + erf(x/√2)` exactly (halving and
/// doubling a normal f32 are exact, and `1 + erf` is 0 or at least 2^-24), so the values are
/// those of [`Unary::f`].
pub(super) fn gelu_erf_fwd(x: &[f32], shape: &[usize], dtype: DType) -> Result<(Computed, Tensor)> {
    let cdf = produce_wide(x.len(), shape, DType::F32, GeluCdf { x })?.tensor;
    let y = {
        let Storage::F32(c) = cdf.storage() else {
            unreachable!("a host f32 computation")
        };
        produce_wide(x.len(), shape, dtype, GeluFromCdf { x, cdf: c })?
    };
    Ok((y, cdf))
}

/// The exact GELU's backward from its kept `cdf`: `g·(cdf + x·pdf)`, as [`Unary::df`].
pub(super) fn gelu_erf_bwd(
    x: &[f32],
    cdf: &[f32],
    g: &[f32],
    shape: &[usize],
    dtype: DType,
) -> Result<Computed> {
    produce_wide(x.len(), shape, dtype, GeluBwdFromCdf { x, cdf, g })
}

struct GeluCdf<'a> {
    x: &'a [f32],
}

impl PieceKernel<f32> for GeluCdf<'_> {
    #[inline(always)]
    fn run(&self, s: usize, out: &mut [f32]) {
        for (c, &x) in out.iter_mut().zip(&self.x[s..]) {
            *c = 0.5 * (1.0 + erf_f32(x * std::f32::consts::FRAC_1_SQRT_2));
        }
    }
}

struct GeluFromCdf<'a> {
    x: &'a [f32],
    cdf: &'a [f32],
}

impl PieceKernel<f32> for GeluFromCdf<'_> {
    #[inline(always)]
    fn run(&self, s: usize, out: &mut [f32]) {
        for ((y, &x), &c) in out.iter_mut().zip(&self.x[s..]).zip(&self.cdf[s..]) {
            *y = 0.5 * x * (c * 2.0);
        }
    }
}

struct GeluBwdFromCdf<'a> {
    x: &'a [f32],
    cdf: &'a [f32],
    g: &'a [f32],
}

impl PieceKernel<f32> for GeluBwdFromCdf<'_> {
    #[inline(always)]
    fn run(&self, s: usize, out: &mut [f32]) {
        let e = s + out.len();
        let (x, cdf, g) = (&self.x[s..e], &self.cdf[s..e], &self.g[s..e]);
        let k = f32::of(1.0 / (2.0 * std::f64::consts::PI).sqrt());
        for (((d, &x), &c), &g) in out.iter_mut().zip(x).zip(cdf).zip(g) {
            let pdf = exp_f32(-0.5 * x * x) * k;
            *d = g * (c + x * pdf);
        }
    }
}

/// How a broadcast operand of an elementwise op is read, element by element of the
/// output.
#[derive(Clone, Copy)]
enum Read<'a, T> {
    /// Same shape as the output.
    Same(&'a [T]),
    /// Output element i reads operand element i % len (a bias).
    Tile(&'a [T]),
    /// Output element i reads operand element i / r (a per-row scale).
    Repeat(&'a [T], usize),
}

impl<'a, T: Copy> Read<'a, T> {
    fn of(data: &'a [T], shape: &[usize], out: &[usize]) -> Option<Read<'a, T>> {
        if shape == out {
            return Some(Read::Same(data));
        }
        match Pattern::of(shape, out) {
            Pattern::Tile(k) if k == data.len() => Some(Read::Tile(data)),
            Pattern::Repeat(r) => Some(Read::Repeat(data, r)),
            _ => None,
        }
    }

    /// Calls `f(j, v)` for output elements `s..s + n`, `v` this operand's value there.
    #[inline(always)]
    fn run(self, s: usize, n: usize, mut f: impl FnMut(usize, T)) {
        match self {
            Read::Same(d) => {
                for (j, &v) in d[s..s + n].iter().enumerate() {
                    f(j, v);
                }
            }
            Read::Tile(d) => {
                let k = d.len();
                let (mut j, mut i) = (0, s % k);
                while j < n {
                    let take = (k - i).min(n - j);
                    for (t, &v) in d[i..i + take].iter().enumerate() {
                        f(j + t, v);
                    }
                    j += take;
                    i = 0;
                }
            }
            Read::Repeat(d, r) => {
                let mut j = 0;
                while j < n {
                    let at = s + j;
                    let take = (r - at % r).min(n - j);
                    let v = d[at / r];
                    for t in 0..take {
                        f(j + t, v);
                    }
                    j += take;
                }
            }
        }
    }
}

/// `h(a, b)` over the broadcast output shape, for the patterns [`Read`] knows: `None`
/// when an operand is laid out otherwise.
fn broadcast2<T: Finish>(
    (a, sa): (&[T], &[usize]),
    (b, sb): (&[T], &[usize]),
    out: &[usize],
    dtype: DType,
    h: impl Fn(T, T) -> T + Sync + Send,
) -> Option<Result<Computed>> {
    let n: usize = out.iter().product();
    let (ra, rb) = (Read::of(a, sa, out)?, Read::of(b, sb, out)?);
    Some(produce(n, out, dtype, |s, piece: &mut [T]| {
        if let (Read::Same(a), Read::Same(b)) = (ra, rb) {
            let e = s + piece.len();
            for ((y, &x), &z) in piece.iter_mut().zip(&a[s..e]).zip(&b[s..e]) {
                *y = h(x, z);
            }
            return;
        }
        ra.run(s, piece.len(), |j, x| piece[j] = x);
        rb.run(s, piece.len(), |j, z| piece[j] = h(piece[j], z));
    }))
}

pub(super) fn binary<T: Finish>(
    a: &[T],
    sa: &[usize],
    b: &[T],
    sb: &[usize],
    out: &[usize],
    op: Binary,
    dtype: DType,
) -> Result<Computed> {
    per_binary!(op, |o| {
        if let Some(r) = broadcast2((a, sa), (b, sb), out, dtype, |x, y| o().f(x, y)) {
            return r;
        }
        let n: usize = out.iter().product();
        let mut res = Vec::with_capacity(n);
        let (ta, tb) = (bstrides(sa, out), bstrides(sb, out));
        for_each_offset(out, [&ta, &tb], |[i, j]| res.push(o().f(a[i], b[j])));
        T::finish(res, out, dtype)
    })
}

/// Gradient of one operand of a broadcast binary op: `h(a, b, g)` at the full shape,
/// summed down to the operand's shape.
// A kernel takes its operands, their shapes and the output dtype explicitly.
#[allow(clippy::too_many_arguments)]
pub(super) fn binary_grad<T: Finish>(
    a: &[T],
    sa: &[usize],
    b: &[T],
    sb: &[usize],
    g: &[T],
    out: &[usize],
    target: &[usize],
    dtype: DType,
    h: impl Fn(T, T, T) -> T + Sync + Send,
) -> Result<Computed> {
    let n: usize = out.iter().product();
    if sa == out && sb == out {
        let m = a.len().min(b.len()).min(g.len());
        return produce(m, target, dtype, |s, piece: &mut [T]| {
            let e = s + piece.len();
            for (((d, &x), &y), &gv) in piece.iter_mut().zip(&a[s..e]).zip(&b[s..e]).zip(&g[s..e]) {
                *d = h(x, y, gv);
            }
        });
    }
    if target == out {
        // The gradient of the operand that has the output's shape: nothing to sum, so it
        // is produced (and rounded) directly.
        let fast = match (Read::of(a, sa, out), Read::of(b, sb, out)) {
            (Some(ra), Some(rb)) => Some(produce(n, target, dtype, |s, piece: &mut [T]| {
                let m = piece.len();
                let mut bv = vec![T::zero(); m];
                ra.run(s, m, |j, x| piece[j] = x);
                rb.run(s, m, |j, y| bv[j] = y);
                for ((d, &y), &gv) in piece.iter_mut().zip(&bv).zip(&g[s..s + m]) {
                    *d = h(*d, y, gv);
                }
            })),
            _ => None,
        };
        if let Some(r) = fast {
            return r;
        }
    }
    if let (Some(ra), Some(rb), true) = (Read::of(a, sa, out), Read::of(b, sb, out), g.len() >= n) {
        // Summed to a bias (Tile) or a per-row value (Repeat): the terms are summed as they
        // are made, in the order `sum_to` sums the full product.
        match Pattern::of(target, out) {
            Pattern::Tile(k) if k > 0 && n.is_multiple_of(k) && target != out => {
                let mut acc = vec![0f64; k];
                let mut row = vec![T::zero(); k];
                let mut bv = vec![T::zero(); k];
                for r in 0..n / k {
                    let s = r * k;
                    ra.run(s, k, |j, x| row[j] = x);
                    rb.run(s, k, |j, y| bv[j] = y);
                    for (((t, &x), &y), &gv) in acc.iter_mut().zip(&row).zip(&bv).zip(&g[s..s + k])
                    {
                        *t += h(x, y, gv).f64();
                    }
                }
                return T::finish_acc(acc, target, dtype);
            }
            Pattern::Repeat(r) if r > 0 && n.is_multiple_of(r) && target != out => {
                let (mut row, mut bv) = (vec![T::zero(); r], vec![T::zero(); r]);
                let acc: Vec<f64> = (0..n / r)
                    .map(|i| {
                        let s = i * r;
                        ra.run(s, r, |j, x| row[j] = x);
                        rb.run(s, r, |j, y| bv[j] = y);
                        row.iter()
                            .zip(&bv)
                            .zip(&g[s..s + r])
                            .map(|((&x, &y), &gv)| h(x, y, gv).f64())
                            .sum()
                    })
                    .collect();
                return T::finish_acc(acc, target, dtype);
            }
            _ => {}
        }
    }
    let full = match (Read::of(a, sa, out), Read::of(b, sb, out)) {
        (Some(ra), Some(rb)) if g.len() >= n => {
            let (mut full, mut bv) = (vec![T::zero(); n], vec![T::zero(); n]);
            ra.run(0, n, |j, x| full[j] = x);
            rb.run(0, n, |j, y| bv[j] = y);
            for ((d, &y), &gv) in full.iter_mut().zip(&bv).zip(g) {
                *d = h(*d, y, gv);
            }
            full
        }
        _ => {
            let mut full = Vec::with_capacity(n);
            let (ta, tb) = (bstrides(sa, out), bstrides(sb, out));
            let tg = crate::tensor::strides(out);
            for_each_offset(out, [&ta, &tb, &tg], |[i, j, k]| {
                full.push(h(a[i], b[j], g[k]))
            });
            full
        }
    };
    sum_to(&full, out, target, dtype)
}

/// The host's elementwise kernels: computed over rayon's threads, read at once.
pub(super) struct Host;

impl Kernels for Host {
    fn any_inf(&self, x: &Tensor) -> Result<Option<bool>> {
        Ok(Some(x.f32s()?.iter().any(|v| v.is_infinite())))
    }

    fn unary(
        &self,
        op: Unary,
        x: &Tensor,
        on_inf: Option<(f64, f64)>,
    ) -> Result<(Computed, Option<Tensor>)> {
        if on_inf.is_some() {
            return Err(Error::Device(format!(
                "{}: a parameter switch on an inf is decided on a device only",
                op.name()
            )));
        }
        // The exact GELU keeps its cdf for the backward (erf once, not twice).
        if let (Unary::GeluErf, FData::F32(d)) = (op, fdata(x, op.name())?) {
            let (y, cdf) = gelu_erf_fwd(d, x.shape(), x.dtype())?;
            return Ok((y, Some(cdf)));
        }
        let y = crate::ops::with_float!(x, op.name(), |d| unary(d, op, x.shape(), x.dtype()))?;
        Ok((y, None))
    }

    fn unary_backward(
        &self,
        op: Unary,
        (xs, ys, g): (&Tensor, &Tensor, &Tensor),
        dtype: DType,
        kept: Option<&Tensor>,
        _on_inf: Option<(f64, f64)>,
    ) -> Result<Computed> {
        let shape = g.shape();
        if let Some(cdf) = kept {
            return match (
                fdata(xs, "backward")?,
                fdata(cdf, "backward")?,
                fdata(g, "backward")?,
            ) {
                (FData::F32(a), FData::F32(c), FData::F32(gd)) => {
                    gelu_erf_bwd(a, c, gd, shape, dtype)
                }
                _ => Err(Error::shape(op.name(), "gradient dtype differs from input")),
            };
        }
        match (
            fdata(xs, "backward")?,
            fdata(ys, "backward")?,
            fdata(g, "backward")?,
        ) {
            (FData::F32(a), FData::F32(b), FData::F32(c)) => {
                unary_backward(a, b, c, op, shape, dtype)
            }
            (FData::F64(a), FData::F64(b), FData::F64(c)) => {
                unary_backward(a, b, c, op, shape, dtype)
            }
            _ => Err(Error::shape(op.name(), "gradient dtype differs from input")),
        }
    }

    fn binary(&self, op: Binary, a: &Tensor, b: &Tensor, out_shape: &[usize]) -> Result<Computed> {
        crate::ops::with_float2!(a, b, op.name(), |x, y| binary(
            x,
            a.shape(),
            y,
            b.shape(),
            out_shape,
            op,
            a.dtype()
        ))
    }

    fn binary_grad(
        &self,
        op: Binary,
        [sa, sb]: [Side<'_>; 2],
        g: &Tensor,
        out_shape: &[usize],
        dtype: DType,
        wrt_b: bool,
    ) -> Result<Computed> {
        // An operand whose values no needed gradient reads: `g`, at least as long, stands
        // in (never read).
        let at = sa.values.unwrap_or(g);
        let bt = sb.values.unwrap_or(g);
        let (na, nb) = (
            crate::tensor::numel(sa.shape),
            crate::tensor::numel(sb.shape),
        );
        let shapes = (sa.shape, sb.shape, out_shape);
        match (
            fdata(at, "backward")?,
            fdata(bt, "backward")?,
            fdata(g, "backward")?,
        ) {
            (FData::F32(x), FData::F32(y), FData::F32(gg)) => {
                let (x, y) = (&x[..na.min(x.len())], &y[..nb.min(y.len())]);
                grad_of(op, wrt_b, (x, y, gg), shapes, dtype)
            }
            (FData::F64(x), FData::F64(y), FData::F64(gg)) => {
                let (x, y) = (&x[..na.min(x.len())], &y[..nb.min(y.len())]);
                grad_of(op, wrt_b, (x, y, gg), shapes, dtype)
            }
            _ => Err(Error::shape(
                op.name(),
                "gradient dtype differs from inputs",
            )),
        }
    }
}

/// One operand's gradient of `a op b` on the host: an add's (and a subtraction's left
/// operand's) `g` summed to the operand's shape, the others' terms per element, summed.
fn grad_of<T: Finish>(
    op: Binary,
    wrt_b: bool,
    (a, b, g): (&[T], &[T], &[T]),
    (sa, sb, out): (&[usize], &[usize], &[usize]),
    dtype: DType,
) -> Result<Computed> {
    let target = if wrt_b { sb } else { sa };
    match (op, wrt_b) {
        (Binary::Add, _) | (Binary::Sub, false) => sum_to(g, out, target, dtype),
        (Binary::Sub, true) => binary_grad(a, sa, b, sb, g, out, target, dtype, |_, _, g| -g),
        (Binary::Mul, false) => binary_grad(a, sa, b, sb, g, out, target, dtype, |_, b, g| g * b),
        (Binary::Div, false) => binary_grad(a, sa, b, sb, g, out, target, dtype, |_, b, g| g / b),
        (Binary::Mul, true) => binary_grad(a, sa, b, sb, g, out, target, dtype, |a, _, g| g * a),
        (Binary::Div, true) => binary_grad(a, sa, b, sb, g, out, target, dtype, |a, b, g| {
            -g * a / (b * b)
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::Tensor;

    /// Values that overflow and underflow fp16 now and then, so the counts are exercised.
    fn data(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let k = (i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 8;
                let v = (k % 2001) as f32 - 1000.0;
                match k % 97 {
                    0 => v * 1e3,
                    1 => v * 1e-9,
                    _ => v * 0.37,
                }
            })
            .collect()
    }

    /// The general path's values for `h` over the broadcast shape.
    fn general(a: &[f32], sa: &[usize], b: &[f32], sb: &[usize], out: &[usize]) -> Vec<f32> {
        let mut r = Vec::new();
        let (ta, tb) = (bstrides(sa, out), bstrides(sb, out));
        for_each_offset(out, [&ta, &tb], |[i, j]| r.push(a[i] * b[j] - a[i]));
        r
    }

    fn same(c: &Computed, want: Vec<f32>, shape: &[usize], dtype: DType) {
        let w = Tensor::from_f32(want.clone(), shape, dtype).unwrap();
        let mut expect = want;
        let counts = crate::dtype::round_slice(dtype, &mut expect);
        let got = c.tensor.f32s().unwrap();
        assert_eq!(got.len(), expect.len());
        for (i, (x, y)) in got.iter().zip(w.f32s().unwrap()).enumerate() {
            assert_eq!(x.to_bits(), y.to_bits(), "element {i} of {shape:?}");
        }
        assert_eq!(c.rounding, counts, "{shape:?}");
    }

    /// The exact GELU with its kept cdf gives the values and counts of the one-element
    /// formulas (`Unary::f`, `Unary::df`), bit for bit, in every dtype: large and tiny
    /// values, where erf is ±1, and the special values included.
    #[test]
    fn gelu_with_kept_cdf_matches_the_elementwise_formulas() {
        let mut x = data(70_000, 4);
        x.extend([
            0.0,
            -0.0,
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            -5.6,
            -5.5,
            f32::from_bits(1),
            -1e-30,
            1e30,
        ]);
        let g = data(x.len(), 5);
        let shape = [x.len()];
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let (y, cdf) = gelu_erf_fwd(&x, &shape, dtype).unwrap();
            let want: Vec<f32> = x.iter().map(|&v| Unary::GeluErf.f(v)).collect();
            same(&y, want, &shape, dtype);
            let Storage::F32(c) = cdf.storage() else {
                unreachable!()
            };
            let Storage::F32(yv) = y.tensor.storage() else {
                unreachable!()
            };
            let dx = gelu_erf_bwd(&x, c, &g, &shape, dtype).unwrap();
            let want: Vec<f32> = (0..x.len())
                .map(|i| Unary::GeluErf.df(x[i], yv[i], g[i]))
                .collect();
            same(&dx, want, &shape, dtype);
        }
    }

    #[test]
    fn broadcast_fast_paths_match_the_general_path_bit_for_bit() {
        let cases: &[(&[usize], &[usize])] = &[
            (&[4, 300, 70], &[70]),
            (&[4, 300, 70], &[4, 300, 1]),
            (&[70], &[4, 300, 70]),
            (&[4, 300, 1], &[4, 300, 70]),
            (&[2, 256, 256], &[256]),
            (&[2, 256, 256], &[2, 256, 1]),
            (&[2, 256, 256], &[2, 256, 256]),
            (&[3, 1, 5], &[3, 7, 5]),
        ];
        for &(sa, sb) in cases {
            let out = crate::ops::broadcast_shape(sa, sb, "test").unwrap();
            let (a, b) = (data(sa.iter().product(), 1), data(sb.iter().product(), 2));
            for dtype in [DType::F32, DType::F16, DType::BF16] {
                let h = |x: f32, y: f32| x * y - x;
                let r = match broadcast2((&a, sa), (&b, sb), &out, dtype, h) {
                    Some(r) => r.unwrap(),
                    None => continue,
                };
                same(&r, general(&a, sa, &b, sb, &out), &out, dtype);
                // The gradient of the output-shaped operand goes through its own fast path.
                let n: usize = out.iter().product();
                let g = data(n, 3);
                for (target, other) in [(sa, sb), (sb, sa)] {
                    if target != out.as_slice() {
                        // Summed down to the operand: against the general full product
                        // summed by `sum_to`.
                        let k = |x: f32, y: f32, gv: f32| gv * x - y;
                        let mut full = Vec::new();
                        let (ta, tb) = (bstrides(sa, &out), bstrides(sb, &out));
                        let mut idx = 0;
                        for_each_offset(&out, [&ta, &tb], |[i, j]| {
                            full.push(k(a[i], b[j], g[idx]));
                            idx += 1;
                        });
                        let want = sum_to(&full, &out, target, dtype).unwrap();
                        let got = binary_grad(&a, sa, &b, sb, &g, &out, target, dtype, k).unwrap();
                        let bits = |c: &Computed| {
                            c.tensor
                                .f32s()
                                .unwrap()
                                .iter()
                                .map(|x| x.to_bits())
                                .collect::<Vec<_>>()
                        };
                        assert_eq!(bits(&got), bits(&want), "{sa:?} {sb:?} -> {target:?}");
                        assert_eq!(got.rounding, want.rounding);
                        continue;
                    }
                    let k = |x: f32, y: f32, gv: f32| gv * x + y;
                    let got = if target == sa {
                        binary_grad(&a, sa, &b, sb, &g, &out, target, dtype, k)
                    } else {
                        binary_grad(&b, sb, &a, sa, &g, &out, target, dtype, k)
                    }
                    .unwrap();
                    let (t, o) = if target == sa { (&a, &b) } else { (&b, &a) };
                    let mut want = Vec::new();
                    let (tt, to) = (bstrides(target, &out), bstrides(other, &out));
                    let mut idx = 0;
                    for_each_offset(&out, [&tt, &to], |[i, j]| {
                        want.push(k(t[i], o[j], g[idx]));
                        idx += 1;
                    });
                    same(&got, want, &out, dtype);
                }
            }
        }
    }
}
