//! Autocast policy tables: which dtype each ATen op runs in under `torch.autocast`.
//!
//! PyTorch registers an autocast kernel for a fixed set of ops per device type and gives
//! each a cast policy (`lower_precision_fp`, `fp32`, `fp32_set_opt_dtype`,
//! `fp32_append_dtype`, `promote`, or a banning kernel); every other op falls through and
//! runs in its inputs' dtypes. The tables here transcribe those lists for the CUDA and CPU
//! autocast keys of torch 2.15.0 (`aten/src/ATen/autocast_mode.{h,cpp}`);
//! `tests/golden/autocast_lists.json` holds the same lists as data with the sources and
//! commits they were read at, and `tests/autocast_table.rs` checks the two agree both ways.
//!
//! Op names are ATen op names without the overload suffix (`softmax`, not `softmax.int`).
//! PyTorch registers a policy per overload, but within one device every registered overload
//! of an op has the same policy, so the op name decides the category.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::dtype::DType;
use crate::error::{Error, Result};

/// The device type whose autocast key (and hence op lists) applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, PartialOrd, Ord)]
#[serde(rename_all = "lowercase")]
pub enum DeviceType {
    /// `torch.autocast("cuda")`: the `Autocast` dispatch key.
    Cuda,
    /// `torch.autocast("cpu")`: the `AutocastCPU` dispatch key.
    Cpu,
}

impl DeviceType {
    /// Both device types, CUDA first.
    pub const ALL: [DeviceType; 2] = [DeviceType::Cuda, DeviceType::Cpu];

    /// PyTorch's device-type string (`"cuda"`, `"cpu"`).
    pub fn name(self) -> &'static str {
        match self {
            DeviceType::Cuda => "cuda",
            DeviceType::Cpu => "cpu",
        }
    }

    /// The lower-precision dtype autocast uses on this device when none is given:
    /// float16 on CUDA, bfloat16 on CPU (PyTorch's per-device `autocast_dtype` defaults).
    pub fn default_lower_precision(self) -> DType {
        match self {
            DeviceType::Cuda => DType::F16,
            DeviceType::Cpu => DType::BF16,
        }
    }

    /// Parses `"cuda"` or `"cpu"` (case-insensitive); an error names the string and the
    /// accepted values.
    pub fn parse(s: &str) -> Result<DeviceType> {
        s.parse()
    }
}

impl FromStr for DeviceType {
    type Err = Error;

    fn from_str(s: &str) -> Result<DeviceType> {
        match s.trim().to_ascii_lowercase().as_str() {
            "cuda" => Ok(DeviceType::Cuda),
            "cpu" => Ok(DeviceType::Cpu),
            _ => Err(Error::Invalid(format!(
                "unknown autocast device type `{s}`: expected `cuda` or `cpu`"
            ))),
        }
    }
}

impl fmt::Display for DeviceType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The autocast cast policy of an op on one device type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, PartialOrd, Ord)]
#[serde(rename_all = "snake_case")]
pub enum Category {
    /// Eligible inputs are cast to the autocast dtype (fp16/bf16) and the op runs there.
    LowerPrecisionFp,
    /// Eligible inputs are cast to float32 and the op runs there.
    Fp32,
    /// The op runs in and outputs float32 via its optional `dtype` argument, provided its
    /// first argument is eligible and no dtype was given explicitly. PyTorch's
    /// `fp32_append_dtype` ops (`norm`) land here too: they redispatch with a float32
    /// dtype under the same first-argument rule, with the same observable result.
    Fp32SetOptDtype,
    /// Eligible inputs are cast to the widest eligible input dtype (float32 beats the
    /// autocast dtype).
    Promote,
    /// The op refuses to run under autocast (CUDA `binary_cross_entropy`).
    Banned,
    /// No autocast kernel: the op runs in its inputs' dtypes, by its own type promotion.
    Passthrough,
}

impl Category {
    /// Every category, in declaration order.
    pub const ALL: [Category; 6] = [
        Category::LowerPrecisionFp,
        Category::Fp32,
        Category::Fp32SetOptDtype,
        Category::Promote,
        Category::Banned,
        Category::Passthrough,
    ];

    /// PyTorch's name of the policy list (`lower_precision_fp`, `fp32`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Category::LowerPrecisionFp => "lower_precision_fp",
            Category::Fp32 => "fp32",
            Category::Fp32SetOptDtype => "fp32_set_opt_dtype",
            Category::Promote => "promote",
            Category::Banned => "banned",
            Category::Passthrough => "passthrough",
        }
    }
}

impl FromStr for Category {
    type Err = Error;

    fn from_str(s: &str) -> Result<Category> {
        Category::ALL
            .into_iter()
            .find(|c| c.name() == s)
            .ok_or_else(|| {
                Error::Invalid(format!(
                    "unknown autocast category `{s}`: expected one of lower_precision_fp, fp32, \
                     fp32_set_opt_dtype, promote, banned, passthrough"
                ))
            })
    }
}

impl fmt::Display for Category {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

// CUDA lists: AT_FORALL_* of autocast_mode.h plus the CUDA-only registrations of
// autocast_mode.cpp. Overload suffixes dropped; entries with several overloads once.
const CUDA_LOWER_PRECISION_FP: &[&str] = &[
    "_convolution",
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_tbc",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    "convolution",
    "prelu",
    "addmm",
    "addmv",
    "addr",
    "matmul",
    "einsum",
    "mm",
    "mv",
    "linalg_vecdot",
    "linear",
    "addbmm",
    "baddbmm",
    "bmm",
    "chain_matmul",
    "linalg_multi_dot",
    "_thnn_fused_lstm_cell",
    "_thnn_fused_gru_cell",
    "lstm_cell",
    "gru_cell",
    "rnn_tanh_cell",
    "rnn_relu_cell",
    "_scaled_dot_product_flash_attention",
    "scaled_dot_product_attention",
    "cudnn_convolution",
    "cudnn_convolution_transpose",
    // Registered by aten/src/ATen/cudnn/AutocastRNN.cpp, which casts to float16 whatever
    // the autocast dtype; amprobe has no cuDNN RNN, so the difference never shows.
    "_cudnn_rnn",
];

const CUDA_FP32: &[&str] = &[
    "acos",
    "asin",
    "cosh",
    "erfinv",
    "exp",
    "expm1",
    "log",
    "log10",
    "log2",
    "log1p",
    "reciprocal",
    "rsqrt",
    "sinh",
    "tan",
    "pow",
    "softplus",
    "layer_norm",
    "native_layer_norm",
    "rms_norm",
    "group_norm",
    "frobenius_norm",
    "nuclear_norm",
    "cosine_similarity",
    "poisson_nll_loss",
    "cosine_embedding_loss",
    "nll_loss",
    "nll_loss2d",
    "hinge_embedding_loss",
    "kl_div",
    "l1_loss",
    "smooth_l1_loss",
    "huber_loss",
    "mse_loss",
    "margin_ranking_loss",
    "multilabel_margin_loss",
    "soft_margin_loss",
    "triplet_margin_loss",
    "multi_margin_loss",
    "binary_cross_entropy_with_logits",
    "dist",
    "pdist",
    "cdist",
    "renorm",
    "logsumexp",
    "upsample_nearest1d",
    "_upsample_nearest_exact1d",
    "upsample_nearest2d",
    "_upsample_nearest_exact2d",
    "upsample_nearest3d",
    "_upsample_nearest_exact3d",
    "upsample_linear1d",
    "upsample_bilinear2d",
    "_upsample_bilinear2d_aa",
    "upsample_trilinear3d",
    "upsample_bicubic2d",
    "_upsample_bicubic2d_aa",
    // Registered in autocast_mode.cpp outside the shared lists; observed as fp32.
    "linalg_matrix_sqrth",
];

// `norm` is PyTorch's fp32_append_dtype list; see Category::Fp32SetOptDtype.
const CUDA_FP32_SET_OPT_DTYPE: &[&str] = &[
    "prod",
    "softmax",
    "log_softmax",
    "cumprod",
    "cumsum",
    "linalg_vector_norm",
    "linalg_matrix_norm",
    "sum",
    "norm",
];

const CUDA_PROMOTE: &[&str] = &[
    "addcdiv",
    "addcmul",
    "atan2",
    "bilinear",
    "cross",
    "dot",
    "vdot",
    "grid_sampler",
    "index_put",
    "tensordot",
    "scatter_add",
];

const CUDA_BANNED: &[&str] = &["binary_cross_entropy"];

// CPU lists: the explicit KERNEL_CPU registrations of autocast_mode.cpp.
const CPU_LOWER_PRECISION_FP: &[&str] = &[
    "conv1d",
    "conv2d",
    "conv3d",
    "bmm",
    "mm",
    "linalg_vecdot",
    "baddbmm",
    "addmm",
    "_addmm_activation",
    "addbmm",
    "linear",
    "_convolution",
    "matmul",
    "conv_tbc",
    "mkldnn_rnn_layer",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    "prelu",
    "scaled_dot_product_attention",
    "_native_multi_head_attention",
];

const CPU_FP32: &[&str] = &[
    "avg_pool3d",
    "binary_cross_entropy",
    "grid_sampler",
    "polar",
    "prod",
    "quantile",
    "nanquantile",
    "stft",
    "cdist",
    "grid_sampler_2d",
    "_grid_sampler_2d_cpu_fallback",
    "grid_sampler_3d",
    "trace",
    "view_as_complex",
    "cholesky_inverse",
    "cholesky_solve",
    "inverse",
    "lu_solve",
    "orgqr",
    "ormqr",
    "pinverse",
    "max_pool3d",
    "max_unpool2d",
    "max_unpool3d",
    "adaptive_avg_pool3d",
    "reflection_pad1d",
    "reflection_pad2d",
    "replication_pad1d",
    "replication_pad2d",
    "replication_pad3d",
    "mse_loss",
    "cosine_embedding_loss",
    "nll_loss",
    "nll_loss2d",
    "hinge_embedding_loss",
    "poisson_nll_loss",
    "smooth_l1_loss",
    "cross_entropy_loss",
    "l1_loss",
    "huber_loss",
    "margin_ranking_loss",
    "soft_margin_loss",
    "triplet_margin_loss",
    "multi_margin_loss",
    "ctc_loss",
    "kl_div",
    "multilabel_margin_loss",
    "binary_cross_entropy_with_logits",
    "fft_fft",
    "fft_ifft",
    "fft_fft2",
    "fft_ifft2",
    "fft_fftn",
    "fft_ifftn",
    "fft_rfft",
    "fft_irfft",
    "fft_rfft2",
    "fft_irfft2",
    "fft_rfftn",
    "fft_irfftn",
    "fft_hfft",
    "fft_ihfft",
    "linalg_cond",
    "linalg_matrix_rank",
    "linalg_solve",
    "linalg_cholesky",
    "linalg_svdvals",
    "linalg_eigvals",
    "linalg_eigvalsh",
    "linalg_inv",
    "linalg_householder_product",
    "linalg_tensorinv",
    "linalg_tensorsolve",
    "fake_quantize_per_tensor_affine",
    "geqrf",
    "_lu_with_info",
    "svd",
    "triangular_solve",
    "fractional_max_pool2d",
    "fractional_max_pool3d",
    "adaptive_max_pool3d",
    "multilabel_margin_loss_forward",
    "linalg_qr",
    "linalg_cholesky_ex",
    "linalg_svd",
    "linalg_eig",
    "linalg_eigh",
    "linalg_lstsq",
    "linalg_inv_ex",
    "linalg_matrix_sqrth",
];

const CPU_PROMOTE: &[&str] = &["stack", "cat", "index_copy"];

/// The autocast policy of every registered op for one device type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyTable {
    device: DeviceType,
    /// Sorted by op name, names unique.
    entries: Vec<(&'static str, Category)>,
}

impl PolicyTable {
    /// The table of PyTorch's autocast lists for device type `d`.
    pub fn for_device(d: DeviceType) -> PolicyTable {
        let lists: &[(&[&'static str], Category)] = match d {
            DeviceType::Cuda => &[
                (CUDA_LOWER_PRECISION_FP, Category::LowerPrecisionFp),
                (CUDA_FP32, Category::Fp32),
                (CUDA_FP32_SET_OPT_DTYPE, Category::Fp32SetOptDtype),
                (CUDA_PROMOTE, Category::Promote),
                (CUDA_BANNED, Category::Banned),
            ],
            DeviceType::Cpu => &[
                (CPU_LOWER_PRECISION_FP, Category::LowerPrecisionFp),
                (CPU_FP32, Category::Fp32),
                (CPU_PROMOTE, Category::Promote),
            ],
        };
        let mut entries: Vec<(&'static str, Category)> = lists
            .iter()
            .flat_map(|(ops, cat)| ops.iter().map(move |op| (*op, *cat)))
            .collect();
        entries.sort_unstable();
        entries.dedup();
        PolicyTable { device: d, entries }
    }

    /// The device type this table is for.
    pub fn device(&self) -> DeviceType {
        self.device
    }

    /// The category of ATen op `op` (name without overload suffix; a suffix such as
    /// `softmax.int` is accepted and ignored). Ops without an autocast kernel are
    /// [`Category::Passthrough`].
    pub fn category(&self, op: &str) -> Category {
        let name = op.split('.').next().unwrap_or(op);
        match self.entries.binary_search_by(|(n, _)| (*n).cmp(name)) {
            Ok(i) => self.entries[i].1,
            Err(_) => Category::Passthrough,
        }
    }

    /// Like [`PolicyTable::category`], but a banned op is an error carrying PyTorch's
    /// reason and remedy.
    pub fn checked_category(&self, op: &str) -> Result<Category> {
        match self.category(op) {
            Category::Banned => Err(Error::Invalid(format!(
                "{op} is unsafe to autocast on {}: a sigmoid followed by binary cross entropy \
                 loses precision in {}; use binary_cross_entropy_with_logits (BCEWithLogitsLoss), \
                 which autocasts to float32",
                self.device,
                self.device.default_lower_precision()
            ))),
            c => Ok(c),
        }
    }

    /// Every op with an autocast kernel on this device and its category, sorted by op name.
    /// Unlisted ops are passthrough and do not appear.
    pub fn entries(&self) -> Vec<(&'static str, Category)> {
        self.entries.clone()
    }
}

/// True if autocast casts a tensor of dtype `d` (PyTorch's `is_eligible`): floating point
/// and not float64. Integer and float64 tensors are never cast.
pub fn is_eligible(d: DType) -> bool {
    d.is_float() && d != DType::F64
}

/// The dtype an input of dtype `input` has after autocast casts eligible inputs to
/// `target`: `target` if the input is eligible, otherwise `input` unchanged.
pub fn autocast_input_dtype(target: DType, input: DType) -> DType {
    if is_eligible(input) {
        target
    } else {
        input
    }
}

/// The dtype autocast casts an op's inputs to, for an op of category `cat` under autocast
/// with lower-precision dtype `low`, given its tensor inputs' dtypes in argument order.
/// Each eligible input becomes the returned dtype (see [`autocast_input_dtype`]);
/// ineligible ones (integer, float64) are left alone, and the op then applies its own type
/// promotion to what it receives (a bf16 input beside float64 ones still yields float64).
/// For [`Category::Fp32SetOptDtype`] the inputs are not cast but the op computes and
/// outputs float32, which is the same result.
///
/// `None` means autocast casts nothing: a passthrough op, an op with no eligible input, or
/// a [`Category::Fp32SetOptDtype`] op whose first input is ineligible (PyTorch then calls it
/// unaltered). [`Category::Banned`] yields `None` too; use
/// [`PolicyTable::checked_category`] to refuse it.
///
/// [`Category::Promote`] follows PyTorch's `promote_type`: starting from `low`, each
/// eligible input in order makes the result float32 if either is float32, keeps `low` if
/// both are `low`, and is an error otherwise (an fp16 input under bf16 autocast before any
/// float32 input).
///
/// Errors if `low` is not float16 or bfloat16, or on the promote conflict above.
pub fn autocast_output_dtype(
    cat: Category,
    low: DType,
    input_dtypes: &[DType],
) -> Result<Option<DType>> {
    if !low.is_low_precision() {
        return Err(Error::Invalid(format!(
            "autocast lower-precision dtype must be float16 or bfloat16, got {low}"
        )));
    }
    let any_eligible = input_dtypes.iter().any(|d| is_eligible(*d));
    Ok(match cat {
        Category::Passthrough | Category::Banned => None,
        _ if !any_eligible => None,
        Category::LowerPrecisionFp => Some(low),
        Category::Fp32 => Some(DType::F32),
        Category::Fp32SetOptDtype => match input_dtypes.first() {
            Some(first) if is_eligible(*first) => Some(DType::F32),
            _ => None,
        },
        Category::Promote => {
            let mut current = low;
            for &next in input_dtypes.iter().filter(|d| is_eligible(**d)) {
                current = if current == DType::F32 || next == DType::F32 {
                    DType::F32
                } else if current == low && next == low {
                    low
                } else {
                    return Err(Error::Invalid(format!(
                        "autocast promote: input dtype {next} is neither float32 nor the \
                         autocast dtype {low}"
                    )));
                };
            }
            Some(current)
        }
    })
}

/// The dtypes of `cross_entropy_loss` with class-index targets and no label smoothing under
/// autocast on one device (see [`cross_entropy_dtypes`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct CrossEntropyDtypes {
    /// Dtype of the log-probabilities produced by the inner `log_softmax`.
    pub log_probs: DType,
    /// Dtype of the loss produced by the inner `nll_loss`.
    pub loss: DType,
}

/// How PyTorch's `cross_entropy_loss` (class-index targets, no label smoothing) runs under
/// autocast on `device` with logits of dtype `logits`.
///
/// It decomposes into `nll_loss(log_softmax(x, class_dim, dtype = x.dtype))`. On CUDA the op
/// has no autocast kernel, so the decomposition's calls meet autocast one by one:
/// `log_softmax` is `fp32_set_opt_dtype`, but its dtype is given explicitly and kept, so the
/// log-probabilities are rounded to the logits' dtype (fp16 logits give fp16 log-probs);
/// `nll_loss` is `fp32` and upcasts them, so the loss is float32. On CPU `cross_entropy_loss`
/// itself is `fp32`: the logits are cast first and both steps run in float32. Float64
/// logits are never cast.
pub fn cross_entropy_dtypes(device: DeviceType, logits: DType) -> CrossEntropyDtypes {
    if !is_eligible(logits) {
        return CrossEntropyDtypes {
            log_probs: logits,
            loss: logits,
        };
    }
    match device {
        DeviceType::Cuda => CrossEntropyDtypes {
            log_probs: logits,
            loss: DType::F32,
        },
        DeviceType::Cpu => CrossEntropyDtypes {
            log_probs: DType::F32,
            loss: DType::F32,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_op_is_listed_twice_across_categories() {
        for d in DeviceType::ALL {
            let entries = PolicyTable::for_device(d).entries();
            for w in entries.windows(2) {
                assert_ne!(w[0].0, w[1].0, "{d}: {} has two categories", w[0].0);
            }
        }
    }

    #[test]
    fn overload_suffix_is_ignored() {
        let t = PolicyTable::for_device(DeviceType::Cuda);
        assert_eq!(t.category("softmax.int"), Category::Fp32SetOptDtype);
        assert_eq!(t.category("pow.Tensor_Scalar"), Category::Fp32);
        assert_eq!(
            t.category("conv_transpose2d.input"),
            Category::LowerPrecisionFp
        );
    }
}
