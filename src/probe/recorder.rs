//! The standard probe: statistics of every op's output, and the origin of the first Inf and
//! the first NaN with the chain of ops between them.

use super::nonfinite::{self, NonFinite};
use super::tensor_stats::{Deferred, TensorStats};
use crate::device::cuda::arena::SlotStats;
use crate::dtype::DType;
use crate::engine::observer::{Observer, OpEvent};
use crate::error::{Error, Result};
use crate::tensor::{CudaStorage, Storage, Tensor, TensorId};
use crate::trace::record::{OpBlame, OpRecord, OpRef, Origins, Phase, TensorMeta};
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Weak};

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
            let n = nonfinite::count(v);
            f.nan = n.nan > 0;
            f.inf = n.pos_inf + n.neg_inf > 0;
        }
        Storage::F64(v) => {
            for &x in v.iter() {
                f.nan |= x.is_nan();
                f.inf |= x.is_infinite();
            }
        }
        // Device data is not scanned on the host: what is known of it comes from the
        // resolved statistics of the op that produced it.
        Storage::I64(_) | Storage::Cuda(_) => {}
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
    /// Per op: whether its statistics are known, or pending in a device arena slot.
    handles: Vec<StatsHandle>,
    /// Ops whose origins have been tracked, in order (a pending op stops the tracking).
    tracked: usize,
    /// Per op: input finiteness as seen when the op ran (for tracking later).
    input_flags: Vec<Finiteness>,
    /// Device probes that could not be queued.
    errors: Vec<String>,
    /// Statistics computed this step, by the host storage they came from: an op whose
    /// output shares that storage (a view, a gradient passed through, a widening cast) has
    /// the same values, so the same statistics, recounted for its dtype. The storage is
    /// held weakly, so that a freed storage's address is never taken for a live one.
    shared: ByStorage<Known>,
    /// The output storage of this step's first cast of a tensor to a dtype: casting the
    /// same tensor (the same values) to the same dtype again gives the same values (a
    /// query, key and value projection each cast one input).
    casts: HashMap<(TensorId, DType), Weak<Vec<f32>>>,
    /// Whether host outputs are scanned by background jobs ([`Recorder::in_background`]).
    background: bool,
    /// This step's background scans, by the job number their ops' handles hold.
    jobs: Vec<Job>,
    /// Whether an op's statistics wait for a background scan ([`Recorder::resolve_host`]).
    host_pending: bool,
    /// Values whose statistics this step computed on the host ([`Recorder::scanned_values`]).
    scanned: u64,
    /// Whether this step's host outputs are only checked for non-finite values
    /// ([`Recorder::check_only`]).
    check_only: bool,
    /// Non-finite counts made this step in that mode, by host storage (as `shared`).
    counted: ByStorage<NonFinite>,
    /// Values this step only checked for non-finite values ([`Recorder::checked_values`]).
    checked: u64,
    /// In the check-only mode, each optimizer-phase op's output (by op) and dtype, held
    /// until the step ends for [`Recorder::complete_from`] to compute its statistics.
    held: Vec<(usize, Arc<Vec<f32>>, DType)>,
}

/// Host outputs shorter than this are scanned at once even in the background mode: their
/// scan costs less than handing it over.
const BACKGROUND_MIN: usize = 16 * 1024;

/// What was noted this step of each host storage, by its address, the storage held weakly.
type ByStorage<T> = HashMap<usize, (Weak<Vec<f32>>, T)>;

/// The statistics of a host storage: computed, or in background job `n`.
#[derive(Debug, Clone)]
enum Known {
    Ready(TensorStats),
    Job(u32),
}

/// A background scan: running, or done.
#[derive(Debug)]
enum Job {
    Running(Deferred),
    Done(TensorStats),
}

/// Where an op's output statistics come from: computed on the host when the op ran, or
/// gathered on the device into an arena slot and known after the step's one arena read
/// ([`Recorder::resolve`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StatsHandle {
    /// Computed; the record holds them.
    Ready,
    /// In this slot of the device's statistics arena.
    Pending(u32),
    /// Being computed on the host by background job `job` ([`Recorder::in_background`]);
    /// the op's statistics are that job's, counted as `dtype`.
    Host {
        /// The job.
        job: u32,
        /// The op's output dtype.
        dtype: DType,
    },
}

impl Recorder {
    /// An empty recorder.
    pub fn new() -> Recorder {
        Recorder::default()
    }

    /// This recorder, scanning long host outputs in jobs on rayon's threads instead of
    /// before the op returns, so that the scans fill the time those threads would wait.
    /// The statistics are the same, bit for bit: every reader of the step's records and
    /// origins ([`Recorder::ops`], [`Recorder::take_ops`], [`Recorder::origins`],
    /// [`Recorder::saw_nonfinite`], [`Recorder::forward_nonfinite`]) first waits for the
    /// jobs ([`Recorder::resolve_host`]).
    pub fn in_background(mut self) -> Recorder {
        self.background = true;
        self
    }

    /// For the current step only (the next [`Observer::begin_step`] ends it): host
    /// outputs are only checked for non-finite values, and their records hold those exact
    /// counts (`nan`, `pos_inf`, `neg_inf`, and `numel`) with every other statistic left
    /// at zero. Origins, the chain between them and [`Recorder::saw_nonfinite`] depend on
    /// nothing else, so they are the same as with full statistics. For a step whose
    /// records are not kept: a step that keeps them completes them
    /// ([`Recorder::complete_from`]), the forward and backward ops' from a run of the
    /// same step with full statistics, the optimizer phase's from their outputs, which
    /// are held until the step ends (the optimizer's state, which they depend on, is not
    /// the run's).
    pub fn check_only(&mut self) {
        self.check_only = true;
    }

    /// Whether the current step's host outputs are only checked
    /// ([`Recorder::check_only`]).
    pub fn is_check_only(&self) -> bool {
        self.check_only
    }

    /// Completes the statistics of a step recorded in the check-only mode
    /// ([`Recorder::check_only`]): each forward and backward op takes the statistics and
    /// rounding counts (which a device does not count in that mode) of the op at its
    /// position among those of `full`, the op records of the same step
    /// recorded with full statistics, and each optimizer-phase op's are computed from its
    /// held output. The op in `full` must be the same op — phase, index, name, module,
    /// output dtype and shape — with the same non-finite counts, or the records are left
    /// as they were and the error says where the two runs part.
    pub fn complete_from(&mut self, full: &[OpRecord]) -> Result<()> {
        self.resolve_host();
        let checked = |o: &OpRecord| o.phase != Phase::Optimizer;
        let mine: Vec<usize> = (0..self.ops.len())
            .filter(|&i| checked(&self.ops[i]))
            .collect();
        let theirs: Vec<&OpRecord> = full.iter().filter(|o| checked(o)).collect();
        if mine.len() != theirs.len() {
            return Err(Error::Invalid(format!(
                "step {}: the re-run with full statistics has {} forward and backward ops, \
                 the step had {}",
                self.step,
                theirs.len(),
                mine.len()
            )));
        }
        for (&i, f) in mine.iter().zip(&theirs) {
            let o = &self.ops[i];
            let same_op = (o.phase, o.index, &o.op, &o.module, &o.output)
                == (f.phase, f.index, &f.op, &f.module, &f.output);
            let same_counts = (o.stats.nan, o.stats.pos_inf, o.stats.neg_inf)
                == (f.stats.nan, f.stats.pos_inf, f.stats.neg_inf);
            if !same_op || !same_counts {
                return Err(Error::Invalid(format!(
                    "step {}: op {} ({} {}, {} NaN, {} +inf, {} -inf) is op {} ({} {}, {} NaN, \
                     {} +inf, {} -inf) in the re-run with full statistics",
                    self.step,
                    o.index,
                    o.op,
                    o.module,
                    o.stats.nan,
                    o.stats.pos_inf,
                    o.stats.neg_inf,
                    f.index,
                    f.op,
                    f.module,
                    f.stats.nan,
                    f.stats.pos_inf,
                    f.stats.neg_inf
                )));
            }
        }
        for (&i, f) in mine.iter().zip(theirs) {
            self.ops[i].stats = f.stats.clone();
            self.ops[i].rounding = f.rounding;
        }
        for (i, v, dtype) in std::mem::take(&mut self.held) {
            self.scanned += v.len() as u64;
            self.ops[i].stats = TensorStats::compute(dtype, &v);
        }
        self.check_only = false;
        Ok(())
    }

    /// Waits for the background scans of this step, completes their ops' records and
    /// tracks their origins. Nothing to do when none is running.
    pub fn resolve_host(&mut self) {
        if !self.host_pending {
            return;
        }
        self.host_pending = false;
        for job in &mut self.jobs {
            if let Job::Running(d) = job {
                *job = Job::Done(d.wait());
            }
        }
        for (op, h) in self.ops.iter_mut().zip(&mut self.handles) {
            let StatsHandle::Host { job, dtype } = *h else {
                continue;
            };
            if let Some(Job::Done(st)) = self.jobs.get(job as usize) {
                op.stats = st.recount_as(dtype);
                mask_owns_neg_inf(op);
                *h = StatsHandle::Ready;
            }
        }
        self.advance();
    }

    /// The op records of the current step, in execution order (once the step's background
    /// scans are done: this waits for them).
    pub fn ops(&mut self) -> &[OpRecord] {
        self.resolve_host();
        &self.ops
    }

    /// How many ops the current step has recorded so far (without waiting for anything).
    pub fn op_count(&self) -> usize {
        self.ops.len()
    }

    /// Takes the op records of the current step (once its background scans are done).
    pub fn take_ops(&mut self) -> Vec<OpRecord> {
        self.resolve_host();
        std::mem::take(&mut self.ops)
    }

    /// True when any op of the step produced an Inf or NaN.
    pub fn saw_nonfinite(&mut self) -> bool {
        self.resolve_host();
        self.first_inf.is_some()
            || self.first_nan.is_some()
            || self.ops.iter().any(|o| o.stats.nonfinite() > 0)
    }

    /// True when a forward op of the step produced an Inf or NaN (intentional masks aside).
    pub fn forward_nonfinite(&mut self) -> bool {
        self.resolve_host();
        self.ops.iter().any(|o| {
            o.phase == crate::trace::record::Phase::Forward
                && (o.stats.nan > 0 || o.stats.pos_inf + o.stats.neg_inf > o.masked_neg_inf)
        })
    }

    /// First Inf, first NaN and the chain of ops from the first to the second.
    pub fn origins(&mut self) -> Origins {
        self.resolve_host();
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

    /// Tracks the origins of every op whose statistics are known, in execution order,
    /// stopping at the first still pending on a device.
    fn advance(&mut self) {
        while self.tracked < self.ops.len() && self.handles[self.tracked] == StatsHandle::Ready {
            self.track(self.tracked);
            self.tracked += 1;
        }
    }

    /// First Inf / first NaN bookkeeping for op `idx`: an op is an origin when its output
    /// has a non-finite value (masks aside) that none of its inputs had.
    fn track(&mut self, idx: usize) {
        let mut f = self.input_flags[idx];
        for &p in &self.preds[idx] {
            let s = &self.ops[p].stats;
            f.inf |= s.pos_inf + s.neg_inf > 0;
            f.nan |= s.nan > 0;
        }
        let op = &self.ops[idx];
        let unmasked_inf = op.stats.pos_inf + op.stats.neg_inf > op.masked_neg_inf;
        if self.first_inf.is_none() && unmasked_inf && !f.inf && !f.nan {
            self.first_inf = Some(idx);
        }
        if self.first_nan.is_none() && op.stats.nan > 0 && !f.nan {
            self.first_nan = Some(idx);
        }
    }

    /// Queues the statistics of a device output into its op's arena slot (or a fresh one
    /// when the op did not round), returning the slot.
    fn queue_device_probe(
        &mut self,
        c: &CudaStorage,
        dtype: DType,
        slot: Option<u32>,
    ) -> Result<u32> {
        let dev = &c.dev;
        dev.with_arena(|a| {
            let slot = match slot {
                Some(s) => s,
                None => a.slot(dev)?,
            };
            a.probe(dev, &c.buf, dtype, slot)?;
            Ok(slot)
        })
    }

    /// Completes the records of ops whose statistics were gathered on a device, from the
    /// step's one arena read (`slots[i]` is arena slot `i`), and tracks their origins.
    pub fn resolve(&mut self, slots: &[SlotStats]) -> Result<()> {
        for (op, h) in self.ops.iter_mut().zip(&mut self.handles) {
            let StatsHandle::Pending(slot) = *h else {
                continue;
            };
            let got = slots.get(slot as usize).ok_or_else(|| {
                Error::Device(format!(
                    "arena read has {} slots; op {} {} needs slot {slot}",
                    slots.len(),
                    op.op,
                    op.module
                ))
            })?;
            op.stats = got.stats.clone();
            op.rounding = got.rounding;
            // A device mask's -inf count is known only now (a host mask's was counted
            // when the op ran; the slot's word is then 0).
            op.masked_neg_inf += got.masked_neg_inf;
            mask_owns_neg_inf(op);
            *h = StatsHandle::Ready;
        }
        self.advance();
        Ok(())
    }

    /// Drops every op record after the first `n` (ops that turned out not to have happened:
    /// a device queues the optimizer's update before it knows the step is skipped). Their
    /// statistics never took part in origin tracking past the ops kept.
    pub fn truncate(&mut self, n: usize) {
        if n >= self.ops.len() {
            return;
        }
        self.ops.truncate(n);
        self.handles.truncate(n);
        self.preds.truncate(n);
        self.input_flags.truncate(n);
        self.producer.retain(|_, &mut i| i < n);
        self.tracked = self.tracked.min(n);
        if self.first_inf.is_some_and(|i| i >= n) {
            self.first_inf = None;
        }
        if self.first_nan.is_some_and(|i| i >= n) {
            self.first_nan = None;
        }
    }

    /// Ops whose statistics still wait for the device's arena read.
    pub fn pending(&self) -> usize {
        self.handles[self.tracked.min(self.handles.len())..]
            .iter()
            .filter(|h| matches!(h, StatsHandle::Pending(_)))
            .count()
    }

    /// How many values this step's host statistics were computed from: each storage once,
    /// so an output that shares a storage already scanned (a view, a widening cast), a
    /// moved copy of one and a repeated cast of the same tensor add nothing. The probes'
    /// work in a step, whether the scans have finished or not.
    pub fn scanned_values(&self) -> u64 {
        self.scanned
    }

    /// How many values this step only checked for non-finite values
    /// ([`Recorder::check_only`]), each storage once as [`Recorder::scanned_values`] counts.
    pub fn checked_values(&self) -> u64 {
        self.checked
    }

    /// Probe failures on a device (an op whose statistics could not be queued).
    pub fn errors(&self) -> &[String] {
        &self.errors
    }

    /// The statistics computed this step from a storage, if it is that same live storage
    /// (those of a finished background job as computed).
    fn known(&self, v: &Arc<Vec<f32>>) -> Option<Known> {
        Some(match of_storage(&self.shared, v)? {
            Known::Job(n) => match self.jobs.get(*n as usize) {
                Some(Job::Done(st)) => Known::Ready(st.clone()),
                _ => Known::Job(*n),
            },
            k => k.clone(),
        })
    }

    /// The statistics of an output `v`: computed once per storage in a step (an op's
    /// record recounts them for its dtype), and taken from another storage's when the
    /// output holds its values (`same_as`: the input a copy only moved, or an earlier cast
    /// of the same tensor). In the background mode a long storage's are a job's.
    fn host_stats(
        &mut self,
        v: &Arc<Vec<f32>>,
        dtype: DType,
        same_as: Option<&Arc<Vec<f32>>>,
    ) -> Known {
        if let Some(k) = self.known(v) {
            return k;
        }
        let source = same_as
            .filter(|u| u.len() == v.len())
            .and_then(|u| self.known(u));
        let k = match source {
            Some(k) => k,
            None => {
                self.scanned += v.len() as u64;
                if self.background && v.len() >= BACKGROUND_MIN {
                    self.jobs
                        .push(Job::Running(TensorStats::spawn(dtype, v.clone())));
                    Known::Job((self.jobs.len() - 1) as u32)
                } else {
                    Known::Ready(TensorStats::compute(dtype, v))
                }
            }
        };
        remember(&mut self.shared, v, k.clone());
        k
    }

    /// The non-finite counts of an output `v` in the check-only mode: none when the op
    /// found every value finite as it wrote them (`finite`), else counted once per
    /// storage in a step, and taken from `same_as`'s when the output holds its values.
    fn host_counts(
        &mut self,
        v: &Arc<Vec<f32>>,
        same_as: Option<&Arc<Vec<f32>>>,
        finite: bool,
    ) -> NonFinite {
        let known = |u: &Arc<Vec<f32>>| of_storage(&self.counted, u).copied();
        if let Some(n) = known(v) {
            return n;
        }
        let n = match same_as.filter(|u| u.len() == v.len()).and_then(known) {
            Some(n) => n,
            None => {
                self.checked += v.len() as u64;
                match finite {
                    true => NonFinite::default(),
                    false => nonfinite::count(v),
                }
            }
        };
        remember(&mut self.counted, v, n);
        n
    }

    fn finiteness(&mut self, t: &Tensor) -> Finiteness {
        *self.tensors.entry(t.id()).or_insert_with(|| scan(t))
    }
}

impl Observer for Recorder {
    fn begin_step(&mut self, step: u64) {
        *self = Recorder {
            step,
            background: self.background,
            ..Recorder::default()
        };
    }

    fn on_op(&mut self, ev: &OpEvent<'_>) {
        let out = ev.output;
        let (stats, handle) = match out.storage() {
            Storage::F32(v) => {
                let moved_from = match ev
                    .inputs
                    .first()
                    .and_then(|t| t.tensor())
                    .map(|t| t.storage())
                {
                    Some(Storage::F32(u)) if ev.permuted => Some(u.clone()),
                    _ => None,
                };
                let cast_of = match ev.inputs {
                    [t] if ev.op == "to" => Some((t.id(), out.dtype())),
                    _ => None,
                };
                let earlier = cast_of
                    .and_then(|k| self.casts.get(&k))
                    .and_then(Weak::upgrade);
                let same_as = moved_from.or(earlier);
                if let Some(k) = cast_of {
                    self.casts.entry(k).or_insert_with(|| Arc::downgrade(v));
                }
                if self.check_only {
                    if ev.phase == Phase::Optimizer {
                        self.held.push((self.ops.len(), v.clone(), out.dtype()));
                    }
                    let n = self.host_counts(v, same_as.as_ref(), ev.finite);
                    let stats = TensorStats {
                        numel: v.len() as u64,
                        nan: n.nan,
                        pos_inf: n.pos_inf,
                        neg_inf: n.neg_inf,
                        ..TensorStats::default()
                    };
                    (stats, StatsHandle::Ready)
                } else {
                    match self.host_stats(v, out.dtype(), same_as.as_ref()) {
                        Known::Ready(st) => (st.recount_as(out.dtype()), StatsHandle::Ready),
                        Known::Job(job) => {
                            self.host_pending = true;
                            let handle = StatsHandle::Host {
                                job,
                                dtype: out.dtype(),
                            };
                            (TensorStats::default(), handle)
                        }
                    }
                }
            }
            Storage::F64(v) => {
                self.scanned += v.len() as u64;
                (TensorStats::compute_f64(v), StatsHandle::Ready)
            }
            Storage::I64(_) => (TensorStats::default(), StatsHandle::Ready),
            Storage::Cuda(c) => match self.queue_device_probe(c, out.dtype(), ev.slot) {
                Ok(slot) => (TensorStats::default(), StatsHandle::Pending(slot)),
                Err(e) => {
                    self.errors.push(format!("{} {}: {e}", ev.op, ev.module));
                    (TensorStats::default(), StatsHandle::Ready)
                }
            },
        };
        let mut in_flags = Finiteness::default();
        let mut preds = Vec::new();
        for t in ev.inputs {
            // An input made by an op of this step is known by that op's statistics (read
            // when the op is tracked); any other is scanned once.
            if let Some(&p) = self.producer.get(&t.id()) {
                preds.push(p);
            } else if let Some(t) = t.tensor() {
                let f = self.finiteness(t);
                in_flags.inf |= f.inf;
                in_flags.nan |= f.nan;
            }
        }
        let idx = self.ops.len();
        self.producer.insert(out.id(), idx);
        self.preds.push(preds);
        self.handles.push(handle);
        self.input_flags.push(in_flags);
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
            additive_mask: ev.additive_mask,
            blame: ev.blame.map(|b| OpBlame {
                introduced: b.introduced,
                inherited: b.inherited,
                total: b.total,
                input: b.input,
            }),
        });
        if let Some(o) = self.ops.last_mut() {
            mask_owns_neg_inf(o);
        }
        self.advance();
    }

    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
}

/// What `map` notes of storage `v`, if the entry is that same live storage (a freed
/// storage's address may be taken by a new one).
fn of_storage<'m, T>(map: &'m ByStorage<T>, v: &Arc<Vec<f32>>) -> Option<&'m T> {
    let (w, x) = map.get(&(Arc::as_ptr(v) as usize))?;
    w.upgrade().is_some_and(|a| Arc::ptr_eq(&a, v)).then_some(x)
}

/// Notes `x` of storage `v` in `map`.
fn remember<T>(map: &mut ByStorage<T>, v: &Arc<Vec<f32>>, x: T) {
    map.insert(Arc::as_ptr(v) as usize, (Arc::downgrade(v), x));
}

/// An op applying an additive attention mask: the -inf of its output are the mask's (fp16's
/// −65504 plus a negative score rounds to −inf; an input's own -inf was that input's
/// origin already).
fn mask_owns_neg_inf(o: &mut OpRecord) {
    if o.additive_mask {
        o.masked_neg_inf = o.masked_neg_inf.max(o.stats.neg_inf);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::observer::Operand;

    /// Tells `r` that op `op` made `out` from `inputs` (only moving `inputs[0]`'s values
    /// when `op` is "transpose").
    fn record(r: &mut Recorder, op: &str, inputs: &[&Tensor], out: &Tensor) {
        let operands: Vec<Operand> = inputs.iter().map(|t| Operand::Tensor(t)).collect();
        r.on_op(&event(r, op, &operands, out));
    }

    /// The forward event [`record`] tells.
    fn event<'a>(
        r: &Recorder,
        op: &'a str,
        inputs: &'a [Operand<'a>],
        out: &'a Tensor,
    ) -> OpEvent<'a> {
        OpEvent {
            step: 0,
            micro: 0,
            index: r.ops.len() as u64,
            phase: crate::trace::record::Phase::Forward,
            op,
            module: "m",
            inputs,
            output: out,
            rounding: Default::default(),
            slot: None,
            forward_op: None,
            wrt: None,
            masked_neg_inf: 0,
            additive_mask: false,
            blame: None,
            permuted: op == "transpose",
            finite: false,
        }
    }

    /// Values over 2^-31..2^13 (finite in fp16), with `special` = (index, value) put in.
    fn values(n: usize, seed: u32, special: Option<(usize, f32)>) -> Vec<f32> {
        let mut x = seed;
        (0..n)
            .map(|i| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                match special {
                    Some((at, v)) if i == at => v,
                    _ => {
                        f32::from_bits(0x3000_0000 + (x % 0x1600_0000))
                            * if x & 1 == 1 { -1.0 } else { 1.0 }
                    }
                }
            })
            .collect()
    }

    #[test]
    fn statistics_from_workers_and_shared_storages_are_the_ones_computed_here() {
        statistics_are_the_ones_computed_here(Recorder::new());
    }

    #[test]
    fn statistics_from_background_jobs_are_the_ones_computed_here() {
        statistics_are_the_ones_computed_here(Recorder::new().in_background());
    }

    /// Records ops whose outputs share storages, move values and hold an Inf and a NaN,
    /// and checks each op's statistics and the origins against statistics computed here.
    fn statistics_are_the_ones_computed_here(mut r: Recorder) {
        let background = r.background;
        r.begin_step(0);
        let n = 200_000;
        let host = |t: &Tensor| t.f32s().unwrap().to_vec();
        let a = Tensor::from_f32(values(n, 1, None), &[n], DType::F16).unwrap();
        // The same storage as f32 (a widening cast), as a view, and a tensor with an inf.
        let b = Tensor::from_storage(a.storage().clone(), &[n], DType::F32).unwrap();
        let c = Tensor::from_storage(a.storage().clone(), &[2, n / 2], DType::F16).unwrap();
        let d =
            Tensor::from_f32(values(n, 2, Some((n / 3, f32::INFINITY))), &[n], DType::F32).unwrap();
        let e = Tensor::from_f32(values(n, 3, Some((7, f32::NAN))), &[n], DType::F32).unwrap();
        let small = Tensor::from_f32(vec![1.0, -2.0, 3.0e-6, 0.0], &[4], DType::F16).unwrap();
        // d's values moved (reversed), and e's moved though e was made in no op of the step.
        let rev = |t: &Tensor| {
            let v: Vec<f32> = host(t).into_iter().rev().collect();
            Tensor::from_f32(v, &[n], DType::F32).unwrap()
        };
        let (dt, et) = (rev(&d), rev(&e));
        record(&mut r, "a", &[], &a);
        record(&mut r, "to", &[&a], &b);
        record(&mut r, "view", &[&a], &c);
        record(&mut r, "d", &[&b], &d);
        record(&mut r, "transpose", &[&d], &dt);
        record(&mut r, "small", &[], &small);
        record(&mut r, "transpose", &[&e], &et);
        record(&mut r, "e", &[&d], &e);
        if background {
            // Long outputs wait for their jobs (the small one does not), and their origins
            // are not tracked yet; reading the origins waits for the jobs.
            assert!(matches!(r.handles[0], StatsHandle::Host { .. }));
            assert_eq!(r.handles[5], StatsHandle::Ready);
            assert_eq!((r.first_inf, r.tracked), (None, 0));
        }
        // a, d, small, e's moved copy (e was scanned by no op before it) and e: b and c
        // share a's storage, and d's moved copy takes d's statistics.
        assert_eq!(r.scanned_values(), 4 * n as u64 + 4);
        let origins = r.origins();
        assert_eq!(origins.first_inf.map(|o| o.op), Some("d".to_string()));
        // The moved copy of e saw e's NaN already in its input: e's op is the origin.
        assert_eq!(origins.first_nan.map(|o| o.op), Some("e".to_string()));
        let ops = r.take_ops();
        let outs = [&a, &b, &c, &d, &dt, &small, &et, &e];
        for (i, (o, t)) in ops.iter().zip(outs).enumerate() {
            let mut want = TensorStats::compute(t.dtype(), &host(t));
            if i == 4 {
                // The moved copy's statistics are its input's: the same squares, added in
                // the input's order.
                assert!((o.stats.sum_sq - want.sum_sq).abs() <= 1e-12 * want.sum_sq);
                assert_eq!(o.stats.sum_sq, ops[3].stats.sum_sq);
                want.sum_sq = o.stats.sum_sq;
            }
            assert_eq!(o.stats, want, "{i} {}", o.op);
        }
        assert_ne!(ops[0].stats.subnormal, ops[1].stats.subnormal);
    }

    #[test]
    fn a_tensor_cast_again_to_a_dtype_has_the_first_casts_statistics() {
        let mut r = Recorder::new();
        r.begin_step(0);
        let n = 100_000;
        let x = Tensor::from_f32(values(n, 4, None), &[n], DType::F32).unwrap();
        let cast = |t: &Tensor, d: DType| {
            let mut v = t.f32s().unwrap().to_vec();
            crate::dtype::round_slice(d, &mut v);
            Tensor::from_f32(v, &[n], d).unwrap()
        };
        // x to fp16 three times (the casts of a query, key and value projection), to bf16
        // once, and another tensor with x's values to fp16.
        let y = Tensor::from_f32(x.f32s().unwrap().to_vec(), &[n], DType::F32).unwrap();
        let outs = [
            cast(&x, DType::F16),
            cast(&x, DType::F16),
            cast(&x, DType::BF16),
            cast(&x, DType::F16),
            cast(&y, DType::F16),
        ];
        let ins = [&x, &x, &x, &x, &y];
        for (i, o) in ins.iter().zip(&outs) {
            record(&mut r, "to", &[i], o);
        }
        // x to fp16 and to bf16, and y to fp16: the repeats of x's fp16 cast scan nothing.
        assert_eq!(r.scanned_values(), 3 * n as u64);
        let ops = r.ops();
        for (o, t) in ops.iter().zip(&outs) {
            assert_eq!(o.stats, TensorStats::compute(t.dtype(), t.f32s().unwrap()));
        }
        assert_ne!(ops[0].stats, ops[2].stats);
    }

    #[test]
    fn a_checked_step_counts_non_finite_values_and_completes_from_full_records() {
        let n = 100_000;
        let t = |special, dtype| Tensor::from_f32(values(n, 5, special), &[n], dtype).unwrap();
        let a = t(None, DType::F16);
        let b = t(Some((n - 1, f32::NEG_INFINITY)), DType::F32);
        let c = t(Some((3, f32::NAN)), DType::F32);
        let run = |r: &mut Recorder| {
            record(r, "a", &[], &a);
            record(r, "b", &[&a], &b);
            record(r, "view", &[&b], &b);
            record(r, "c", &[&b], &c);
            // An optimizer-phase op, of a storage checked before.
            r.on_op(&OpEvent {
                phase: crate::trace::record::Phase::Optimizer,
                ..event(r, "unscale", &[], &b)
            });
        };
        let mut full = Recorder::new().in_background();
        full.begin_step(0);
        run(&mut full);
        let mut r = Recorder::new().in_background();
        r.begin_step(0);
        r.check_only();
        run(&mut r);
        assert!(r.is_check_only());
        // a, b and c once each (the view and the optimizer op share b's storage).
        assert_eq!((r.checked_values(), r.scanned_values()), (3 * n as u64, 0));
        assert_eq!(r.origins(), full.origins());
        assert!(r.saw_nonfinite());
        let want = full.take_ops();
        for (o, f) in r.ops().iter().zip(&want) {
            let counts =
                |o: &OpRecord| (o.stats.numel, o.stats.nan, o.stats.pos_inf, o.stats.neg_inf);
            assert_eq!(counts(o), counts(f), "{}", o.op);
            assert_eq!(o.stats.max_abs, 0.0);
        }
        // Records of another step are refused, and nothing changes.
        let mut other = want.clone();
        other[2].stats.neg_inf = 0;
        let err = r.complete_from(&other).unwrap_err().to_string();
        assert!(
            err.contains("op 2 (view m, 0 NaN, 0 +inf, 1 -inf)"),
            "{err}"
        );
        assert!(r.complete_from(&want[..3]).is_err());
        assert_eq!(r.ops()[0].stats.max_abs, 0.0);
        // The optimizer-phase op's statistics come from its output, not from the records
        // given, whose optimizer phase may differ.
        let mut given = want.clone();
        given[4].stats = TensorStats::default();
        r.complete_from(&given).unwrap();
        assert!(!r.is_check_only());
        assert_eq!(r.ops(), &want[..]);
        assert_eq!(r.scanned_values(), n as u64);
        // The mode ends with the step.
        r.begin_step(1);
        assert!(!r.is_check_only());
    }

    #[test]
    fn statistics_are_shared_only_with_a_live_storage() {
        let mut r = Recorder::new();
        r.begin_step(0);
        let a = Tensor::from_f32(vec![1.0, -2.0, 3.0e-6, 0.0], &[4], DType::F32).unwrap();
        record(&mut r, "a", &[], &a);
        // A storage freed and another allocated, at the same address or not: computed anew.
        drop(a);
        for i in 0..8 {
            let b = Tensor::from_f32(vec![5.0, f32::INFINITY, 7.0, 8.0], &[4], DType::F32).unwrap();
            record(&mut r, "b", &[], &b);
            let want = TensorStats::compute(DType::F32, b.f32s().unwrap());
            assert_eq!(r.ops()[i + 1].stats, want);
        }
    }
}
