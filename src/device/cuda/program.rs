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
    /// first loads the same PTX), and kept on disk across processes ([`ptx_cache_dir`]),
    /// keyed by the source, the architecture, the options and NVRTC's version.
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
        let ptx = self.compile_stored(arch, ptx_cache_dir().as_deref())?;
        CACHE
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_or_insert_with(HashMap::new)
            .insert(key, ptx.clone());
        Ok(ptx)
    }

    /// The PTX for `arch` from the disk cache in `dir` when it holds a complete copy, else
    /// compiled and stored there.
    fn compile_stored(&self, arch: &'static str, dir: Option<&std::path::Path>) -> Result<String> {
        let source = self.source();
        let disk = dir.map(|d| {
            let nvrtc = super::super::detect::nvrtc_version().ok();
            let options = format!("{:?}", compile_options(Some(arch)));
            let id = format!("{arch}\n{nvrtc:?}\n{options}\n{source}");
            let name = format!(
                "ptx-{arch}-{:016x}{:016x}.ptx",
                fnv1a(&id, 0),
                fnv1a(&id, 1)
            );
            (d.join(name), format!("// amprobe ptx {}\n", id.len()))
        });
        let stored = disk.as_ref().and_then(|(path, stamp)| {
            let text = std::fs::read_to_string(path).ok()?;
            text.strip_prefix(stamp.as_str())
                .filter(|p| p.ends_with(PTX_END))
                .map(|p| p[..p.len() - PTX_END.len()].to_string())
        });
        let ptx = match stored {
            Some(p) => p,
            None => {
                let p = self.compile(Some(arch))?.to_src();
                if let Some((path, stamp)) = &disk {
                    // A cache that cannot be written only costs the next process a compile.
                    let _ = store(path, &format!("{stamp}{p}{PTX_END}"));
                }
                p
            }
        };
        Ok(ptx)
    }
}

/// The last line of a complete cached PTX file (a file cut short by a crash lacks it).
const PTX_END: &str = "\n// amprobe ptx end\n";

/// Where compiled PTX is kept across processes: `AMPROBE_CACHE_DIR` (empty: no disk cache),
/// else `$XDG_CACHE_HOME/amprobe`, else `$HOME/.cache/amprobe`.
pub fn ptx_cache_dir() -> Option<std::path::PathBuf> {
    use std::path::PathBuf;
    match std::env::var_os("AMPROBE_CACHE_DIR") {
        Some(d) if d.is_empty() => None,
        Some(d) => Some(PathBuf::from(d)),
        None => std::env::var_os("XDG_CACHE_HOME")
            .filter(|d| !d.is_empty())
            .map(|d| PathBuf::from(d).join("amprobe"))
            .or_else(|| {
                std::env::var_os("HOME")
                    .filter(|d| !d.is_empty())
                    .map(|h| PathBuf::from(h).join(".cache").join("amprobe"))
            }),
    }
}

/// Writes `text` to `path` whole or not at all (a temporary file renamed into place), so a
/// process reading the cache at the same time never sees half a file.
fn store(path: &std::path::Path, text: &str) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path)
}

/// 64-bit FNV-1a of `text`, its offset basis varied by `seed` (two seeds make a 128-bit
/// cache key).
fn fnv1a(text: &str, seed: u64) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ seed.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    for b in text.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
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

    /// Compiling needs NVRTC (CI has it); the cache is checked where it is found.
    #[test]
    fn compiled_ptx_is_kept_whole_on_disk_and_a_cut_file_is_compiled_again() {
        if let Err(e) = crate::device::detect::nvrtc_version() {
            assert!(!crate::device::gpu_required(), "no NVRTC: {e}");
            return;
        }
        let dir = std::env::temp_dir().join(format!("amprobe-ptx-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let program = super::Program {
            sources: vec![(
                "t.cu",
                "extern \"C\" __global__ void t(float* x) { x[threadIdx.x] *= 2.0f; }",
            )],
            kernels: vec!["t"],
        };
        let first = program.compile_stored("sm_90", Some(&dir)).unwrap();
        let files: Vec<_> = std::fs::read_dir(&dir).unwrap().flatten().collect();
        assert_eq!(files.len(), 1, "one file, no temporary left");
        let path = files[0].path();
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.contains(&first) && text.ends_with(super::PTX_END));
        // A stored copy is used as it is: mark it and see the mark come back.
        let marked = text.replace(".entry t(", ".entry t( ");
        std::fs::write(&path, &marked).unwrap();
        let again = program.compile_stored("sm_90", Some(&dir)).unwrap();
        assert!(again.contains(".entry t( "), "the stored PTX was not used");
        // A file cut short (a crash while writing) is compiled again and replaced.
        std::fs::write(&path, &text[..text.len() / 2]).unwrap();
        assert_eq!(program.compile_stored("sm_90", Some(&dir)).unwrap(), first);
        assert_eq!(std::fs::read_to_string(&path).unwrap(), text);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
