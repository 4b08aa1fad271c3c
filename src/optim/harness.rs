//! What the Adam and SGD unit tests share: single-parameter steps, a run held to an f64
//! model of the optimizer, a resized parameter, and the element loops' test data.

use super::update::{Optimizer, ParamSlot};
use crate::dtype::DType;
use crate::Result;

/// Values for holding an element loop's FMA copy to its plain copy: ordinary magnitudes,
/// with now and then one near fp16's limits.
pub(crate) fn kernel_test_data(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let k = (i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 7;
            let v = ((k % 4001) as f32 - 2000.0) / 977.0;
            match k % 53 {
                0 => v * 3e4,
                1 => v * 1e-6,
                _ => v,
            }
        })
        .collect()
}

/// One step of the f32 parameter `name` (now `data`) by gradient `grad`.
pub(crate) fn step_f32(
    opt: &mut dyn Optimizer,
    name: &str,
    data: &mut [f32],
    grad: &[f32],
) -> Result<()> {
    opt.step(&mut [ParamSlot {
        name,
        data,
        grad: Some(grad),
        dtype: DType::F32,
    }])
}

/// An independent f64 model of an optimizer (the documented algorithm, no rounding).
pub(crate) trait Reference {
    /// One step of `p` by gradient `grad`.
    fn step(&mut self, p: &mut [f64], grad: &[f64]);
}

/// A run against an f64 model: what it starts from, and how close it must stay.
pub(crate) struct RefRun<'a> {
    /// How the failures name the run (the configuration).
    pub what: String,
    /// The parameter before the first step.
    pub p0: Vec<f32>,
    /// Steps to take.
    pub steps: usize,
    /// The gradient of each step.
    pub grads: &'a dyn Fn(usize) -> Vec<f32>,
    /// The largest difference allowed from the model's value.
    pub tol: fn(f64) -> f64,
}

/// Steps parameter `w` of `opt` and the model side by side, each step's values within
/// `run.tol` of the model's, and every step counted; the parameter and the model's at
/// the end.
pub(crate) fn run_against_reference(
    opt: &mut dyn Optimizer,
    reference: &mut dyn Reference,
    run: RefRun<'_>,
) -> (Vec<f32>, Vec<f64>) {
    let what = &run.what;
    let mut p = run.p0;
    let mut r: Vec<f64> = p.iter().map(|&x| f64::from(x)).collect();
    for s in 0..run.steps {
        let g = (run.grads)(s);
        let g64: Vec<f64> = g.iter().map(|&x| f64::from(x)).collect();
        step_f32(opt, "w", &mut p, &g).unwrap();
        reference.step(&mut r, &g64);
        for (j, (&a, &b)) in p.iter().zip(&r).enumerate() {
            assert!(
                (f64::from(a) - b).abs() <= (run.tol)(b),
                "{what} step {s} elem {j}: f32 {a} vs f64 {b}"
            );
        }
    }
    assert_eq!(opt.step_count("w"), Some(run.steps as f32));
    (p, r)
}

/// Steps parameter `name` of `before` elements (all 1, gradient 1), then the same name with
/// `after`: the second step's error, and the resized values it left.
pub(crate) fn resized_step(
    opt: &mut dyn Optimizer,
    name: &str,
    before: usize,
    after: usize,
) -> (String, Vec<f32>) {
    let mut p = vec![1.0f32; before];
    step_f32(opt, name, &mut p, &vec![1.0; before]).unwrap();
    let mut q = vec![1.0f32; after];
    let err = step_f32(opt, name, &mut q, &vec![1.0; after])
        .unwrap_err()
        .to_string();
    (err, q)
}
