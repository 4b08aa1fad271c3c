//! The training step on a CUDA device: the same phases as on the host, queued on the
//! device's stream without a host wait, and one device-to-host read at the end.
//!
//! The forward, the loss, the scaling and the backward are the engine's ops on device
//! tensors (their kernels dispatch on storage). The optimizer phase runs
//! `optim::cuda`'s kernels: unscale with the inf check, clipping, the update (skipped on
//! the device itself when a gradient held inf/NaN) and the scale update. The losses, the
//! scaler's words, every probe's statistics and the per-parameter records land in the
//! probe arena, which the host reads once ([`Trainer::device_finish`]); then it resolves
//! the op records, replays the scaler's bookkeeping with the device's inf check and checks
//! that both arrive at the same scale.

use super::{StepOutput, StepState, Trainer};
use crate::device::cuda::arena::ArenaWords;
use crate::device::cuda::CudaDevice;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::models::Batch;
use crate::optim::clip::ClipOutcome;
use crate::optim::cuda::{
    self as dev_optim, word, DeviceOptimizer, DeviceScaler, ParamUpdate, RecordSlots, StepScalars,
};
use crate::tensor::Tensor;
use crate::trace::record::{ParamRecord, StepRecord};
use std::sync::Arc;

/// What a trainer keeps on its device between steps.
pub(super) struct DeviceSide {
    pub dev: Arc<CudaDevice>,
    pub scaler: DeviceScaler,
    pub opt: DeviceOptimizer,
    /// Whether op kernels gather their outputs' statistics when probes are on.
    pub fused_stats: bool,
}

/// What the device phases of one step leave for the read.
#[derive(Default)]
pub(super) struct DeviceStep {
    /// Per micro-batch: the slot holding its loss.
    loss_slots: Vec<u32>,
    /// The slot holding the last scaled loss.
    scaled_slot: Option<u32>,
    /// The slot of the scaler's words.
    scalars_slot: Option<u32>,
    /// The step was clipped (its outcome is in the scalars slot).
    clipped: bool,
    /// The gradients have been unscaled (on the device).
    unscaled: bool,
    /// Op records before the optimizer's (dropped if the step turns out skipped).
    ops_before_update: Option<usize>,
    /// Per parameter with a gradient: its index, gradient slot and value slot.
    records: Vec<(usize, u32, u32)>,
}

/// A fresh arena slot of `dev`, with the device address of its word `w`.
fn slot_word(dev: &CudaDevice, w: usize) -> Result<(u32, u64)> {
    dev.with_arena(|a| {
        let s = a.slot(dev)?;
        Ok((s, a.word_ptr(dev, s, w)))
    })
}

/// Launches the queued small probes, so that a kernel may then change their tensors in
/// place (gradients are unscaled and clipped where they lie).
fn flush(dev: &CudaDevice) -> Result<()> {
    dev.with_arena(|a| a.flush(dev))
}

impl DeviceSide {
    /// Opens the device side of a trainer: the scaler's state uploaded once.
    pub fn new(
        dev: Arc<CudaDevice>,
        scaler: &crate::amp::scaler::GradScaler,
        opt: &crate::optim::OptimizerConfig,
    ) -> Result<DeviceSide> {
        let scaler = DeviceScaler::new(
            &dev,
            scaler.scale(),
            scaler.growth_tracker(),
            scaler.hysteresis_tracker().unwrap_or(0),
        )?;
        Ok(DeviceSide {
            dev,
            scaler,
            opt: DeviceOptimizer::new(opt),
            fused_stats: true,
        })
    }
}

impl Trainer {
    /// On a device: whether op kernels gather their outputs' statistics as they write them
    /// (the default) or the probe arena makes its own pass over each output afterwards.
    /// Both give the same statistics; the second costs a pass over memory per op. For
    /// checking the one against the other, and for timing them. No effect on the host.
    pub fn set_fused_stats(&mut self, on: bool) {
        if let Some(d) = self.device.as_mut() {
            d.fused_stats = on;
        }
    }

    fn dev(&self) -> Result<Arc<CudaDevice>> {
        Ok(self.device()?.dev.clone())
    }

    /// One step on the device (see the module docs).
    pub(super) fn device_step(&mut self, step: u64) -> Result<StepRecord> {
        let dev = self.dev()?;
        // Every op output is probed when probes are on: its kernel gathers the statistics
        // as it writes it, where it can. An injection rewrites an output after its kernel
        // ran, so a step with one probes the rewritten output instead.
        let gather =
            self.device()?.fused_stats && self.engine.probing() && self.injections.is_empty();
        // Nothing reads an op's rounding counts without probes, so none are counted and
        // 16-bit products come out of cuBLAS in their dtype.
        let counting = self.engine.probing();
        let mut st = self.begin(step);
        // A step the sampling keeps no records of only counts its forward and backward
        // outputs' non-finite values (Trainer::set_full_statistics); the optimizer phase
        // always gets full statistics.
        let check_only = self.last_checked_only;
        dev.with_arena(|a| {
            a.reset(&dev)?;
            a.set_gathering(gather);
            a.set_counting(counting);
            a.set_check_only(check_only);
            Ok(())
        })?;
        let mut ds = DeviceStep::default();
        for micro in 0..self.cfg.accumulate {
            let out = self.forward(&mut st, micro)?;
            let loss = self.device_loss(&mut ds, out)?;
            let root = self.device_scale(&mut ds, loss)?;
            self.backward(&mut st, &root)?;
        }
        dev.with_arena(|a| {
            a.set_check_only(false);
            Ok(())
        })?;
        self.before = st.inputs.take();
        let grads = self.device_grads(&st)?;
        if let Some(max_norm) = self.cfg.clip {
            self.device_unscale(&mut ds, &grads)?;
            flush(&dev)?;
            let live: Vec<&Tensor> = grads.iter().flatten().collect();
            self.device()?
                .scaler
                .clip(&live, max_norm, self.cfg.clip_norm)?;
            ds.clipped = !live.is_empty();
            self.emit_device_grads("clip_grad_norm", &grads)?;
        }
        if self.scaler.is_enabled() && !ds.unscaled {
            self.device_unscale(&mut ds, &grads)?;
        }
        self.device_optimizer_step(&mut ds, &grads, st.scale_before)?;
        if self.scaler.is_enabled() {
            let cfg = self.scaler.config().clone();
            self.device()?.scaler.update(&cfg)?;
        }
        self.device_finish(st, ds, &grads)
    }

    fn device(&self) -> Result<&DeviceSide> {
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

    /// Loss: its value left in a slot for the read, divided by the micro-batch count when
    /// accumulating.
    fn device_loss(&mut self, ds: &mut DeviceStep, out: crate::models::Output) -> Result<Tensor> {
        let dev = self.dev()?;
        let mut loss = out.loss;
        let (slot, w) = slot_word(&dev, word::LOSS)?;
        dev_optim::scalar_to_word(&loss, w)?;
        ds.loss_slots.push(slot);
        self.outputs.push(StepOutput {
            loss: f64::NAN,
            hidden: out.hidden,
        });
        let accumulate = self.cfg.accumulate;
        if accumulate > 1 {
            let d = super::divisor(accumulate, loss.dtype())?.to_device(&dev)?;
            loss = self.engine.scope("loss", |e| e.div(&loss, &d))?;
        }
        Ok(loss)
    }

    /// Scale: the loss times the device's scale, when scaling is on.
    fn device_scale(&mut self, ds: &mut DeviceStep, loss: Tensor) -> Result<Tensor> {
        if !self.scaler.is_enabled() {
            return Ok(loss);
        }
        let dev = self.dev()?;
        let s = self.device()?.scaler.scale().clone();
        let scaled = self.engine.scope("scaler", |e| e.mul(&loss, &s))?;
        let (slot, w) = slot_word(&dev, word::LOSS)?;
        dev_optim::scalar_to_word(&scaled, w)?;
        ds.scaled_slot = Some(slot);
        Ok(scaled)
    }

    /// The step's gradients, each in a buffer of its own (a backward may hand one buffer
    /// to two inputs; unscaling in place must not reach it twice).
    fn device_grads(&self, st: &StepState) -> Result<Vec<Option<Tensor>>> {
        let mut seen = std::collections::HashSet::new();
        st.grads
            .iter()
            .map(|g| {
                let Some(g) = g else { return Ok(None) };
                let c = g.cuda("gradient")?;
                let at = c.buf.ptr(&c.dev);
                if seen.insert(at) {
                    Ok(Some(g.clone()))
                } else {
                    crate::ops::cast::cuda::cast(g, g.dtype(), crate::ops::cuda::Out::NONE)
                        .map(Some)
                }
            })
            .collect()
    }

    /// Unscale with the inf check (a disabled scaler leaves the gradients as they are but,
    /// as on the host, the phase is still recorded).
    fn device_unscale(&mut self, ds: &mut DeviceStep, grads: &[Option<Tensor>]) -> Result<()> {
        if self.scaler.is_enabled() {
            flush(&*self.dev()?)?;
            let live: Vec<&Tensor> = grads.iter().flatten().collect();
            self.device()?.scaler.unscale(&live)?;
        }
        ds.unscaled = true;
        self.emit_device_grads("unscale", grads)
    }

    fn emit_device_grads(&mut self, op: &'static str, grads: &[Option<Tensor>]) -> Result<()> {
        if !self.engine.probing() {
            return Ok(());
        }
        for (p, g) in self.params.params.iter().zip(grads) {
            if let Some(t) = g {
                let m = p.module.clone();
                self.engine.emit_optimizer_op(op, &m, &[], t);
            }
        }
        Ok(())
    }

    /// The optimizer's kernels: new parameter values (the old ones again when the device
    /// finds the step must be skipped).
    fn device_optimizer_step(
        &mut self,
        ds: &mut DeviceStep,
        grads: &[Option<Tensor>],
        scale: f32,
    ) -> Result<()> {
        flush(&*self.dev()?)?;
        ds.ops_before_update = self.recorder().map(|r| r.op_count());
        let lr = self.optimizer.lr_f64();
        // Every parameter with a gradient gets its record's two slots, all taken before the
        // first update launches (a slot taken later could move the arena).
        let dev = self.dev()?;
        let mut slots = Vec::new();
        dev.with_arena(|a| {
            for (i, g) in grads.iter().enumerate() {
                if g.is_some() {
                    let grad = a.slot(&dev)?;
                    slots.push((
                        i,
                        RecordSlots {
                            grad,
                            param: a.slot(&dev)?,
                        },
                    ));
                }
            }
            Ok(())
        })?;
        ds.records = slots.iter().map(|&(i, s)| (i, s.grad, s.param)).collect();
        let new = {
            let d = self.device.as_mut().expect("a device trainer");
            let mut at = slots.iter().map(|&(_, s)| s);
            let list: Vec<ParamUpdate<'_>> = self
                .params
                .params
                .iter()
                .zip(grads)
                .map(|(p, g)| ParamUpdate {
                    name: &p.name,
                    value: &p.value,
                    grad: g
                        .as_ref()
                        .map(|g| (g, at.next().expect("a slot per gradient"))),
                })
                .collect();
            d.scaler.optimizer_step(&mut d.opt, lr, scale, &list)?
        };
        for (p, nv) in self.params.params.iter_mut().zip(new) {
            let stepped = grads_has(&nv, &p.value);
            let old = std::mem::replace(&mut p.value, nv);
            if stepped {
                let (m, nv) = (p.module.clone(), p.value.clone());
                self.engine
                    .emit_optimizer_op("optimizer_step", &m, &[&old], &nv);
            }
        }
        Ok(())
    }

    /// The step's one read and what follows from it: losses, op records, the scaler's
    /// bookkeeping (checked against the device), the per-parameter records.
    fn device_finish(
        &mut self,
        mut st: StepState,
        mut ds: DeviceStep,
        grads: &[Option<Tensor>],
    ) -> Result<StepRecord> {
        let dev = self.dev()?;
        let (ss, sw) = slot_word(&dev, 0)?;
        let slot_ptr = sw;
        self.device()?.scaler.summary(slot_ptr)?;
        ds.scalars_slot = Some(ss);

        let words = dev.with_arena(|a| a.read_words(&dev))?;

        if let Some(r) = self.recorder() {
            r.resolve(&words.stats())?;
        }
        for (o, &s) in self.outputs.iter_mut().zip(&ds.loss_slots) {
            o.loss = loss_of(&words, s)?;
            st.loss_sum += o.loss;
        }
        if let Some(s) = ds.scaled_slot {
            st.scaled_loss = Some(loss_of(&words, s)?);
        }
        let sc = StepScalars::parse(words.slot(ss)?);
        if ds.clipped {
            st.clip = Some(ClipOutcome {
                total_norm: sc.total_norm,
                clip_coef: sc.clip_coef,
                nonfinite: !sc.total_norm.is_finite(),
            });
        } else if self.cfg.clip.is_some() {
            st.clip = Some(ClipOutcome {
                total_norm: 0.0,
                clip_coef: 1.0,
                nonfinite: false,
            });
        }
        if let Some(c) = &st.clip {
            if c.nonfinite {
                st.events.push(format!(
                    "clip_grad_norm: total norm is {} (non-finite); gradients were multiplied \
                     by {}",
                    c.total_norm, c.clip_coef
                ));
            }
        }

        let named: Vec<(&str, DType)> = self
            .params
            .params
            .iter()
            .zip(grads)
            .filter_map(|(p, g)| g.as_ref().map(|g| (p.name.as_str(), g.dtype())))
            .collect();
        if self.scaler.is_enabled() {
            self.scaler
                .unscaled_elsewhere(0, &named, sc.found_inf, sc.unscale_rounding)?;
        }
        let decision = self.scaler.should_step(0, &mut [])?;
        if let Some(d) = self.device.as_mut() {
            d.opt.commit(!decision.skip);
        }
        if decision.skip {
            if let (Some(n), Some(r)) = (ds.ops_before_update, self.recorder()) {
                r.truncate(n);
            }
        }
        let upd = match self.update(&mut st) {
            Ok(u) => u,
            Err(e) if sc.floor_error => return Err(e),
            Err(e) => {
                return Err(Error::Device(format!(
                    "the scale update failed on the host ({e}) but not on the device"
                )))
            }
        };
        if self.scaler.is_enabled() {
            let host = (
                upd.scale_after.to_bits(),
                upd.growth_tracker,
                upd.hysteresis_tracker.unwrap_or(sc.hysteresis_tracker),
            );
            let device = (sc.scale.to_bits(), sc.growth_tracker, sc.hysteresis_tracker);
            if host != device || sc.floor_error {
                return Err(Error::Device(format!(
                    "the device's scale update disagrees with the scaler: device scale {} \
                     (growth {}, hysteresis {}), scaler {} (growth {}, hysteresis {:?})",
                    sc.scale,
                    sc.growth_tracker,
                    sc.hysteresis_tracker,
                    upd.scale_after,
                    upd.growth_tracker,
                    upd.hysteresis_tracker
                )));
            }
        }

        let mut params_rec = vec![None; self.params.params.len()];
        for &(i, gs, ps) in &ds.records {
            let p = &self.params.params[i];
            let g = words.slot(gs)?;
            let gst = crate::device::cuda::arena::parse_slot(g).stats;
            let pst = crate::device::cuda::arena::parse_slot(words.slot(ps)?).stats;
            let gd = grads[i].as_ref().map_or(p.value.dtype(), Tensor::dtype);
            params_rec[i] = Some(ParamRecord::from_stats(
                &p.name,
                p.value.dtype(),
                gd,
                &gst,
                g[word::SCALED_FLUSHES],
                &pst,
            ));
        }
        for (i, g) in grads.iter().enumerate() {
            self.last_grads[i] = g.clone();
        }
        self.record_step(st, params_rec, decision, upd)
    }
}

/// True when the optimizer made a new value (a parameter without a gradient keeps its
/// tensor).
fn grads_has(new: &Tensor, old: &Tensor) -> bool {
    new.id() != old.id()
}

/// The loss left in slot `s` (f64 bits).
fn loss_of(words: &ArenaWords, s: u32) -> Result<f64> {
    Ok(f64::from_bits(words.slot(s)?[word::LOSS]))
}
