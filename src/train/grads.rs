//! The host step's gradients through the optimizer phase (unscale, clip, the inf check, the
//! optimizer step, the per-parameter records): f32 buffers updated in place with PyTorch's
//! numerics (`amp::scaler`, `optim`). A device step keeps its gradients on the device and
//! runs `optim::cuda`'s kernels instead (`device.rs`).

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

/// The gradients of one host step, per parameter (`None`: no gradient), with their dtypes:
/// unscaled, clipped and read in place.
pub(crate) struct StepGrads(Vec<Option<(Vec<f32>, DType)>>);

impl StepGrads {
    /// The gradients of a step, copied into host buffers.
    pub fn new(grads: &[Option<Tensor>]) -> Result<StepGrads> {
        grads
            .iter()
            .map(|g| {
                g.as_ref()
                    .map(|t| {
                        if t.storage().is_device() {
                            return Err(Error::Device(
                                "the host step was handed a gradient in device memory".into(),
                            ));
                        }
                        Ok((t.f32s()?.to_vec(), t.dtype()))
                    })
                    .transpose()
            })
            .collect::<Result<_>>()
            .map(StepGrads)
    }

    /// Unscales the gradients in place (`scaler.unscale_`), noting Inf/NaN.
    pub fn unscale(&mut self, scaler: &mut GradScaler, names: &[&str]) -> Result<()> {
        scaler.unscale_(0, &mut host_views(names, &mut self.0))?;
        Ok(())
    }

    /// Clips the gradients' total norm to at most `max_norm`.
    pub fn clip(&mut self, names: &[&str], max_norm: f32, norm: NormType) -> Result<ClipOutcome> {
        let mut slots: Vec<GradSlot<'_>> = names
            .iter()
            .zip(self.0.iter_mut())
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

    /// The scaler's step decision (`scaler.step`): unscales first when not yet done.
    pub fn check(&mut self, scaler: &mut GradScaler, names: &[&str]) -> Result<StepDecision> {
        scaler.should_step(0, &mut host_views(names, &mut self.0))
    }

    /// The optimizer step: the parameters' new values, in order.
    pub fn step(
        &self,
        optimizer: &mut dyn Optimizer,
        params: &[ParamRef<'_>],
    ) -> Result<Vec<Tensor>> {
        let mut datas: Vec<Vec<f32>> = params
            .iter()
            .map(|p| p.value.f32s().map(<[f32]>::to_vec))
            .collect::<Result<_>>()?;
        {
            let mut slots: Vec<ParamSlot<'_>> = params
                .iter()
                .zip(datas.iter_mut())
                .zip(self.0.iter())
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
        self.0[i]
            .as_ref()
            .map(|(g, d)| Tensor::from_exact(g.clone(), shape, *d))
            .transpose()
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
    /// out of the buffers, which no longer hold it.
    pub fn take_tensor(&mut self, i: usize, shape: &[usize]) -> Result<Option<Tensor>> {
        self.0[i]
            .take()
            .map(|(g, d)| Tensor::from_exact(g, shape, d))
            .transpose()
    }

    /// Parameter `i`'s record (gradient statistics against its value), or None without a
    /// gradient.
    pub fn record(&self, i: usize, p: &ParamRef<'_>, scale: f32) -> Result<Option<ParamRecord>> {
        let Some((g, gd)) = &self.0[i] else {
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
