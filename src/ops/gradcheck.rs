//! Finite-difference gradient checking in f64, the reference every op's backward is held to.

use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// Outcome of a gradient check.
#[derive(Debug, Clone)]
pub struct GradCheck {
    /// Largest |analytic − numeric| / (atol + rtol·|numeric|) over all checked elements
    /// (≤ 1 passes).
    pub worst_ratio: f64,
    /// Where the worst element is: (input index, element index, analytic, numeric).
    pub worst_at: (usize, usize, f64, f64),
    /// Number of elements checked.
    pub checked: usize,
}

/// Deterministic pseudo-random weights in [-1, 1) used to project outputs to a scalar.
fn weights(n: usize, seed: u64) -> Vec<f64> {
    let mut rng = crate::rng::Rng::new(seed);
    (0..n).map(|_| rng.uniform() * 2.0 - 1.0).collect()
}

/// Checks the gradients of `f` with respect to every floating-point input (all f64)
/// against central differences with step `eps`: the output is projected to a scalar with
/// fixed random weights, so the whole vector-Jacobian product is checked.
pub fn check(
    inputs: &[Tensor],
    f: impl Fn(&mut Engine, &[Tensor]) -> Result<Tensor>,
    eps: f64,
    atol: f64,
    rtol: f64,
) -> Result<GradCheck> {
    for (i, t) in inputs.iter().enumerate() {
        if t.dtype().is_float() && t.dtype() != crate::DType::F64 {
            return Err(Error::tensor(
                format!("input {i}"),
                "gradient checks run in float64",
            ));
        }
    }
    let leaves: Vec<Tensor> = inputs
        .iter()
        .map(|t| t.as_leaf(t.dtype().is_float()))
        .collect();
    let mut eng = Engine::new();
    let y = f(&mut eng, &leaves)?;
    let w = weights(y.numel(), 7);
    let seed = Tensor::from_f64(w.clone(), y.shape())?;
    let grads = eng.backward_with(&y, seed)?;
    let project = |ins: &[Tensor]| -> Result<f64> {
        let mut e = Engine::new();
        e.set_grad_enabled(false);
        let y = f(&mut e, ins)?;
        Ok(y.f64s()?.iter().zip(&w).map(|(a, b)| a * b).sum())
    };
    let mut out = GradCheck {
        worst_ratio: 0.0,
        worst_at: (0, 0, 0.0, 0.0),
        checked: 0,
    };
    for (i, leaf) in leaves.iter().enumerate() {
        if !leaf.dtype().is_float() {
            continue;
        }
        let analytic = match grads.get(&leaf.id()) {
            Some(g) => g.f64s()?.to_vec(),
            None => vec![0.0; leaf.numel()],
        };
        let base = leaf.f64s()?.to_vec();
        for j in 0..base.len() {
            let shifted = |d: f64| -> Result<f64> {
                let mut v = base.clone();
                v[j] += d;
                let mut ins = inputs.to_vec();
                ins[i] = Tensor::from_f64(v, leaf.shape())?;
                project(&ins)
            };
            let numeric = (shifted(eps)? - shifted(-eps)?) / (2.0 * eps);
            let a = analytic[j];
            let ratio = (a - numeric).abs() / (atol + rtol * numeric.abs());
            if ratio > out.worst_ratio || ratio.is_nan() {
                out.worst_ratio = if ratio.is_nan() { f64::INFINITY } else { ratio };
                out.worst_at = (i, j, a, numeric);
            }
            out.checked += 1;
        }
    }
    Ok(out)
}
