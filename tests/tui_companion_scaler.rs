//! The Overview panel of a trace the PyTorch companion wrote shows its scaler as the
//! companion's header gives it: a GradScaler's initial scale, growth and backoff (the header
//! has no `kind`), or `off` where the header's scaler is null (no enabled GradScaler).

mod rank_fixture;
mod tui_fixture;

use amprobe::trace::io::read_trace;
use amprobe::trace::record::{Header, StepRecord};
use amprobe::tui::Model;
use rank_fixture::{header, step, write};
use tui_fixture::{app, draw, screen};

/// The screen of the Overview panel of a companion-style trace with this header and steps.
fn overview(h: &Header, steps: &[StepRecord], w: u16, hgt: u16) -> String {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("captured.jsonl");
    write(&p, h, steps);
    let mut app = app(
        Model::from_trace(read_trace(&p).unwrap(), "captured.jsonl"),
        None,
    );
    screen(&draw(&mut app, w, hgt))
}

#[test]
fn a_companion_trace_with_a_grad_scaler_shows_its_configuration() {
    let steps = [step(0, false), step(1, true), step(2, false)];
    for (w, hgt) in [(80, 24), (160, 48)] {
        let s = overview(&header(0, 1), &steps, w, hgt);
        assert!(
            s.contains(
                "scaler    GradScaler · init 2^16 · ×2 after 2000 clean steps · backoff ×0.5"
            ),
            "{s}"
        );
        assert!(!s.contains("scaler    ?"), "{s}");
        // What the scale is now, from the step records.
        assert!(s.contains("scale now 2^16"), "{s}");
    }
}

#[test]
fn a_companion_trace_without_a_scaler_shows_it_off() {
    let mut h = header(0, 1);
    h.scaler = serde_json::Value::Null;
    h.precision = "bf16".into();
    // The companion records scale 1 without a scaler.
    let steps: Vec<StepRecord> = (0..3)
        .map(|n| {
            let mut s = step(n, false);
            s.scale_before = 1.0;
            s.scale_after = 1.0;
            s.scaled_loss = None;
            s
        })
        .collect();
    let s = overview(&h, &steps, 80, 24);
    assert!(s.contains("scaler    off (no loss scaling)"), "{s}");
    assert!(!s.contains("scaler    ?"), "{s}");
}
