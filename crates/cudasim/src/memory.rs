//! Device memory: host mappings the library tracks, each followed by guard bytes whose
//! pattern is checked after every launch (the first [`GUARD_BYTES`]) and at every
//! synchronization point (all of them, to the mapping's end); freed mappings are kept (inaccessible) so that a
//! late use is caught instead of landing in a new allocation.

use std::collections::BTreeMap;
use std::sync::Arc;

/// Bytes after each allocation checked after every launch; the rest of the mapping, also
/// filled with [`GUARD`], is checked at synchronization points.
pub const GUARD_BYTES: usize = 256;
/// The guard pattern.
pub const GUARD: u8 = 0xA5;
/// Freed allocations kept before their memory is returned (newest last).
const QUARANTINE: usize = 4096;

/// One allocation.
#[derive(Debug, Clone)]
pub struct Alloc {
    /// Requested size in bytes.
    pub size: usize,
    /// Mapped bytes (size + guard, rounded to pages).
    pub mapped: usize,
    /// Whether it has been freed.
    pub freed: bool,
    /// What last wrote it, as a phrase ("kernel `amp_stats`", "a memset"); None while
    /// nothing has since it was allocated.
    pub writer: Option<Arc<str>>,
}

/// Every allocation, by start address.
#[derive(Default)]
pub struct Memory {
    allocs: BTreeMap<u64, Alloc>,
    /// The starts of the allocations not freed (the guard checks walk only these).
    live: std::collections::BTreeSet<u64>,
    quarantine: std::collections::VecDeque<u64>,
    /// Bytes allocated and not freed.
    pub live_bytes: usize,
}

/// The host's page size.
pub fn page() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as usize
    } else {
        4096
    }
}

impl Memory {
    /// Maps `size` bytes (256-byte aligned, as cuMemAlloc guarantees) plus guard bytes.
    pub fn alloc(&mut self, size: usize) -> Option<u64> {
        let pg = page();
        let mapped = (size.max(1) + GUARD_BYTES).div_ceil(pg) * pg;
        // SAFETY: an anonymous private mapping; checked for failure below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                mapped,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return None;
        }
        // Fresh device memory holds garbage on a GPU; a pattern makes reads of
        // never-written memory visible instead of silently zero.
        // SAFETY: the mapping is `mapped` bytes long and writable.
        unsafe {
            std::ptr::write_bytes(p as *mut u8, 0xCD, size);
            std::ptr::write_bytes((p as *mut u8).add(size), GUARD, mapped - size);
        }
        let addr = p as u64;
        self.allocs.insert(
            addr,
            Alloc {
                size,
                mapped,
                freed: false,
                writer: None,
            },
        );
        self.live_bytes += size;
        self.live.insert(addr);
        Some(addr)
    }

    /// Frees the allocation starting at `addr`: its memory becomes inaccessible.
    pub fn free(&mut self, addr: u64) -> Result<(), String> {
        let Some(a) = self.allocs.get_mut(&addr) else {
            return Err(format!(
                "free of {addr:#x}, which is not the start of an allocation"
            ));
        };
        if a.freed {
            return Err(format!("double free of the allocation at {addr:#x}"));
        }
        a.freed = true;
        self.live_bytes -= a.size;
        self.live.remove(&addr);
        // SAFETY: the mapping is ours; PROT_NONE makes any later access fault.
        unsafe { libc::mprotect(addr as *mut libc::c_void, a.mapped, libc::PROT_NONE) };
        self.quarantine.push_back(addr);
        if self.quarantine.len() > QUARANTINE {
            if let Some(old) = self.quarantine.pop_front() {
                if let Some(a) = self.allocs.remove(&old) {
                    // SAFETY: unmapping a quarantined mapping nothing may use any more.
                    unsafe { libc::munmap(old as *mut libc::c_void, a.mapped) };
                }
            }
        }
        Ok(())
    }

    /// The allocation holding `addr`, with its start.
    pub fn find(&self, addr: u64) -> Option<(u64, &Alloc)> {
        let (&start, a) = self.allocs.range(..=addr).next_back()?;
        (addr < start + a.mapped as u64).then_some((start, a))
    }

    /// Records `writer` as what last wrote the live allocation holding `addr`.
    pub fn set_writer(&mut self, addr: u64, writer: Arc<str>) {
        if let Some((&start, a)) = self.allocs.range_mut(..=addr).next_back() {
            if !a.freed && addr < start + a.mapped as u64 {
                a.writer = Some(writer);
            }
        }
    }

    /// What last wrote the allocation holding `addr`, as a phrase for messages.
    pub fn writer(&self, addr: u64) -> String {
        match self.find(addr) {
            Some((
                _,
                Alloc {
                    writer: Some(w), ..
                },
            )) => format!("last written by {w}"),
            _ => "not written since it was allocated".to_string(),
        }
    }

    /// Checks that `[addr, addr + len)` lies inside one live allocation; `what` names the
    /// operation in the error.
    pub fn check(&self, addr: u64, len: usize, what: &str) -> Result<(), String> {
        if len == 0 {
            return Ok(());
        }
        match self.find(addr) {
            None => Err(format!(
                "{what}: {addr:#x} is not device memory (no allocation holds it)"
            )),
            Some((start, a)) if a.freed => Err(format!(
                "{what}: {addr:#x} is in the freed allocation of {} bytes at {start:#x} (use after free)",
                a.size
            )),
            Some((start, a)) => {
                let end = addr + len as u64;
                if end > start + a.size as u64 {
                    Err(format!(
                        "{what}: {len} bytes at {addr:#x} run {} bytes past the end of the \
                         {}-byte allocation at {start:#x}",
                        end - (start + a.size as u64),
                        a.size
                    ))
                } else {
                    Ok(())
                }
            }
        }
    }

    /// The live allocations whose guard bytes were overwritten, as messages. With `near`,
    /// the first [`GUARD_BYTES`] past the end of each allocation a launch was given (what
    /// every launch checks: an overrun by a few elements, by the kernel just run); without,
    /// the whole rest of every live mapping (what a synchronization point checks, so a far
    /// overrun, or one through a pointer read from memory, is found there, as a GPU reports
    /// a kernel's fault late).
    pub fn damaged_guards(&self, near: Option<&[u64]>) -> Vec<String> {
        let mut out = Vec::new();
        let starts: Box<dyn Iterator<Item = u64> + '_> = match near {
            Some(s) => Box::new(s.iter().copied()),
            None => Box::new(self.live.iter().copied()),
        };
        for start in starts {
            let Some(a) = self.allocs.get(&start).filter(|a| !a.freed) else {
                continue;
            };
            let len = if near.is_some() {
                GUARD_BYTES.min(a.mapped - a.size)
            } else {
                a.mapped - a.size
            };
            // SAFETY: the guard bytes are inside the live mapping.
            let guard =
                unsafe { std::slice::from_raw_parts((start as *const u8).add(a.size), len) };
            if let Some(i) = first_not_guard(guard) {
                let by = match &a.writer {
                    Some(w) => format!(" (last written by {w})"),
                    None => String::new(),
                };
                out.push(format!(
                    "wrote {} bytes past the end of the {}-byte allocation at {start:#x}{by}",
                    i + 1,
                    a.size
                ));
                // Restore the guard so the next check is judged on its own.
                // SAFETY: as above, writable.
                unsafe {
                    std::ptr::write_bytes((start as *mut u8).add(a.size), GUARD, a.mapped - a.size)
                };
            }
        }
        out
    }

    /// Number of live allocations.
    pub fn live_count(&self) -> usize {
        self.live.len()
    }
}

/// The index of the first byte of `bytes` that is not [`GUARD`], eight bytes at a time.
fn first_not_guard(bytes: &[u8]) -> Option<usize> {
    const WORD: u64 = u64::from_ne_bytes([GUARD; 8]);
    let mut chunks = bytes.chunks_exact(8);
    let mut at = 0;
    for c in &mut chunks {
        if u64::from_ne_bytes(c.try_into().unwrap_or([0; 8])) != WORD {
            return c.iter().position(|&b| b != GUARD).map(|i| at + i);
        }
        at += 8;
    }
    chunks
        .remainder()
        .iter()
        .position(|&b| b != GUARD)
        .map(|i| at + i)
}
