//! What the device benches share: the T5-base-width encoder trainer on the CUDA backend
//! (and, for the benches that include `llama.rs` beside it, a LLaMA of about 1B parameters).

use amprobe::amp::mode::Precision;
use amprobe::backend::BackendKind;
use amprobe::models::pretrained::Pretrained;
use amprobe::models::t5::{synthetic_ids, T5Config, T5Encoder};
use amprobe::optim::{OptimizerConfig, SgdConfig};
use amprobe::train::{Synthetic, TrainConfig, Trainer};

/// Sizes of a T5-base-width step besides the widths: layers, batch, sequence, vocabulary.
#[derive(Debug, Clone, Copy)]
pub struct Size {
    pub layers: usize,
    pub batch: usize,
    pub seq: usize,
    pub vocab: usize,
}

/// A trainer of T5EncoderModel with T5-base's widths (d_model 768, d_ff 3072, 12 heads,
/// d_kv 64, relu FFN) at `size` on the CUDA device: the LM objective on the tied
/// embedding, SGD(lr=0.01), the default loss scaler, seeded synthetic token ids.
pub fn t5_base_trainer(precision: Precision, probes: bool, size: Size) -> amprobe::Result<Trainer> {
    let cfg = T5Config::relu(768, 3072, (12, 64), size.layers, size.vocab);
    let model = T5Encoder::new(cfg);
    let params = model.seeded(0)?;
    device_trainer(Box::new(model), params, precision, probes, size)
}

/// A trainer of `model` on the CUDA device: SGD(lr=0.01), the default loss scaler, seeded
/// synthetic token ids of `size`'s batch, sequence and vocabulary.
pub fn device_trainer(
    model: Box<dyn amprobe::models::Model>,
    params: amprobe::models::ParamStore,
    precision: Precision,
    probes: bool,
    size: Size,
) -> amprobe::Result<Trainer> {
    let train = TrainConfig {
        precision,
        probes,
        backend: BackendKind::Cuda,
        optimizer: OptimizerConfig::Sgd(SgdConfig {
            lr: 0.01,
            ..SgdConfig::default()
        }),
        ..TrainConfig::default()
    };
    let Size {
        batch, seq, vocab, ..
    } = size;
    let data = Synthetic(move |step, micro| {
        synthetic_ids(vocab, batch, seq, 0, step * 1024 + micro as u64)
    });
    Trainer::new(train, model, params, Box::new(data))
}
