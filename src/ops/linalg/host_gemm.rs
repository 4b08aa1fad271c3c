//! Which GEMM kernels the host runs: by default the gemm crate's blocked kernels, picked at
//! run time for the machine's instruction set (AVX-512 where the CPU has it, else AVX2 and
//! FMA) and sized to its caches, and for bf16 operands on CPUs with AVX512-BF16 its dot
//! products where they are exact (`bf16_dot.rs`): the fastest, but their sums group
//! differently from one machine to another. On request the fixed-order kernels of
//! `fixed_order.rs`, whose bits are the same on every machine. Asked for by
//! [`set_reproducible`] (the command line's `--reproducible`) or by the environment
//! variable `AMPROBE_REPRODUCIBLE=1`.

use std::sync::atomic::{AtomicU8, Ordering};

/// 0: not set (the environment decides), 1: the default kernels, 2: the fixed-order ones.
static CHOICE: AtomicU8 = AtomicU8::new(0);

/// The environment variable that asks for the fixed-order kernels (`1` or `true`).
pub const ENV: &str = "AMPROBE_REPRODUCIBLE";

/// Asks for the fixed-order kernels (`true`) or the default ones, over the environment.
pub fn set_reproducible(on: bool) {
    CHOICE.store(if on { 2 } else { 1 }, Ordering::Relaxed);
}

/// Whether the host's products run the fixed-order kernels.
pub fn reproducible() -> bool {
    match CHOICE.load(Ordering::Relaxed) {
        0 => {
            let on = matches!(std::env::var(ENV).as_deref(), Ok("1") | Ok("true"));
            CHOICE.store(if on { 2 } else { 1 }, Ordering::Relaxed);
            on
        }
        c => c == 2,
    }
}

/// The host's GEMM kernels as the trace header names them: `fixed-order:` and the lanes
/// its chains advance in (the same bits whatever they are), or `gemm-crate:` and the
/// instruction set its dispatch picks here (`avx512f`, `avx2-fma`, `scalar`, or the
/// target's name off x86-64), with `+bf16-dot` where bf16 products may run the CPU's
/// bf16 dot products.
pub fn describe() -> String {
    if reproducible() {
        return format!("fixed-order:{}", super::fixed_order::Lanes::detect().name());
    }
    let dot = if super::bf16_dot::available() {
        "+bf16-dot"
    } else {
        ""
    };
    format!("gemm-crate:{}{dot}", instruction_set())
}

/// The kernel the gemm crate's dispatch picks on this CPU (built with its `x86-v4`
/// feature, it takes AVX-512 where the CPU has it).
fn instruction_set() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            "avx512f"
        } else if std::arch::is_x86_feature_detected!("fma") {
            "avx2-fma"
        } else {
            "scalar"
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        std::env::consts::ARCH
    }
}
