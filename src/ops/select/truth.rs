//! Truth values of conditions and masks: read on the host, or placed on a device.

use crate::error::Result;
use crate::ops::{bstrides, for_each_offset};
use crate::tensor::{Storage, Tensor};

/// Truth values of a condition or mask: nonzero (NaN included) is true.
pub(super) fn truth(t: &Tensor, op: &str) -> Result<Vec<bool>> {
    Ok(match t.storage() {
        Storage::F32(v) => v.iter().map(|&x| x != 0.0).collect(),
        Storage::F64(v) => v.iter().map(|&x| x != 0.0).collect(),
        Storage::I64(v) => v.iter().map(|&x| x != 0).collect(),
        Storage::Cuda(_) => return Err(crate::ops::no_device_kernel(op)),
    })
}

/// Elements of `shape` where the mask (truth values `m` of shape `mask`, broadcast) is set.
pub(super) fn masked_count(m: &[bool], mask: &[usize], shape: &[usize]) -> u64 {
    let ms = bstrides(mask, shape);
    let mut masked = 0u64;
    for_each_offset(shape, [&ms], |[i]| masked += m[i] as u64);
    masked
}

/// A condition or mask on the device of `like`: itself when it is there already, else its
/// truth values uploaded as int64 0/1 (any host dtype, f64 included, keeps its exact
/// truth).
pub(super) fn device_truth(t: &Tensor, like: &Tensor, op: &str) -> Result<Tensor> {
    if crate::ops::on_device(t) {
        return Ok(t.clone());
    }
    let dev = like.cuda(op)?.dev.clone();
    let v = truth(t, op)?.into_iter().map(i64::from).collect();
    Tensor::from_i64(v, t.shape())?.to_device(&dev)
}
