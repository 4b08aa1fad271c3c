//! Layer 0 of `amprobe::LAYERS`: uses no other module of the crate.
//!
//! How the process's allocator treats the host step's buffers.
//!
//! A host step allocates and frees tensors of megabytes hundreds of times. glibc's malloc
//! serves blocks that large with fresh `mmap`s and returns them on free, so every op pays
//! page faults and the kernel's zeroing again (a quarter of a GPT-2-mini step's CPU time,
//! measured with `perf stat`). Kept in the heap instead, freed blocks are reused.

/// Keeps freed blocks of any size in the heap for reuse (glibc: the `mmap` threshold at its
/// 32 MiB maximum, no trimming of the heap top below 1 GiB, and one arena for all threads,
/// since the arenas of rayon's threads, where the host step runs, gave freed blocks back to
/// the kernel all the same); elsewhere nothing. Called once at the start of the command
/// line and the benchmarks; results do not depend on it.
pub fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets malloc's parameters; it is called before other threads run.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
        libc::mallopt(libc::M_ARENA_MAX, 1);
    }
}
