//! The device itself: its context, stream, loaded kernels and cuBLAS handle, and the launch
//! geometry of the element kernels; what buffers and the statistics arena work with.

use super::blas;
use super::driver_error::dev_err;
use super::program::{self, Program};
use crate::device::detect::{detect, Detection, GpuDevice};
use crate::error::{Error, Result};
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream};
use std::collections::HashMap;
use std::sync::Arc;

/// Threads per block of the elementwise kernels.
pub const THREADS: u32 = 256;

/// An open device's context, stream, kernels and cuBLAS handle ([`super::CudaDevice`] adds
/// the statistics arena).
pub struct DeviceHandle {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    _module: Arc<CudaModule>,
    funcs: HashMap<&'static str, CudaFunction>,
    blas: blas::Blas,
    info: GpuDevice,
    arity: HashMap<String, usize>,
}

impl DeviceHandle {
    /// Opens device `ordinal`: checks that a GPU is usable ([`detect`]), creates the
    /// context and stream, compiles `program` for the device's architecture and loads its
    /// kernels, and creates the cuBLAS handle (true fp32 GEMM unless `tf32`).
    pub fn open(ordinal: usize, tf32: bool, program: &Program) -> Result<DeviceHandle> {
        let info = match detect() {
            Detection::Unavailable { reason } => {
                return Err(Error::Device(format!("no usable GPU: {reason}")))
            }
            Detection::Available(i) => i.devices.get(ordinal).cloned().ok_or_else(|| {
                Error::Device(format!(
                    "device {ordinal} does not exist ({} found)",
                    i.devices.len()
                ))
            })?,
        };
        let ctx = CudaContext::new(ordinal).map_err(|e| dev_err("create context")(&e))?;
        // One stream, ordered: the per-slice event tracking is not needed.
        // SAFETY: every buffer is used on this context's one stream only.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.default_stream();
        let (major, minor) = info.compute_capability;
        let src = program.compile_cached(program::arch_name(major, minor))?;
        let arity = program::entry_arity(&src);
        let module = ctx
            .load_module(cudarc::nvrtc::Ptx::from_src(src))
            .map_err(|e| dev_err("load kernel module")(&e))?;
        let mut funcs = HashMap::new();
        for &name in &program.kernels {
            let f = module
                .load_function(name)
                .map_err(|e| dev_err(&format!("kernel {name}"))(&e))?;
            funcs.insert(name, f);
        }
        let blas = blas::Blas::new(stream.clone(), tf32)?;
        Ok(DeviceHandle {
            ctx,
            stream,
            _module: module,
            funcs,
            blas,
            info,
            arity,
        })
    }

    /// The device's description.
    pub fn info(&self) -> &GpuDevice {
        &self.info
    }

    /// The stream all work is queued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// cuBLAS.
    pub fn blas(&self) -> &blas::Blas {
        &self.blas
    }

    /// Checks that a launch of kernel `name` passes as many arguments as its PTX entry
    /// takes: the driver cannot tell (it reads the argument array up to the entry's count),
    /// so a missing argument would be read from whatever memory follows.
    pub fn check_args(&self, name: &str, given: usize) -> Result<()> {
        match self.arity.get(name) {
            Some(&n) if n == given => Ok(()),
            Some(&n) => Err(Error::Device(format!(
                "kernel {name} takes {n} arguments, the launch passes {given}"
            ))),
            None => Err(Error::Device(format!(
                "kernel {name} is not an entry of the loaded module"
            ))),
        }
    }

    /// A loaded kernel by name.
    pub fn func(&self, name: &str) -> Result<&CudaFunction> {
        self.funcs
            .get(name)
            .ok_or_else(|| Error::Device(format!("kernel {name} is not in the module")))
    }

    /// Waits until all queued work is done (tests and timing only; a step never does).
    pub fn synchronize(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(|e| dev_err("synchronize")(&e))
    }
}

/// Grid size for a grid-stride loop over `n` elements.
pub fn grid_for(n: u64) -> u32 {
    const MAX_BLOCKS: u64 = 65_535;
    n.div_ceil(THREADS as u64).clamp(1, MAX_BLOCKS) as u32
}

/// Elements a thread of an element kernel takes at a time (`GRID_UNROLL` in common.cuh).
pub const GRID_UNROLL: u64 = 4;

/// The launch of an element kernel (common.cuh's `grid_map`) over `n` elements when it
/// gathers no statistics: a thread per [`GRID_UNROLL`] elements, so that each thread's
/// group of loads is full.
pub fn elems_config(n: u64) -> cudarc::driver::LaunchConfig {
    cudarc::driver::LaunchConfig {
        grid_dim: (grid_for(n.div_ceil(GRID_UNROLL)), 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}
