//! What a launch read and wrote of the allocations it was given as pointer arguments,
//! page by page.
//!
//! Each allocation's pages are closed (`PROT_NONE`) for the launch. A kernel's first touch
//! of a page faults, and the handler (`fault.rs`) records whether it was a read or a write:
//! after a read it opens the page read-only, so a later write faults again and is recorded
//! too; after a write it opens the page read-write. A page read while closed counts as
//! read, a page written at all counts as written, each with its bytes clipped to the
//! allocation's size. So the counts depend on which pages the kernel touched and how, never
//! on the values it read or wrote (a write of the value already there counts).
//!
//! Reads are a lower bound: a written page is readable (x86-64 has no write-only pages), so
//! a read after a write, or the read half of an instruction that reads and writes (an atomic
//! read-modify-write, which faults as a write), is not seen. Where the fault context is not
//! decoded (architectures other than x86-64) a page's first fault is taken as a read; a
//! write then faults again on the read-only page and counts as written, so writes stay
//! page-exact while every touched page also counts as read. Touches from other threads
//! during the launch (a copy on another stream into the same allocation) count as the
//! kernel's.

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
    /// Bytes of the pages read while closed (first touched by a read), within the
    /// allocation's size.
    pub read: u64,
    /// Bytes of the pages written (first touched by a write, or written after a read),
    /// within the allocation's size, whatever values were written.
    pub written: u64,
    /// Whether anything wrote it (`written` is nonzero).
    pub wrote: bool,
}

/// Whether launches measure their traffic: it closes every argument allocation for each
/// launch and takes a fault or two on every page a kernel touches, which costs time, so it
/// is off unless `CUDASIM_TRAFFIC=1` or [`set_enabled`] asks for it.
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
    pages: Vec<Box<[AtomicU8]>>,
}

impl Watch {
    /// Closes `args` (distinct live allocations, at most [`fault::MAX_TRACKED`]).
    ///
    /// # Safety
    /// Each arg must be a live allocation of the library, not touched by other threads
    /// while the watch lives.
    pub unsafe fn start(args: &[Arg]) -> Watch {
        let pg = crate::memory::page();
        let mut w = Watch {
            args: args.to_vec(),
            pages: Vec::with_capacity(args.len()),
        };
        for (i, a) in args.iter().enumerate() {
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
                if flag & fault::PAGE_WRITTEN != 0 {
                    t.written += bytes;
                }
            }
            t.wrote = t.written > 0;
            out.push(t);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::{page, Memory};

    /// Runs `touch` on `args` under a watch and returns what it measured.
    fn watched(args: &[Arg], touch: impl FnOnce()) -> Vec<Traffic> {
        fault::install();
        let _launch = launch_lock();
        // SAFETY: live allocations of `Memory`, touched only by `touch` on this thread.
        let w = unsafe { Watch::start(args) };
        touch();
        w.finish()
    }

    fn arg(mem: &mut Memory, size: usize) -> Arg {
        let start = mem.alloc(size).expect("alloc");
        let (_, a) = mem.find(start).expect("allocated");
        Arg {
            start,
            size,
            mapped: a.mapped,
        }
    }

    #[test]
    fn pages_count_by_how_they_were_touched_not_by_the_values() {
        let pg = page();
        let mut mem = Memory::default();
        // Two and a half pages, and one page read only.
        let a = arg(&mut mem, 2 * pg + pg / 2);
        let b = arg(&mut mem, pg);
        let (pa, pb) = (a.start as *mut u8, b.start as *const u8);
        let t = watched(&[a, b], || {
            // SAFETY: bytes inside the allocations; volatile so each touch happens.
            unsafe {
                // Page 0 read, then written with the value it held.
                let v = std::ptr::read_volatile(pa.add(8));
                std::ptr::write_volatile(pa.add(8), v);
                // Page 2 (half of it inside the allocation) written with the value it held,
                // never read.
                std::ptr::write_volatile(pa.add(2 * pg + 1), 0xCD);
                std::ptr::read_volatile(pb.add(pg - 1));
            }
        });
        // Undecoded faults take the write's first fault on page 2 as a read.
        let undecoded = !cfg!(all(target_os = "linux", target_arch = "x86_64"));
        let read = pg + if undecoded { pg / 2 } else { 0 };
        assert_eq!(
            (t[0].read, t[0].written, t[0].wrote),
            (read as u64, (pg + pg / 2) as u64, true)
        );
        assert_eq!((t[1].read, t[1].written, t[1].wrote), (pg as u64, 0, false));
        // The allocations are open again.
        // SAFETY: inside the allocation.
        unsafe { std::ptr::write_volatile(pa.add(pg), 1) };
        mem.free(a.start).unwrap();
        mem.free(b.start).unwrap();
    }
}
