//! Tensors in device memory: f32 data as f32, fp16 and bf16 data as their 16-bit patterns
//! (the device computes on the real storage formats), int64 labels as i64.

use super::{dev_err, CudaDevice};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::{numel, Storage, Tensor};
use cudarc::driver::{CudaSlice, DevicePtr};
use std::sync::Arc;

/// Storage kind codes shared with the kernels (`KIND_*` in common.cuh).
pub(crate) fn kind_code(dtype: DType) -> Result<i32> {
    match dtype {
        DType::F32 => Ok(0),
        DType::F16 => Ok(1),
        DType::BF16 => Ok(2),
        other => Err(Error::Device(format!(
            "{other} tensors are not kept on the device (f32, f16 and bf16 are)"
        ))),
    }
}

/// Device memory of one tensor.
#[derive(Debug)]
pub enum DeviceData {
    /// f32 values.
    F32(CudaSlice<f32>),
    /// fp16 or bf16 bit patterns.
    Half(CudaSlice<u16>),
    /// int64 values.
    I64(CudaSlice<i64>),
}

/// A tensor on the device; cheap to clone (the memory is shared).
#[derive(Debug, Clone)]
pub struct DeviceTensor {
    shape: Vec<usize>,
    dtype: DType,
    data: Arc<DeviceData>,
}

impl DeviceTensor {
    /// Copies a host tensor to the device (f32, f16, bf16 or i64).
    pub fn upload(dev: &CudaDevice, t: &Tensor) -> Result<DeviceTensor> {
        let s = dev.stream();
        let data = match (t.storage(), t.dtype()) {
            (Storage::F32(v), DType::F32) => DeviceData::F32(
                s.clone_htod(v.as_slice())
                    .map_err(|e| dev_err("upload")(&e))?,
            ),
            (Storage::F32(v), DType::F16) => {
                let bits: Vec<u16> = v
                    .iter()
                    .map(|&x| half::f16::from_f32(x).to_bits())
                    .collect();
                DeviceData::Half(s.clone_htod(&bits).map_err(|e| dev_err("upload")(&e))?)
            }
            (Storage::F32(v), DType::BF16) => {
                // bf16 values in f32 storage are exact: their low 16 bits are zero.
                let bits: Vec<u16> = v.iter().map(|&x| (x.to_bits() >> 16) as u16).collect();
                DeviceData::Half(s.clone_htod(&bits).map_err(|e| dev_err("upload")(&e))?)
            }
            (Storage::I64(v), DType::I64) => DeviceData::I64(
                s.clone_htod(v.as_slice())
                    .map_err(|e| dev_err("upload")(&e))?,
            ),
            (_, d) => {
                return Err(Error::Device(format!(
                    "cannot upload a {d} tensor of shape {:?}",
                    t.shape()
                )))
            }
        };
        Ok(DeviceTensor {
            shape: t.shape().to_vec(),
            dtype: t.dtype(),
            data: Arc::new(data),
        })
    }

    /// Zero-filled device memory for a tensor of `shape` and `dtype`.
    pub fn zeros(dev: &CudaDevice, shape: &[usize], dtype: DType) -> Result<DeviceTensor> {
        Self::alloc(dev, shape, dtype, true)
    }

    /// Device memory for an op's output that its kernel writes in full (not zeroed: a
    /// memset would be one more pass over memory per op).
    pub(crate) fn for_output(
        dev: &CudaDevice,
        shape: &[usize],
        dtype: DType,
    ) -> Result<DeviceTensor> {
        Self::alloc(dev, shape, dtype, false)
    }

    fn alloc(dev: &CudaDevice, shape: &[usize], dtype: DType, zero: bool) -> Result<DeviceTensor> {
        fn get<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
            s: &std::sync::Arc<cudarc::driver::CudaStream>,
            n: usize,
            zero: bool,
        ) -> Result<CudaSlice<T>> {
            let r = if zero {
                s.alloc_zeros(n)
            } else {
                // SAFETY: only `for_output` asks for unzeroed memory, and its callers'
                // kernels write every element before anything reads it.
                unsafe { s.alloc(n) }
            };
            r.map_err(|e| dev_err("alloc")(&e))
        }
        let n = numel(shape);
        let s = dev.stream();
        let data = match dtype {
            DType::F32 => DeviceData::F32(get(s, n, zero)?),
            DType::F16 | DType::BF16 => DeviceData::Half(get(s, n, zero)?),
            DType::I64 => DeviceData::I64(get(s, n, zero)?),
            DType::F64 => return Err(Error::Device("f64 tensors stay on the host".into())),
        };
        Ok(DeviceTensor {
            shape: shape.to_vec(),
            dtype,
            data: Arc::new(data),
        })
    }

    /// Copies the tensor back to the host (waits for the device).
    pub fn download(&self, dev: &CudaDevice) -> Result<Tensor> {
        let s = dev.stream();
        match (&*self.data, self.dtype) {
            (DeviceData::F32(d), _) => {
                let v = s.clone_dtoh(d).map_err(|e| dev_err("download")(&e))?;
                Tensor::from_f32(v, &self.shape, DType::F32)
            }
            (DeviceData::Half(d), dt) => {
                let bits = s.clone_dtoh(d).map_err(|e| dev_err("download")(&e))?;
                let v: Vec<f32> = if dt == DType::F16 {
                    bits.iter()
                        .map(|&b| half::f16::from_bits(b).to_f32())
                        .collect()
                } else {
                    bits.iter()
                        .map(|&b| f32::from_bits(u32::from(b) << 16))
                        .collect()
                };
                Tensor::from_f32(v, &self.shape, dt)
            }
            (DeviceData::I64(d), _) => {
                let v = s.clone_dtoh(d).map_err(|e| dev_err("download")(&e))?;
                Tensor::from_i64(v, &self.shape)
            }
        }
    }

    /// Shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Element dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        numel(&self.shape)
    }

    /// The same memory seen with another shape of the same size.
    pub fn reshaped(&self, shape: &[usize]) -> Result<DeviceTensor> {
        if numel(shape) != self.numel() {
            return Err(Error::shape(
                "reshape",
                format!("cannot view {:?} as {shape:?}", self.shape),
            ));
        }
        Ok(DeviceTensor {
            shape: shape.to_vec(),
            dtype: self.dtype,
            data: self.data.clone(),
        })
    }

    /// Raw device address of the first element, for kernel arguments.
    pub(crate) fn ptr(&self, dev: &CudaDevice) -> u64 {
        let s = dev.stream();
        match &*self.data {
            DeviceData::F32(d) => d.device_ptr(s).0,
            DeviceData::Half(d) => d.device_ptr(s).0,
            DeviceData::I64(d) => d.device_ptr(s).0,
        }
    }

    /// Storage kind code for the kernels.
    pub(crate) fn kind(&self) -> Result<i32> {
        kind_code(self.dtype)
    }
}
