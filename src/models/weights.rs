//! Reading and writing tensors in safetensors files, with errors that name the file and
//! tensor.

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use safetensors::tensor::{Dtype as StDtype, SafeTensors};
use std::collections::BTreeMap;
use std::path::Path;

/// Tensors of a safetensors file by name, converted to amprobe tensors: F32/F16/BF16 to
/// their dtype (values exact), F64 to f64, I64/I32 to int64.
pub fn load_safetensors(path: &Path) -> Result<BTreeMap<String, Tensor>> {
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    parse_safetensors(&bytes, path)
}

/// [`load_safetensors`] of a file's bytes; `path` names it in errors. Every tensor's size
/// is checked against the bytes the file holds before anything is allocated for it.
pub fn parse_safetensors(bytes: &[u8], path: &Path) -> Result<BTreeMap<String, Tensor>> {
    let st = SafeTensors::deserialize(bytes).map_err(|e| {
        Error::tensor(
            path.display().to_string(),
            format!("not a valid safetensors file: {e}"),
        )
    })?;
    let mut out = BTreeMap::new();
    for (name, view) in st.tensors() {
        let shape = view.shape().to_vec();
        let data = view.data();
        let named = |msg: String| Error::tensor(format!("{}: {name}", path.display()), msg);
        let t = match view.dtype() {
            StDtype::F32 => Tensor::from_exact(
                data.chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
                &shape,
                DType::F32,
            ),
            StDtype::F16 => Tensor::from_exact(
                data.chunks_exact(2)
                    .map(|c| crate::dtype::f16_bits_to_f32(u16::from_le_bytes([c[0], c[1]])))
                    .collect(),
                &shape,
                DType::F16,
            ),
            StDtype::BF16 => Tensor::from_exact(
                data.chunks_exact(2)
                    .map(|c| crate::dtype::bf16_bits_to_f32(u16::from_le_bytes([c[0], c[1]])))
                    .collect(),
                &shape,
                DType::BF16,
            ),
            StDtype::F64 => Tensor::from_f64(
                data.chunks_exact(8)
                    .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")))
                    .collect(),
                &shape,
            ),
            StDtype::I64 => Tensor::from_i64(
                data.chunks_exact(8)
                    .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
                    .collect(),
                &shape,
            ),
            StDtype::I32 => Tensor::from_i64(
                data.chunks_exact(4)
                    .map(|c| i32::from_le_bytes(c.try_into().expect("4 bytes")) as i64)
                    .collect(),
                &shape,
            ),
            other => {
                return Err(named(format!(
                    "unsupported dtype {other:?} (expected F32, F16, BF16, F64, I64 or I32)"
                )))
            }
        }
        .map_err(|e| named(e.to_string()))?;
        out.insert(name.to_string(), t);
    }
    Ok(out)
}

/// Takes tensor `name` from a loaded file, checking its shape; `file` names the file in errors.
pub fn take(
    map: &mut BTreeMap<String, Tensor>,
    file: &Path,
    name: &str,
    shape: &[usize],
) -> Result<Tensor> {
    let t = map.remove(name).ok_or_else(|| {
        Error::tensor(
            format!("{}: {name}", file.display()),
            format!("missing (expected shape {shape:?})"),
        )
    })?;
    if t.shape() != shape {
        return Err(Error::tensor(
            format!("{}: {name}", file.display()),
            format!("has shape {:?}, expected {shape:?}", t.shape()),
        ));
    }
    Ok(t)
}

/// Writes f32 tensors to a safetensors file (f32 storage; low-precision values written as F32).
pub fn save_safetensors(path: &Path, tensors: &[(String, Tensor)]) -> Result<()> {
    let mut bufs: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, t) in tensors {
        let bytes: Vec<u8> = t
            .to_f64_vec()?
            .iter()
            .flat_map(|&v| (v as f32).to_le_bytes())
            .collect();
        bufs.push((name.clone(), t.shape().to_vec(), bytes));
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = bufs
        .iter()
        .map(|(n, s, b)| {
            safetensors::tensor::TensorView::new(StDtype::F32, s.clone(), b)
                .map(|v| (n.clone(), v))
                .map_err(|e| Error::tensor(n.clone(), e.to_string()))
        })
        .collect::<Result<_>>()?;
    safetensors::tensor::serialize_to_file(views, None, path)
        .map_err(|e| Error::tensor(path.display().to_string(), e.to_string()))
}
