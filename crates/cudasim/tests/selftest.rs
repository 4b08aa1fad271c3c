//! The simulated device against kernels with known answers (`kernels/selftest.cu`), through
//! the same cudarc calls amprobe makes, and launches that must fail. Needs the stand-in
//! first on the library path and libnvrtc (scripts/cudasim.sh sets both up); skips without
//! them unless `AMPROBE_REQUIRE_GPU=1`.

use cudarc::driver::{CudaContext, CudaModule, CudaStream, LaunchConfig, PushKernelArg};
use std::sync::Arc;

const SOURCE: &str = include_str!("../kernels/selftest.cu");

fn required() -> bool {
    std::env::var("AMPROBE_REQUIRE_GPU").is_ok_and(|v| v == "1")
}

/// The simulated device's context, stream and the self-test module, or None (skip).
fn setup() -> Option<(Arc<CudaStream>, Arc<CudaModule>)> {
    // SAFETY: dlopen by name only.
    let present = unsafe { cudarc::driver::sys::is_culib_present() }
        && unsafe { cudarc::nvrtc::sys::is_culib_present() };
    if !present {
        assert!(
            !required(),
            "AMPROBE_REQUIRE_GPU=1 but the stand-in or NVRTC is missing"
        );
        eprintln!("skipped: the simulated device is not on the library path");
        return None;
    }
    // SAFETY: the symbol exists only in the stand-in; a real driver lacks it.
    let simulated = unsafe {
        cudarc::driver::sys::culib()
            .get::<unsafe extern "C" fn() -> i32>(b"cudasim_is_simulated")
            .is_ok()
    };
    assert!(
        simulated,
        "libcuda.so on the library path is not the simulated device"
    );
    let ctx = CudaContext::new(0).expect("context");
    let ptx = cudarc::nvrtc::compile_ptx(SOURCE).expect("NVRTC compiles selftest.cu");
    let module = ctx.load_module(ptx).expect("module");
    Some((ctx.default_stream(), module))
}

fn cfg(grid: (u32, u32, u32), block: (u32, u32, u32), shared: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: grid,
        block_dim: block,
        shared_mem_bytes: shared,
    }
}

/// Calls one of the stand-in's own functions.
fn sim_fn<T: Copy>(name: &[u8]) -> T {
    // SAFETY: the stand-in is loaded (setup checked it); `T` is the symbol's signature.
    unsafe {
        *cudarc::driver::sys::culib()
            .get::<T>(name)
            .expect("stand-in symbol")
    }
}

#[test]
fn block_reduction_across_barriers() {
    let Some((s, m)) = setup() else { return };
    let n = 1000u32;
    let x: Vec<f32> = (0..n).map(|i| (i % 7) as f32).collect();
    let xd = s.clone_htod(&x).unwrap();
    let mut out = s.alloc_zeros::<f32>(4).unwrap();
    let f = m.load_function("sim_block_sum").unwrap();
    let mut b = s.launch_builder(&f);
    b.arg(&xd).arg(&mut out).arg(&n);
    // SAFETY: argument types match the kernel; buffers are large enough.
    unsafe { b.launch(cfg((4, 1, 1), (256, 1, 1), 0)) }.unwrap();
    let got = s.clone_dtoh(&out).unwrap();
    for (blk, g) in got.iter().enumerate() {
        let want: f32 = x.iter().skip(blk * 256).take(256).sum();
        assert_eq!(*g, want, "block {blk}");
    }
}

#[test]
fn warp_shuffle_sum() {
    let Some((s, m)) = setup() else { return };
    let x: Vec<i32> = (0..256).map(|i| i * 3 - 100).collect();
    let xd = s.clone_htod(&x).unwrap();
    let mut out = s.alloc_zeros::<i32>(8).unwrap();
    let f = m.load_function("sim_warp_sum").unwrap();
    let mut b = s.launch_builder(&f);
    b.arg(&xd).arg(&mut out);
    // SAFETY: as above.
    unsafe { b.launch(cfg((2, 1, 1), (128, 1, 1), 0)) }.unwrap();
    let got = s.clone_dtoh(&out).unwrap();
    for (w, g) in got.iter().enumerate() {
        assert_eq!(*g, x[w * 32..w * 32 + 32].iter().sum::<i32>(), "warp {w}");
    }
}

#[test]
fn atomic_contention() {
    let Some((s, m)) = setup() else { return };
    let mut c = s.alloc_zeros::<u64>(1).unwrap();
    let f = m.load_function("sim_atomic_count").unwrap();
    let reps = 5u32;
    let mut b = s.launch_builder(&f);
    b.arg(&mut c).arg(&reps);
    // SAFETY: as above.
    unsafe { b.launch(cfg((7, 1, 1), (96, 1, 1), 0)) }.unwrap();
    assert_eq!(s.clone_dtoh(&c).unwrap(), vec![7 * 96 * 5]);
}

#[test]
fn shared_memory_transpose() {
    let Some((s, m)) = setup() else { return };
    let n = 70u32;
    let a: Vec<f32> = (0..n * n).map(|i| i as f32).collect();
    let ad = s.clone_htod(&a).unwrap();
    let mut t = s.alloc_zeros::<f32>((n * n) as usize).unwrap();
    let f = m.load_function("sim_transpose").unwrap();
    let mut b = s.launch_builder(&f);
    b.arg(&ad).arg(&mut t).arg(&n);
    let g = n.div_ceil(32);
    // SAFETY: as above.
    unsafe { b.launch(cfg((g, g, 1), (32, 32, 1), 0)) }.unwrap();
    let got = s.clone_dtoh(&t).unwrap();
    for r in 0..n as usize {
        for c in 0..n as usize {
            assert_eq!(got[c * n as usize + r], a[r * n as usize + c], "({r}, {c})");
        }
    }
}

#[test]
fn dynamic_shared_memory() {
    let Some((s, m)) = setup() else { return };
    let x: Vec<i32> = (0..192).collect();
    let xd = s.clone_htod(&x).unwrap();
    let mut out = s.alloc_zeros::<i32>(192).unwrap();
    let f = m.load_function("sim_reverse_dynamic").unwrap();
    let mut b = s.launch_builder(&f);
    b.arg(&xd).arg(&mut out);
    // SAFETY: as above; 64 ints of dynamic shared memory per block.
    unsafe { b.launch(cfg((3, 1, 1), (64, 1, 1), 64 * 4)) }.unwrap();
    let got = s.clone_dtoh(&out).unwrap();
    for blk in 0..3 {
        for t in 0..64 {
            assert_eq!(got[blk * 64 + t], x[blk * 64 + 63 - t]);
        }
    }
}

#[test]
fn votes_and_match_in_lockstep() {
    let Some((s, m)) = setup() else { return };
    let x: Vec<i32> = (0..64).map(|i| (i * 5) % 4).collect();
    let xd = s.clone_htod(&x).unwrap();
    let mut ballot = s.alloc_zeros::<u32>(64).unwrap();
    let mut matched = s.alloc_zeros::<u32>(64).unwrap();
    let f = m.load_function("sim_vote").unwrap();
    let mut b = s.launch_builder(&f);
    b.arg(&xd).arg(&mut ballot).arg(&mut matched);
    // SAFETY: as above.
    unsafe { b.launch(cfg((1, 1, 1), (64, 1, 1), 0)) }.unwrap();
    let (bal, mat) = (
        s.clone_dtoh(&ballot).unwrap(),
        s.clone_dtoh(&matched).unwrap(),
    );
    for w in 0..2 {
        let lanes = &x[w * 32..w * 32 + 32];
        let want_ballot = (0..32).fold(0u32, |m, l| m | (((lanes[l] & 1) as u32) << l));
        for l in 0..32 {
            assert_eq!(bal[w * 32 + l], want_ballot, "ballot, warp {w} lane {l}");
            let want = (0..32).fold(0u32, |m, o| m | (((lanes[o] == lanes[l]) as u32) << o));
            assert_eq!(mat[w * 32 + l], want, "match, warp {w} lane {l}");
        }
    }
}

#[test]
fn a_write_past_the_end_fails_naming_the_kernel() {
    let Some((s, m)) = setup() else { return };
    let mut x = s.alloc_zeros::<f32>(10).unwrap();
    let n = 10u32;
    let f = m.load_function("sim_write_past_end").unwrap();
    let mut b = s.launch_builder(&f);
    b.arg(&mut x).arg(&n);
    // SAFETY: the kernel writes one element past the end on purpose.
    let r = unsafe { b.launch(cfg((1, 1, 1), (32, 1, 1), 0)) };
    assert!(r.is_err(), "the out-of-bounds write was not reported");
    let msg = last_error();
    assert!(
        msg.contains("sim_write_past_end") && msg.contains("past the end"),
        "{msg}"
    );
}

#[test]
fn a_block_over_1024_threads_is_refused() {
    let Some((s, m)) = setup() else { return };
    let x = s.alloc_zeros::<f32>(2048).unwrap();
    let mut out = s.alloc_zeros::<f32>(1).unwrap();
    let n = 2048u32;
    let f = m.load_function("sim_block_sum").unwrap();
    let mut b = s.launch_builder(&f);
    b.arg(&x).arg(&mut out).arg(&n);
    // SAFETY: refused before it runs.
    let r = unsafe { b.launch(cfg((1, 1, 1), (2048, 1, 1), 0)) };
    assert!(r.is_err());
    let msg = last_error();
    assert!(
        msg.contains("sim_block_sum") && msg.contains("1024"),
        "{msg}"
    );
}

#[test]
fn dynamic_shared_memory_over_the_default_needs_the_opt_in() {
    let Some((s, m)) = setup() else { return };
    let x = s.alloc_zeros::<i32>(64).unwrap();
    let mut out = s.alloc_zeros::<i32>(64).unwrap();
    let f = m.load_function("sim_reverse_dynamic").unwrap();
    let mut b = s.launch_builder(&f);
    b.arg(&x).arg(&mut out);
    // SAFETY: refused before it runs (64 KiB of dynamic shared memory without the opt-in).
    let r = unsafe { b.launch(cfg((1, 1, 1), (64, 1, 1), 64 * 1024)) };
    assert!(r.is_err());
    assert!(last_error().contains("opt-in") || last_error().contains("dynamic shared"));
}

#[test]
fn a_kernel_missing_from_the_ptx_is_not_found() {
    let Some((_s, m)) = setup() else { return };
    assert!(
        m.load_function("amp_cast").is_err(),
        "amp_cast is not in selftest.cu's PTX"
    );
    assert!(last_error().contains("amp_cast"));
}

#[test]
fn copies_outside_an_allocation_are_refused() {
    let Some((s, _m)) = setup() else { return };
    let d = s.alloc_zeros::<f32>(4).unwrap();
    let mut host = vec![0f32; 4];
    s.memcpy_dtoh(&d, &mut host).unwrap();
    // A raw copy of 8 floats out of a 4-float allocation.
    let mut big = [0f32; 8];
    let (ptr, _g) = cudarc::driver::DevicePtr::device_ptr(&d, &s);
    // SAFETY: the stand-in checks the range before touching memory.
    let r = unsafe { cudarc::driver::sys::cuMemcpyDtoH_v2(big.as_mut_ptr() as *mut _, ptr, 32) };
    assert_ne!(r, cudarc::driver::sys::CUresult::CUDA_SUCCESS);
    assert!(last_error().contains("past the end"), "{}", last_error());
}

#[test]
fn counters_count_launches_and_copies() {
    let Some((s, m)) = setup() else { return };
    #[repr(C)]
    #[derive(Default, Clone, Copy, Debug)]
    struct Counters {
        launches: u64,
        htod_copies: u64,
        htod_bytes: u64,
        dtoh_copies: u64,
        dtoh_bytes: u64,
        dtod_copies: u64,
        dtod_bytes: u64,
        memsets: u64,
        allocs: u64,
        kernel_arg_bytes: u64,
    }
    let counters: unsafe extern "C" fn(usize, bool) -> Counters = sim_fn(b"cudasim_counters");
    // A stream of its own, so other tests' work on the default stream is not counted.
    let s2 = s.context().new_stream().unwrap();
    let id = s2.cu_stream() as usize;
    // SAFETY: plain reads of the stand-in's counters.
    let before = unsafe { counters(id, false) };
    let x = s2.clone_htod(&[1i32; 64]).unwrap();
    let mut out = s2.alloc_zeros::<i32>(2).unwrap();
    let f = m.load_function("sim_warp_sum").unwrap();
    let mut b = s2.launch_builder(&f);
    b.arg(&x).arg(&mut out);
    // SAFETY: as above.
    unsafe { b.launch(cfg((1, 1, 1), (64, 1, 1), 0)) }.unwrap();
    let got = s2.clone_dtoh(&out).unwrap();
    assert_eq!(got, vec![32, 32]);
    // SAFETY: as above.
    let after = unsafe { counters(id, false) };
    assert_eq!(after.launches - before.launches, 1);
    assert_eq!(after.htod_copies - before.htod_copies, 1);
    assert_eq!(after.htod_bytes - before.htod_bytes, 256);
    assert_eq!(after.dtoh_copies - before.dtoh_copies, 1);
    assert_eq!(after.dtoh_bytes - before.dtoh_bytes, 8);
    assert_eq!(after.kernel_arg_bytes - before.kernel_arg_bytes, 256 + 8);
}

fn last_error() -> String {
    let f: unsafe extern "C" fn(*mut std::ffi::c_char, usize) -> usize =
        sim_fn(b"cudasim_last_error_message");
    let mut buf = vec![0 as std::ffi::c_char; 1024];
    // SAFETY: the buffer is 1024 bytes.
    unsafe { f(buf.as_mut_ptr(), buf.len()) };
    // SAFETY: NUL-terminated by the stand-in.
    unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}
