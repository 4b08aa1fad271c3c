//! The CUDA C sources of the device kernels, compiled once per process with NVRTC.
//!
//! All sources go into one program (the helpers of `common.cuh` first), so one module
//! holds every kernel. The options keep the numerics of the CPU emulator: no fast-math,
//! no flush-to-zero, IEEE division and square root, and no FMA contraction (each f32
//! operation rounds on its own, as on the CPU).

use crate::error::{Error, Result};

/// Helpers shared by every kernel (conversions, rounding, counting).
pub const COMMON: &str = include_str!("kernels/common.cuh");
/// Casts, unary maps and broadcasting binary arithmetic.
pub const ELEMENTWISE: &str = include_str!("kernels/elementwise.cu");
/// Probe statistics into the device-side arena.
pub const PROBE_STATS: &str = include_str!("../../../probes/stats.cu");

/// Every source in program order, with a name for error messages.
pub const SOURCES: &[(&str, &str)] = &[
    ("kernels/common.cuh", COMMON),
    ("kernels/elementwise.cu", ELEMENTWISE),
    ("probes/stats.cu", PROBE_STATS),
];

/// Every kernel the module must export.
pub const KERNELS: &[&str] = &[
    "amp_cast",
    "amp_unary",
    "amp_unary_backward",
    "amp_binary",
    "amp_binary_grad",
    "amp_stats",
    "amp_stats_batch",
    "amp_stats_finish",
];

/// The whole program's source.
pub fn program_source() -> String {
    let mut s = String::new();
    for (name, src) in SOURCES {
        s.push_str(&format!("// ---- {name}\n"));
        s.push_str(src);
        s.push('\n');
    }
    s
}

/// NVRTC options: exact IEEE arithmetic for `arch` (e.g. `sm_90`; None: NVRTC's default).
pub fn compile_options(arch: Option<&'static str>) -> cudarc::nvrtc::CompileOptions {
    cudarc::nvrtc::CompileOptions {
        ftz: Some(false),
        prec_sqrt: Some(true),
        prec_div: Some(true),
        fmad: Some(false),
        use_fast_math: Some(false),
        arch,
        name: Some("amprobe.cu".into()),
        ..Default::default()
    }
}

/// The `sm_XY` name of a compute capability, for NVRTC's `--gpu-architecture`.
pub fn arch_name(major: i32, minor: i32) -> &'static str {
    // NVRTC wants a 'static str; the few distinct values are interned once each.
    static NAMES: std::sync::Mutex<Vec<&'static str>> = std::sync::Mutex::new(Vec::new());
    let want = format!("sm_{major}{minor}");
    let mut names = NAMES.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(n) = names.iter().find(|n| **n == want) {
        return n;
    }
    let leaked: &'static str = Box::leak(want.into_boxed_str());
    names.push(leaked);
    leaked
}

/// Compiles the program to PTX. Needs libnvrtc (not a GPU); the error carries NVRTC's log.
pub fn compile(arch: Option<&'static str>) -> Result<cudarc::nvrtc::Ptx> {
    let nv = super::super::detect::nvrtc_version();
    if let Err(e) = nv {
        return Err(Error::Device(format!("cannot compile kernels: {e}")));
    }
    super::super::detect::quietly(|| {
        cudarc::nvrtc::compile_ptx_with_opts(program_source(), compile_options(arch))
    })
    .ok_or_else(|| Error::Device("NVRTC failed to load".into()))?
    .map_err(|e| Error::Device(format!("NVRTC compile of the kernels failed: {e}")))
}
