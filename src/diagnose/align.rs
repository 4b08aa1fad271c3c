//! The one way two runs' ops are put side by side, shared by the comparison report and the
//! terminal UI's Compare panel: ops pair up by what they are (micro-batch, phase, op name,
//! module, gradient input) and their occurrence among such ops, so that ops one precision
//! mode adds (casts) stay one-sided instead of shifting every later pair; and the one
//! threshold above which a pair's values differ.

use crate::trace::record::{OpRecord, Phase, StepRecord};
use std::collections::HashMap;

/// Relative difference of an op's unscaled largest magnitude or L2 norm from the
/// reference's above which the op counts as diverged (`compare --threshold` overrides).
pub const DEFAULT_THRESHOLD: f64 = 0.05;

/// One row of two aligned op lists: an op of A, of B, or of both.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pair {
    /// Position of the op in A's list.
    pub a: Option<usize>,
    /// Position of the op in B's list.
    pub b: Option<usize>,
}

type Kind<'a> = (u32, Phase, &'a str, &'a str, Option<&'a str>);

fn kind(o: &OpRecord) -> Kind<'_> {
    (
        o.micro,
        o.phase,
        o.op.as_str(),
        o.module.as_str(),
        o.wrt.as_deref(),
    )
}

/// Aligns two op lists. The n-th op of a kind in A pairs with the n-th op of that kind in
/// B. Rows follow B's order; an op only A has comes right after the row of A's previous
/// op. Linear in the number of ops.
pub fn align(a: &[OpRecord], b: &[OpRecord]) -> Vec<Pair> {
    let mut seen: HashMap<Kind<'_>, usize> = HashMap::new();
    let mut in_b: HashMap<(Kind<'_>, usize), usize> = HashMap::with_capacity(b.len());
    for (j, o) in b.iter().enumerate() {
        let n = seen.entry(kind(o)).or_insert(0);
        in_b.insert((kind(o), *n), j);
        *n += 1;
    }
    seen.clear();
    let mut partner_of_b: Vec<Option<usize>> = vec![None; b.len()];
    let mut partner_of_a: Vec<Option<usize>> = vec![None; a.len()];
    for (i, o) in a.iter().enumerate() {
        let n = seen.entry(kind(o)).or_insert(0);
        if let Some(&j) = in_b.get(&(kind(o), *n)) {
            partner_of_a[i] = Some(j);
            partner_of_b[j] = Some(i);
        }
        *n += 1;
    }
    // after[r + 1]: A-only ops placed after B-ordered row r; after[0]: before every row.
    let mut after: Vec<Vec<usize>> = vec![Vec::new(); b.len() + 1];
    let mut slot = 0;
    for (i, p) in partner_of_a.iter().enumerate() {
        match p {
            Some(j) => slot = j + 1,
            None => after[slot].push(i),
        }
    }
    let mut rows = Vec::with_capacity(a.len().max(b.len()));
    let one_sided = |i: &usize| Pair {
        a: Some(*i),
        b: None,
    };
    rows.extend(after[0].iter().map(one_sided));
    for (j, p) in partner_of_b.iter().enumerate() {
        rows.push(Pair { a: *p, b: Some(j) });
        rows.extend(after[j + 1].iter().map(one_sided));
    }
    rows
}

/// Relative difference of `a` from the reference `r` (0 when equal, infinite when only the
/// reference is 0).
pub fn rel_diff(a: f64, r: f64) -> f64 {
    if a == r {
        0.0
    } else if r == 0.0 {
        f64::INFINITY
    } else {
        (a - r).abs() / r.abs()
    }
}

/// True for ops of the loss scaler's own bookkeeping (the `scaler` module: loss × scale
/// and its backward). They hold the scale itself, not model values.
pub fn is_scaler_op(op: &OpRecord) -> bool {
    op.module == "scaler"
}

/// The factor an op's values carry from loss scaling: the step's scale for backward ops and
/// the scaler's own ops, else 1. Dividing by it compares runs with different scales.
pub fn scale_of(s: &StepRecord, o: &OpRecord) -> f64 {
    let scaled = o.phase == Phase::Backward || is_scaler_op(o);
    if scaled && s.scale_before.is_finite() && s.scale_before > 0.0 {
        s.scale_before
    } else {
        1.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::{DType, RoundCounts};
    use crate::trace::record::TensorMeta;
    use crate::trace::stats::TensorStats;

    fn op(index: u64, phase: Phase, name: &str, module: &str) -> OpRecord {
        OpRecord {
            micro: 0,
            index,
            phase,
            op: name.into(),
            module: module.into(),
            inputs: vec![],
            output: TensorMeta {
                dtype: DType::F16,
                shape: vec![1],
            },
            stats: TensorStats::default(),
            rounding: RoundCounts::default(),
            forward_op: None,
            wrt: None,
            masked_neg_inf: 0,
            additive_mask: false,
            blame: None,
        }
    }

    #[test]
    fn pairs_same_ops_and_leaves_casts_one_sided() {
        let f = Phase::Forward;
        let a = vec![
            op(0, f, "to", "fc1"),
            op(1, f, "linear", "fc1"),
            op(2, f, "relu", "relu"),
            op(3, f, "to", "fc2"),
            op(4, f, "linear", "fc2"),
        ];
        let b = vec![
            op(0, f, "linear", "fc1"),
            op(1, f, "relu", "relu"),
            op(2, f, "linear", "fc2"),
            op(3, Phase::Backward, "linear", "fc2"),
        ];
        let p = |a: Option<usize>, b: Option<usize>| Pair { a, b };
        assert_eq!(
            align(&a, &b),
            vec![
                p(Some(0), None),
                p(Some(1), Some(0)),
                p(Some(2), Some(1)),
                p(Some(3), None),
                p(Some(4), Some(2)),
                p(None, Some(3)),
            ]
        );
        assert_eq!(align(&[], &b).len(), 4);
        assert_eq!(align(&a, &[]).len(), 5);
    }

    #[test]
    fn repeated_ops_pair_by_occurrence_and_gradient_input() {
        let bw = Phase::Backward;
        let mut x = op(0, bw, "mul_backward", "m");
        x.wrt = Some("a".into());
        let mut y = op(1, bw, "mul_backward", "m");
        y.wrt = Some("b".into());
        // B emits the two gradients in the other order: they still pair by input.
        let a = vec![x.clone(), y.clone(), x.clone()];
        let b = vec![y, x.clone(), x];
        let rows = align(&a, &b);
        let pairs: Vec<(Option<usize>, Option<usize>)> = rows.iter().map(|p| (p.a, p.b)).collect();
        assert_eq!(
            pairs,
            vec![(Some(1), Some(0)), (Some(0), Some(1)), (Some(2), Some(2))]
        );
    }

    #[test]
    fn relative_difference() {
        assert_eq!(rel_diff(2.0, 2.0), 0.0);
        assert_eq!(rel_diff(1.0, 0.0), f64::INFINITY);
        assert_eq!(rel_diff(1.1, 1.0), 1.1f64 - 1.0);
    }
}
