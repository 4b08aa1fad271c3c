//! Layer 11 of `amprobe::LAYERS`: may use layers 0–10 (`dtype` … `diagnose`).
//!
//! A whole run: build the model, data and step engine from a config, train, stream the
//! trace, and summarise the outcome.

use crate::backend_choice::resolve_backend;
use crate::config::RunConfig;
pub use crate::diagnose::summary::{verdict, ParamSummary, RunSummary, StepSummary};
use crate::dtype::DType;
use crate::engine::Injection;
use crate::error::{Error, Result};
use crate::models::bert::{Bert, BertConfig};
use crate::models::gpt2::{Gpt2, Gpt2Config};
use crate::models::llama::{Llama, LlamaConfig};
use crate::models::mlp::{synthetic_batch, Mlp};
use crate::models::pretrained::Pretrained;
use crate::models::t5::{T5Config, T5Encoder};
use crate::models::t5_seq2seq::T5Seq2Seq;
use crate::models::tokens::{load_inputs, synthetic_ids};
use crate::models::weights::{load_safetensors, take};
use crate::models::{Batch, Model, ParamStore};
use crate::trace::io::TraceWriter;
use crate::trace::record::{EndRecord, Header, Record};
use crate::train::{DataSource, FixedBatch, Synthetic, TrainConfig, Trainer};
use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::Instant;

/// Options of a run that are not part of the config.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Command line, recorded in the trace header.
    pub command_line: Vec<String>,
    /// Test hooks: values written into chosen ops' outputs.
    pub injections: Vec<Injection>,
    /// Show a progress bar (only when stdout is a terminal).
    pub progress: bool,
    /// A live channel that receives the same records as the trace (header, each step as it
    /// finishes, end), e.g. for the terminal UI. A closed receiver is ignored.
    pub live: Option<std::sync::mpsc::Sender<Record>>,
    /// Diagnosis: skip causes, collapse flag, headroom, remedies.
    pub diagnose: crate::diagnose::DiagnoseOptions,
}

/// A model, its parameters and its data, ready for a [`Trainer`].
pub type Built = (Box<dyn Model>, ParamStore, Box<dyn DataSource>);

/// Builds the model, its parameters and the data source a config describes, with the
/// model's fp16 switches that `[model] switches` turns on.
pub fn build(cfg: &RunConfig, train: &TrainConfig) -> Result<Built> {
    let (mut m, params, data) = build_model(cfg, train)?;
    for name in cfg.model.switches.iter().flatten() {
        if !m.set_switch(name, true) {
            let known: Vec<String> = m
                .fp16_switches()
                .iter()
                .map(|(s, _)| format!("`{s}`"))
                .collect();
            return Err(Error::config(
                "model.switches",
                format!(
                    "`{name}` is not a switch of {}; its switches: {}",
                    m.describe(),
                    if known.is_empty() {
                        "none".to_string()
                    } else {
                        known.join(", ")
                    }
                ),
            ));
        }
    }
    Ok((m, params, data))
}

fn build_model(cfg: &RunConfig, train: &TrainConfig) -> Result<Built> {
    let detected;
    let kind = match (&cfg.model.kind, hf_config_path(cfg)) {
        (Some(k), _) => k.as_str(),
        (None, Some(path)) => {
            detected = architecture(&path)?;
            detected.as_str()
        }
        (None, None) => "mlp",
    };
    match kind {
        "mlp" => {
            let m = Mlp {
                inputs: cfg.model.inputs.unwrap_or(100),
                hidden: cfg.model.hidden.unwrap_or(50),
                classes: cfg.model.classes.unwrap_or(10),
            };
            let params = match &cfg.model.weights {
                Some(p) => m.load(&cfg.resolve(p))?,
                None => m.init(train.seed)?,
            };
            let data: Box<dyn DataSource> = match &cfg.data.batch_file {
                Some(p) => Box::new(FixedBatch(load_batch(&cfg.resolve(p), m.inputs)?)),
                None => {
                    let (inputs, classes, b, seed) = (
                        m.inputs,
                        m.classes,
                        cfg.data.batch.unwrap_or(16),
                        train.seed,
                    );
                    if b == 0 {
                        return Err(Error::config("data.batch", "must be at least 1"));
                    }
                    Box::new(Synthetic(move |step, micro| {
                        synthetic_batch(inputs, classes, b, seed, step * 1024 + micro as u64)
                    }))
                }
            };
            Ok((Box::new(m), params, data))
        }
        "t5" => hf_model(cfg, train, "t5", |path| {
            let mut m = T5Encoder::new(T5Config::load(path)?);
            m.clamp = cfg.model.t5_clamp.unwrap_or(false);
            Ok(m)
        }),
        "t5-seq2seq" => hf_model(cfg, train, "t5", |path| {
            let mut m = T5Seq2Seq::load_config(path)?;
            m.enc.clamp = cfg.model.t5_clamp.unwrap_or(false);
            Ok(m)
        }),
        "gpt2" => hf_model(cfg, train, "gpt2", |path| {
            Ok(Gpt2::new(Gpt2Config::load(path)?))
        }),
        "llama" => hf_model(cfg, train, "llama", |path| {
            Ok(Llama::new(LlamaConfig::load(path)?))
        }),
        "bert" => hf_model(cfg, train, "bert", |path| {
            Ok(Bert::new(BertConfig::load(path)?))
        }),
        other => Err(Error::config(
            "model.kind",
            format!(
                "unknown model kind `{other}` (expected mlp, t5, t5-seq2seq, gpt2, llama or bert)"
            ),
        )),
    }
}

/// A Hugging Face model of kind `kind`, made by `make` from its `config.json`, with the
/// checkpoint's weights (or a seeded init when the config names none) and token data.
fn hf_model<M: Pretrained>(
    cfg: &RunConfig,
    train: &TrainConfig,
    kind: &str,
    make: impl FnOnce(&std::path::Path) -> Result<M>,
) -> Result<Built> {
    let (config_path, weights) = hf_paths(cfg, kind)?;
    let m = make(&config_path)?;
    let params = if weights.as_os_str().is_empty() {
        m.seeded(train.seed)?
    } else {
        m.load_weights(&weights)?
    };
    let (vocab, seq) = m.tokens();
    let data = token_data(cfg, train, vocab, seq)?;
    Ok((Box::new(m), params, data))
}

/// The architectures `run --hf` takes: `model_type` in `config.json` and the model kind.
pub const HF_ARCHITECTURES: &[(&str, &str)] = &[
    ("t5", "t5"),
    ("gpt2", "gpt2"),
    ("llama", "llama"),
    ("bert", "bert"),
];

/// The `config.json` a config's `[model]` names (`hf` directory or `hf_config`), if any.
fn hf_config_path(cfg: &RunConfig) -> Option<PathBuf> {
    match (&cfg.model.hf, &cfg.model.hf_config) {
        (Some(dir), _) => Some(cfg.resolve(dir).join("config.json")),
        (None, Some(c)) => Some(cfg.resolve(c)),
        (None, None) => None,
    }
}

/// The model kind of a Hugging Face `config.json`, from `model_type` (or, without it,
/// `architectures`); an unsupported one is refused with the list of supported ones.
pub fn architecture(path: &std::path::Path) -> Result<String> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    let v: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| Error::config(path.display().to_string(), format!("not valid JSON: {e}")))?;
    let supported = || {
        HF_ARCHITECTURES
            .iter()
            .map(|(t, _)| format!("`{t}`"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mt = v.get("model_type").and_then(|x| x.as_str()).or_else(|| {
        let arch = v.get("architectures")?.as_array()?.first()?.as_str()?;
        match arch {
            "T5EncoderModel" | "T5Model" | "T5ForConditionalGeneration" => Some("t5"),
            "GPT2LMHeadModel" | "GPT2Model" => Some("gpt2"),
            "LlamaForCausalLM" | "LlamaModel" => Some("llama"),
            "BertForMaskedLM" | "BertModel" | "BertForPreTraining" => Some("bert"),
            _ => None,
        }
    });
    // A T5 checkpoint is the encoder alone unless it says it is the whole model.
    let seq2seq = v
        .get("architectures")
        .and_then(|a| a.as_array())
        .is_some_and(|a| {
            a.iter()
                .any(|x| x.as_str() == Some("T5ForConditionalGeneration"))
        });
    if mt == Some("t5") && seq2seq {
        return Ok("t5-seq2seq".into());
    }
    match mt {
        Some(t) => HF_ARCHITECTURES
            .iter()
            .find(|(name, _)| *name == t)
            .map(|(_, kind)| kind.to_string())
            .ok_or_else(|| {
                Error::config(
                    format!("{}: model_type", path.display()),
                    format!("`{t}` is not supported; supported: {}", supported()),
                )
            }),
        None => Err(Error::config(
            format!("{}: model_type", path.display()),
            format!(
                "missing, and `architectures` names none amprobe knows; supported: {}",
                supported()
            ),
        )),
    }
}

/// `config.json` and the weights (a directory or file; empty: seeded init) of a Hugging
/// Face model of kind `kind`.
fn hf_paths(cfg: &RunConfig, kind: &str) -> Result<(PathBuf, PathBuf)> {
    match (&cfg.model.hf, &cfg.model.hf_config, &cfg.model.weights) {
        (Some(dir), _, w) => {
            let dir = cfg.resolve(dir);
            Ok((
                dir.join("config.json"),
                w.as_ref().map(|w| cfg.resolve(w)).unwrap_or(dir),
            ))
        }
        (None, Some(c), Some(w)) => Ok((cfg.resolve(c), cfg.resolve(w))),
        (None, Some(c), None) => Ok((cfg.resolve(c), PathBuf::new())),
        (None, None, _) => Err(Error::config(
            "model.hf",
            format!("a {kind} model needs `hf` (a checkpoint directory) or `hf_config`"),
        )),
    }
}

/// Token batches: `data.inputs` (a safetensors inputs file, see [`load_inputs`]) or
/// seeded synthetic ids of `data.batch` × `data.seq` (default 8 × `seq`).
fn token_data(
    cfg: &RunConfig,
    train: &TrainConfig,
    vocab: usize,
    seq: usize,
) -> Result<Box<dyn DataSource>> {
    Ok(match &cfg.data.inputs {
        Some(p) => Box::new(FixedBatch(load_inputs(&cfg.resolve(p))?)),
        None => {
            let (b, s, seed) = (
                cfg.data.batch.unwrap_or(8),
                cfg.data.seq.unwrap_or(seq),
                train.seed,
            );
            if b == 0 || s == 0 {
                return Err(Error::config("data.batch / data.seq", "must be at least 1"));
            }
            Box::new(Synthetic(move |step, micro| {
                synthetic_ids(vocab, b, s, seed, step * 1024 + micro as u64)
            }))
        }
    })
}

/// Loads a batch file with `x` [batch, inputs] (float) and `y` [batch] (int64).
pub fn load_batch(path: &std::path::Path, inputs: usize) -> Result<Batch> {
    let mut map = load_safetensors(path)?;
    let x = map.get("x").ok_or_else(|| {
        Error::tensor(
            format!("{}: x", path.display()),
            "missing (expected [batch, inputs] float)",
        )
    })?;
    let b = x.shape().first().copied().unwrap_or(0);
    let x = take(&mut map, path, "x", &[b, inputs])?;
    if !x.dtype().is_float() || x.dtype() == DType::F64 {
        return Err(Error::tensor(
            format!("{}: x", path.display()),
            format!("has dtype {}, expected F32, F16 or BF16", x.dtype()),
        ));
    }
    let x = crate::ops::cast::cast(&x, DType::F32)?.tensor;
    let y = take(&mut map, path, "y", &[b])?;
    if y.dtype() != DType::I64 {
        return Err(Error::tensor(
            format!("{}: y", path.display()),
            format!("has dtype {}, expected I64 labels", y.dtype()),
        ));
    }
    Ok(Batch::new(x, y))
}

/// The trace header of a run.
pub fn header(
    cfg: &RunConfig,
    train: &TrainConfig,
    model: String,
    opts: &RunOptions,
) -> Result<Header> {
    let json =
        |v: serde_json::Result<serde_json::Value>| v.map_err(|e| Error::Invalid(e.to_string()));
    let table: BTreeMap<_, _> = crate::amp::policy::PolicyTable::for_device(train.policy)
        .entries()
        .into_iter()
        .collect();
    Ok(Header {
        model,
        precision: train.precision.name().to_string(),
        autocast_dtype: train.precision.autocast_dtype(),
        policy_device: train.policy.name().to_string(),
        policy: json(serde_json::to_value(table))?,
        scaler: json(serde_json::to_value(&train.scaler))?,
        optimizer: json(serde_json::to_value(&train.optimizer))?,
        backend: train.backend.to_string(),
        host_gemm: Some(crate::ops::linalg::host_gemm::describe()),
        seed: train.seed,
        command_line: opts.command_line.clone(),
        config: json(serde_json::to_value(cfg))?,
        ..Header::new()
    })
}

/// A progress bar over the run's steps, when asked for, stdout is a terminal and there is
/// more than one step.
fn progress_bar(opts: &RunOptions, steps: u64) -> Option<indicatif::ProgressBar> {
    if !(opts.progress && std::io::stdout().is_terminal() && steps > 1) {
        return None;
    }
    let b = indicatif::ProgressBar::new(steps);
    b.set_style(
        indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} steps  {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    Some(b)
}

/// Whether every parameter the run ends with is finite (device values, which the host
/// cannot read here, count as finite).
fn params_finite(trainer: &Trainer) -> bool {
    trainer.params().params.iter().all(|p| {
        p.value
            .f32s()
            .map(|v| v.iter().all(|x| x.is_finite()))
            .unwrap_or(true)
    })
}

/// Runs the configured training and writes the trace (when a path is configured).
pub fn run(cfg: &RunConfig, opts: &RunOptions) -> Result<RunSummary> {
    let choice = cfg.backend_choice()?;
    let resolved = resolve_backend(choice)?;
    let mut train = cfg.train_config()?;
    train.backend = resolved.kind;
    // The scaler's own collapse events use the same streak as the diagnosis.
    train.scaler.collapse_streak = opts.diagnose.collapse_steps;
    let (model, params, data) = build(cfg, &train)?;
    let mut trainer = Trainer::new(train.clone(), model, params, data)?;
    for inj in &opts.injections {
        trainer.inject(inj.clone());
    }
    let mut header = header(cfg, &train, trainer.model().describe(), opts)?;
    header.device = resolved.device.clone();
    let dir = if cfg.base_dir.as_os_str().is_empty() {
        std::path::Path::new(".")
    } else {
        cfg.base_dir.as_path()
    };
    header.config_dir = dir.canonicalize().ok();
    let mut writer = match &cfg.probe.trace {
        Some(p) => Some(TraceWriter::create(p, &header)?),
        None => None,
    };
    let send = |r: Record| {
        if let Some(tx) = &opts.live {
            let _ = tx.send(r);
        }
    };
    send(Record::Header(header));
    let steps = cfg.steps();
    let bar = progress_bar(opts, steps);
    let t0 = Instant::now();
    let mut records = Vec::new();
    let mut diag = crate::diagnose::Diagnoser::new(opts.diagnose.clone());
    for s in 0..steps {
        let mut rec = trainer.step(s)?;
        diag.after_step(&trainer, &mut rec)?;
        if let Some(w) = writer.as_mut() {
            w.write_step(&rec)?;
        }
        if opts.live.is_some() {
            send(Record::Step(rec.clone()));
        }
        if let Some(b) = &bar {
            b.set_message(format!(
                "loss {:.4}  scale {}",
                rec.loss.unwrap_or(f64::NAN),
                rec.scale_after
            ));
            b.inc(1);
        }
        rec.ops = None;
        records.push(rec);
        if diag.should_stop() {
            break;
        }
    }
    let diagnosis = diag.finish();
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    let params_finite = params_finite(&trainer);
    let verdict = verdict(&records, params_finite);
    let end = EndRecord {
        steps: records.len() as u64,
        verdict: verdict.to_string(),
        wall_ms: t0.elapsed().as_secs_f64() * 1e3,
    };
    if let Some(w) = writer {
        w.finish(&end)?;
    }
    send(Record::End(end));
    Ok(crate::diagnose::summary::summarize(
        &records,
        crate::diagnose::summary::RunIdentity {
            model: trainer.model().describe(),
            precision: train.precision,
            backend: resolved.kind,
            device: resolved.device,
            backend_warning: resolved.warning,
            trace: cfg.probe.trace.clone(),
        },
        verdict,
        diagnosis,
    ))
}
