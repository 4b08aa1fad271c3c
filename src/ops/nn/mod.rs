//! Neural-network ops: layer norm, embedding lookup and dropout.

use super::shape::check_grad;
use super::{expect_float, grad};
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::rng::Rng;
use crate::tensor::Tensor;

mod cpu;
pub mod cuda;
mod kernels;

pub use kernels::{Kernels, Mask, Stats};

/// The layer-norm, embedding and dropout kernels of the backend that holds `t`.
pub fn kernels(t: &Tensor) -> &'static dyn Kernels {
    if super::on_device(t) {
        &cuda::Device
    } else {
        &cpu::Host
    }
}

/// 64-bit FNV-1a hash.
fn fnv1a(bytes: impl IntoIterator<Item = u8>) -> u64 {
    bytes.into_iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// The stream of a dropout call's mask (element `i` uses its `i+1`-th draw).
fn dropout_rng(seed: u64, step: u64, micro: u32, module: &str, shape: &[usize], salt: u64) -> Rng {
    let shape_key = fnv1a(shape.iter().flat_map(|&s| (s as u64).to_le_bytes()));
    Rng::derive(
        seed,
        &[step, micro as u64, fnv1a(module.bytes()), shape_key, salt],
    )
}

impl Engine {
    /// `torch.nn.functional.layer_norm` over the last dim (of size `normalized_shape_last`)
    /// with biased variance; `weight` and `bias` have shape `[normalized_shape_last]`.
    /// Row statistics accumulate in f64; the output is rounded once.
    pub fn layer_norm(
        &mut self,
        x: &Tensor,
        normalized_shape_last: usize,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        eps: f64,
    ) -> Result<Tensor> {
        const OP: &str = "layer_norm";
        expect_float(x, OP, "input")?;
        let d = normalized_shape_last;
        if d == 0 || x.rank() == 0 || x.shape()[x.rank() - 1] != d {
            return Err(Error::shape(
                OP,
                format!(
                    "input {:?} must end in the normalized size {d} (which must be positive)",
                    x.shape()
                ),
            ));
        }
        for (what, t) in [("weight", weight), ("bias", bias)] {
            if let Some(t) = t {
                expect_float(t, OP, what)?;
                if t.shape() != [d] {
                    return Err(Error::shape(
                        OP,
                        format!("{what} must be [{d}], got {:?}", t.shape()),
                    ));
                }
            }
        }
        if eps.is_nan() || eps < 0.0 {
            return Err(Error::shape(OP, format!("eps must be >= 0, got {eps}")));
        }
        let mut raw = vec![x];
        raw.extend(weight);
        raw.extend(bias);
        let ins = self.prepare(OP, &raw)?;
        let x = &ins[0];
        let w = weight.map(|_| ins[1].clone());
        let b = bias.map(|_| ins[ins.len() - 1].clone());
        let shape = x.shape().to_vec();
        let kern = kernels(x);
        let (out, stats) = kern.layer_norm(x, (w.as_ref(), b.as_ref()), d, eps)?;
        let (xt, wt, has_b) = (x.clone(), w.clone(), b.is_some());
        let bw = Box::new(move |g: &Tensor| {
            check_grad(g, &shape, OP)?;
            kern.layer_norm_backward(&xt, wt.as_ref(), has_b, g, &stats, d)
        });
        let wrt: &'static [&'static str] = match (weight.is_some(), bias.is_some()) {
            (true, true) => &["input", "weight", "bias"],
            (true, false) => &["input", "weight"],
            (false, true) => &["input", "bias"],
            (false, false) => &["input"],
        };
        let refs: Vec<&Tensor> = ins.iter().collect();
        let has_w = weight.is_some();
        self.record(
            OP,
            &refs,
            wrt,
            out,
            Some(bw),
            Box::new(move |e: &mut Engine, r: &[Tensor]| {
                let w = has_w.then(|| &r[1]);
                let b = has_b.then(|| &r[r.len() - 1]);
                e.layer_norm(&r[0], d, w, b, eps)
            }),
        )
    }

    /// `torch.nn.functional.embedding(ids, weight)`: rows of `weight` [V, D] picked by the
    /// int64 `ids` [...], giving [..., D]. The weight gradient is a scatter-add accumulated
    /// in f64 and rounded once; the ids get none.
    pub fn embedding(&mut self, weight: &Tensor, ids: &Tensor) -> Result<Tensor> {
        self.embedding_padded(weight, ids, None)
    }

    /// [`Engine::embedding`] with PyTorch's `padding_idx`: the positions holding `pad` add
    /// nothing to the weight gradient, so that row gets none from this lookup.
    pub fn embedding_padded(
        &mut self,
        weight: &Tensor,
        ids: &Tensor,
        pad: Option<i64>,
    ) -> Result<Tensor> {
        const OP: &str = "embedding";
        expect_float(weight, OP, "weight")?;
        if weight.rank() != 2 {
            return Err(Error::shape(
                OP,
                format!("weight must be [vocab, dim], got {:?}", weight.shape()),
            ));
        }
        if ids.dtype() != crate::DType::I64 {
            return Err(Error::tensor(
                "input_ids",
                format!("expected int64 ids, got {}", ids.dtype()),
            ));
        }
        let (v, d) = (weight.shape()[0], weight.shape()[1]);
        if let Some(p) = pad.filter(|&p| p < 0 || p as usize >= v) {
            return Err(Error::shape(
                OP,
                format!("padding_idx {p} is outside the vocabulary of {v}"),
            ));
        }
        let padding = pad;
        let pad = pad.unwrap_or(-1);
        // Host ids are checked here; device ids cannot be without a read back (an id out
        // of range gives a NaN row and no gradient there).
        if let Ok(idv) = ids.i64s() {
            for (p, &id) in idv.iter().enumerate() {
                if id < 0 || id as usize >= v {
                    return Err(Error::tensor(
                        "input_ids",
                        format!(
                            "embedding id {id} at position {p} is out of range for a \
                             vocabulary of {v} (expected 0..{v})"
                        ),
                    ));
                }
            }
        }
        let ins = self.prepare(OP, &[weight, ids])?;
        let (w, ids) = (&ins[0], &ins[1]);
        let mut out_shape = ids.shape().to_vec();
        out_shape.push(d);
        let kern = kernels(w);
        let (out, idk) = kern.embedding(w, ids, &out_shape)?;
        let dtype = w.dtype();
        let bw = Box::new(move |g: &Tensor| {
            check_grad(g, &out_shape, OP)?;
            let dw = kern.embedding_backward(g, &idk, (v, d), pad, dtype)?;
            Ok(vec![grad(dw), None])
        });
        self.record(
            OP,
            &[w, ids],
            &["weight", "indices"],
            out,
            Some(bw),
            Box::new(move |e: &mut Engine, r: &[Tensor]| e.embedding_padded(&r[0], &r[1], padding)),
        )
    }

    /// `torch.nn.functional.dropout(x, p, train)`: zeroes each element with probability `p`
    /// and scales the kept ones by 1/(1-p). With `p == 0` or `!train` it returns `x`
    /// itself (nothing recorded).
    ///
    /// The mask is a deterministic function of the engine seed, step, micro-batch, module
    /// path, input shape and `salt`; callers that apply dropout more than once in one
    /// module with equal shapes must pass different salts to get independent masks.
    pub fn dropout(&mut self, x: &Tensor, p: f64, train: bool, salt: u64) -> Result<Tensor> {
        const OP: &str = "dropout";
        expect_float(x, OP, "input")?;
        if !(0.0..=1.0).contains(&p) {
            return Err(Error::shape(
                OP,
                format!("probability has to be between 0 and 1, but got {p}"),
            ));
        }
        if p == 0.0 || !train {
            return Ok(x.clone());
        }
        let ins = self.prepare(OP, &[x])?;
        let x = &ins[0];
        // p == 1 keeps nothing: PyTorch multiplies by zero instead of scaling by 1/0.
        let scale = if p == 1.0 { 0.0 } else { 1.0 / (1.0 - p) };
        let rng = dropout_rng(
            self.seed(),
            self.step(),
            self.micro(),
            &self.module_path(),
            x.shape(),
            salt,
        );
        let kern = kernels(x);
        let (out, mask) = kern.dropout(x, rng, 1.0 - p, scale)?;
        let (shape, dtype) = (x.shape().to_vec(), x.dtype());
        let bw = Box::new(move |g: &Tensor| {
            check_grad(g, &shape, OP)?;
            Ok(vec![grad(kern.dropout_backward(g, &mask, scale, dtype)?)])
        });
        // (a scratch engine draws the same mask: it has this engine's seed, step, micro-batch
        // and module path)
        self.record(
            OP,
            &[x],
            &["input"],
            out,
            Some(bw),
            Box::new(move |e: &mut Engine, r: &[Tensor]| e.dropout(&r[0], p, true, salt)),
        )
    }
}

#[cfg(test)]
mod tests {
    use crate::engine::Engine;
    use crate::{DType, Tensor};

    fn t32(v: &[f32], shape: &[usize]) -> Tensor {
        Tensor::from_f32(v.to_vec(), shape, DType::F32).unwrap()
    }

    #[test]
    fn layer_norm_forward_by_hand() {
        let mut e = Engine::new();
        let x = t32(&[1.0, 2.0, 3.0, 4.0, 2.0, 2.0, 2.0, 6.0], &[2, 4]);
        let w = t32(&[1.0, 2.0, 0.5, -1.0], &[4]);
        let b = t32(&[0.0, 1.0, 0.0, 3.0], &[4]);
        let y = e.layer_norm(&x, 4, Some(&w), Some(&b), 0.0).unwrap();
        // Row 0: mean 2.5, var 1.25; row 1: mean 3, var 3.
        let s0 = 1.25f64.sqrt();
        let s1 = 3f64.sqrt();
        let want = [
            -1.5 / s0,
            2.0 * (-0.5 / s0) + 1.0,
            0.5 * (0.5 / s0),
            -(1.5 / s0) + 3.0,
            -1.0 / s1,
            2.0 * (-1.0 / s1) + 1.0,
            0.5 * (-1.0 / s1),
            -(3.0 / s1) + 3.0,
        ];
        for (a, w) in y.f32s().unwrap().iter().zip(want) {
            assert!((*a as f64 - w).abs() < 1e-6, "{a} vs {w}");
        }
        let plain = e.layer_norm(&x, 4, None, None, 1e-5).unwrap();
        let want0 = -1.5 / (1.25f64 + 1e-5).sqrt();
        assert!((plain.f32s().unwrap()[0] as f64 - want0).abs() < 1e-6);
        let err = e
            .layer_norm(&x, 3, None, None, 1e-5)
            .unwrap_err()
            .to_string();
        assert!(err.contains("must end in the normalized size 3"), "{err}");
        let bad = t32(&[1.0; 3], &[3]);
        let err = e
            .layer_norm(&x, 4, Some(&bad), None, 1e-5)
            .unwrap_err()
            .to_string();
        assert!(err.contains("weight must be [4], got [3]"), "{err}");
    }

    #[test]
    fn embedding_picks_rows_and_checks_ids() {
        let mut e = Engine::new();
        let w = t32(&[0.0, 1.0, 10.0, 11.0, 20.0, 21.0], &[3, 2]);
        let ids = Tensor::from_i64(vec![2, 0, 2, 1], &[2, 2]).unwrap();
        let y = e.embedding(&w, &ids).unwrap();
        assert_eq!(y.shape(), &[2, 2, 2]);
        assert_eq!(
            y.f32s().unwrap(),
            &[20.0, 21.0, 0.0, 1.0, 20.0, 21.0, 10.0, 11.0]
        );
        let bad = Tensor::from_i64(vec![0, 1, 3], &[3]).unwrap();
        let err = e.embedding(&w, &bad).unwrap_err().to_string();
        assert_eq!(
            err,
            "tensor `input_ids`: embedding id 3 at position 2 is out of range for a \
             vocabulary of 3 (expected 0..3)"
        );
        let neg = Tensor::from_i64(vec![-1], &[1]).unwrap();
        let err = e.embedding(&w, &neg).unwrap_err().to_string();
        assert!(err.contains("id -1 at position 0"), "{err}");
        let err = e.embedding(&w, &w).unwrap_err().to_string();
        assert!(err.contains("expected int64 ids, got float32"), "{err}");
    }

    #[test]
    fn embedding_gradient_accumulates_in_f64_and_rounds_once() {
        let mut e = Engine::new();
        let w = Tensor::from_f32(vec![0.0; 4], &[2, 2], DType::F16)
            .unwrap()
            .as_leaf(true);
        let ids = Tensor::from_i64(vec![1, 1, 1], &[3]).unwrap();
        let y = e.embedding(&w, &ids).unwrap();
        // Row 1 gets 2048 + 1 + 1 = 2050 (exact in fp16); adding in fp16 would give 2048.
        let g =
            Tensor::from_f32(vec![2048.0, 1.0, 1.0, 0.5, 1.0, 0.25], &[3, 2], DType::F16).unwrap();
        let grads = e.backward_with(&y, g).unwrap();
        let gw = &grads[&w.id()];
        assert_eq!(gw.dtype(), DType::F16);
        assert_eq!(gw.f32s().unwrap(), &[0.0, 0.0, 2050.0, 1.75]);
    }

    #[test]
    fn dropout_masks_are_deterministic_and_keep_1_minus_p() {
        let n = 100_000;
        let x = t32(&vec![1.0; n], &[n]);
        let run = |seed: u64, step: u64, salt: u64, module: &str| {
            let mut e = Engine::new();
            e.set_seed(seed);
            e.begin_step(step);
            e.scope(module, |e| e.dropout(&x, 0.25, true, salt))
                .unwrap()
                .f32s()
                .unwrap()
                .to_vec()
        };
        let a = run(1, 3, 0, "enc");
        assert_eq!(a, run(1, 3, 0, "enc"));
        assert_ne!(a, run(1, 3, 1, "enc"));
        assert_ne!(a, run(1, 4, 0, "enc"));
        assert_ne!(a, run(2, 3, 0, "enc"));
        assert_ne!(a, run(1, 3, 0, "dec"));
        // Kept values are scaled by 1/(1-p) = 4/3 (rounded to f32), dropped ones are 0.
        let scale = (1.0f64 / 0.75) as f32;
        assert!(a.iter().all(|&v| v == 0.0 || v == scale));
        let kept = a.iter().filter(|&&v| v != 0.0).count() as f64;
        // Binomial(1e5, 0.75): sd ≈ 137; allow 5 sd.
        assert!((kept - 75_000.0).abs() < 5.0 * 137.0, "kept {kept}");
    }

    #[test]
    fn dropout_identity_cases_and_bad_p() {
        let mut e = Engine::new();
        let x = t32(&[1.0, 2.0], &[2]).as_leaf(true);
        assert_eq!(e.dropout(&x, 0.0, true, 0).unwrap().id(), x.id());
        assert_eq!(e.dropout(&x, 0.5, false, 0).unwrap().id(), x.id());
        assert_eq!(e.tape_len(), 0);
        let z = e.dropout(&x, 1.0, true, 0).unwrap();
        assert_eq!(z.f32s().unwrap(), &[0.0, 0.0]);
        let err = e.dropout(&x, 1.5, true, 0).unwrap_err().to_string();
        assert!(err.contains("between 0 and 1, but got 1.5"), "{err}");
        let h = Tensor::from_f32(vec![3.0; 64], &[64], DType::F16).unwrap();
        let y = e.dropout(&h, 0.1, true, 7).unwrap();
        // 3 / 0.9 = 3.333.. rounds once to fp16 3.333984375 (ulp 2^-9 in [2, 4)).
        assert!(y
            .f32s()
            .unwrap()
            .iter()
            .all(|&v| v == 0.0 || v == 3.333_984_4));
    }
}
