//! The simulated device's work counters (`crates/cudasim`): kernel launches, copies each
//! way with their bytes, allocations, the bytes kernels read and wrote, and cuBLAS GEMMs
//! with their flops and operand bytes. A real driver
//! has none of these, so every function here answers `None` there; tests and the step
//! bench use them to count what a step does instead of assuming it.

use crate::device::detect::quietly;

/// What the device was asked to do, summed over its streams (the layout of cudasim's
/// `Counters`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SimCounters {
    /// Kernel launches (cuBLAS GEMMs not included: see `gemm_calls`).
    pub launches: u64,
    /// Host-to-device copies.
    pub htod_copies: u64,
    /// Bytes copied host to device.
    pub htod_bytes: u64,
    /// Device-to-host copies (reads the host waits for).
    pub dtoh_copies: u64,
    /// Bytes copied device to host.
    pub dtoh_bytes: u64,
    /// Device-to-device copies.
    pub dtod_copies: u64,
    /// Bytes copied device to device.
    pub dtod_bytes: u64,
    /// Memsets.
    pub memsets: u64,
    /// Device allocations.
    pub allocs: u64,
    /// Bytes of the buffers launches were given (an upper bound of kernel traffic).
    pub kernel_arg_bytes: u64,
    /// Bytes kernels read, measured page by page (first touch a read), while
    /// [`measure_traffic`] is on.
    pub kernel_read_bytes: u64,
    /// Bytes kernels wrote, measured page by page (every page written, whatever the
    /// values), while [`measure_traffic`] is on.
    pub kernel_written_bytes: u64,
    /// cuBLAS GEMM calls.
    pub gemm_calls: u64,
    /// Floating-point operations of those GEMMs (`2·m·n·k` per batch entry).
    pub gemm_flops: u64,
    /// The part of `gemm_flops` with f32 operands.
    pub gemm_f32_flops: u64,
    /// Bytes of those GEMMs' operands (A and B read once, C written once, read too when
    /// accumulated into): the least they move, not measured.
    pub gemm_bytes: u64,
}

impl SimCounters {
    /// `self - earlier`, field by field (what happened in between).
    pub fn since(&self, earlier: &SimCounters) -> SimCounters {
        SimCounters {
            launches: self.launches - earlier.launches,
            htod_copies: self.htod_copies - earlier.htod_copies,
            htod_bytes: self.htod_bytes - earlier.htod_bytes,
            dtoh_copies: self.dtoh_copies - earlier.dtoh_copies,
            dtoh_bytes: self.dtoh_bytes - earlier.dtoh_bytes,
            dtod_copies: self.dtod_copies - earlier.dtod_copies,
            dtod_bytes: self.dtod_bytes - earlier.dtod_bytes,
            memsets: self.memsets - earlier.memsets,
            allocs: self.allocs - earlier.allocs,
            kernel_arg_bytes: self.kernel_arg_bytes - earlier.kernel_arg_bytes,
            kernel_read_bytes: self.kernel_read_bytes - earlier.kernel_read_bytes,
            kernel_written_bytes: self.kernel_written_bytes - earlier.kernel_written_bytes,
            gemm_calls: self.gemm_calls - earlier.gemm_calls,
            gemm_flops: self.gemm_flops - earlier.gemm_flops,
            gemm_f32_flops: self.gemm_f32_flops - earlier.gemm_f32_flops,
            gemm_bytes: self.gemm_bytes - earlier.gemm_bytes,
        }
    }
}

/// The counters of every stream so far, or None when the driver is not the simulated
/// device.
pub fn sim_counters() -> Option<SimCounters> {
    // SAFETY: looks up one symbol of the loaded driver library and calls it with its
    // signature (stream 0, all streams) when present; a real driver lacks it.
    quietly(|| unsafe {
        let lib = cudarc::driver::sys::culib();
        lib.get::<unsafe extern "C" fn(usize, bool) -> SimCounters>(b"cudasim_counters")
            .ok()
            .map(|f| f(0, true))
    })
    .flatten()
}

/// Launches of kernel `name` so far, on the simulated device (None on a real driver).
pub fn sim_kernel_launches(name: &str) -> Option<u64> {
    let name = std::ffi::CString::new(name).ok()?;
    // SAFETY: as in `sim_counters`, for the stand-in's `fn(*const c_char) -> u64`, given a
    // NUL-terminated string that outlives the call.
    quietly(|| unsafe {
        let lib = cudarc::driver::sys::culib();
        lib.get::<unsafe extern "C" fn(*const std::ffi::c_char) -> u64>(b"cudasim_kernel_launches")
            .ok()
            .map(|f| f(name.as_ptr()))
    })
    .flatten()
}

/// Turns the simulated device's measurement of the bytes kernels read and write on or off
/// (off by default: it copies every argument allocation per launch). False when the driver
/// is not the simulated device.
pub fn measure_traffic(on: bool) -> bool {
    // SAFETY: as in `sim_counters`, for the stand-in's switch `fn(i32)`.
    quietly(|| unsafe {
        let lib = cudarc::driver::sys::culib();
        lib.get::<unsafe extern "C" fn(i32)>(b"cudasim_measure_traffic")
            .map(|f| f(on as i32))
            .is_ok()
    })
    .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_layout_is_the_simulated_devices() {
        let src = include_str!("../../../crates/cudasim/src/driver.rs");
        let at = src
            .find("pub struct Counters {")
            .expect("cudasim's Counters");
        let body = &src[at..at + src[at..].find('}').expect("end")];
        let fields: Vec<&str> = body
            .lines()
            .filter_map(|l| l.trim().strip_prefix("pub "))
            .filter_map(|l| l.strip_suffix(": u64,"))
            .collect();
        assert_eq!(
            fields,
            [
                "launches",
                "htod_copies",
                "htod_bytes",
                "dtoh_copies",
                "dtoh_bytes",
                "dtod_copies",
                "dtod_bytes",
                "memsets",
                "allocs",
                "kernel_arg_bytes",
                "kernel_read_bytes",
                "kernel_written_bytes",
                "gemm_calls",
                "gemm_flops",
                "gemm_f32_flops",
                "gemm_bytes",
            ]
        );
    }
}
