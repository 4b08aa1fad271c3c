//! Trace record types (placeholder).
use crate::dtype::DType;
use serde::{Deserialize, Serialize};
/// Phase of the step an op belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Forward.
    Forward,
    /// Backward.
    Backward,
    /// Optimizer.
    Optimizer,
}
/// Dtype and shape.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorMeta {
    /// Dtype.
    pub dtype: DType,
    /// Shape.
    pub shape: Vec<usize>,
}
