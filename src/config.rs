//! Layer 10 of `amprobe::LAYERS`: may use layers 0–9 (`dtype` … `train`).
//!
//! Run configuration: a TOML file whose every field can also be set by a CLI flag (flags win).

use crate::amp::mode::Precision;
use crate::amp::policy::DeviceType;
use crate::amp::scaler::{ScalerConfig, ScalerKind};
use crate::error::{Error, Result};
use crate::optim::clip::NormType;
use crate::optim::{AdamConfig, AdamWConfig, OptimizerConfig, SgdConfig};
use crate::train::{OpSampling, TrainConfig};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// `[model]`: which model and where its weights are.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    /// Model kind: `mlp`, `t5`, `gpt2` or `llama` (default: from the Hugging Face `config.json`
    /// when `hf` or `hf_config` is given, else `mlp`).
    pub kind: Option<String>,
    /// Hugging Face checkpoint directory (`config.json` + `model.safetensors` or a sharded
    /// index), relative to the config file; its `model_type` picks the kind.
    pub hf: Option<PathBuf>,
    /// Hugging Face `config.json` when the weights are elsewhere (`weights`).
    pub hf_config: Option<PathBuf>,
    /// transformers' fp16 clamp in T5Block.
    pub t5_clamp: Option<bool>,
    /// The model's own fp16 switches from transformers' config to turn on, overriding
    /// `config.json` (GPT-2: `reorder_and_upcast_attn`, `scale_attn_by_inverse_layer_idx`).
    pub switches: Option<Vec<String>>,
    /// MLP input features.
    pub inputs: Option<usize>,
    /// MLP hidden units.
    pub hidden: Option<usize>,
    /// MLP classes.
    pub classes: Option<usize>,
    /// Weights (safetensors), relative to the config file; seeded init when absent.
    pub weights: Option<PathBuf>,
}

/// `[data]`: the batch.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DataSection {
    /// A safetensors file with `x` [batch, inputs] (float) and `y` [batch] (int64), used
    /// for every step; relative to the config file.
    pub batch_file: Option<PathBuf>,
    /// Batch size of seeded synthetic data (when no batch file).
    pub batch: Option<usize>,
    /// Token ids for T5: a safetensors file with `input_ids` [batch, seq] (int64) and
    /// optional `labels`, relative to the config file.
    pub inputs: Option<PathBuf>,
    /// Sequence length of seeded synthetic token ids.
    pub seq: Option<usize>,
}

/// Most weights a seeded MLP may have (2^28).
pub const MAX_SEEDED_ELEMENTS: u64 = 1 << 28;
/// Most values a synthetic batch may hold, and most entries of a T5 position table
/// (`seq²`): 2^26.
pub const MAX_BATCH_ELEMENTS: u64 = 1 << 26;

/// `[train]`: the step.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TrainSection {
    /// Precision mode: fp32, fp16, bf16, o2, o2-bf16, half, bfloat16-pure.
    pub precision: Option<String>,
    /// Optimizer steps.
    pub steps: Option<u64>,
    /// Micro-batches per optimizer step.
    pub accumulate: Option<u32>,
    /// Max gradient norm (clipping after unscale).
    #[serde(serialize_with = "crate::trace::float_json::f32_exact::option::serialize")]
    pub clip: Option<f32>,
    /// Clipping norm: `l2` or `inf`.
    pub clip_norm: Option<NormType>,
    /// sgd, adam or adamw.
    pub optimizer: Option<String>,
    /// Learning rate.
    pub lr: Option<f64>,
    /// SGD momentum.
    pub momentum: Option<f64>,
    /// Weight decay.
    pub weight_decay: Option<f64>,
    /// Seed for synthetic data, init and dropout.
    pub seed: Option<u64>,
    /// Autocast policy table: cuda or cpu.
    pub policy: Option<String>,
    /// Module path patterns kept in fp32.
    pub keep_fp32: Option<Vec<String>>,
    /// Where the step runs: `auto` (default: the GPU when the step can run there, else the
    /// CPU), `cpu` or `cuda`.
    pub backend: Option<String>,
}

/// `[scaler]`: the loss scaler.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ScalerSection {
    /// default, maxclip, hysteresis, fixed or none.
    pub kind: Option<String>,
    /// Initial scale.
    #[serde(serialize_with = "crate::trace::float_json::f32_exact::option::serialize")]
    pub init_scale: Option<f32>,
    /// Growth factor.
    pub growth_factor: Option<f64>,
    /// Backoff factor.
    pub backoff_factor: Option<f64>,
    /// Clean steps before growth.
    pub growth_interval: Option<u32>,
    /// Cap of `maxclip`.
    #[serde(serialize_with = "crate::trace::float_json::f32_exact::option::serialize")]
    pub max_scale: Option<f32>,
    /// Overflows tolerated before a backoff (`hysteresis`).
    pub hysteresis: Option<u32>,
    /// Floor of `hysteresis`.
    #[serde(serialize_with = "crate::trace::float_json::f32_exact::option::serialize")]
    pub min_scale: Option<f32>,
    /// Fail when an overflow happens at the floor (`hysteresis`).
    pub error_at_floor: Option<bool>,
}

/// `[probe]`: probes and outputs.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ProbeSection {
    /// Probes on (default) or off.
    pub enabled: Option<bool>,
    /// Keep full op records every N steps (0: only the first step and non-finite steps).
    pub sample_every: Option<u64>,
    /// Blame every op (forward, backward, optimizer) of the steps whose op records are
    /// kept: its error against f64, introduced by the op or inherited from its inputs.
    pub blame: Option<bool>,
    /// Trace path (JSON Lines).
    pub trace: Option<PathBuf>,
    /// Summary JSON path.
    pub summary_json: Option<PathBuf>,
}

/// A whole run configuration, as in the TOML file.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RunConfig {
    /// Model.
    #[serde(default)]
    pub model: ModelSection,
    /// Data.
    #[serde(default)]
    pub data: DataSection,
    /// Training.
    #[serde(default)]
    pub train: TrainSection,
    /// Loss scaler.
    #[serde(default)]
    pub scaler: ScalerSection,
    /// Probes.
    #[serde(default)]
    pub probe: ProbeSection,
    /// Directory relative paths resolve against (the config file's folder).
    #[serde(skip)]
    pub base_dir: PathBuf,
}

impl RunConfig {
    /// Reads a TOML config file.
    pub fn load(path: &Path) -> Result<RunConfig> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        RunConfig::parse(&text, path)
    }

    /// [`RunConfig::load`] of a file's text; `path` names it in errors and is the file
    /// relative paths resolve against.
    pub fn parse(text: &str, path: &Path) -> Result<RunConfig> {
        let mut cfg: RunConfig = toml::from_str(text)
            .map_err(|e| Error::config(path.display().to_string(), e.to_string()))?;
        cfg.base_dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
        Ok(cfg)
    }

    /// Resolves a path from the file against the config's folder.
    pub fn resolve(&self, p: &Path) -> PathBuf {
        if p.is_absolute() {
            p.to_path_buf()
        } else {
            self.base_dir.join(p)
        }
    }

    /// Number of steps (default 1).
    pub fn steps(&self) -> u64 {
        self.train.steps.unwrap_or(1)
    }

    /// The step engine's configuration.
    pub fn train_config(&self) -> Result<TrainConfig> {
        let t = &self.train;
        let precision = Precision::parse(t.precision.as_deref().unwrap_or("fp32"))?;
        self.backend_choice()?;
        self.check_sizes()?;
        let policy = match t.policy.as_deref().unwrap_or("cuda") {
            "cuda" => DeviceType::Cuda,
            "cpu" => DeviceType::Cpu,
            other => {
                return Err(Error::config(
                    "train.policy",
                    format!("unknown device type `{other}` (expected cuda or cpu)"),
                ))
            }
        };
        let lr = t.lr.unwrap_or(0.01);
        let wd = t.weight_decay;
        let optimizer = match t.optimizer.as_deref().unwrap_or("sgd") {
            "sgd" => OptimizerConfig::Sgd(SgdConfig {
                lr,
                momentum: t.momentum.unwrap_or(0.0),
                weight_decay: wd.unwrap_or(0.0),
                ..SgdConfig::default()
            }),
            "adam" => OptimizerConfig::Adam(AdamConfig {
                lr,
                weight_decay: wd.unwrap_or(0.0),
                ..AdamConfig::default()
            }),
            "adamw" => OptimizerConfig::AdamW(AdamWConfig {
                lr,
                weight_decay: wd.unwrap_or(0.01),
                ..AdamWConfig::default()
            }),
            other => {
                return Err(Error::config(
                    "train.optimizer",
                    format!("unknown optimizer `{other}` (expected sgd, adam or adamw)"),
                ))
            }
        };
        let s = &self.scaler;
        let d = ScalerConfig::default();
        let kind = match s.kind.as_deref().unwrap_or("default") {
            "default" => ScalerKind::Default,
            "maxclip" | "max_clip" => ScalerKind::MaxClip { max_scale: s.max_scale.unwrap_or(16777216.0) },
            "hysteresis" => ScalerKind::Hysteresis {
                hysteresis: s.hysteresis.unwrap_or(2),
                min_scale: s.min_scale.unwrap_or(1.0),
                error_at_floor: s.error_at_floor.unwrap_or(false),
            },
            "fixed" => ScalerKind::Fixed,
            "none" => ScalerKind::None,
            other => {
                return Err(Error::config(
                    "scaler.kind",
                    format!("unknown scaler `{other}` (expected default, maxclip, hysteresis, fixed or none)"),
                ))
            }
        };
        let scaler = ScalerConfig {
            enabled: !matches!(kind, ScalerKind::None),
            kind,
            init_scale: s.init_scale.unwrap_or(d.init_scale),
            growth_factor: s.growth_factor.unwrap_or(d.growth_factor),
            backoff_factor: s.backoff_factor.unwrap_or(d.backoff_factor),
            growth_interval: s.growth_interval.unwrap_or(d.growth_interval),
            ..d
        };
        scaler.validate()?;
        Ok(TrainConfig {
            precision,
            accumulate: t.accumulate.unwrap_or(1),
            clip: t.clip,
            clip_norm: t.clip_norm.unwrap_or_default(),
            optimizer,
            scaler,
            policy,
            seed: t.seed.unwrap_or(0),
            keep_fp32: t.keep_fp32.clone().unwrap_or_default(),
            probes: self.probe.enabled.unwrap_or(true),
            sampling: OpSampling {
                every: self.probe.sample_every.unwrap_or(0),
                ..OpSampling::default()
            },
            // What runs the step is resolved by the runner from `backend_choice`.
            backend: crate::backend::BackendKind::Cpu,
            blame: self.probe.blame.unwrap_or(false),
        })
    }

    /// Refuses sizes that would make amprobe set aside more memory than any real run of
    /// these models needs: seeded MLP parameters, synthetic batches.
    fn check_sizes(&self) -> Result<()> {
        let m = &self.model;
        let (i, h, c) = (
            m.inputs.unwrap_or(100) as u64,
            m.hidden.unwrap_or(50) as u64,
            m.classes.unwrap_or(10) as u64,
        );
        let mlp = i
            .checked_mul(h)
            .and_then(|a| h.checked_mul(c).and_then(|b| a.checked_add(b)));
        if mlp.is_none_or(|n| n > MAX_SEEDED_ELEMENTS) {
            return Err(Error::config(
                "model.inputs / hidden / classes",
                format!("the MLP would have more than {MAX_SEEDED_ELEMENTS} weights"),
            ));
        }
        let (b, s) = (
            self.data.batch.unwrap_or(16) as u64,
            self.data.seq.unwrap_or(128) as u64,
        );
        let batch = b
            .checked_mul(s.max(i))
            .filter(|&n| n <= MAX_BATCH_ELEMENTS)
            .and_then(|_| s.checked_mul(s))
            .filter(|&n| n <= MAX_BATCH_ELEMENTS);
        if batch.is_none() {
            return Err(Error::config(
                "data.batch / data.seq",
                format!(
                    "a synthetic batch (or a seq × seq position table) would hold more than \
                     {MAX_BATCH_ELEMENTS} values"
                ),
            ));
        }
        Ok(())
    }

    /// The backend asked for in `train.backend` (`auto` when unset).
    pub fn backend_choice(&self) -> Result<crate::backend::BackendChoice> {
        match &self.train.backend {
            Some(b) => crate::backend::BackendChoice::parse(b)
                .map_err(|e| Error::config("train.backend", e.to_string())),
            None => Ok(crate::backend::BackendChoice::Auto),
        }
    }
}
