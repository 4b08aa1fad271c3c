//! Layer 11 of `amprobe::LAYERS`: may use layers 0–10 (`dtype` … `diagnose`).
//! Sideways it uses `runner` (to build a run from its configuration).
//!
//! The smallest failing batch (`amprobe shrink`): the run's first Inf/NaN is found, then the
//! batch of the step where it appeared is cut down — its rows by delta debugging, its
//! sequence to the shortest prefix, the steps before it to the fewest — while the first
//! Inf/NaN of a run on the smaller batch (the same batch every step) stays at the same op,
//! module and phase. Each candidate is a fresh run from the configuration's weights,
//! stopped at its first step with an Inf or NaN.

use crate::config::RunConfig;
use crate::error::{Error, Result};
use crate::models::Batch;
use crate::runner::build;
use crate::tensor::Tensor;
use crate::trace::record::{OpRef, Phase, StepRecord};
use crate::train::{FixedBatch, TrainConfig, Trainer};
use std::path::Path;

/// Where a failure first shows: the kind of value and the op.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// `"Inf"` or `"NaN"`.
    pub kind: &'static str,
    /// Op name.
    pub op: String,
    /// Module path.
    pub module: String,
    /// Phase.
    pub phase: Phase,
}

impl Target {
    fn of(o: &OpRef, kind: &'static str) -> Target {
        Target {
            kind,
            op: o.op.clone(),
            module: o.module.clone(),
            phase: o.phase,
        }
    }

    /// `Inf at forward `linear` in `wo``.
    pub fn describe(&self) -> String {
        let phase = self.phase.name();
        let module = crate::trace::record::module_name(&self.module);
        format!("{} at {phase} `{}` in `{module}`", self.kind, self.op)
    }
}

/// The first Inf/NaN origin of a step: the earlier of its first Inf and first NaN.
pub fn first_origin(s: &StepRecord) -> Option<Target> {
    match (&s.origins.first_inf, &s.origins.first_nan) {
        (Some(i), Some(n)) if n.op_index < i.op_index => Some(Target::of(n, "NaN")),
        (Some(i), _) => Some(Target::of(i, "Inf")),
        (None, Some(n)) => Some(Target::of(n, "NaN")),
        (None, None) => None,
    }
}

/// Limits of a shrink.
#[derive(Debug, Clone, Copy)]
pub struct ShrinkOptions {
    /// Most candidate runs.
    pub max_runs: usize,
}

impl Default for ShrinkOptions {
    fn default() -> Self {
        ShrinkOptions { max_runs: 1000 }
    }
}

/// What a shrink found.
#[derive(Debug, Clone)]
pub struct Shrunk {
    /// The failure held fixed.
    pub target: Target,
    /// The step of the original run where it first appeared.
    pub original_step: u64,
    /// Rows and sequence length of that step's batch.
    pub original_shape: (usize, usize),
    /// The smallest batch found.
    pub batch: Batch,
    /// Which rows of the original batch it keeps, in order.
    pub rows: Vec<usize>,
    /// Its sequence length (a prefix of the original's).
    pub seq: usize,
    /// Steps a run on it needs before the failure shows (the failure is in the last).
    pub steps: u64,
    /// Candidate runs made.
    pub runs: usize,
    /// True when the run limit stopped the search before it was done.
    pub hit_limit: bool,
}

/// Progress of a shrink, reported after each candidate run.
#[derive(Debug, Clone, Copy)]
pub struct Progress {
    /// Candidate runs so far.
    pub runs: usize,
    /// Rows of the smallest failing batch so far.
    pub rows: usize,
    /// Its sequence length.
    pub seq: usize,
    /// Its steps.
    pub steps: u64,
}

/// The search: a configuration, the batch being cut, the target.
struct Search<'a> {
    cfg: &'a RunConfig,
    train: TrainConfig,
    base: Batch,
    /// Whether labels are the target side of an encoder–decoder (their own length).
    target_side_labels: bool,
    target: Target,
    runs: usize,
    max_runs: usize,
    hit_limit: bool,
    on_run: &'a mut dyn FnMut(Progress),
    best: (usize, usize, u64),
}

impl Search<'_> {
    /// Rows `rows` of the base batch, its first `seq` positions.
    fn slice(&self, rows: &[usize], seq: usize) -> Result<Batch> {
        let b = &self.base;
        let seq_aligned = |t: &Tensor| t.rank() == 2 && t.shape() == b.inputs.shape();
        let cut = |t: &Tensor, along_seq: bool| -> Result<Tensor> {
            let shape = t.shape();
            let width: usize = shape[1..].iter().product();
            let ids = t.i64s()?;
            let keep = if along_seq { seq } else { width };
            let mut v = Vec::with_capacity(rows.len() * keep);
            for &r in rows {
                v.extend_from_slice(&ids[r * width..r * width + keep]);
            }
            let mut s = shape.to_vec();
            s[0] = rows.len();
            if along_seq {
                s[1] = seq;
            }
            Tensor::from_i64(v, &s)
        };
        let opt = |t: &Option<Tensor>| -> Result<Option<Tensor>> {
            t.as_ref().map(|t| cut(t, seq_aligned(t))).transpose()
        };
        Ok(Batch {
            inputs: cut(&b.inputs, true)?,
            labels: cut(
                &b.labels,
                !self.target_side_labels && seq_aligned(&b.labels),
            )?,
            attention_mask: opt(&b.attention_mask)?,
            token_type_ids: opt(&b.token_type_ids)?,
            decoder_input_ids: b
                .decoder_input_ids
                .as_ref()
                .map(|t| cut(t, false))
                .transpose()?,
        })
    }

    /// Whether a run of `steps` steps on rows `rows` × `seq` shows the target first. A
    /// batch the model refuses does not.
    fn fails(&mut self, rows: &[usize], seq: usize, steps: u64) -> Result<bool> {
        if self.runs >= self.max_runs {
            self.hit_limit = true;
            return Ok(false);
        }
        self.runs += 1;
        let batch = self.slice(rows, seq)?;
        let found = match first_failure(self.cfg, &self.train, batch, steps) {
            Ok(f) => f.is_some_and(|(_, t)| t == self.target),
            Err(Error::Io { path, source }) => return Err(Error::Io { path, source }),
            Err(_) => false,
        };
        if found {
            // (the search only tries what is no larger than what failed before)
            self.best = (rows.len(), seq, steps);
        }
        (self.on_run)(Progress {
            runs: self.runs,
            rows: self.best.0,
            seq: self.best.1,
            steps: self.best.2,
        });
        Ok(found)
    }

    /// The fewest steps, up to `max`, after which rows × seq shows the target.
    fn fewest_steps(&mut self, rows: &[usize], seq: usize, max: u64) -> Result<Option<u64>> {
        for n in 1..=max {
            if self.fails(rows, seq, n)? {
                return Ok(Some(n));
            }
        }
        Ok(None)
    }

    /// Delta debugging (Zeller's ddmin) over the rows: a subset that fails, from which no
    /// single row can be left out.
    fn ddmin_rows(&mut self, mut rows: Vec<usize>, seq: usize, steps: u64) -> Result<Vec<usize>> {
        let mut n = 2usize;
        while rows.len() >= 2 {
            let chunk = rows.len().div_ceil(n);
            let parts: Vec<Vec<usize>> = rows.chunks(chunk).map(<[usize]>::to_vec).collect();
            let mut reduced = false;
            for p in &parts {
                if self.fails(p, seq, steps)? {
                    rows = p.clone();
                    n = 2;
                    reduced = true;
                    break;
                }
            }
            if !reduced && parts.len() > 2 {
                for i in 0..parts.len() {
                    let rest: Vec<usize> = parts
                        .iter()
                        .enumerate()
                        .filter(|(j, _)| *j != i)
                        .flat_map(|(_, p)| p.iter().copied())
                        .collect();
                    if self.fails(&rest, seq, steps)? {
                        rows = rest;
                        n = (n - 1).max(2);
                        reduced = true;
                        break;
                    }
                }
            }
            if !reduced {
                if n >= rows.len() {
                    break;
                }
                n = (2 * n).min(rows.len());
            }
            if self.hit_limit {
                break;
            }
        }
        Ok(rows)
    }

    /// The shortest prefix that fails: a bisection, then one position at a time, so that
    /// one position fewer does not fail.
    fn shortest_prefix(&mut self, rows: &[usize], mut seq: usize, steps: u64) -> Result<usize> {
        let (mut lo, mut hi) = (1usize, seq);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if self.fails(rows, mid, steps)? {
                hi = mid;
            } else {
                lo = mid + 1;
            }
        }
        seq = hi;
        while seq > 1 && self.fails(rows, seq - 1, steps)? {
            seq -= 1;
        }
        Ok(seq)
    }
}

/// Runs `steps` steps of `cfg`'s model on `batch` every step and returns the first step
/// with an Inf/NaN origin and where it was.
fn first_failure(
    cfg: &RunConfig,
    train: &TrainConfig,
    batch: Batch,
    steps: u64,
) -> Result<Option<(u64, Target)>> {
    let (model, params, _) = build(cfg, train)?;
    let mut t = Trainer::new(train.clone(), model, params, Box::new(FixedBatch(batch)))?;
    for s in 0..steps {
        let rec = t.step(s)?;
        if let Some(o) = first_origin(&rec) {
            return Ok(Some((s, o)));
        }
    }
    Ok(None)
}

/// Shrinks the batch of `cfg`'s first failing step (see the module docs). `on_run` hears
/// of every candidate run.
pub fn shrink(
    cfg: &RunConfig,
    opts: ShrinkOptions,
    on_run: &mut dyn FnMut(Progress),
) -> Result<Shrunk> {
    let mut train = cfg.train_config()?;
    // (the host's step: a device's would be re-checked against it for every candidate)
    train.backend = crate::backend::BackendKind::Cpu;
    if train.accumulate != 1 {
        return Err(Error::config(
            "train.accumulate",
            format!(
                "shrink cuts the one batch of a step ({} micro-batches here): run it with \
                 --accumulate 1",
                train.accumulate
            ),
        ));
    }
    let steps = cfg.steps();
    let (model, params, mut data) = build(cfg, &train)?;
    let probe = model.prepare_batch(data.batch(0, 0)?)?;
    let target_side_labels = probe.decoder_input_ids.is_some();
    if probe.inputs.dtype() != crate::DType::I64 || probe.inputs.rank() != 2 {
        return Err(Error::Invalid(format!(
            "shrink cuts token batches (int64 [batch, seq] input ids); this model's inputs are \
             {} {:?}",
            probe.inputs.dtype(),
            probe.inputs.shape()
        )));
    }
    let mut t = Trainer::new(train.clone(), model, params, data)?;
    let mut found = None;
    for s in 0..steps {
        let rec = t.step(s)?;
        if let Some(o) = first_origin(&rec) {
            found = Some((s, o));
            break;
        }
    }
    let Some((k, target)) = found else {
        return Err(Error::Invalid(format!(
            "no Inf or NaN in {steps} step(s): nothing to shrink"
        )));
    };
    // The batch of the failing step, from a fresh data source (the trainer's has moved on).
    let (_, _, mut data) = build(cfg, &train)?;
    let base = data.batch(k, 0)?;
    let (b, s) = (base.inputs.shape()[0], base.inputs.shape()[1]);
    let mut search = Search {
        cfg,
        train,
        base,
        target_side_labels,
        target: target.clone(),
        runs: 0,
        max_runs: opts.max_runs,
        hit_limit: false,
        on_run,
        best: (b, s, k + 1),
    };
    let mut rows: Vec<usize> = (0..b).collect();
    let mut seq = s;
    let Some(mut n) = search.fewest_steps(&rows, seq, k + 1)? else {
        return Err(Error::Invalid(format!(
            "the {} of step {k} does not show when step {k}'s batch is used from the first \
             step on (the batches of the steps before it are part of the failure): shrink \
             needs a failure one batch reproduces",
            target.describe()
        )));
    };
    loop {
        let before = (rows.len(), seq, n);
        rows = search.ddmin_rows(rows, seq, n)?;
        seq = search.shortest_prefix(&rows, seq, n)?;
        if n > 1 {
            if let Some(m) = search.fewest_steps(&rows, seq, n - 1)? {
                n = m;
            }
        }
        if (rows.len(), seq, n) == before || search.hit_limit {
            break;
        }
    }
    let batch = search.slice(&rows, seq)?;
    Ok(Shrunk {
        target,
        original_step: k,
        original_shape: (b, s),
        batch,
        rows,
        seq,
        steps: n,
        runs: search.runs,
        hit_limit: search.hit_limit,
    })
}

/// Writes a batch as an `--inputs` file (`input_ids`, `labels`, and the masks and decoder
/// inputs it has).
pub fn write_inputs(batch: &Batch, path: &Path) -> Result<()> {
    let mut t = vec![
        ("input_ids".to_string(), batch.inputs.clone()),
        ("labels".to_string(), batch.labels.clone()),
    ];
    for (name, x) in [
        ("attention_mask", &batch.attention_mask),
        ("token_type_ids", &batch.token_type_ids),
        ("decoder_input_ids", &batch.decoder_input_ids),
    ] {
        if let Some(x) = x {
            t.push((name.to_string(), x.clone()));
        }
    }
    crate::models::weights::save_safetensors(path, &t)
}
