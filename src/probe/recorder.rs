//! The standard probe: statistics of every op's output, and the origin of the first Inf and
//! the first NaN with the chain of ops between them.

use super::stats::TensorStats;
use crate::engine::observer::{Observer, OpEvent};
use crate::tensor::{Storage, Tensor, TensorId};
use crate::trace::record::{OpRecord, OpRef, Origins, TensorMeta};
use std::collections::{HashMap, HashSet};

/// Non-finite content of a tensor.
#[derive(Debug, Clone, Copy, Default)]
struct Finiteness {
    inf: bool,
    nan: bool,
}

fn scan(t: &Tensor) -> Finiteness {
    let mut f = Finiteness::default();
    match t.storage() {
        Storage::F32(v) => {
            for &x in v.iter() {
                f.nan |= x.is_nan();
                f.inf |= x.is_infinite();
            }
        }
        Storage::F64(v) => {
            for &x in v.iter() {
                f.nan |= x.is_nan();
                f.inf |= x.is_infinite();
            }
        }
        Storage::I64(_) => {}
    }
    f
}

/// Records every op of the current step with its output statistics and tracks origins.
#[derive(Default)]
pub struct Recorder {
    step: u64,
    ops: Vec<OpRecord>,
    tensors: HashMap<TensorId, Finiteness>,
    producer: HashMap<TensorId, usize>,
    preds: Vec<Vec<usize>>,
    first_inf: Option<usize>,
    first_nan: Option<usize>,
}

impl Recorder {
    /// An empty recorder.
    pub fn new() -> Recorder {
        Recorder::default()
    }

    /// The op records of the current step, in execution order.
    pub fn ops(&self) -> &[OpRecord] {
        &self.ops
    }

    /// Takes the op records of the current step.
    pub fn take_ops(&mut self) -> Vec<OpRecord> {
        std::mem::take(&mut self.ops)
    }

    /// True when any op of the step produced an Inf or NaN.
    pub fn saw_nonfinite(&self) -> bool {
        self.first_inf.is_some()
            || self.first_nan.is_some()
            || self.ops.iter().any(|o| o.stats.nonfinite() > 0)
    }

    /// True when a forward op of the step produced an Inf or NaN (intentional masks aside).
    pub fn forward_nonfinite(&self) -> bool {
        self.ops.iter().any(|o| {
            o.phase == crate::trace::record::Phase::Forward
                && (o.stats.nan > 0 || o.stats.pos_inf + o.stats.neg_inf > o.masked_neg_inf)
        })
    }

    /// First Inf, first NaN and the chain of ops from the first to the second.
    pub fn origins(&self) -> Origins {
        let r = |i: usize| OpRef::from_op(self.step, &self.ops[i]);
        Origins {
            first_inf: self.first_inf.map(r),
            first_nan: self.first_nan.map(r),
            chain: self.chain().into_iter().map(r).collect(),
        }
    }

    /// Ops on a data path from the first Inf to the first NaN, in execution order; when the
    /// NaN does not descend from the Inf, the chain is just the NaN's origin.
    fn chain(&self) -> Vec<usize> {
        let (Some(a), Some(b)) = (self.first_inf, self.first_nan) else {
            return self.first_inf.or(self.first_nan).into_iter().collect();
        };
        if a == b {
            return vec![a];
        }
        if b < a {
            return vec![b];
        }
        // Walk back from the NaN over predecessors no earlier than the Inf.
        let mut parent: HashMap<usize, usize> = HashMap::new();
        let mut seen: HashSet<usize> = HashSet::from([b]);
        let mut stack = vec![b];
        while let Some(n) = stack.pop() {
            if n == a {
                let mut path = vec![a];
                let mut cur = a;
                while let Some(&p) = parent.get(&cur) {
                    path.push(p);
                    cur = p;
                }
                return path;
            }
            for &p in &self.preds[n] {
                if p >= a && seen.insert(p) {
                    parent.insert(p, n);
                    stack.push(p);
                }
            }
        }
        vec![a, b]
    }

    fn finiteness(&mut self, t: &Tensor) -> Finiteness {
        *self.tensors.entry(t.id()).or_insert_with(|| scan(t))
    }
}

impl Observer for Recorder {
    fn begin_step(&mut self, step: u64) {
        *self = Recorder {
            step,
            ..Recorder::default()
        };
    }

    fn on_op(&mut self, ev: &OpEvent<'_>) {
        let out = ev.output;
        let stats = match out.storage() {
            Storage::F32(v) => TensorStats::compute(out.dtype(), v),
            Storage::F64(v) => TensorStats::compute_f64(v),
            Storage::I64(_) => TensorStats::default(),
        };
        let mut in_inf = false;
        let mut in_nan = false;
        let mut preds = Vec::new();
        for t in ev.inputs {
            let f = self.finiteness(t);
            in_inf |= f.inf;
            in_nan |= f.nan;
            if let Some(&p) = self.producer.get(&t.id()) {
                preds.push(p);
            }
        }
        let idx = self.ops.len();
        let unmasked_inf = stats.pos_inf + stats.neg_inf > ev.masked_neg_inf;
        if self.first_inf.is_none() && unmasked_inf && !in_inf && !in_nan {
            self.first_inf = Some(idx);
        }
        if self.first_nan.is_none() && stats.nan > 0 && !in_nan {
            self.first_nan = Some(idx);
        }
        self.tensors.insert(
            out.id(),
            Finiteness {
                inf: stats.pos_inf + stats.neg_inf > 0,
                nan: stats.nan > 0,
            },
        );
        self.producer.insert(out.id(), idx);
        self.preds.push(preds);
        self.ops.push(OpRecord {
            micro: ev.micro,
            index: ev.index,
            phase: ev.phase,
            op: ev.op.to_string(),
            module: ev.module.to_string(),
            inputs: ev
                .inputs
                .iter()
                .map(|t| TensorMeta {
                    dtype: t.dtype(),
                    shape: t.shape().to_vec(),
                })
                .collect(),
            output: TensorMeta {
                dtype: out.dtype(),
                shape: out.shape().to_vec(),
            },
            stats,
            rounding: ev.rounding,
            forward_op: ev.forward_op,
            wrt: ev.wrt.map(str::to_string),
            masked_neg_inf: ev.masked_neg_inf,
        });
    }

    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
}
