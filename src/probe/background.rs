//! Statistics computed beside the step instead of in its way.
//!
//! A host step does not keep both cores busy all the time (serial stretches between the
//! parallel kernels, waits at their joins). The recorder hands each output's statistics to
//! a few threads at the lowest scheduling priority (`SCHED_IDLE` on Linux), which the
//! kernel runs only on a core that would otherwise idle, so they take time from nobody.
//! What they have not done when the step's record is needed is done then, by the caller.
//!
//! The result does not depend on who computes it or when: a worker computes a tensor's
//! chunks in order on its own thread, the caller with rayon, and both merge the chunk
//! results in chunk order ([`TensorStats::compute`]). Outputs waiting for a worker stay
//! alive until it is done; the values waiting at any time are bounded ([`BACKLOG`]), and
//! an output past the bound is computed at once, as it would be without the workers.

use super::stats::TensorStats;
use crate::dtype::DType;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};

/// Most values waiting for or in a worker at once (64 MiB of f32).
const BACKLOG: usize = 1 << 24;
/// Shorter tensors are computed at once: handing them over costs about what they do.
const MIN_LEN: usize = 1 << 14;
/// Most worker threads.
const MAX_WORKERS: usize = 4;

/// Where one tensor's statistics are.
enum State {
    /// Waiting in the queue, with the values and the dtype to count them as.
    Queued(Arc<Vec<f32>>, DType),
    /// Being computed by a worker.
    Running,
    /// Computed.
    Done(TensorStats),
}

struct Slot {
    state: Mutex<State>,
    done: Condvar,
    len: usize,
}

/// Locks a mutex whose holder cannot leave its data half-written (every critical section
/// here only moves a value in or out), so a poisoned lock is still sound to use.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

struct Pool {
    queue: Mutex<VecDeque<Arc<Slot>>>,
    ready: Condvar,
    /// Values queued or running.
    backlog: AtomicUsize,
}

impl Pool {
    /// Takes a queued slot's values for computing, or `None` when the caller already has.
    fn claim(slot: &Slot) -> Option<(Arc<Vec<f32>>, DType)> {
        let mut st = lock(&slot.state);
        match std::mem::replace(&mut *st, State::Running) {
            State::Queued(v, d) => Some((v, d)),
            other => {
                *st = other;
                None
            }
        }
    }

    fn finish(&self, slot: &Slot, stats: TensorStats) {
        *lock(&slot.state) = State::Done(stats);
        slot.done.notify_all();
        self.backlog.fetch_sub(slot.len, Ordering::AcqRel);
    }

    fn work(&self) {
        lower_priority();
        loop {
            let slot = {
                let mut q = lock(&self.queue);
                loop {
                    if let Some(s) = q.pop_front() {
                        break s;
                    }
                    q = self.ready.wait(q).unwrap_or_else(|e| e.into_inner());
                }
            };
            if let Some((v, d)) = Pool::claim(&slot) {
                // On this thread only: rayon's threads run at normal priority.
                let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    TensorStats::compute_here(d, &v)
                }));
                match run {
                    Ok(stats) => {
                        drop(v);
                        self.finish(&slot, stats);
                    }
                    // Back in the queue's state, for the caller to compute (and report).
                    Err(_) => {
                        *lock(&slot.state) = State::Queued(v, d);
                        slot.done.notify_all();
                    }
                }
            }
        }
    }
}

/// Asks the kernel to run this thread only when a core has nothing else to run.
fn lower_priority() {
    #[cfg(target_os = "linux")]
    {
        let param = libc::sched_param { sched_priority: 0 };
        // SAFETY: plain system call on the calling thread with a valid parameter block.
        // If it fails the thread keeps its priority, which only costs speed.
        unsafe {
            libc::sched_setscheduler(0, libc::SCHED_IDLE, &param);
        }
    }
}

/// The pool, started on first use; `None` when no worker thread could be started.
fn pool() -> Option<&'static Pool> {
    static POOL: OnceLock<Option<&'static Pool>> = OnceLock::new();
    *POOL.get_or_init(|| {
        let pool: &'static Pool = Box::leak(Box::new(Pool {
            queue: Mutex::new(VecDeque::new()),
            ready: Condvar::new(),
            backlog: AtomicUsize::new(0),
        }));
        let n = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .min(MAX_WORKERS);
        let started = (0..n)
            .filter(|i| {
                std::thread::Builder::new()
                    .name(format!("amprobe-stats-{i}"))
                    .spawn(move || pool.work())
                    .is_ok()
            })
            .count();
        (started > 0).then_some(pool)
    })
}

/// Statistics on their way: from a worker, or from the caller if it gets there first.
pub(super) struct Pending {
    slot: Arc<Slot>,
    pool: &'static Pool,
}

/// Hands the statistics of `data` as `dtype` to the workers; `None` when the caller should
/// compute them now (a short tensor, a full backlog, no workers).
pub(super) fn submit(data: &Arc<Vec<f32>>, dtype: DType) -> Option<Pending> {
    let len = data.len();
    if len < MIN_LEN {
        return None;
    }
    let pool = pool()?;
    if pool.backlog.fetch_add(len, Ordering::AcqRel) + len > BACKLOG {
        pool.backlog.fetch_sub(len, Ordering::AcqRel);
        return None;
    }
    let slot = Arc::new(Slot {
        state: Mutex::new(State::Queued(Arc::clone(data), dtype)),
        done: Condvar::new(),
        len,
    });
    lock(&pool.queue).push_back(Arc::clone(&slot));
    pool.ready.notify_one();
    Some(Pending { slot, pool })
}

impl Pending {
    /// The statistics if a worker has finished them, else the pending statistics back.
    pub(super) fn poll(self) -> Result<TensorStats, Pending> {
        let mut st = lock(&self.slot.state);
        match std::mem::replace(&mut *st, State::Running) {
            State::Done(s) => Ok(s),
            other => {
                *st = other;
                drop(st);
                Err(self)
            }
        }
    }

    /// The statistics: computed here (with rayon) if no worker has started them, else
    /// waited for.
    pub(super) fn take(self) -> TensorStats {
        let mut st = lock(&self.slot.state);
        loop {
            match std::mem::replace(&mut *st, State::Running) {
                State::Done(s) => return s,
                State::Queued(v, d) => {
                    // Not started (or handed back): the caller's own threads do it.
                    drop(st);
                    let stats = TensorStats::compute(d, &v);
                    drop(v);
                    self.pool.backlog.fetch_sub(self.slot.len, Ordering::AcqRel);
                    return stats;
                }
                State::Running => {
                    st = self.slot.done.wait(st).unwrap_or_else(|e| e.into_inner());
                }
            }
        }
    }
}
