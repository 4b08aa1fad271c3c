//! Statistics of one tensor, computed in one pass from the raw bits.
//!
//! Every value is classified by its bit pattern (never by a float compare), so NaN payloads,
//! signed zeros and subnormals are all counted exactly and nothing is flushed. The pass runs
//! on every op's output, so it is written for speed. The data is cut into fixed-size chunks;
//! each chunk is scanned once for its extremes, sum of squares, exact-tie counts and the
//! histogram of the exponent field (`f32_scan` for f32 storage; a branch-free loop and a
//! separate histogram for f64), from which nearly every count follows exactly. A scalar
//! scan runs only for chunks holding rare values (NaN, inf, subnormals in the storage
//! format, values in the binade of an overflow threshold). Chunks of large tensors are
//! spread over rayon's threads. Chunk boundaries depend only on the length and per-chunk
//! results are merged in chunk order, so the result — including the floating-point
//! `sum_sq` — is bit-identical whatever the number of threads or the CPU's SIMD width.

use super::f32_scan;
use crate::dtype::DType;
pub use crate::trace::stats::{CastCounts, ExpHist, TensorStats};
use rayon::prelude::*;
use std::sync::{mpsc, Arc, OnceLock};

/// Elements per chunk: the unit of parallel work and of the deterministic merge.
const CHUNK: usize = 16 * 1024;
/// Tensors at least this long are scanned in parallel.
const PAR_MIN: usize = 64 * 1024;
/// Elements per background job of [`TensorStats::spawn`] (whole chunks): short, so that a
/// thread that takes one while an op's parallel loop waits for it is not held long.
const JOB: usize = 2 * CHUNK;
/// Accumulator lanes of the counting loop (one AVX2 register of u32).
const LANES: usize = 8;

// Absolute-value bit patterns of f32 thresholds.
const F32_INF: u32 = 0x7f80_0000;
const F32_MIN_NORMAL: u32 = 0x0080_0000; // 2^-126
const F32_F16_MIN_NORMAL: u32 = 0x3880_0000; // 2^-14
const F32_F16_OVERFLOW: u32 = 0x477f_f000; // 65520: halfway between 65504 and 2^16, ties to inf
const F32_F16_FLUSH: u32 = 0x3300_0000; // 2^-25: halfway between 0 and 2^-24, ties to 0
const F32_BF16_OVERFLOW: u32 = 0x7f7f_8000; // halfway between bf16 max and 2^128, ties to inf
const F32_BF16_FLUSH: u32 = 0x0000_8000; // 2^-134: halfway between 0 and 2^-133, ties to 0

// Absolute-value bit patterns of f64 thresholds (the same values, widened exactly).
const F64_INF: u64 = 0x7ff0_0000_0000_0000;
const F64_MIN_NORMAL: u64 = 0x0010_0000_0000_0000; // 2^-1022
const F64_F16_OVERFLOW: u64 = widen(F32_F16_OVERFLOW);
const F64_F16_FLUSH: u64 = widen(F32_F16_FLUSH);
const F64_BF16_OVERFLOW: u64 = widen(F32_BF16_OVERFLOW);
const F64_BF16_FLUSH: u64 = widen(F32_BF16_FLUSH);

/// Bit pattern of the f64 equal to the f32 with bit pattern `b`.
const fn widen(b: u32) -> u64 {
    (f32::from_bits(b) as f64).to_bits()
}

impl TensorStats {
    /// Statistics of a tensor of `dtype` whose values are held in f32 storage (fp16, bf16
    /// and f32 tensors). `dtype` only selects the subnormal threshold: f16 counts
    /// `0 < |x| < 2^-14`, bf16 and f32 count `0 < |x| < 2^-126`, and f64 or i64 count none
    /// (no f32 value is subnormal in f64). Values need not be representable in `dtype`;
    /// the cast counts are exact for any f32 input.
    pub fn compute(dtype: DType, data: &[f32]) -> Self {
        reduce_chunks(data, |c| chunk_f32(c, sub_limit(dtype)), true)
    }

    /// [`TensorStats::compute`] on the calling thread alone (the same result).
    pub fn compute_here(dtype: DType, data: &[f32]) -> Self {
        reduce_chunks(data, |c| chunk_f32(c, sub_limit(dtype)), false)
    }

    /// The statistics of the same f32-stored values counted as `dtype` instead (a widening
    /// cast shares its input's storage). Only the subnormal count depends on the dtype,
    /// and it follows from the exponent histogram: the values below the dtype's smallest
    /// normal, as [`TensorStats::compute`] counts them.
    pub fn recount_as(&self, dtype: DType) -> Self {
        let subnormal = match sub_limit(dtype) {
            0 => 0,
            // The exponent of the dtype's smallest normal, from its bit pattern.
            limit => {
                let e = (limit >> 23) as i32 - 127;
                self.exp_hist
                    .iter()
                    .filter(|&(x, _)| x < e)
                    .map(|(_, c)| c)
                    .sum()
            }
        };
        TensorStats {
            subnormal,
            ..self.clone()
        }
    }

    /// [`TensorStats::compute`] as jobs on rayon's global pool, which its threads take when
    /// they find no other work (or while they wait inside a parallel loop); [`Deferred::wait`]
    /// gives the same result, bit for bit: the chunks are the same and are merged in the
    /// same order. The jobs hold `data` until they have run.
    pub fn spawn(dtype: DType, data: Arc<Vec<f32>>) -> Deferred {
        let limit = sub_limit(dtype);
        let mut jobs: Vec<Job> = Vec::with_capacity(data.len().div_ceil(JOB));
        let parts = (0..data.len())
            .step_by(JOB)
            .map(|start| {
                let part = Arc::new(OnceLock::new());
                let (data, done) = (data.clone(), part.clone());
                jobs.push(Box::new(move || {
                    let end = (start + JOB).min(data.len());
                    let chunks = data[start..end]
                        .chunks(CHUNK)
                        .map(|c| chunk_f32(c, limit))
                        .collect();
                    // The only writer of this cell.
                    let _ = done.set(chunks);
                }));
                part
            })
            .collect();
        submit(jobs);
        Deferred { parts }
    }

    /// Statistics of an f64 tensor. Cast counts are for a single correct rounding of the
    /// f64 value to fp16 / bf16.
    pub fn compute_f64(data: &[f64]) -> Self {
        reduce_chunks(data, chunk_f64, true)
    }
}

/// One background job of [`TensorStats::spawn`].
type Job = Box<dyn FnOnce() + Send>;

/// Hands background jobs to rayon's global pool through its queue for work from outside
/// the pool.
///
/// A job spawned on one of the pool's threads goes to that thread's own deque, and the other
/// thread steals the oldest entry of a deque first: every pending statistics job would come
/// before the other half of the op that is running, which would wait for them. The pool's
/// threads turn to the outside queue only when they find nothing to steal, so jobs put there
/// run in time that no op wants. Only a thread outside the pool can put them there; from
/// inside it, a thread of its own that does nothing else passes them on.
fn submit(jobs: Vec<Job>) {
    static RELAY: OnceLock<Option<mpsc::Sender<Vec<Job>>>> = OnceLock::new();
    if rayon::current_thread_index().is_none() {
        return jobs.into_iter().for_each(rayon::spawn);
    }
    let relay = RELAY.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<Vec<Job>>();
        std::thread::Builder::new()
            .name("amprobe-stats-relay".into())
            .spawn(move || rx.into_iter().flatten().for_each(rayon::spawn))
            .ok()
            .map(|_| tx)
    });
    // Without the relay (its thread could not start), the pool's own deque: the same
    // results, sooner than op work wants them.
    let unsent = match relay {
        Some(tx) => match tx.send(jobs) {
            Ok(()) => return,
            Err(mpsc::SendError(jobs)) => jobs,
        },
        None => jobs,
    };
    unsent.into_iter().for_each(rayon::spawn);
}

/// Statistics being computed by [`TensorStats::spawn`]'s jobs.
#[derive(Debug)]
pub struct Deferred {
    /// Per job, in data order, the statistics of each of its chunks once it has run.
    parts: Vec<Arc<OnceLock<Vec<TensorStats>>>>,
}

impl Deferred {
    /// The statistics, once every job has run; meanwhile the calling thread runs pending
    /// rayon jobs (these or others) or yields.
    pub fn wait(&self) -> TensorStats {
        let mut total = TensorStats::default();
        for part in &self.parts {
            let chunks = loop {
                if let Some(c) = part.get() {
                    break c;
                }
                if rayon::yield_now() != Some(rayon::Yield::Executed) {
                    std::thread::yield_now();
                }
            };
            for c in chunks {
                total.merge(c);
            }
        }
        total
    }
}

/// The dtype's smallest normal as an f32 bit pattern, or 0 when no value counts as
/// subnormal in it.
fn sub_limit(dtype: DType) -> u32 {
    match dtype {
        DType::F16 => F32_F16_MIN_NORMAL,
        DType::BF16 | DType::F32 => F32_MIN_NORMAL,
        DType::F64 | DType::I64 => 0,
    }
}

/// Splits `data` into fixed chunks, computes each (in parallel for long tensors when
/// `parallel`) and merges the results in chunk order.
fn reduce_chunks<T: Sync>(
    data: &[T],
    f: impl Fn(&[T]) -> TensorStats + Sync,
    parallel: bool,
) -> TensorStats {
    let mut total = TensorStats::default();
    if data.len() < PAR_MIN || !parallel {
        for c in data.chunks(CHUNK) {
            total.merge(&f(c));
        }
    } else {
        let parts: Vec<TensorStats> = data.par_chunks(CHUNK).map(&f).collect();
        for p in &parts {
            total.merge(p);
        }
    }
    total
}

/// Result of the branch-free pass over a chunk: extremes of the absolute bit patterns,
/// sum of squares, and two exact-tie counters (`a == tie_a`, `a == tie_b`).
struct PassA<U> {
    max: U,
    min: U,
    sq: f64,
    tie_a: u64,
    tie_b: u64,
}

/// Sums the four interleaved histogram copies.
fn merge_copies<const N: usize>(h: &[[u32; N]; 4]) -> Vec<u64> {
    (0..N)
        .map(|e| h.iter().map(|hk| u64::from(hk[e])).sum())
        .collect()
}

/// Counts of the rare values of a chunk, from a scalar scan that runs only when the
/// chunk holds such values.
#[derive(Default)]
struct Rare {
    nan: u64,
    pos_inf: u64,
    neg_inf: u64,
    subnormal: u64,
    f16_over_edge: u64,
    bf16_over_edge: u64,
    bf16_under: u64,
}

/// Branch-free pass: lane-wise accumulators the compiler turns into SIMD.
#[inline(always)]
fn pass_a_f64_body(data: &[f64]) -> PassA<u64> {
    const ABS: u64 = u64::MAX >> 1;
    let mut mx = [0i64; LANES];
    let mut mn = [ABS as i64; LANES];
    let mut sq = [0f64; LANES];
    let mut ta = [0u32; LANES];
    let mut tb = [0u32; LANES];
    let mut blocks = data.chunks_exact(LANES);
    for blk in &mut blocks {
        let mut xs = [0f64; LANES];
        xs.copy_from_slice(blk);
        for l in 0..LANES {
            let a = xs[l].to_bits() & ABS;
            // Masks rather than branches, so every lane does the same work.
            let fin = 0u64.wrapping_sub((a < F64_INF) as u64);
            let fa = a & fin;
            mx[l] = mx[l].max(fa as i64);
            let nzm = 0u64.wrapping_sub((a.wrapping_sub(1) < F64_INF - 1) as u64);
            mn[l] = mn[l].min(((a & nzm) | (ABS & !nzm)) as i64);
            ta[l] += (a == F64_F16_FLUSH) as u32;
            tb[l] += (a == F64_BF16_FLUSH) as u32;
            let v: f64 = f64::from_bits(fa);
            sq[l] += v * v;
        }
    }
    // The tail goes through the same per-lane steps, lane l for element l.
    for (l, &x) in blocks.remainder().iter().enumerate() {
        let a = x.to_bits() & ABS;
        let fa = if a < F64_INF { a } else { 0 };
        mx[l] = mx[l].max(fa as i64);
        if a != 0 && a < F64_INF {
            mn[l] = mn[l].min(a as i64);
        }
        ta[l] += (a == F64_F16_FLUSH) as u32;
        tb[l] += (a == F64_BF16_FLUSH) as u32;
        let v: f64 = f64::from_bits(fa);
        sq[l] += v * v;
    }
    // Lanes combined in a fixed order: the sum depends on the data only.
    let mut s = 0.0;
    for v in sq {
        s += v;
    }
    PassA {
        max: mx.iter().copied().max().unwrap_or(0) as u64,
        min: mn.iter().copied().min().unwrap_or(ABS as i64) as u64,
        sq: s,
        tie_a: ta.iter().map(|&c| u64::from(c)).sum(),
        tie_b: tb.iter().map(|&c| u64::from(c)).sum(),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn pass_a_f64_avx2(data: &[f64]) -> PassA<u64> {
    pass_a_f64_body(data)
}

fn pass_a_f64(data: &[f64]) -> PassA<u64> {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2, checked just above. Same operations in the
        // same order as the portable path, so results are identical.
        return unsafe { pass_a_f64_avx2(data) };
    }
    pass_a_f64_body(data)
}

/// Pass A and the exponent-field histogram of an f64 chunk.
fn scan_f64(data: &[f64]) -> (PassA<u64>, Vec<u64>) {
    const ABS: u64 = u64::MAX >> 1;
    let pa = pass_a_f64(data);
    // Four copies so that runs of equal exponents do not serialize on one counter.
    let mut h = [[0u32; 1 << 11]; 4];
    let mut quads = data.chunks_exact(4);
    for q in &mut quads {
        for (hk, x) in h.iter_mut().zip(q) {
            hk[((x.to_bits() & ABS) >> 52) as usize] += 1;
        }
    }
    for x in quads.remainder() {
        h[0][((x.to_bits() & ABS) >> 52) as usize] += 1;
    }
    (pa, merge_copies(&h))
}

/// Pass A and the exponent-field histogram of an f32 chunk, in one pass.
fn scan_f32(data: &[f32]) -> (PassA<u32>, [u64; 256]) {
    let s = f32_scan::scan(data, F32_F16_FLUSH);
    let pa = PassA {
        max: s.max,
        min: s.min,
        sq: s.sq,
        tie_a: s.tie,
        // The bf16 flush tie is an f32 subnormal: the rare-value scan counts it.
        tie_b: 0,
    };
    (pa, s.hist.map(u64::from))
}

macro_rules! chunk_kernel {
    (
        $chunk:ident, scan = $scan:ident,
        float = $f:ty, bits = $u:ty, exp_bits = $eb:expr, man_bits = $mb:expr,
        inf = $inf:expr, min_normal = $mn:expr,
        f16_over = $f16o:expr, bf16_over = $bf16o:expr, bf16_flush = $bf16f:expr,
        tie_a = $ta:expr, tie_b = $tb:expr, to_f64 = $to64:expr
    ) => {
        /// Statistics of one chunk (at most `u32::MAX` elements). `dtype_sub_max_field`:
        /// normal exponent fields `1..=it` also count as subnormal in the tensor's dtype.
        fn $chunk(
            data: &[$f],
            dtype_sub_max_field: usize,
            storage_sub_counts: bool,
        ) -> TensorStats {
            const ABS: $u = <$u>::MAX >> 1;
            const FIELDS: usize = 1 << $eb;
            const BIAS: i32 = (FIELDS as i32 / 2) - 1;
            let field = |a: $u| (a >> $mb) as usize;
            let (pa, hist) = $scan(data);
            let sum = |r: std::ops::RangeInclusive<usize>| -> u64 { hist[r].iter().sum() };

            // Exponent -(BIAS - 1) - man_bits is the smallest subnormal's; dense bins from there.
            let lo = 1 - BIAS - $mb;
            // On the stack: a chunk's statistics cost no allocation but their histogram's.
            let mut bins = [0u64; (1 << $eb) - 2 + $mb];
            for e in 1..FIELDS - 1 {
                bins[e - 1 + $mb] = hist[e];
            }

            let has_sub = pa.min != ABS && pa.min < $mn;
            let has_special = hist[FIELDS - 1] > 0;
            let f16_edge = pa.max >= $f16o && hist[field($f16o)] > 0;
            let bf16_edge = pa.max >= $bf16o && hist[field($bf16o)] > 0;
            let mut rare = Rare::default();
            if has_sub || has_special || f16_edge || bf16_edge {
                for x in data {
                    let b = x.to_bits();
                    let a = b & ABS;
                    if a > $inf {
                        rare.nan += 1;
                    } else if a == $inf {
                        if b == a {
                            rare.pos_inf += 1;
                        } else {
                            rare.neg_inf += 1;
                        }
                    } else if a != 0 && a < $mn {
                        rare.subnormal += 1;
                        rare.bf16_under += (a <= $bf16f) as u64;
                        let exp = lo + (<$u>::BITS - 1 - a.leading_zeros()) as i32;
                        bins[(exp - lo) as usize] += 1;
                    } else if field(a) == field($f16o) && a >= $f16o {
                        rare.f16_over_edge += 1;
                    } else if field(a) == field($bf16o) && a >= $bf16o {
                        rare.bf16_over_edge += 1;
                    }
                }
            }
            let f16_flush_field = field($ta);
            let bf16_flush_field = field($tb);
            TensorStats {
                numel: data.len() as u64,
                nan: rare.nan,
                pos_inf: rare.pos_inf,
                neg_inf: rare.neg_inf,
                zeros: hist[0] - rare.subnormal,
                subnormal: if storage_sub_counts {
                    rare.subnormal
                } else {
                    0
                } + if dtype_sub_max_field > 0 {
                    sum(1..=dtype_sub_max_field)
                } else {
                    0
                },
                max_abs: $to64(pa.max),
                min_abs_nonzero: (pa.min != ABS).then(|| $to64(pa.min)),
                sum_sq: pa.sq,
                exp_hist: ExpHist::from_bins(lo, &bins),
                to_f16: CastCounts {
                    overflow: sum(field($f16o) + 1..=FIELDS - 2) + rare.f16_over_edge,
                    // Everything below the tie's binade, the tie itself, and subnormals.
                    underflow: sum(1..=f16_flush_field - 1) + pa.tie_a + rare.subnormal,
                },
                to_bf16: CastCounts {
                    overflow: sum(field($bf16o) + 1..=FIELDS - 2) + rare.bf16_over_edge,
                    underflow: if bf16_flush_field == 0 {
                        rare.bf16_under
                    } else {
                        sum(1..=bf16_flush_field - 1) + pa.tie_b + rare.subnormal
                    },
                },
            }
        }
    };
}

chunk_kernel!(
    chunk_f32_raw,
    scan = scan_f32,
    float = f32,
    bits = u32,
    exp_bits = 8,
    man_bits = 23,
    inf = F32_INF,
    min_normal = F32_MIN_NORMAL,
    f16_over = F32_F16_OVERFLOW,
    bf16_over = F32_BF16_OVERFLOW,
    bf16_flush = F32_BF16_FLUSH,
    tie_a = F32_F16_FLUSH,
    tie_b = F32_BF16_FLUSH,
    to_f64 = |a: u32| f64::from(f32::from_bits(a))
);

chunk_kernel!(
    chunk_f64_raw,
    scan = scan_f64,
    float = f64,
    bits = u64,
    exp_bits = 11,
    man_bits = 52,
    inf = F64_INF,
    min_normal = F64_MIN_NORMAL,
    f16_over = F64_F16_OVERFLOW,
    bf16_over = F64_BF16_OVERFLOW,
    bf16_flush = F64_BF16_FLUSH,
    tie_a = F64_F16_FLUSH,
    tie_b = F64_BF16_FLUSH,
    to_f64 = f64::from_bits
);

/// One chunk of f32-stored data; `sub_limit` is the dtype's smallest normal (bit pattern),
/// or 0 when no value counts as subnormal.
fn chunk_f32(data: &[f32], sub_limit: u32) -> TensorStats {
    match sub_limit {
        0 => chunk_f32_raw(data, 0, false),
        F32_MIN_NORMAL => chunk_f32_raw(data, 0, true),
        // fp16: f32 subnormals plus normal fields below 2^-14's.
        l => chunk_f32_raw(data, (l >> 23) as usize - 1, true),
    }
}

/// One chunk of f64 data.
fn chunk_f64(data: &[f64]) -> TensorStats {
    chunk_f64_raw(data, 0, true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::round_f64_to;
    use half::{bf16, f16};
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    /// floor(log2 |x|) by exact doubling/halving in f64 (independent of the bit layout).
    fn floor_log2(x: f64) -> i32 {
        let mut v = x.abs();
        let mut e = 0;
        while v >= 2.0 {
            v /= 2.0;
            e += 1;
        }
        while v < 1.0 {
            v *= 2.0;
            e -= 1;
        }
        e
    }

    /// Reference statistics of f64 values by plain float arithmetic. `sub_thr` is the
    /// smallest normal of the dtype; `f16`/`bf16` round one value.
    fn reference(
        data: &[f64],
        sub_thr: f64,
        f16r: impl Fn(f64) -> f64,
        bf16r: impl Fn(f64) -> f64,
    ) -> TensorStats {
        let mut s = TensorStats {
            numel: data.len() as u64,
            ..Default::default()
        };
        let mut hist = BTreeMap::new();
        for &x in data {
            if x.is_nan() {
                s.nan += 1;
                continue;
            }
            if x == f64::INFINITY {
                s.pos_inf += 1;
                continue;
            }
            if x == f64::NEG_INFINITY {
                s.neg_inf += 1;
                continue;
            }
            s.sum_sq += x * x;
            s.max_abs = s.max_abs.max(x.abs());
            if x == 0.0 {
                s.zeros += 1;
                continue;
            }
            s.min_abs_nonzero = Some(s.min_abs_nonzero.map_or(x.abs(), |m| m.min(x.abs())));
            if x.abs() < sub_thr {
                s.subnormal += 1;
            }
            *hist.entry(floor_log2(x)).or_insert(0u64) += 1;
            let h = f16r(x);
            s.to_f16.overflow += h.is_infinite() as u64;
            s.to_f16.underflow += (h == 0.0) as u64;
            let b = bf16r(x);
            s.to_bf16.overflow += b.is_infinite() as u64;
            s.to_bf16.underflow += (b == 0.0) as u64;
        }
        if let (Some((&lo, _)), Some((&hi, _))) = (hist.first_key_value(), hist.last_key_value()) {
            s.exp_hist = ExpHist {
                lo,
                counts: (lo..=hi)
                    .map(|e| hist.get(&e).copied().unwrap_or(0))
                    .collect(),
            };
        }
        s
    }

    fn reference_f32(dtype: DType, data: &[f32]) -> TensorStats {
        let thr = match dtype {
            DType::F16 => 2f64.powi(-14),
            DType::BF16 | DType::F32 => 2f64.powi(-126),
            _ => 0.0,
        };
        let wide: Vec<f64> = data.iter().map(|&x| f64::from(x)).collect();
        reference(
            &wide,
            thr,
            |x| f64::from(f16::from_f32(x as f32).to_f32()),
            |x| f64::from(bf16::from_f32(x as f32).to_f32()),
        )
    }

    fn reference_f64(data: &[f64]) -> TensorStats {
        reference(
            data,
            f64::MIN_POSITIVE,
            |x| round_f64_to(DType::F16, x),
            |x| round_f64_to(DType::BF16, x),
        )
    }

    /// Equal in everything; `sum_sq` to a relative `tol` (the reference sums in another
    /// order).
    fn assert_close(got: &TensorStats, want: &TensorStats, tol: f64) {
        let err = (got.sum_sq - want.sum_sq).abs();
        assert!(
            err <= tol * want.sum_sq || got.sum_sq == want.sum_sq,
            "sum_sq {} vs {}",
            got.sum_sq,
            want.sum_sq
        );
        let mut g = got.clone();
        g.sum_sq = want.sum_sq;
        assert_eq!(&g, want);
    }

    fn p2(e: i32) -> f32 {
        2f32.powi(e)
    }

    fn edge_values() -> Vec<f32> {
        vec![
            0.0,
            1.0,
            65504.0,
            65519.0,
            65520.0,
            65536.0,
            p2(-24),
            p2(-25),
            p2(-14),
            p2(-126),
            p2(-133),
            p2(-134),
            p2(-149),
            f32::from_bits(0x7f7f_0000), // bf16 max
            f32::from_bits(F32_BF16_OVERFLOW),
            f32::MAX,
            f32::INFINITY,
            3.0 * p2(-26),
            p2(-24) * 1.5,
        ]
    }

    fn f32_value() -> impl Strategy<Value = f32> {
        let edges = edge_values();
        prop_oneof![
            any::<u32>().prop_map(f32::from_bits),
            (0..edges.len(), -3i32..=3, any::<bool>()).prop_map(move |(i, d, neg)| {
                let b = edges[i].to_bits().wrapping_add_signed(d);
                let x = f32::from_bits(b);
                if neg {
                    -x
                } else {
                    x
                }
            }),
            any::<u16>().prop_map(|b| f16::from_bits(b).to_f32()),
            any::<u16>().prop_map(|b| bf16::from_bits(b).to_f32()),
            (-30i32..30, -1.0f32..1.0).prop_map(|(e, m)| m * p2(e)),
            Just(f32::NAN),
            Just(-0.0f32),
        ]
    }

    fn f64_value() -> impl Strategy<Value = f64> {
        let edges: Vec<f64> = vec![
            0.0,
            65504.0,
            65519.0,
            65520.0,
            2f64.powi(-24),
            2f64.powi(-25),
            2f64.powi(-14),
            2f64.powi(-126),
            2f64.powi(-133),
            2f64.powi(-134),
            f64::from_bits(F64_BF16_OVERFLOW),
            f64::from(f32::MAX),
            f64::MIN_POSITIVE,
            f64::MAX,
            f64::INFINITY,
        ];
        prop_oneof![
            any::<u64>().prop_map(f64::from_bits),
            (0..edges.len(), -3i64..=3, any::<bool>()).prop_map(move |(i, d, neg)| {
                let x = f64::from_bits(edges[i].to_bits().wrapping_add_signed(d));
                if neg {
                    -x
                } else {
                    x
                }
            }),
            f32_value().prop_map(f64::from),
            (-200i32..200, -1.0f64..1.0).prop_map(|(e, m)| m * 2f64.powi(e)),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn f32_matches_reference(data in prop::collection::vec(f32_value(), 0..300)) {
            for dtype in [DType::F16, DType::BF16, DType::F32] {
                assert_close(&TensorStats::compute(dtype, &data), &reference_f32(dtype, &data), 1e-12);
            }
            // Element by element, the cast counts are exactly what `half` does.
            for &x in &data {
                let s = TensorStats::compute(DType::F32, &[x]);
                let h = f16::from_f32(x);
                let b = bf16::from_f32(x);
                let nz = x.is_finite() && x != 0.0;
                prop_assert_eq!(s.to_f16.overflow, (x.is_finite() && h.is_infinite()) as u64, "{:e}", x);
                prop_assert_eq!(s.to_f16.underflow, (nz && h.to_f32() == 0.0) as u64, "{:e}", x);
                prop_assert_eq!(s.to_bf16.overflow, (x.is_finite() && b.is_infinite()) as u64, "{:e}", x);
                prop_assert_eq!(s.to_bf16.underflow, (nz && b.to_f32() == 0.0) as u64, "{:e}", x);
            }
        }

        #[test]
        fn rounded_dtype_values_match_reference(data in prop::collection::vec(f32_value(), 0..300)) {
            for dtype in [DType::F16, DType::BF16] {
                let mut v = data.clone();
                crate::dtype::round_slice(dtype, &mut v);
                assert_close(&TensorStats::compute(dtype, &v), &reference_f32(dtype, &v), 1e-12);
            }
        }

        #[test]
        fn f64_matches_reference(data in prop::collection::vec(f64_value(), 0..300)) {
            let got = TensorStats::compute_f64(&data);
            let want = reference_f64(&data);
            if want.sum_sq.is_finite() {
                assert_close(&got, &want, 1e-12);
            } else {
                prop_assert!(got.sum_sq.is_infinite());
                let mut g = got.clone();
                g.sum_sq = want.sum_sq;
                prop_assert_eq!(g, want);
            }
        }
    }

    #[test]
    fn background_jobs_give_the_statistics_computed_here() {
        let mut next = crate::probe::xorshift(0x2545_f491_4f6c_dd1d);
        // Both signs, exponents from the subnormals up to 2^0.
        let mut data: Vec<f32> = (0..5 * JOB + CHUNK + 3)
            .map(|_| f32::from_bits((next() >> 32) as u32 & 0xbfff_ffff))
            .collect();
        data[5] = 0.0;
        data[JOB + 17] = f32::NAN;
        data[3 * JOB - 1] = f32::NEG_INFINITY;
        let data = Arc::new(data);
        for n in [0, 1, CHUNK - 1, CHUNK, JOB + 5, data.len()] {
            let part = Arc::new(data[..n].to_vec());
            for dtype in [DType::F16, DType::BF16, DType::F32] {
                let want = TensorStats::compute(dtype, &part);
                // From outside the pool the jobs enter its outside queue directly; from one
                // of its threads, through the relay.
                let outside = TensorStats::spawn(dtype, part.clone()).wait();
                assert!(rayon::current_thread_index().is_none());
                let inside = rayon::scope(|_| {
                    assert!(rayon::current_thread_index().is_some());
                    TensorStats::spawn(dtype, part.clone()).wait()
                });
                for got in [outside, inside] {
                    assert_eq!(got, want, "{n} values as {dtype:?}");
                    assert_eq!(got.sum_sq.to_bits(), want.sum_sq.to_bits());
                }
            }
        }
    }

    #[test]
    fn hand_derived_f32() {
        let data = [
            65519.0f32,                            // rounds down to 65504
            65520.0,                               // tie, rounds to inf
            -7.0e4,                                // overflows
            p2(-25),                               // tie, flushes to 0
            f32::from_bits(p2(-25).to_bits() + 1), // just above: rounds to 2^-24
            0.0,
            -0.0,
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::from_bits(1), // 2^-149: f32 subnormal, flushes in both
            -p2(-134),         // bf16 tie: flushes
            p2(-133),          // bf16 smallest subnormal: kept
            3.0,
        ];
        let s = TensorStats::compute(DType::F16, &data);
        assert_eq!(s.numel, 14);
        assert_eq!((s.nan, s.pos_inf, s.neg_inf, s.zeros), (1, 1, 1, 2));
        // fp16-subnormal: 2^-25, its successor, 2^-149, 2^-134, 2^-133.
        assert_eq!(s.subnormal, 5);
        assert_eq!(s.max_abs, 7.0e4);
        assert_eq!(s.min_abs_nonzero, Some(2f64.powi(-149)));
        assert_eq!(
            s.to_f16,
            CastCounts {
                overflow: 2,
                underflow: 4
            }
        );
        assert_eq!(
            s.to_bf16,
            CastCounts {
                overflow: 0,
                underflow: 2
            }
        );
        assert_eq!(s.exp_hist.min_exp(), Some(-149));
        assert_eq!(s.exp_hist.max_exp(), Some(16));
        assert_eq!(s.exp_hist.get(15), 2); // 65519, 65520
        assert_eq!(s.exp_hist.get(16), 1); // 7e4
        assert_eq!(s.exp_hist.get(-25), 2);
        assert_eq!(s.exp_hist.get(-134), 1);
        assert_eq!(s.exp_hist.get(-133), 1);
        assert_eq!(s.exp_hist.get(1), 1);
        assert_eq!(s.exp_hist.total(), 9);
        assert_eq!(s.nonfinite(), 3);
        assert!(s.has_inf() && s.has_nan());
        assert_eq!(s.headroom_f16(), 7.0e4 / 65504.0);
        // For f32 / bf16 only 2^-149, 2^-134 and 2^-133 are subnormal.
        assert_eq!(TensorStats::compute(DType::F32, &data).subnormal, 3);
        assert_eq!(TensorStats::compute(DType::BF16, &data).subnormal, 3);

        let t = TensorStats::compute(DType::F32, &[3.0, -4.0]);
        assert_eq!(t.sum_sq, 25.0);
        assert_eq!(t.l2(), 5.0);
        assert_eq!(
            t.exp_hist,
            ExpHist {
                lo: 1,
                counts: vec![1, 1]
            }
        );
    }

    #[test]
    fn empty_and_all_special() {
        let e = TensorStats::compute(DType::F32, &[]);
        assert_eq!(e, TensorStats::default());
        let s = TensorStats::compute(DType::BF16, &[f32::NAN, -0.0, f32::NEG_INFINITY]);
        assert_eq!(s.max_abs, 0.0);
        assert_eq!(s.min_abs_nonzero, None);
        assert!(s.exp_hist.counts.is_empty());
        assert_eq!(s.sum_sq, 0.0);
    }

    #[test]
    fn hand_derived_f64() {
        let data = [
            65520.0 - 1e-9, // below the tie: rounds down to 65504
            65520.0,
            2f64.powi(-25) * (1.0 + 1e-15), // above the tie: 2^-24
            2f64.powi(-25),
            f64::from_bits(1), // 2^-1074
            f64::from(f32::MAX) * 1.5,
        ];
        let s = TensorStats::compute_f64(&data);
        assert_eq!(s.subnormal, 1);
        assert_eq!(
            s.to_f16,
            CastCounts {
                overflow: 2,
                underflow: 2
            }
        );
        assert_eq!(
            s.to_bf16,
            CastCounts {
                overflow: 1,
                underflow: 1
            }
        );
        assert_eq!(s.exp_hist.min_exp(), Some(-1074));
        assert_eq!(s.exp_hist.max_exp(), Some(128));
        assert_eq!(s.exp_hist.get(-25), 2);
        assert_eq!(s.exp_hist.get(15), 2);
        assert_eq!(s.exp_hist.total(), 6);
        assert_eq!(s.min_abs_nonzero, Some(f64::from_bits(1)));
    }

    /// Deterministic pseudo-random values over a wide exponent range, with specials.
    fn wide_values(n: usize, seed: u64) -> Vec<f32> {
        let mut next = super::super::xorshift(seed);
        (0..n)
            .map(|i| {
                let x = next();
                match i % 97 {
                    0 => f32::NAN,
                    1 => 0.0,
                    2 => f32::from_bits((x as u32) & 0x007f_ffff),
                    _ => {
                        let m = (x >> 40) as f32 / (1u64 << 24) as f32 + 0.5;
                        let e = ((x >> 8) % 80) as i32 - 40;
                        if x & 1 == 0 {
                            m * p2(e)
                        } else {
                            -m * p2(e)
                        }
                    }
                }
            })
            .collect()
    }

    #[test]
    fn identical_across_thread_counts() {
        let data = wide_values(3_000_017, 0x9e37_79b9_7f4a_7c15);
        let wide: Vec<f64> = data.iter().map(|&x| f64::from(x) * 1e10).collect();
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            pool.install(|| {
                (
                    TensorStats::compute(DType::F32, &data),
                    TensorStats::compute_f64(&wide),
                )
            })
        };
        let one = run(1);
        // The serial path (one thread) gives the same bits too.
        let here = TensorStats::compute_here(DType::F32, &data);
        assert_eq!(here, one.0);
        assert_eq!(here.sum_sq.to_bits(), one.0.sum_sq.to_bits());
        for t in [2, 3, 7] {
            let other = run(t);
            assert_eq!(one, other, "{t} threads");
            assert_eq!(one.0.sum_sq.to_bits(), other.0.sum_sq.to_bits());
            assert_eq!(one.1.sum_sq.to_bits(), other.1.sum_sq.to_bits());
        }
        assert_close(&one.0, &reference_f32(DType::F32, &data), 1e-9);
        assert_close(&one.1, &reference_f64(&wide), 1e-9);
    }

    #[test]
    fn portable_and_dispatched_passes_agree() {
        // The SIMD path the CPU picks and the portable one must give the same bits.
        let data = wide_values(100_003, 7);
        let wide: Vec<f64> = data.iter().map(|&x| f64::from(x) * 3.0).collect();
        let key32 = |p: f32_scan::F32Scan| (p.max, p.min, p.sq.to_bits(), p.tie, p.hist);
        assert_eq!(
            key32(f32_scan::scan_portable(&data, F32_F16_FLUSH)),
            key32(f32_scan::scan(&data, F32_F16_FLUSH))
        );
        let key64 = |p: PassA<u64>| (p.max, p.min, p.sq.to_bits(), p.tie_a, p.tie_b);
        assert_eq!(key64(pass_a_f64_body(&wide)), key64(pass_a_f64(&wide)));
    }

    #[test]
    fn sweep_of_f32_bit_patterns() {
        // Every 251st bit pattern, plus every pattern near the thresholds.
        let mut xs: Vec<f32> = (0..=u32::MAX / 251)
            .map(|i| f32::from_bits(i * 251))
            .collect();
        for base in edge_values() {
            let b = base.to_bits();
            for d in 0..600u32 {
                xs.push(f32::from_bits(b.wrapping_add(d)));
                xs.push(-f32::from_bits(b.wrapping_sub(d)));
            }
        }
        for dtype in [DType::F16, DType::F32] {
            assert_close(
                &TensorStats::compute(dtype, &xs),
                &reference_f32(dtype, &xs),
                1e-9,
            );
        }
    }

    #[test]
    fn recounting_for_another_dtype_is_computing_for_it() {
        let data = wide_values(50_000, 11);
        let all = [DType::F16, DType::BF16, DType::F32, DType::F64, DType::I64];
        for from in all {
            let s = TensorStats::compute(from, &data);
            for to in all {
                assert_eq!(
                    s.recount_as(to),
                    TensorStats::compute(to, &data),
                    "{from} as {to}"
                );
            }
        }
    }

    #[test]
    fn exp_hist_merge() {
        let mut a = ExpHist::from_bins(-3, &[0, 2, 0, 1, 0]);
        assert_eq!(
            a,
            ExpHist {
                lo: -2,
                counts: vec![2, 0, 1]
            }
        );
        a.merge(&ExpHist {
            lo: 3,
            counts: vec![5],
        });
        assert_eq!(
            a,
            ExpHist {
                lo: -2,
                counts: vec![2, 0, 1, 0, 0, 5]
            }
        );
        a.merge(&ExpHist {
            lo: -4,
            counts: vec![1, 0, 1],
        });
        assert_eq!(
            a,
            ExpHist {
                lo: -4,
                counts: vec![1, 0, 3, 0, 1, 0, 0, 5]
            }
        );
        a.merge(&ExpHist::default());
        assert_eq!(a.total(), 10);
        assert_eq!(a.get(-100), 0);
        assert_eq!(a.get(3), 5);
        let mut e = ExpHist::default();
        e.merge(&a);
        assert_eq!(e, a);
    }
}
