//! Autocast policy tables (placeholder until the policy module lands).
use crate::dtype::DType;
use serde::{Deserialize, Serialize};
/// Target device type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeviceType {
    /// CUDA.
    Cuda,
    /// CPU.
    Cpu,
}
/// Autocast category.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Category {
    /// Low precision.
    LowerPrecisionFp,
    /// fp32.
    Fp32,
    /// fp32 output.
    Fp32SetOptDtype,
    /// Widest.
    Promote,
    /// Banned.
    Banned,
    /// Input type.
    Passthrough,
}
/// A table.
#[derive(Debug, Clone)]
pub struct PolicyTable {
    device: DeviceType,
}
impl PolicyTable {
    /// For a device.
    pub fn for_device(d: DeviceType) -> PolicyTable {
        PolicyTable { device: d }
    }
    /// Category.
    pub fn category(&self, op: &str) -> Category {
        match op {
            "linear" | "matmul" | "bmm" | "mm" => Category::LowerPrecisionFp,
            "cross_entropy_loss" | "mse_loss" | "exp" | "log" | "pow" | "rsqrt" | "layer_norm" => {
                Category::Fp32
            }
            "softmax" | "log_softmax" | "sum" => Category::Fp32SetOptDtype,
            "cat" => Category::Promote,
            _ => Category::Passthrough,
        }
    }
    /// Entries.
    pub fn entries(&self) -> Vec<(&'static str, Category)> {
        vec![]
    }
    /// Device.
    pub fn device(&self) -> DeviceType {
        self.device
    }
}
/// Cast target.
pub fn autocast_output_dtype(cat: Category, low: DType, input_dtypes: &[DType]) -> Option<DType> {
    let floats = || {
        input_dtypes
            .iter()
            .copied()
            .filter(|d| d.is_float() && *d != DType::F64)
    };
    match cat {
        Category::LowerPrecisionFp => Some(low),
        Category::Fp32 | Category::Fp32SetOptDtype => Some(DType::F32),
        Category::Promote => floats().reduce(DType::promote),
        Category::Banned | Category::Passthrough => None,
    }
}
