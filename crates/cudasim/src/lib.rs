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
//! Work is executed when it is queued (one in-order stream is all amprobe uses), and
//! counted per stream: launches, copies each way with their bytes, and the bytes of every
//! argument buffer a kernel could touch.

#![allow(non_snake_case)]
#![allow(clippy::missing_safety_doc)]

mod blas;
mod driver;
mod memory;
mod ptx;

pub use driver::Counters;

/// The device's name, as `cuDeviceGetName` reports it.
pub const DEVICE_NAME: &str = "amprobe-sim (simulated)";
