//! The library's SIGSEGV handler and the lock-free tables it reads.
//!
//! Two kinds of memory are made inaccessible on purpose, and the handler tells their faults
//! apart by address: pinned host buffers with a device-to-host copy the host has not waited
//! for (a touch there is the bug being looked for: the handler prints what was copied and
//! aborts), and the argument allocations of the launch running (a touch there is a kernel's
//! first read or first write of that page: the handler records which and opens the page,
//! read-only after a read so that a later write faults too, read-write after a write).
//! Faults anywhere else go on to the handler that was installed before this one.
//!
//! The handler takes no lock and allocates nothing: it reads fixed static tables through
//! atomics. The tables are written only by the library, under its state lock (pinned memory)
//! or its launch lock (argument allocations), so each has one writer at a time.

use std::cell::UnsafeCell;
use std::ffi::{c_int, c_void};
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicPtr, AtomicU8, AtomicUsize, Ordering};
use std::sync::Once;

/// Page flag: the page was read while closed (its first access in the launch was a read).
pub const PAGE_READ: u8 = 1;
/// Page flag: the page was written in the launch (its first access, or one after a read).
pub const PAGE_WRITTEN: u8 = 2;

/// Pinned buffers the handler knows.
pub const MAX_PINNED: usize = 1024;
/// Copies into pinned memory not yet waited for.
pub const MAX_PENDING: usize = 1024;
/// Argument allocations of one launch.
pub const MAX_TRACKED: usize = 512;
/// Bytes of a pending copy's preformatted message.
const MSG: usize = 448;

struct Range {
    start: AtomicUsize,
    /// One past the last byte; 0 marks a free slot.
    end: AtomicUsize,
}

#[allow(clippy::declare_interior_mutable_const)]
const FREE_RANGE: Range = Range {
    start: AtomicUsize::new(0),
    end: AtomicUsize::new(0),
};

struct PendingSlot {
    range: Range,
    len: AtomicUsize,
    msg: UnsafeCell<[u8; MSG]>,
}

// SAFETY: `msg` is written only while the slot is free (`end` 0) by the one writer the
// state lock allows, and read by the handler only after it sees `end` set (Acquire).
unsafe impl Sync for PendingSlot {}

#[allow(clippy::declare_interior_mutable_const)]
const FREE_PENDING: PendingSlot = PendingSlot {
    range: FREE_RANGE,
    len: AtomicUsize::new(0),
    msg: UnsafeCell::new([0; MSG]),
};

struct TrackedSlot {
    range: Range,
    /// One flag byte per page of the range.
    pages: AtomicPtr<AtomicU8>,
}

#[allow(clippy::declare_interior_mutable_const)]
const FREE_TRACKED: TrackedSlot = TrackedSlot {
    range: FREE_RANGE,
    pages: AtomicPtr::new(std::ptr::null_mut()),
};

static PINNED: [Range; MAX_PINNED] = [FREE_RANGE; MAX_PINNED];
static PENDING: [PendingSlot; MAX_PENDING] = [FREE_PENDING; MAX_PENDING];
static TRACKED: [TrackedSlot; MAX_TRACKED] = [FREE_TRACKED; MAX_TRACKED];
static PAGE: AtomicUsize = AtomicUsize::new(4096);

struct OldAction(UnsafeCell<MaybeUninit<libc::sigaction>>);
// SAFETY: written once by `install` before the handler that reads it is installed.
unsafe impl Sync for OldAction {}
static OLD: OldAction = OldAction(UnsafeCell::new(MaybeUninit::zeroed()));

/// Installs the handler (once per process).
pub fn install() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        PAGE.store(crate::memory::page(), Ordering::Relaxed);
        // SAFETY: plain sigaction calls with initialized structures; the previous action is
        // read into OLD before the new handler can run.
        unsafe {
            libc::sigaction(libc::SIGSEGV, std::ptr::null(), (*OLD.0.get()).as_mut_ptr());
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_segv as *const () as usize;
            // On the alternate stack where there is one: Rust's stack-overflow report runs
            // there, and it is reached through this handler.
            sa.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(libc::SIGSEGV, &sa, std::ptr::null_mut());
        }
    });
}

fn claim(table: impl Iterator<Item = (usize, &'static Range)>) -> Option<usize> {
    // Slots are claimed only by the table's one writer, so a free slot stays free.
    table
        .filter(|(_, r)| r.end.load(Ordering::Relaxed) == 0)
        .map(|(i, _)| i)
        .next()
}

/// Makes `[start, end)` known as pinned memory; None when the table is full.
pub fn add_pinned(start: usize, end: usize) -> Option<usize> {
    let i = claim(PINNED.iter().enumerate())?;
    PINNED[i].start.store(start, Ordering::Relaxed);
    PINNED[i].end.store(end, Ordering::Release);
    Some(i)
}

/// Forgets pinned slot `i`.
pub fn remove_pinned(i: usize) {
    PINNED[i].end.store(0, Ordering::Release);
}

/// Records a pending copy into `[lo, hi)` of pinned memory, with the message's tail the
/// handler prints after the address; None when the table is full.
pub fn add_pending(lo: usize, hi: usize, msg: &str) -> Option<usize> {
    let i = claim(PENDING.iter().enumerate().map(|(i, p)| (i, &p.range)))?;
    let p = &PENDING[i];
    let bytes = msg.as_bytes();
    let n = bytes.len().min(MSG);
    // SAFETY: the slot is free, so the handler does not read `msg`; one writer (see Sync).
    unsafe { (&mut *p.msg.get())[..n].copy_from_slice(&bytes[..n]) };
    p.len.store(n, Ordering::Relaxed);
    p.range.start.store(lo, Ordering::Relaxed);
    p.range.end.store(hi, Ordering::Release);
    Some(i)
}

/// Forgets pending slot `i` (the host waited for the copy).
pub fn remove_pending(i: usize) {
    PENDING[i].range.end.store(0, Ordering::Release);
}

/// Watches `[start, end)` (page-aligned) during a launch, one flag byte per page in `pages`,
/// which must outlive the watch (ended by [`untrack`]).
pub fn track(i: usize, start: usize, end: usize, pages: &[AtomicU8]) {
    let t = &TRACKED[i];
    t.pages
        .store(pages.as_ptr() as *mut AtomicU8, Ordering::Relaxed);
    t.range.start.store(start, Ordering::Relaxed);
    t.range.end.store(end, Ordering::Release);
}

/// Ends the watch of slot `i`.
pub fn untrack(i: usize) {
    TRACKED[i].range.end.store(0, Ordering::Release);
}

/// How the faulting instruction touched memory.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Access {
    Read,
    Write,
    /// The architecture's fault context is not decoded here.
    #[cfg_attr(all(target_os = "linux", target_arch = "x86_64"), allow(dead_code))]
    Unknown,
}

#[cfg(all(target_os = "linux", target_arch = "x86_64"))]
unsafe fn access(ctx: *mut c_void) -> Access {
    // Bit 1 of the page-fault error code: the access was a write.
    let uc = ctx as *const libc::ucontext_t;
    if (*uc).uc_mcontext.gregs[libc::REG_ERR as usize] & 2 != 0 {
        Access::Write
    } else {
        Access::Read
    }
}

#[cfg(not(all(target_os = "linux", target_arch = "x86_64")))]
unsafe fn access(_ctx: *mut c_void) -> Access {
    Access::Unknown
}

fn contains(r: &Range, addr: usize) -> Option<usize> {
    let end = r.end.load(Ordering::Acquire);
    let start = r.start.load(Ordering::Relaxed);
    (end != 0 && addr >= start && addr < end).then_some(start)
}

/// The flag a fault on a watched page sets, from how it touched memory and the flags the
/// page already has.
fn fault_flag(how: Access, flags: u8) -> u8 {
    match how {
        Access::Read => PAGE_READ,
        Access::Write => PAGE_WRITTEN,
        // Undecoded, a page's first fault is taken as a read and opens it read-only, so a
        // fault on a page already read can only be a write (unless another thread's first
        // read of the page is still opening it: that read then counts as a write).
        Access::Unknown if flags & PAGE_READ != 0 => PAGE_WRITTEN,
        Access::Unknown => PAGE_READ,
    }
}

unsafe fn open_page(addr: usize, prot: c_int) -> bool {
    let pg = PAGE.load(Ordering::Relaxed);
    let page = addr & !(pg - 1);
    libc::mprotect(page as *mut c_void, pg, prot) == 0
}

unsafe extern "C" fn on_segv(sig: c_int, info: *mut libc::siginfo_t, ctx: *mut c_void) {
    let addr = (*info).si_addr() as usize;
    for p in &PENDING {
        if contains(&p.range, addr).is_some() {
            report(addr, p, access(ctx));
        }
    }
    for t in &TRACKED {
        if let Some(start) = contains(&t.range, addr) {
            let page = (addr - start) / PAGE.load(Ordering::Relaxed);
            let flags = &*t.pages.load(Ordering::Relaxed).add(page);
            let flag = fault_flag(access(ctx), flags.load(Ordering::Relaxed));
            let now = flags.fetch_or(flag, Ordering::Relaxed) | flag;
            // A page already written opens read-write, so that another thread's read fault,
            // taken while the page was closed and handled after the write's, does not close
            // it to writes again (it would only cost the next write one more fault).
            let prot = if now & PAGE_WRITTEN != 0 {
                libc::PROT_READ | libc::PROT_WRITE
            } else {
                libc::PROT_READ
            };
            if open_page(addr, prot) {
                return;
            }
        }
    }
    // A pinned page closed for a pending copy's bytes, touched outside those bytes: not a
    // hazard; the page opens (and the copy's bytes on it are no longer watched).
    for r in &PINNED {
        if contains(r, addr).is_some() && open_page(addr, libc::PROT_READ | libc::PROT_WRITE) {
            return;
        }
    }
    chain(sig, info, ctx);
}

/// Writes the pending copy's message and aborts (async-signal-safe calls only).
unsafe fn report(addr: usize, p: &PendingSlot, how: Access) -> ! {
    let mut head = [0u8; 96];
    let mut n = 0;
    let mut put = |s: &[u8]| {
        for &b in s {
            if n < head.len() {
                head[n] = b;
                n += 1;
            }
        }
    };
    put(b"cudasim: host ");
    put(match how {
        Access::Read => b"read",
        Access::Write => b"write",
        Access::Unknown => b"access",
    });
    put(b" of pinned memory at 0x");
    let mut hex = [0u8; 16];
    let mut v = addr;
    let mut digits = 0;
    loop {
        hex[15 - digits] = b"0123456789abcdef"[v & 15];
        digits += 1;
        v >>= 4;
        if v == 0 {
            break;
        }
    }
    put(&hex[16 - digits..]);
    put(b" ");
    libc::write(2, head.as_ptr() as *const c_void, n);
    let len = p.len.load(Ordering::Relaxed);
    libc::write(2, p.msg.get() as *const c_void, len);
    libc::abort();
}

/// Hands a fault that is not the library's to the previous handler.
unsafe fn chain(sig: c_int, info: *mut libc::siginfo_t, ctx: *mut c_void) {
    let old = (*OLD.0.get()).assume_init_ref();
    let h = old.sa_sigaction;
    if h == libc::SIG_DFL || h == libc::SIG_IGN {
        // Returning re-runs the access, which then takes the default action (a SIGSEGV
        // that ends the process), as it would have without this handler.
        let mut dfl: libc::sigaction = std::mem::zeroed();
        dfl.sa_sigaction = libc::SIG_DFL;
        libc::sigaction(sig, &dfl, std::ptr::null_mut());
    } else if old.sa_flags & libc::SA_SIGINFO != 0 {
        let f: unsafe extern "C" fn(c_int, *mut libc::siginfo_t, *mut c_void) =
            std::mem::transmute(h);
        f(sig, info, ctx);
    } else {
        let f: unsafe extern "C" fn(c_int) = std::mem::transmute(h);
        f(sig);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decoded_faults_set_their_own_flag() {
        for flags in [0, PAGE_READ, PAGE_WRITTEN, PAGE_READ | PAGE_WRITTEN] {
            assert_eq!(fault_flag(Access::Read, flags), PAGE_READ);
            assert_eq!(fault_flag(Access::Write, flags), PAGE_WRITTEN);
        }
    }

    #[test]
    fn an_undecoded_fault_is_a_read_first_and_a_write_on_a_page_already_read() {
        assert_eq!(fault_flag(Access::Unknown, 0), PAGE_READ);
        assert_eq!(fault_flag(Access::Unknown, PAGE_READ), PAGE_WRITTEN);
    }
}
