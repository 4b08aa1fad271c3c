//! The terminal UI over a real trace of the T5 fixture (fp16 autocast: the Inf at block 3's
//! `wo`, the NaN at the final norm): every panel at 80×24 and 160×48, the first-NaN card,
//! and the jump to the first non-finite op.

mod tui_fixture;

use amprobe::config::RunConfig;
use amprobe::runner::{run, RunOptions};
use amprobe::trace::io::read_trace;
use amprobe::tui::app::Tab;
use amprobe::tui::Model;
use std::path::Path;
use tui_fixture::*;

fn t5_model(dir: &Path, precision: &str) -> Model {
    let mut cfg = RunConfig::load(Path::new("samples/t5_overflow.toml")).unwrap();
    cfg.train.precision = Some(precision.into());
    cfg.train.steps = Some(2);
    let p = dir.join(format!("t5-{precision}.jsonl"));
    cfg.probe.trace = Some(p.clone());
    run(&cfg, &RunOptions::default()).unwrap();
    let mut t = read_trace(&p).unwrap();
    normalise(&mut t);
    Model::from_trace(t, format!("t5-{precision}.jsonl"))
}

fn snap(name: &str, app: &mut amprobe::tui::App) {
    for (w, h) in [(80u16, 24u16), (160, 48)] {
        insta::assert_snapshot!(format!("{name}_{w}x{h}"), screen(&draw(app, w, h)));
    }
}

#[test]
fn t5_panels_first_nan_card_and_jump() {
    let dir = tempfile::tempdir().unwrap();
    let mut a = app(t5_model(dir.path(), "fp16"), None);
    let s = screen(&draw(&mut a, 160, 48));
    assert!(s.contains("wo"), "the first-Inf card names wo: {s}");
    assert!(
        s.contains("final_layer_norm"),
        "the first-NaN card names the final norm: {s}"
    );
    snap("t5_overview", &mut a);
    type_keys(&mut a, "2");
    assert_eq!(a.tab(), Tab::Scale);
    snap("t5_scale", &mut a);
    type_keys(&mut a, "3");
    snap("t5_layers", &mut a);
    type_keys(&mut a, "f");
    assert_eq!(a.tab(), Tab::Ops);
    let op = a.ops().selected_op(a.model(), a.cursor().idx).unwrap();
    assert_eq!(
        (op.op.as_str(), op.module.as_str()),
        ("linear", "encoder.block.3.layer.1.DenseReluDense.wo")
    );
    snap("t5_ops_first_nonfinite", &mut a);
    type_keys(&mut a, "\n");
    snap("t5_ops_details", &mut a);
}

#[test]
fn t5_compare_fp16_with_fp32() {
    let dir = tempfile::tempdir().unwrap();
    let mut a = app(
        t5_model(dir.path(), "fp16"),
        Some(t5_model(dir.path(), "fp32")),
    );
    type_keys(&mut a, "5");
    assert_eq!(a.tab(), Tab::Compare);
    snap("t5_compare", &mut a);
}
