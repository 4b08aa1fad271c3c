//! The CUDA backend: a device context with one stream, the NVRTC-compiled kernels, cuBLAS,
//! device tensors and the probe statistics arena.
//!
//! Work is queued on one stream and nothing waits for the device per op: rounding counts
//! and probe statistics are written into the arena on the device and read back with one
//! copy ([`arena::StatsArena::read`]).

pub mod arena;
pub mod blas;
pub mod kernels;
pub mod ops;
pub mod parity;
pub mod tensor;

use crate::backend::detect::{detect, Detection, GpuDevice};
use crate::error::{Error, Result};
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream};
use std::collections::HashMap;
use std::sync::Arc;

/// Threads per block of the elementwise kernels.
pub(crate) const THREADS: u32 = 256;

/// Turns a driver, NVRTC or cuBLAS error into the library's error, naming what failed.
pub(crate) fn dev_err(what: &str) -> impl Fn(&dyn std::fmt::Debug) -> Error + '_ {
    move |e| Error::Device(format!("{what}: {e:?}"))
}

/// An open CUDA device: context, stream, kernels and cuBLAS handle.
pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    _module: Arc<CudaModule>,
    funcs: HashMap<&'static str, CudaFunction>,
    blas: blas::Blas,
    info: GpuDevice,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice")
            .field("info", &self.info)
            .finish()
    }
}

impl CudaDevice {
    /// Opens device `ordinal`: checks that a GPU is usable ([`detect`]), creates the
    /// context and stream, compiles the kernels for the device's architecture and loads
    /// them, and creates the cuBLAS handle (true fp32 GEMM unless `tf32`).
    pub fn open(ordinal: usize, tf32: bool) -> Result<Arc<CudaDevice>> {
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
        let ptx = kernels::compile(Some(kernels::arch_name(major, minor)))?;
        let module = ctx
            .load_module(ptx)
            .map_err(|e| dev_err("load kernel module")(&e))?;
        let mut funcs = HashMap::new();
        for &name in kernels::KERNELS {
            let f = module
                .load_function(name)
                .map_err(|e| dev_err(&format!("kernel {name}"))(&e))?;
            funcs.insert(name, f);
        }
        let blas = blas::Blas::new(stream.clone(), tf32)?;
        Ok(Arc::new(CudaDevice {
            ctx,
            stream,
            _module: module,
            funcs,
            blas,
            info,
        }))
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

    /// A loaded kernel by name.
    pub(crate) fn func(&self, name: &str) -> Result<&CudaFunction> {
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
pub(crate) fn grid_for(n: u64) -> u32 {
    const MAX_BLOCKS: u64 = 65_535;
    n.div_ceil(THREADS as u64).clamp(1, MAX_BLOCKS) as u32
}
