//! Reading and writing tensors in safetensors files, with errors that name the file and
//! tensor.

use super::{Param, ParamStore};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::rng::Rng;
use crate::tensor::Tensor;
use safetensors::tensor::{Dtype as StDtype, SafeTensors};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

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

/// Writes tensors to a safetensors file: int64 ones as I64, floating ones as F32
/// (low-precision values widen exactly).
pub fn save_safetensors(path: &Path, tensors: &[(String, Tensor)]) -> Result<()> {
    let mut bufs: Vec<(String, StDtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, t) in tensors {
        let (dtype, bytes): (StDtype, Vec<u8>) = if t.dtype() == crate::DType::I64 {
            (
                StDtype::I64,
                t.i64s()?.iter().flat_map(|v| v.to_le_bytes()).collect(),
            )
        } else {
            (
                StDtype::F32,
                t.to_f64_vec()?
                    .iter()
                    .flat_map(|&v| (v as f32).to_le_bytes())
                    .collect(),
            )
        };
        bufs.push((name.clone(), dtype, t.shape().to_vec(), bytes));
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = bufs
        .iter()
        .map(|(n, d, s, b)| {
            safetensors::tensor::TensorView::new(*d, s.clone(), b)
                .map(|v| (n.clone(), v))
                .map_err(|e| Error::tensor(n.clone(), e.to_string()))
        })
        .collect::<Result<_>>()?;
    safetensors::tensor::serialize_to_file(views, None, path)
        .map_err(|e| Error::tensor(path.display().to_string(), e.to_string()))
}

/// Most parameters a seeded init makes up (2^31: 8 GiB of fp32).
pub const MAX_INIT_PARAMS: u64 = 1 << 31;

/// Where a checkpoint's tensors are: one safetensors file or a sharded index.
pub fn weight_files(dir_or_file: &Path) -> Result<Vec<PathBuf>> {
    if dir_or_file.is_file() {
        return Ok(vec![dir_or_file.to_path_buf()]);
    }
    let single = dir_or_file.join("model.safetensors");
    if single.is_file() {
        return Ok(vec![single]);
    }
    let index = dir_or_file.join("model.safetensors.index.json");
    if index.is_file() {
        let text = std::fs::read_to_string(&index).map_err(|e| Error::io(&index, e))?;
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
            Error::config(index.display().to_string(), format!("not valid JSON: {e}"))
        })?;
        let map = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| {
                Error::config(
                    format!("{}: weight_map", index.display()),
                    "missing or not an object",
                )
            })?;
        let mut files: Vec<PathBuf> = map
            .values()
            .filter_map(|f| f.as_str())
            .map(|f| dir_or_file.join(f))
            .collect();
        files.sort();
        files.dedup();
        return Ok(files);
    }
    Err(Error::config(
        dir_or_file.display().to_string(),
        "no model.safetensors or model.safetensors.index.json found",
    ))
}

/// Every tensor of a checkpoint (`weight_files`), by name, with the file it came from.
pub type Checkpoint = BTreeMap<String, (Tensor, PathBuf)>;

/// Reads every tensor of a checkpoint: one safetensors file, or a directory with
/// `model.safetensors` or a sharded `model.safetensors.index.json`.
pub fn read_checkpoint(weights: &Path) -> Result<Checkpoint> {
    let mut all = Checkpoint::new();
    for f in weight_files(weights)? {
        for (k, t) in load_safetensors(&f)? {
            all.insert(k, (t, f.clone()));
        }
    }
    Ok(all)
}

/// The parameters `shapes` names (name, shape, norm) taken from a checkpoint read from
/// `weights`: each must be there with its shape, in f32, f16 or bf16; it becomes an fp32
/// master. Errors name the file and tensor.
pub fn take_params(
    all: &mut Checkpoint,
    shapes: &[(String, Vec<usize>, bool)],
    weights: &Path,
) -> Result<ParamStore> {
    let mut params = Vec::new();
    for (name, shape, norm) in shapes {
        let (t, file) = all.remove(name).ok_or_else(|| {
            Error::tensor(
                format!("{}: {name}", weights.display()),
                format!("missing (expected shape {shape:?})"),
            )
        })?;
        if t.shape() != shape.as_slice() {
            return Err(Error::tensor(
                format!("{}: {name}", file.display()),
                format!("has shape {:?}, expected {shape:?}", t.shape()),
            ));
        }
        if !matches!(t.dtype(), DType::F32 | DType::F16 | DType::BF16) {
            return Err(Error::tensor(
                format!("{}: {name}", file.display()),
                format!("has dtype {}, expected F32, F16 or BF16", t.dtype()),
            ));
        }
        let t = crate::ops::cast::cast(&t, DType::F32)?.tensor;
        params.push(Param::new(name, t, *norm));
    }
    Ok(ParamStore { params })
}

/// Seeded parameters for `shapes`: biases (names ending `.bias`) 0, norm weights 1, the
/// rest normal with standard deviation `std`, drawn from `rng` in order. Refuses more than
/// [`MAX_INIT_PARAMS`] parameters (`count`, `None` past 2^64).
pub fn init_params(
    shapes: &[(String, Vec<usize>, bool)],
    count: Option<u64>,
    mut rng: Rng,
    std: f64,
) -> Result<ParamStore> {
    let max = MAX_INIT_PARAMS;
    match count {
        Some(n) if n <= max => {}
        n => {
            return Err(Error::config(
                "model",
                format!(
                    "a seeded init of {} parameters is more than the {max} amprobe makes up; \
                     give the checkpoint's weights",
                    n.map_or("more than 2^64".to_string(), |n| n.to_string())
                ),
            ))
        }
    }
    let mut params = Vec::new();
    for (name, shape, norm) in shapes {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = if name.ends_with(".bias") {
            vec![0.0; n]
        } else if *norm {
            vec![1.0; n]
        } else {
            (0..n).map(|_| (rng.normal() * std) as f32).collect()
        };
        params.push(Param::new(
            name,
            Tensor::from_f32(v, shape, DType::F32)?,
            *norm,
        ));
    }
    Ok(ParamStore { params })
}
