//! Device memory of one tensor: f32 data as f32, fp16 and bf16 data as their 16-bit
//! patterns (the device computes on the real storage formats), int64 labels as i64.

use super::driver_error::dev_err;
use super::handle::DeviceHandle;
use crate::dtype::DType;
use crate::error::{Error, Result};
use cudarc::driver::{CudaSlice, DevicePtr};
use std::mem::ManuallyDrop;

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
///
/// Dropping a buffer hands its memory to a cache for the next buffer of the same kind and
/// length ([`pool`]), so that a training step allocates nothing on the device after its
/// first: every tensor of a step has a twin of the same size in the step before. All work
/// is on one stream, so memory handed on is never used by two kernels at once.
#[derive(Debug)]
pub enum DeviceBuffer {
    /// f32 values.
    F32(ManuallyDrop<CudaSlice<f32>>),
    /// fp16 or bf16 bit patterns.
    Half(ManuallyDrop<CudaSlice<u16>>),
    /// int64 values.
    I64(ManuallyDrop<CudaSlice<i64>>),
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        // SAFETY: each slice is taken exactly once, here, and never used again.
        unsafe {
            match self {
                DeviceBuffer::F32(d) => pool::put(ManuallyDrop::take(d)),
                DeviceBuffer::Half(d) => pool::put(ManuallyDrop::take(d)),
                DeviceBuffer::I64(d) => pool::put(ManuallyDrop::take(d)),
            }
        }
    }
}

/// Bytes of device memory that tensors hold, live or cached for reuse ([`held_bytes`]).
static HELD: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
/// Bytes of live tensors, and their largest value since [`reset_peak_live`].
static LIVE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
static PEAK_LIVE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// The most device memory live tensors held at once since [`reset_peak_live`], in bytes:
/// what an allocator that could hand any freed memory to any tensor would need, against
/// [`held_bytes`], what the pool of exact sizes holds.
pub fn peak_live_bytes() -> u64 {
    PEAK_LIVE.load(std::sync::atomic::Ordering::Relaxed)
}

/// Starts [`peak_live_bytes`] again from the bytes live now.
pub fn reset_peak_live() {
    use std::sync::atomic::Ordering::Relaxed;
    PEAK_LIVE.store(LIVE.load(Relaxed), Relaxed);
}

/// The device memory amprobe's tensors hold, live or in the [`pool`], in bytes: everything
/// allocated for them and not yet returned by [`pool::trim`]. Since freed buffers stay in
/// the pool, it only grows between trims, so it is the peak of what they held since the
/// last trim.
pub fn held_bytes() -> u64 {
    HELD.load(std::sync::atomic::Ordering::Relaxed)
}

/// The cache of freed device memory, by element type and length.
pub mod pool {
    use cudarc::driver::CudaSlice;
    use std::any::{Any, TypeId};
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Mutex;

    /// Bytes on the shelves.
    static POOLED: AtomicU64 = AtomicU64::new(0);

    /// Element type, context and length.
    type Key = (TypeId, usize, usize);
    /// Freed slices of one key (each a `CudaSlice` of the key's element type).
    type Shelf = Vec<Box<dyn Any + Send>>;
    static CACHE: Mutex<Option<HashMap<Key, Shelf>>> = Mutex::new(None);

    fn key<T: 'static>(s: &CudaSlice<T>) -> Key {
        (
            TypeId::of::<T>(),
            std::sync::Arc::as_ptr(s.context()) as usize,
            s.len(),
        )
    }

    /// Keeps `s` for a later [`take`] of its type and length on its context.
    pub fn put<T: Send + 'static>(s: CudaSlice<T>) {
        let k = key(&s);
        let bytes = (s.len() * std::mem::size_of::<T>()) as u64;
        POOLED.fetch_add(bytes, Ordering::Relaxed);
        super::LIVE.fetch_sub(bytes, Ordering::Relaxed);
        let mut g = CACHE.lock().unwrap_or_else(|e| e.into_inner());
        g.get_or_insert_with(HashMap::new)
            .entry(k)
            .or_default()
            .push(Box::new(s));
    }

    /// A cached slice of `len` elements of `T` on `ctx`, if one was freed.
    pub fn take<T: Send + 'static>(
        ctx: &std::sync::Arc<cudarc::driver::CudaContext>,
        len: usize,
    ) -> Option<CudaSlice<T>> {
        let k = (TypeId::of::<T>(), std::sync::Arc::as_ptr(ctx) as usize, len);
        let mut g = CACHE.lock().unwrap_or_else(|e| e.into_inner());
        let b = g.as_mut()?.get_mut(&k)?.pop()?;
        POOLED.fetch_sub((len * std::mem::size_of::<T>()) as u64, Ordering::Relaxed);
        b.downcast::<CudaSlice<T>>().ok().map(|b| *b)
    }

    /// Returns every cached slice to the device (frees them).
    pub fn trim() {
        let mut g = CACHE.lock().unwrap_or_else(|e| e.into_inner());
        *g = None;
        let freed = POOLED.swap(0, Ordering::Relaxed);
        super::HELD.fetch_sub(freed, Ordering::Relaxed);
    }
}

/// Device memory for `n` elements of `T`: a cached slice, else a fresh one; zero-filled
/// (queued) when `zero`.
fn get<T>(dev: &DeviceHandle, n: usize, zero: bool) -> Result<CudaSlice<T>>
where
    T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits + Send + 'static,
{
    let s = dev.stream();
    let bytes = (n * std::mem::size_of::<T>()) as u64;
    let went_live = || {
        use std::sync::atomic::Ordering::Relaxed;
        PEAK_LIVE.fetch_max(LIVE.fetch_add(bytes, Relaxed) + bytes, Relaxed);
    };
    if let Some(mut c) = pool::take::<T>(dev.context(), n) {
        went_live();
        if zero {
            s.memset_zeros(&mut c).map_err(|e| dev_err("memset")(&e))?;
        }
        return Ok(c);
    }
    let r = if zero {
        s.alloc_zeros(n)
    } else {
        // SAFETY: unzeroed memory is only handed to kernels that write every element
        // before anything reads it (the caller's contract).
        unsafe { s.alloc(n) }
    };
    let r = r.map_err(|e| dev_err("alloc")(&e))?;
    HELD.fetch_add(bytes, std::sync::atomic::Ordering::Relaxed);
    went_live();
    Ok(r)
}

/// `v` copied into device memory (a cached slice when there is one).
fn put_host<T>(dev: &DeviceHandle, v: &[T]) -> Result<CudaSlice<T>>
where
    T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits + Send + 'static,
{
    let mut d = get::<T>(dev, v.len(), false)?;
    dev.stream()
        .memcpy_htod(v, &mut d)
        .map_err(|e| dev_err("upload")(&e))?;
    Ok(d)
}

impl DeviceBuffer {
    /// Copies f32-stored values of `dtype` (f32, f16 or bf16, each exactly representable)
    /// to the device in `dtype`'s storage format.
    pub fn upload_f32(dev: &DeviceHandle, v: &[f32], dtype: DType) -> Result<DeviceBuffer> {
        Ok(match dtype {
            DType::F32 => DeviceBuffer::F32(ManuallyDrop::new(put_host(dev, v)?)),
            DType::F16 => {
                let bits: Vec<u16> = v
                    .iter()
                    .map(|&x| half::f16::from_f32(x).to_bits())
                    .collect();
                DeviceBuffer::Half(ManuallyDrop::new(put_host(dev, &bits)?))
            }
            DType::BF16 => {
                // bf16 values in f32 storage are exact: their low 16 bits are zero.
                let bits: Vec<u16> = v.iter().map(|&x| (x.to_bits() >> 16) as u16).collect();
                DeviceBuffer::Half(ManuallyDrop::new(put_host(dev, &bits)?))
            }
            other => {
                return Err(Error::Device(format!(
                    "f32 storage cannot hold {other} on the device"
                )))
            }
        })
    }

    /// Copies int64 values to the device.
    pub fn upload_i64(dev: &DeviceHandle, v: &[i64]) -> Result<DeviceBuffer> {
        Ok(DeviceBuffer::I64(ManuallyDrop::new(put_host(dev, v)?)))
    }

    /// Device memory for `n` elements of `dtype`, zero-filled when `zero` (otherwise the
    /// caller's kernel must write every element before anything reads it).
    pub fn alloc(dev: &DeviceHandle, n: usize, dtype: DType, zero: bool) -> Result<DeviceBuffer> {
        Ok(match dtype {
            DType::F32 => DeviceBuffer::F32(ManuallyDrop::new(get(dev, n, zero)?)),
            DType::F16 | DType::BF16 => DeviceBuffer::Half(ManuallyDrop::new(get(dev, n, zero)?)),
            DType::I64 => DeviceBuffer::I64(ManuallyDrop::new(get(dev, n, zero)?)),
            DType::F64 => return Err(Error::Device("f64 tensors stay on the host".into())),
        })
    }

    /// Copies float data of `dtype` back to the host as f32 values (waits for the device).
    pub fn download_f32(&self, dev: &DeviceHandle, dtype: DType) -> Result<Vec<f32>> {
        let s = dev.stream();
        let down = dev_err("download");
        match self {
            DeviceBuffer::F32(d) => s.clone_dtoh(&**d).map_err(|e| down(&e)),
            DeviceBuffer::Half(d) => {
                let bits = s.clone_dtoh(&**d).map_err(|e| down(&e))?;
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
    pub fn download_i64(&self, dev: &DeviceHandle) -> Result<Vec<i64>> {
        match self {
            DeviceBuffer::I64(d) => dev
                .stream()
                .clone_dtoh(&**d)
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
    pub fn ptr(&self, dev: &DeviceHandle) -> u64 {
        let s = dev.stream();
        match self {
            DeviceBuffer::F32(d) => d.device_ptr(s).0,
            DeviceBuffer::Half(d) => d.device_ptr(s).0,
            DeviceBuffer::I64(d) => d.device_ptr(s).0,
        }
    }
}
