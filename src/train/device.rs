//! The training step on a CUDA device: the same phases as on the host, queued on the
//! device's stream without a host wait, and one device-to-host read at the end.
//!
//! The forward, the loss, the scaling and the backward are the engine's ops on device
//! tensors (their kernels dispatch on storage). The optimizer phase runs
//! `optim::cuda`'s kernels: unscale with the inf check, clipping, the update (skipped on
//! the device itself when a gradient held inf/NaN) and the scale update. The losses, the
//! scaler's words, every probe's statistics and the per-parameter records land in the
//! probe arena, which the host reads once (when the step finishes); then it resolves
//! the op records, replays the scaler's bookkeeping with the device's inf check and checks
//! that both arrive at the same scale.

use super::phases::StepSide;
use super::trainer::{divisor, StepOutput, StepState, Trainer};
use crate::device::cuda::arena::ArenaWords;
use crate::device::cuda::CudaDevice;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::models::Output as ForwardOutput;
use crate::optim::clip::ClipOutcome;
use crate::optim::cuda::{self as dev_optim, word, ParamUpdate, RecordSlots, StepScalars};
use crate::tensor::Tensor;
use crate::trace::record::{ParamRecord, StepRecord};

/// What the device phases of one step leave for the read.
#[derive(Default)]
pub(super) struct DeviceStep {
    /// The step's gradients, each in a buffer of its own.
    grads: Vec<Option<Tensor>>,
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

impl StepSide for DeviceStep {
    fn open(&mut self, t: &mut Trainer) -> Result<()> {
        let dev = t.dev()?;
        // Every op output is probed when probes are on: its kernel gathers the statistics
        // as it writes it, where it can. An injection rewrites an output after its kernel
        // ran, so a step with one probes the rewritten output instead.
        let gather = t.device()?.fused_stats && t.engine.probing() && t.injections.is_empty();
        // Nothing reads an op's rounding counts without probes, so none are counted and
        // 16-bit products come out of cuBLAS in their dtype.
        let counting = t.engine.probing();
        // A step the sampling keeps no records of only counts its forward and backward
        // outputs' non-finite values (Trainer::set_full_statistics); the optimizer phase
        // always gets full statistics.
        let check_only = t.last_checked_only;
        dev.with_arena(|a| {
            a.reset(&dev)?;
            a.set_gathering(gather);
            a.set_counting(counting);
            a.set_check_only(check_only);
            Ok(())
        })
    }

    /// The loss's value left in a slot for the read.
    fn loss(&mut self, t: &mut Trainer, _st: &mut StepState, out: ForwardOutput) -> Result<Tensor> {
        let dev = t.dev()?;
        let mut loss = out.loss;
        let (slot, w) = slot_word(&dev, word::LOSS)?;
        dev_optim::scalar_to_word(&loss, w)?;
        self.loss_slots.push(slot);
        t.outputs.push(StepOutput {
            loss: f64::NAN,
            hidden: out.hidden,
        });
        let accumulate = t.cfg.accumulate;
        if accumulate > 1 {
            let d = divisor(accumulate, loss.dtype())?.to_device(&dev)?;
            loss = t.engine.scope("loss", |e| e.div(&loss, &d))?;
        }
        Ok(loss)
    }

    /// The loss times the device's scale; the scaled loss left in a slot.
    fn scale(&mut self, t: &mut Trainer, _st: &mut StepState, loss: Tensor) -> Result<Tensor> {
        if !t.scaler.is_enabled() {
            return Ok(loss);
        }
        let dev = t.dev()?;
        let s = t.device()?.scaler.scale().clone();
        let scaled = t.engine.scope("scaler", |e| e.mul(&loss, &s))?;
        let (slot, w) = slot_word(&dev, word::LOSS)?;
        dev_optim::scalar_to_word(&scaled, w)?;
        self.scaled_slot = Some(slot);
        Ok(scaled)
    }

    /// Each gradient in a buffer of its own (a backward may hand one buffer to two
    /// inputs; unscaling in place must not reach it twice).
    fn gradients(&mut self, t: &mut Trainer, st: &StepState) -> Result<()> {
        let dev = t.dev()?;
        dev.with_arena(|a| {
            a.set_check_only(false);
            Ok(())
        })?;
        let mut seen = std::collections::HashSet::new();
        self.grads = st
            .grads
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
            .collect::<Result<_>>()?;
        Ok(())
    }

    /// Unscale with the inf check (a disabled scaler leaves the gradients as they are but,
    /// as on the host, the phase is still recorded).
    fn unscale(&mut self, t: &mut Trainer) -> Result<()> {
        if t.scaler.is_enabled() {
            flush(&*t.dev()?)?;
            let live: Vec<&Tensor> = self.grads.iter().flatten().collect();
            t.device()?.scaler.unscale(&live)?;
        }
        self.unscaled = true;
        {
            let grads = &self.grads;
            t.emit_grads(t.unscale_op(), |i, _| Ok(grads[i].clone()))
        }
    }

    fn clip(&mut self, t: &mut Trainer, _st: &mut StepState, max_norm: f32) -> Result<()> {
        flush(&*t.dev()?)?;
        let live: Vec<&Tensor> = self.grads.iter().flatten().collect();
        t.device()?.scaler.clip(&live, max_norm, t.cfg.clip_norm)?;
        self.clipped = !live.is_empty();
        {
            let grads = &self.grads;
            t.emit_grads(t.clip_op(max_norm), |i, _| Ok(grads[i].clone()))
        }
    }

    /// The optimizer's kernels: new parameter values (the old ones again when the device
    /// finds the step must be skipped), then the scale update's.
    fn optimize(&mut self, t: &mut Trainer, st: &mut StepState) -> Result<()> {
        if t.scaler.is_enabled() && !self.unscaled {
            self.unscale(t)?;
        }
        self.optimizer_step(t, st.scale_before)?;
        if t.scaler.is_enabled() {
            let cfg = t.scaler.config().clone();
            t.device()?.scaler.update(&cfg)?;
        }
        Ok(())
    }

    /// The step's one read and what follows from it: losses, op records, the scaler's
    /// bookkeeping (checked against the device), the per-parameter records.
    fn finish(mut self, t: &mut Trainer, mut st: StepState) -> Result<StepRecord> {
        let dev = t.dev()?;
        let (ss, sw) = slot_word(&dev, 0)?;
        let slot_ptr = sw;
        t.device()?.scaler.summary(slot_ptr)?;
        self.scalars_slot = Some(ss);

        let words = dev.with_arena(|a| a.read_words(&dev))?;

        if let Some(r) = t.recorder() {
            r.resolve(&words.stats())?;
        }
        for (o, &s) in t.outputs.iter_mut().zip(&self.loss_slots) {
            o.loss = loss_of(&words, s)?;
            st.loss_sum += o.loss;
        }
        if let Some(s) = self.scaled_slot {
            st.scaled_loss = Some(loss_of(&words, s)?);
        }
        let sc = StepScalars::parse(words.slot(ss)?);
        if self.clipped {
            st.clip = Some(ClipOutcome {
                total_norm: sc.total_norm,
                clip_coef: sc.clip_coef,
                nonfinite: !sc.total_norm.is_finite(),
            });
        } else if t.cfg.clip.is_some() {
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

        let grads = &self.grads;
        let named: Vec<(&str, DType)> = t
            .params
            .params
            .iter()
            .zip(grads)
            .filter_map(|(p, g)| g.as_ref().map(|g| (p.name.as_str(), g.dtype())))
            .collect();
        if t.scaler.is_enabled() {
            t.scaler
                .unscaled_elsewhere(0, &named, sc.found_inf, sc.unscale_rounding)?;
        }
        let decision = t.scaler.should_step(0, &mut [])?;
        if let Some(d) = t.device.as_mut() {
            d.opt.commit(!decision.skip);
        }
        if decision.skip {
            if let (Some(n), Some(r)) = (self.ops_before_update, t.recorder()) {
                r.truncate(n);
            }
        }
        let upd = match t.update(&mut st) {
            Ok(u) => u,
            Err(e) if sc.floor_error => return Err(e),
            Err(e) => {
                return Err(Error::Device(format!(
                    "the scale update failed on the host ({e}) but not on the device"
                )))
            }
        };
        if t.scaler.is_enabled() {
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

        let mut params_rec = vec![None; t.params.params.len()];
        for &(i, gs, ps) in &self.records {
            let p = &t.params.params[i];
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
            t.last_grads[i] = g.clone();
        }
        t.record_step(st, params_rec, decision, upd)
    }
}

impl DeviceStep {
    /// The optimizer's kernels: new parameter values (the old ones again when the device
    /// finds the step must be skipped).
    fn optimizer_step(&mut self, t: &mut Trainer, scale: f32) -> Result<()> {
        flush(&*t.dev()?)?;
        self.ops_before_update = t.recorder().map(|r| r.op_count());
        let lr = t.optimizer.lr_f64();
        // Every parameter with a gradient gets its record's two slots, all taken before the
        // first update launches (a slot taken later could move the arena).
        let dev = t.dev()?;
        let grads = &self.grads;
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
        self.records = slots.iter().map(|&(i, s)| (i, s.grad, s.param)).collect();
        let blamed = match (&t.grad_blame, &t.device) {
            (Some(gb), Some(d)) => {
                let exact = |n: &str, p: &[f64], g: &[f64]| d.opt.exact_step(&dev, lr, n, p, g);
                Some(gb.before_step(&exact, &t.params.params)?)
            }
            _ => None,
        };
        let new = {
            let d = t.device.as_mut().expect("a device trainer");
            let mut at = slots.iter().map(|&(_, s)| s);
            let list: Vec<ParamUpdate<'_>> = t
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
        for (i, (p, nv)) in t.params.params.iter_mut().zip(new).enumerate() {
            let stepped = grads_has(&nv, &p.value);
            let old = std::mem::replace(&mut p.value, nv);
            if stepped {
                let (m, nv) = (p.module.clone(), p.value.clone());
                let blame = match &blamed {
                    Some(b) => b.of(i, &old, &nv)?,
                    None => None,
                };
                t.engine
                    .emit_optimizer_op("optimizer_step", &m, &[&old], &nv, blame);
            }
        }
        Ok(())
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
