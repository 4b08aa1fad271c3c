//! The optimizer phase of a step on the device (`optim.cu`): the scaler's state and its
//! unscale / inf check / scale update, gradient clipping, SGD and Adam/AdamW, and the
//! step's scalars for the one arena read.
//!
//! Nothing here waits for the device. The scaler's scale and trackers live in device
//! memory and the kernels read them there; the host learns the step's found_inf, scale and
//! clip norm from the arena read at the end of the step and checks its own mirror of the
//! scaler against them ([`StepScalars`]). Optimizer state (momentum, moments) stays on the
//! device; the per-parameter update counts the host needs for the next step's scalars are
//! committed once the read says whether the step was skipped ([`DeviceOptimizer::commit`]).

use crate::amp::scaler::{ScalerConfig, ScalerKind};
use crate::device::cuda::arena::stats_config;
use crate::device::cuda::{dev_err, CudaDevice};
use crate::dtype::{DType, RoundCounts};
use crate::error::{Error, Result};
use crate::ops::cuda::{arg, device_of, launch, launch_with, output};
use crate::optim::clip::NormType;
use crate::optim::{AdamConfig, OptimizerConfig, SgdConfig};
use crate::tensor::Tensor;
use cudarc::driver::{CudaSlice, DevicePtr, DeviceRepr};
use std::collections::HashMap;
use std::sync::Arc;

/// The CUDA source of the optimizer-phase kernels.
pub const SOURCE: &str = include_str!("optim.cu");

/// The kernels of [`SOURCE`].
pub const KERNELS: &[&str] = &[
    "amp_unscale_multi",
    "amp_grad_norm_multi",
    "amp_clip_coef",
    "amp_clip_apply_multi",
    "amp_sgd_multi",
    "amp_adam_multi",
    "amp_update_scale",
    "amp_step_summary",
    "amp_scalar_to_word",
];

/// u32 words of the scaler's device state (`AMP_STATE_WORDS`).
const STATE_WORDS: usize = 8;
const AMP_GROWTH: usize = 1;
const AMP_HYST: usize = 2;

/// Arena words of the step's scalars slot (`SS_*` in optim.cu).
pub mod word {
    /// Nonzero when a gradient held inf/NaN.
    pub const FOUND_INF: usize = 16;
    /// The scale after the update (f32 bits).
    pub const SCALE: usize = 17;
    /// The growth tracker after the update.
    pub const GROWTH: usize = 18;
    /// The hysteresis tracker after the update.
    pub const HYST: usize = 19;
    /// 1 when an overflow met the floor with `error_at_floor`.
    pub const ERROR: usize = 20;
    /// Unscale overflow count.
    pub const UNSCALE_OVER: usize = 21;
    /// Unscale underflow count.
    pub const UNSCALE_UNDER: usize = 22;
    /// The clip's total norm (f32 bits).
    pub const TOTAL_NORM: usize = 23;
    /// The clip coefficient (f32 bits).
    pub const CLIP_COEF: usize = 24;
    /// In a gradient's statistics slot: its scaled fp16 flushes (a word no probe writes).
    pub const SCALED_FLUSHES: usize = 293;
    /// In a loss slot: the value as f64 bits.
    pub const LOSS: usize = 16;
}

/// SGD's scalars (`SgdArgs` in optim.cu).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct SgdArgs {
    neg_lr: f32,
    wd: f32,
    momentum_alpha: f32,
    momentum: f32,
    one_minus_damp: f32,
    od: i32,
    use_wd: i32,
    use_momentum: i32,
    first: i32,
    nesterov: i32,
    maximize: i32,
    pad: i32,
}

/// Adam's scalars of one step (`AdamArgs`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct AdamArgs {
    decay_factor: f32,
    lerp_weight: f32,
    beta2: f32,
    one_minus_beta2: f32,
    eps: f32,
    wd: f32,
    bc2_sqrt: f32,
    neg_step_size: f32,
    od: i32,
    use_wd: i32,
    decoupled: i32,
    amsgrad: i32,
    maximize: i32,
    pad: i32,
}

/// Where an update gathers its parameter's record (`RecordArgs` in optim.cu): the
/// gradient's and the new value's arena slots (word 0) and partial sums, and the step's
/// loss scale for the gradient's scaled fp16 flushes.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct RecordArgs {
    g_slot: u64,
    g_partials: u64,
    p_slot: u64,
    p_partials: u64,
    scale: f32,
    pad: u32,
}

// SAFETY: plain-old-data with the C layout of the kernel's struct.
unsafe impl DeviceRepr for RecordArgs {}

/// A parameter's record slots for [`DeviceScaler::optimizer_step`].
#[derive(Debug, Clone, Copy)]
pub struct RecordSlots {
    /// The gradient's statistics (and its scaled flushes, word [`word::SCALED_FLUSHES`]).
    pub grad: u32,
    /// The parameter's statistics after the update.
    pub param: u32,
}

/// One parameter of [`DeviceScaler::optimizer_step`]: its name and value, and its gradient
/// with its record's slots (None: no gradient; the value is kept).
pub struct ParamUpdate<'a> {
    /// Parameter name (for errors).
    pub name: &'a str,
    /// Its value before the step.
    pub value: &'a Tensor,
    /// Its gradient and record slots.
    pub grad: Option<(&'a Tensor, RecordSlots)>,
}

/// One parameter's part of the step's update launch (`UpdateDesc` in optim.cu).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct UpdateDesc {
    p: u64,
    p_out: u64,
    g: u64,
    a: u64,
    b: u64,
    c: u64,
    n: u64,
    rec: RecordArgs,
    sgd: SgdArgs,
    adam: AdamArgs,
    kind: i32,
    first_block: u32,
    nblocks: u32,
    pad: u32,
}

// SAFETY: plain-old-data with the C layout of the kernel's struct.
unsafe impl DeviceRepr for UpdateDesc {}

/// The scale policy's parameters (`ScalerArgs`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct ScalerArgs {
    growth_factor: f64,
    backoff_factor: f64,
    max_scale: f32,
    min_scale: f32,
    kind: i32,
    growth_interval: i32,
    hysteresis: i32,
    error_at_floor: i32,
}

// SAFETY: plain-old-data with the C layout of the kernels' structs.
unsafe impl DeviceRepr for SgdArgs {}
// SAFETY: as above.
unsafe impl DeviceRepr for AdamArgs {}
// SAFETY: as above.
unsafe impl DeviceRepr for ScalerArgs {}

/// Storage kind code of a dtype (the rounding target of an optimizer's intermediate ops).
fn kind(dtype: DType) -> Result<i32> {
    crate::device::cuda::buffer::kind_code(dtype)
}

fn ptr<T>(dev: &CudaDevice, s: &CudaSlice<T>) -> u64 {
    s.device_ptr(dev.stream()).0
}

/// The loss scaler's state in device memory: the scale as a one-element f32 tensor (the
/// loss is multiplied by it where it lies) and the trackers and per-step words.
pub struct DeviceScaler {
    dev: Arc<CudaDevice>,
    scale: Tensor,
    state: CudaSlice<u32>,
    /// The gradient descriptors of the unscale and clip launches, kept and grown.
    descs: std::sync::Mutex<Option<CudaSlice<GradDesc>>>,
}

/// One gradient of a launch over all of a step's gradients (`GradDesc` in optim.cu).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct GradDesc {
    g: u64,
    n: u64,
    kind: i32,
    first_block: u32,
    nblocks: u32,
    pad: u32,
}

// SAFETY: plain-old-data with the C layout of the kernel's struct.
unsafe impl DeviceRepr for GradDesc {}

impl DeviceScaler {
    /// The device copy of a scaler's state (`scale`, growth and hysteresis trackers).
    pub fn new(dev: &Arc<CudaDevice>, scale: f32, growth: i32, hysteresis: i32) -> Result<Self> {
        let s = dev.stream();
        let mut words = [0u32; STATE_WORDS];
        words[AMP_GROWTH] = growth as u32;
        words[AMP_HYST] = hysteresis as u32;
        let state = s
            .clone_htod(&words[..])
            .map_err(|e| dev_err("scaler state upload")(&e))?;
        let scale = Tensor::from_exact(vec![scale], &[1], DType::F32)?.to_device(dev)?;
        Ok(DeviceScaler {
            dev: dev.clone(),
            scale,
            state,
            descs: std::sync::Mutex::new(None),
        })
    }

    /// The scale as a device tensor of shape [1].
    pub fn scale(&self) -> &Tensor {
        &self.scale
    }

    fn state_ptr(&self) -> u64 {
        ptr(&self.dev, &self.state)
    }

    fn scale_ptr(&self) -> Result<u64> {
        Ok(arg(&self.scale, "scaler")?.0)
    }

    /// Queues `_amp_foreach_non_finite_check_and_unscale_` over `grads` (in place).
    pub fn unscale(&self, grads: &[&Tensor]) -> Result<()> {
        let (sp, st) = (self.scale_ptr()?, self.state_ptr());
        self.over_grads(grads, "unscale", |d, count, blocks| {
            let cfg = cudarc::driver::LaunchConfig {
                grid_dim: (blocks, 1, 1),
                block_dim: (crate::device::cuda::THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            launch_with!(self.dev, "amp_unscale_multi", cfg, d, &count, &sp, &st);
            Ok(())
        })
    }

    /// Uploads one descriptor per gradient (each on its own range of blocks, enough to fill
    /// a GPU) into the kept buffer and calls `launch` with it, the count and the total
    /// blocks: one launch for every gradient. Nothing for no gradients.
    fn over_grads(
        &self,
        grads: &[&Tensor],
        op: &str,
        launch: impl FnOnce(&CudaSlice<GradDesc>, u32, u32) -> Result<()>,
    ) -> Result<()> {
        if grads.is_empty() {
            return Ok(());
        }
        let mut descs = Vec::with_capacity(grads.len());
        let mut blocks = 0u32;
        for g in grads {
            let (gp, kind) = arg(g, op)?;
            let n = g.numel() as u64;
            let nblocks = stats_config(n).grid_dim.0;
            descs.push(GradDesc {
                g: gp,
                n,
                kind,
                first_block: blocks,
                nblocks,
                pad: 0,
            });
            blocks = blocks
                .checked_add(nblocks)
                .ok_or_else(|| Error::Device(format!("{op}: more than 2^32 blocks")))?;
        }
        let s = self.dev.stream();
        let mut kept = self.descs.lock().unwrap_or_else(|e| e.into_inner());
        if kept.as_ref().is_none_or(|d| d.len() < descs.len()) {
            let cap = descs.len().next_power_of_two().max(64);
            // SAFETY: every descriptor a launch reads is written by the copy below first.
            *kept = Some(
                unsafe { s.alloc::<GradDesc>(cap) }
                    .map_err(|e| dev_err("gradient descriptors")(&e))?,
            );
        }
        let buf = kept.as_mut().expect("allocated above");
        // The copy is ordered after the launches that read the previous contents.
        s.memcpy_htod(&descs[..], &mut buf.slice_mut(..descs.len()))
            .map_err(|e| dev_err("gradient descriptors")(&e))?;
        launch(buf, descs.len() as u32, blocks)
    }

    /// Queues the scale update of `cfg`'s policy from this step's inf checks.
    pub fn update(&self, cfg: &ScalerConfig) -> Result<()> {
        let mut a = ScalerArgs {
            growth_factor: cfg.growth_factor,
            backoff_factor: cfg.backoff_factor,
            growth_interval: cfg.growth_interval.min(i32::MAX as u32) as i32,
            kind: 3,
            ..Default::default()
        };
        match cfg.kind {
            ScalerKind::Default => a.kind = 0,
            ScalerKind::MaxClip { max_scale } => {
                a.kind = 1;
                a.max_scale = max_scale;
            }
            ScalerKind::Hysteresis {
                hysteresis,
                min_scale,
                error_at_floor,
            } => {
                a.kind = 2;
                a.hysteresis = hysteresis.min(i32::MAX as u32) as i32;
                a.min_scale = min_scale;
                a.error_at_floor = error_at_floor as i32;
            }
            ScalerKind::Fixed | ScalerKind::None => {}
        }
        let (sp, st) = (self.scale_ptr()?, self.state_ptr());
        launch!(self.dev, "amp_update_scale", 1, &sp, &st, &a);
        Ok(())
    }

    /// Queues the copy of the scaler's words into the step's scalars slot at `slot_ptr`
    /// (and clears the per-step words).
    pub fn summary(&self, slot_ptr: u64) -> Result<()> {
        let (sp, st) = (self.scale_ptr()?, self.state_ptr());
        launch!(self.dev, "amp_step_summary", 1, &sp, &st, &slot_ptr);
        Ok(())
    }

    /// Queues the clipping of `grads` (in place) to a total `norm_type` norm of at most
    /// `max_norm`, as `clip_grad_norm_` on the CPU (optim/clip.rs); the total norm and the
    /// coefficient land in the scaler's words.
    pub fn clip(&self, grads: &[&Tensor], max_norm: f32, norm_type: NormType) -> Result<()> {
        if max_norm.is_nan() || max_norm < 0.0 {
            return Err(Error::Invalid(format!(
                "clip_grad_norm: max_norm must be a non-negative number, got {max_norm}"
            )));
        }
        let inf = matches!(norm_type, NormType::Inf) as i32;
        let count = grads.len() as u64;
        let norms = output(&self.dev, &[grads.len().max(1)], DType::F32)?;
        let (np, _) = arg(&norms, "clip_grad_norm")?;
        let mut norm_dtype = None;
        for g in grads {
            if inf == 1 && g.numel() == 0 {
                return Err(Error::tensor(
                    "clip_grad_norm",
                    "the inf norm of an empty gradient is undefined",
                ));
            }
            norm_dtype = Some(norm_dtype.map_or(g.dtype(), |d| DType::promote(d, g.dtype())));
        }
        let Some(nd) = norm_dtype else {
            return Ok(());
        };
        self.over_grads(grads, "clip_grad_norm", |d, count, _| {
            launch!(
                self.dev,
                "amp_grad_norm_multi",
                count as u64,
                d,
                &count,
                &inf,
                &np
            );
            Ok(())
        })?;
        let nk = kind(nd)?;
        let st = self.state_ptr();
        launch!(
            self.dev,
            "amp_clip_coef",
            1,
            &np,
            &count,
            &nk,
            &inf,
            &max_norm,
            &st
        );
        self.over_grads(grads, "clip_grad_norm", |d, count, blocks| {
            let cfg = cudarc::driver::LaunchConfig {
                grid_dim: (blocks, 1, 1),
                block_dim: (crate::device::cuda::THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            launch_with!(self.dev, "amp_clip_apply_multi", cfg, d, &count, &st);
            Ok(())
        })?;
        // `norms` is freed on return; the stream orders that after the kernels above.
        Ok(())
    }

    /// Queues the optimizer update of `params` (name, value, gradient): new values in
    /// fresh buffers, the old ones copied on a skipped step.
    ///
    /// Each parameter with a gradient has its record slots: its update gathers the
    /// gradient's and the new value's statistics there, and the gradient's fp16 flushes
    /// under `scale` (the step's loss scale), in the same pass.
    pub fn optimizer_step(
        &self,
        opt: &mut DeviceOptimizer,
        lr: f64,
        scale: f32,
        params: &[ParamUpdate<'_>],
    ) -> Result<Vec<Tensor>> {
        let mut descs = Vec::new();
        let mut next_block = 0u32;
        let mut out = Vec::with_capacity(params.len());
        for u in params {
            match u.grad {
                Some((g, slots)) => {
                    let (d, nv) = opt.describe(
                        &self.dev,
                        lr,
                        u.name,
                        u.value,
                        g,
                        (slots, scale),
                        next_block,
                    )?;
                    next_block = next_block.checked_add(d.nblocks).ok_or_else(|| {
                        Error::Device("the optimizer's launch needs more than 2^32 blocks".into())
                    })?;
                    descs.push(d);
                    out.push(nv);
                }
                None => out.push(u.value.clone()),
            }
        }
        opt.launch(&self.dev, &descs, self.state_ptr())?;
        Ok(out)
    }
}

/// What the step's scalars slot says after the read.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepScalars {
    /// A gradient held inf/NaN (the step was skipped when scaling is on).
    pub found_inf: bool,
    /// The scale after the update.
    pub scale: f32,
    /// The growth tracker after the update.
    pub growth_tracker: i32,
    /// The hysteresis tracker after the update.
    pub hysteresis_tracker: i32,
    /// An overflow met the floor with `error_at_floor` (the update did not happen).
    pub floor_error: bool,
    /// Over/underflow of the unscale.
    pub unscale_rounding: RoundCounts,
    /// The clip's total norm.
    pub total_norm: f32,
    /// The clip coefficient.
    pub clip_coef: f32,
}

impl StepScalars {
    /// Decodes the scalars slot's words.
    pub fn parse(w: &[u64]) -> StepScalars {
        let f = |i: usize| f32::from_bits(w[i] as u32);
        StepScalars {
            found_inf: w[word::FOUND_INF] != 0,
            scale: f(word::SCALE),
            growth_tracker: w[word::GROWTH] as u32 as i32,
            hysteresis_tracker: w[word::HYST] as u32 as i32,
            floor_error: w[word::ERROR] != 0,
            unscale_rounding: RoundCounts {
                overflow: w[word::UNSCALE_OVER],
                underflow: w[word::UNSCALE_UNDER],
            },
            total_norm: f(word::TOTAL_NORM),
            clip_coef: f(word::CLIP_COEF),
        }
    }
}

/// Queues element 0 of `x` (as f64 bits) into the arena word at `word_ptr`.
pub fn scalar_to_word(x: &Tensor, word_ptr: u64) -> Result<()> {
    let dev = device_of("loss", &[x])?;
    let (xp, k) = arg(x, "loss")?;
    launch!(dev, "amp_scalar_to_word", 1, &xp, &k, &word_ptr);
    Ok(())
}

/// One parameter's optimizer state on the device.
#[derive(Default)]
struct ParamState {
    /// SGD's momentum buffer, or Adam's first moment.
    a: Option<CudaSlice<f32>>,
    /// Adam's second moment.
    b: Option<CudaSlice<f32>>,
    /// AMSGrad's running maximum.
    c: Option<CudaSlice<f32>>,
    /// Updates applied (committed after the step's read).
    updates: f32,
    /// Updated in the step now in flight (not yet committed).
    pending: bool,
}

/// SGD or Adam/AdamW with its state on the device, numerically the CPU optimizers.
pub struct DeviceOptimizer {
    cfg: OptimizerConfig,
    states: HashMap<String, ParamState>,
    /// The update launch's descriptors, kept and grown.
    descs: Option<CudaSlice<UpdateDesc>>,
}

impl DeviceOptimizer {
    /// An optimizer of `cfg` (hyper-parameters already validated by the host optimizer).
    pub fn new(cfg: &OptimizerConfig) -> DeviceOptimizer {
        DeviceOptimizer {
            cfg: cfg.clone(),
            states: HashMap::new(),
            descs: None,
        }
    }

    /// Updates applied to a parameter so far (after the last commit).
    pub fn updates(&self, name: &str) -> f32 {
        self.states.get(name).map_or(0.0, |s| s.updates)
    }

    /// Parameter `name`'s value after one update of it by `grad` at learning rate `lr`, in
    /// f64, from its state on the device as it is now (read back, waiting for the device;
    /// `sgd::exact_update`, `adam::exact_update`); `None` when the lengths differ.
    pub fn exact_step(
        &self,
        dev: &Arc<CudaDevice>,
        lr: f64,
        name: &str,
        param: &[f64],
        grad: &[f64],
    ) -> Result<Option<Vec<f64>>> {
        let st = self.states.get(name);
        let read = |b: Option<&CudaSlice<f32>>| -> Result<Option<Vec<f32>>> {
            b.map(|b| {
                let mut v = dev
                    .stream()
                    .clone_dtoh(b)
                    .map_err(|e| dev_err("optimizer state")(&e))?;
                // (an empty parameter's buffers hold one element)
                v.truncate(param.len());
                Ok(v)
            })
            .transpose()
        };
        let first = read(st.and_then(|s| s.a.as_ref()))?;
        let second = read(st.and_then(|s| s.b.as_ref()))?;
        let max_second = read(st.and_then(|s| s.c.as_ref()))?;
        let state = super::StateBefore {
            updates: st.map_or(0.0, |s| s.updates),
            first: first.as_deref(),
            second: second.as_deref(),
            max_second: max_second.as_deref(),
        };
        Ok(match &self.cfg {
            OptimizerConfig::Sgd(c) => super::sgd::exact_update(c, lr, state, param, grad),
            OptimizerConfig::Adam(c) => super::adam::exact_update(c, lr, state, param, grad),
            OptimizerConfig::AdamW(c) => {
                super::adam::exact_update(&AdamConfig::from(c.clone()), lr, state, param, grad)
            }
        })
    }

    /// Ends a step once its read is in: counts the update of every parameter stepped, or
    /// none when the step was skipped (the kernels then left state untouched).
    pub fn commit(&mut self, stepped: bool) {
        for s in self.states.values_mut() {
            if std::mem::take(&mut s.pending) && stepped {
                s.updates += 1.0;
            }
        }
    }

    /// Parameter `name`'s update as a descriptor of the step's one update launch (its new
    /// value's buffer allocated, its state created on first use), the new value beside it.
    #[allow(clippy::too_many_arguments)]
    fn describe(
        &mut self,
        dev: &Arc<CudaDevice>,
        lr: f64,
        name: &str,
        p: &Tensor,
        g: &Tensor,
        (slots, scale): (RecordSlots, f32),
        first_block: u32,
    ) -> Result<(UpdateDesc, Tensor)> {
        if p.shape() != g.shape() || p.dtype() != g.dtype() {
            return Err(Error::tensor(
                name,
                format!(
                    "gradient {} {:?} does not match the parameter {} {:?}",
                    g.dtype(),
                    g.shape(),
                    p.dtype(),
                    p.shape()
                ),
            ));
        }
        let n = p.numel();
        let out = output(dev, p.shape(), p.dtype())?;
        let st = self.states.entry(name.to_string()).or_default();
        st.pending = true;
        let zeros = |n: usize| -> Result<CudaSlice<f32>> {
            dev.stream()
                .alloc_zeros(n.max(1))
                .map_err(|e| dev_err("optimizer state")(&e))
        };
        let ((pp, k), (op, _), (gp, _)) = (arg(p, name)?, arg(&out, name)?, arg(g, name)?);
        let rec = dev.with_arena(|a| {
            let (gb, pb) = (&g.cuda(name)?.buf, &out.cuda(name)?.buf);
            Ok(RecordArgs {
                g_slot: a.word_ptr(dev, slots.grad, 0),
                g_partials: a.gather_in_kernel(dev, slots.grad, gb)?,
                p_slot: a.word_ptr(dev, slots.param, 0),
                p_partials: a.gather_in_kernel(dev, slots.param, pb)?,
                scale,
                pad: 0,
            })
        })?;
        let mut d = UpdateDesc {
            p: pp,
            p_out: op,
            g: gp,
            n: n as u64,
            rec,
            kind: k,
            first_block,
            nblocks: stats_config(n as u64).grid_dim.0,
            ..UpdateDesc::default()
        };
        match &self.cfg {
            OptimizerConfig::Sgd(c) => {
                d.sgd = sgd_args(c, lr, p.dtype(), st.updates == 0.0)?;
                if d.sgd.use_momentum == 1 && st.a.is_none() {
                    st.a = Some(zeros(n)?);
                }
            }
            OptimizerConfig::Adam(_) | OptimizerConfig::AdamW(_) => {
                let c = match &self.cfg {
                    OptimizerConfig::AdamW(c) => AdamConfig::from(c.clone()),
                    OptimizerConfig::Adam(c) => c.clone(),
                    OptimizerConfig::Sgd(_) => unreachable!("matched above"),
                };
                if st.a.is_none() {
                    st.a = Some(zeros(n)?);
                    st.b = Some(zeros(n)?);
                }
                if c.amsgrad && st.c.is_none() {
                    st.c = Some(zeros(n)?);
                }
                d.adam = adam_args(&c, lr, p.dtype(), st.updates + 1.0)?;
            }
        }
        d.a = st.a.as_ref().map_or(0, |b| ptr(dev, b));
        d.b = st.b.as_ref().map_or(0, |b| ptr(dev, b));
        d.c = st.c.as_ref().map_or(0, |b| ptr(dev, b));
        Ok((d, out.as_leaf(true)))
    }

    /// Queues every described update as one launch (descriptors uploaded into a buffer the
    /// optimizer keeps, so a warm step allocates nothing).
    fn launch(&mut self, dev: &Arc<CudaDevice>, descs: &[UpdateDesc], state: u64) -> Result<()> {
        let Some(last) = descs.last() else {
            return Ok(());
        };
        let blocks = last.first_block + last.nblocks;
        let s = dev.stream();
        if self.descs.as_ref().is_none_or(|d| d.len() < descs.len()) {
            let cap = descs.len().next_power_of_two().max(64);
            // SAFETY: every descriptor the launch reads is written by the copy below first.
            self.descs = Some(
                unsafe { s.alloc::<UpdateDesc>(cap) }
                    .map_err(|e| dev_err("optimizer descriptors")(&e))?,
            );
        }
        let all = self.descs.as_mut().expect("allocated above");
        s.memcpy_htod(descs, &mut all.slice_mut(..descs.len()))
            .map_err(|e| dev_err("optimizer descriptors")(&e))?;
        let name = match self.cfg {
            OptimizerConfig::Sgd(_) => "amp_sgd_multi",
            OptimizerConfig::Adam(_) | OptimizerConfig::AdamW(_) => "amp_adam_multi",
        };
        let count = descs.len() as u32;
        let view = all.slice(..descs.len());
        let cfg = cudarc::driver::LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (crate::device::cuda::THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        launch_with!(dev, name, cfg, &view, &count, &state);
        Ok(())
    }
}

/// SGD's scalars, rounded as sgd.rs rounds them.
fn sgd_args(c: &SgdConfig, lr: f64, dtype: DType, first: bool) -> Result<SgdArgs> {
    let od = c.state_precision.op_dtype(dtype);
    let r = |x: f32| crate::dtype::round_to(od, x);
    Ok(SgdArgs {
        neg_lr: r((-lr) as f32),
        wd: r(c.weight_decay as f32),
        momentum_alpha: r(c.momentum as f32),
        momentum: c.momentum as f32,
        one_minus_damp: r((1.0 - c.dampening) as f32),
        od: kind(od)?,
        use_wd: (c.weight_decay != 0.0) as i32,
        use_momentum: (c.momentum != 0.0) as i32,
        first: first as i32,
        nesterov: c.nesterov as i32,
        maximize: c.maximize as i32,
        pad: 0,
    })
}

/// Adam's scalars for update number `t` (1-based), as adam.rs computes them.
fn adam_args(c: &AdamConfig, lr: f64, dtype: DType, t: f32) -> Result<AdamArgs> {
    let (beta1, beta2) = c.betas;
    let od = c.state_precision.op_dtype(dtype);
    let t = f64::from(t);
    let bias_correction1 = 1.0 - beta1.powf(t);
    let bias_correction2 = 1.0 - beta2.powf(t);
    let step_size = lr / bias_correction1;
    Ok(AdamArgs {
        decay_factor: (1.0 - lr * c.weight_decay) as f32,
        lerp_weight: (1.0 - beta1) as f32,
        beta2: beta2 as f32,
        one_minus_beta2: (1.0 - beta2) as f32,
        eps: c.eps as f32,
        wd: crate::dtype::round_to(od, c.weight_decay as f32),
        bc2_sqrt: bias_correction2.powf(0.5) as f32,
        neg_step_size: (-step_size) as f32,
        od: kind(od)?,
        use_wd: (c.weight_decay != 0.0) as i32,
        decoupled: c.decoupled as i32,
        amsgrad: c.amsgrad as i32,
        maximize: c.maximize as i32,
        pad: 0,
    })
}
