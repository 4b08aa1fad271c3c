//! The terminal UI over real traces of the GPT-2, LLaMA, BERT and full T5 samples (fp16 autocast): the
//! first-Inf and first-NaN cards name their modules, and `f` jumps to the op where the
//! overflow starts.

mod tui_fixture;

use amprobe::config::RunConfig;
use amprobe::runner::{run, RunOptions};
use amprobe::trace::io::read_trace;
use amprobe::tui::app::Tab;
use amprobe::tui::Model;
use std::path::Path;
use tui_fixture::*;

fn sample_model(dir: &Path, sample: &str) -> Model {
    let mut cfg = RunConfig::load(Path::new(&format!("samples/{sample}.toml"))).unwrap();
    cfg.train.steps = Some(2);
    let p = dir.join(format!("{sample}.jsonl"));
    cfg.probe.trace = Some(p.clone());
    run(&cfg, &RunOptions::default()).unwrap();
    let mut t = read_trace(&p).unwrap();
    normalise(&mut t);
    Model::from_trace(t, format!("{sample}.jsonl"))
}

#[test]
fn the_cards_and_the_jump_name_the_origin_in_each_sample() {
    let dir = tempfile::tempdir().unwrap();
    for (sample, inf_module, nan_module, first_op) in [
        (
            "gpt2_overflow",
            "transformer.h.1.attn",
            "transformer.h.1.attn",
            "matmul",
        ),
        (
            "llama_overflow",
            "model.layers.1.mlp.down_proj",
            "model.layers.2.input_layernorm",
            "linear",
        ),
        (
            "bert_overflow",
            "bert.encoder.layer.1.output.dense",
            "bert.encoder.layer.1.output.LayerNorm",
            "linear",
        ),
        (
            "t5_seq2seq",
            "decoder.block.1.layer.2.DenseReluDense.wo",
            "decoder.final_layer_norm",
            "linear",
        ),
    ] {
        let mut a = app(sample_model(dir.path(), sample), None);
        let s = screen(&draw(&mut a, 160, 48));
        assert!(
            s.contains(inf_module),
            "{sample}: the first-Inf card names {inf_module}: {s}"
        );
        assert!(
            s.contains(nan_module),
            "{sample}: the first-NaN card names {nan_module}: {s}"
        );
        for tab in ["2", "3", "4"] {
            type_keys(&mut a, tab);
            let _ = screen(&draw(&mut a, 80, 24));
        }
        type_keys(&mut a, "f");
        assert_eq!(a.tab(), Tab::Ops, "{sample}");
        let op = a.ops().selected_op(a.model(), a.cursor().idx).unwrap();
        assert_eq!(
            (op.op.as_str(), op.module.as_str()),
            (first_op, inf_module),
            "{sample}"
        );
    }
}
