//! A simulated CUDA device for machines without a GPU.
//!
//! Built as a shared library and put first on the library path under the names cudarc
//! opens (`libcuda.so`, `libcublas.so`), it answers the CUDA driver and cuBLAS calls amprobe
//! makes: one device, "amprobe-sim (simulated)", with an H100-like property set; device
//! memory is host memory the library tracks; modules are real PTX from NVRTC, whose
//! `.entry` points are checked against the host build of the same kernel sources, and a
//! launch runs that host build with the CUDA execution model of `cpp/cudasim.cuh`.
//!
//! Checks a GPU would not make: every copy and memset must lie inside one live allocation;
//! a kernel that writes past the end of an allocation (into its guard bytes) or into freed
//! memory fails its launch; launches beyond the device's limits, with a wrong argument
//! count, or of a kernel missing from the loaded PTX fail naming the kernel. Each failure's
//! message is kept for [`cudasim_last_error`] and printed to stderr.
//!
//! Pinned host memory (`cuMemHostAlloc`, `cuMemAllocHost`) is page-aligned memory the
//! library maps and tracks. A device-to-host copy into it with `cuMemcpyDtoHAsync` lands
//! at once, but its pages are closed (`PROT_NONE`) until the host waits for it: a
//! synchronize of its stream or of the context, a synchronize (or successful query) of an
//! event recorded after it, or any other device-to-host copy on its stream (those return
//! when done, so they order it). Stream order follows CUDA's: events, `cuStreamWaitEvent`,
//! and the legacy default stream's implicit order with blocking streams. A host read (or
//! write) of the copy's bytes before then ends the process with SIGABRT and a message
//! naming the copy and what last wrote its source, such as "cudasim: host read of pinned
//! memory at 0x… (copy of N bytes from device memory last written by kernel `amp_stats`)
//! before the stream was synchronized". Pages are the unit: a touch of a closed page
//! outside the copy's bytes opens the page, and the copy's bytes on it are then no longer
//! watched. `cuMemFreeHost` of a buffer with a copy pending fails naming it. Copies into pageable
//! memory are synchronous on a GPU too, and are not watched. Each device allocation
//! remembers what last wrote it: the last kernel seen to write it (see below), copy,
//! memset, or cuBLAS call.
//!
//! Work is executed when it is queued, and counted per stream: launches, copies each way
//! with their bytes, the bytes of every argument buffer a kernel could touch, and the bytes
//! kernels did read and write of those buffers, measured (see [`Counters`] for how, and at
//! what granularity), and cuBLAS GEMMs with their flops and operand bytes. Launches run one at a time, so that the measurement of one is not
//! disturbed by another.
//!
//! Both checks rest on one SIGSEGV handler, installed by `cuInit`, which handles faults on
//! the pages the library closed and hands every other fault to the handler installed
//! before it.

#![allow(non_snake_case)]
#![allow(clippy::missing_safety_doc)]

mod blas;
mod driver;
mod fault;
mod memory;
mod pinned;
mod ptx;
mod traffic;

pub use driver::Counters;

/// The device's name, as `cuDeviceGetName` reports it.
pub const DEVICE_NAME: &str = "amprobe-sim (simulated)";
