//! What a launch read and wrote of the allocations it was given as pointer arguments.
//!
//! Writes: each allocation is copied before the launch and compared after; the bytes whose
//! value changed are the bytes written (a write of the value already there is not seen).
//! Reads: each allocation's pages are closed (`PROT_NONE`) for the launch; a kernel's first
//! touch of a page faults, the handler (`fault.rs`) notes whether it was a read or a write
//! and opens the page. A page whose first touch was a read counts as read, its bytes
//! clipped to the allocation's size. Later touches of an open page are not seen, so a page
//! first written and then read (or updated by an atomic read-modify-write, which faults as
//! a write) does not count as read; where the fault context is not decoded (architectures
//! other than x86-64) every first touch counts as a read. Touches from other threads during
//! the launch (a copy on another stream into the same allocation) count as the kernel's.

use crate::fault;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Mutex, MutexGuard};

/// One allocation a launch was given.
#[derive(Clone, Copy)]
pub struct Arg {
    /// Start address.
    pub start: u64,
    /// Requested size.
    pub size: usize,
    /// Mapped bytes (page-aligned, guard included).
    pub mapped: usize,
}

/// What a launch did to one argument allocation.
#[derive(Clone, Copy, Default)]
pub struct Traffic {
    /// Bytes of the pages whose first touch was a read, within the allocation's size.
    pub read: u64,
    /// Bytes whose value changed.
    pub written: u64,
    /// Whether anything wrote it (a changed byte, or a page whose first touch was a write).
    pub wrote: bool,
}

/// Whether launches measure their traffic: it copies and closes every argument allocation
/// for each launch, which costs time in proportion to their size, so it is off unless
/// `CUDASIM_TRAFFIC=1` or [`set_enabled`] asks for it.
static ENABLED: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(2);

/// True when launches measure their traffic.
pub fn enabled() -> bool {
    match ENABLED.load(Ordering::Relaxed) {
        2 => {
            let on = std::env::var("CUDASIM_TRAFFIC").is_ok_and(|v| v == "1");
            ENABLED.store(on as u8, Ordering::Relaxed);
            on
        }
        v => v == 1,
    }
}

/// Turns the measurement on or off for the following launches.
pub fn set_enabled(on: bool) {
    ENABLED.store(on as u8, Ordering::Relaxed);
}

/// Launches run one at a time: a page closed for one launch must not be opened by another
/// launch's end, and the handler's table of watched allocations has one writer.
static LAUNCH: Mutex<()> = Mutex::new(());

/// Holds the launch lock.
pub fn launch_lock() -> MutexGuard<'static, ()> {
    LAUNCH.lock().unwrap_or_else(|e| e.into_inner())
}

/// A launch's watch over its argument allocations (hold [`launch_lock`] while it lives).
pub struct Watch {
    args: Vec<Arg>,
    before: Vec<Vec<u8>>,
    pages: Vec<Box<[AtomicU8]>>,
}

impl Watch {
    /// Copies and closes `args` (distinct live allocations, at most [`fault::MAX_TRACKED`]).
    ///
    /// # Safety
    /// Each arg must be a live allocation of the library, not touched by other threads
    /// while the watch lives.
    pub unsafe fn start(args: &[Arg]) -> Watch {
        let pg = crate::memory::page();
        let mut w = Watch {
            args: args.to_vec(),
            before: Vec::with_capacity(args.len()),
            pages: Vec::with_capacity(args.len()),
        };
        for (i, a) in args.iter().enumerate() {
            w.before
                .push(std::slice::from_raw_parts(a.start as *const u8, a.size).to_vec());
            let pages: Box<[AtomicU8]> = (0..a.mapped / pg).map(|_| AtomicU8::new(0)).collect();
            fault::track(i, a.start as usize, a.start as usize + a.mapped, &pages);
            w.pages.push(pages);
            libc::mprotect(a.start as *mut libc::c_void, a.mapped, libc::PROT_NONE);
        }
        w
    }

    /// Opens the allocations again and measures each one's traffic.
    pub fn finish(self) -> Vec<Traffic> {
        let pg = crate::memory::page();
        let mut out = Vec::with_capacity(self.args.len());
        for (i, a) in self.args.iter().enumerate() {
            // SAFETY: our mapping, closed by `start`; the watch ends after it is open, so
            // no fault of this allocation is left to the handler.
            unsafe {
                libc::mprotect(
                    a.start as *mut libc::c_void,
                    a.mapped,
                    libc::PROT_READ | libc::PROT_WRITE,
                )
            };
            fault::untrack(i);
            let mut t = Traffic::default();
            for (p, flag) in self.pages[i].iter().enumerate() {
                let bytes = a.size.saturating_sub(p * pg).min(pg) as u64;
                let flag = flag.load(Ordering::Relaxed);
                if flag & fault::PAGE_READ != 0 {
                    t.read += bytes;
                }
                if flag & fault::PAGE_WRITTEN != 0 && bytes > 0 {
                    t.wrote = true;
                }
            }
            // SAFETY: `size` bytes of the open allocation.
            let now = unsafe { std::slice::from_raw_parts(a.start as *const u8, a.size) };
            t.written = changed(&self.before[i], now);
            t.wrote |= t.written > 0;
            out.push(t);
        }
        out
    }
}

/// Bytes that differ between `a` and `b` (equal lengths).
fn changed(a: &[u8], b: &[u8]) -> u64 {
    let mut n = 0u64;
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        if x != y {
            n += x.iter().zip(y).filter(|(p, q)| p != q).count() as u64;
        }
    }
    n + ra.iter().zip(rb).filter(|(p, q)| p != q).count() as u64
}

#[cfg(test)]
mod tests {
    #[test]
    fn changed_counts_differing_bytes() {
        let a = [0u8; 19];
        let mut b = a;
        b[0] = 1;
        b[9] = 2;
        b[18] = 3;
        assert_eq!(super::changed(&a, &b), 3);
        assert_eq!(super::changed(&a, &a), 0);
    }
}
