//! Unary maps and broadcasting binary arithmetic on the device (`elementwise.cu`), with
//! the CPU emulator's numerics: compute in f32, round once, count where the op rounds.

use super::functions::{Binary, Unary};
use super::kernels::Kernels;
pub use super::kernels::Side;
use crate::dtype::DType;
use crate::engine::Computed;
use crate::error::{Error, Result};
use crate::ops::cuda::{
    arg, collapse, device_of, launch, launch_with, output, pad_shape, pad_strides, same_dtype,
    Geometry, GradGeometry, Out, MAX_DIMS,
};
use crate::tensor::Tensor;

/// The kernels of `elementwise.cu`.
pub const KERNELS: &[&str] = &[
    "amp_unary",
    "amp_unary_backward",
    "amp_binary",
    "amp_binary_grad",
    "amp_binary_grad_same",
    "amp_binary_grad_warp",
    "amp_inf_flag_clear",
    "amp_inf_flag",
];

/// Kernel code and scalar parameters of a unary op.
fn unary_code(op: Unary) -> (i32, f64, f64, i32, i32) {
    match op {
        Unary::Neg => (0, 0.0, 0.0, 0, 0),
        Unary::Relu => (1, 0.0, 0.0, 0, 0),
        Unary::GeluErf => (2, 0.0, 0.0, 0, 0),
        Unary::GeluTanh => (3, 0.0, 0.0, 0, 0),
        Unary::Silu => (4, 0.0, 0.0, 0, 0),
        Unary::Tanh => (5, 0.0, 0.0, 0, 0),
        Unary::Sigmoid => (6, 0.0, 0.0, 0, 0),
        Unary::Exp => (7, 0.0, 0.0, 0, 0),
        Unary::Log => (8, 0.0, 0.0, 0, 0),
        Unary::Sqrt => (9, 0.0, 0.0, 0, 0),
        Unary::Rsqrt => (10, 0.0, 0.0, 0, 0),
        Unary::Pow(p) => (11, p, 0.0, 0, 0),
        Unary::Clamp(lo, hi) => (
            12,
            lo.unwrap_or(0.0),
            hi.unwrap_or(0.0),
            lo.is_some() as i32,
            hi.is_some() as i32,
        ),
        Unary::MulScalar(s) => (13, s, 0.0, 0, 0),
        Unary::AddScalar(s) => (14, s, 0.0, 0, 0),
    }
}

/// Where a unary op's two scalar parameters switch on the device: while `flag` (from
/// [`inf_flag`]) is set, `p0` and `p1` replace the op's own (transformers' T5 clamp, whose
/// bound is larger once an inf has been seen), with no read on the host.
#[derive(Clone, Copy)]
pub struct Switch<'a> {
    /// A one-word device flag.
    pub flag: &'a Tensor,
    /// The first parameter while it is set.
    pub p0: f64,
    /// The second parameter while it is set.
    pub p1: f64,
}

impl Switch<'_> {
    /// The kernel's switch arguments: the flag's address (0: none) and the parameters.
    fn args(s: Option<Self>, name: &str) -> Result<(u64, f64, f64)> {
        match s {
            Some(s) => Ok((arg(s.flag, name)?.0, s.p0, s.p1)),
            None => Ok((0, 0.0, 0.0)),
        }
    }
}

/// `y = f(x)` in x's dtype, its parameters switched by `switch` where given.
pub fn unary(op: Unary, x: &Tensor, switch: Option<Switch<'_>>, sink: Out) -> Result<Tensor> {
    let name = op.name();
    let dev = device_of(name, &[x])?;
    let y = output(&dev, x.shape(), x.dtype())?;
    let ((xp, k), (yp, _)) = (arg(x, name)?, arg(&y, name)?);
    let (c, p0, p1, h0, h1) = unary_code(op);
    let (fp, q0, q1) = Switch::args(switch, name)?;
    let n = x.numel() as u64;
    let o = sink.for_output(&y, n)?;
    launch_with!(
        dev,
        "amp_unary",
        o.cfg,
        &xp,
        &yp,
        &k,
        &n,
        &c,
        &p0,
        &p1,
        &h0,
        &h1,
        &fp,
        &q0,
        &q1,
        &o.counts,
        &o.partials
    );
    Ok(y)
}

/// `dx = f'(x)·g` from the forward input `x`, output `y` and output gradient `g`, with the
/// forward's `switch`.
pub fn unary_backward(
    op: Unary,
    (x, y, g): (&Tensor, &Tensor, &Tensor),
    switch: Option<Switch<'_>>,
    sink: Out,
) -> Result<Tensor> {
    let name = op.name();
    let dt = same_dtype(name, &[x, y, g])?;
    if x.shape() != y.shape() || x.shape() != g.shape() {
        return Err(Error::shape(name, "backward operands differ in shape"));
    }
    let dev = device_of(name, &[x, y, g])?;
    let dx = output(&dev, x.shape(), dt)?;
    let ((xp, k), (yp, _), (gp, _), (dp, _)) =
        (arg(x, name)?, arg(y, name)?, arg(g, name)?, arg(&dx, name)?);
    let (c, p0, p1, h0, h1) = unary_code(op);
    let (fp, q0, q1) = Switch::args(switch, name)?;
    let n = x.numel() as u64;
    let o = sink.for_output(&dx, n)?;
    launch_with!(
        dev,
        "amp_unary_backward",
        o.cfg,
        &xp,
        &yp,
        &gp,
        &dp,
        &k,
        &n,
        &c,
        &p0,
        &p1,
        &h0,
        &h1,
        &fp,
        &q0,
        &q1,
        &o.counts,
        &o.partials
    );
    Ok(dx)
}

/// A one-word device flag, set when any value of `x` is infinite (two launches, no read).
pub fn inf_flag(x: &Tensor) -> Result<Tensor> {
    let name = "clamp";
    let dev = device_of(name, &[x])?;
    let flag = output(&dev, &[1], crate::dtype::DType::F32)?;
    let ((xp, k), (fp, _)) = (arg(x, name)?, arg(&flag, name)?);
    let n = x.numel() as u64;
    launch!(dev, "amp_inf_flag_clear", 1u64, &fp);
    launch!(dev, "amp_inf_flag", n, &xp, &k, &n, &fp);
    Ok(flag)
}

fn binary_code(op: Binary) -> i32 {
    match op {
        Binary::Add => 0,
        Binary::Sub => 1,
        Binary::Mul => 2,
        Binary::Div => 3,
    }
}

/// `a op b` with broadcasting, in the operands' (shared) dtype.
pub fn binary(op: Binary, a: &Tensor, b: &Tensor, sink: Out) -> Result<Tensor> {
    let name = op.name();
    let dt = same_dtype(name, &[a, b])?;
    let dev = device_of(name, &[a, b])?;
    let out = crate::ops::broadcast_shape(a.shape(), b.shape(), name)?;
    let mut geo = Geometry {
        shape: pad_shape(&out)?,
        sa: pad_strides(&crate::ops::bstrides(a.shape(), &out)),
        sb: pad_strides(&crate::ops::bstrides(b.shape(), &out)),
    };
    collapse(&mut geo.shape, &mut [&mut geo.sa, &mut geo.sb], None);
    let y = output(&dev, &out, dt)?;
    let ((ap, _), (bp, _), (yp, k)) = (arg(a, name)?, arg(b, name)?, arg(&y, name)?);
    let c = binary_code(op);
    let n = y.numel() as u64;
    let o = sink.for_output(&y, n)?;
    launch_with!(
        dev,
        "amp_binary",
        o.cfg,
        &ap,
        &bp,
        &yp,
        &k,
        &n,
        &c,
        &geo,
        &o.counts,
        &o.partials
    );
    Ok(y)
}

/// The gradient of `a op b` for operand `a` (`wrt_b` false) or `b`, from the output
/// gradient `g`, summed down to the operand's shape in f64 and rounded once.
pub fn binary_grad(
    op: Binary,
    a: &Tensor,
    b: &Tensor,
    g: &Tensor,
    wrt_b: bool,
    sink: Out,
) -> Result<Tensor> {
    let side = |t| Side {
        shape: Tensor::shape(t),
        values: Some(t),
    };
    binary_grad_of(op, [side(a), side(b)], g, wrt_b, sink)
}

/// The kernel's gradient term of `a op b` for operand `b` (`wrt_b`) or `a`.
fn grad_term(op: Binary, wrt_b: bool) -> i32 {
    match (op, wrt_b) {
        (Binary::Add | Binary::Sub, false) | (Binary::Add, true) => 0,
        (Binary::Sub, true) => 1,
        (Binary::Mul, false) => 2,
        (Binary::Div, false) => 3,
        (Binary::Mul, true) => 4,
        (Binary::Div, true) => 5,
    }
}

/// The geometry of summing a gradient of shape `full` down to `target` (one of the
/// operand shapes `[a, b]`), collapsed, and how many elements each output sums.
fn grad_geometry(
    name: &str,
    [a_shape, b_shape]: [&[usize]; 2],
    full: &[usize],
    target: &[usize],
) -> Result<(GradGeometry, u64)> {
    let shape = pad_shape(full)?;
    let tshape = pad_shape(target)?;
    let mut reduced = [0u32; MAX_DIMS];
    let mut n_reduced = 1u64;
    for d in 0..MAX_DIMS {
        if tshape[d] == 1 && shape[d] > 1 {
            reduced[d] = 1;
            n_reduced *= shape[d];
        } else if tshape[d] != shape[d] {
            return Err(Error::shape(
                name,
                format!("cannot sum a gradient of {full:?} down to {target:?}"),
            ));
        }
    }
    let mut geo = GradGeometry {
        shape,
        sa: pad_strides(&crate::ops::bstrides(a_shape, full)),
        sb: pad_strides(&crate::ops::bstrides(b_shape, full)),
        sg: pad_strides(&crate::tensor::strides(full)),
        reduced,
    };
    collapse(
        &mut geo.shape,
        &mut [&mut geo.sa, &mut geo.sb, &mut geo.sg],
        Some(&mut geo.reduced),
    );
    Ok((geo, n_reduced))
}

/// [`binary_grad`] from operands of which only the values the term reads are kept: the
/// multiply's and divide's terms read the operands their formulas name, an add's and a
/// subtraction's none. `g` is passed to the kernel in place of an operand it does not
/// read (never loaded: `grad_term_at` loads only what its term reads).
pub fn binary_grad_of<'a>(
    op: Binary,
    [sa, sb]: [Side<'a>; 2],
    g: &'a Tensor,
    wrt_b: bool,
    sink: Out,
) -> Result<Tensor> {
    let name = op.name();
    let term = grad_term(op, wrt_b);
    let (reads_a, reads_b) = op.grad_reads([!wrt_b, wrt_b]);
    let value = |s: Side<'a>, reads: bool, which: &str| -> Result<&'a Tensor> {
        match s.values {
        Some(t) => Ok(t),
        None if !reads => Ok(g),
        None => Err(Error::Device(format!(
            "{name} backward: the {which} operand's values were not kept, and its gradient term reads them"
        ))),
        }
    };
    let a = value(sa, reads_a, "left")?;
    let b = value(sb, reads_b, "right")?;
    let dt = same_dtype(name, &[a, b, g])?;
    let dev = device_of(name, &[a, b, g])?;
    let full = g.shape().to_vec();
    let (a_shape, b_shape) = (sa.shape, sb.shape);
    let target = if wrt_b { b_shape } else { a_shape };
    let (geo, n_reduced) = grad_geometry(name, [a_shape, b_shape], &full, target)?;
    let out = output(&dev, target, dt)?;
    let ((ap, _), (bp, _), (gp, _), (op_, k)) = (
        arg(a, name)?,
        arg(b, name)?,
        arg(g, name)?,
        arg(&out, name)?,
    );
    let n = out.numel() as u64;
    // The CPU's reductions (`sum_to_f64`): a per-row run sums as Rust's `Sum` does, from
    // -0.0; the other patterns from +0.0. Only the sign of an all-zero sum depends on it.
    let init = match crate::ops::Pattern::of(target, &full) {
        crate::ops::Pattern::Repeat(_) => -0.0f64,
        _ => 0.0f64,
    };
    if n_reduced == 1 && a_shape == full.as_slice() && b_shape == full.as_slice() {
        let o = sink.for_output(&out, n)?;
        launch_with!(
            dev,
            "amp_binary_grad_same",
            o.cfg,
            &ap,
            &bp,
            &gp,
            &op_,
            &k,
            &n,
            &term,
            &o.counts,
            &o.partials
        );
        return Ok(out);
    }
    if n_reduced >= 32 {
        // A warp per output element; its statistics come from the arena's own pass.
        let counts = sink.counts();
        launch!(
            dev,
            "amp_binary_grad_warp",
            n * 32,
            &ap,
            &bp,
            &gp,
            &op_,
            &k,
            &n,
            &term,
            &geo,
            &n_reduced,
            &init,
            &counts
        );
        return Ok(out);
    }
    let o = sink.for_output(&out, n)?;
    launch_with!(
        dev,
        "amp_binary_grad",
        o.cfg,
        &ap,
        &bp,
        &gp,
        &op_,
        &k,
        &n,
        &term,
        &geo,
        &n_reduced,
        &init,
        &o.counts,
        &o.partials
    );
    Ok(out)
}

/// The device's elementwise kernels: each op's output written, rounded and counted by one
/// launch into the op's arena slot.
pub struct Device;

/// The switch of a forward that was given `on_inf`, from the flag it made.
fn switch(flag: Option<&Tensor>, on_inf: Option<(f64, f64)>) -> Option<Switch<'_>> {
    flag.zip(on_inf)
        .map(|(flag, (p0, p1))| Switch { flag, p0, p1 })
}

impl Kernels for Device {
    fn any_inf(&self, _x: &Tensor) -> Result<Option<bool>> {
        Ok(None)
    }

    fn unary(
        &self,
        op: Unary,
        x: &Tensor,
        on_inf: Option<(f64, f64)>,
    ) -> Result<(Computed, Option<Tensor>)> {
        let flag = on_inf.map(|_| inf_flag(x)).transpose()?;
        let (slot, sink) = crate::ops::device_out(x)?;
        let y = unary(op, x, switch(flag.as_ref(), on_inf), sink)?;
        Ok((Computed::pending(y, slot), flag))
    }

    fn unary_backward(
        &self,
        op: Unary,
        xyg: (&Tensor, &Tensor, &Tensor),
        _dtype: DType,
        kept: Option<&Tensor>,
        on_inf: Option<(f64, f64)>,
    ) -> Result<Computed> {
        let (slot, sink) = crate::ops::device_out(xyg.2)?;
        let dx = unary_backward(op, xyg, switch(kept, on_inf), sink)?;
        Ok(Computed::pending(dx, slot))
    }

    fn binary(&self, op: Binary, a: &Tensor, b: &Tensor, _out_shape: &[usize]) -> Result<Computed> {
        let (slot, sink) = crate::ops::device_out(a)?;
        Ok(Computed::pending(binary(op, a, b, sink)?, slot))
    }

    fn binary_grad(
        &self,
        op: Binary,
        sides: [Side<'_>; 2],
        g: &Tensor,
        _out_shape: &[usize],
        _dtype: DType,
        wrt_b: bool,
    ) -> Result<Computed> {
        let (slot, sink) = crate::ops::device_out(g)?;
        Ok(Computed::pending(
            binary_grad_of(op, sides, g, wrt_b, sink)?,
            slot,
        ))
    }
}
