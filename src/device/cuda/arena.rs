//! The device-side probe statistics arena: one slot of counters, extremes, sum of squares
//! and exponent histogram per probed tensor, filled by kernels and read back with one copy.
//!
//! The slot layout is shared with the kernels (the `ST_*` word indices of `common.cuh`).
//! A slot's statistics come from one of two places: the arena's own pass over a finished
//! tensor ([`StatsArena::probe`], `probes/stats.cu`), or, while the arena gathers
//! ([`StatsArena::set_gathering`]), the kernel that writes the tensor, in the same pass
//! ([`StatsArena::gather`]). Both run the same per-element steps over the same launch
//! shape ([`stats_config`]), so a slot holds the same words either way.

use super::buffer::{kind_code, DeviceBuffer};
use super::driver_error::dev_err;
use super::handle::{DeviceHandle, THREADS};
use crate::dtype::{DType, RoundCounts};
use crate::error::{Error, Result};
use crate::trace::stats::{CastCounts, ExpHist, TensorStats};
use cudarc::driver::{CudaSlice, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg};
use std::sync::Arc;

/// u64 words per slot (`SLOT_WORDS`).
pub const SLOT_WORDS: usize = 296;
/// f64 partial sums per slot (`MAX_PARTIALS`): the most blocks one tensor's pass uses.
pub const MAX_PARTIALS: usize = 1024;
/// Histogram bins: floor(log2|x|) from -149 to 127.
pub const HIST_BINS: usize = 277;
/// Tensors shorter than this are queued and probed many per launch.
pub const SMALL: usize = 1 << 16;
const HIST_AT: usize = 16;
const ROUND_AT: usize = 9;
/// In an op's slot: the -inf values its kernel wrote on purpose (a mask's fill), for
/// [`SlotStats::masked_neg_inf`]. No probe writes it (the statistics stop at word 292; word 293
/// holds a gradient's scaled fp16 flushes).
pub const MASKED_NEG_INF: usize = 294;

/// The CUDA source of the arena's own statistics kernels (`probes/stats.cu`).
pub const SOURCE: &str = include_str!("../../../probes/stats.cu");
/// The kernels of [`SOURCE`] the arena launches.
pub const KERNELS: &[&str] = &["amp_stats", "amp_stats_batch", "amp_stats_finish"];

/// A probe request, laid out as `ProbeDesc` in stats.cu.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct ProbeDesc {
    data: u64,
    n: u64,
    kind: u32,
    sub_limit: u32,
    slot: u32,
    /// 1: count only the non-finite values (the check-only mode).
    check: u32,
}

// SAFETY: plain-old-data with the C layout of the kernel's struct.
unsafe impl DeviceRepr for ProbeDesc {}

/// What one slot holds after [`StatsArena::read`].
#[derive(Debug, Clone, PartialEq)]
pub struct SlotStats {
    /// Statistics of the probed tensor (default when the slot only counted rounding).
    pub stats: TensorStats,
    /// Over/underflow counted by the kernel that rounded the tensor.
    pub rounding: RoundCounts,
    /// -inf values the op's kernel wrote on purpose (word [`MASKED_NEG_INF`]).
    pub masked_neg_inf: u64,
}

/// Slots of statistics on the device for one step.
pub struct StatsArena {
    words: CudaSlice<u64>,
    partials: CudaSlice<f64>,
    capacity: usize,
    used: usize,
    pending: Vec<ProbeDesc>,
    keep: Vec<Arc<DeviceBuffer>>,
    descs: Option<CudaSlice<ProbeDesc>>,
    gathering: bool,
    /// Whether kernels count their rounding's over/underflow ([`StatsArena::set_counting`]).
    counting: bool,
    /// Whether slots get only their tensors' non-finite counts ([`StatsArena::set_check_only`]).
    check_only: bool,
    /// Per slot whose statistics a producing kernel gathers: that tensor's address and
    /// length.
    gathered: std::collections::HashMap<u32, (u64, usize)>,
}

/// The launch shape of one tensor's statistics pass over `n` values: enough blocks to fill
/// a GPU, fixed by the length alone (so the sum of squares is reproducible), at most
/// [`MAX_PARTIALS`].
pub fn stats_config(n: u64) -> LaunchConfig {
    let blocks = n.div_ceil(THREADS as u64 * 8).clamp(1, MAX_PARTIALS as u64) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The smallest normal of `dtype` as an f32 bit pattern (0: nothing is subnormal).
fn sub_limit(dtype: DType) -> u32 {
    match dtype {
        DType::F16 => 0x3880_0000,
        DType::BF16 | DType::F32 => 0x0080_0000,
        DType::F64 | DType::I64 => 0,
    }
}

impl StatsArena {
    /// An arena of `capacity` slots (it grows when a step needs more).
    pub fn new(dev: &DeviceHandle, capacity: usize) -> Result<StatsArena> {
        let capacity = capacity.max(1);
        let s = dev.stream();
        Ok(StatsArena {
            words: s
                .alloc_zeros(capacity * SLOT_WORDS)
                .map_err(|e| dev_err("arena alloc")(&e))?,
            partials: s
                .alloc_zeros(capacity * MAX_PARTIALS)
                .map_err(|e| dev_err("arena alloc")(&e))?,
            capacity,
            used: 0,
            pending: Vec::new(),
            keep: Vec::new(),
            descs: None,
            gathering: false,
            counting: true,
            check_only: false,
            gathered: std::collections::HashMap::new(),
        })
    }

    /// Clears every slot for a new step (queued on the stream, no wait).
    pub fn reset(&mut self, dev: &DeviceHandle) -> Result<()> {
        let s = dev.stream();
        s.memset_zeros(&mut self.words)
            .map_err(|e| dev_err("arena reset")(&e))?;
        self.used = 0;
        self.pending.clear();
        self.keep.clear();
        self.gathered.clear();
        Ok(())
    }

    /// Whether the kernels that write op outputs gather their statistics while they write
    /// them (one pass over memory instead of two). Set per step: on when every output is
    /// probed anyway, off when nothing is (so no statistics are computed at all).
    pub fn set_gathering(&mut self, on: bool) {
        self.gathering = on;
    }

    /// Whether op kernels count the over/underflow of their rounding (the default) or
    /// count nothing: [`round_counts_ptr`](Self::round_counts_ptr) is then 0, so a 16-bit
    /// product is rounded by cuBLAS as it writes it instead of by a counting cast. Set per
    /// step: off when no probe reads the counts.
    pub fn set_counting(&mut self, on: bool) {
        self.counting = on;
    }

    /// Whether the statistics gathered and probed from now on are only each tensor's NaN,
    /// +inf and -inf counts and its length (every other word of the slot stays zero), or
    /// the full statistics (the default). The check-only mode is for a step whose op
    /// records are not kept: origins need nothing else, and a step that turns out to keep
    /// its records takes their statistics from a re-run. Rounding is counted or not as
    /// [`set_counting`](Self::set_counting) says.
    pub fn set_check_only(&mut self, on: bool) {
        self.check_only = on;
    }

    /// Whether slots get only their tensors' non-finite counts
    /// ([`set_check_only`](Self::set_check_only)).
    pub fn is_check_only(&self) -> bool {
        self.check_only
    }

    /// True while the arena gathers statistics in producing kernels.
    pub fn gathering(&self) -> bool {
        self.gathering
    }

    /// Where the kernel about to write `out` (an op's whole output) gathers its statistics
    /// into `slot`: the device address of the slot's partial sums, to launch that kernel
    /// with on [`stats_config`]'s shape. None when the arena is not gathering (the kernel
    /// then runs without statistics). A later [`probe`](Self::probe) of the same tensor
    /// into the slot finds it done; a probe of another tensor into it is an error.
    pub fn gather(
        &mut self,
        dev: &DeviceHandle,
        slot: u32,
        out: &Arc<DeviceBuffer>,
    ) -> Result<Option<u64>> {
        if !self.gathering {
            return Ok(None);
        }
        // The partials are 8-byte aligned: the lowest bit tells the kernel to check only.
        let tag = self.check_only as u64;
        self.gather_in_kernel(dev, slot, out).map(|p| Some(p | tag))
    }

    /// [`gather`](Self::gather) whatever the arena's mode: for statistics every step has
    /// (a parameter's record), gathered by the kernel that reads or writes the tensor.
    pub fn gather_in_kernel(
        &mut self,
        dev: &DeviceHandle,
        slot: u32,
        out: &Arc<DeviceBuffer>,
    ) -> Result<u64> {
        if slot as usize >= self.used {
            return Err(Error::Device(format!(
                "statistics slot {slot} was not handed out"
            )));
        }
        if self
            .gathered
            .insert(slot, (out.ptr(dev), out.len()))
            .is_some()
        {
            return Err(Error::Device(format!(
                "slot {slot} already gathers another tensor's statistics"
            )));
        }
        Ok(self.partials.device_ptr(dev.stream()).0 + (slot as usize * MAX_PARTIALS * 8) as u64)
    }

    /// The device memory the arena holds, in bytes (its slots' words and partial sums).
    pub fn bytes(&self) -> u64 {
        (self.capacity * (SLOT_WORDS + MAX_PARTIALS) * 8) as u64
    }

    /// Slots handed out since the last reset.
    pub fn used(&self) -> usize {
        self.used
    }

    /// A fresh slot.
    pub fn slot(&mut self, dev: &DeviceHandle) -> Result<u32> {
        if self.used == self.capacity {
            self.grow(dev)?;
        }
        self.used += 1;
        Ok((self.used - 1) as u32)
    }

    fn grow(&mut self, dev: &DeviceHandle) -> Result<()> {
        let s = dev.stream();
        let cap = self.capacity * 2;
        let mut words: CudaSlice<u64> = s
            .alloc_zeros(cap * SLOT_WORDS)
            .map_err(|e| dev_err("arena grow")(&e))?;
        let mut partials: CudaSlice<f64> = s
            .alloc_zeros(cap * MAX_PARTIALS)
            .map_err(|e| dev_err("arena grow")(&e))?;
        s.memcpy_dtod(
            &self.words,
            &mut words.slice_mut(..self.capacity * SLOT_WORDS),
        )
        .map_err(|e| dev_err("arena grow")(&e))?;
        s.memcpy_dtod(
            &self.partials,
            &mut partials.slice_mut(..self.capacity * MAX_PARTIALS),
        )
        .map_err(|e| dev_err("arena grow")(&e))?;
        self.words = words;
        self.partials = partials;
        self.capacity = cap;
        Ok(())
    }

    /// Device address of a slot's two rounding counters (overflow, underflow), for a
    /// kernel that rounds; 0 (count nothing) while the arena does not count.
    pub fn round_counts_ptr(&self, dev: &DeviceHandle, slot: u32) -> u64 {
        if !self.counting {
            return 0;
        }
        self.word_ptr(dev, slot, ROUND_AT)
    }

    /// Device address of word `word` of `slot`: where a kernel leaves a value for the
    /// step's one read (in a slot no probe writes, or a word no probe uses).
    pub fn word_ptr(&self, dev: &DeviceHandle, slot: u32, word: usize) -> u64 {
        debug_assert!(word < SLOT_WORDS);
        self.words.device_ptr(dev.stream()).0 + ((slot as usize * SLOT_WORDS + word) * 8) as u64
    }

    /// Queues the statistics of `buf` (elements of `dtype`) into `slot`. Large tensors get
    /// their own launch; small ones are batched into one launch at the next
    /// [`flush`](Self::flush).
    pub fn probe(
        &mut self,
        dev: &DeviceHandle,
        buf: &Arc<DeviceBuffer>,
        dtype: DType,
        slot: u32,
    ) -> Result<()> {
        if slot as usize >= self.used {
            return Err(Error::Device(format!(
                "probe slot {slot} was not handed out"
            )));
        }
        let n = buf.len();
        if let Some(&(at, len)) = self.gathered.get(&slot) {
            if (at, len) == (buf.ptr(dev), n) {
                return Ok(());
            }
            return Err(Error::Device(format!(
                "slot {slot} holds statistics its kernel gathered from another tensor"
            )));
        }
        let d = ProbeDesc {
            data: buf.ptr(dev),
            n: n as u64,
            kind: kind_code(dtype)? as u32,
            sub_limit: sub_limit(dtype),
            slot,
            check: self.check_only as u32,
        };
        if n < SMALL {
            self.pending.push(d);
            self.keep.push(buf.clone());
            return Ok(());
        }
        dev.check_args("amp_stats", 3)?;
        let f = dev.func("amp_stats")?;
        let cfg = stats_config(n as u64);
        let mut b = dev.stream().launch_builder(f);
        b.arg(&d).arg(&mut self.words).arg(&mut self.partials);
        // SAFETY: the descriptor addresses a live tensor of `n` elements of `kind`; the
        // slot is inside the arena; argument types match the kernel's signature.
        unsafe { b.launch(cfg) }.map_err(|e| dev_err("amp_stats")(&e))?;
        Ok(())
    }

    /// Launches the queued small-tensor probes (one launch).
    pub fn flush(&mut self, dev: &DeviceHandle) -> Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let s = dev.stream();
        // One descriptor buffer, kept and grown, so that a step allocates nothing; the copy
        // into it is ordered after the launches that read its previous contents.
        let n = self.pending.len();
        if self.descs.as_ref().is_none_or(|d| d.len() < n) {
            let cap = n.next_power_of_two().max(256);
            // SAFETY: every descriptor a launch reads is written by the copy below first.
            self.descs = Some(
                unsafe { s.alloc::<ProbeDesc>(cap) }
                    .map_err(|e| dev_err("probe batch alloc")(&e))?,
            );
        }
        let all = self.descs.as_mut().expect("allocated above");
        s.memcpy_htod(&self.pending[..], &mut all.slice_mut(..n))
            .map_err(|e| dev_err("probe batch upload")(&e))?;
        for (c, chunk) in self.pending.chunks(65_535).enumerate() {
            let at = c * 65_535;
            let descs = all.slice(at..at + chunk.len());
            let count = chunk.len() as u32;
            dev.check_args("amp_stats_batch", 4)?;
            let f = dev.func("amp_stats_batch")?;
            let cfg = LaunchConfig {
                grid_dim: (count, 1, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut b = s.launch_builder(f);
            b.arg(&descs)
                .arg(&count)
                .arg(&mut self.words)
                .arg(&mut self.partials);
            // SAFETY: as in `probe`, for every queued descriptor.
            unsafe { b.launch(cfg) }.map_err(|e| dev_err("amp_stats_batch")(&e))?;
        }
        self.pending.clear();
        Ok(())
    }

    /// Finishes the step's statistics and copies every used slot to the host: the one
    /// device-to-host read of a step.
    pub fn read(&mut self, dev: &DeviceHandle) -> Result<Vec<SlotStats>> {
        Ok(self.read_words(dev)?.stats())
    }

    /// [`StatsArena::read`], keeping every word of every slot (values kernels left in
    /// slot words besides the statistics).
    pub fn read_words(&mut self, dev: &DeviceHandle) -> Result<ArenaWords> {
        self.flush(dev)?;
        if self.used == 0 {
            return Ok(ArenaWords { words: Vec::new() });
        }
        let s = dev.stream();
        let slots = self.used as u32;
        dev.check_args("amp_stats_finish", 3)?;
        let f = dev.func("amp_stats_finish")?;
        let cfg = LaunchConfig {
            grid_dim: (slots.div_ceil(THREADS), 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = s.launch_builder(f);
        b.arg(&mut self.words).arg(&self.partials).arg(&slots);
        // SAFETY: `slots` slots exist in both buffers.
        unsafe { b.launch(cfg) }.map_err(|e| dev_err("amp_stats_finish")(&e))?;
        let host = s
            .clone_dtoh(&self.words.slice(..self.used * SLOT_WORDS))
            .map_err(|e| dev_err("arena read")(&e))?;
        self.keep.clear();
        Ok(ArenaWords { words: host })
    }
}

/// Every word of the used slots, as one read returned them.
#[derive(Debug, Clone, Default)]
pub struct ArenaWords {
    words: Vec<u64>,
}

impl ArenaWords {
    /// Number of slots.
    pub fn slots(&self) -> usize {
        self.words.len() / SLOT_WORDS
    }

    /// The words of slot `slot`, or an error naming it when the read did not hold it.
    pub fn slot(&self, slot: u32) -> Result<&[u64]> {
        let at = slot as usize * SLOT_WORDS;
        self.words.get(at..at + SLOT_WORDS).ok_or_else(|| {
            Error::Device(format!(
                "arena read holds {} slots; slot {slot} was asked for",
                self.slots()
            ))
        })
    }

    /// The statistics of every slot.
    pub fn stats(&self) -> Vec<SlotStats> {
        self.words
            .chunks_exact(SLOT_WORDS)
            .map(parse_slot)
            .collect()
    }
}

/// Decodes one slot (the `ST_*` layout of common.cuh).
pub fn parse_slot(w: &[u64]) -> SlotStats {
    let bins = &w[HIST_AT..HIST_AT + HIST_BINS];
    let rev = w[12] as u32;
    SlotStats {
        stats: TensorStats {
            numel: w[15],
            nan: w[0],
            pos_inf: w[1],
            neg_inf: w[2],
            zeros: w[3],
            subnormal: w[4],
            max_abs: f64::from(f32::from_bits(w[11] as u32)),
            min_abs_nonzero: (rev != 0).then(|| f64::from(f32::from_bits(0x7fff_ffff - rev))),
            sum_sq: f64::from_bits(w[13]),
            exp_hist: ExpHist::from_bins(-149, bins),
            to_f16: CastCounts {
                overflow: w[5],
                underflow: w[6],
            },
            to_bf16: CastCounts {
                overflow: w[7],
                underflow: w[8],
            },
        },
        rounding: RoundCounts {
            overflow: w[ROUND_AT],
            underflow: w[ROUND_AT + 1],
        },
        masked_neg_inf: w[MASKED_NEG_INF],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_slot_decodes_the_kernel_layout() {
        let mut w = vec![0u64; SLOT_WORDS];
        w[0] = 2; // nan
        w[3] = 5; // zeros
        w[11] = u64::from(3.5f32.to_bits());
        w[12] = u64::from(0x7fff_ffff - 0.25f32.to_bits());
        w[13] = 12.5f64.to_bits();
        w[15] = 10;
        w[HIST_AT + 149 + 1] = 3; // exponent 1: |x| in [2, 4)
        w[HIST_AT + 149 - 2] = 1; // exponent -2: 0.25
        w[ROUND_AT] = 7;
        w[MASKED_NEG_INF] = 4;
        let s = parse_slot(&w);
        assert_eq!(s.stats.numel, 10);
        assert_eq!(s.stats.nan, 2);
        assert_eq!(s.stats.zeros, 5);
        assert_eq!(s.stats.max_abs, 3.5);
        assert_eq!(s.stats.min_abs_nonzero, Some(0.25));
        assert_eq!(s.stats.sum_sq, 12.5);
        assert_eq!(s.stats.exp_hist.min_exp(), Some(-2));
        assert_eq!(s.stats.exp_hist.get(1), 3);
        assert_eq!(s.rounding.overflow, 7);
        assert_eq!(s.masked_neg_inf, 4);
        w[12] = 0;
        assert_eq!(parse_slot(&w).stats.min_abs_nonzero, None);
    }

    #[test]
    fn layout_constants_match_the_kernel_source() {
        let src = super::super::program::COMMON;
        for (name, v) in [
            ("SLOT_WORDS", SLOT_WORDS),
            ("MAX_PARTIALS", MAX_PARTIALS),
            ("HIST_BINS", HIST_BINS),
            ("ST_HIST", HIST_AT),
            ("ST_ROUND_OVER", ROUND_AT),
            ("ST_NUMEL", 15),
            ("ST_SUM_SQ", 13),
        ] {
            let needle = format!("#define {name} {v}");
            assert!(src.contains(&needle), "common.cuh lacks `{needle}`");
        }
        // The mask word lies past the histogram and apart from the trainer's word.
        const { assert!(MASKED_NEG_INF >= HIST_AT + HIST_BINS && MASKED_NEG_INF < SLOT_WORDS) };
        assert_ne!(MASKED_NEG_INF, crate::optim::cuda::word::SCALED_FLUSHES);
    }
}
