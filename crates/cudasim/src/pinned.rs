//! Page-locked ("pinned") host memory, the device-to-host copies into it that the host has
//! not waited for, and the stream ordering that says when it has.
//!
//! On a GPU a device-to-host copy into pageable memory returns when the data has landed,
//! but one into pinned memory returns at once and lands later: reading the buffer before
//! synchronizing reads stale data, sometimes. Here every copy lands when it is queued, so
//! the hazard is made visible instead: the pages a pending copy wrote are closed
//! (`PROT_NONE`) until the host waits for the copy (a synchronize of its stream, of the
//! context, or of an event recorded after it, or a query of one of those that succeeds),
//! and a touch before then ends the process naming the copy (see `fault.rs`).

use crate::fault;
use std::collections::{BTreeMap, HashMap, HashSet};

/// For each stream, the number of its last operation that something is ordered after.
pub type Clock = HashMap<usize, u64>;

fn join(into: &mut Clock, from: &Clock) {
    for (&s, &n) in from {
        let e = into.entry(s).or_insert(0);
        *e = (*e).max(n);
    }
}

/// The order among queued operations: streams run in order, events capture a point of a
/// stream, a stream waiting for an event is ordered after that point, and the legacy
/// default stream (0) and the blocking streams wait for each other's earlier work.
#[derive(Default)]
pub struct StreamOrder {
    seq: u64,
    /// What each stream's next operation is ordered after (itself included).
    streams: HashMap<usize, Clock>,
    /// Streams created without CU_STREAM_NON_BLOCKING.
    blocking: HashSet<usize>,
    /// Each recorded event's point.
    events: HashMap<usize, Clock>,
}

impl StreamOrder {
    /// Notes a new stream; `blocking` when it synchronizes with the legacy default stream.
    pub fn create(&mut self, stream: usize, blocking: bool) {
        if blocking {
            self.blocking.insert(stream);
        }
    }

    /// Numbers an operation queued on `stream`.
    pub fn enqueue(&mut self, stream: usize) -> u64 {
        self.seq += 1;
        let mut clock = self.streams.remove(&stream).unwrap_or_default();
        if stream == 0 {
            for b in &self.blocking {
                if let Some(c) = self.streams.get(b) {
                    join(&mut clock, c);
                }
            }
        } else if self.blocking.contains(&stream) {
            if let Some(c) = self.streams.get(&0) {
                join(&mut clock, c);
            }
        }
        clock.insert(stream, self.seq);
        self.streams.insert(stream, clock);
        self.seq
    }

    /// Records `event` at the current end of `stream`.
    pub fn record(&mut self, event: usize, stream: usize) {
        self.enqueue(stream);
        let point = self.streams.get(&stream).cloned().unwrap_or_default();
        self.events.insert(event, point);
    }

    /// Orders `stream`'s later work after `event`'s point (nothing if it was never recorded).
    pub fn wait(&mut self, stream: usize, event: usize) {
        if let Some(point) = self.events.get(&event).cloned() {
            join(self.streams.entry(stream).or_default(), &point);
        }
    }

    /// What has finished once the host waited for `stream`.
    pub fn stream_point(&self, stream: usize) -> Clock {
        self.streams.get(&stream).cloned().unwrap_or_default()
    }

    /// What has finished once the host waited for `event` (nothing if never recorded).
    pub fn event_point(&self, event: usize) -> Clock {
        self.events.get(&event).cloned().unwrap_or_default()
    }

    /// Forgets a destroyed event.
    pub fn destroy_event(&mut self, event: usize) {
        self.events.remove(&event);
    }
}

struct Region {
    size: usize,
    mapped: usize,
    slot: Option<usize>,
}

struct Pending {
    lo: usize,
    hi: usize,
    stream: usize,
    seq: u64,
    slot: usize,
    /// The copy, for messages ("copy of N bytes from device memory last written by …").
    what: String,
}

/// The pinned buffers and the copies into them not yet waited for.
#[derive(Default)]
pub struct Pinned {
    regions: BTreeMap<usize, Region>,
    pending: Vec<Pending>,
    warned_full: bool,
}

fn page_range(lo: usize, hi: usize) -> (usize, usize) {
    let pg = crate::memory::page();
    (lo / pg * pg, hi.div_ceil(pg) * pg)
}

unsafe fn protect(lo: usize, hi: usize, prot: libc::c_int) {
    if hi > lo {
        libc::mprotect(lo as *mut libc::c_void, hi - lo, prot);
    }
}

impl Pinned {
    /// Maps `size` bytes of page-aligned host memory.
    pub fn alloc(&mut self, size: usize) -> Option<usize> {
        let pg = crate::memory::page();
        let mapped = size.max(1).div_ceil(pg) * pg;
        // SAFETY: an anonymous private mapping; checked for failure below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                mapped,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return None;
        }
        let start = p as usize;
        let slot = fault::add_pinned(start, start + mapped);
        if slot.is_none() {
            self.warn_full("pinned buffers");
        }
        self.regions.insert(start, Region { size, mapped, slot });
        Some(start)
    }

    fn warn_full(&mut self, what: &str) {
        if !self.warned_full {
            self.warned_full = true;
            eprintln!(
                "cudasim: too many {what} to watch; reads of pinned memory before a \
                 synchronize are no longer all caught"
            );
        }
    }

    /// Unmaps the pinned buffer at `addr`; refused while a copy into it is pending.
    pub fn free(&mut self, addr: usize) -> Result<(), String> {
        let Some(r) = self.regions.get(&addr) else {
            return Err(format!(
                "cuMemFreeHost of {addr:#x}, which is not the start of a pinned buffer"
            ));
        };
        let end = addr + r.mapped;
        if let Some(p) = self.pending.iter().find(|p| p.lo < end && p.hi > addr) {
            return Err(format!(
                "cuMemFreeHost of the pinned buffer at {addr:#x} while a copy into it is \
                 pending ({}); synchronize its stream (or an event recorded after it) first",
                p.what
            ));
        }
        if let Some(slot) = r.slot {
            fault::remove_pinned(slot);
        }
        // SAFETY: our mapping, which no pending copy or watch refers to any more.
        unsafe { libc::munmap(addr as *mut libc::c_void, r.mapped) };
        self.regions.remove(&addr);
        Ok(())
    }

    /// The pinned buffer holding `addr`, as (start, requested size).
    pub fn find(&self, addr: usize) -> Option<(usize, usize)> {
        let (&start, r) = self.regions.range(..=addr).next_back()?;
        (addr < start + r.mapped).then_some((start, r.size))
    }

    /// Runs `f` with `[lo, hi)` accessible, then closes the pages of pending copies again.
    pub fn with_access<T>(&mut self, lo: usize, hi: usize, f: impl FnOnce() -> T) -> T {
        let (plo, phi) = page_range(lo, hi);
        // SAFETY: pages of our own mappings (the caller found them in a region).
        unsafe { protect(plo, phi, libc::PROT_READ | libc::PROT_WRITE) };
        let out = f();
        self.close_pending(plo, phi);
        out
    }

    /// Closes, within the pages `[plo, phi)`, the pages of every pending copy.
    fn close_pending(&self, plo: usize, phi: usize) {
        for p in &self.pending {
            let (a, b) = page_range(p.lo, p.hi);
            // SAFETY: pages of our own mappings.
            unsafe { protect(a.max(plo), b.min(phi), libc::PROT_NONE) };
        }
    }

    /// Notes a copy into `[lo, hi)` queued as operation `seq` of `stream` and closes its
    /// pages; `what` describes it. Earlier pending copies it covers are superseded.
    pub fn add_pending(&mut self, lo: usize, hi: usize, stream: usize, seq: u64, what: String) {
        if hi <= lo {
            return;
        }
        let mut i = 0;
        while i < self.pending.len() {
            if self.pending[i].lo >= lo && self.pending[i].hi <= hi {
                fault::remove_pending(self.pending.swap_remove(i).slot);
            } else {
                i += 1;
            }
        }
        let msg = format!("({what}) before the stream was synchronized\n");
        let Some(slot) = fault::add_pending(lo, hi, &msg) else {
            self.warn_full("pending copies into pinned memory");
            return;
        };
        self.pending.push(Pending {
            lo,
            hi,
            stream,
            seq,
            slot,
            what,
        });
        let (plo, phi) = page_range(lo, hi);
        // SAFETY: pages of our own mapping.
        unsafe { protect(plo, phi, libc::PROT_NONE) };
    }

    /// Completes the pending copies ordered before `point` (the host waited for it), or all
    /// of them when `point` is None; their pages open.
    pub fn complete(&mut self, point: Option<&Clock>) {
        let done =
            |p: &Pending| point.is_none_or(|c| c.get(&p.stream).is_some_and(|&n| n >= p.seq));
        let mut opened = Vec::new();
        let mut i = 0;
        while i < self.pending.len() {
            if done(&self.pending[i]) {
                let p = self.pending.swap_remove(i);
                fault::remove_pending(p.slot);
                opened.push(page_range(p.lo, p.hi));
            } else {
                i += 1;
            }
        }
        for (plo, phi) in opened {
            // SAFETY: pages of our own mappings.
            unsafe { protect(plo, phi, libc::PROT_READ | libc::PROT_WRITE) };
            self.close_pending(plo, phi);
        }
    }
}
