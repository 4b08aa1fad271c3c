//! The step engine: forward under the autocast policy, loss, loss scaling, backward,
//! unscale, clipping, optimizer step and scale update, with probes on every op.

use crate::amp::mode::Precision;
use crate::amp::policy::{DeviceType, PolicyTable};
use crate::amp::scaler::{GradScaler, ScalerConfig, StepDecision, UpdateOutcome};
use crate::backend::BackendKind;
use crate::dtype::DType;
use crate::engine::{Autocast, Engine, Injection};
use crate::error::{Error, Result};
use crate::models::{Batch, Model, Output as ForwardOutput, ParamAccess, ParamStore};
use crate::optim::clip::{ClipOutcome, NormType};
use crate::optim::{build_optimizer, Optimizer, OptimizerConfig};
use crate::probe::recorder::Recorder;
use crate::tensor::Tensor;
use crate::trace::record::{ParamRecord, StepRecord};
use grads::{ParamRef, StepGrads};
use serde::{Deserialize, Serialize};
use std::time::Instant;

pub mod confirm;
mod device;
mod grads;

/// When full op records are kept for a step. A step that keeps none by schedule only checks
/// its ops' outputs for non-finite values, and completes their statistics if it turns out to
/// keep them for one ([`Trainer::set_full_statistics`]): the records are the same either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpSampling {
    /// Keep every op of every `every`-th step (0: never by schedule).
    pub every: u64,
    /// Keep every op of the first step.
    pub first: bool,
    /// Keep every op of any step in which a value was non-finite.
    pub nonfinite: bool,
}

impl Default for OpSampling {
    fn default() -> Self {
        OpSampling {
            every: 0,
            first: true,
            nonfinite: true,
        }
    }
}

/// Everything the step engine needs besides the model, its parameters and data.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrainConfig {
    /// Precision mode.
    pub precision: Precision,
    /// Micro-batches per optimizer step (gradient accumulation; the loss is divided by it).
    pub accumulate: u32,
    /// Clip the total gradient norm to this value after unscaling.
    #[serde(serialize_with = "crate::trace::float_json::f32_exact::option::serialize")]
    pub clip: Option<f32>,
    /// Norm used for clipping.
    pub clip_norm: NormType,
    /// Optimizer.
    pub optimizer: OptimizerConfig,
    /// Loss scaler.
    pub scaler: ScalerConfig,
    /// Autocast policy table (target device type).
    pub policy: DeviceType,
    /// Seed (dropout, synthetic data).
    pub seed: u64,
    /// Module path patterns kept in fp32.
    pub keep_fp32: Vec<String>,
    /// Probes on or off.
    pub probes: bool,
    /// Which steps keep full op records.
    pub sampling: OpSampling,
    /// The backend the step runs on (resolved from the user's choice by the runner).
    pub backend: BackendKind,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            precision: Precision::Fp32,
            accumulate: 1,
            clip: None,
            clip_norm: NormType::L2,
            optimizer: OptimizerConfig::default(),
            scaler: ScalerConfig::default(),
            policy: DeviceType::Cuda,
            seed: 0,
            keep_fp32: Vec::new(),
            probes: true,
            sampling: OpSampling::default(),
            backend: BackendKind::Cpu,
        }
    }
}

/// Supplies the batch of each step and micro-batch.
pub trait DataSource: Send {
    /// The batch for `step`, micro-batch `micro`.
    fn batch(&mut self, step: u64, micro: u32) -> Result<Batch>;
}

/// The same batch every step.
pub struct FixedBatch(pub Batch);

impl DataSource for FixedBatch {
    fn batch(&mut self, _step: u64, _micro: u32) -> Result<Batch> {
        Ok(self.0.clone())
    }
}

/// A seeded generator of batches.
pub struct Synthetic<F: FnMut(u64, u32) -> Result<Batch> + Send>(pub F);

impl<F: FnMut(u64, u32) -> Result<Batch> + Send> DataSource for Synthetic<F> {
    fn batch(&mut self, step: u64, micro: u32) -> Result<Batch> {
        (self.0)(step, micro)
    }
}

/// Runs training steps of one model.
pub struct Trainer {
    cfg: TrainConfig,
    model: Box<dyn Model>,
    params: ParamStore,
    optimizer: Box<dyn Optimizer>,
    scaler: GradScaler,
    engine: Engine,
    data: Box<dyn DataSource>,
    last_grads: Vec<Option<Tensor>>,
    before: Option<StepInputs>,
    outputs: Vec<StepOutput>,
    injections: Vec<Injection>,
    told: Told,
    /// The device side when the step runs on a CUDA device.
    device: Option<device::DeviceSide>,
    /// Every step gets full op statistics ([`Trainer::set_full_statistics`]).
    full_statistics: bool,
    /// The last step kept its records for a non-finite value.
    last_kept_nonfinite: bool,
    /// The last step began by only checking its outputs ([`Trainer::last_step_checked_only`]).
    last_checked_only: bool,
}

/// Scale states already told in a step's events (each is told once per run).
#[derive(Debug, Clone, Copy, Default)]
struct Told {
    scale_zero: bool,
    inv_scale_infinite: bool,
    /// How many of the scaler's warnings (which it keeps, in order) have been told.
    scaler_warnings: usize,
}

/// What a step started from: the parameters, the scale and the batches it used.
#[derive(Clone)]
struct StepInputs {
    step: u64,
    params: ParamStore,
    scale: f32,
    batches: Vec<Batch>,
}

/// What the phases of one step hand to each other.
struct StepState {
    t0: Instant,
    step: u64,
    /// Gradients summed over the micro-batches so far.
    grads: Vec<Option<Tensor>>,
    loss_sum: f64,
    scaled_loss: Option<f64>,
    scale_before: f32,
    weight_casts: u64,
    /// What a replay of the step needs (handed to the trainer once the gradients are in).
    inputs: Option<StepInputs>,
    clip: Option<ClipOutcome>,
    events: Vec<String>,
}

/// The loss and final hidden state of one micro-batch (for accuracy comparisons).
#[derive(Debug, Clone)]
pub struct StepOutput {
    /// Unscaled loss.
    pub loss: f64,
    /// The model's final hidden state.
    pub hidden: Tensor,
}

/// A different precision recipe for re-running a step from the same weights and data.
#[derive(Debug, Clone, Default)]
pub struct Variant {
    /// Precision mode (None: the trainer's).
    pub precision: Option<Precision>,
    /// Module patterns kept in fp32 (None: the trainer's).
    pub keep_fp32: Option<Vec<String>>,
    /// Loss scale for the step (None: the scale the step used).
    pub scale: Option<f32>,
    /// transformers' fp16 clamp (None: the model's setting).
    pub clamp: Option<bool>,
    /// The model's fp16 switches to turn on ([`crate::models::Model::fp16_switches`]).
    pub switches: Vec<String>,
    /// Probes on or off (None: the trainer's).
    pub probes: Option<bool>,
}

/// A step re-run under a [`Variant`].
pub struct Replay {
    /// Its record (op records always kept).
    pub record: StepRecord,
    /// Loss and hidden state per micro-batch.
    pub outputs: Vec<StepOutput>,
}

struct Replayed(Vec<Batch>);

impl DataSource for Replayed {
    fn batch(&mut self, _step: u64, micro: u32) -> Result<Batch> {
        self.0
            .get(micro as usize)
            .cloned()
            .ok_or_else(|| Error::Invalid(format!("no recorded batch for micro-batch {micro}")))
    }
}

impl Trainer {
    /// A trainer; parameters are converted to the mode's parameter dtype.
    pub fn new(
        cfg: TrainConfig,
        model: Box<dyn Model>,
        mut params: ParamStore,
        data: Box<dyn DataSource>,
    ) -> Result<Trainer> {
        if cfg.accumulate == 0 {
            return Err(Error::config("accumulate", "must be at least 1"));
        }
        let kept = |p: &crate::models::Param| {
            cfg.keep_fp32
                .iter()
                .any(|pat| crate::engine::module_matches(pat, &p.module))
        };
        params.convert(cfg.precision.param_dtype(), kept)?;
        let optimizer = build_optimizer(&cfg.optimizer)?;
        let scaler = GradScaler::new(cfg.scaler.clone())?;
        let device = match cfg.backend {
            BackendKind::Cpu => None,
            BackendKind::Cuda => {
                let dev = crate::backend::open_device(0, false)?;
                for p in &mut params.params {
                    p.value = p.value.to_device(&dev)?.as_leaf(true);
                }
                Some(device::DeviceSide::new(dev, &scaler, &cfg.optimizer)?)
            }
        };
        let mut engine = Engine::new();
        engine.set_seed(cfg.seed);
        engine.set_keep_fp32(cfg.keep_fp32.clone());
        if let Some(d) = cfg.precision.autocast_dtype() {
            engine.set_autocast(Some(Autocast {
                dtype: d,
                table: PolicyTable::for_device(cfg.policy),
            }));
        }
        if cfg.probes {
            // On the host, the statistics of long outputs are gathered by jobs that rayon's
            // threads take while they would wait; the step resolves them before its record.
            let recorder = match device {
                None => Recorder::new().in_background(),
                Some(_) => Recorder::new(),
            };
            engine.add_observer(Box::new(recorder));
        }
        let n = params.params.len();
        Ok(Trainer {
            cfg,
            model,
            params,
            optimizer,
            scaler,
            engine,
            data,
            last_grads: vec![None; n],
            before: None,
            outputs: Vec::new(),
            injections: Vec::new(),
            told: Told::default(),
            device,
            full_statistics: false,
            last_kept_nonfinite: false,
            last_checked_only: false,
        })
    }

    /// Whether every step computes the full statistics of every op (true), or only
    /// a step that keeps its op records by the sampling's schedule does (false, the
    /// default). In a step the schedule does not keep, outputs are then only checked for
    /// non-finite values (by the ops as they write them where they can:
    /// [`crate::engine::FiniteChecks`]), which is all its record holds of them (origins,
    /// the op count). If the step turns out to keep its records for a non-finite value,
    /// the forward and backward ops' statistics come from a re-run of the step with full
    /// statistics ([`Trainer::replay`]), checked op by op against the step, and the
    /// optimizer phase's from its outputs, held until the step ends
    /// ([`Recorder::complete_from`]). So records, origins and every result are the same
    /// either way; only the cost differs. A step right after one kept for a non-finite
    /// value computes them at once, since such steps come in runs (a falling loss scale).
    /// On a device the same holds: the kernels that write a forward or backward op's
    /// output (or the probe arena's own pass) then count only its non-finite values
    /// ([`crate::device::cuda::arena::StatsArena::set_check_only`]); the optimizer phase
    /// always gathers full statistics there, so a re-run completes the forward and
    /// backward ops alone.
    pub fn set_full_statistics(&mut self, on: bool) {
        self.full_statistics = on;
    }

    /// Whether the last step began by only checking its forward and backward outputs for
    /// non-finite values ([`Trainer::set_full_statistics`]); its records, if it kept them,
    /// were then completed from a re-run.
    pub fn last_step_checked_only(&self) -> bool {
        self.last_checked_only
    }

    /// The configuration.
    pub fn config(&self) -> &TrainConfig {
        &self.cfg
    }
    /// The parameters.
    pub fn params(&self) -> &ParamStore {
        &self.params
    }
    /// The model.
    pub fn model(&self) -> &dyn Model {
        self.model.as_ref()
    }
    /// The loss scaler.
    pub fn scaler(&self) -> &GradScaler {
        &self.scaler
    }
    /// The unscaled gradients of the last step, by parameter (None: no gradient).
    pub fn last_grads(&self) -> &[Option<Tensor>] {
        &self.last_grads
    }
    /// Loss and final hidden state of each micro-batch of the last step.
    pub fn last_outputs(&self) -> &[StepOutput] {
        &self.outputs
    }

    /// Re-runs the last step from the weights, loss scale and batches it started from,
    /// under another precision recipe; this trainer's state is untouched.
    pub fn replay(&self, v: &Variant) -> Result<Replay> {
        let b = self
            .before
            .as_ref()
            .ok_or_else(|| Error::Invalid("no step to re-run yet".into()))?;
        let mut cfg = self.cfg.clone();
        if let Some(p) = v.precision {
            cfg.precision = p;
        }
        if let Some(k) = &v.keep_fp32 {
            cfg.keep_fp32 = k.clone();
        }
        if let Some(p) = v.probes {
            cfg.probes = p;
        }
        cfg.scaler.init_scale = v.scale.unwrap_or(b.scale);
        cfg.sampling = OpSampling {
            every: 1,
            first: true,
            nonfinite: true,
        };
        let mut model = self.model.clone_model();
        if let Some(c) = v.clamp {
            if !model.set_clamp(c) && c {
                return Err(Error::Invalid(format!(
                    "{} has no fp16 clamp",
                    model.describe()
                )));
            }
        }
        for s in &v.switches {
            if !model.set_switch(s, true) {
                return Err(Error::Invalid(format!(
                    "{} has no fp16 switch `{s}`",
                    model.describe()
                )));
            }
        }
        let mut params = b.params.clone();
        params.convert(DType::F32, |_| false)?;
        let mut t = Trainer::new(cfg, model, params, Box::new(Replayed(b.batches.clone())))?;
        // Injections stand for faults in the step itself (data, kernels): they recur in
        // every recipe of the same step.
        for inj in &self.injections {
            t.inject(inj.clone());
        }
        let record = t.step(b.step)?;
        Ok(Replay {
            record,
            outputs: t.outputs,
        })
    }

    /// Adds an observer: it sees every op of every step from now on, beside the probes.
    pub fn add_observer(&mut self, obs: Box<dyn crate::engine::observer::Observer>) {
        self.engine.add_observer(obs);
    }

    /// Adds an injection (test hook: writes a value into a chosen op's output).
    pub fn inject(&mut self, inj: Injection) {
        self.injections.push(inj.clone());
        self.engine.add_injection(inj);
    }

    /// How many values the probes computed statistics from in the last step
    /// ([`Recorder::scanned_values`]); 0 without probes. Device outputs are not counted:
    /// their statistics come from the device's kernels.
    pub fn scanned_values(&mut self) -> u64 {
        self.recorder().map_or(0, |r| r.scanned_values())
    }

    /// How many values the probes only checked for non-finite values in the last step
    /// ([`Recorder::checked_values`], [`Trainer::set_full_statistics`]); 0 without probes.
    pub fn checked_values(&mut self) -> u64 {
        self.recorder().map_or(0, |r| r.checked_values())
    }

    /// Whether the sampling keeps every op record of `step` by its schedule.
    fn scheduled(&self, step: u64) -> bool {
        let s = self.cfg.sampling;
        (s.first && step == 0) || (s.every > 0 && step % s.every == 0)
    }

    fn recorder(&mut self) -> Option<&mut Recorder> {
        self.engine
            .observers_mut()
            .iter_mut()
            .find_map(|o| o.as_any_mut().downcast_mut::<Recorder>())
    }

    /// Runs one optimizer step (all its micro-batches) and returns its record: per
    /// micro-batch forward, loss, scale and backward; then unscale, clip, the optimizer step
    /// and the scale update, each a phase of its own.
    pub fn step(&mut self, step: u64) -> Result<StepRecord> {
        if self.device.is_some() {
            return self.device_step(step);
        }
        // The host step runs on one of rayon's threads, so that each op's parallel loop
        // starts on the thread that reaches it instead of handing the work to the pool and
        // sleeping until a pool thread has picked it up (hundreds of hand-offs a step).
        rayon::scope(|_| self.host_step(step))
    }

    /// [`Trainer::step`] on the host backend.
    fn host_step(&mut self, step: u64) -> Result<StepRecord> {
        let mut st = self.begin(step);
        // A step that only checks its outputs for non-finite values has the ops check
        // them as they write them, where they can, instead of the probe reading them again.
        let _checks = crate::engine::FiniteChecks::set(self.last_checked_only);
        for micro in 0..self.cfg.accumulate {
            let out = self.forward(&mut st, micro)?;
            let loss = self.loss(&mut st, out)?;
            let root = self.scale(&mut st, loss)?;
            self.backward(&mut st, &root)?;
        }
        let mut grads = self.gradient_buffers(&mut st)?;
        if let Some(max_norm) = self.cfg.clip {
            self.unscale(&mut grads)?;
            self.clip(&mut st, &mut grads, max_norm)?;
        }
        let decision = self.check(&mut grads)?;
        if !decision.skip {
            self.optimizer_step(&grads)?;
        }
        let upd = self.update(&mut st)?;
        self.finish(st, grads, decision, upd)
    }

    /// Starts a step: the scale it begins with and what a replay needs.
    fn begin(&mut self, step: u64) -> StepState {
        self.engine.begin_step(step);
        let check_only =
            !self.full_statistics && !self.last_kept_nonfinite && !self.scheduled(step);
        self.last_checked_only = false;
        if check_only {
            if let Some(r) = self.recorder() {
                r.check_only();
                self.last_checked_only = true;
            }
        }
        self.outputs.clear();
        let scale_before = self.scaler.scale();
        StepState {
            t0: Instant::now(),
            step,
            grads: vec![None; self.params.params.len()],
            loss_sum: 0.0,
            scaled_loss: None,
            scale_before,
            weight_casts: 0,
            inputs: Some(StepInputs {
                step,
                params: self.params.clone(),
                scale: scale_before,
                batches: Vec::new(),
            }),
            clip: None,
            events: Vec::new(),
        }
    }

    /// Forward: the model on micro-batch `micro`, under the precision mode's casts.
    fn forward(&mut self, st: &mut StepState, micro: u32) -> Result<ForwardOutput> {
        self.engine.begin_micro(micro);
        let batch = self.data.batch(st.step, micro)?;
        // Replays feed the recorded batch through here again: it is kept as the data
        // source gave it, before the model's preparation.
        if let Some(inputs) = &mut st.inputs {
            inputs.batches.push(batch.clone());
        }
        let batch = self.model.prepare_batch(batch)?;
        let batch = match self.device {
            Some(_) => self.batch_to_device(&batch)?,
            None => batch,
        };
        let access = ParamAccess::new(&self.params, self.cfg.precision);
        self.model.forward(&mut self.engine, &access, &batch)
    }

    /// Loss: kept for the record, divided by the micro-batch count when accumulating.
    fn loss(&mut self, st: &mut StepState, out: ForwardOutput) -> Result<Tensor> {
        let mut loss = out.loss;
        let value = loss.item()?;
        st.loss_sum += value;
        self.outputs.push(StepOutput {
            loss: value,
            hidden: out.hidden,
        });
        let accumulate = self.cfg.accumulate;
        if accumulate > 1 {
            let d = divisor(accumulate, loss.dtype())?;
            loss = self.engine.scope("loss", |e| e.div(&loss, &d))?;
        }
        Ok(loss)
    }

    /// Scale: the loss times the loss scale, when scaling is on.
    fn scale(&mut self, st: &mut StepState, loss: Tensor) -> Result<Tensor> {
        if !self.scaler.is_enabled() {
            return Ok(loss);
        }
        let s = Tensor::from_exact(vec![self.scaler.scale()], &[1], DType::F32)?;
        let scaled = self.engine.scope("scaler", |e| e.mul(&loss, &s))?;
        st.scaled_loss = Some(scaled.item()?);
        Ok(scaled)
    }

    /// Backward: gradients of the parameters, summed over micro-batches.
    fn backward(&mut self, st: &mut StepState, root: &Tensor) -> Result<()> {
        st.weight_casts += self.engine.take_weight_casts();
        let g = self.engine.backward(root)?;
        for (i, p) in self.params.params.iter().enumerate() {
            if let Some(gi) = g.get(&p.value.id()) {
                st.grads[i] = Some(match st.grads[i].take() {
                    Some(prev) => prev.add_same(gi, "accumulate_grad")?.0,
                    None => gi.clone(),
                });
            }
        }
        Ok(())
    }

    /// The step's gradients for the scaler, clipping and the optimizer, on the backend
    /// that holds them.
    fn gradient_buffers(&mut self, st: &mut StepState) -> Result<StepGrads> {
        self.before = st.inputs.take();
        StepGrads::new(&st.grads)
    }

    /// Unscale (before clipping): gradients divided by the scale, Inf/NaN noted.
    fn unscale(&mut self, grads: &mut StepGrads) -> Result<()> {
        let names = self.param_names();
        grads.unscale(
            &mut self.scaler,
            &names.iter().map(String::as_str).collect::<Vec<_>>(),
        )?;
        self.emit_grads("unscale", grads)
    }

    /// Clip: the gradients' total norm brought to at most `max_norm`.
    fn clip(&mut self, st: &mut StepState, grads: &mut StepGrads, max_norm: f32) -> Result<()> {
        let names = self.param_names();
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        let c = grads.clip(&names, max_norm, self.cfg.clip_norm)?;
        if c.nonfinite {
            st.events.push(format!(
                "clip_grad_norm: total norm is {} (non-finite); gradients were multiplied by {}",
                c.total_norm, c.clip_coef
            ));
        }
        st.clip = Some(c);
        self.emit_grads("clip_grad_norm", grads)
    }

    /// The scaler's decision: skip on an Inf/NaN gradient, else unscale (if not yet done).
    fn check(&mut self, grads: &mut StepGrads) -> Result<StepDecision> {
        let names = self.param_names();
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        let decision = grads.check(&mut self.scaler, &names)?;
        if decision.unscaled_here {
            self.emit_grads("unscale", grads)?;
        }
        Ok(decision)
    }

    /// Step: the optimizer updates the parameters from the unscaled gradients.
    fn optimizer_step(&mut self, grads: &StepGrads) -> Result<()> {
        let new = {
            let refs: Vec<ParamRef<'_>> = self
                .params
                .params
                .iter()
                .map(|p| ParamRef {
                    name: &p.name,
                    value: &p.value,
                })
                .collect();
            grads.step(self.optimizer.as_mut(), &refs)?
        };
        for (p, nv) in self.params.params.iter_mut().zip(new) {
            let old = std::mem::replace(&mut p.value, nv);
            let (m, nv) = (p.module.clone(), p.value.clone());
            self.engine
                .emit_optimizer_op("optimizer_step", &m, &[&old], &nv);
        }
        Ok(())
    }

    /// Update: the scaler's new scale, and its events.
    fn update(&mut self, st: &mut StepState) -> Result<UpdateOutcome> {
        let upd = self.scaler.update(None)?;
        // A falling or sub-1 scale is the diagnosis' finding (one event, with the fall);
        // the trainer tells, once each, the two states that corrupt the step itself.
        if let Some(c) = &upd.collapse {
            if c.zero && !self.told.scale_zero {
                self.told.scale_zero = true;
                st.events.push(
                    "scale collapse: the loss scale reached 0; the loss and every gradient \
                     become 0, and unscaling multiplies by an infinite inverse scale"
                        .to_string(),
                );
            } else if c.inv_scale_infinite && !c.zero && !self.told.inv_scale_infinite {
                self.told.inv_scale_infinite = true;
                st.events.push(format!(
                    "scale collapse: the loss scale {:e} is so small that 1/scale overflows \
                     f32; unscaled gradients become inf/NaN after the inf check, and the step \
                     is not skipped",
                    c.scale
                ));
            }
        }
        for w in
            &self.scaler.warnings()[self.told.scaler_warnings.min(self.scaler.warnings().len())..]
        {
            if !st.events.contains(w) {
                st.events.push(w.clone());
            }
        }
        self.told.scaler_warnings = self.scaler.warnings().len();
        Ok(upd)
    }

    /// The step's record: per-parameter records from the unscaled gradients, the op
    /// records the sampling keeps, the origins.
    fn finish(
        &mut self,
        st: StepState,
        mut grads: StepGrads,
        decision: StepDecision,
        upd: UpdateOutcome,
    ) -> Result<StepRecord> {
        let records = grads.records(&self.params.params, st.scale_before)?;
        for (i, p) in self.params.params.iter().enumerate() {
            if records[i].is_some() {
                self.last_grads[i] = grads.take_tensor(i, p.value.shape())?;
            }
        }
        self.record_step(st, records, decision, upd)
    }

    /// The step's record from its parameter records (None: no gradient), the op records
    /// the sampling keeps and the origins.
    fn record_step(
        &mut self,
        st: StepState,
        records: Vec<Option<ParamRecord>>,
        decision: StepDecision,
        upd: UpdateOutcome,
    ) -> Result<StepRecord> {
        let mut params_rec = Vec::new();
        let mut sum_sq = 0f64;
        let mut any_grad = false;
        for rec in records.into_iter().flatten() {
            any_grad = true;
            sum_sq += if rec.nonfinite > 0 {
                f64::INFINITY
            } else {
                rec.grad_l2 * rec.grad_l2
            };
            params_rec.push(rec);
        }
        let grad_norm = match st.clip {
            Some(c) => Some(c.total_norm as f64),
            None if any_grad => Some(sum_sq.sqrt()),
            None => None,
        };
        let step = st.step;
        let scheduled = self.scheduled(step);
        let kept_nonfinite =
            self.cfg.sampling.nonfinite && self.recorder().is_some_and(|r| r.saw_nonfinite());
        self.last_kept_nonfinite = kept_nonfinite;
        if kept_nonfinite && self.recorder().is_some_and(|r| r.is_check_only()) {
            self.complete_statistics()?;
        }
        let (origins, ops, op_count) = match self.recorder() {
            Some(r) => {
                let keep = scheduled || kept_nonfinite;
                let origins = r.origins();
                let count = r.ops().len() as u64;
                (origins, if keep { Some(r.take_ops()) } else { None }, count)
            }
            None => (Default::default(), None, 0),
        };
        let accumulate = self.cfg.accumulate;
        Ok(StepRecord {
            step,
            micro_batches: accumulate,
            loss: Some(st.loss_sum / accumulate as f64),
            scaled_loss: st.scaled_loss,
            scale_before: upd.scale_before as f64,
            scale_after: upd.scale_after as f64,
            found_inf: upd.found_inf || decision.found_inf,
            skipped: decision.skip,
            growth_tracker: upd.growth_tracker as i64,
            grad_norm,
            clip_coef: st.clip.map(|c| c.clip_coef as f64),
            lr: self.optimizer.lr_f64(),
            weight_casts: st.weight_casts,
            origins,
            params: params_rec,
            ops,
            op_count,
            events: st.events,
            wall_ms: st.t0.elapsed().as_secs_f64() * 1e3,
            skip_cause: None,
        })
    }

    /// The full statistics of a step recorded in the check-only mode, from a re-run of
    /// it (the same weights, scale, batches and injections) with full statistics.
    fn complete_statistics(&mut self) -> Result<()> {
        let full = self.replay(&Variant::default())?.record.ops;
        match self.recorder() {
            Some(r) => r.complete_from(full.as_deref().unwrap_or_default()),
            None => Ok(()),
        }
    }

    fn param_names(&self) -> Vec<String> {
        self.params.params.iter().map(|p| p.name.clone()).collect()
    }

    fn emit_grads(&mut self, op: &'static str, grads: &StepGrads) -> Result<()> {
        if !self.engine.probing() {
            return Ok(());
        }
        for (i, p) in self.params.params.iter().enumerate() {
            if let Some(t) = grads.tensor(i, p.value.shape())? {
                let m = p.module.clone();
                self.engine.emit_optimizer_op(op, &m, &[], &t);
            }
        }
        Ok(())
    }
}

fn divisor(n: u32, dtype: DType) -> Result<Tensor> {
    match dtype {
        DType::F64 => Tensor::from_f64(vec![n as f64], &[]),
        d => Tensor::from_f32(vec![n as f32], &[], d),
    }
}
