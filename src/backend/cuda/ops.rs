//! Device ops: the kernels behind the engine's casts, elementwise ops and GEMM, with the
//! CPU emulator's numerics (compute in f32, round once, count over/underflow where the
//! op rounds). `counts` is the address of a slot's two rounding counters in the stats
//! arena ([`super::arena::StatsArena::round_counts_ptr`]), or 0 to not count.

use super::blas::Gemm;
use super::tensor::DeviceTensor;
use super::{dev_err, grid_for, CudaDevice, THREADS};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::ops::elementwise::{Binary, Unary};
use cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};

const MAX_DIMS: usize = 6;

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct Geometry {
    shape: [u64; MAX_DIMS],
    sa: [u64; MAX_DIMS],
    sb: [u64; MAX_DIMS],
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct GradGeometry {
    shape: [u64; MAX_DIMS],
    sa: [u64; MAX_DIMS],
    sb: [u64; MAX_DIMS],
    sg: [u64; MAX_DIMS],
    reduced: [u32; MAX_DIMS],
}

// SAFETY: plain-old-data with the C layout of the kernels' structs.
unsafe impl DeviceRepr for Geometry {}
// SAFETY: as above.
unsafe impl DeviceRepr for GradGeometry {}

fn cfg(n: u64) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid_for(n), 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Queues kernel `$name` over `$n` elements with the given arguments.
macro_rules! launch {
    ($dev:expr, $name:expr, $n:expr, $($arg:expr),+ $(,)?) => {{
        let f = $dev.func($name)?;
        let mut b = $dev.stream().launch_builder(f);
        $( b.arg($arg); )+
        // SAFETY: every pointer argument addresses live device memory of the sizes the
        // kernel derives from its length arguments; argument types and order match the
        // kernel's signature in kernels/*.cu.
        unsafe { b.launch(cfg($n)) }.map_err(|e| dev_err($name)(&e))?;
    }};
}

/// Pads a shape on the left with ones to `MAX_DIMS`.
fn pad_shape(s: &[usize]) -> Result<[u64; MAX_DIMS]> {
    if s.len() > MAX_DIMS {
        return Err(Error::Device(format!(
            "shape {s:?} has more than {MAX_DIMS} dims"
        )));
    }
    let mut out = [1u64; MAX_DIMS];
    for (o, &v) in out[MAX_DIMS - s.len()..].iter_mut().zip(s) {
        *o = v as u64;
    }
    Ok(out)
}

/// Pads strides on the left with zeros to `MAX_DIMS`.
fn pad_strides(s: &[usize]) -> [u64; MAX_DIMS] {
    let mut out = [0u64; MAX_DIMS];
    for (o, &v) in out[MAX_DIMS - s.len()..].iter_mut().zip(s) {
        *o = v as u64;
    }
    out
}

fn same_dtype(op: &str, ts: &[&DeviceTensor]) -> Result<DType> {
    let d = ts[0].dtype();
    if let Some(t) = ts.iter().find(|t| t.dtype() != d) {
        return Err(Error::shape(
            op,
            format!("operands must share a dtype, got {d} and {}", t.dtype()),
        ));
    }
    Ok(d)
}

/// Rounds `x` to `to` (any of f32, f16, bf16), counting over/underflow.
pub fn cast(dev: &CudaDevice, x: &DeviceTensor, to: DType, counts: u64) -> Result<DeviceTensor> {
    let y = DeviceTensor::for_output(dev, x.shape(), to)?;
    let (xk, yk) = (x.kind()?, y.kind()?);
    let (xp, yp, n) = (x.ptr(dev), y.ptr(dev), x.numel() as u64);
    launch!(dev, "amp_cast", n, &xp, &xk, &yp, &yk, &n, &counts);
    Ok(y)
}

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

/// `y = f(x)` in x's dtype.
pub fn unary(dev: &CudaDevice, op: Unary, x: &DeviceTensor, counts: u64) -> Result<DeviceTensor> {
    let y = DeviceTensor::for_output(dev, x.shape(), x.dtype())?;
    let k = x.kind()?;
    let (c, p0, p1, h0, h1) = unary_code(op);
    let (xp, yp, n) = (x.ptr(dev), y.ptr(dev), x.numel() as u64);
    launch!(
        dev,
        "amp_unary",
        n,
        &xp,
        &yp,
        &k,
        &n,
        &c,
        &p0,
        &p1,
        &h0,
        &h1,
        &counts
    );
    Ok(y)
}

/// `dx = f'(x)·g` from the forward input `x`, output `y` and output gradient `g`.
pub fn unary_backward(
    dev: &CudaDevice,
    op: Unary,
    x: &DeviceTensor,
    y: &DeviceTensor,
    g: &DeviceTensor,
    counts: u64,
) -> Result<DeviceTensor> {
    let dt = same_dtype(op.name(), &[x, y, g])?;
    if x.shape() != y.shape() || x.shape() != g.shape() {
        return Err(Error::shape(op.name(), "backward operands differ in shape"));
    }
    let dx = DeviceTensor::for_output(dev, x.shape(), dt)?;
    let k = x.kind()?;
    let (c, p0, p1, h0, h1) = unary_code(op);
    let (xp, yp, gp, dp) = (x.ptr(dev), y.ptr(dev), g.ptr(dev), dx.ptr(dev));
    let n = x.numel() as u64;
    launch!(
        dev,
        "amp_unary_backward",
        n,
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
        &counts
    );
    Ok(dx)
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
pub fn binary(
    dev: &CudaDevice,
    op: Binary,
    a: &DeviceTensor,
    b: &DeviceTensor,
    counts: u64,
) -> Result<DeviceTensor> {
    let dt = same_dtype(op.name(), &[a, b])?;
    let out = crate::ops::broadcast_shape(a.shape(), b.shape(), op.name())?;
    let geo = Geometry {
        shape: pad_shape(&out)?,
        sa: pad_strides(&crate::ops::bstrides(a.shape(), &out)),
        sb: pad_strides(&crate::ops::bstrides(b.shape(), &out)),
    };
    let y = DeviceTensor::for_output(dev, &out, dt)?;
    let k = y.kind()?;
    let c = binary_code(op);
    let (ap, bp, yp, n) = (a.ptr(dev), b.ptr(dev), y.ptr(dev), y.numel() as u64);
    launch!(
        dev,
        "amp_binary",
        n,
        &ap,
        &bp,
        &yp,
        &k,
        &n,
        &c,
        &geo,
        &counts
    );
    Ok(y)
}

/// The gradient of `a op b` for operand `a` (`wrt_b` false) or `b`, from the output
/// gradient `g`, summed down to the operand's shape in f64 and rounded once.
pub fn binary_grad(
    dev: &CudaDevice,
    op: Binary,
    a: &DeviceTensor,
    b: &DeviceTensor,
    g: &DeviceTensor,
    wrt_b: bool,
    counts: u64,
) -> Result<DeviceTensor> {
    let dt = same_dtype(op.name(), &[a, b, g])?;
    let full = g.shape().to_vec();
    let target = if wrt_b { b.shape() } else { a.shape() };
    let term = match (op, wrt_b) {
        (Binary::Add | Binary::Sub, false) | (Binary::Add, true) => 0,
        (Binary::Sub, true) => 1,
        (Binary::Mul, false) => 2,
        (Binary::Div, false) => 3,
        (Binary::Mul, true) => 4,
        (Binary::Div, true) => 5,
    };
    let shape = pad_shape(&full)?;
    let tshape = pad_shape(target)?;
    let mut reduced = [0u32; MAX_DIMS];
    let mut n_reduced = 1u64;
    for d in 0..MAX_DIMS {
        if tshape[d] == 1 && shape[d] > 1 {
            reduced[d] = 1;
            n_reduced *= shape[d];
        } else if tshape[d] != shape[d] {
            return Err(Error::shape(
                op.name(),
                format!("cannot sum a gradient of {full:?} down to {target:?}"),
            ));
        }
    }
    let geo = GradGeometry {
        shape,
        sa: pad_strides(&crate::ops::bstrides(a.shape(), &full)),
        sb: pad_strides(&crate::ops::bstrides(b.shape(), &full)),
        sg: pad_strides(&crate::tensor::strides(&full)),
        reduced,
    };
    let out = DeviceTensor::for_output(dev, target, dt)?;
    let k = out.kind()?;
    let (ap, bp, gp, op_) = (a.ptr(dev), b.ptr(dev), g.ptr(dev), out.ptr(dev));
    let n = out.numel() as u64;
    launch!(
        dev,
        "amp_binary_grad",
        n,
        &ap,
        &bp,
        &gp,
        &op_,
        &k,
        &n,
        &term,
        &geo,
        &n_reduced,
        &counts
    );
    Ok(out)
}

/// Matrix product of row-major `a` (…×m×k, or k×m with `trans_a`) and `b` (…×k×n, or
/// n×k with `trans_b`): 2-D × 2-D, 3-D × 3-D (same batch) or 3-D × 2-D (shared b).
/// cuBLAS accumulates in f32; the f32 result is rounded once to the operands' dtype by
/// the cast kernel, which counts over/underflow.
pub fn matmul(
    dev: &CudaDevice,
    a: &DeviceTensor,
    b: &DeviceTensor,
    trans_a: bool,
    trans_b: bool,
    counts: u64,
) -> Result<DeviceTensor> {
    let dt = same_dtype("matmul", &[a, b])?;
    let (sa, sb) = (a.shape(), b.shape());
    let mat = |s: &[usize], t: bool| -> Result<(usize, usize, usize)> {
        match s.len() {
            2 if t => Ok((1, s[1], s[0])),
            2 => Ok((1, s[0], s[1])),
            3 if t => Ok((s[0], s[2], s[1])),
            3 => Ok((s[0], s[1], s[2])),
            _ => Err(Error::shape(
                "matmul",
                format!("expected 2-D or 3-D operands, got {s:?}"),
            )),
        }
    };
    let (ba, m, k) = mat(sa, trans_a)?;
    let (bb, k2, n) = mat(sb, trans_b)?;
    if k != k2 || (bb != 1 && bb != ba) || (sb.len() == 3 && sa.len() == 2) {
        return Err(Error::shape(
            "matmul",
            format!("cannot multiply {sa:?} (trans {trans_a}) by {sb:?} (trans {trans_b})"),
        ));
    }
    let g = Gemm {
        m,
        n,
        k,
        trans_a,
        trans_b,
        batch: ba,
        stride_a: m * k,
        stride_b: if sb.len() == 3 { k * n } else { 0 },
    };
    let out_shape: Vec<usize> = if sa.len() == 3 {
        vec![ba, m, n]
    } else {
        vec![m, n]
    };
    let acc = DeviceTensor::for_output(dev, &out_shape, DType::F32)?;
    // SAFETY: a, b and acc are live device tensors of exactly the sizes `g` implies.
    unsafe {
        dev.blas()
            .gemm_f32_out(g, a.kind()?, a.ptr(dev), b.ptr(dev), acc.ptr(dev))?
    };
    if dt == DType::F32 {
        return Ok(acc);
    }
    cast(dev, &acc, dt, counts)
}
