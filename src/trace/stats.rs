//! Statistics of one tensor as a trace stores them: counts by class, extremes, the sum of
//! squares, the exponent histogram and what a cast to fp16 / bf16 would do. Plain data; the
//! one-pass computation over a tensor's raw bits lives in the probes.

use super::float_json;
use serde::{Deserialize, Serialize};

/// Histogram of `floor(log2 |x|)` over the finite nonzero values of a tensor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(try_from = "ExpHistFields")]
pub struct ExpHist {
    /// Exponent of `counts[0]`.
    pub lo: i32,
    /// `counts[i]` is the number of values with `floor(log2 |x|) == lo + i`. Trimmed so that
    /// the first and last entries are nonzero; empty when the tensor has no finite nonzero
    /// value.
    pub counts: Vec<u64>,
}

impl ExpHist {
    /// Builds a trimmed histogram from dense bins, `bins[i]` counting exponent `lo + i`.
    pub fn from_bins(lo: i32, bins: &[u64]) -> ExpHist {
        let first = bins.iter().position(|&c| c != 0);
        let last = bins.iter().rposition(|&c| c != 0);
        match (first, last) {
            (Some(f), Some(l)) => ExpHist {
                lo: lo + f as i32,
                counts: bins[f..=l].to_vec(),
            },
            _ => ExpHist::default(),
        }
    }

    /// Number of values counted.
    pub fn total(&self) -> u64 {
        self.counts.iter().sum()
    }

    /// Smallest exponent present, if any.
    pub fn min_exp(&self) -> Option<i32> {
        (!self.counts.is_empty()).then_some(self.lo)
    }

    /// Largest exponent present, if any.
    pub fn max_exp(&self) -> Option<i32> {
        (!self.counts.is_empty()).then(|| self.lo + self.counts.len() as i32 - 1)
    }

    /// Number of values with `floor(log2 |x|) == exp`.
    pub fn get(&self, exp: i32) -> u64 {
        let i = i64::from(exp) - i64::from(self.lo);
        if i < 0 {
            return 0;
        }
        self.counts.get(i as usize).copied().unwrap_or(0)
    }

    /// `(exponent, count)` pairs in increasing exponent order, zero counts included.
    pub fn iter(&self) -> impl Iterator<Item = (i32, u64)> + '_ {
        self.counts
            .iter()
            .enumerate()
            .map(move |(i, &c)| (self.lo + i as i32, c))
    }

    /// Adds the counts of `other` to this histogram.
    pub fn merge(&mut self, other: &ExpHist) {
        let (Some(olo), Some(ohi)) = (other.min_exp(), other.max_exp()) else {
            return;
        };
        let (Some(slo), Some(shi)) = (self.min_exp(), self.max_exp()) else {
            *self = other.clone();
            return;
        };
        if olo < slo || ohi > shi {
            let lo = slo.min(olo);
            let hi = shi.max(ohi);
            let mut counts = vec![0u64; (hi - lo + 1) as usize];
            let off = (slo - lo) as usize;
            counts[off..off + self.counts.len()].copy_from_slice(&self.counts);
            self.lo = lo;
            self.counts = counts;
        }
        let off = (olo - self.lo) as usize;
        for (d, &c) in self.counts[off..].iter_mut().zip(&other.counts) {
            *d += c;
        }
    }
}

/// How many values would go wrong if the tensor were rounded (round-to-nearest-even) to a
/// narrower dtype.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct CastCounts {
    /// Finite values that would become ±inf.
    pub overflow: u64,
    /// Nonzero finite values that would become ±0.
    pub underflow: u64,
}

/// Statistics of one tensor. See [`TensorStats::compute`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(try_from = "TensorStatsFields")]
pub struct TensorStats {
    /// Number of elements.
    pub numel: u64,
    /// NaN values (any payload, either sign).
    pub nan: u64,
    /// +inf values.
    pub pos_inf: u64,
    /// -inf values.
    pub neg_inf: u64,
    /// +0 and -0 values.
    pub zeros: u64,
    /// Nonzero values that are subnormal in the tensor's dtype (fp16: `|x| < 2^-14`;
    /// bf16 and f32: `|x| < 2^-126`; f64: `|x| < 2^-1022`).
    pub subnormal: u64,
    /// Largest `|x|` over the finite values; 0 when there is none.
    #[serde(with = "float_json")]
    pub max_abs: f64,
    /// Smallest `|x|` over the finite nonzero values; `None` when there is none.
    #[serde(with = "float_json::option")]
    pub min_abs_nonzero: Option<f64>,
    /// Sum of `x²` over the finite values, accumulated in f64 (square root: the L2 norm
    /// of the finite part). Can only overflow for f64 data.
    #[serde(with = "float_json")]
    pub sum_sq: f64,
    /// Histogram of `floor(log2 |x|)` over the finite nonzero values, subnormals included.
    pub exp_hist: ExpHist,
    /// What rounding every value to fp16 would do.
    pub to_f16: CastCounts,
    /// What rounding every value to bf16 would do.
    pub to_bf16: CastCounts,
}

impl TensorStats {
    /// Adds the statistics of `other` as if its values followed this tensor's values.
    /// `sum_sq` is added in call order, so merge in a fixed order for reproducible sums.
    pub fn merge(&mut self, other: &TensorStats) {
        self.numel += other.numel;
        self.nan += other.nan;
        self.pos_inf += other.pos_inf;
        self.neg_inf += other.neg_inf;
        self.zeros += other.zeros;
        self.subnormal += other.subnormal;
        self.max_abs = self.max_abs.max(other.max_abs);
        self.min_abs_nonzero = match (self.min_abs_nonzero, other.min_abs_nonzero) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        self.sum_sq += other.sum_sq;
        self.exp_hist.merge(&other.exp_hist);
        self.to_f16.overflow += other.to_f16.overflow;
        self.to_f16.underflow += other.to_f16.underflow;
        self.to_bf16.overflow += other.to_bf16.overflow;
        self.to_bf16.underflow += other.to_bf16.underflow;
    }

    /// NaN and infinite values together.
    pub fn nonfinite(&self) -> u64 {
        self.nan + self.pos_inf + self.neg_inf
    }

    /// True if any value is ±inf.
    pub fn has_inf(&self) -> bool {
        self.pos_inf + self.neg_inf > 0
    }

    /// True if any value is NaN.
    pub fn has_nan(&self) -> bool {
        self.nan > 0
    }

    /// Finite nonzero values.
    pub fn finite_nonzero(&self) -> u64 {
        self.numel - self.zeros - self.nonfinite()
    }

    /// `max_abs / 65504`: how much of fp16's range the finite values use (1.0 = at the edge).
    pub fn headroom_f16(&self) -> f64 {
        self.max_abs / crate::dtype::FP16.max
    }

    /// L2 norm of the finite values, `sqrt(sum_sq)`.
    pub fn l2(&self) -> f64 {
        self.sum_sq.sqrt()
    }
}

/// Smallest and largest `floor(log2 |x|)` of a finite nonzero f64 (or narrower) value.
const EXP_MIN: i64 = -1074;
const EXP_MAX: i64 = 1023;

/// [`ExpHist`] as read from a trace, before its range is checked.
#[derive(Deserialize)]
struct ExpHistFields {
    lo: i32,
    counts: Vec<u64>,
}

impl TryFrom<ExpHistFields> for ExpHist {
    type Error = String;

    fn try_from(f: ExpHistFields) -> Result<Self, String> {
        let hi = i64::from(f.lo) + f.counts.len() as i64 - 1;
        if !f.counts.is_empty() && (i64::from(f.lo) < EXP_MIN || hi > EXP_MAX) {
            return Err(format!(
                "exp_hist: bins 2^{} to 2^{hi}, expected exponents within \
                 2^{EXP_MIN} to 2^{EXP_MAX}",
                f.lo
            ));
        }
        Ok(ExpHist {
            lo: f.lo,
            counts: f.counts,
        })
    }
}

/// [`TensorStats`] as read from a trace, before its counts are checked against `numel`.
#[derive(Deserialize)]
struct TensorStatsFields {
    numel: u64,
    nan: u64,
    pos_inf: u64,
    neg_inf: u64,
    zeros: u64,
    subnormal: u64,
    #[serde(with = "float_json")]
    max_abs: f64,
    #[serde(with = "float_json::option")]
    min_abs_nonzero: Option<f64>,
    #[serde(with = "float_json")]
    sum_sq: f64,
    exp_hist: ExpHist,
    to_f16: CastCounts,
    to_bf16: CastCounts,
}

impl TryFrom<TensorStatsFields> for TensorStats {
    type Error = String;

    /// Every count is of a subset of the values, so none may exceed `numel`, nor may the
    /// disjoint NaN, ±inf and zero counts together.
    fn try_from(f: TensorStatsFields) -> Result<Self, String> {
        let n = f.numel;
        let special = [f.nan, f.pos_inf, f.neg_inf, f.zeros]
            .iter()
            .try_fold(0u64, |a, &c| a.checked_add(c));
        if special.is_none_or(|s| s > n) {
            return Err(format!(
                "tensor stats: nan {} + pos_inf {} + neg_inf {} + zeros {} exceed numel {n}",
                f.nan, f.pos_inf, f.neg_inf, f.zeros
            ));
        }
        let hist = f
            .exp_hist
            .counts
            .iter()
            .try_fold(0u64, |a, &c| a.checked_add(c));
        let counts = [
            ("subnormal", Some(f.subnormal)),
            ("exp_hist total", hist),
            ("to_f16.overflow", Some(f.to_f16.overflow)),
            ("to_f16.underflow", Some(f.to_f16.underflow)),
            ("to_bf16.overflow", Some(f.to_bf16.overflow)),
            ("to_bf16.underflow", Some(f.to_bf16.underflow)),
        ];
        for (name, c) in counts {
            if c.is_none_or(|c| c > n) {
                let shown = c.map_or("more than 2^64".to_string(), |c| c.to_string());
                return Err(format!("tensor stats: {name} {shown} exceeds numel {n}"));
            }
        }
        Ok(TensorStats {
            numel: f.numel,
            nan: f.nan,
            pos_inf: f.pos_inf,
            neg_inf: f.neg_inf,
            zeros: f.zeros,
            subnormal: f.subnormal,
            max_abs: f.max_abs,
            min_abs_nonzero: f.min_abs_nonzero,
            sum_sq: f.sum_sq,
            exp_hist: f.exp_hist,
            to_f16: f.to_f16,
            to_bf16: f.to_bf16,
        })
    }
}
