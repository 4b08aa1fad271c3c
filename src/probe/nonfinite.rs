//! Exact counts of the non-finite values of f32-stored data, and nothing else: the check a
//! step makes of an op's output when its full statistics would not be kept
//! ([`super::recorder::Recorder::check_only`]) and the op did not check it as it wrote it.
//!
//! A chunk is first reduced to the largest absolute bit pattern in one SIMD loop
//! ([`crate::dtype::max_abs_bits`]: a load, an `and` and a `max` per eight values); only a
//! chunk whose largest pattern is that of an inf or a NaN is counted value by value.
//! Finite data, nearly all data, costs little more than reading it.

use rayon::prelude::*;

/// Bit pattern of `|x|` for f32.
const ABS: u32 = 0x7fff_ffff;
/// |x| bit pattern of +inf; anything above it is a NaN.
const INF: u32 = 0x7f80_0000;
/// Values per chunk: the unit of parallel work.
const CHUNK: usize = 16 * 1024;
/// Data at least this long is checked on rayon's threads.
const PAR_MIN: usize = 64 * 1024;

/// How many NaN, +inf and -inf values some data holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NonFinite {
    /// NaN values (any payload, either sign).
    pub nan: u64,
    /// +inf values.
    pub pos_inf: u64,
    /// -inf values.
    pub neg_inf: u64,
}

impl NonFinite {
    fn add(self, o: NonFinite) -> NonFinite {
        NonFinite {
            nan: self.nan + o.nan,
            pos_inf: self.pos_inf + o.pos_inf,
            neg_inf: self.neg_inf + o.neg_inf,
        }
    }
}

/// The non-finite values of `data`, counted exactly; on rayon's threads when `data` is long.
pub fn count(data: &[f32]) -> NonFinite {
    if data.len() < PAR_MIN {
        data.chunks(CHUNK)
            .map(count_chunk)
            .fold(NonFinite::default(), NonFinite::add)
    } else {
        data.par_chunks(CHUNK)
            .map(count_chunk)
            .reduce(NonFinite::default, NonFinite::add)
    }
}

/// One chunk: all finite when its largest absolute bit pattern is below inf's, else
/// counted value by value.
fn count_chunk(c: &[f32]) -> NonFinite {
    if crate::dtype::max_abs_bits(c) < INF {
        return NonFinite::default();
    }
    let mut n = NonFinite::default();
    for &x in c {
        let b = x.to_bits();
        match b & ABS {
            INF if b == INF => n.pos_inf += 1,
            INF => n.neg_inf += 1,
            a if a > INF => n.nan += 1,
            _ => {}
        }
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One value at a time, by float classification.
    fn reference(data: &[f32]) -> NonFinite {
        let mut n = NonFinite::default();
        for &x in data {
            if x.is_nan() {
                n.nan += 1;
            } else if x == f32::INFINITY {
                n.pos_inf += 1;
            } else if x == f32::NEG_INFINITY {
                n.neg_inf += 1;
            }
        }
        n
    }

    fn finite(n: usize, seed: u32) -> Vec<f32> {
        let mut x = seed | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                // Any finite pattern, the largest finite included.
                f32::from_bits((x % 0x7f80_0000) | (x & 0x8000_0000))
            })
            .collect()
    }

    #[test]
    fn finite_data_has_none() {
        for n in [0, 1, 31, 32, 33, CHUNK - 1, CHUNK, PAR_MIN + 17] {
            let mut d = finite(n, n as u32 + 7);
            if let Some(x) = d.first_mut() {
                *x = f32::MAX;
            }
            if let Some(x) = d.last_mut() {
                *x = -f32::MAX;
            }
            assert_eq!(count(&d), NonFinite::default(), "{n}");
        }
    }

    /// Every kind of non-finite value (NaNs of several payloads and both signs), alone
    /// and together, at positions in every SIMD lane, around block and chunk edges, in
    /// data short and long.
    #[test]
    fn every_non_finite_value_is_counted_wherever_it_is() {
        let specials = [
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
            f32::from_bits(0x7f80_0001),
            f32::from_bits(0xffff_ffff),
        ];
        for n in [5, 40, CHUNK + 3, PAR_MIN + 100, 3 * PAR_MIN] {
            let base = finite(n, 99);
            let mut at: Vec<usize> = (0..40).chain([CHUNK - 1, CHUNK, CHUNK + 1]).collect();
            at.extend([n - 1, n / 2, PAR_MIN - 1, PAR_MIN]);
            at.retain(|&i| i < n);
            for (k, &s) in specials.iter().enumerate() {
                for &i in &at {
                    let mut d = base.clone();
                    d[i] = s;
                    assert_eq!(count(&d), reference(&d), "{s} at {i} of {n}");
                }
                // Many at once: every special at every third position.
                let mut d = base.clone();
                for (j, x) in d.iter_mut().enumerate() {
                    if j % 3 == k % 3 {
                        *x = specials[(j / 3) % specials.len()];
                    }
                }
                let got = count(&d);
                assert_eq!(got, reference(&d), "many in {n}");
                assert!(got.nan + got.pos_inf + got.neg_inf > 0);
            }
        }
    }
}
