//! Traces for the terminal UI tests, made by real runs of the seed MLP (deterministic), and
//! helpers to draw an app on a test backend and send it keys.
#![allow(dead_code)]

use amprobe::config::RunConfig;
use amprobe::engine::Injection;
use amprobe::runner::{run, RunOptions};
use amprobe::trace::io::{read_trace, Trace};
use amprobe::trace::record::Phase;
use amprobe::tui::{App, Model, Theme};
use ratatui::backend::TestBackend;
use ratatui::crossterm::event::{KeyCode, KeyEvent, KeyModifiers};
use ratatui::Terminal;
use std::path::{Path, PathBuf};

/// The seed MLP config with `edit` applied and the trace written to `dir/name`.
pub fn config(dir: &Path, name: &str, edit: impl FnOnce(&mut RunConfig)) -> (RunConfig, PathBuf) {
    let mut cfg = RunConfig::load(Path::new("samples/mlp.toml")).expect("samples/mlp.toml");
    let path = dir.join(name);
    cfg.probe.trace = Some(path.clone());
    edit(&mut cfg);
    (cfg, path)
}

/// Runs and reads back the trace, with wall-clock times zeroed so that drawings repeat.
pub fn trace(
    dir: &Path,
    name: &str,
    edit: impl FnOnce(&mut RunConfig),
    injections: Vec<Injection>,
) -> (Trace, PathBuf) {
    let (cfg, path) = config(dir, name, edit);
    let opts = RunOptions {
        command_line: vec!["amprobe".into()],
        injections,
        ..RunOptions::default()
    };
    run(&cfg, &opts).expect("fixture run");
    let mut t = read_trace(&path).expect("fixture trace");
    normalise(&mut t);
    (t, path)
}

/// Zeroes what differs from run to run (times) and what names the temporary folder.
pub fn normalise(t: &mut Trace) {
    for s in &mut t.steps {
        s.wall_ms = 0.0;
    }
    if let Some(e) = &mut t.end {
        e.wall_ms = 0.0;
    }
    t.header.config = serde_json::json!({"train": t.header.config["train"].clone()});
}

/// fp16, initial scale 2^24, growth after 3 clean steps, 12 steps, full ops every 4th
/// step: overflows in backward skip steps 0-5 and 9 while the scale backs off.
pub fn overflow_edit(precision: &'static str) -> impl FnOnce(&mut RunConfig) {
    move |c: &mut RunConfig| {
        c.train.precision = Some(precision.into());
        c.train.steps = Some(12);
        c.scaler.init_scale = Some(16_777_216.0);
        c.scaler.growth_interval = Some(3);
        c.probe.sample_every = Some(4);
    }
}

/// The overflow run under fp16 (A) as a model labelled `overflow.jsonl`.
pub fn overflow_model(dir: &Path) -> Model {
    let (t, _) = trace(dir, "overflow.jsonl", overflow_edit("fp16"), vec![]);
    Model::from_trace(t, "overflow.jsonl")
}

/// The same run under fp32 (B of the comparison).
pub fn overflow_fp32_model(dir: &Path) -> Model {
    let (t, _) = trace(dir, "overflow32.jsonl", overflow_edit("fp32"), vec![]);
    Model::from_trace(t, "overflow32.jsonl")
}

/// The planted fault: an Inf written into the output of the forward `linear` of `fc2`
/// at step 1 of a 4-step fp16 run (default scaler).
pub fn planted_injection() -> Injection {
    Injection {
        step: Some(1),
        op: "linear".into(),
        module: "fc2".into(),
        phase: Phase::Forward,
        value: f32::INFINITY,
    }
}

/// The planted-fault run as a trace.
pub fn planted_trace(dir: &Path) -> (Trace, PathBuf) {
    trace(
        dir,
        "planted.jsonl",
        |c| {
            c.train.steps = Some(4);
        },
        vec![planted_injection()],
    )
}

/// The planted-fault run as a model labelled `planted.jsonl`.
pub fn planted_model(dir: &Path) -> Model {
    Model::from_trace(planted_trace(dir).0, "planted.jsonl")
}

/// A test terminal of `w`×`h` cells.
pub fn terminal(w: u16, h: u16) -> Terminal<TestBackend> {
    Terminal::new(TestBackend::new(w, h)).expect("test terminal")
}

/// Draws `app` on a fresh `w`×`h` test terminal and returns it.
pub fn draw(app: &mut App, w: u16, h: u16) -> Terminal<TestBackend> {
    let mut t = terminal(w, h);
    t.draw(|f| app.draw(f)).expect("draw");
    t
}

/// The screen as text, one line per row.
pub fn screen(t: &Terminal<TestBackend>) -> String {
    let buf = t.backend().buffer();
    let mut out = String::new();
    for y in 0..buf.area.height {
        for x in 0..buf.area.width {
            out.push_str(buf[(x, y)].symbol());
        }
        out.push('\n');
    }
    out
}

/// A key press.
pub fn key(code: KeyCode) -> KeyEvent {
    KeyEvent::new(code, KeyModifiers::NONE)
}

/// Presses each key of `keys` (characters; `\n` is Enter, `\x1b` Esc, `\t` Tab).
pub fn type_keys(app: &mut App, keys: &str) {
    for c in keys.chars() {
        let code = match c {
            '\n' => KeyCode::Enter,
            '\x1b' => KeyCode::Esc,
            '\t' => KeyCode::Tab,
            c => KeyCode::Char(c),
        };
        app.handle_key(key(code));
    }
}

/// An app over `model` (and `other`), plain theme.
pub fn app(model: Model, other: Option<Model>) -> App {
    App::new(model, other, Theme::plain())
}
