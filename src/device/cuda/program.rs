//! A CUDA program: the kernel sources of the op families and the probe arena, compiled
//! once per process with NVRTC into one module.
//!
//! The op families own their `.cu` files (`ops/*/*.cu`) and hand them to [`Program`]; this
//! runtime only knows the shared helpers of `common.cuh`, which go first. The options keep
//! the numerics of the CPU emulator: no fast-math, no flush-to-zero, IEEE division and
//! square root, and no FMA contraction (each f32 operation rounds on its own, as on the
//! CPU).

use crate::error::{Error, Result};

/// Helpers shared by every kernel (conversions, rounding, counting).
pub const COMMON: &str = include_str!("common.cuh");

/// Kernel sources in program order, each with a name for error messages, and the kernels
/// the loaded module must export.
#[derive(Debug, Clone, Default)]
pub struct Program {
    /// (name, source) pairs; [`COMMON`] is prepended by [`Program::source`].
    pub sources: Vec<(&'static str, &'static str)>,
    /// Every kernel the module must export.
    pub kernels: Vec<&'static str>,
}

impl Program {
    /// The whole program's source, the shared helpers first.
    pub fn source(&self) -> String {
        let mut s = String::new();
        for (name, src) in std::iter::once(&("device/cuda/common.cuh", COMMON)).chain(&self.sources)
        {
            s.push_str(&format!("// ---- {name}\n"));
            s.push_str(src);
            s.push('\n');
        }
        s
    }

    /// Compiles the program to PTX for `arch` (None: NVRTC's default). Needs libnvrtc (not
    /// a GPU); the error carries NVRTC's log.
    pub fn compile(&self, arch: Option<&'static str>) -> Result<cudarc::nvrtc::Ptx> {
        let nv = super::super::detect::nvrtc_version();
        if let Err(e) = nv {
            return Err(Error::Device(format!("cannot compile kernels: {e}")));
        }
        super::super::detect::quietly(|| {
            cudarc::nvrtc::compile_ptx_with_opts(self.source(), compile_options(arch))
        })
        .ok_or_else(|| Error::Device("NVRTC failed to load".into()))?
        .map_err(|e| Error::Device(format!("NVRTC compile of the kernels failed: {e}")))
    }
}

impl Program {
    /// [`Program::compile`]'s PTX text for `arch`, compiled once per process for each
    /// program source and architecture (NVRTC takes seconds; every device opened after the
    /// first loads the same PTX).
    pub fn compile_cached(&self, arch: &'static str) -> Result<String> {
        use std::collections::HashMap;
        use std::sync::Mutex;
        static CACHE: Mutex<Option<HashMap<(String, &'static str), String>>> = Mutex::new(None);
        let key = (self.source(), arch);
        if let Some(p) = CACHE
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .and_then(|m| m.get(&key))
        {
            return Ok(p.clone());
        }
        let ptx = self.compile(Some(arch))?.to_src();
        CACHE
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_or_insert_with(HashMap::new)
            .insert(key, ptx.clone());
        Ok(ptx)
    }
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

/// The number of parameters of every `.entry` of a PTX module, by kernel name.
pub fn entry_arity(ptx: &str) -> std::collections::HashMap<String, usize> {
    let mut out = std::collections::HashMap::new();
    let mut rest = ptx;
    while let Some(i) = rest.find(".entry ") {
        let after = &rest[i + ".entry ".len()..];
        let (Some(open), Some(close)) = (after.find('('), after.find(')')) else {
            break;
        };
        if close < open {
            break;
        }
        let name = after[..open].trim().to_string();
        out.insert(name, after[open..close].matches(".param").count());
        rest = &after[close..];
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn counts_entry_parameters() {
        let ptx = ".visible .entry k(\n .param .u64 k_param_0,\n .param .u32 k_param_1\n)\n{}\n\
                   .visible .entry j()\n{}";
        let a = super::entry_arity(ptx);
        assert_eq!(a["k"], 2);
        assert_eq!(a["j"], 0);
    }
}
