//! The trainer: a model, its parameters, optimizer, loss scaler and data, and the phases
//! of a step that do not depend on the backend (the forward, the backward, the scale update
//! and the record). Layer 9 (train) like the rest of `train/`; uses everything below it.

use super::config::TrainConfig;
use super::data::DataSource;
use super::device_state::DeviceState;
use super::grad_blame::GradBlame;
use crate::amp::policy::PolicyTable;
use crate::amp::scaler::{GradScaler, UpdateOutcome};
use crate::backend::BackendKind;
use crate::device::cuda::CudaDevice;
use crate::dtype::DType;
use crate::engine::{Autocast, Engine, Injection};
use crate::error::{Error, Result};
use crate::models::{Batch, Model, Output as ForwardOutput, ParamAccess, ParamStore};
use crate::optim::build_optimizer;
use crate::optim::clip::ClipOutcome;
use crate::optim::Optimizer;
use crate::probe::recorder::Recorder;
use crate::tensor::Tensor;
use std::sync::Arc;
use std::time::Instant;

/// Runs training steps of one model.
pub struct Trainer {
    pub(super) cfg: TrainConfig,
    pub(super) model: Box<dyn Model>,
    pub(super) params: ParamStore,
    pub(super) optimizer: Box<dyn Optimizer>,
    pub(super) scaler: GradScaler,
    pub(super) engine: Engine,
    pub(super) data: Box<dyn DataSource>,
    pub(super) last_grads: Vec<Option<Tensor>>,
    pub(super) before: Option<StepInputs>,
    pub(super) outputs: Vec<StepOutput>,
    pub(super) injections: Vec<Injection>,
    pub(super) told: Told,
    /// The device side when the step runs on a CUDA device.
    pub(super) device: Option<DeviceState>,
    /// Every step gets full op statistics ([`Trainer::set_full_statistics`]).
    pub(super) full_statistics: bool,
    /// The last step kept its records for a non-finite value.
    pub(super) last_kept_nonfinite: bool,
    /// The last step began by only checking its outputs ([`Trainer::last_step_checked_only`]).
    pub(super) last_checked_only: bool,
    /// The step being run blames its forward and backward ops (its records are kept, `cfg.blame`).
    pub(super) blame_step: bool,
    /// In a blamed step's optimizer phase: the gradients and their shadows, for the blame
    /// of unscale and clipping.
    pub(super) grad_blame: Option<GradBlame>,
}

/// Scale states already told in a step's events (each is told once per run).
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Told {
    scale_zero: bool,
    inv_scale_infinite: bool,
    /// How many of the scaler's warnings (which it keeps, in order) have been told.
    scaler_warnings: usize,
}

/// What a step started from: the parameters, the scale and the batches it used.
#[derive(Clone)]
pub(super) struct StepInputs {
    pub(super) step: u64,
    pub(super) params: ParamStore,
    pub(super) scale: f32,
    pub(super) batches: Vec<Batch>,
}

/// What the phases of one step hand to each other.
pub(super) struct StepState {
    pub(super) t0: Instant,
    pub(super) step: u64,
    /// Gradients summed over the micro-batches so far.
    pub(super) grads: Vec<Option<Tensor>>,
    /// In a blamed step: their all-f64 shadows, summed likewise.
    pub(super) grad_shadows: Vec<Option<Tensor>>,
    pub(super) loss_sum: f64,
    pub(super) scaled_loss: Option<f64>,
    pub(super) scale_before: f32,
    pub(super) weight_casts: u64,
    /// What a replay of the step needs (handed to the trainer once the gradients are in).
    pub(super) inputs: Option<StepInputs>,
    pub(super) clip: Option<ClipOutcome>,
    pub(super) events: Vec<String>,
}

/// The loss and final hidden state of one micro-batch (for accuracy comparisons).
#[derive(Debug, Clone)]
pub struct StepOutput {
    /// Unscaled loss.
    pub loss: f64,
    /// The model's final hidden state.
    pub hidden: Tensor,
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
        if cfg.blame && !cfg.probes {
            return Err(Error::config(
                "probe.blame",
                "blame reports through the probes: it needs them on",
            ));
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
                Some(DeviceState::new(dev, &scaler, &cfg.optimizer)?)
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
            blame_step: false,
            grad_blame: None,
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
    pub(super) fn scheduled(&self, step: u64) -> bool {
        let s = self.cfg.sampling;
        (s.first && step == 0) || (s.every > 0 && step.is_multiple_of(s.every))
    }

    pub(super) fn recorder(&mut self) -> Option<&mut Recorder> {
        self.engine
            .observers_mut()
            .iter_mut()
            .find_map(|o| o.as_any_mut().downcast_mut::<Recorder>())
    }

    /// Starts a step: the scale it begins with and what a replay needs.
    pub(super) fn begin(&mut self, step: u64) -> StepState {
        self.engine.begin_step(step);
        let check_only =
            !self.full_statistics && !self.last_kept_nonfinite && !self.scheduled(step);
        self.last_checked_only = false;
        self.blame_step = self.cfg.blame && !check_only;
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
            grad_shadows: vec![None; self.params.params.len()],
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
    pub(super) fn forward(&mut self, st: &mut StepState, micro: u32) -> Result<ForwardOutput> {
        self.engine.begin_micro(micro);
        self.engine.set_blame(self.blame_step);
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

    /// Backward: gradients of the parameters, summed over micro-batches.
    pub(super) fn backward(&mut self, st: &mut StepState, root: &Tensor) -> Result<()> {
        st.weight_casts += self.engine.take_weight_casts();
        let g = self.engine.backward(root)?;
        let shadows = self.engine.take_gradient_shadows();
        for (i, p) in self.params.params.iter().enumerate() {
            if let Some(s) = shadows.get(&p.value.id()) {
                st.grad_shadows[i] = Some(match st.grad_shadows[i].take() {
                    Some(prev) => {
                        let (a, b) = (prev.to_f64_vec()?, s.to_f64_vec()?);
                        Tensor::from_f64(a.iter().zip(&b).map(|(x, y)| x + y).collect(), s.shape())?
                    }
                    None => s.clone(),
                });
            }
            if let Some(gi) = g.get(&p.value.id()) {
                st.grads[i] = Some(match st.grads[i].take() {
                    Some(prev) => prev.add_same(gi, "accumulate_grad")?.0,
                    None => gi.clone(),
                });
            }
        }
        Ok(())
    }

    /// Update: the scaler's new scale, and its events.
    pub(super) fn update(&mut self, st: &mut StepState) -> Result<UpdateOutcome> {
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

    /// On a device: whether op kernels gather their outputs' statistics as they write them
    /// (the default) or the probe arena makes its own pass over each output afterwards.
    /// Both give the same statistics; the second costs a pass over memory per op. For
    /// checking the one against the other, and for timing them. No effect on the host.
    pub fn set_fused_stats(&mut self, on: bool) {
        if let Some(d) = self.device.as_mut() {
            d.fused_stats = on;
        }
    }

    pub(super) fn dev(&self) -> Result<Arc<CudaDevice>> {
        Ok(self.device()?.dev.clone())
    }

    pub(super) fn device(&self) -> Result<&DeviceState> {
        self.device
            .as_ref()
            .ok_or_else(|| Error::Device("this trainer runs on the CPU backend".into()))
    }

    /// A micro-batch's tensors on the device.
    pub(super) fn batch_to_device(&self, b: &Batch) -> Result<Batch> {
        let dev = self.dev()?;
        self.model.check_batch(b)?;
        b.try_map(|t| t.to_device(&dev))
    }
}

/// The micro-batch count `n` as a scalar of `dtype` (the loss is divided by it).
pub(super) fn divisor(n: u32, dtype: DType) -> Result<Tensor> {
    match dtype {
        DType::F64 => Tensor::from_f64(vec![n as f64], &[]),
        d => Tensor::from_f32(vec![n as f32], &[], d),
    }
}
