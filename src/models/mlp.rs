//! The seed model: Linear → ReLU → Linear, cross-entropy loss.

use super::{Batch, Model, Output, Param, ParamAccess, ParamStore};
use crate::dtype::DType;
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::rng::Rng;
use crate::tensor::Tensor;
use std::path::Path;

/// A two-layer perceptron `fc1` (Linear) → `relu` → `fc2` (Linear).
#[derive(Debug, Clone)]
pub struct Mlp {
    /// Input features.
    pub inputs: usize,
    /// Hidden units.
    pub hidden: usize,
    /// Classes.
    pub classes: usize,
}

impl Mlp {
    /// Parameter names and shapes, in order.
    pub fn shapes(&self) -> Vec<(&'static str, Vec<usize>)> {
        vec![
            ("fc1.weight", vec![self.hidden, self.inputs]),
            ("fc1.bias", vec![self.hidden]),
            ("fc2.weight", vec![self.classes, self.hidden]),
            ("fc2.bias", vec![self.classes]),
        ]
    }

    /// Parameters from a safetensors file, checked against the shapes.
    pub fn load(&self, path: &Path) -> Result<ParamStore> {
        let mut map = super::weights::load_safetensors(path)?;
        let mut params = Vec::new();
        for (name, shape) in self.shapes() {
            let t = super::weights::take(&mut map, path, name, &shape)?;
            if !t.dtype().is_float() || t.dtype() == DType::F64 {
                return Err(Error::tensor(
                    format!("{}: {name}", path.display()),
                    format!("has dtype {}, expected F32, F16 or BF16", t.dtype()),
                ));
            }
            let t = crate::ops::cast::cast(&t, DType::F32)?.tensor;
            params.push(Param::new(name, t, false));
        }
        Ok(ParamStore { params })
    }

    /// Parameters initialised as PyTorch's `nn.Linear` does (uniform in ±1/√fan_in), seeded.
    pub fn init(&self, seed: u64) -> Result<ParamStore> {
        let mut rng = Rng::derive(seed, &[0x1417]);
        let mut params = Vec::new();
        for (name, shape) in self.shapes() {
            let fan_in = if name.starts_with("fc1") {
                self.inputs
            } else {
                self.hidden
            };
            let bound = 1.0 / (fan_in as f64).sqrt();
            let n: usize = shape.iter().product();
            let v = (0..n)
                .map(|_| ((rng.uniform() * 2.0 - 1.0) * bound) as f32)
                .collect();
            params.push(Param::new(
                name,
                Tensor::from_f32(v, &shape, DType::F32)?,
                false,
            ));
        }
        Ok(ParamStore { params })
    }
}

impl Model for Mlp {
    fn describe(&self) -> String {
        format!("mlp {}→{}→{}", self.inputs, self.hidden, self.classes)
    }

    fn clone_model(&self) -> Box<dyn Model> {
        Box::new(self.clone())
    }

    fn check_batch(&self, batch: &Batch) -> Result<()> {
        crate::ops::loss::check_labels(&batch.labels, self.classes, Some(-100))
    }

    fn forward(&self, eng: &mut Engine, p: &ParamAccess<'_>, batch: &Batch) -> Result<Output> {
        let mut x = batch.inputs.clone();
        if x.shape().last() != Some(&self.inputs) {
            return Err(Error::tensor(
                "x",
                format!(
                    "has shape {:?}, expected [batch, {}]",
                    x.shape(),
                    self.inputs
                ),
            ));
        }
        if let Some(d) = p.precision().input_dtype() {
            x = eng.to_dtype(&x, d)?;
        }
        let h = eng.scope("fc1", |e| {
            let (w, b) = (p.get(e, "fc1.weight")?, p.get(e, "fc1.bias")?);
            e.linear(&x, &w, Some(&b))
        })?;
        let h = eng.scope("relu", |e| e.relu(&h))?;
        let mut logits = eng.scope("fc2", |e| {
            let (w, b) = (p.get(e, "fc2.weight")?, p.get(e, "fc2.bias")?);
            e.linear(&h, &w, Some(&b))
        })?;
        if p.precision().o2_dtype().is_some() {
            logits = eng.to_dtype(&logits, DType::F32)?;
        }
        let loss = eng.scope("loss", |e| {
            e.cross_entropy(&logits, &batch.labels, Some(-100))
        })?;
        Ok(Output {
            loss,
            hidden: logits.clone(),
            logits,
        })
    }
}

/// A seeded synthetic classification batch: x ~ N(0, 1) [batch, inputs], y uniform.
pub fn synthetic_batch(
    inputs: usize,
    classes: usize,
    batch: usize,
    seed: u64,
    step: u64,
) -> Result<Batch> {
    let mut rng = Rng::derive(seed, &[0xda7a, step]);
    let x: Vec<f32> = (0..batch * inputs).map(|_| rng.normal() as f32).collect();
    let y: Vec<i64> = (0..batch)
        .map(|_| rng.below(classes as u64) as i64)
        .collect();
    Ok(Batch::new(
        Tensor::from_f32(x, &[batch, inputs], DType::F32)?,
        Tensor::from_i64(y, &[batch])?,
    ))
}
