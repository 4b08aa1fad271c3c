//! A CUDA device: a context with one stream, the NVRTC-compiled kernels of a [`Program`],
//! cuBLAS, device buffers and the probe statistics arena.
//!
//! Work is queued on one stream and nothing waits for the device per op: rounding counts
//! and probe statistics are written into the arena on the device and read back with one
//! copy ([`arena::StatsArena::read`]).

pub mod arena;
pub mod blas;
pub mod buffer;
pub mod counters;
mod driver_error;
mod handle;
pub mod program;

pub use buffer::DeviceBuffer;
pub use driver_error::dev_err;
pub use handle::{elems_config, grid_for, DeviceHandle, GRID_UNROLL, THREADS};
pub use program::Program;

use crate::error::Result;
use std::sync::{Arc, Mutex};

/// An open CUDA device: context, stream, kernels and cuBLAS handle ([`DeviceHandle`], which
/// it dereferences to), and the probe statistics arena.
pub struct CudaDevice {
    handle: DeviceHandle,
    arena: Mutex<Option<arena::StatsArena>>,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice")
            .field("info", self.info())
            .finish()
    }
}

impl std::ops::Deref for CudaDevice {
    type Target = DeviceHandle;
    fn deref(&self) -> &DeviceHandle {
        &self.handle
    }
}

impl CudaDevice {
    /// Opens device `ordinal` ([`DeviceHandle::open`]); the arena is made on first use.
    pub fn open(ordinal: usize, tf32: bool, program: &Program) -> Result<Arc<CudaDevice>> {
        Ok(Arc::new(CudaDevice {
            handle: DeviceHandle::open(ordinal, tf32, program)?,
            arena: Mutex::new(None),
        }))
    }

    /// Runs `f` on the device's probe statistics arena (made on first use): the slots
    /// where kernels count rounding and probes gather statistics during a step, read back
    /// with one copy ([`arena::StatsArena::read`]).
    pub fn with_arena<T>(&self, f: impl FnOnce(&mut arena::StatsArena) -> Result<T>) -> Result<T> {
        let mut guard = self.arena.lock().unwrap_or_else(|e| e.into_inner());
        let arena = match &mut *guard {
            Some(a) => a,
            empty => empty.insert(arena::StatsArena::new(self, 256)?),
        };
        f(arena)
    }

    /// A fresh arena slot for one op, with the device address of its rounding counters.
    /// The address is valid until the next slot is handed out (the arena may move when it
    /// grows): take it right before the launch, or take several at once with
    /// [`CudaDevice::counts_slots`].
    pub fn counts_slot(&self) -> Result<(u32, u64)> {
        Ok(self.counts_slots(1)?[0])
    }

    /// `n` fresh arena slots with their counters' addresses, valid together: the arena
    /// grows (and moves) before any address is taken.
    pub fn counts_slots(&self, n: usize) -> Result<Vec<(u32, u64)>> {
        self.with_arena(|a| {
            let slots = (0..n).map(|_| a.slot(self)).collect::<Result<Vec<u32>>>()?;
            Ok(slots
                .into_iter()
                .map(|s| (s, a.round_counts_ptr(self, s)))
                .collect())
        })
    }
}
