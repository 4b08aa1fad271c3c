//! Precision modes: how parameters are stored, which dtype ops run in, what autocast does.

use crate::dtype::DType;
use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};

/// A mixed-precision recipe (apex's O0–O3 levels and PyTorch autocast).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Precision {
    /// O0: everything in fp32.
    #[serde(rename = "fp32")]
    Fp32,
    /// O1: fp32 parameters, autocast to fp16.
    #[serde(rename = "fp16")]
    Fp16,
    /// O1: fp32 parameters, autocast to bf16.
    #[serde(rename = "bf16")]
    Bf16,
    /// O2: an fp16 copy of the model (norms kept fp32) with fp32 master weights; model
    /// outputs cast to fp32 before the loss.
    #[serde(rename = "o2")]
    O2,
    /// O2 with bf16.
    #[serde(rename = "o2-bf16")]
    O2Bf16,
    /// O3: everything in fp16 (`model.half()`), parameters and optimizer updates included.
    #[serde(rename = "half")]
    Half,
    /// O3 with bf16 (`model.bfloat16()`).
    #[serde(rename = "bfloat16-pure")]
    Bf16Pure,
}

impl Precision {
    /// Every mode, in order.
    pub const ALL: [Precision; 7] = [
        Precision::Fp32,
        Precision::Fp16,
        Precision::Bf16,
        Precision::O2,
        Precision::O2Bf16,
        Precision::Half,
        Precision::Bf16Pure,
    ];

    /// Parses a mode name (`fp32`/`o0`, `fp16`/`o1`, `bf16`, `o2`, `o2-bf16`, `half`/`o3`,
    /// `bfloat16-pure`/`bf16-pure`).
    pub fn parse(s: &str) -> Result<Precision> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "fp32" | "o0" | "float32" => Precision::Fp32,
            "fp16" | "o1" | "float16" => Precision::Fp16,
            "bf16" | "o1-bf16" | "bfloat16" => Precision::Bf16,
            "o2" | "o2-fp16" => Precision::O2,
            "o2-bf16" => Precision::O2Bf16,
            "half" | "o3" | "fp16-pure" => Precision::Half,
            "bfloat16-pure" | "bf16-pure" | "o3-bf16" => Precision::Bf16Pure,
            _ => {
                return Err(Error::config(
                    "precision",
                    format!("unknown mode `{s}` (expected fp32, fp16, bf16, o2, o2-bf16, half or bfloat16-pure)"),
                ))
            }
        })
    }

    /// Canonical name.
    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Fp16 => "fp16",
            Precision::Bf16 => "bf16",
            Precision::O2 => "o2",
            Precision::O2Bf16 => "o2-bf16",
            Precision::Half => "half",
            Precision::Bf16Pure => "bfloat16-pure",
        }
    }

    /// The low-precision dtype of the mode, if any.
    pub fn low_dtype(self) -> Option<DType> {
        match self {
            Precision::Fp32 => None,
            Precision::Fp16 | Precision::O2 | Precision::Half => Some(DType::F16),
            Precision::Bf16 | Precision::O2Bf16 | Precision::Bf16Pure => Some(DType::BF16),
        }
    }

    /// Autocast dtype (O1 only).
    pub fn autocast_dtype(self) -> Option<DType> {
        match self {
            Precision::Fp16 => Some(DType::F16),
            Precision::Bf16 => Some(DType::BF16),
            _ => None,
        }
    }

    /// Dtype the parameters are stored and updated in.
    pub fn param_dtype(self) -> DType {
        match self {
            Precision::Half => DType::F16,
            Precision::Bf16Pure => DType::BF16,
            _ => DType::F32,
        }
    }

    /// Dtype of the per-forward parameter copy in O2 (None otherwise).
    pub fn o2_dtype(self) -> Option<DType> {
        match self {
            Precision::O2 => Some(DType::F16),
            Precision::O2Bf16 => Some(DType::BF16),
            _ => None,
        }
    }

    /// Dtype float model inputs are cast to at the model's entry (O2 and O3).
    pub fn input_dtype(self) -> Option<DType> {
        match self {
            Precision::O2 | Precision::O2Bf16 | Precision::Half | Precision::Bf16Pure => {
                self.low_dtype()
            }
            _ => None,
        }
    }
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
