//! Finding a usable NVIDIA GPU without panicking or printing.
//!
//! cudarc loads the CUDA libraries at run time and panics when one is missing, and even
//! formatting a driver error calls into the library. So the driver library's presence is
//! checked first, and every later call runs inside `catch_unwind` with the panic hook
//! silenced, so a machine without CUDA sees no output at all.

use serde::Serialize;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Mutex, OnceLock};

/// One CUDA device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GpuDevice {
    /// Device ordinal.
    pub ordinal: usize,
    /// Marketing name (`NVIDIA H100 80GB HBM3`).
    pub name: String,
    /// Total device memory in bytes.
    pub total_mem: u64,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
    /// True for the project's simulated device (`crates/cudasim`), which runs kernels on
    /// the CPU: its results prove launch logic and kernel arithmetic, never hardware speed.
    pub simulated: bool,
}

/// What a machine with a CUDA driver offers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CudaInfo {
    /// Driver's CUDA version as reported by `cuDriverGetVersion` (13000 = 13.0).
    pub driver_version: i32,
    /// The devices found.
    pub devices: Vec<GpuDevice>,
    /// NVRTC version (major, minor), or why it is unusable.
    pub nvrtc: std::result::Result<(i32, i32), String>,
    /// cuBLAS version (major, minor, patch), or why it is unusable.
    pub cublas: std::result::Result<(i32, i32, i32), String>,
    /// The CUDA version the binary's bindings were built for.
    pub bindings: &'static str,
}

/// The outcome of looking for a GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "status", rename_all = "lowercase")]
pub enum Detection {
    /// A driver, at least one device, NVRTC and cuBLAS.
    Available(CudaInfo),
    /// No usable GPU, and why.
    Unavailable {
        /// What was missing.
        reason: String,
    },
}

impl Detection {
    /// True when a GPU is usable.
    pub fn is_available(&self) -> bool {
        matches!(self, Detection::Available(_))
    }
}

/// Runs `f` with panics caught and the panic hook silenced. The hook is process-wide, so
/// concurrent callers are serialized.
pub(crate) fn quietly<T>(f: impl FnOnce() -> T) -> Option<T> {
    static LOCK: Mutex<()> = Mutex::new(());
    let _guard = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let prev = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let r = catch_unwind(AssertUnwindSafe(f));
    std::panic::set_hook(prev);
    r.ok()
}

/// Looks for a usable GPU once per process (later calls return the first answer).
pub fn detect() -> Detection {
    static FOUND: OnceLock<Detection> = OnceLock::new();
    FOUND.get_or_init(detect_now).clone()
}

fn detect_now() -> Detection {
    let unavailable = |reason: String| Detection::Unavailable { reason };
    // SAFETY: only tries to dlopen the driver library by its known names.
    if !quietly(|| unsafe { cudarc::driver::sys::is_culib_present() }).unwrap_or(false) {
        return unavailable("no CUDA driver library (libcuda.so) found".into());
    }
    let driver = quietly(|| -> std::result::Result<(i32, Vec<GpuDevice>), String> {
        cudarc::driver::result::init().map_err(|e| format!("cuInit failed: {e}"))?;
        let mut version = 0;
        // SAFETY: writes one int.
        unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut version) }
            .result()
            .map_err(|e| format!("cuDriverGetVersion failed: {e}"))?;
        let n = cudarc::driver::result::device::get_count()
            .map_err(|e| format!("cuDeviceGetCount failed: {e}"))?;
        let mut devices = Vec::new();
        for ordinal in 0..n.max(0) {
            let dev = cudarc::driver::result::device::get(ordinal)
                .map_err(|e| format!("device {ordinal}: {e}"))?;
            let name = cudarc::driver::result::device::get_name(dev)
                .map_err(|e| format!("device {ordinal}: {e}"))?;
            // SAFETY: `dev` is a valid device handle from cuDeviceGet.
            let total = unsafe { cudarc::driver::result::device::total_mem(dev) }
                .map_err(|e| format!("device {ordinal}: {e}"))?;
            let attr = |a| {
                // SAFETY: as above; the attribute is a plain int query.
                unsafe { cudarc::driver::result::device::get_attribute(dev, a) }
                    .map_err(|e| format!("device {ordinal}: {e}"))
            };
            use cudarc::driver::sys::CUdevice_attribute as A;
            let cc = (
                attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
                attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
            );
            devices.push(GpuDevice {
                ordinal: ordinal as usize,
                name,
                total_mem: total as u64,
                compute_capability: cc,
                simulated: false,
            });
        }
        Ok((version, devices))
    });
    let (driver_version, mut devices) = match driver {
        None => return unavailable("the CUDA driver library failed to load".into()),
        Some(Err(e)) => return unavailable(e),
        Some(Ok(v)) => v,
    };
    let simulated = driver_is_simulated();
    for d in &mut devices {
        d.simulated = simulated;
    }
    if devices.is_empty() {
        return unavailable(format!(
            "CUDA driver {} found but no CUDA device",
            version_string(driver_version)
        ));
    }
    let nvrtc = nvrtc_version();
    let cublas = cublas_version();
    if let Err(e) = &nvrtc {
        return unavailable(format!("NVRTC unusable: {e}"));
    }
    if let Err(e) = &cublas {
        return unavailable(format!("cuBLAS unusable: {e}"));
    }
    Detection::Available(CudaInfo {
        driver_version,
        devices,
        nvrtc,
        cublas,
        bindings: "13.0",
    })
}

/// True when the loaded driver library is the simulated device (it exports
/// `cudasim_is_simulated`; NVIDIA's driver does not).
fn driver_is_simulated() -> bool {
    // SAFETY: looks up one symbol of the already loaded driver library; it is only called
    // (a function of no arguments returning an int) when present.
    quietly(|| unsafe {
        let lib = cudarc::driver::sys::culib();
        lib.get::<unsafe extern "C" fn() -> i32>(b"cudasim_is_simulated")
            .map(|f| f() == 1)
            .unwrap_or(false)
    })
    .unwrap_or(false)
}

/// NVRTC's version, or why it cannot be loaded.
pub fn nvrtc_version() -> std::result::Result<(i32, i32), String> {
    // SAFETY: dlopen by name only.
    if !quietly(|| unsafe { cudarc::nvrtc::sys::is_culib_present() }).unwrap_or(false) {
        return Err(
            "libnvrtc not found (add the CUDA toolkit's lib directory to \
                    LD_LIBRARY_PATH)"
                .into(),
        );
    }
    quietly(|| {
        let (mut major, mut minor) = (0, 0);
        // SAFETY: writes two ints.
        let r = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
        if r == cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
            Ok((major, minor))
        } else {
            Err(format!("nvrtcVersion failed: {r:?}"))
        }
    })
    .unwrap_or_else(|| Err("libnvrtc failed to load".into()))
}

fn cublas_version() -> std::result::Result<(i32, i32, i32), String> {
    // SAFETY: dlopen by name only.
    if !quietly(|| unsafe { cudarc::cublas::sys::is_culib_present() }).unwrap_or(false) {
        return Err("libcublas not found".into());
    }
    quietly(|| {
        use cudarc::cublas::sys::{cublasGetProperty, cublasStatus_t, libraryPropertyType as P};
        let mut v = [0; 3];
        for (slot, p) in v
            .iter_mut()
            .zip([P::MAJOR_VERSION, P::MINOR_VERSION, P::PATCH_LEVEL])
        {
            // SAFETY: writes one int.
            let r = unsafe { cublasGetProperty(p, slot) };
            if r != cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                return Err(format!("cublasGetProperty failed: {r:?}"));
            }
        }
        Ok((v[0], v[1], v[2]))
    })
    .unwrap_or_else(|| Err("libcublas failed to load".into()))
}

/// `13000` → `13.0`.
pub fn version_string(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

/// A human-readable report of a detection (what `amprobe doctor` prints).
pub fn describe(d: &Detection) -> String {
    match d {
        Detection::Unavailable { reason } => format!("GPU: none usable — {reason}\n"),
        Detection::Available(info) => {
            let mut s = format!(
                "CUDA driver: {} (bindings built for CUDA {})\n",
                version_string(info.driver_version),
                info.bindings
            );
            for dev in &info.devices {
                s.push_str(&format!(
                    "device {}: {}, {:.1} GiB, compute capability {}.{}{}\n",
                    dev.ordinal,
                    dev.name,
                    dev.total_mem as f64 / (1u64 << 30) as f64,
                    dev.compute_capability.0,
                    dev.compute_capability.1,
                    if dev.simulated {
                        " — a simulated device: kernels run on the CPU; its results check \
                         launch logic and kernel arithmetic, not hardware speed or cuBLAS's \
                         summation order"
                    } else {
                        ""
                    }
                ));
            }
            match &info.nvrtc {
                Ok((a, b)) => s.push_str(&format!("NVRTC: {a}.{b}\n")),
                Err(e) => s.push_str(&format!("NVRTC: {e}\n")),
            }
            match &info.cublas {
                Ok((a, b, c)) => s.push_str(&format!("cuBLAS: {a}.{b}.{c}\n")),
                Err(e) => s.push_str(&format!("cuBLAS: {e}\n")),
            }
            s
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_strings() {
        assert_eq!(version_string(13000), "13.0");
        assert_eq!(version_string(12080), "12.8");
    }

    #[test]
    fn quietly_catches_and_restores_the_hook() {
        assert_eq!(quietly(|| 3), Some(3));
        assert_eq!(quietly(|| -> i32 { panic!("boom") }), None);
    }

    #[test]
    fn detection_is_stable_and_never_panics() {
        let a = detect();
        let b = detect();
        assert_eq!(a, b);
        if let Detection::Unavailable { reason } = &a {
            assert!(!reason.is_empty());
        }
    }
}
