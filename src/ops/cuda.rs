//! What every op family's CUDA host code shares: launch geometry, and the checks that turn
//! tensors into kernel arguments.
//!
//! A family's `cuda.rs` queues its kernels on the device's stream and never waits: rounding
//! counts go to the address `counts` (a slot of the probe arena,
//! [`StatsArena::round_counts_ptr`](crate::device::cuda::arena::StatsArena::round_counts_ptr)),
//! or nowhere when it is 0.

use crate::device::cuda::{buffer, grid_for, CudaDevice, DeviceBuffer, THREADS};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use cudarc::driver::{DeviceRepr, LaunchConfig};
use std::sync::Arc;

pub(crate) const MAX_DIMS: usize = 6;

/// Broadcast geometry of a binary kernel (`Geometry` in elementwise.cu).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Geometry {
    pub shape: [u64; MAX_DIMS],
    pub sa: [u64; MAX_DIMS],
    pub sb: [u64; MAX_DIMS],
}

/// Geometry of a gradient summed down to an operand's shape (`GradGeometry`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct GradGeometry {
    pub shape: [u64; MAX_DIMS],
    pub sa: [u64; MAX_DIMS],
    pub sb: [u64; MAX_DIMS],
    pub sg: [u64; MAX_DIMS],
    pub reduced: [u32; MAX_DIMS],
}

// SAFETY: plain-old-data with the C layout of the kernels' structs.
unsafe impl DeviceRepr for Geometry {}
// SAFETY: as above.
unsafe impl DeviceRepr for GradGeometry {}

/// One thread per element in a grid-stride loop over `n` elements.
pub(crate) fn cfg(n: u64) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid_for(n), 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Queues kernel `$name` over `$n` elements with the given arguments.
macro_rules! launch {
    ($dev:expr, $name:expr, $n:expr, $($arg:expr),+ $(,)?) => {
        $crate::ops::cuda::launch_with!($dev, $name, $crate::ops::cuda::cfg($n), $($arg),+)
    };
}
pub(crate) use launch;

/// Queues kernel `$name` on launch shape `$cfg` with the given arguments.
macro_rules! launch_with {
    ($dev:expr, $name:expr, $cfg:expr, $($arg:expr),+ $(,)?) => {{
        use cudarc::driver::PushKernelArg;
        $dev.check_args($name, 0 $(+ { let _ = stringify!($arg); 1 })+)?;
        let f = $dev.func($name)?;
        let mut b = $dev.stream().launch_builder(f);
        $( b.arg($arg); )+
        // SAFETY: every pointer argument addresses live device memory of the sizes the
        // kernel derives from its length arguments; argument types and order match the
        // kernel's signature in the family's .cu source.
        unsafe { b.launch($cfg) }
            .map_err(|e| $crate::device::cuda::dev_err($name)(&e))?;
    }};
}
pub(crate) use launch_with;

/// An op's arena slot as its kernels see it: where the kernel that rounds the op's output
/// counts over/underflow and, while the arena gathers statistics in producing kernels,
/// where that kernel leaves the output's statistics.
#[derive(Debug, Clone, Copy, Default)]
pub struct Out {
    slot: Option<u32>,
    counts: u64,
}

/// What the kernel writing an op's final output is launched with ([`Out::for_output`]).
pub struct OutArgs {
    /// The slot's rounding counters (0: not counted).
    pub counts: u64,
    /// The slot's partial sums when the kernel gathers the output's statistics, else 0.
    pub partials: u64,
    /// The launch shape: the statistics pass's when gathering, else one thread per element.
    pub cfg: LaunchConfig,
}

impl Out {
    /// Nowhere: the rounding is not counted and no statistics are gathered (an
    /// intermediate result of an op, or a kernel run outside any op).
    pub const NONE: Out = Out {
        slot: None,
        counts: 0,
    };

    /// Slot `slot`, whose rounding counters are at device address `counts`.
    pub fn new(slot: u32, counts: u64) -> Out {
        Out {
            slot: Some(slot),
            counts,
        }
    }

    /// The rounding counters' address, for a kernel that counts but never gathers.
    pub fn counts(&self) -> u64 {
        self.counts
    }

    /// The arguments of the kernel that writes `y`, the op's whole final output, `n`
    /// elements long.
    pub fn for_output(&self, y: &Tensor, n: u64) -> Result<OutArgs> {
        let partials = match self.slot {
            Some(slot) => {
                let c = y.cuda("op output")?;
                if c.buf.len() as u64 != n {
                    return Err(Error::Device(format!(
                        "an op's output of {n} values lies in a buffer of {}",
                        c.buf.len()
                    )));
                }
                c.dev.with_arena(|a| a.gather(&c.dev, slot, &c.buf))?
            }
            None => None,
        };
        Ok(OutArgs {
            counts: self.counts,
            partials: partials.unwrap_or(0),
            cfg: match partials {
                Some(_) => crate::device::cuda::arena::stats_config(n),
                None => cfg(n),
            },
        })
    }

    /// [`Out::for_output`] for a kernel with one thread per line of `n / lines` values:
    /// when gathering, one thread per line on at most [`MAX_PARTIALS`] blocks.
    ///
    /// [`MAX_PARTIALS`]: crate::device::cuda::arena::MAX_PARTIALS
    pub fn for_lines(&self, y: &Tensor, n: u64, lines: u64) -> Result<OutArgs> {
        let mut o = self.for_output(y, n)?;
        o.cfg = cfg(lines);
        if o.partials != 0 {
            let blocks = lines
                .div_ceil(THREADS as u64)
                .clamp(1, crate::device::cuda::arena::MAX_PARTIALS as u64);
            o.cfg.grid_dim = (blocks as u32, 1, 1);
        }
        Ok(o)
    }

    /// [`Out::for_output`] for a kernel with a warp per line of `n / lines` values: when
    /// gathering, the warps on at most [`MAX_PARTIALS`] blocks.
    ///
    /// [`MAX_PARTIALS`]: crate::device::cuda::arena::MAX_PARTIALS
    pub fn for_warp_lines(&self, y: &Tensor, n: u64, lines: u64) -> Result<OutArgs> {
        self.for_lines(y, n, lines * 32)
    }
}

/// Pads a shape on the left with ones to `MAX_DIMS`.
pub(crate) fn pad_shape(s: &[usize]) -> Result<[u64; MAX_DIMS]> {
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
pub(crate) fn pad_strides(s: &[usize]) -> [u64; MAX_DIMS] {
    let mut out = [0u64; MAX_DIMS];
    for (o, &v) in out[MAX_DIMS - s.len()..].iter_mut().zip(s) {
        *o = v as u64;
    }
    out
}

/// The common dtype of an op's device operands, or an error naming the op.
pub(crate) fn same_dtype(op: &str, ts: &[&Tensor]) -> Result<DType> {
    let d = ts[0].dtype();
    if let Some(t) = ts.iter().find(|t| t.dtype() != d) {
        return Err(Error::shape(
            op,
            format!("operands must share a dtype, got {d} and {}", t.dtype()),
        ));
    }
    Ok(d)
}

/// The device of an op's operands (all on one device), or an error naming the op.
pub(crate) fn device_of(op: &str, ts: &[&Tensor]) -> Result<Arc<CudaDevice>> {
    let dev = ts[0].cuda(op)?.dev.clone();
    for t in &ts[1..] {
        if !Arc::ptr_eq(&t.cuda(op)?.dev, &dev) {
            return Err(Error::Device(format!(
                "{op}: operands are on different devices"
            )));
        }
    }
    Ok(dev)
}

/// A device operand: its buffer address and storage kind code.
pub(crate) fn arg(t: &Tensor, op: &str) -> Result<(u64, i32)> {
    let c = t.cuda(op)?;
    Ok((c.buf.ptr(&c.dev), buffer::kind_code(t.dtype())?))
}

/// Unzeroed device memory for an op's output of `shape` and `dtype`, which its kernel
/// writes in full (a memset would be one more pass over memory per op).
pub(crate) fn output(dev: &Arc<CudaDevice>, shape: &[usize], dtype: DType) -> Result<Tensor> {
    let n = shape.iter().product();
    Tensor::on_device(
        dev,
        DeviceBuffer::alloc(dev, n, dtype, false)?,
        shape,
        dtype,
    )
}

/// A device operand's buffer address, whatever its dtype (int64 included).
pub(crate) fn arg_ptr(t: &Tensor, op: &str) -> Result<u64> {
    let c = t.cuda(op)?;
    Ok(c.buf.ptr(&c.dev))
}
