//! Layer 3 of `amprobe::LAYERS`: may use layers 0–2 (`dtype` … `device`).
//!
//! Tensors: shape, dtype and storage on the host or a CUDA device.
//!
//! Storage is row-major and contiguous. On the host, fp16 and bf16 values live in `f32`
//! storage, each exactly representable in its dtype, so that kernels compute in `f32` and
//! round once; on a device they are kept as their 16-bit patterns.

pub mod accumulate;
mod math;

pub use math::{erf_f32, exp_f32, tanh_f32};

use crate::device::cuda::{CudaDevice, DeviceBuffer};
use crate::dtype::DType;
use crate::error::{Error, Result};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Scalar types kernels compute in: `f32` for fp32/fp16/bf16 data, `f64` for the reference.
pub trait Real:
    num_traits::Float + Copy + Send + Sync + Default + std::fmt::Debug + std::iter::Sum + 'static
{
    /// The error function (for `f32`, [`erf_f32`]).
    fn erf(self) -> Self;
    /// e^x as the ops compute it (for `f32`, [`exp_f32`]).
    fn exp_op(self) -> Self;
    /// The hyperbolic tangent as the elementwise ops compute it (for `f32`, [`tanh_f32`]).
    fn tanh_op(self) -> Self;
    /// Converts from f64 (rounding once).
    fn of(x: f64) -> Self;
    /// Converts to f64 (exact).
    fn f64(self) -> f64;
}

impl Real for f32 {
    #[inline(always)]
    fn erf(self) -> Self {
        erf_f32(self)
    }
    #[inline(always)]
    fn exp_op(self) -> Self {
        exp_f32(self)
    }
    #[inline(always)]
    fn tanh_op(self) -> Self {
        tanh_f32(self)
    }
    #[inline(always)]
    fn of(x: f64) -> Self {
        x as f32
    }
    #[inline(always)]
    fn f64(self) -> f64 {
        self as f64
    }
}

impl Real for f64 {
    #[inline(always)]
    fn erf(self) -> Self {
        libm::erf(self)
    }
    #[inline(always)]
    fn exp_op(self) -> Self {
        self.exp()
    }
    #[inline(always)]
    fn tanh_op(self) -> Self {
        self.tanh()
    }
    #[inline(always)]
    fn of(x: f64) -> Self {
        x
    }
    #[inline(always)]
    fn f64(self) -> f64 {
        self
    }
}

/// Where a tensor's elements live, and how they are stored.
#[derive(Debug, Clone)]
pub enum Storage {
    /// Host f32, f16 and bf16 data (low-precision values exactly representable).
    F32(Arc<Vec<f32>>),
    /// Host f64 reference data.
    F64(Arc<Vec<f64>>),
    /// Host integer indices and labels.
    I64(Arc<Vec<i64>>),
    /// Memory of a CUDA device (f32, fp16/bf16 bit patterns, or int64).
    Cuda(CudaStorage),
}

/// A tensor's memory on a CUDA device, with the device that holds it.
#[derive(Debug, Clone)]
pub struct CudaStorage {
    /// The device (its stream orders every use of the buffer).
    pub dev: Arc<CudaDevice>,
    /// The elements.
    pub buf: Arc<DeviceBuffer>,
}

impl Storage {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Storage::F32(v) => v.len(),
            Storage::F64(v) => v.len(),
            Storage::I64(v) => v.len(),
            Storage::Cuda(c) => c.buf.len(),
        }
    }
    /// True when the elements are in device memory.
    pub fn is_device(&self) -> bool {
        matches!(self, Storage::Cuda(_))
    }
    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Identity of a tensor value (unique within the process).
pub type TensorId = u64;

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

fn next_id() -> TensorId {
    NEXT_ID.fetch_add(1, Ordering::Relaxed)
}

#[derive(Debug)]
struct Inner {
    id: TensorId,
    shape: Vec<usize>,
    dtype: DType,
    storage: Storage,
    requires_grad: bool,
    node: Option<usize>,
}

/// An immutable n-dimensional array with a dtype; cheap to clone.
#[derive(Debug, Clone)]
pub struct Tensor(Arc<Inner>);

/// Number of elements of a shape.
pub fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

impl Tensor {
    fn build(shape: Vec<usize>, dtype: DType, storage: Storage) -> Result<Tensor> {
        if numel(&shape) != storage.len() {
            return Err(Error::shape(
                "tensor",
                format!(
                    "shape {shape:?} needs {} elements, storage has {}",
                    numel(&shape),
                    storage.len()
                ),
            ));
        }
        let ok = match (&storage, dtype) {
            (Storage::F32(_), DType::F32 | DType::F16 | DType::BF16)
            | (Storage::F64(_), DType::F64)
            | (Storage::I64(_), DType::I64) => true,
            (Storage::Cuda(c), d) => matches!(
                (&*c.buf, d),
                (DeviceBuffer::F32(_), DType::F32)
                    | (DeviceBuffer::Half(_), DType::F16 | DType::BF16)
                    | (DeviceBuffer::I64(_), DType::I64)
            ),
            _ => false,
        };
        if !ok {
            return Err(Error::shape(
                "tensor",
                format!("storage does not hold {dtype}"),
            ));
        }
        Ok(Tensor(Arc::new(Inner {
            id: next_id(),
            shape,
            dtype,
            storage,
            requires_grad: false,
            node: None,
        })))
    }

    /// A tensor from f32 values, rounded once to `dtype` (f32, f16 or bf16).
    pub fn from_f32(mut data: Vec<f32>, shape: &[usize], dtype: DType) -> Result<Tensor> {
        if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16) {
            return Err(Error::shape(
                "tensor",
                format!("f32 data cannot hold {dtype}"),
            ));
        }
        crate::dtype::round_slice(dtype, &mut data);
        Tensor::build(shape.to_vec(), dtype, Storage::F32(Arc::new(data)))
    }

    /// A tensor from values already representable in `dtype` (no rounding).
    pub(crate) fn from_exact(data: Vec<f32>, shape: &[usize], dtype: DType) -> Result<Tensor> {
        Tensor::build(shape.to_vec(), dtype, Storage::F32(Arc::new(data)))
    }

    /// An f64 reference tensor.
    pub fn from_f64(data: Vec<f64>, shape: &[usize]) -> Result<Tensor> {
        Tensor::build(shape.to_vec(), DType::F64, Storage::F64(Arc::new(data)))
    }

    /// An i64 tensor (indices, labels).
    pub fn from_i64(data: Vec<i64>, shape: &[usize]) -> Result<Tensor> {
        Tensor::build(shape.to_vec(), DType::I64, Storage::I64(Arc::new(data)))
    }

    /// A tensor from a storage of the right kind.
    pub fn from_storage(storage: Storage, shape: &[usize], dtype: DType) -> Result<Tensor> {
        Tensor::build(shape.to_vec(), dtype, storage)
    }

    /// The same values as a new leaf that requires a gradient (a parameter).
    pub fn as_leaf(&self, requires_grad: bool) -> Tensor {
        Tensor(Arc::new(Inner {
            id: next_id(),
            shape: self.0.shape.clone(),
            dtype: self.0.dtype,
            storage: self.0.storage.clone(),
            requires_grad,
            node: None,
        }))
    }

    pub(crate) fn with_node(self, node: Option<usize>, requires_grad: bool) -> Tensor {
        let inner = Arc::try_unwrap(self.0).unwrap_or_else(|a| Inner {
            id: a.id,
            shape: a.shape.clone(),
            dtype: a.dtype,
            storage: a.storage.clone(),
            requires_grad: a.requires_grad,
            node: a.node,
        });
        Tensor(Arc::new(Inner {
            node,
            requires_grad,
            ..inner
        }))
    }

    /// Unique id of this tensor value.
    pub fn id(&self) -> TensorId {
        self.0.id
    }
    /// Shape (row-major).
    pub fn shape(&self) -> &[usize] {
        &self.0.shape
    }
    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.0.shape.len()
    }
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.0.storage.len()
    }
    /// Element dtype.
    pub fn dtype(&self) -> DType {
        self.0.dtype
    }
    /// Storage.
    pub fn storage(&self) -> &Storage {
        &self.0.storage
    }
    /// Whether a gradient flows to this tensor.
    pub fn requires_grad(&self) -> bool {
        self.0.requires_grad
    }
    /// True for tensors not produced by a recorded op.
    pub fn is_leaf(&self) -> bool {
        self.0.node.is_none()
    }

    /// The host f32 storage (f32, f16, bf16 tensors).
    pub fn f32s(&self) -> Result<&[f32]> {
        match &self.0.storage {
            Storage::F32(v) => Ok(v),
            Storage::Cuda(_) => Err(self.device_access_error()),
            _ => Err(Error::tensor(
                "tensor",
                format!("expected f32 storage, found {}", self.0.dtype),
            )),
        }
    }
    /// The host f64 storage.
    pub fn f64s(&self) -> Result<&[f64]> {
        match &self.0.storage {
            Storage::F64(v) => Ok(v),
            Storage::Cuda(_) => Err(self.device_access_error()),
            _ => Err(Error::tensor(
                "tensor",
                format!("expected f64 storage, found {}", self.0.dtype),
            )),
        }
    }
    /// The host i64 storage.
    pub fn i64s(&self) -> Result<&[i64]> {
        match &self.0.storage {
            Storage::I64(v) => Ok(v),
            Storage::Cuda(_) => Err(self.device_access_error()),
            _ => Err(Error::tensor(
                "tensor",
                format!("expected int64 storage, found {}", self.0.dtype),
            )),
        }
    }

    /// All values as f64 (exact for every float dtype); a device tensor is copied back
    /// first (waiting for the device).
    pub fn to_f64_vec(&self) -> Result<Vec<f64>> {
        Ok(match &self.0.storage {
            Storage::F32(v) => v.iter().map(|&x| x as f64).collect(),
            Storage::F64(v) => v.to_vec(),
            Storage::I64(v) => v.iter().map(|&x| x as f64).collect(),
            Storage::Cuda(_) => return self.to_host()?.to_f64_vec(),
        })
    }

    /// The error of a host-only access to a device tensor.
    fn device_access_error(&self) -> Error {
        Error::tensor(
            "tensor",
            format!(
                "the {} tensor of shape {:?} is in device memory; copy it with to_host()",
                self.0.dtype, self.0.shape
            ),
        )
    }

    /// The device holding this tensor, or None for a host tensor.
    pub fn device(&self) -> Option<&Arc<CudaDevice>> {
        match &self.0.storage {
            Storage::Cuda(c) => Some(&c.dev),
            _ => None,
        }
    }

    /// The device storage, or an error naming `op` for a host tensor.
    pub fn cuda(&self, op: &str) -> Result<&CudaStorage> {
        match &self.0.storage {
            Storage::Cuda(c) => Ok(c),
            _ => Err(Error::tensor(
                op,
                format!("expected a device tensor, found a host {}", self.0.dtype),
            )),
        }
    }

    /// A copy of this tensor's values in `dev`'s memory (f32, f16, bf16 or i64; queued on
    /// the device's stream). A tensor already there is returned as is.
    pub fn to_device(&self, dev: &Arc<CudaDevice>) -> Result<Tensor> {
        let buf = match &self.0.storage {
            Storage::F32(v) => DeviceBuffer::upload_f32(dev, v, self.0.dtype)?,
            Storage::I64(v) => DeviceBuffer::upload_i64(dev, v)?,
            Storage::Cuda(c) if Arc::ptr_eq(&c.dev, dev) => return Ok(self.clone()),
            // Another handle on the same device (a re-run's trainer opens its own): both
            // use the device's primary context and its default stream, so the memory is
            // shared as it is, in the same order.
            Storage::Cuda(c) if c.dev.info().ordinal == dev.info().ordinal => {
                let storage = Storage::Cuda(CudaStorage {
                    dev: dev.clone(),
                    buf: c.buf.clone(),
                });
                return Tensor::build(self.shape().to_vec(), self.dtype(), storage);
            }
            Storage::Cuda(_) => {
                return Err(Error::Device(
                    "copies between two devices are not supported".into(),
                ))
            }
            Storage::F64(_) => {
                return Err(Error::Device(format!(
                    "f64 reference tensors stay on the host (shape {:?})",
                    self.0.shape
                )))
            }
        };
        Tensor::on_device(dev, buf, self.shape(), self.dtype())
    }

    /// A tensor over device memory `buf` of `dev`.
    pub fn on_device(
        dev: &Arc<CudaDevice>,
        buf: DeviceBuffer,
        shape: &[usize],
        dtype: DType,
    ) -> Result<Tensor> {
        let storage = Storage::Cuda(CudaStorage {
            dev: dev.clone(),
            buf: Arc::new(buf),
        });
        Tensor::build(shape.to_vec(), dtype, storage)
    }

    /// This tensor's values in host memory (waits for the device's queued work). A host
    /// tensor is returned as is.
    pub fn to_host(&self) -> Result<Tensor> {
        let Storage::Cuda(c) = &self.0.storage else {
            return Ok(self.clone());
        };
        let storage = match self.0.dtype {
            DType::I64 => Storage::I64(Arc::new(c.buf.download_i64(&c.dev)?)),
            d => Storage::F32(Arc::new(c.buf.download_f32(&c.dev, d)?)),
        };
        Tensor::build(self.shape().to_vec(), self.dtype(), storage)
    }

    /// The same device memory seen with another shape of as many elements.
    pub fn view_as(&self, shape: &[usize]) -> Result<Tensor> {
        if numel(shape) != self.numel() {
            return Err(Error::shape(
                "view",
                format!("cannot view {:?} as {shape:?}", self.shape()),
            ));
        }
        Tensor::build(shape.to_vec(), self.dtype(), self.0.storage.clone())
    }

    /// The single value of a one-element tensor, as f64.
    pub fn item(&self) -> Result<f64> {
        if self.numel() != 1 {
            return Err(Error::tensor(
                "item",
                format!("expected one element, shape is {:?}", self.shape()),
            ));
        }
        Ok(self.to_f64_vec()?[0])
    }
}

/// Row-major strides of a shape.
pub fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}

/// Resolves a possibly negative dimension index against `rank`.
pub fn norm_dim(dim: isize, rank: usize, op: &str) -> Result<usize> {
    let d = if dim < 0 { dim + rank as isize } else { dim };
    if d < 0 || d as usize >= rank.max(1) {
        return Err(Error::shape(
            op,
            format!("dim {dim} out of range for rank {rank}"),
        ));
    }
    Ok(d as usize)
}
