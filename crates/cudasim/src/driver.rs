//! The CUDA driver functions amprobe's cudarc calls, over the simulated device.

use crate::memory::Memory;
use crate::pinned::{Pinned, StreamOrder};
use crate::traffic::{self, Arg, Watch};
use crate::{fault, ptx};
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::{Arc, Mutex, MutexGuard};

/// `CUresult` codes used here.
pub(crate) mod code {
    pub const SUCCESS: u32 = 0;
    pub const INVALID_VALUE: u32 = 1;
    pub const OUT_OF_MEMORY: u32 = 2;
    pub const NOT_INITIALIZED: u32 = 3;
    pub const INVALID_DEVICE: u32 = 101;
    pub const INVALID_IMAGE: u32 = 200;
    pub const INVALID_HANDLE: u32 = 400;
    pub const NOT_FOUND: u32 = 500;
    pub const ILLEGAL_ADDRESS: u32 = 700;
    pub const LAUNCH_OUT_OF_RESOURCES: u32 = 701;
    pub const LAUNCH_FAILED: u32 = 719;
    pub const NOT_SUPPORTED: u32 = 801;
}
use code::*;

/// The device's limits (an H100 SXM's).
pub(crate) const MAX_THREADS_PER_BLOCK: u32 = 1024;
pub(crate) const MAX_BLOCK_DIM: [u32; 3] = [1024, 1024, 64];
pub(crate) const MAX_GRID_DIM: [u32; 3] = [2_147_483_647, 65_535, 65_535];
pub(crate) const STATIC_SHARED_LIMIT: usize = 48 * 1024;
pub(crate) const SHARED_OPTIN_LIMIT: usize = 227 * 1024;
const TOTAL_MEM: usize = 80 * 1024 * 1024 * 1024;

/// What was done on one stream (or all of them).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    /// Kernel launches.
    pub launches: u64,
    /// Host-to-device copies and their bytes.
    pub htod_copies: u64,
    /// Bytes copied host to device.
    pub htod_bytes: u64,
    /// Device-to-host copies.
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
    /// Bytes of the allocations that launches were given as arguments (what the kernels
    /// could read or write; an upper bound of their traffic).
    pub kernel_arg_bytes: u64,
    /// Bytes kernels read of their argument allocations, measured at page granularity: the
    /// bytes (within the allocation's size) of every page whose first touch in the launch
    /// was a read. A lower bound: a page first written and then read in the same launch
    /// does not count as read (nor one updated only by atomics, which touch it as writes);
    /// memory reached through pointers stored in device memory rather than passed as
    /// arguments is not seen. Reads and writes are told apart on x86-64 Linux; elsewhere
    /// every page touched counts as read.
    /// (Measured only while traffic measurement is on: `CUDASIM_TRAFFIC=1` or
    /// `cudasim_measure_traffic`; 0 otherwise.)
    pub kernel_read_bytes: u64,
    /// Bytes kernels wrote of their argument allocations, measured at page granularity: the
    /// bytes (within the allocation's size) of every page written in the launch, whether
    /// first touched by a write or written after a read, and whatever the values written
    /// (a write of the value already there counts); as for reads, memory reached through
    /// pointers stored in device memory is not seen. (Measured only while traffic
    /// measurement is on.)
    pub kernel_written_bytes: u64,
    /// cuBLAS GEMM calls (`cublasGemmStridedBatchedEx`), each one kernel on a GPU; not in
    /// `launches`.
    pub gemm_calls: u64,
    /// Floating-point operations of those GEMMs: `2·m·n·k` per batch entry (a multiply and
    /// an add per term).
    pub gemm_flops: u64,
    /// The part of `gemm_flops` with f32 operands (not run on fp16/bf16 tensor cores).
    pub gemm_f32_flops: u64,
    /// Bytes of those GEMMs' operands: A and B read once, C written once and also read when
    /// beta is nonzero (the least a GEMM moves; not measured).
    pub gemm_bytes: u64,
}

impl Counters {
    fn add(&mut self, o: &Counters) {
        self.launches += o.launches;
        self.htod_copies += o.htod_copies;
        self.htod_bytes += o.htod_bytes;
        self.dtoh_copies += o.dtoh_copies;
        self.dtoh_bytes += o.dtoh_bytes;
        self.dtod_copies += o.dtod_copies;
        self.dtod_bytes += o.dtod_bytes;
        self.memsets += o.memsets;
        self.allocs += o.allocs;
        self.kernel_arg_bytes += o.kernel_arg_bytes;
        self.kernel_read_bytes += o.kernel_read_bytes;
        self.kernel_written_bytes += o.kernel_written_bytes;
        self.gemm_calls += o.gemm_calls;
        self.gemm_flops += o.gemm_flops;
        self.gemm_f32_flops += o.gemm_f32_flops;
        self.gemm_bytes += o.gemm_bytes;
    }
}

#[repr(C)]
pub(crate) struct KernelInfo {
    name: *const c_char,
    nparams: usize,
    param_sizes: *const usize,
    invoke: *const c_void,
    func: *const c_void,
}

extern "C" {
    fn cudasim_kernels(n: *mut usize) -> *const KernelInfo;
    fn cudasim_run(
        k: *const KernelInfo,
        grid: *const c_uint,
        block: *const c_uint,
        dynamic_shared: *mut c_void,
        args: *mut *mut c_void,
        err: *mut c_char,
        errlen: usize,
    ) -> c_int;
}

struct Function {
    name: String,
    kernel: *const KernelInfo,
    entry: ptx::Entry,
    max_dynamic_shared: usize,
}

// SAFETY: KernelInfo pointers address the library's static, immutable kernel table.
unsafe impl Send for Function {}

struct Module {
    functions: Vec<usize>,
    loaded: bool,
}

#[derive(Default)]
struct State {
    initialized: bool,
    memory: Memory,
    pinned: Pinned,
    order: StreamOrder,
    modules: Vec<Module>,
    functions: Vec<Function>,
    streams: HashMap<usize, Counters>,
    /// Launches per kernel name, all streams.
    by_kernel: HashMap<String, u64>,
    next_stream: usize,
    events: usize,
    last_error: String,
}

static STATE: Mutex<Option<State>> = Mutex::new(None);

fn state() -> MutexGuard<'static, Option<State>> {
    STATE.lock().unwrap_or_else(|e| e.into_inner())
}

/// Runs `f` on the state, or returns NOT_INITIALIZED before `cuInit`.
fn with<T>(f: impl FnOnce(&mut State) -> Result<T, (u32, String)>) -> Result<T, u32> {
    let mut g = state();
    let Some(s) = g.as_mut() else {
        return Err(NOT_INITIALIZED);
    };
    if !s.initialized {
        return Err(NOT_INITIALIZED);
    }
    f(s).map_err(|(c, msg)| {
        eprintln!("cudasim: {msg}");
        s.last_error = msg;
        c
    })
}

fn status(r: Result<(), u32>) -> u32 {
    match r {
        Ok(()) => SUCCESS,
        Err(c) => c,
    }
}

/// The stream a handle names (CU_STREAM_LEGACY is the default stream).
fn sid(stream: *mut c_void) -> usize {
    match stream as usize {
        1 => 0,
        s => s,
    }
}

fn counters(s: &mut State, stream: *mut c_void) -> &mut Counters {
    s.streams.entry(sid(stream)).or_default()
}

/// The counters of `stream` (0: the default stream), or of every stream when `all`.
#[no_mangle]
pub extern "C" fn cudasim_counters(stream: usize, all: bool) -> Counters {
    let g = state();
    let Some(s) = g.as_ref() else {
        return Counters::default();
    };
    if all {
        let mut c = Counters::default();
        for v in s.streams.values() {
            c.add(v);
        }
        c
    } else {
        s.streams.get(&stream).copied().unwrap_or_default()
    }
}

/// Launches of the kernel named by the C string `name` so far, all streams (0 for a null
/// or non-UTF-8 name).
///
/// # Safety
/// `name` is null or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn cudasim_kernel_launches(name: *const c_char) -> u64 {
    if name.is_null() {
        return 0;
    }
    let Ok(name) = CStr::from_ptr(name).to_str() else {
        return 0;
    };
    state()
        .as_ref()
        .and_then(|s| s.by_kernel.get(name).copied())
        .unwrap_or(0)
}

/// Live device allocations (a leak check for tests).
#[no_mangle]
pub extern "C" fn cudasim_live_allocations() -> usize {
    state().as_ref().map_or(0, |s| s.memory.live_count())
}

/// Turns the measurement of the bytes kernels read and write on (nonzero) or off (it is
/// off unless `CUDASIM_TRAFFIC=1`: it takes a fault or two on every page a launch touches).
#[no_mangle]
pub extern "C" fn cudasim_measure_traffic(on: i32) {
    traffic::set_enabled(on != 0);
}

/// Zeroes every stream's counters.
#[no_mangle]
pub extern "C" fn cudasim_reset_counters() {
    if let Some(s) = state().as_mut() {
        for v in s.streams.values_mut() {
            *v = Counters::default();
        }
    }
}

/// The message of the last failed call (empty when none failed).
fn cudasim_last_error() -> String {
    state()
        .as_ref()
        .map(|s| s.last_error.clone())
        .unwrap_or_default()
}

/// Copies the last error's message into `buf` (NUL-terminated); returns its full length.
#[no_mangle]
pub unsafe extern "C" fn cudasim_last_error_message(buf: *mut c_char, len: usize) -> usize {
    let msg = cudasim_last_error();
    if !buf.is_null() && len > 0 {
        let n = msg.len().min(len - 1);
        std::ptr::copy_nonoverlapping(msg.as_ptr() as *const c_char, buf, n);
        *buf.add(n) = 0;
    }
    msg.len()
}

/// Marks the library as the simulated device (amprobe's detection looks for this symbol).
/// `CUDASIM_AS_HARDWARE=1` answers 0, so that tests can drive the path a real GPU takes
/// (`--backend auto` choosing the device); the device's name still says "(simulated)".
#[no_mangle]
pub extern "C" fn cudasim_is_simulated() -> c_int {
    c_int::from(!std::env::var("CUDASIM_AS_HARDWARE").is_ok_and(|v| v == "1"))
}

// ---- initialization and the device

#[no_mangle]
pub extern "C" fn cuInit(_flags: c_uint) -> u32 {
    let mut g = state();
    let s = g.get_or_insert_with(State::default);
    s.initialized = true;
    fault::install();
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuDriverGetVersion(v: *mut c_int) -> u32 {
    if v.is_null() {
        return INVALID_VALUE;
    }
    *v = 13000;
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetCount(n: *mut c_int) -> u32 {
    if n.is_null() {
        return INVALID_VALUE;
    }
    status(with(|_| Ok(())).map(|()| *n = 1))
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGet(d: *mut c_int, ordinal: c_int) -> u32 {
    if d.is_null() {
        return INVALID_VALUE;
    }
    if ordinal != 0 {
        return INVALID_DEVICE;
    }
    status(with(|_| Ok(())).map(|()| *d = 0))
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetName(name: *mut c_char, len: c_int, dev: c_int) -> u32 {
    if dev != 0 {
        return INVALID_DEVICE;
    }
    if name.is_null() || len <= 0 {
        return INVALID_VALUE;
    }
    let bytes = crate::DEVICE_NAME.as_bytes();
    let n = bytes.len().min(len as usize - 1);
    std::ptr::copy_nonoverlapping(bytes.as_ptr() as *const c_char, name, n);
    *name.add(n) = 0;
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetAttribute(v: *mut c_int, attrib: c_uint, dev: c_int) -> u32 {
    if dev != 0 {
        return INVALID_DEVICE;
    }
    if v.is_null() {
        return INVALID_VALUE;
    }
    *v = match attrib {
        1 => MAX_THREADS_PER_BLOCK as c_int,
        2..=4 => MAX_BLOCK_DIM[attrib as usize - 2] as c_int,
        5..=7 => MAX_GRID_DIM[attrib as usize - 5] as c_int,
        8 => STATIC_SHARED_LIMIT as c_int,
        9 => 65_536,
        10 => 32,
        12 => 65_536,
        13 => 1_980_000,
        16 => 132,
        36 => 2_619_000,
        37 => 5120,
        38 => 50 * 1024 * 1024,
        39 => 2048,
        41 => 1,
        75 => 9,
        76 => 0,
        81 => 228 * 1024,
        97 => SHARED_OPTIN_LIMIT as c_int,
        115 => 1,
        _ => 0,
    };
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: c_int) -> u32 {
    if dev != 0 {
        return INVALID_DEVICE;
    }
    if bytes.is_null() {
        return INVALID_VALUE;
    }
    *bytes = TOTAL_MEM;
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetUuid_v2(uuid: *mut u8, dev: c_int) -> u32 {
    if dev != 0 {
        return INVALID_DEVICE;
    }
    if uuid.is_null() {
        return INVALID_VALUE;
    }
    let id = *b"amprobe-cudasim\0";
    std::ptr::copy_nonoverlapping(id.as_ptr(), uuid, 16);
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetUuid(uuid: *mut u8, dev: c_int) -> u32 {
    cuDeviceGetUuid_v2(uuid, dev)
}

#[no_mangle]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> u32 {
    status(with(|s| {
        if !free.is_null() {
            *free = TOTAL_MEM.saturating_sub(s.memory.live_bytes);
        }
        if !total.is_null() {
            *total = TOTAL_MEM;
        }
        Ok(())
    }))
}

// ---- contexts: one primary context

const CONTEXT: usize = 0xC0;

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(ctx: *mut *mut c_void, dev: c_int) -> u32 {
    if dev != 0 {
        return INVALID_DEVICE;
    }
    if ctx.is_null() {
        return INVALID_VALUE;
    }
    status(with(|_| Ok(())).map(|()| *ctx = CONTEXT as *mut c_void))
}

#[no_mangle]
pub extern "C" fn cuDevicePrimaryCtxRelease_v2(_dev: c_int) -> u32 {
    SUCCESS
}

#[no_mangle]
pub extern "C" fn cuCtxSetCurrent(_ctx: *mut c_void) -> u32 {
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxGetCurrent(ctx: *mut *mut c_void) -> u32 {
    if ctx.is_null() {
        return INVALID_VALUE;
    }
    *ctx = CONTEXT as *mut c_void;
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxGetDevice(dev: *mut c_int) -> u32 {
    if dev.is_null() {
        return INVALID_VALUE;
    }
    *dev = 0;
    SUCCESS
}

#[no_mangle]
pub extern "C" fn cuCtxSynchronize() -> u32 {
    status(with(|s| {
        far_overruns(s)?;
        s.pinned.complete(None);
        Ok(())
    }))
}

// ---- streams and events (work runs when queued, so waiting is immediate; what it settles
// is which copies into pinned memory the host may read)

/// CU_STREAM_NON_BLOCKING.
const STREAM_NON_BLOCKING: c_uint = 1;

#[no_mangle]
pub unsafe extern "C" fn cuStreamCreate(stream: *mut *mut c_void, flags: c_uint) -> u32 {
    if stream.is_null() {
        return INVALID_VALUE;
    }
    status(with(|s| {
        s.next_stream += 1;
        let id = 0x5000 + s.next_stream;
        s.streams.insert(id, Counters::default());
        s.order.create(id, flags & STREAM_NON_BLOCKING == 0);
        *stream = id as *mut c_void;
        Ok(())
    }))
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamCreateWithPriority(
    stream: *mut *mut c_void,
    flags: c_uint,
    _priority: c_int,
) -> u32 {
    cuStreamCreate(stream, flags)
}

#[no_mangle]
pub extern "C" fn cuStreamDestroy_v2(_stream: *mut c_void) -> u32 {
    SUCCESS
}

/// The host has seen `stream`'s work so far finish.
/// The whole-guard check of a synchronization point: an overrun a launch's own check could
/// not see (far past an allocation's end) is reported at the next wait, as a GPU reports a
/// kernel's fault at the next synchronizing call.
fn far_overruns(s: &mut State) -> Result<(), (u32, String)> {
    let damaged = s.memory.damaged_guards(None);
    if damaged.is_empty() {
        return Ok(());
    }
    Err((
        ILLEGAL_ADDRESS,
        format!("found at a synchronization: {}", damaged.join("; ")),
    ))
}

fn stream_done(stream: *mut c_void) -> u32 {
    status(with(|s| {
        far_overruns(s)?;
        let point = s.order.stream_point(sid(stream));
        s.pinned.complete(Some(&point));
        Ok(())
    }))
}

#[no_mangle]
pub extern "C" fn cuStreamSynchronize(stream: *mut c_void) -> u32 {
    stream_done(stream)
}

#[no_mangle]
pub extern "C" fn cuStreamQuery(stream: *mut c_void) -> u32 {
    stream_done(stream)
}

#[no_mangle]
pub extern "C" fn cuStreamWaitEvent(stream: *mut c_void, ev: *mut c_void, _f: c_uint) -> u32 {
    status(with(|s| {
        s.order.wait(sid(stream), ev as usize);
        Ok(())
    }))
}

#[no_mangle]
pub unsafe extern "C" fn cuEventCreate(ev: *mut *mut c_void, _flags: c_uint) -> u32 {
    if ev.is_null() {
        return INVALID_VALUE;
    }
    status(with(|s| {
        s.events += 1;
        *ev = (0xE000 + s.events) as *mut c_void;
        Ok(())
    }))
}

#[no_mangle]
pub extern "C" fn cuEventRecord(ev: *mut c_void, stream: *mut c_void) -> u32 {
    status(with(|s| {
        s.order.record(ev as usize, sid(stream));
        Ok(())
    }))
}

/// The host has seen the work before `ev` finish.
fn event_done(ev: *mut c_void) -> u32 {
    status(with(|s| {
        let point = s.order.event_point(ev as usize);
        s.pinned.complete(Some(&point));
        Ok(())
    }))
}

#[no_mangle]
pub extern "C" fn cuEventSynchronize(ev: *mut c_void) -> u32 {
    event_done(ev)
}

#[no_mangle]
pub extern "C" fn cuEventQuery(ev: *mut c_void) -> u32 {
    event_done(ev)
}

#[no_mangle]
pub extern "C" fn cuEventDestroy_v2(ev: *mut c_void) -> u32 {
    status(with(|s| {
        s.order.destroy_event(ev as usize);
        Ok(())
    }))
}

#[no_mangle]
pub unsafe extern "C" fn cuEventElapsedTime(ms: *mut f32, _a: *mut c_void, _b: *mut c_void) -> u32 {
    if ms.is_null() {
        return INVALID_VALUE;
    }
    // No timing exists on a simulated device; a zero says so rather than a made-up figure.
    *ms = 0.0;
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuEventElapsedTime_v2(
    ms: *mut f32,
    a: *mut c_void,
    b: *mut c_void,
) -> u32 {
    cuEventElapsedTime(ms, a, b)
}

// ---- memory

fn alloc(s: &mut State, size: usize, stream: *mut c_void) -> Result<u64, (u32, String)> {
    let addr = s
        .memory
        .alloc(size)
        .ok_or((OUT_OF_MEMORY, format!("cannot allocate {size} bytes")))?;
    s.order.enqueue(sid(stream));
    counters(s, stream).allocs += 1;
    Ok(addr)
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut u64, size: usize) -> u32 {
    if dptr.is_null() {
        return INVALID_VALUE;
    }
    status(with(|s| alloc(s, size, std::ptr::null_mut())).map(|a| *dptr = a))
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAllocAsync(dptr: *mut u64, size: usize, stream: *mut c_void) -> u32 {
    if dptr.is_null() {
        return INVALID_VALUE;
    }
    status(with(|s| alloc(s, size, stream)).map(|a| *dptr = a))
}

#[no_mangle]
pub extern "C" fn cuMemFree_v2(dptr: u64) -> u32 {
    status(with(|s| {
        s.memory.free(dptr).map_err(|m| (INVALID_VALUE, m))
    }))
}

#[no_mangle]
pub extern "C" fn cuMemFreeAsync(dptr: u64, _stream: *mut c_void) -> u32 {
    cuMemFree_v2(dptr)
}

/// CU_MEMHOSTALLOC_DEVICEMAP: host memory mapped into the device's address space.
const MEMHOSTALLOC_DEVICEMAP: c_uint = 2;

#[no_mangle]
pub unsafe extern "C" fn cuMemHostAlloc(pp: *mut *mut c_void, size: usize, flags: c_uint) -> u32 {
    if pp.is_null() {
        return INVALID_VALUE;
    }
    status(
        with(|s| {
            if flags & MEMHOSTALLOC_DEVICEMAP != 0 {
                return Err((
                    NOT_SUPPORTED,
                    "cuMemHostAlloc: mapped pinned memory (CU_MEMHOSTALLOC_DEVICEMAP) is not \
                     simulated"
                        .to_string(),
                ));
            }
            s.pinned.alloc(size).ok_or((
                OUT_OF_MEMORY,
                format!("cannot allocate {size} bytes of pinned host memory"),
            ))
        })
        .map(|p| *pp = p as *mut c_void),
    )
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAllocHost_v2(pp: *mut *mut c_void, size: usize) -> u32 {
    cuMemHostAlloc(pp, size, 0)
}

#[no_mangle]
pub extern "C" fn cuMemFreeHost(p: *mut c_void) -> u32 {
    status(with(|s| {
        s.pinned.free(p as usize).map_err(|m| (INVALID_VALUE, m))
    }))
}

unsafe fn copy(dst: u64, src: u64, n: usize) {
    std::ptr::copy(src as *const u8, dst as *mut u8, n);
}

/// Checks that host range `[p, p + n)` does not run out of the pinned buffer it starts in;
/// returns whether it is pinned memory.
fn pinned_range(s: &State, p: usize, n: usize, what: &str) -> Result<bool, (u32, String)> {
    match s.pinned.find(p) {
        None => Ok(false),
        Some((start, size)) if p + n > start + size => Err((
            INVALID_VALUE,
            format!(
                "{what}: {n} bytes at {p:#x} run {} bytes past the end of the {size}-byte \
                 pinned buffer at {start:#x}",
                p + n - (start + size)
            ),
        )),
        Some(_) => Ok(true),
    }
}

fn htod(dst: u64, src: *const c_void, n: usize, stream: *mut c_void) -> u32 {
    status(with(|s| {
        s.memory
            .check(dst, n, "host-to-device copy")
            .map_err(|m| (INVALID_VALUE, m))?;
        let lo = src as usize;
        // SAFETY: dst is inside a live allocation (checked); src is the caller's buffer.
        if pinned_range(s, lo, n, "host-to-device copy")? {
            // Pages closed for a pending copy into this buffer are read in stream order.
            s.pinned
                .with_access(lo, lo + n, || unsafe { copy(dst, src as u64, n) });
        } else {
            unsafe { copy(dst, src as u64, n) };
        }
        if n > 0 {
            s.memory.set_writer(dst, Arc::from("a host-to-device copy"));
        }
        s.order.enqueue(sid(stream));
        let c = counters(s, stream);
        c.htod_copies += 1;
        c.htod_bytes += n as u64;
        Ok(())
    }))
}

/// A device-to-host copy; `is_async` for cuMemcpyDtoHAsync (into pinned memory it is then
/// pending until the host waits for it).
fn dtoh(dst: *mut c_void, src: u64, n: usize, stream: *mut c_void, is_async: bool) -> u32 {
    status(with(|s| {
        far_overruns(s)?;
        s.memory
            .check(src, n, "device-to-host copy")
            .map_err(|m| (INVALID_VALUE, m))?;
        let lo = dst as usize;
        let pinned = pinned_range(s, lo, n, "device-to-host copy")?;
        // SAFETY: src is inside a live allocation (checked); dst is the caller's buffer.
        if pinned {
            s.pinned
                .with_access(lo, lo + n, || unsafe { copy(dst as u64, src, n) });
        } else {
            unsafe { copy(dst as u64, src, n) };
        }
        let seq = s.order.enqueue(sid(stream));
        if pinned && is_async {
            let what = format!(
                "copy of {n} bytes from device memory {}",
                s.memory.writer(src)
            );
            s.pinned.add_pending(lo, lo + n, sid(stream), seq, what);
        } else {
            // Any other device-to-host copy returns once it (and so its stream's work
            // before it) is done.
            let point = s.order.stream_point(sid(stream));
            s.pinned.complete(Some(&point));
        }
        let c = counters(s, stream);
        c.dtoh_copies += 1;
        c.dtoh_bytes += n as u64;
        Ok(())
    }))
}

fn dtod(dst: u64, src: u64, n: usize, stream: *mut c_void) -> u32 {
    status(with(|s| {
        s.memory
            .check(src, n, "device-to-device copy (source)")
            .map_err(|m| (INVALID_VALUE, m))?;
        s.memory
            .check(dst, n, "device-to-device copy (destination)")
            .map_err(|m| (INVALID_VALUE, m))?;
        // SAFETY: both ranges are inside live allocations (checked).
        unsafe { copy(dst, src, n) };
        if n > 0 {
            let from = s.memory.writer(src);
            let writer = if from.starts_with("last written by a device-to-device copy") {
                from.trim_start_matches("last written by ").to_string()
            } else {
                format!("a device-to-device copy of memory {from}")
            };
            s.memory.set_writer(dst, Arc::from(writer));
        }
        s.order.enqueue(sid(stream));
        let c = counters(s, stream);
        c.dtod_copies += 1;
        c.dtod_bytes += n as u64;
        Ok(())
    }))
}

#[no_mangle]
pub extern "C" fn cuMemcpyHtoD_v2(dst: u64, src: *const c_void, n: usize) -> u32 {
    htod(dst, src, n, std::ptr::null_mut())
}

#[no_mangle]
pub extern "C" fn cuMemcpyHtoDAsync_v2(
    dst: u64,
    src: *const c_void,
    n: usize,
    stream: *mut c_void,
) -> u32 {
    htod(dst, src, n, stream)
}

#[no_mangle]
pub extern "C" fn cuMemcpyDtoH_v2(dst: *mut c_void, src: u64, n: usize) -> u32 {
    dtoh(dst, src, n, std::ptr::null_mut(), false)
}

#[no_mangle]
pub extern "C" fn cuMemcpyDtoHAsync_v2(
    dst: *mut c_void,
    src: u64,
    n: usize,
    stream: *mut c_void,
) -> u32 {
    dtoh(dst, src, n, stream, true)
}

#[no_mangle]
pub extern "C" fn cuMemcpyDtoD_v2(dst: u64, src: u64, n: usize) -> u32 {
    dtod(dst, src, n, std::ptr::null_mut())
}

#[no_mangle]
pub extern "C" fn cuMemcpyDtoDAsync_v2(dst: u64, src: u64, n: usize, stream: *mut c_void) -> u32 {
    dtod(dst, src, n, stream)
}

fn memset(dst: u64, value: u8, n: usize, stream: *mut c_void) -> u32 {
    status(with(|s| {
        s.memory
            .check(dst, n, "memset")
            .map_err(|m| (INVALID_VALUE, m))?;
        // SAFETY: inside a live allocation (checked).
        unsafe { std::ptr::write_bytes(dst as *mut u8, value, n) };
        if n > 0 {
            s.memory.set_writer(dst, Arc::from("a memset"));
        }
        s.order.enqueue(sid(stream));
        counters(s, stream).memsets += 1;
        Ok(())
    }))
}

#[no_mangle]
pub extern "C" fn cuMemsetD8_v2(dst: u64, value: u8, n: usize) -> u32 {
    memset(dst, value, n, std::ptr::null_mut())
}

#[no_mangle]
pub extern "C" fn cuMemsetD8Async(dst: u64, value: u8, n: usize, stream: *mut c_void) -> u32 {
    memset(dst, value, n, stream)
}

/// Counts one cuBLAS GEMM on `stream`: its flops (`f32` when its operands are f32) and
/// operand bytes.
pub(crate) fn note_gemm(stream: usize, flops: u64, f32_operands: bool, bytes: u64) {
    let _ = with(|s| {
        let c = counters(s, stream as *mut c_void);
        c.gemm_calls += 1;
        c.gemm_flops += flops;
        if f32_operands {
            c.gemm_f32_flops += flops;
        }
        c.gemm_bytes += bytes;
        Ok(())
    });
}

/// Notes `what` as the last writer of the device memory at `addr` (cuBLAS results).
pub(crate) fn note_writer(addr: u64, what: &str) {
    let _ = with(|s| {
        s.memory.set_writer(addr, Arc::from(what));
        Ok(())
    });
}

// ---- modules and kernels

fn host_kernels() -> &'static [KernelInfo] {
    let mut n = 0usize;
    // SAFETY: the table is a static array of `n` entries.
    unsafe {
        let p = cudasim_kernels(&mut n);
        std::slice::from_raw_parts(p, n)
    }
}

fn kernel_name(k: &KernelInfo) -> String {
    // SAFETY: names are static NUL-terminated strings.
    unsafe { CStr::from_ptr(k.name) }
        .to_string_lossy()
        .into_owned()
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleLoadData(module: *mut *mut c_void, image: *const c_void) -> u32 {
    if module.is_null() || image.is_null() {
        return INVALID_VALUE;
    }
    let text = CStr::from_ptr(image as *const c_char).to_string_lossy();
    if !text.contains(".entry") && !text.contains(".version") {
        return status(with(|_| {
            Err((
                INVALID_IMAGE,
                "cuModuleLoadData: the image is not PTX text (the simulated device runs PTX \
                 modules only)"
                    .to_string(),
            ))
        }));
    }
    let entries = ptx::entries(&text);
    status(
        with(|s| {
            let mut functions = Vec::new();
            for (name, entry) in entries {
                // Entries without a host build stay unresolved until asked for by name.
                let kernel = host_kernels()
                    .iter()
                    .find(|k| kernel_name(k) == name)
                    .map_or(std::ptr::null(), |k| k as *const KernelInfo);
                s.functions.push(Function {
                    name,
                    kernel,
                    entry,
                    max_dynamic_shared: STATIC_SHARED_LIMIT,
                });
                functions.push(s.functions.len() - 1);
            }
            s.modules.push(Module {
                functions,
                loaded: true,
            });
            Ok(s.modules.len())
        })
        .map(|id| *module = id as *mut c_void),
    )
}

#[no_mangle]
pub extern "C" fn cuModuleUnload(module: *mut c_void) -> u32 {
    status(with(|s| {
        let m = s
            .modules
            .get_mut((module as usize).wrapping_sub(1))
            .ok_or((INVALID_HANDLE, "cuModuleUnload: unknown module".to_string()))?;
        m.loaded = false;
        Ok(())
    }))
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleGetFunction(
    f: *mut *mut c_void,
    module: *mut c_void,
    name: *const c_char,
) -> u32 {
    if f.is_null() || name.is_null() {
        return INVALID_VALUE;
    }
    let want = CStr::from_ptr(name).to_string_lossy().into_owned();
    status(
        with(|s| {
            let m = s
                .modules
                .get((module as usize).wrapping_sub(1))
                .filter(|m| m.loaded)
                .ok_or((INVALID_HANDLE, format!("kernel {want}: unknown module")))?;
            let id = *m
                .functions
                .iter()
                .find(|&&i| s.functions[i].name == want)
                .ok_or((
                    NOT_FOUND,
                    format!("kernel {want}: not an .entry of the loaded PTX"),
                ))?;
            let func = &s.functions[id];
            if func.kernel.is_null() {
                return Err((
                    NOT_FOUND,
                    format!("kernel {want}: in the PTX but not in the simulator's host build"),
                ));
            }
            // SAFETY: a pointer into the static kernel table.
            let k = &*func.kernel;
            let host: Vec<usize> = std::slice::from_raw_parts(k.param_sizes, k.nparams).to_vec();
            if host != func.entry.params {
                return Err((
                    INVALID_IMAGE,
                    format!(
                        "kernel {want}: the PTX entry takes parameters of {:?} bytes, the host \
                         build {host:?}",
                        func.entry.params
                    ),
                ));
            }
            Ok(id + 1)
        })
        .map(|id| *f = id as *mut c_void),
    )
}

#[no_mangle]
pub unsafe extern "C" fn cuFuncGetAttribute(v: *mut c_int, attrib: c_uint, f: *mut c_void) -> u32 {
    if v.is_null() {
        return INVALID_VALUE;
    }
    status(with(|s| {
        let func = s.functions.get((f as usize).wrapping_sub(1)).ok_or((
            INVALID_HANDLE,
            "cuFuncGetAttribute: unknown function".to_string(),
        ))?;
        *v = match attrib {
            0 => MAX_THREADS_PER_BLOCK as c_int,
            1 => func.entry.static_shared as c_int,
            8 => func.max_dynamic_shared as c_int,
            _ => 0,
        };
        Ok(())
    }))
}

#[no_mangle]
pub extern "C" fn cuFuncSetAttribute(f: *mut c_void, attrib: c_uint, value: c_int) -> u32 {
    status(with(|s| {
        let func = s.functions.get_mut((f as usize).wrapping_sub(1)).ok_or((
            INVALID_HANDLE,
            "cuFuncSetAttribute: unknown function".to_string(),
        ))?;
        if attrib == 8 {
            if value < 0 || func.entry.static_shared + value as usize > SHARED_OPTIN_LIMIT {
                return Err((
                    INVALID_VALUE,
                    format!(
                        "kernel {}: dynamic shared memory of {value} bytes (plus {} static) is \
                         over the device's opt-in limit of {SHARED_OPTIN_LIMIT}",
                        func.name, func.entry.static_shared
                    ),
                ));
            }
            func.max_dynamic_shared = value as usize;
        }
        Ok(())
    }))
}

fn launch_error(name: &str, msg: String) -> (u32, String) {
    (LAUNCH_FAILED, format!("kernel {name}: {msg}"))
}

#[no_mangle]
pub unsafe extern "C" fn cuLaunchKernel(
    f: *mut c_void,
    gx: c_uint,
    gy: c_uint,
    gz: c_uint,
    bx: c_uint,
    by: c_uint,
    bz: c_uint,
    shared: c_uint,
    stream: *mut c_void,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> u32 {
    // The launch runs with the state lock released (kernels may run for a while, and other
    // threads' copies must not wait); what it needs is read first. Launches themselves run
    // one at a time (see traffic.rs).
    let _launch = traffic::launch_lock();
    let prepared = with(|s| {
        let func = s.functions.get((f as usize).wrapping_sub(1)).ok_or((
            INVALID_HANDLE,
            "cuLaunchKernel: unknown function".to_string(),
        ))?;
        let (name, entry, kernel, max_dynamic_shared) = (
            func.name.clone(),
            func.entry.clone(),
            func.kernel,
            func.max_dynamic_shared,
        );
        if !extra.is_null() {
            return Err((
                NOT_SUPPORTED,
                format!("kernel {name}: arguments through `extra` are not supported"),
            ));
        }
        let threads = u64::from(bx) * u64::from(by) * u64::from(bz);
        let dims_ok = bx <= MAX_BLOCK_DIM[0] && by <= MAX_BLOCK_DIM[1] && bz <= MAX_BLOCK_DIM[2];
        if threads == 0 || threads > u64::from(MAX_THREADS_PER_BLOCK) || !dims_ok {
            return Err((
                INVALID_VALUE,
                format!(
                    "kernel {name}: a block of ({bx}, {by}, {bz}) = {threads} threads is over the \
                     device's limit of {MAX_THREADS_PER_BLOCK} (dims at most {MAX_BLOCK_DIM:?})"
                ),
            ));
        }
        let grid_ok = gx >= 1
            && gy >= 1
            && gz >= 1
            && gx <= MAX_GRID_DIM[0]
            && gy <= MAX_GRID_DIM[1]
            && gz <= MAX_GRID_DIM[2];
        if !grid_ok {
            return Err((
                INVALID_VALUE,
                format!("kernel {name}: grid ({gx}, {gy}, {gz}) is outside {MAX_GRID_DIM:?}"),
            ));
        }
        if entry.static_shared > STATIC_SHARED_LIMIT {
            return Err((
                LAUNCH_OUT_OF_RESOURCES,
                format!(
                    "kernel {name}: {} bytes of static shared memory, over the limit of \
                     {STATIC_SHARED_LIMIT}",
                    entry.static_shared
                ),
            ));
        }
        if shared as usize > max_dynamic_shared {
            return Err((
                INVALID_VALUE,
                format!(
                    "kernel {name}: {shared} bytes of dynamic shared memory, over the {} \
                     allowed (raise it with CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, \
                     up to {SHARED_OPTIN_LIMIT})",
                    max_dynamic_shared
                ),
            ));
        }
        let nparams = entry.params.len();
        if nparams > 0 && params.is_null() {
            return Err((
                INVALID_VALUE,
                format!("kernel {name}: takes {nparams} arguments, none were given"),
            ));
        }
        // Arguments that address device memory: counted as the bytes the kernel may touch,
        // and watched for what it does touch. A pointer is an 8-byte argument or an aligned
        // 8-byte word of a struct passed by value (a descriptor holding a tensor's
        // address), or, one level down, an aligned word of an argument allocation of at
        // most 64 KiB (an array of descriptors). A word that only looks like an address
        // costs a watch but counts nothing: only pages the kernel touches count.
        let mut arg_bytes = 0u64;
        let mut args: Vec<Arg> = Vec::new();
        for (i, &sz) in entry.params.iter().enumerate() {
            if sz < 8 || sz % 8 != 0 {
                continue;
            }
            let p = *params.add(i);
            if p.is_null() {
                return Err((
                    INVALID_VALUE,
                    format!("kernel {name}: argument {i} is missing (null pointer)"),
                ));
            }
            for w in 0..sz / 8 {
                let v = std::ptr::read_unaligned((p as *const u64).add(w));
                let Some((start, a)) = s.memory.find(v) else {
                    continue;
                };
                if a.freed {
                    return Err(launch_error(
                        &name,
                        format!("argument {i} points into a freed allocation (use after free)"),
                    ));
                }
                if !args.iter().any(|x| x.start == start) {
                    arg_bytes += a.size as u64;
                    args.push(Arg {
                        start,
                        size: a.size,
                        mapped: a.mapped,
                    });
                }
            }
        }
        // One level down: descriptor arrays in device memory (written by a copy before the
        // launch; copies complete when they are queued here).
        let direct = args.len();
        for k in 0..direct {
            let a = args[k];
            if a.size > 64 * 1024 {
                continue;
            }
            for w in 0..a.size / 8 {
                let v = std::ptr::read_unaligned((a.start as *const u64).add(w));
                let Some((start, b)) = s.memory.find(v) else {
                    continue;
                };
                if b.freed || args.iter().any(|x| x.start == start) {
                    continue;
                }
                args.push(Arg {
                    start,
                    size: b.size,
                    mapped: b.mapped,
                });
            }
        }
        // Only a launch that measures its traffic watches them in the fault handler's table.
        if args.len() > fault::MAX_TRACKED && traffic::enabled() {
            return Err((
                NOT_SUPPORTED,
                format!(
                    "kernel {name}: {} distinct allocations as arguments, over the {} the \
                     simulator can watch while it measures traffic",
                    args.len(),
                    fault::MAX_TRACKED
                ),
            ));
        }
        s.order.enqueue(sid(stream));
        let c = counters(s, stream);
        c.launches += 1;
        c.kernel_arg_bytes += arg_bytes;
        *s.by_kernel.entry(name.clone()).or_default() += 1;
        Ok((name, kernel, args))
    });
    let (name, kernel, args) = match prepared {
        Ok(p) => p,
        Err(c) => return c,
    };
    let measure = traffic::enabled();
    // SAFETY: live allocations (checked under the lock); launches run one at a time.
    let watch = Watch::start(if measure { &args } else { &[] });
    CURRENT_KERNEL.with(|k| *k.borrow_mut() = name.clone());
    let mut dynamic = vec![0u8; shared as usize + 16];
    let grid = [gx, gy, gz];
    let block = [bx, by, bz];
    let mut err = [0 as c_char; 512];
    let rc = cudasim_run(
        kernel,
        grid.as_ptr(),
        block.as_ptr(),
        dynamic.as_mut_ptr() as *mut c_void,
        params,
        err.as_mut_ptr(),
        err.len(),
    );
    CURRENT_KERNEL.with(|k| k.borrow_mut().clear());
    let traffic = watch.finish();
    status(with(|s| {
        let writer: Arc<str> = Arc::from(format!("kernel `{name}`"));
        let c = counters(s, stream);
        for t in &traffic {
            c.kernel_read_bytes += t.read;
            c.kernel_written_bytes += t.written;
        }
        if !measure {
            // Unmeasured, any allocation the kernel was given may have been written.
            for a in &args {
                s.memory.set_writer(a.start, writer.clone());
            }
        }
        for (a, t) in args.iter().zip(&traffic) {
            if t.wrote {
                s.memory.set_writer(a.start, writer.clone());
            }
            if s.memory.find(a.start).is_some_and(|(_, x)| x.freed) {
                // Freed by another thread during the launch: closed again, as freed memory is.
                libc::mprotect(a.start as *mut c_void, a.mapped, libc::PROT_NONE);
            }
        }
        if rc != 0 {
            let msg = CStr::from_ptr(err.as_ptr()).to_string_lossy().into_owned();
            return Err(launch_error(&name, msg));
        }
        let given: Vec<u64> = args.iter().map(|a| a.start).collect();
        let damaged = s.memory.damaged_guards(Some(&given));
        if !damaged.is_empty() {
            return Err((
                ILLEGAL_ADDRESS,
                format!("kernel {name}: {}", damaged.join("; ")),
            ));
        }
        Ok(())
    }))
}

thread_local! {
    /// The kernel running on this thread, for the fault handler's message.
    static CURRENT_KERNEL: std::cell::RefCell<String> = const { std::cell::RefCell::new(String::new()) };
}

// ---- errors

fn error_name(c: u32) -> &'static [u8] {
    match c {
        SUCCESS => b"CUDA_SUCCESS\0",
        INVALID_VALUE => b"CUDA_ERROR_INVALID_VALUE\0",
        OUT_OF_MEMORY => b"CUDA_ERROR_OUT_OF_MEMORY\0",
        NOT_INITIALIZED => b"CUDA_ERROR_NOT_INITIALIZED\0",
        INVALID_DEVICE => b"CUDA_ERROR_INVALID_DEVICE\0",
        INVALID_IMAGE => b"CUDA_ERROR_INVALID_IMAGE\0",
        INVALID_HANDLE => b"CUDA_ERROR_INVALID_HANDLE\0",
        NOT_FOUND => b"CUDA_ERROR_NOT_FOUND\0",
        ILLEGAL_ADDRESS => b"CUDA_ERROR_ILLEGAL_ADDRESS\0",
        LAUNCH_OUT_OF_RESOURCES => b"CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES\0",
        LAUNCH_FAILED => b"CUDA_ERROR_LAUNCH_FAILED\0",
        NOT_SUPPORTED => b"CUDA_ERROR_NOT_SUPPORTED\0",
        _ => b"CUDA_ERROR_UNKNOWN\0",
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuGetErrorName(c: u32, out: *mut *const c_char) -> u32 {
    if out.is_null() {
        return INVALID_VALUE;
    }
    *out = error_name(c).as_ptr() as *const c_char;
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuGetErrorString(c: u32, out: *mut *const c_char) -> u32 {
    cuGetErrorName(c, out)
}

/// NVIDIA's private interface tables (NVRTC asks for them when it finds a driver). The
/// simulated driver has none; NVRTC then compiles as it does without a driver.
#[no_mangle]
pub unsafe extern "C" fn cuGetExportTable(table: *mut *const c_void, _id: *const c_void) -> u32 {
    if !table.is_null() {
        *table = std::ptr::null();
    }
    NOT_SUPPORTED
}
