//! A counting allocator: while an input runs on a thread, the bytes that thread holds are
//! counted and their peak kept. Above a hard cap an allocation is refused (which aborts the
//! process) so that a parser that trusts a claimed size never gets the memory; the input is
//! saved first, as the refusal leaves nothing else behind.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::path::PathBuf;
use std::sync::Mutex;

pub struct Counting;

/// At most this many fuzzing threads keep a slot for their current input.
pub const SLOTS: usize = 16;

/// Each fuzzing thread's current input, for a refusal or a hang to save.
pub static CURRENT: [Mutex<Vec<u8>>; SLOTS] = [const { Mutex::new(Vec::new()) }; SLOTS];
/// Where to save the input a refusal or a hang stopped at (none: not saved).
pub static SAVE_TO: Mutex<Option<PathBuf>> = Mutex::new(None);

thread_local! {
    /// The cap on the bytes this thread holds while measuring (0: not measuring).
    static CAP: Cell<usize> = const { Cell::new(0) };
    static LIVE: Cell<usize> = const { Cell::new(0) };
    static PEAK: Cell<usize> = const { Cell::new(0) };
    /// This thread's slot in [`CURRENT`].
    static SLOT: Cell<usize> = const { Cell::new(0) };
}

/// Makes this thread use `slot` of [`CURRENT`].
pub fn set_slot(slot: usize) {
    SLOT.with(|s| s.set(slot % SLOTS));
}

pub fn slot() -> usize {
    SLOT.with(Cell::get)
}

/// Runs `f` counting this thread's allocations under `cap` bytes held at once; returns
/// its result and the peak of bytes held (above what was held before).
pub fn measure<R>(cap: usize, f: impl FnOnce() -> R) -> (R, usize) {
    LIVE.with(|l| l.set(0));
    PEAK.with(|p| p.set(0));
    CAP.with(|c| c.set(cap.max(1)));
    let r = f();
    CAP.with(|c| c.set(0));
    (r, PEAK.with(Cell::get))
}

/// Counts `size` more bytes held; false: refused (over the cap).
fn grow(size: usize) -> bool {
    let cap = CAP.with(Cell::get);
    if cap == 0 {
        return true;
    }
    let live = LIVE.with(Cell::get).saturating_add(size);
    if live > cap {
        refused(size, live);
        return false;
    }
    LIVE.with(|l| l.set(live));
    PEAK.with(|p| p.set(p.get().max(live)));
    true
}

fn shrink(size: usize) {
    if CAP.with(Cell::get) != 0 {
        LIVE.with(|l| l.set(l.get().saturating_sub(size)));
    }
}

/// Saves the current input and says why the process is about to abort.
fn refused(size: usize, live: usize) {
    // Stop counting: saving allocates.
    CAP.with(|c| c.set(0));
    save_current(slot());
    eprintln!(
        "over-allocation: an allocation of {size} bytes would hold {live} bytes; refused \
         (the process aborts)"
    );
}

/// Writes the input in `slot` to [`SAVE_TO`], when set; locks are only tried, since the
/// caller may be inside the allocator or racing a stuck thread.
pub fn save_current(slot: usize) {
    let Ok(to) = SAVE_TO.try_lock() else { return };
    let (Some(path), Ok(input)) = (to.as_ref(), CURRENT[slot % SLOTS].try_lock()) else {
        return;
    };
    if std::fs::write(path, &*input).is_ok() {
        eprintln!("the input is saved in {}", path.display());
    }
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if !grow(layout.size()) {
            return std::ptr::null_mut();
        }
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if !grow(layout.size()) {
            return std::ptr::null_mut();
        }
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        shrink(layout.size());
        // SAFETY: `ptr` came from this allocator, that is from the system allocator.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let old = layout.size();
        if new_size > old && !grow(new_size - old) {
            return std::ptr::null_mut();
        }
        // SAFETY: forwarded unchanged to the system allocator.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if new_size < old && !p.is_null() {
            shrink(old - new_size);
        }
        p
    }
}
