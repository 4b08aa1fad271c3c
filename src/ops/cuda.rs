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

    /// True when nothing needs the kernel writing the output on `dev` to count its
    /// rounding or gather its statistics: then a library call may round it instead
    /// (cuBLAS's epilogue), and a check of its values, if any, is the arena's own pass
    /// over it. So it is where neither is asked for, and in a check-only step, whose
    /// rounding counts are read only if it keeps its records after all, and then come
    /// from its re-run with full statistics (the recorder's `complete_from`).
    pub fn silent(&self, dev: &CudaDevice) -> Result<bool> {
        match self.slot {
            None => Ok(self.counts == 0),
            Some(_) => {
                dev.with_arena(|a| Ok(a.is_check_only() || (self.counts == 0 && !a.gathering())))
            }
        }
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
                None => crate::device::cuda::elems_config(n),
            },
        })
    }

    /// [`Out::for_output`] for a kernel that shares the output's lines out to `threads`
    /// threads (a thread per line, a warp per line, or a warp per group of 32 lines): when
    /// gathering, those threads on at most [`MAX_PARTIALS`] blocks.
    ///
    /// [`MAX_PARTIALS`]: crate::device::cuda::arena::MAX_PARTIALS
    pub fn for_lines(&self, y: &Tensor, n: u64, threads: u64) -> Result<OutArgs> {
        let mut o = self.for_output(y, n)?;
        o.cfg = cfg(threads);
        if o.partials != 0 {
            let blocks = threads
                .div_ceil(THREADS as u64)
                .clamp(1, crate::device::cuda::arena::MAX_PARTIALS as u64);
            o.cfg.grid_dim = (blocks as u32, 1, 1);
        }
        Ok(o)
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

/// Merges the dims of a padded iteration shape that every one of `strides` walks as one,
/// in place: dim d joins dim d + 1 when each list has `s[d] == s[d+1] · shape[d+1]` and
/// both dims are in the same group (`groups`: which dims a kernel sums over, or none).
/// Dims of size 1 are dropped. The row-major enumeration of the indices, every offset
/// and each group's order stay the same; the kernels only divide less per element (a
/// contiguous elementwise op becomes one dim).
pub(crate) fn collapse(
    shape: &mut [u64; MAX_DIMS],
    strides: &mut [&mut [u64; MAX_DIMS]],
    mut groups: Option<&mut [u32; MAX_DIMS]>,
) {
    // Kept dims, outermost first: size, group, strides.
    let mut dims: Vec<(u64, u32, Vec<u64>)> = Vec::with_capacity(MAX_DIMS);
    for d in 0..MAX_DIMS {
        if shape[d] == 1 {
            continue;
        }
        let group = groups.as_ref().map_or(0, |g| g[d]);
        let s: Vec<u64> = strides.iter().map(|st| st[d]).collect();
        if let Some(last) = dims.last_mut() {
            let joins = last.1 == group && last.2.iter().zip(&s).all(|(&o, &i)| o == i * shape[d]);
            if joins {
                last.0 *= shape[d];
                last.2 = s;
                continue;
            }
        }
        dims.push((shape[d], group, s));
    }
    let pad = MAX_DIMS - dims.len();
    for d in 0..MAX_DIMS {
        let kept = d.checked_sub(pad).map(|i| &dims[i]);
        shape[d] = kept.map_or(1, |k| k.0);
        for (j, st) in strides.iter_mut().enumerate() {
            st[d] = kept.map_or(0, |k| k.2[j]);
        }
        if let Some(g) = groups.as_deref_mut() {
            g[d] = kept.map_or(0, |k| k.1);
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The offsets of every index of `shape`, enumerated row-major over the dims of group
    /// `group` only, as the kernels decode them (the last dim fastest).
    fn offsets(
        shape: &[u64; MAX_DIMS],
        strides: &[[u64; MAX_DIMS]],
        groups: &[u32; MAX_DIMS],
        group: u32,
    ) -> Vec<Vec<u64>> {
        let dims: Vec<usize> = (0..MAX_DIMS)
            .filter(|&d| groups[d] == group && shape[d] > 1)
            .collect();
        let n: u64 = dims.iter().map(|&d| shape[d]).product();
        (0..n)
            .map(|i| {
                let mut rest = i;
                let mut off = vec![0u64; strides.len()];
                for &d in dims.iter().rev() {
                    let c = rest % shape[d];
                    rest /= shape[d];
                    for (o, s) in off.iter_mut().zip(strides) {
                        *o += c * s[d];
                    }
                }
                off
            })
            .collect()
    }

    #[test]
    fn the_element_kernels_unroll_as_their_launch_assumes() {
        let needle = format!("#define GRID_UNROLL {}", crate::device::cuda::GRID_UNROLL);
        assert!(crate::device::cuda::program::COMMON.contains(&needle));
    }

    #[test]
    fn collapse_keeps_every_offset_and_each_groups_order() {
        let mut rng = crate::rng::Rng::new(7);
        let mut merged_some = false;
        for _ in 0..2000 {
            let mut shape = [1u64; MAX_DIMS];
            for s in shape.iter_mut() {
                *s = [1, 1, 2, 3, 4][rng.below(5) as usize];
            }
            // Row-major strides, broadcast (0) dims, and transposed layouts.
            let row_major = |shape: &[u64; MAX_DIMS]| {
                let mut s = [0u64; MAX_DIMS];
                let mut acc = 1;
                for d in (0..MAX_DIMS).rev() {
                    s[d] = acc;
                    acc *= shape[d];
                }
                s
            };
            let mut lists = Vec::new();
            for _ in 0..3 {
                let mut s = row_major(&shape);
                match rng.below(3) {
                    0 => {}
                    1 => s[rng.below(MAX_DIMS as u64) as usize] = 0,
                    _ => s.swap(rng.below(MAX_DIMS as u64) as usize, MAX_DIMS - 1),
                }
                lists.push(s);
            }
            let mut groups = [0u32; MAX_DIMS];
            for g in groups.iter_mut() {
                *g = rng.below(2) as u32;
            }
            let before: Vec<_> = (0..2)
                .map(|g| offsets(&shape, &lists, &groups, g))
                .collect();
            let (mut s2, mut l2, mut g2) = (shape, lists.clone(), groups);
            {
                let mut refs: Vec<&mut [u64; MAX_DIMS]> = l2.iter_mut().collect();
                collapse(&mut s2, &mut refs, Some(&mut g2));
            }
            let after: Vec<_> = (0..2).map(|g| offsets(&s2, &l2, &g2, g)).collect();
            assert_eq!(
                before, after,
                "shape {shape:?} strides {lists:?} groups {groups:?}"
            );
            let dims = |s: &[u64; MAX_DIMS]| s.iter().filter(|&&x| x > 1).count();
            merged_some |= dims(&s2) < dims(&shape);
        }
        assert!(merged_some);
        // A contiguous op over any shape is one dim.
        let mut shape = [1, 1, 2, 3, 4, 5];
        let mut s = [0, 0, 60, 20, 5, 1];
        collapse(&mut shape, &mut [&mut s], None);
        assert_eq!((shape, s), ([1, 1, 1, 1, 1, 120], [0, 0, 0, 0, 0, 1]));
    }
}
