//! The step's gradients through the optimizer phase (unscale, clip, the inf check, the
//! optimizer step, the per-parameter records), on the backend that holds them.
//!
//! This is the trainer's side of the backend seam: the trainer's phases call these methods
//! and never touch gradient or parameter memory themselves. On the host the gradients are
//! f32 buffers updated in place with PyTorch's numerics (`amp::scaler`, `optim`). Device
//! gradients stay device tensors; their optimizer-phase kernels
//! (`_amp_foreach_non_finite_check_and_unscale_`, the device-side norm, the SGD and Adam
//! updates) are not written yet, so those phases refuse them with an error naming the
//! kernel.

use crate::amp::scaler::{GradScaler, GradView, StepDecision};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::optim::clip::{clip_grad_norm, ClipOutcome, GradSlot, NormType};
use crate::optim::{Optimizer, ParamSlot};
use crate::tensor::Tensor;
use crate::trace::record::ParamRecord;

/// One parameter as the optimizer phase sees it.
pub(crate) struct ParamRef<'a> {
    /// Unique name (optimizer state is keyed by it).
    pub name: &'a str,
    /// Current value.
    pub value: &'a Tensor,
}

/// The gradients of one step, per parameter (`None`: no gradient), on one backend.
pub(crate) enum StepGrads {
    /// Host buffers with their dtypes, unscaled, clipped and read in place.
    Host(Vec<Option<(Vec<f32>, DType)>>),
    /// Device tensors.
    Device(Vec<Option<Tensor>>),
}

/// The error of an optimizer-phase operation that has no device kernel yet.
fn no_device_kernel(what: &str) -> Error {
    Error::Device(format!(
        "{what} has no CUDA kernel yet: the optimizer phase runs on the CPU backend"
    ))
}

impl StepGrads {
    /// The gradients of a step, on the backend that holds them (all on one).
    pub fn new(grads: &[Option<Tensor>]) -> Result<StepGrads> {
        let on_device = grads.iter().flatten().any(|t| t.storage().is_device());
        if on_device {
            if grads.iter().flatten().any(|t| !t.storage().is_device()) {
                return Err(Error::Device(
                    "a step's gradients are split between host and device memory".into(),
                ));
            }
            return Ok(StepGrads::Device(grads.to_vec()));
        }
        grads
            .iter()
            .map(|g| {
                g.as_ref()
                    .map(|t| Ok::<_, Error>((t.f32s()?.to_vec(), t.dtype())))
                    .transpose()
            })
            .collect::<Result<_>>()
            .map(StepGrads::Host)
    }

    /// Unscales the gradients in place (`scaler.unscale_`), noting Inf/NaN.
    pub fn unscale(&mut self, scaler: &mut GradScaler, names: &[&str]) -> Result<()> {
        match self {
            StepGrads::Host(bufs) => {
                scaler.unscale_(0, &mut host_views(names, bufs))?;
                Ok(())
            }
            StepGrads::Device(_) => Err(no_device_kernel(
                "unscale (`_amp_foreach_non_finite_check_and_unscale_`)",
            )),
        }
    }

    /// Clips the gradients' total norm to at most `max_norm`.
    pub fn clip(&mut self, names: &[&str], max_norm: f32, norm: NormType) -> Result<ClipOutcome> {
        match self {
            StepGrads::Host(bufs) => {
                let mut slots: Vec<GradSlot<'_>> = names
                    .iter()
                    .zip(bufs.iter_mut())
                    .filter_map(|(nm, b)| {
                        b.as_mut().map(|(d, dt)| GradSlot {
                            name: nm,
                            data: d.as_mut_slice(),
                            dtype: *dt,
                        })
                    })
                    .collect();
                clip_grad_norm(&mut slots, max_norm, norm)
            }
            StepGrads::Device(_) => Err(no_device_kernel("clip_grad_norm (the device-side norm)")),
        }
    }

    /// The scaler's step decision (`scaler.step`): unscales first when not yet done.
    pub fn check(&mut self, scaler: &mut GradScaler, names: &[&str]) -> Result<StepDecision> {
        match self {
            StepGrads::Host(bufs) => scaler.should_step(0, &mut host_views(names, bufs)),
            StepGrads::Device(_) => Err(no_device_kernel(
                "the inf check (`_amp_foreach_non_finite_check_and_unscale_`)",
            )),
        }
    }

    /// The optimizer step: the parameters' new values, in order.
    pub fn step(
        &self,
        optimizer: &mut dyn Optimizer,
        params: &[ParamRef<'_>],
    ) -> Result<Vec<Tensor>> {
        let StepGrads::Host(bufs) = self else {
            return Err(no_device_kernel(&format!(
                "the {} update",
                optimizer.name()
            )));
        };
        let mut datas: Vec<Vec<f32>> = params
            .iter()
            .map(|p| p.value.f32s().map(<[f32]>::to_vec))
            .collect::<Result<_>>()?;
        {
            let mut slots: Vec<ParamSlot<'_>> = params
                .iter()
                .zip(datas.iter_mut())
                .zip(bufs.iter())
                .map(|((p, d), g)| ParamSlot {
                    name: p.name,
                    data: d.as_mut_slice(),
                    grad: g.as_ref().map(|(v, _)| v.as_slice()),
                    dtype: p.value.dtype(),
                })
                .collect();
            optimizer.step(&mut slots)?;
        }
        params
            .iter()
            .zip(datas)
            .map(
                |(p, d)| Ok(Tensor::from_exact(d, p.value.shape(), p.value.dtype())?.as_leaf(true)),
            )
            .collect()
    }

    /// Parameter `i`'s gradient as a tensor of `shape`, or None without a gradient.
    pub fn tensor(&self, i: usize, shape: &[usize]) -> Result<Option<Tensor>> {
        match self {
            StepGrads::Host(bufs) => bufs[i]
                .as_ref()
                .map(|(g, d)| Tensor::from_exact(g.clone(), shape, *d))
                .transpose(),
            StepGrads::Device(ts) => Ok(ts[i].clone()),
        }
    }

    /// Every parameter's record (gradient statistics against its value; None without a
    /// gradient), computed over rayon's threads, one parameter each.
    pub fn records(
        &self,
        params: &[crate::models::Param],
        scale: f32,
    ) -> Result<Vec<Option<ParamRecord>>> {
        use rayon::prelude::*;
        params
            .par_iter()
            .enumerate()
            .map(|(i, p)| {
                let r = ParamRef {
                    name: &p.name,
                    value: &p.value,
                };
                self.record(i, &r, scale)
            })
            .collect()
    }

    /// Parameter `i`'s gradient as a tensor of `shape` (None without a gradient), moved
    /// out of the host buffers, which no longer hold it.
    pub fn take_tensor(&mut self, i: usize, shape: &[usize]) -> Result<Option<Tensor>> {
        match self {
            StepGrads::Host(bufs) => bufs[i]
                .take()
                .map(|(g, d)| Tensor::from_exact(g, shape, d))
                .transpose(),
            StepGrads::Device(ts) => Ok(ts[i].clone()),
        }
    }

    /// Parameter `i`'s record (gradient statistics against its value), or None without a
    /// gradient.
    pub fn record(&self, i: usize, p: &ParamRef<'_>, scale: f32) -> Result<Option<ParamRecord>> {
        match self {
            StepGrads::Host(bufs) => {
                let Some((g, gd)) = &bufs[i] else {
                    return Ok(None);
                };
                Ok(Some(ParamRecord::from_grad(
                    p.name,
                    p.value.dtype(),
                    *gd,
                    g,
                    scale,
                    p.value.f32s()?,
                )))
            }
            StepGrads::Device(_) => Err(no_device_kernel("the per-parameter gradient statistics")),
        }
    }
}

fn host_views<'a>(
    names: &'a [&'a str],
    bufs: &'a mut [Option<(Vec<f32>, DType)>],
) -> Vec<GradView<'a>> {
    names
        .iter()
        .zip(bufs.iter_mut())
        .filter_map(|(n, b)| {
            b.as_mut()
                .map(|(d, dt)| GradView::new(n, d.as_mut_slice(), *dt))
        })
        .collect()
}
