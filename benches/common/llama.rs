//! A LLaMA of about 1B parameters on the CUDA backend, for `benches/t5_base_gpu.rs
//! --model llama` (included with `#[path]` by the benches that use it).

use crate::common::Size;
use amprobe::amp::mode::Precision;
use amprobe::models::pretrained::Pretrained;
use amprobe::train::Trainer;

/// The configuration of [`llama_1b_trainer`]'s model at `layers` layers, `seq` positions
/// and a vocabulary of `vocab`.
pub fn llama_1b_config(
    layers: usize,
    seq: usize,
    vocab: usize,
) -> amprobe::Result<amprobe::models::llama::LlamaConfig> {
    let json = format!(
        r#"{{"model_type": "llama", "vocab_size": {vocab}, "hidden_size": 2048,
            "intermediate_size": 8192, "num_hidden_layers": {layers},
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
            "max_position_embeddings": {seq}, "rms_norm_eps": 1e-5,
            "tie_word_embeddings": true}}"#
    );
    amprobe::models::llama::LlamaConfig::parse(&json, std::path::Path::new("llama_1b"))
}

/// A trainer of LlamaForCausalLM with the widths of a 1B model (hidden 2048, intermediate
/// 8192, 32 query heads and 8 key-value heads of 64, tied embedding) at `size` (layers,
/// vocabulary, and the sequence as its longest position) on the CUDA device: the causal
/// LM objective on the input ids, SGD(lr=0.01), the default loss scaler, random weights
/// as transformers initialises them (normal, std 0.02), seeded synthetic token ids.
pub fn llama_1b_trainer(
    precision: Precision,
    probes: bool,
    size: Size,
) -> amprobe::Result<Trainer> {
    let cfg = llama_1b_config(size.layers, size.seq, size.vocab)?;
    let model = amprobe::models::llama::Llama::new(cfg);
    let params = model.seeded(0)?;
    crate::common::device_trainer(Box::new(model), params, precision, probes, size)
}
