//! Device memory of one tensor: f32 data as f32, fp16 and bf16 data as their 16-bit
//! patterns (the device computes on the real storage formats), int64 labels as i64.

use super::{dev_err, CudaDevice};
use crate::dtype::DType;
use crate::error::{Error, Result};
use cudarc::driver::{CudaSlice, DevicePtr};

/// Storage kind codes shared with the kernels (`KIND_*` in common.cuh).
pub fn kind_code(dtype: DType) -> Result<i32> {
    match dtype {
        DType::F32 => Ok(0),
        DType::F16 => Ok(1),
        DType::BF16 => Ok(2),
        other => Err(Error::Device(format!(
            "{other} tensors have no kernel storage kind (f32, f16 and bf16 do)"
        ))),
    }
}

/// Device memory of one tensor, typed by how its elements are stored.
#[derive(Debug)]
pub enum DeviceBuffer {
    /// f32 values.
    F32(CudaSlice<f32>),
    /// fp16 or bf16 bit patterns.
    Half(CudaSlice<u16>),
    /// int64 values.
    I64(CudaSlice<i64>),
}

impl DeviceBuffer {
    /// Copies f32-stored values of `dtype` (f32, f16 or bf16, each exactly representable)
    /// to the device in `dtype`'s storage format.
    pub fn upload_f32(dev: &CudaDevice, v: &[f32], dtype: DType) -> Result<DeviceBuffer> {
        let s = dev.stream();
        let up = dev_err("upload");
        Ok(match dtype {
            DType::F32 => DeviceBuffer::F32(s.clone_htod(v).map_err(|e| up(&e))?),
            DType::F16 => {
                let bits: Vec<u16> = v
                    .iter()
                    .map(|&x| half::f16::from_f32(x).to_bits())
                    .collect();
                DeviceBuffer::Half(s.clone_htod(&bits).map_err(|e| up(&e))?)
            }
            DType::BF16 => {
                // bf16 values in f32 storage are exact: their low 16 bits are zero.
                let bits: Vec<u16> = v.iter().map(|&x| (x.to_bits() >> 16) as u16).collect();
                DeviceBuffer::Half(s.clone_htod(&bits).map_err(|e| up(&e))?)
            }
            other => {
                return Err(Error::Device(format!(
                    "f32 storage cannot hold {other} on the device"
                )))
            }
        })
    }

    /// Copies int64 values to the device.
    pub fn upload_i64(dev: &CudaDevice, v: &[i64]) -> Result<DeviceBuffer> {
        let s = dev.stream();
        Ok(DeviceBuffer::I64(
            s.clone_htod(v).map_err(|e| dev_err("upload")(&e))?,
        ))
    }

    /// Device memory for `n` elements of `dtype`, zero-filled when `zero` (otherwise the
    /// caller's kernel must write every element before anything reads it).
    pub fn alloc(dev: &CudaDevice, n: usize, dtype: DType, zero: bool) -> Result<DeviceBuffer> {
        fn get<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
            s: &std::sync::Arc<cudarc::driver::CudaStream>,
            n: usize,
            zero: bool,
        ) -> Result<CudaSlice<T>> {
            let r = if zero {
                s.alloc_zeros(n)
            } else {
                // SAFETY: unzeroed memory is only handed to kernels that write every
                // element before anything reads it (the caller's contract).
                unsafe { s.alloc(n) }
            };
            r.map_err(|e| dev_err("alloc")(&e))
        }
        let s = dev.stream();
        Ok(match dtype {
            DType::F32 => DeviceBuffer::F32(get(s, n, zero)?),
            DType::F16 | DType::BF16 => DeviceBuffer::Half(get(s, n, zero)?),
            DType::I64 => DeviceBuffer::I64(get(s, n, zero)?),
            DType::F64 => return Err(Error::Device("f64 tensors stay on the host".into())),
        })
    }

    /// Copies float data of `dtype` back to the host as f32 values (waits for the device).
    pub fn download_f32(&self, dev: &CudaDevice, dtype: DType) -> Result<Vec<f32>> {
        let s = dev.stream();
        let down = dev_err("download");
        match self {
            DeviceBuffer::F32(d) => s.clone_dtoh(d).map_err(|e| down(&e)),
            DeviceBuffer::Half(d) => {
                let bits = s.clone_dtoh(d).map_err(|e| down(&e))?;
                Ok(if dtype == DType::F16 {
                    bits.iter()
                        .map(|&b| half::f16::from_bits(b).to_f32())
                        .collect()
                } else {
                    bits.iter()
                        .map(|&b| f32::from_bits(u32::from(b) << 16))
                        .collect()
                })
            }
            DeviceBuffer::I64(_) => Err(Error::Device(
                "download: an int64 buffer holds no float values".into(),
            )),
        }
    }

    /// Copies int64 data back to the host (waits for the device).
    pub fn download_i64(&self, dev: &CudaDevice) -> Result<Vec<i64>> {
        match self {
            DeviceBuffer::I64(d) => dev
                .stream()
                .clone_dtoh(d)
                .map_err(|e| dev_err("download")(&e)),
            _ => Err(Error::Device(
                "download: a float buffer holds no int64 values".into(),
            )),
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            DeviceBuffer::F32(d) => d.len(),
            DeviceBuffer::Half(d) => d.len(),
            DeviceBuffer::I64(d) => d.len(),
        }
    }

    /// True when the buffer holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Raw device address of the first element, for kernel arguments.
    pub fn ptr(&self, dev: &CudaDevice) -> u64 {
        let s = dev.stream();
        match self {
            DeviceBuffer::F32(d) => d.device_ptr(s).0,
            DeviceBuffer::Half(d) => d.device_ptr(s).0,
            DeviceBuffer::I64(d) => d.device_ptr(s).0,
        }
    }
}
