//! Token batches of the language models: the inputs file (`input_ids` and the optional
//! tensors transformers takes beside it), seeded synthetic ids, and the host checks a
//! model runs before a batch is copied to a device.

use super::weights::load_safetensors;
use super::{Batch, Model};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::rng::Rng;
use crate::tensor::Tensor;
use std::collections::BTreeMap;
use std::path::Path;

/// The tensors an inputs file may hold.
pub const INPUT_TENSORS: &[&str] = &[
    "input_ids",
    "attention_mask",
    "token_type_ids",
    "labels",
    "decoder_input_ids",
];

/// Seeded synthetic token ids [batch, seq] (labels = ids).
pub fn synthetic_ids(
    vocab: usize,
    batch: usize,
    seq: usize,
    seed: u64,
    step: u64,
) -> Result<Batch> {
    let mut rng = Rng::derive(seed, &[0x1d5, step]);
    let ids: Vec<i64> = (0..batch * seq)
        .map(|_| rng.below(vocab as u64) as i64)
        .collect();
    let t = Tensor::from_i64(ids, &[batch, seq])?;
    Ok(Batch::new(t.clone(), t))
}

/// A batch from a safetensors file with `input_ids` [batch, seq] and optionally
/// `attention_mask` and `token_type_ids` (both [batch, seq]), `labels` [batch, target]
/// (default: the input ids) and `decoder_input_ids` (the labels' shape), all int64.
pub fn load_inputs(path: &Path) -> Result<Batch> {
    inputs_from(load_safetensors(path)?, path)
}

/// [`load_inputs`] from the tensors of a loaded file; `path` names it in errors.
pub fn inputs_from(mut map: BTreeMap<String, Tensor>, path: &Path) -> Result<Batch> {
    let at = |name: &str| format!("{}: {name}", path.display());
    if let Some(other) = map.keys().find(|k| !INPUT_TENSORS.contains(&k.as_str())) {
        return Err(Error::tensor(
            at(other),
            format!(
                "is not an input amprobe takes (expected {})",
                INPUT_TENSORS.join(", ")
            ),
        ));
    }
    let int2 = |name: &str, t: &Tensor| -> Result<()> {
        if t.dtype() != DType::I64 || t.rank() != 2 {
            return Err(Error::tensor(
                at(name),
                format!(
                    "expected int64 [batch, seq], got {} {:?}",
                    t.dtype(),
                    t.shape()
                ),
            ));
        }
        Ok(())
    };
    let ids = map
        .remove("input_ids")
        .ok_or_else(|| Error::tensor(at("input_ids"), "missing (expected int64 [batch, seq])"))?;
    int2("input_ids", &ids)?;
    let batch = ids.shape()[0];
    let same_as_ids = |name: &str, t: &Tensor| -> Result<()> {
        int2(name, t)?;
        if t.shape() != ids.shape() {
            return Err(Error::tensor(
                at(name),
                format!(
                    "has shape {:?}, expected input_ids' {:?}",
                    t.shape(),
                    ids.shape()
                ),
            ));
        }
        Ok(())
    };
    let attention_mask = map.remove("attention_mask");
    if let Some(m) = &attention_mask {
        same_as_ids("attention_mask", m)?;
        if let Some((p, v)) = m
            .i64s()?
            .iter()
            .enumerate()
            .find(|(_, &v)| v != 0 && v != 1)
        {
            return Err(Error::tensor(
                at("attention_mask"),
                format!("holds {v} at position {p} (expected 1 for a token, 0 for padding)"),
            ));
        }
    }
    let token_type_ids = map.remove("token_type_ids");
    if let Some(t) = &token_type_ids {
        same_as_ids("token_type_ids", t)?;
        if let Some((p, v)) = t.i64s()?.iter().enumerate().find(|(_, &v)| v < 0) {
            return Err(Error::tensor(
                at("token_type_ids"),
                format!("holds {v} at position {p} (expected a token type ≥ 0)"),
            ));
        }
    }
    let labels = match map.remove("labels") {
        Some(l) => {
            int2("labels", &l)?;
            if l.shape()[0] != batch {
                return Err(Error::tensor(
                    at("labels"),
                    format!("has {} rows, expected input_ids' {batch}", l.shape()[0]),
                ));
            }
            l
        }
        None => ids.clone(),
    };
    let decoder_input_ids = map.remove("decoder_input_ids");
    if let Some(d) = &decoder_input_ids {
        int2("decoder_input_ids", d)?;
        if d.shape() != labels.shape() {
            return Err(Error::tensor(
                at("decoder_input_ids"),
                format!(
                    "has shape {:?}, expected the labels' {:?}",
                    d.shape(),
                    labels.shape()
                ),
            ));
        }
    }
    Ok(Batch {
        inputs: ids,
        labels,
        attention_mask,
        token_type_ids,
        decoder_input_ids,
    })
}

/// A host batch of token ids checked against a vocabulary of `vocab`: every input id in
/// range, every label in range or -100, the labels one per input position.
pub(crate) fn check_token_batch(batch: &Batch, vocab: usize) -> Result<()> {
    check_ids("input_ids", &batch.inputs, vocab)?;
    if batch.labels.shape() != batch.inputs.shape() {
        return Err(Error::tensor(
            "labels",
            format!(
                "has shape {:?}, expected input_ids' {:?} (one label per input token)",
                batch.labels.shape(),
                batch.inputs.shape()
            ),
        ));
    }
    crate::ops::loss::check_labels(&batch.labels, vocab, Some(-100))
}

/// Every id of `t` (named `name` in errors) in `0..vocab`.
pub(crate) fn check_ids(name: &str, t: &Tensor, vocab: usize) -> Result<()> {
    let v = vocab as i64;
    if let Some((pos, &bad)) = t.i64s()?.iter().enumerate().find(|(_, &t)| t < 0 || t >= v) {
        return Err(Error::tensor(
            name,
            format!("id {bad} at position {pos} is out of range for a vocabulary of {v}"),
        ));
    }
    Ok(())
}

/// Refuses the optional inputs a model does not model (`model` names it), rather than
/// leaving them out silently: padding (an attention mask with a 0), token types, decoder
/// inputs. An all-ones mask is the same as none and is taken.
pub(crate) fn refuse_inputs(batch: &Batch, model: &str, mask: bool, types: bool) -> Result<()> {
    if let (false, Some(m)) = (mask, &batch.attention_mask) {
        if m.i64s()?.contains(&0) {
            return Err(Error::tensor(
                "attention_mask",
                format!(
                    "marks padding, which amprobe's {model} does not model (give all-ones or \
                     no attention_mask)"
                ),
            ));
        }
    }
    if let (false, Some(_)) = (types, &batch.token_type_ids) {
        return Err(Error::tensor(
            "token_type_ids",
            format!("{model} takes no token types"),
        ));
    }
    if batch.decoder_input_ids.is_some() {
        return Err(Error::tensor(
            "decoder_input_ids",
            format!("{model} has no decoder"),
        ));
    }
    Ok(())
}

/// The batch without its attention mask when that marks no padding (a host mask of all
/// ones): transformers skips its eager mask then.
pub(crate) fn drop_full_mask(mut batch: Batch) -> Result<Batch> {
    if let Some(m) = &batch.attention_mask {
        if m.device().is_none() && !m.i64s()?.contains(&0) {
            batch.attention_mask = None;
        }
    }
    Ok(batch)
}

/// The token ids a language model's forward takes: int64, and checked by the model's
/// `check_batch` when on the host (device ids were checked before they were copied).
pub(crate) fn forward_ids<'a>(model: &dyn Model, batch: &'a Batch) -> Result<&'a Tensor> {
    let ids = &batch.inputs;
    if ids.dtype() != DType::I64 {
        return Err(Error::tensor(
            "input_ids",
            format!("expected int64 token ids, got {}", ids.dtype()),
        ));
    }
    if ids.device().is_none() {
        model.check_batch(batch)?;
    }
    Ok(ids)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(v: Vec<i64>, shape: &[usize]) -> Tensor {
        Tensor::from_i64(v, shape).unwrap()
    }

    fn file(pairs: Vec<(&str, Tensor)>) -> BTreeMap<String, Tensor> {
        pairs.into_iter().map(|(k, t)| (k.to_string(), t)).collect()
    }

    fn err(map: BTreeMap<String, Tensor>) -> String {
        inputs_from(map, Path::new("in.safetensors"))
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn every_input_is_checked_and_named() {
        let x = || ids(vec![1, 2, 3, 4], &[2, 2]);
        let e = err(file(vec![("input_ids", x()), ("position_ids", x())]));
        assert!(e.contains("in.safetensors: position_ids") && e.contains("token_type_ids"));
        let e = err(file(vec![
            ("input_ids", x()),
            ("attention_mask", ids(vec![1, 2, 1, 0], &[2, 2])),
        ]));
        assert!(
            e.contains("attention_mask") && e.contains("holds 2 at position 1"),
            "{e}"
        );
        let e = err(file(vec![
            ("input_ids", x()),
            ("token_type_ids", ids(vec![0, 1], &[1, 2])),
        ]));
        assert!(e.contains("token_type_ids") && e.contains("[1, 2]"), "{e}");
        let e = err(file(vec![
            ("input_ids", x()),
            ("labels", ids(vec![1; 3], &[3, 1])),
        ]));
        assert!(e.contains("labels") && e.contains("3 rows"), "{e}");
        let e = err(file(vec![
            ("input_ids", x()),
            ("labels", ids(vec![1; 6], &[2, 3])),
            ("decoder_input_ids", x()),
        ]));
        assert!(
            e.contains("decoder_input_ids") && e.contains("labels'"),
            "{e}"
        );
        let b = inputs_from(
            file(vec![
                ("input_ids", x()),
                ("labels", ids(vec![1; 6], &[2, 3])),
            ]),
            Path::new("in.safetensors"),
        )
        .unwrap();
        let e = check_token_batch(&b, 8).unwrap_err().to_string();
        assert!(e.contains("one label per input token"), "{e}");
    }

    #[test]
    fn a_model_refuses_the_inputs_it_does_not_model() {
        let x = ids(vec![1, 2, 3, 4], &[2, 2]);
        let mut b = Batch::new(x.clone(), x.clone());
        b.attention_mask = Some(ids(vec![1; 4], &[2, 2]));
        refuse_inputs(&b, "gpt2", false, false).unwrap();
        b.attention_mask = Some(ids(vec![1, 1, 1, 0], &[2, 2]));
        let e = refuse_inputs(&b, "gpt2", false, false)
            .unwrap_err()
            .to_string();
        assert!(e.contains("padding") && e.contains("gpt2"), "{e}");
        refuse_inputs(&b, "x", true, false).unwrap();
        b.token_type_ids = Some(x.clone());
        assert!(refuse_inputs(&b, "x", true, false).is_err());
        b.token_type_ids = None;
        b.decoder_input_ids = Some(x);
        assert!(refuse_inputs(&b, "x", true, true).is_err());
    }
}
