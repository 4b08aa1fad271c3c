//! Layer 5 of `amprobe::LAYERS`: may use layers 0–4 (`dtype` … `amp`).
//!
//! The op recorder: autocast, the autograd tape, module scopes and probe events.
//!
//! Every op goes through [`Engine::record`]: its inputs have already been cast to the dtype
//! the op computes in (autocast and native type promotion insert explicit `to` ops, recorded
//! like any other), so each backward op produces gradients in the dtype its forward used, and
//! a cast's backward casts the gradient back.

pub mod blame;
pub mod observer;

use crate::amp::policy::{autocast_output_dtype, Category, DeviceType, PolicyTable};
use crate::dtype::{DType, RoundCounts};
use crate::error::{Error, Result};
use crate::tensor::{Tensor, TensorId};
use crate::trace::record::Phase;
use observer::{Blame, Observer, OpEvent, Operand, Released};
use std::cell::Cell;
use std::collections::HashMap;

thread_local! {
    /// Whether host ops on this thread check their outputs as they write them
    /// ([`finite_checks`]).
    static FINITE_CHECKS: Cell<bool> = const { Cell::new(false) };
}

/// Whether host ops running on this thread check, as they write an output, that every
/// value of it is finite, and say so in [`Computed::finite`]: asked for by a probe that
/// would otherwise read the output again only to find that out ([`FiniteChecks`]).
pub fn finite_checks() -> bool {
    FINITE_CHECKS.with(Cell::get)
}

/// Turns [`finite_checks`] on or off on this thread until dropped, which puts back the
/// setting it found.
pub struct FiniteChecks {
    was: bool,
}

impl FiniteChecks {
    /// Sets the checks on this thread to `on`.
    pub fn set(on: bool) -> FiniteChecks {
        FiniteChecks {
            was: FINITE_CHECKS.with(|c| c.replace(on)),
        }
    }
}

impl Drop for FiniteChecks {
    fn drop(&mut self) {
        FINITE_CHECKS.with(|c| c.set(self.was));
    }
}

/// A gradient produced by a backward op, with the rounding it suffered.
pub struct Grad {
    /// The gradient, in the dtype of the input it belongs to.
    pub tensor: Tensor,
    /// Over/underflow when the gradient was rounded to its dtype.
    pub rounding: RoundCounts,
    /// The device arena slot where a device kernel counts that rounding (then `rounding`
    /// is zero until the step's arena read resolves it).
    pub slot: Option<u32>,
    /// The output holds the values of the op's first input (for a backward op, of the
    /// output gradient), only moved: a transpose's or permute's copy. Probes take its
    /// statistics from that input's.
    pub permuted: bool,
    /// Every value of the gradient is known to be finite ([`Computed::finite`]).
    pub finite: bool,
}

/// Computes the gradients of an op's inputs from the gradient of its output.
pub type BackwardFn = Box<dyn Fn(&Tensor) -> Result<Vec<Option<Grad>>> + Send + Sync>;

/// The result of a kernel: an output tensor and the rounding it suffered.
pub struct Computed {
    /// Output tensor (not yet on the tape).
    pub tensor: Tensor,
    /// Over/underflow counted where the op rounded to its output dtype.
    pub rounding: RoundCounts,
    /// -inf values written on purpose (attention masks): not an origin.
    pub masked_neg_inf: u64,
    /// The device arena slot where the op's kernel counts its rounding (then `rounding` is
    /// zero until the step's one arena read resolves it); None on the host.
    pub slot: Option<u32>,
    /// The output holds the values of the op's first input (for a backward op, of the
    /// output gradient), only moved: a transpose's or permute's copy. Probes take its
    /// statistics from that input's.
    pub permuted: bool,
    /// Every value of the output is known to be finite: the op checked as it wrote the
    /// output, where [`finite_checks`] asks it to. False when that is not known.
    pub finite: bool,
}

impl Computed {
    /// A result with its rounding counts (host ops count as they round).
    pub fn new(tensor: Tensor, rounding: RoundCounts) -> Computed {
        Computed {
            tensor,
            rounding,
            masked_neg_inf: 0,
            slot: None,
            permuted: false,
            finite: false,
        }
    }

    /// A device result whose rounding counts are pending in arena slot `slot`.
    pub fn pending(tensor: Tensor, slot: u32) -> Computed {
        Computed {
            tensor,
            rounding: RoundCounts::default(),
            masked_neg_inf: 0,
            slot: Some(slot),
            permuted: false,
            finite: false,
        }
    }
}

/// A forward input as the tape keeps it.
enum Saved {
    /// A tensor no op of the tape made (a parameter, the batch, a constant): kept whole,
    /// as its owner keeps it anyway.
    Held(Tensor),
    /// A tensor an op of the tape made: only what it was. Its values stay alive only where
    /// the backward function captured them, so activations that no gradient formula needs
    /// are freed during the forward pass.
    Made(Released),
}

impl Saved {
    fn of(t: &Tensor) -> Saved {
        if t.is_leaf() {
            Saved::Held(t.clone())
        } else {
            Saved::Made(Released::of(t))
        }
    }
    fn id(&self) -> TensorId {
        self.operand().id()
    }
    /// Tensors the tape made always require a gradient.
    fn requires_grad(&self) -> bool {
        match self {
            Saved::Held(t) => t.requires_grad(),
            Saved::Made(_) => true,
        }
    }
    fn is_leaf(&self) -> bool {
        matches!(self, Saved::Held(_))
    }
    fn operand(&self) -> Operand<'_> {
        match self {
            Saved::Held(t) => Operand::Tensor(t),
            Saved::Made(r) => Operand::Released(r),
        }
    }
}

struct Node {
    index: u64,
    op: &'static str,
    module: String,
    inputs: Vec<Saved>,
    wrt: &'static [&'static str],
    output: TensorId,
    backward: BackwardFn,
    /// While blaming: the op done again in f64, whose tapes give its exact gradients.
    blame: Option<Box<NodeBlame>>,
}

/// What blaming a forward op keeps for its backward, where the op is done again on
/// scratch engines with a tape: its inputs and output as the run had them, the inputs'
/// shadows, which of them need a gradient, the largest error they carry, and how to do
/// the op again.
struct NodeBlame {
    inputs: Vec<Tensor>,
    output: Tensor,
    shadows: Vec<Tensor>,
    needs: Vec<bool>,
    input: f64,
    recompute: Recompute,
}

/// A chosen op whose output gets a value written into it: a test hook for origin tracking.
#[derive(Debug, Clone)]
pub struct Injection {
    /// Step to inject at (None: every step).
    pub step: Option<u64>,
    /// Op kind (e.g. `relu`).
    pub op: String,
    /// Module path of the op (exact).
    pub module: String,
    /// Phase (forward or backward).
    pub phase: Phase,
    /// Value written into element 0 of the output.
    pub value: f32,
}

/// Autocast settings of a forward pass.
#[derive(Debug, Clone)]
pub struct Autocast {
    /// The low-precision dtype ops of the lower_precision_fp list run in.
    pub dtype: DType,
    /// The policy table of the target device type.
    pub table: PolicyTable,
}

/// Records ops, runs autocast, keeps the tape and tells observers.
pub struct Engine {
    tape: Vec<Node>,
    grad_enabled: bool,
    autocast: Option<Autocast>,
    autocast_disabled: usize,
    module_stack: Vec<String>,
    keep_fp32: Vec<String>,
    cast_cache: HashMap<(TensorId, DType), Tensor>,
    weight_casts: u64,
    observers: Vec<Box<dyn Observer>>,
    op_index: u64,
    step: u64,
    micro: u32,
    phase: Phase,
    injections: Vec<Injection>,
    seed: u64,
    /// Additive attention masks of the current forward (their dtype's lowest finite value
    /// where attention is masked), by tensor.
    masks: Vec<TensorId>,
    /// True while the ops that make such a mask run.
    making_mask: bool,
    /// Whether ops are blamed ([`Engine::set_blame`]).
    blame: bool,
    /// The all-f64 shadow of each forward output made while blaming, by tensor.
    shadows: HashMap<TensorId, Tensor>,
    /// The shadows of the leaf gradients the last blamed backward made, by leaf.
    gradient_shadows: HashMap<TensorId, Tensor>,
    /// On a scratch engine redoing an op from its own inputs for its backward's blame: the
    /// run's output of the op, widened, which an op whose gradient reads its output takes
    /// in place of its own ([`Engine::output_as_saved`]).
    saved_output: Option<Tensor>,
}

/// Does an op again, by the same engine method, on a scratch engine ([`Engine::scratch`])
/// and from other inputs of the same shapes (f64 ones, integer ones as they were): what
/// blaming compares the op's output with and, through the scratch engine's tape, its
/// gradients.
pub type Recompute = Box<dyn Fn(&mut Engine, &[Tensor]) -> Result<Tensor> + Send + Sync>;

impl Default for Engine {
    fn default() -> Self {
        Engine::new()
    }
}

impl Engine {
    /// An engine with autocast off and no observers.
    pub fn new() -> Engine {
        Engine {
            tape: Vec::new(),
            grad_enabled: true,
            autocast: None,
            autocast_disabled: 0,
            module_stack: Vec::new(),
            keep_fp32: Vec::new(),
            cast_cache: HashMap::new(),
            weight_casts: 0,
            observers: Vec::new(),
            op_index: 0,
            step: 0,
            micro: 0,
            phase: Phase::Forward,
            injections: Vec::new(),
            seed: 0,
            masks: Vec::new(),
            making_mask: false,
            blame: false,
            shadows: HashMap::new(),
            gradient_shadows: HashMap::new(),
            saved_output: None,
        }
    }

    /// `out`, or on a scratch engine redoing an op for its backward's blame, the run's
    /// output in its place: an op whose gradient reads its output (softmax, exp, ...)
    /// passes its output through here before its backward takes it, so that the gradient
    /// done again from the op's own inputs reads what the run saved, rounding included.
    pub fn output_as_saved(&mut self, mut out: Computed) -> Result<Computed> {
        if let Some(saved) = self.saved_output.take() {
            if saved.shape() != out.tensor.shape() {
                return Err(Error::Invalid(format!(
                    "blame: the saved output {:?} is not the redone op's {:?}",
                    saved.shape(),
                    out.tensor.shape()
                )));
            }
            out.tensor = saved;
        }
        Ok(out)
    }

    /// An engine to do one op of module `module` again on: autocast off, no observers,
    /// and this engine's seed, step and micro-batch (a dropout draws the same mask).
    pub fn scratch(&self, module: &str) -> Engine {
        Engine {
            seed: self.seed,
            step: self.step,
            micro: self.micro,
            module_stack: vec![module.to_string()],
            ..Engine::new()
        }
    }

    /// Turns autocast on (Some) or off (None) for following forward ops.
    pub fn set_autocast(&mut self, ac: Option<Autocast>) {
        self.autocast = ac;
    }

    /// Autocast dtype when autocast is on.
    pub fn autocast_dtype(&self) -> Option<DType> {
        self.autocast.as_ref().map(|a| a.dtype)
    }

    /// Module path patterns whose ops run with autocast disabled (kept in fp32).
    pub fn set_keep_fp32(&mut self, patterns: Vec<String>) {
        self.keep_fp32 = patterns;
    }

    /// True when `path` matches one of the keep-in-fp32 patterns.
    pub fn is_kept_fp32(&self, path: &str) -> bool {
        self.keep_fp32.iter().any(|p| module_matches(p, path))
    }

    /// Adds an observer; it sees every op from now on.
    pub fn add_observer(&mut self, obs: Box<dyn Observer>) {
        self.observers.push(obs);
    }

    /// Removes and returns all observers.
    pub fn take_observers(&mut self) -> Vec<Box<dyn Observer>> {
        std::mem::take(&mut self.observers)
    }

    /// Mutable access to the observers.
    pub fn observers_mut(&mut self) -> &mut Vec<Box<dyn Observer>> {
        &mut self.observers
    }

    /// Adds an injection (test hook).
    pub fn add_injection(&mut self, inj: Injection) {
        self.injections.push(inj);
    }

    /// Seed for dropout masks.
    pub fn set_seed(&mut self, seed: u64) {
        self.seed = seed;
    }

    /// Seed for dropout masks.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Starts a step: op indices restart at 0.
    pub fn begin_step(&mut self, step: u64) {
        self.shadows.clear();
        self.gradient_shadows.clear();
        self.step = step;
        self.micro = 0;
        self.op_index = 0;
        self.phase = Phase::Forward;
        for o in &mut self.observers {
            o.begin_step(step);
        }
    }

    /// Starts a micro-batch within the step; the weight-cast cache is cleared (one forward).
    pub fn begin_micro(&mut self, micro: u32) {
        self.shadows.clear();
        self.micro = micro;
        self.phase = Phase::Forward;
        self.cast_cache.clear();
        self.masks.clear();
    }

    /// Marks `mask` as an additive attention mask (0 where attention goes, its dtype's
    /// lowest finite value where it is masked, as transformers' eager masks are): the ops
    /// that take it record `additive_mask`, so the -inf they make (fp16's −65504 plus a
    /// negative score) is the mask's, not an origin, and its extreme values are no
    /// headroom warning.
    pub fn mark_mask(&mut self, mask: &Tensor) {
        self.masks.push(mask.id());
    }

    /// Runs `f`, which makes an additive attention mask: its ops record `additive_mask`,
    /// and its result is marked as [`Engine::mark_mask`] does.
    pub fn make_mask(&mut self, f: impl FnOnce(&mut Engine) -> Result<Tensor>) -> Result<Tensor> {
        let was = std::mem::replace(&mut self.making_mask, true);
        let r = f(self);
        self.making_mask = was;
        let t = r?;
        self.mark_mask(&t);
        Ok(t)
    }

    /// Current step.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Current micro-batch.
    pub fn micro(&self) -> u32 {
        self.micro
    }

    /// Number of fp32 parameters cast to a low dtype since the counter was last taken.
    pub fn take_weight_casts(&mut self) -> u64 {
        std::mem::take(&mut self.weight_casts)
    }

    /// Disables gradient recording (evaluation); returns the previous setting.
    pub fn set_grad_enabled(&mut self, on: bool) -> bool {
        std::mem::replace(&mut self.grad_enabled, on)
    }

    /// Enters a module scope: ops get the dotted path of the scopes.
    pub fn push_module(&mut self, name: &str) {
        self.module_stack.push(name.to_string());
    }

    /// Leaves the innermost module scope.
    pub fn pop_module(&mut self) {
        self.module_stack.pop();
    }

    /// Dotted path of the current module scope.
    pub fn module_path(&self) -> String {
        self.module_stack
            .iter()
            .filter(|s| !s.is_empty())
            .cloned()
            .collect::<Vec<_>>()
            .join(".")
    }

    /// Runs `f` inside a module scope.
    pub fn scope<T>(&mut self, name: &str, f: impl FnOnce(&mut Engine) -> Result<T>) -> Result<T> {
        self.push_module(name);
        let r = f(self);
        self.pop_module();
        r
    }

    /// Runs `f` with autocast disabled (a nested `autocast(enabled=False)` region).
    pub fn autocast_off<T>(&mut self, f: impl FnOnce(&mut Engine) -> Result<T>) -> Result<T> {
        self.autocast_disabled += 1;
        let r = f(self);
        self.autocast_disabled -= 1;
        r
    }

    fn autocast_active(&self) -> Option<&Autocast> {
        if self.autocast_disabled > 0 || self.phase != Phase::Forward {
            return None;
        }
        let ac = self.autocast.as_ref()?;
        if !self.keep_fp32.is_empty() && self.is_kept_fp32(&self.module_path()) {
            return None;
        }
        Some(ac)
    }

    /// The autocast category of `op` when autocast is active here (None when it is off).
    pub fn autocast_category(&self, op: &str) -> Option<Category> {
        self.autocast_active().map(|ac| ac.table.category(op))
    }

    /// Casts the inputs of `op` as autocast and native type promotion require, recording
    /// each cast. Integer tensors pass through.
    pub fn prepare(&mut self, op: &'static str, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        let dtypes: Vec<DType> = inputs.iter().map(|t| t.dtype()).collect();
        let mut target = None;
        if let Some(ac) = self.autocast_active() {
            let cat = ac.table.category(op);
            if cat == Category::Banned {
                return Err(Error::Invalid(format!(
                    "{op} is not allowed under autocast (PyTorch bans it as unsafe)"
                )));
            }
            target = autocast_output_dtype(cat, ac.dtype, &dtypes)?;
        }
        let mut out = Vec::with_capacity(inputs.len());
        for t in inputs {
            let eligible = t.dtype().is_float() && t.dtype() != DType::F64;
            match target {
                Some(d) if eligible && t.dtype() != d => out.push(self.autocast_cast(t, d)?),
                _ => out.push((*t).clone()),
            }
        }
        // Native promotion: mixed floating dtypes compute in the widest one.
        let widest = out
            .iter()
            .filter(|t| t.dtype().is_float())
            .map(|t| t.dtype())
            .reduce(DType::promote);
        if let Some(w) = widest {
            for t in out.iter_mut() {
                if t.dtype().is_float() && t.dtype() != w {
                    *t = self.to_dtype(t, w)?;
                }
            }
        }
        Ok(out)
    }

    /// Casts a parameter to `d` once per forward (cached like autocast's weight cache and
    /// counted as a weight cast).
    pub fn cast_param(&mut self, t: &Tensor, d: DType) -> Result<Tensor> {
        self.autocast_cast(t, d)
    }

    fn autocast_cast(&mut self, t: &Tensor, d: DType) -> Result<Tensor> {
        // PyTorch caches casts of fp32 leaf parameters for the duration of the autocast region.
        let cacheable = t.is_leaf() && t.requires_grad() && t.dtype() == DType::F32;
        if cacheable {
            if let Some(c) = self.cast_cache.get(&(t.id(), d)) {
                return Ok(c.clone());
            }
        }
        let c = self.to_dtype(t, d)?;
        if cacheable {
            self.weight_casts += 1;
            self.cast_cache.insert((t.id(), d), c.clone());
        }
        Ok(c)
    }

    /// Records an op that has been computed: tells observers and, when a gradient flows,
    /// puts it on the tape. `inputs` are the (already cast) inputs, `wrt` names them;
    /// `recompute` computes the op again from f64 inputs, for blame ([`Engine::set_blame`]).
    pub fn record(
        &mut self,
        op: &'static str,
        inputs: &[&Tensor],
        wrt: &'static [&'static str],
        mut out: Computed,
        backward: Option<BackwardFn>,
        recompute: Recompute,
    ) -> Result<Tensor> {
        let needs_grad =
            self.grad_enabled && backward.is_some() && inputs.iter().any(|t| t.requires_grad());
        let (blamed, node_blame) = if self.blame {
            let (b, shadow, node) = self.blame_of(inputs, &out.tensor, recompute, needs_grad)?;
            (Some((b, shadow)), node)
        } else {
            (None, None)
        };
        let index = self.op_index;
        self.op_index += 1;
        let module = self.module_path();
        self.apply_injection(op, &module, Phase::Forward, &mut out)?;
        let tensor = if needs_grad {
            let node = self.tape.len();
            let t = out.tensor.with_node(Some(node), true);
            self.tape.push(Node {
                index,
                op,
                module: module.clone(),
                inputs: inputs.iter().map(|t| Saved::of(t)).collect(),
                wrt,
                output: t.id(),
                backward: backward.expect("checked above"),
                blame: node_blame,
            });
            t
        } else {
            out.tensor
        };
        if !self.observers.is_empty() {
            let operands: Vec<Operand> = inputs.iter().map(|t| Operand::Tensor(t)).collect();
            let ev = OpEvent {
                step: self.step,
                micro: self.micro,
                index,
                phase: Phase::Forward,
                op,
                module: &module,
                inputs: &operands,
                output: &tensor,
                rounding: out.rounding,
                slot: out.slot,
                forward_op: None,
                wrt: None,
                masked_neg_inf: out.masked_neg_inf,
                additive_mask: self.making_mask
                    || inputs.iter().any(|t| self.masks.contains(&t.id())),
                permuted: out.permuted,
                finite: out.finite,
                blame: blamed.as_ref().map(|b| b.0),
            };
            for o in &mut self.observers {
                o.on_op(&ev);
            }
        }
        if let Some((_, shadow)) = blamed {
            self.shadows.insert(tensor.id(), shadow);
        }
        Ok(tensor)
    }

    fn apply_injection(
        &self,
        op: &str,
        module: &str,
        phase: Phase,
        out: &mut Computed,
    ) -> Result<()> {
        let hit = self.injections.iter().find(|i| {
            i.op == op
                && i.module == module
                && i.phase == phase
                && i.step.is_none_or(|s| s == self.step)
        });
        if let Some(inj) = hit {
            // A test hook: on a device the output makes a round trip through the host.
            let t = &out.tensor;
            let mut data = t.to_host()?.f32s()?.to_vec();
            if let Some(x) = data.first_mut() {
                *x = inj.value;
            }
            let host = Tensor::from_exact(data, t.shape(), t.dtype())?;
            out.tensor = match t.device() {
                Some(dev) => host.to_device(dev)?,
                None => host,
            };
            out.finite = false;
        }
        Ok(())
    }

    /// Emits an optimizer-phase event (unscale, clip, parameter update) for observers, with
    /// its blame where the step blames it.
    pub fn emit_optimizer_op(
        &mut self,
        op: &'static str,
        module: &str,
        inputs: &[&Tensor],
        output: &Tensor,
        blame: Option<Blame>,
    ) {
        let index = self.op_index;
        self.op_index += 1;
        if self.observers.is_empty() {
            return;
        }
        let operands: Vec<Operand> = inputs.iter().map(|t| Operand::Tensor(t)).collect();
        let ev = OpEvent {
            step: self.step,
            micro: self.micro,
            index,
            phase: Phase::Optimizer,
            op,
            module,
            inputs: &operands,
            output,
            rounding: RoundCounts::default(),
            slot: None,
            forward_op: None,
            wrt: None,
            masked_neg_inf: 0,
            additive_mask: false,
            permuted: false,
            finite: false,
            blame,
        };
        for o in &mut self.observers {
            o.on_op(&ev);
        }
    }

    /// True when observers are attached (probes on).
    pub fn probing(&self) -> bool {
        !self.observers.is_empty()
    }

    /// Runs the backward pass from `root` (seeded with ones of its dtype) and returns the
    /// gradients of the leaf tensors that require one. The tape is consumed.
    pub fn backward(&mut self, root: &Tensor) -> Result<HashMap<TensorId, Tensor>> {
        let seed = match root.dtype() {
            DType::F64 => Tensor::from_f64(vec![1.0; root.numel()], root.shape())?,
            d => Tensor::from_exact(vec![1.0; root.numel()], root.shape(), d)?,
        };
        let seed = match root.device() {
            Some(dev) => seed.to_device(dev)?,
            None => seed,
        };
        self.backward_with(root, seed)
    }

    /// Runs the backward pass from `root` with the given output gradient.
    pub fn backward_with(
        &mut self,
        root: &Tensor,
        seed: Tensor,
    ) -> Result<HashMap<TensorId, Tensor>> {
        self.phase = Phase::Backward;
        let tape = std::mem::take(&mut self.tape);
        let mut grads: HashMap<TensorId, Tensor> = HashMap::new();
        let mut leaves: HashMap<TensorId, Tensor> = HashMap::new();
        if root.requires_grad() {
            if root.is_leaf() {
                leaves.insert(root.id(), seed);
            } else {
                grads.insert(root.id(), seed);
            }
        }
        // While blaming: the all-f64 shadow of each gradient, by the tensor it is for.
        let mut shadows: HashMap<TensorId, Tensor> = HashMap::new();
        for node in tape.into_iter().rev() {
            let Some(g_out) = grads.remove(&node.output) else {
                continue;
            };
            let results = (node.backward)(&g_out)?;
            let blamed = match &node.blame {
                Some(nb) => Some(self.blamed_gradients(
                    nb,
                    &node.module,
                    &g_out,
                    shadows.remove(&node.output),
                )?),
                None => None,
            };
            for (i, r) in results.into_iter().enumerate() {
                let Some(Grad {
                    tensor,
                    rounding,
                    slot,
                    permuted,
                    finite,
                }) = r
                else {
                    continue;
                };
                let Some(input) = node.inputs.get(i) else {
                    continue;
                };
                if !input.requires_grad() {
                    continue;
                }
                let mut comp = Computed {
                    slot,
                    permuted,
                    finite,
                    ..Computed::new(tensor, rounding)
                };
                self.apply_injection(node.op, &node.module, Phase::Backward, &mut comp)?;
                let tensor = comp.tensor;
                let (blame, shadow) = match &blamed {
                    Some(b) => b.blame_of_input(i, &tensor)?,
                    None => (None, None),
                };
                let index = self.op_index;
                self.op_index += 1;
                if !self.observers.is_empty() {
                    let mut ins = vec![Operand::Tensor(&g_out)];
                    ins.extend(node.inputs.iter().map(Saved::operand));
                    let ev = OpEvent {
                        step: self.step,
                        micro: self.micro,
                        index,
                        phase: Phase::Backward,
                        op: node.op,
                        module: &node.module,
                        inputs: &ins,
                        output: &tensor,
                        rounding: comp.rounding,
                        slot: comp.slot,
                        forward_op: Some(node.index),
                        wrt: node.wrt.get(i).copied(),
                        masked_neg_inf: 0,
                        additive_mask: false,
                        permuted: comp.permuted,
                        finite: comp.finite,
                        blame,
                    };
                    for o in &mut self.observers {
                        o.on_op(&ev);
                    }
                }
                let id = input.id();
                let target = if input.is_leaf() {
                    &mut leaves
                } else {
                    &mut grads
                };
                let (merged, shadow) = match target.remove(&id) {
                    Some(prev) => {
                        let both = shadows.remove(&id).zip(shadow);
                        let both = both.as_ref().map(|(a, b)| (a, *b));
                        self.accumulate(&prev, &tensor, both, &node.module, node.index)?
                    }
                    None => (tensor, shadow.cloned()),
                };
                target.insert(id, merged);
                if let Some(s) = shadow {
                    shadows.insert(id, s);
                }
            }
        }
        self.phase = Phase::Forward;
        shadows.retain(|id, _| leaves.contains_key(id));
        self.gradient_shadows = shadows;
        Ok(leaves)
    }

    /// The all-f64 shadows of the leaf gradients the last backward made while blaming,
    /// by leaf (empty when it blamed nothing).
    pub fn take_gradient_shadows(&mut self) -> HashMap<TensorId, Tensor> {
        std::mem::take(&mut self.gradient_shadows)
    }

    /// Adds two gradients of one tensor (it fed several ops), in its dtype; with their
    /// shadows while blaming, the sum's shadow too.
    fn accumulate(
        &mut self,
        a: &Tensor,
        b: &Tensor,
        shadows: Option<(&Tensor, &Tensor)>,
        module: &str,
        forward_op: u64,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let (tensor, rounding, slot) = a.add_same(b, "accumulate_grad")?;
        let sum = Computed {
            slot,
            ..Computed::new(tensor, rounding)
        };
        let (blame, shadow) = match shadows {
            Some(shadows) => self.blame_of_sum((a, b), shadows, &sum.tensor)?,
            None => (None, None),
        };
        let index = self.op_index;
        self.op_index += 1;
        if !self.observers.is_empty() {
            let ins = [Operand::Tensor(a), Operand::Tensor(b)];
            let ev = OpEvent {
                step: self.step,
                micro: self.micro,
                index,
                phase: Phase::Backward,
                op: "accumulate_grad",
                module,
                inputs: &ins,
                output: &sum.tensor,
                rounding: sum.rounding,
                slot: sum.slot,
                forward_op: Some(forward_op),
                wrt: None,
                masked_neg_inf: 0,
                additive_mask: false,
                permuted: false,
                finite: sum.finite,
                blame,
            };
            for o in &mut self.observers {
                o.on_op(&ev);
            }
        }
        Ok((sum.tensor, shadow))
    }

    /// Drops a tape that will not be used (e.g. after an evaluation forward).
    pub fn clear_tape(&mut self) {
        self.tape.clear();
    }

    /// Number of nodes on the tape.
    pub fn tape_len(&self) -> usize {
        self.tape.len()
    }
}

/// Default policy table for a device type name.
pub fn policy_for(device: DeviceType) -> PolicyTable {
    PolicyTable::for_device(device)
}

/// True when the dotted `pattern` matches whole segments of `path`, contiguously
/// (`wo` matches `encoder.block.3.layer.1.DenseReluDense.wo`, not `wox`); `*` matches any
/// one segment.
pub fn module_matches(pattern: &str, path: &str) -> bool {
    let p: Vec<&str> = pattern.split('.').filter(|s| !s.is_empty()).collect();
    let s: Vec<&str> = path.split('.').filter(|s| !s.is_empty()).collect();
    if p.is_empty() || p.len() > s.len() {
        return false;
    }
    (0..=s.len() - p.len()).any(|i| p.iter().zip(&s[i..]).all(|(a, b)| *a == "*" || a == b))
}

#[cfg(test)]
mod tests {
    use super::module_matches;

    #[test]
    fn module_patterns_match_whole_segments() {
        assert!(module_matches(
            "wo",
            "encoder.block.3.layer.1.DenseReluDense.wo"
        ));
        assert!(!module_matches(
            "wo",
            "encoder.block.3.layer.1.DenseReluDense.wox"
        ));
        assert!(module_matches("block.3", "encoder.block.3.layer.1"));
        assert!(!module_matches("block.3", "encoder.block.13.layer.1"));
        assert!(module_matches(
            "block.*.layer.1",
            "encoder.block.2.layer.1.DenseReluDense"
        ));
        assert!(!module_matches("", "fc1"));
    }
}
