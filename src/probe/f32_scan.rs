//! The one pass over a chunk of f32-stored values that the statistics start from: extremes
//! of the absolute bit patterns, the sum of squares, the count of one exact tie value and
//! the histogram of the exponent field.
//!
//! With AVX2 and FMA the pass is one SIMD loop. Its histogram counts *pairs* of exponent
//! fields in 2¹⁶-entry tables (one increment per two values: the increments' loads and
//! stores bound a histogram's speed) and folds the pairs back into single fields at the
//! end, 16 fields at a time over only the fields the chunk's extremes allow. Alternate
//! pairs go to two tables, so that a pair repeated at once (zeros, a narrow range) does
//! not wait on the store of the one before. The portable loop counts
//! one field at a time. Both add the squares in the same 16 lanes with a fused
//! multiply-add, element `i` into lane `i % 16`, and combine the lanes in order, so
//! the two give the same bits.

/// Bit pattern of `|x|` for f32.
const ABS: u32 = 0x7fff_ffff;
/// |x| bit pattern of +inf.
const INF: u32 = 0x7f80_0000;
/// Values per SIMD block (four AVX2 registers).
const BLOCK: usize = 32;
/// Lanes of the sum of squares: element `i` is added into lane `i % LANES`.
const LANES: usize = 16;
/// Longest run whose pair counts fit the table's u16 counters (2¹⁵ pairs at most).
const SEGMENT: usize = 1 << 16;

/// What [`scan`] gathers from a chunk.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct F32Scan {
    /// Largest finite `|x|` bit pattern (0 when there is none).
    pub max: u32,
    /// Smallest nonzero finite `|x|` bit pattern (`0x7fff_ffff` when there is none).
    pub min: u32,
    /// Sum of the squares of the finite values (non-finite ones count as 0).
    pub sq: f64,
    /// Number of values with `|x|` bit pattern equal to the `tie` argument.
    pub tie: u64,
    /// Number of values per exponent field (`bits >> 23 & 0xff`).
    pub hist: [u32; 256],
}

/// Running state of a scan, shared by the SIMD blocks and the scalar tail.
struct Acc {
    max: u32,
    /// Minimum of `|x| - 1` over finite values, wrapping (0 gives `u32::MAX`).
    min_m1: u32,
    sq: [f64; LANES],
    tie: u64,
    hist: [u32; 256],
}

impl Acc {
    fn new() -> Acc {
        Acc {
            max: 0,
            min_m1: u32::MAX,
            sq: [0.0; LANES],
            tie: 0,
            hist: [0; 256],
        }
    }

    /// One value into lane `lane`.
    #[inline(always)]
    fn push(&mut self, x: f32, lane: usize, tie: u32) {
        let a = x.to_bits() & ABS;
        let fa = if a < INF { a } else { 0 };
        self.max = self.max.max(fa);
        self.min_m1 = self.min_m1.min(fa.wrapping_sub(1));
        self.tie += u64::from(a == tie);
        let v = f64::from(f32::from_bits(fa));
        self.sq[lane] = v.mul_add(v, self.sq[lane]);
        self.hist[(a >> 23) as usize] += 1;
    }

    fn finish(self) -> F32Scan {
        // Lanes combined in a fixed order: the sum depends on the data only.
        let mut sq = 0.0;
        for v in self.sq {
            sq += v;
        }
        F32Scan {
            max: self.max,
            min: if self.min_m1 == u32::MAX {
                ABS
            } else {
                self.min_m1 + 1
            },
            sq,
            tie: self.tie,
            hist: self.hist,
        }
    }
}

/// Scans `data`: the SIMD loop where the CPU has AVX2 and FMA, the portable one otherwise
/// (the same result either way).
pub(super) fn scan(data: &[f32], tie: u32) -> F32Scan {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        if let Some(s) = avx2::scan(data, tie) {
            return s;
        }
    }
    scan_portable(data, tie)
}

/// The portable scan, one value at a time.
pub(super) fn scan_portable(data: &[f32], tie: u32) -> F32Scan {
    let mut acc = Acc::new();
    for (i, &x) in data.iter().enumerate() {
        acc.push(x, i % LANES, tie);
    }
    acc.finish()
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{Acc, F32Scan, ABS, BLOCK, INF, LANES, SEGMENT};
    use std::arch::x86_64::*;
    use std::cell::RefCell;

    /// Blocks between packing a block's exponent fields and counting them, so that the
    /// counting loads read stores that have left the store buffer (a narrow load from a
    /// wide store still in flight stalls).
    const DELAY: usize = 8;
    /// Entries of each of the two pair tables.
    const TABLE: usize = 1 << 16;

    thread_local! {
        /// Two tables of pair counts, each indexed by `field(a) | field(b) << 8` for two
        /// values `a`, `b` of a block; all zero between scans.
        static PAIRS: RefCell<Vec<u16>> = RefCell::new(vec![0; 2 * TABLE]);
    }

    /// The SIMD scan; `None` only if this thread's pair table is already in use.
    pub(super) fn scan(data: &[f32], tie: u32) -> Option<F32Scan> {
        PAIRS.with(|t| {
            let mut table = t.try_borrow_mut().ok()?;
            let mut acc = Acc::new();
            let blocks = data.len() / BLOCK * BLOCK;
            for seg in data[..blocks].chunks(SEGMENT) {
                // SAFETY: the caller checked that the CPU has AVX2 and FMA.
                if !unsafe { blocks_avx2(seg, tie, &mut acc, &mut table) } {
                    // The segment holds an inf or a NaN, which the SIMD loop does not mask:
                    // the portable loop does (segments start at a multiple of the lanes).
                    for (i, &x) in seg.iter().enumerate() {
                        acc.push(x, i % LANES, tie);
                    }
                }
            }
            for (i, &x) in data[blocks..].iter().enumerate() {
                acc.push(x, i % LANES, tie);
            }
            Some(acc.finish())
        })
    }

    /// Adds whole blocks (`data.len()` a multiple of 32, at most [`SEGMENT`]) to `acc`,
    /// when they are all finite; returns false, leaving `acc` as it was, when they are not.
    /// Values are taken unmasked (the extremes and squares of finite data need no mask),
    /// and ties are counted afterwards, only when the tie's binade is present.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn blocks_avx2(data: &[f32], tie: u32, acc: &mut Acc, table: &mut [u16]) -> bool {
        debug_assert!(data.len().is_multiple_of(BLOCK) && data.len() <= SEGMENT);
        debug_assert_eq!(table.len(), 2 * TABLE);
        let abs = _mm256_set1_epi32(ABS as i32);
        let minus_one = _mm256_set1_epi32(-1);
        let mut mx = _mm256_set1_epi32(acc.max as i32);
        let mut mn = _mm256_set1_epi32(acc.min_m1 as i32);
        let mut sq = [_mm256_setzero_pd(); LANES / 4];
        for (k, s) in sq.iter_mut().enumerate() {
            *s = _mm256_loadu_pd(acc.sq.as_ptr().add(4 * k));
        }
        // Keys four to a word, read back a word at a time (a load per key would add to the
        // memory operations that bound the loop); alternate keys go to the two tables.
        let mut ring = [0u64; DELAY * BLOCK / 8];
        let ring_p = ring.as_mut_ptr();
        let tab = table.as_mut_ptr();
        let count = |slot: usize| {
            for i in 0..BLOCK / 8 {
                // SAFETY: slot < DELAY, so the index is inside the ring; a u16 key plus
                // `TABLE` indexes the second table.
                let w = *ring_p.add(slot * BLOCK / 8 + i);
                *tab.add((w & 0xffff) as usize) += 1;
                *tab.add(TABLE + (w >> 16 & 0xffff) as usize) += 1;
                *tab.add((w >> 32 & 0xffff) as usize) += 1;
                *tab.add(TABLE + (w >> 48) as usize) += 1;
            }
        };
        let n = data.len() / BLOCK;
        let p = data.as_ptr();
        for b in 0..n {
            let mut fields = [_mm256_setzero_si256(); 4];
            for (k, f) in fields.iter_mut().enumerate() {
                let q = p.add(b * BLOCK + 8 * k);
                let a = _mm256_and_si256(_mm256_loadu_si256(q as *const __m256i), abs);
                mx = _mm256_max_epu32(mx, a);
                mn = _mm256_min_epu32(mn, _mm256_add_epi32(a, minus_one));
                let lo = _mm256_cvtps_pd(_mm_loadu_ps(q));
                let hi = _mm256_cvtps_pd(_mm_loadu_ps(q.add(4)));
                // Elements 8k..8k+8 of the block are lanes 8(k mod 2)..+8.
                let l = 2 * (k % 2);
                sq[l] = _mm256_fmadd_pd(lo, lo, sq[l]);
                sq[l + 1] = _mm256_fmadd_pd(hi, hi, sq[l + 1]);
                *f = _mm256_srli_epi32(a, 23);
            }
            // 32 fields as bytes (in a shuffled order, which a count does not mind).
            let bytes = _mm256_packus_epi16(
                _mm256_packus_epi32(fields[0], fields[1]),
                _mm256_packus_epi32(fields[2], fields[3]),
            );
            _mm256_storeu_si256(ring_p.add(b % DELAY * BLOCK / 8) as *mut __m256i, bytes);
            // Block b + 1 - DELAY; in the first DELAY - 1 blocks, a slot not yet written,
            // whose zeros are taken back below (no branch in the loop).
            count((b + 1) % DELAY);
        }
        for b in n.saturating_sub(DELAY - 1)..n {
            count(b % DELAY);
        }
        let dummies = (n.min(DELAY - 1) * BLOCK / 4) as u16;
        table[0] -= dummies;
        table[TABLE] -= dummies;

        let mut m = [0u32; 8];
        _mm256_storeu_si256(m.as_mut_ptr() as *mut __m256i, mx);
        let max = m.iter().copied().fold(acc.max, u32::max);
        _mm256_storeu_si256(m.as_mut_ptr() as *mut __m256i, mn);
        let min_m1 = m.iter().copied().fold(acc.min_m1, u32::min);
        let mut hist = [0u32; 256];
        unpair(&mut hist, table, min_m1, max);
        if max >= INF {
            return false;
        }
        acc.max = max;
        acc.min_m1 = min_m1;
        for (k, s) in sq.iter().enumerate() {
            _mm256_storeu_pd(acc.sq.as_mut_ptr().add(4 * k), *s);
        }
        for (h, c) in acc.hist.iter_mut().zip(hist) {
            *h += c;
        }
        if hist[(tie >> 23) as usize] > 0 {
            acc.tie += data.iter().filter(|x| x.to_bits() & ABS == tie).count() as u64;
        }
        true
    }

    /// Folds the pair counts of both tables into `hist` and zeroes them again. Every field
    /// of the values counted is 0 (zeros, subnormals), 255 (inf, NaN) or between the fields
    /// of `min_m1 + 1` (the smallest nonzero `|x|`) and `max` (the largest), so only those
    /// rows and columns are read: the range 16 columns at a time (the entries around it
    /// are zero), then columns 0 and 255 (zero by then if the range took them).
    #[target_feature(enable = "avx2")]
    unsafe fn unpair(hist: &mut [u32; 256], table: &mut [u16], min_m1: u32, max: u32) {
        // The fields between the extremes (none when every value is zero).
        let (lo, hi) = match min_m1 {
            u32::MAX => (1, 0),
            _ => (
                ((min_m1 + 1) >> 23).max(1) as usize,
                ((max >> 23) as usize).min(254),
            ),
        };
        let cols = if lo <= hi {
            lo & !15..(hi | 15) + 1
        } else {
            0..0
        };
        let zero = _mm256_setzero_si256();
        let h = hist.as_mut_ptr();
        for r in std::iter::once(0).chain(lo..=hi).chain([255]) {
            let (pa, pb) = (
                table.as_mut_ptr().add(r << 8),
                table.as_mut_ptr().add(TABLE + (r << 8)),
            );
            let mut sum = zero;
            for c in cols.clone().step_by(16) {
                // SAFETY: c + 16 <= 256 within row r of each 2¹⁶-entry table; a key's
                // count is at most 2¹⁵ over both tables, so the u16 sum does not wrap.
                let v = _mm256_add_epi16(
                    _mm256_loadu_si256(pa.add(c) as *const __m256i),
                    _mm256_loadu_si256(pb.add(c) as *const __m256i),
                );
                _mm256_storeu_si256(pa.add(c) as *mut __m256i, zero);
                _mm256_storeu_si256(pb.add(c) as *mut __m256i, zero);
                let lo = _mm256_cvtepu16_epi32(_mm256_castsi256_si128(v));
                let hi = _mm256_cvtepu16_epi32(_mm256_extracti128_si256(v, 1));
                let hp = h.add(c) as *mut __m256i;
                _mm256_storeu_si256(hp, _mm256_add_epi32(_mm256_loadu_si256(hp), lo));
                let hp = h.add(c + 8) as *mut __m256i;
                _mm256_storeu_si256(hp, _mm256_add_epi32(_mm256_loadu_si256(hp), hi));
                sum = _mm256_add_epi32(sum, _mm256_add_epi32(lo, hi));
            }
            let mut lanes = [0u32; 8];
            _mm256_storeu_si256(lanes.as_mut_ptr() as *mut __m256i, sum);
            let mut row_sum: u32 = lanes.iter().sum();
            for c in [0, 255] {
                let v = u32::from(*pa.add(c)) + u32::from(*pb.add(c));
                *pa.add(c) = 0;
                *pb.add(c) = 0;
                hist[c] += v;
                row_sum += v;
            }
            hist[r] += row_sum;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut next = super::super::xorshift(seed);
        (0..n)
            .map(|i| {
                let x = next();
                match i % 61 {
                    0 => f32::NAN,
                    1 => -f32::INFINITY,
                    2 => 0.0,
                    3 => f32::from_bits((x as u32) & 0x007f_ffff),
                    4 => f32::from_bits(0x3300_0000),
                    _ => f32::from_bits((x >> 32) as u32 & 0xbfff_ffff).min(3.0e38),
                }
            })
            .collect()
    }

    /// Plain per-value reference (no lanes): everything but the summation order.
    fn reference(data: &[f32], tie: u32) -> (u32, u32, u64, Vec<u32>) {
        let mut hist = vec![0u32; 256];
        let (mut max, mut min, mut t) = (0, ABS, 0);
        for &x in data {
            let a = x.to_bits() & ABS;
            hist[(a >> 23) as usize] += 1;
            t += u64::from(a == tie);
            if a < INF {
                max = max.max(a);
                if a != 0 {
                    min = min.min(a);
                }
            }
        }
        (max, min, t, hist)
    }

    #[test]
    fn dispatched_and_portable_scans_agree_bit_for_bit() {
        // Lengths around the block, the ring delay and the segment size.
        for (i, n) in [
            0, 1, 31, 32, 33, 255, 256, 257, 1000, 65_536, 65_567, 200_001,
        ]
        .into_iter()
        .enumerate()
        {
            let data = values(n, 0x9e37_79b9 + i as u64);
            let a = scan(&data, 0x3300_0000);
            let b = scan_portable(&data, 0x3300_0000);
            assert_eq!(a, b, "n = {n}");
            assert_eq!(a.sq.to_bits(), b.sq.to_bits(), "n = {n}");
            let (max, min, tie, hist) = reference(&data, 0x3300_0000);
            assert_eq!((a.max, a.min, a.tie), (max, min, tie), "n = {n}");
            assert_eq!(a.hist.to_vec(), hist, "n = {n}");
        }
    }

    #[test]
    fn narrow_ranges_at_every_field_offset() {
        // Fields lo..lo+5 with zeros, for every lo: the fold's 16-field steps start and end
        // inside, at and across the range, and columns 0 and 255 lie in or out of them.
        for lo in 1u32..=249 {
            let data: Vec<f32> = (0..3000u32)
                .map(|i| match i % 7 {
                    0 => 0.0,
                    k => f32::from_bits(
                        (lo + (i * 31 + k) % 6) << 23 | i.wrapping_mul(2_654_435_761) >> 9,
                    ),
                })
                .collect();
            let a = scan(&data, 0x3300_0000);
            assert_eq!(a, scan_portable(&data, 0x3300_0000), "lo = {lo}");
            let (max, min, tie, hist) = reference(&data, 0x3300_0000);
            assert_eq!(
                (a.max, a.min, a.tie, a.hist.to_vec()),
                (max, min, tie, hist),
                "lo = {lo}"
            );
        }
        // The tables were left zeroed by every fold.
        let data = values(10_000, 5);
        assert_eq!(scan(&data, 0), scan_portable(&data, 0));
    }

    #[test]
    fn narrow_and_single_field_chunks() {
        // One field only (the pair table's hottest case), all zeros, all NaN.
        for data in [vec![1.5f32; 4096], vec![0.0; 4096], vec![f32::NAN; 4096]] {
            let a = scan(&data, 0x3300_0000);
            assert_eq!(a, scan_portable(&data, 0x3300_0000));
            let (max, min, tie, hist) = reference(&data, 0x3300_0000);
            assert_eq!(
                (a.max, a.min, a.tie, a.hist.to_vec()),
                (max, min, tie, hist)
            );
        }
        // The table is left zeroed: a second scan of other data is still exact.
        let data = values(10_000, 3);
        assert_eq!(scan(&data, 0), scan_portable(&data, 0));
    }

    #[test]
    fn sum_of_squares_matches_f64_within_rounding() {
        let data: Vec<f32> = (0..100_000)
            .map(|i| ((i % 977) as f32 - 488.0) * 0.01)
            .collect();
        let want: f64 = data.iter().map(|&x| f64::from(x) * f64::from(x)).sum();
        let got = scan(&data, 0).sq;
        assert!((got - want).abs() <= 1e-12 * want, "{got} vs {want}");
    }
}
