//! The one observer trait probes implement; the engine never knows who listens.

use crate::dtype::{DType, RoundCounts};
use crate::tensor::{Tensor, TensorId};
use crate::trace::record::Phase;

/// One op as it happened: its inputs, output and where it ran.
pub struct OpEvent<'a> {
    /// Training step.
    pub step: u64,
    /// Micro-batch within the step (gradient accumulation).
    pub micro: u32,
    /// Op index within the step, in execution order over all phases.
    pub index: u64,
    /// Forward, backward or optimizer.
    pub phase: Phase,
    /// Op kind (ATen-style name: `linear`, `softmax`, `to`, ...).
    pub op: &'a str,
    /// Dotted module path (`encoder.block.3.layer.1.DenseReluDense.wo`).
    pub module: &'a str,
    /// Inputs as the op saw them (backward ops: the output gradient first, then the forward
    /// op's inputs, which the tape may have released).
    pub inputs: &'a [Operand<'a>],
    /// Output (backward ops: the gradient of one input).
    pub output: &'a Tensor,
    /// Over/underflow counted when the op rounded its output to its dtype.
    pub rounding: RoundCounts,
    /// For a device op: the arena slot where its kernel counts that rounding (`rounding`
    /// is zero until the step's arena read), and where probes put the output's statistics.
    pub slot: Option<u32>,
    /// For backward ops: the index of the forward op they belong to.
    pub forward_op: Option<u64>,
    /// For backward ops: the input the gradient is for (`input`, `weight`, ...).
    pub wrt: Option<&'a str>,
    /// -inf values the op wrote on purpose (masks), not a numerical failure.
    pub masked_neg_inf: u64,
    /// The op makes or applies an additive attention mask ([`super::Engine::mark_mask`]).
    pub additive_mask: bool,
    /// The output holds the values of `inputs[0]`, only moved (a transpose's copy).
    pub permuted: bool,
    /// Every value of the output is known to be finite: the op checked as it wrote it
    /// ([`super::finite_checks`]). False when that is not known.
    pub finite: bool,
    /// Where the op's error against exact arithmetic came from, when the engine blames
    /// ([`super::Engine::set_blame`]; forward and backward ops; the trainer blames the
    /// optimizer phase's).
    pub blame: Option<Blame>,
}

/// The relative errors of one op's output, each `‖a − b‖₂ / ‖b‖₂` over the
/// positions where both are finite (0 when equal, infinite when only the reference is 0).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Blame {
    /// The output against the op recomputed in f64 from its own inputs: the error the op
    /// introduces by its own rounding and arithmetic.
    pub introduced: f64,
    /// The op recomputed from its own inputs against the all-f64 shadow of the step: the
    /// error its inputs carry in, as this op passes it on.
    pub inherited: f64,
    /// The output against the shadow: both together.
    pub total: f64,
    /// The largest relative error of its floating inputs against their shadows.
    pub input: f64,
}

/// What the tape keeps of a forward input that an op of the same step made and that the
/// backward pass needs no values of: which tensor it was, without its storage. Holding
/// only this lets the values go as soon as nothing else uses them, as PyTorch frees what
/// no backward formula saves.
#[derive(Debug, Clone)]
pub struct Released {
    /// The tensor's id (observers found it as the output of the op that made it).
    pub id: TensorId,
    /// Its dtype.
    pub dtype: DType,
    /// Its shape.
    pub shape: Vec<usize>,
}

impl Released {
    /// What is kept of `t`.
    pub fn of(t: &Tensor) -> Released {
        Released {
            id: t.id(),
            dtype: t.dtype(),
            shape: t.shape().to_vec(),
        }
    }
}

/// An op's input as observers see it: the tensor, or (a backward op's forward input
/// that the tape did not keep) what it was.
#[derive(Debug, Clone, Copy)]
pub enum Operand<'a> {
    /// The tensor itself, values included.
    Tensor(&'a Tensor),
    /// A forward input made by an op of this step, whose values the tape released.
    Released(&'a Released),
}

impl<'a> Operand<'a> {
    /// The tensor's id.
    pub fn id(&self) -> TensorId {
        match self {
            Operand::Tensor(t) => t.id(),
            Operand::Released(r) => r.id,
        }
    }
    /// Its dtype.
    pub fn dtype(&self) -> DType {
        match self {
            Operand::Tensor(t) => t.dtype(),
            Operand::Released(r) => r.dtype,
        }
    }
    /// Its shape.
    pub fn shape(&self) -> &'a [usize] {
        match self {
            Operand::Tensor(t) => t.shape(),
            Operand::Released(r) => &r.shape,
        }
    }
    /// The tensor with its values, where they are still held.
    pub fn tensor(&self) -> Option<&'a Tensor> {
        match self {
            Operand::Tensor(t) => Some(t),
            Operand::Released(_) => None,
        }
    }
}

/// Something that watches ops: statistics, origin tracking, live views.
pub trait Observer: Send {
    /// A new step begins.
    fn begin_step(&mut self, _step: u64) {}
    /// One op finished.
    fn on_op(&mut self, ev: &OpEvent<'_>);
    /// Lets callers downcast to the concrete observer.
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any;
}
