//! The simulated device against kernels with known answers (`kernels/selftest.cu`), through
//! the same cudarc calls amprobe makes, and launches that must fail. Needs the stand-in
//! first on the library path and libnvrtc (scripts/cudasim.sh sets both up); skips without
//! them unless `AMPROBE_REQUIRE_GPU=1`.

use cudarc::driver::{
    sys, CudaContext, CudaModule, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg,
};
use std::os::unix::process::ExitStatusExt;
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
fn a_write_far_past_the_end_is_reported_at_the_next_synchronization() {
    let Some((s, m)) = setup() else { return };
    let mut x = s.alloc_zeros::<f32>(10).unwrap();
    let (n, far) = (10u32, 300u32);
    let f = m.load_function("sim_write_far_past_end").unwrap();
    let mut b = s.launch_builder(&f);
    b.arg(&mut x).arg(&n).arg(&far);
    // SAFETY: the kernel writes 1200 bytes past the end on purpose, inside the mapping's
    // guard page but beyond the bytes a launch checks.
    let r = unsafe { b.launch(cfg((1, 1, 1), (32, 1, 1), 0)) };
    assert!(
        r.is_ok(),
        "a launch checks only the near guard: {}",
        last_error()
    );
    let mut host = vec![0f32; 10];
    assert!(
        s.memcpy_dtoh(&x, &mut host).is_err(),
        "the far write was not reported"
    );
    let msg = last_error();
    assert!(
        msg.contains("synchronization")
            && msg.contains("past the end")
            && msg.contains("sim_write_far_past_end"),
        "{msg}"
    );
    // The guard is restored: the next wait is judged on its own.
    assert!(s.memcpy_dtoh(&x, &mut host).is_ok(), "{}", last_error());
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

/// The stand-in's `Counters`, field for field.
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
    kernel_read_bytes: u64,
    kernel_written_bytes: u64,
    gemm_calls: u64,
    gemm_flops: u64,
    gemm_f32_flops: u64,
    gemm_bytes: u64,
}

/// The counters of `stream`.
fn stream_counters(stream: &CudaStream) -> Counters {
    let counters: unsafe extern "C" fn(usize, bool) -> Counters = sim_fn(b"cudasim_counters");
    // SAFETY: a plain read of the stand-in's counters.
    unsafe { counters(stream.cu_stream() as usize, false) }
}

#[test]
fn counters_count_launches_and_copies() {
    let Some((s, m)) = setup() else { return };
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

#[test]
fn gemms_are_counted_with_their_flops_and_operand_bytes() {
    let Some((s, _m)) = setup() else { return };
    type Gemm = unsafe extern "C" fn(
        *mut c_void,
        u32,
        u32,
        c_int,
        c_int,
        c_int,
        *const c_void,
        *const c_void,
        u32,
        c_int,
        i64,
        *const c_void,
        u32,
        c_int,
        i64,
        *const c_void,
        *mut c_void,
        u32,
        c_int,
        i64,
        c_int,
        u32,
        c_int,
    ) -> u32;
    use std::ffi::{c_int, c_void};
    let create: unsafe extern "C" fn(*mut *mut c_void) -> u32 = sim_fn(b"cublasCreate_v2");
    let set_stream: unsafe extern "C" fn(*mut c_void, *mut c_void) -> u32 =
        sim_fn(b"cublasSetStream_v2");
    let gemm: Gemm = sim_fn(b"cublasGemmStridedBatchedEx");
    let s2 = s.context().new_stream().unwrap();
    let (m, n, k, batch) = (2usize, 3usize, 4usize, 2usize);
    let a = s2.clone_htod(&vec![1f32; m * k * batch]).unwrap();
    let b = s2.clone_htod(&vec![2f32; k * n * batch]).unwrap();
    let mut c = s2.alloc_zeros::<f32>(m * n * batch).unwrap();
    let before = stream_counters(&s2);
    let (alpha, beta) = (1f32, 0f32);
    let i = |x: usize| x as c_int;
    // SAFETY: column-major operands of the stated sizes; f32 in and out (types 0), no
    // transposes, compute type 68 (32F).
    let rc = unsafe {
        let mut h = std::ptr::null_mut();
        assert_eq!(create(&mut h), 0);
        assert_eq!(set_stream(h, s2.cu_stream() as *mut c_void), 0);
        let (pa, _ga) = cudarc::driver::DevicePtr::device_ptr(&a, &s2);
        let (pb, _gb) = cudarc::driver::DevicePtr::device_ptr(&b, &s2);
        let (pc, _gc) = cudarc::driver::DevicePtrMut::device_ptr_mut(&mut c, &s2);
        let rc = gemm(
            h,
            0,
            0,
            i(m),
            i(n),
            i(k),
            (&alpha) as *const f32 as *const c_void,
            pa as *const c_void,
            0,
            i(m),
            (m * k) as i64,
            pb as *const c_void,
            0,
            i(k),
            (k * n) as i64,
            (&beta) as *const f32 as *const c_void,
            pc as *mut c_void,
            0,
            i(m),
            (m * n) as i64,
            i(batch),
            68,
            -1,
        );
        set_stream(h, std::ptr::null_mut());
        rc
    };
    assert_eq!(rc, 0);
    assert_eq!(s2.clone_dtoh(&c).unwrap(), vec![8f32; m * n * batch]);
    let after = stream_counters(&s2);
    assert_eq!(after.launches - before.launches, 0);
    assert_eq!(after.gemm_calls - before.gemm_calls, 1);
    assert_eq!(
        after.gemm_flops - before.gemm_flops,
        (2 * m * n * k * batch) as u64
    );
    assert_eq!(
        after.gemm_f32_flops - before.gemm_f32_flops,
        (2 * m * n * k * batch) as u64
    );
    let bytes = batch * (m * k + k * n + m * n) * 4;
    assert_eq!(after.gemm_bytes - before.gemm_bytes, bytes as u64);
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

/// Floats whose four bytes are all nonzero, so that writing them over zeros changes every
/// byte.
fn nonzero_bytes(n: usize) -> Vec<f32> {
    (0..n as u32)
        .map(|i| f32::from_bits(0x3F80_0101 | ((i % 127) << 16) | ((i % 251) << 8) | 1))
        .collect()
}

/// Launches `sim_copy` of `n` floats from `a` into `b` on `s`.
fn launch_copy(
    s: &Arc<CudaStream>,
    m: &Arc<CudaModule>,
    a: &CudaSlice<f32>,
    b: &mut CudaSlice<f32>,
    n: u32,
) {
    let f = m.load_function("sim_copy").unwrap();
    let mut l = s.launch_builder(&f);
    l.arg(a).arg(b).arg(&n);
    // SAFETY: argument types match the kernel; both buffers hold at least n floats.
    unsafe { l.launch(cfg((n.div_ceil(256), 1, 1), (256, 1, 1), 0)) }.unwrap();
}

/// Device memory last written by the kernel `sim_copy`, and what it holds.
fn written_by_sim_copy(
    s: &Arc<CudaStream>,
    m: &Arc<CudaModule>,
    n: usize,
) -> (CudaSlice<f32>, Vec<f32>) {
    let want = nonzero_bytes(n);
    let a = s.clone_htod(&want).unwrap();
    let mut d = s.alloc_zeros::<f32>(n).unwrap();
    launch_copy(s, m, &a, &mut d, n as u32);
    (d, want)
}

#[test]
fn kernel_reads_and_writes_are_measured() {
    let Some((s, m)) = setup() else { return };
    // SAFETY: the stand-in's own switch, called with its signature.
    unsafe { sim_fn::<unsafe extern "C" fn(i32)>(b"cudasim_measure_traffic")(1) };
    // A stream of its own, so other tests' work on the default stream is not counted.
    let s2 = s.context().new_stream().unwrap();
    // Not a whole number of pages: reads are clipped to the allocation's size.
    let n = 3000usize;
    let a = s2.clone_htod(&nonzero_bytes(n)).unwrap();
    let mut b = s2.alloc_zeros::<f32>(n).unwrap();
    let before = stream_counters(&s2);
    launch_copy(&s2, &m, &a, &mut b, n as u32);
    let after = stream_counters(&s2);
    // All of a is read; b is only written (its pages are first touched by writes).
    assert_eq!(
        after.kernel_read_bytes - before.kernel_read_bytes,
        4 * n as u64
    );
    assert_eq!(
        after.kernel_written_bytes - before.kernel_written_bytes,
        4 * n as u64
    );
    assert_eq!(s2.clone_dtoh(&b).unwrap(), nonzero_bytes(n));

    // The same copy again: every value written is the one already there, and still counts.
    let before = stream_counters(&s2);
    launch_copy(&s2, &m, &a, &mut b, n as u32);
    let after = stream_counters(&s2);
    assert_eq!(
        after.kernel_written_bytes - before.kernel_written_bytes,
        4 * n as u64
    );

    // In place: b's pages are read first, then written; both count, whether the values
    // change (scale by 2) or not (scale by 1).
    let f = m.load_function("sim_scale").unwrap();
    for scale in [2.0f32, 1.0] {
        let old = s2.clone_dtoh(&b).unwrap();
        let before = stream_counters(&s2);
        let n32 = n as u32;
        let mut l = s2.launch_builder(&f);
        l.arg(&mut b).arg(&scale).arg(&n32);
        // SAFETY: argument types match the kernel; b holds n floats.
        unsafe { l.launch(cfg((n32.div_ceil(256), 1, 1), (256, 1, 1), 0)) }.unwrap();
        let after = stream_counters(&s2);
        let want: Vec<f32> = old.iter().map(|x| x * scale).collect();
        assert_eq!(s2.clone_dtoh(&b).unwrap(), want, "scale {scale}");
        assert_eq!(
            after.kernel_read_bytes - before.kernel_read_bytes,
            4 * n as u64,
            "scale {scale}"
        );
        assert_eq!(
            after.kernel_written_bytes - before.kernel_written_bytes,
            4 * n as u64,
            "scale {scale}"
        );
    }

    // Counted by pages: ten floats of a 32 KiB buffer read its first page; written into a
    // 40-byte buffer they count 40 bytes (the page clipped to the allocation), into a
    // 32 KiB one a whole page.
    let big = s2.clone_htod(&nonzero_bytes(8192)).unwrap();
    let mut out = s2.alloc_zeros::<f32>(10).unwrap();
    let before = stream_counters(&s2);
    launch_copy(&s2, &m, &big, &mut out, 10);
    let after = stream_counters(&s2);
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as u64;
    assert_eq!(
        after.kernel_read_bytes - before.kernel_read_bytes,
        page.min(4 * 8192)
    );
    assert_eq!(after.kernel_written_bytes - before.kernel_written_bytes, 40);
    assert_eq!(
        after.kernel_arg_bytes - before.kernel_arg_bytes,
        4 * 8192 + 40
    );
    let mut big_out = s2.alloc_zeros::<f32>(8192).unwrap();
    let before = stream_counters(&s2);
    launch_copy(&s2, &m, &big, &mut big_out, 10);
    let after = stream_counters(&s2);
    assert_eq!(
        after.kernel_written_bytes - before.kernel_written_bytes,
        page.min(4 * 8192)
    );
}

#[test]
fn pinned_memory_reads_after_a_stream_synchronize() {
    let Some((s, m)) = setup() else { return };
    let n = 5000;
    let (d, want) = written_by_sim_copy(&s, &m, n);
    // SAFETY: every element is written by the copy before it is read.
    let mut h = unsafe { s.context().alloc_pinned::<f32>(n) }.unwrap();
    s.memcpy_dtoh(&d, &mut h).unwrap();
    s.synchronize().unwrap();
    assert_eq!(h.as_slice().unwrap(), &want[..]);
    // A second copy into the same buffer, waited for by the context.
    let (d2, want2) = written_by_sim_copy(&s, &m, n);
    s.memcpy_dtoh(&d2, &mut h).unwrap();
    s.context().synchronize().unwrap();
    assert_eq!(h.as_slice().unwrap(), &want2[..]);
    // Pinned memory as a copy's source.
    let back = s.clone_htod(&h).unwrap();
    assert_eq!(s.clone_dtoh(&back).unwrap(), want2);
}

#[test]
fn pinned_memory_reads_after_an_event_recorded_after_the_copy() {
    let Some((s, m)) = setup() else { return };
    // With a second stream cudarc records the pinned buffer's event after each copy into
    // it, and `as_slice` waits for that event.
    let s2 = s.context().new_stream().unwrap();
    let n = 300;
    let (d, want) = written_by_sim_copy(&s2, &m, n);
    // SAFETY: as above.
    let mut h = unsafe { s.context().alloc_pinned::<f32>(n) }.unwrap();
    s2.memcpy_dtoh(&d, &mut h).unwrap();
    assert_eq!(h.as_slice().unwrap(), &want[..]);
}

#[test]
fn freeing_pinned_memory_with_a_copy_pending_is_refused() {
    let Some((s, m)) = setup() else { return };
    let s2 = s.context().new_stream().unwrap();
    let n = 64;
    let (d, _) = written_by_sim_copy(&s2, &m, n);
    let (src, _guard) = d.device_ptr(&s2);
    let mut p = std::ptr::null_mut();
    // SAFETY: raw driver calls on a buffer of n floats, freed below.
    unsafe {
        assert_eq!(
            sys::cuMemHostAlloc(&mut p, 4 * n, 0),
            sys::CUresult::CUDA_SUCCESS
        );
        let r = sys::cuMemcpyDtoHAsync_v2(p, src, 4 * n, s2.cu_stream());
        assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
        assert_ne!(sys::cuMemFreeHost(p), sys::CUresult::CUDA_SUCCESS);
        let msg = last_error();
        assert!(
            msg.contains("pending") && msg.contains("kernel `sim_copy`"),
            "{msg}"
        );
        s2.synchronize().unwrap();
        assert_eq!(*(p as *const f32), nonzero_bytes(1)[0]);
        assert_eq!(sys::cuMemFreeHost(p), sys::CUresult::CUDA_SUCCESS);
    }
}

/// Set in the child process of the test below.
const CHILD: &str = "CUDASIM_SELFTEST_CHILD";

#[test]
fn reading_pinned_memory_before_synchronizing_aborts_naming_the_kernel() {
    const NAME: &str = "reading_pinned_memory_before_synchronizing_aborts_naming_the_kernel";
    if std::env::var_os(CHILD).is_some() {
        let (s, m) = setup().expect("the parent found the simulated device");
        let n = 1000;
        let (d, _) = written_by_sim_copy(&s, &m, n);
        // SAFETY: as above.
        let mut h = unsafe { s.context().alloc_pinned::<f32>(n) }.unwrap();
        s.memcpy_dtoh(&d, &mut h).unwrap();
        // With the default stream alone cudarc records no event after the copy, so
        // `as_slice` waits for nothing: on a GPU this read races the copy.
        let v = std::hint::black_box(h.as_slice().unwrap()[n / 2]);
        panic!("the read of {v} before synchronizing was not caught");
    }
    if setup().is_none() {
        return;
    }
    let exe = std::env::current_exe().unwrap();
    let out = std::process::Command::new(exe)
        .args([NAME, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.signal(), Some(libc::SIGABRT), "{stderr}");
    assert!(
        stderr.contains("cudasim: host read of pinned memory at 0x")
            && stderr.contains("(copy of 4000 bytes from device memory last written by kernel `sim_copy`) before the stream was synchronized"),
        "{stderr}"
    );
}

#[test]
fn a_stream_waiting_for_the_copy_orders_it_before_its_own_synchronize() {
    let Some((s, m)) = setup() else { return };
    let (s2, s3) = (
        s.context().new_stream().unwrap(),
        s.context().new_stream().unwrap(),
    );
    let n = 256;
    let (d, want) = written_by_sim_copy(&s2, &m, n);
    let (src, _guard) = d.device_ptr(&s2);
    let mut p = std::ptr::null_mut();
    // SAFETY: raw driver calls on a buffer of n floats, freed below; it is read only after
    // s3, which waits for an event recorded after the copy, is synchronized.
    unsafe {
        assert_eq!(
            sys::cuMemHostAlloc(&mut p, 4 * n, 0),
            sys::CUresult::CUDA_SUCCESS
        );
        let r = sys::cuMemcpyDtoHAsync_v2(p, src, 4 * n, s2.cu_stream());
        assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
        s3.wait(&s2.record_event(None).unwrap()).unwrap();
        s3.synchronize().unwrap();
        assert_eq!(std::slice::from_raw_parts(p as *const f32, n), &want[..]);
        assert_eq!(sys::cuMemFreeHost(p), sys::CUresult::CUDA_SUCCESS);
    }
}
