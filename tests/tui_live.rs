//! Live mode: keys answered within 100 ms while a worker trains, runs that end or fail are
//! shown as such, a growing trace is followed, and a trace cut mid-line opens and says so.

mod tui_fixture;

use amprobe::config::RunConfig;
use amprobe::runner::RunOptions;
use amprobe::trace::io::read_trace;
use amprobe::trace::record::Record;
use amprobe::tui::app::Tab;
use amprobe::tui::session::{run_loop, Input};
use amprobe::tui::view_model::SourceKind;
use amprobe::tui::{App, Feed, Model, RunState, Theme};
use ratatui::crossterm::event::{Event, KeyCode};
use std::collections::VecDeque;
use std::io::Write;
use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tui_fixture::*;

/// Starts the configured run on a worker thread and feeds its records to the UI, as the
/// CLI's `tui CONFIG` does (the UI itself only follows a stream).
fn spawn_run(cfg: RunConfig, opts: RunOptions) -> Feed {
    Feed::spawn(move |tx| {
        let opts = RunOptions {
            live: Some(tx),
            progress: false,
            ..opts
        };
        amprobe::runner::run(&cfg, &opts)
            .map(|s| Some(s.verdict.to_string()))
            .map_err(|e| e.to_string())
    })
    .unwrap()
}

/// Tests that train in the background take turns: they time responses on 2 cores.
static HEAVY: Mutex<()> = Mutex::new(());

/// Keys pressed at planned times after the start.
struct Script {
    start: Instant,
    plan: VecDeque<(Duration, KeyCode)>,
    pressed: Vec<(Instant, KeyCode)>,
}

impl Input for Script {
    fn next_event(&mut self, timeout: Duration) -> std::io::Result<Option<Event>> {
        let now = Instant::now();
        match self.plan.front().copied() {
            Some((at, code)) if self.start + at <= now => {
                self.plan.pop_front();
                // The key counts as pressed when it was due, not when it was read.
                self.pressed.push((self.start + at, code));
                Ok(Some(Event::Key(key(code))))
            }
            Some((at, _)) => {
                std::thread::sleep(timeout.min(self.start + at - now));
                Ok(None)
            }
            None => {
                std::thread::sleep(timeout);
                Ok(None)
            }
        }
    }
}

/// An MLP big enough that a step takes milliseconds, with every step overflowing at first.
fn busy_config(steps: u64) -> RunConfig {
    let mut cfg = RunConfig::default();
    cfg.model.kind = Some("mlp".into());
    cfg.model.inputs = Some(512);
    cfg.model.hidden = Some(2048);
    cfg.model.classes = Some(10);
    cfg.data.batch = Some(64);
    cfg.train.precision = Some("fp16".into());
    cfg.train.steps = Some(steps);
    cfg.scaler.init_scale = Some(1e30);
    cfg
}

#[test]
fn keys_are_answered_within_100ms_while_the_worker_trains() {
    let _turn = HEAVY.lock().unwrap_or_else(|e| e.into_inner());
    let steps = 400;
    let feed = spawn_run(busy_config(steps), RunOptions::default());
    let mut feed = feed;
    let mut app = App::new(
        Model::waiting("busy", SourceKind::Live),
        None,
        Theme::plain(),
    );
    let tabs = [
        (KeyCode::Char('2'), Tab::Scale),
        (KeyCode::Char('3'), Tab::Layers),
        (KeyCode::Char('4'), Tab::Ops),
        (KeyCode::Char('1'), Tab::Overview),
    ];
    let mut plan = VecDeque::new();
    let mut at = Duration::from_millis(800);
    for round in 0..3 {
        for (k, _) in tabs {
            plan.push_back((at, k));
            at += Duration::from_millis(130 + 20 * round);
        }
    }
    plan.push_back((at, KeyCode::Char('q')));
    let mut input = Script {
        start: Instant::now(),
        plan,
        pressed: Vec::new(),
    };
    let mut draws: Vec<(Instant, Tab, usize, RunState)> = Vec::new();
    let mut term = terminal(80, 24);
    run_loop(
        &mut term,
        &mut app,
        Some(&mut feed),
        &mut input,
        &mut |a: &App| {
            draws.push((
                Instant::now(),
                a.tab(),
                a.model().steps.len(),
                a.model().state.clone(),
            ))
        },
    )
    .unwrap();
    let want: Vec<Tab> = (0..3).flat_map(|_| tabs.map(|t| t.1)).collect();
    assert_eq!(input.pressed.len(), want.len() + 1);
    let mut steps_seen = Vec::new();
    for ((pressed, _), tab) in input.pressed.iter().zip(&want) {
        let (drawn, _, n, state) = draws
            .iter()
            .find(|d| d.0 >= *pressed && d.1 == *tab)
            .unwrap_or_else(|| panic!("{tab:?} was never drawn"));
        let latency = drawn.duration_since(*pressed);
        assert!(
            latency <= Duration::from_millis(100),
            "{tab:?} drawn {latency:?} after its key"
        );
        assert_eq!(*state, RunState::Running, "the worker was still training");
        steps_seen.push(*n);
    }
    // Steps kept arriving between the keys: the UI ran beside the training.
    assert!(steps_seen.first() < steps_seen.last(), "{steps_seen:?}");
    assert!((*steps_seen.last().unwrap() as u64) < steps);
    // Data redraws are spaced by at least the frame interval, except right after a key.
    let key_times: Vec<Instant> = input.pressed.iter().map(|p| p.0).collect();
    for w in draws.windows(2) {
        let gap = w[1].0.duration_since(w[0].0);
        let after_key = key_times
            .iter()
            .any(|&k| k <= w[1].0 && w[1].0.duration_since(k) < Duration::from_millis(100));
        assert!(
            gap >= Duration::from_millis(95) || after_key,
            "two data redraws {gap:?} apart"
        );
    }
}

/// Takes records until the feed ends (at most 60 s).
fn drain(feed: &mut Feed, app: &mut App) {
    let t0 = Instant::now();
    while !feed.is_done() {
        feed.pump(app, Duration::from_millis(20));
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the feed never ended"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_live_run_that_ends_is_shown_finished() {
    let _turn = HEAVY.lock().unwrap_or_else(|e| e.into_inner());
    let mut cfg = RunConfig::load(Path::new("samples/mlp.toml")).unwrap();
    cfg.train.steps = Some(5);
    let mut feed = spawn_run(cfg, RunOptions::default());
    let mut app = App::new(
        Model::waiting("samples/mlp.toml", SourceKind::Live),
        None,
        Theme::plain(),
    );
    assert_eq!(app.model().state, RunState::Waiting);
    let s = screen(&draw(&mut app, 80, 24));
    assert!(s.contains("waiting for the run"), "{s}");
    drain(&mut feed, &mut app);
    let m = app.model();
    assert_eq!(m.state, RunState::Finished);
    assert_eq!(m.steps.len(), 5);
    // The live channel ends with the run's end record.
    assert_eq!(
        m.end.as_ref().map(|e| (e.steps, e.verdict.as_str())),
        Some((5, "clean"))
    );
    assert_eq!(m.verdict(), ("clean".to_string(), true));
    // The cursor followed the steps to the last one.
    assert_eq!(app.cursor().idx, Some(4));
    let s = screen(&draw(&mut app, 80, 24));
    assert!(
        s.contains("live samples/mlp.toml · finished · 5 steps"),
        "{s}"
    );
    insta::assert_snapshot!("live_finished_overview_80x24", s);
}

#[test]
fn a_live_run_that_fails_is_shown_failed() {
    let dir = tempfile::tempdir().unwrap();
    let (trace, _) = planted_trace(dir.path());
    let recs: Vec<Record> = std::iter::once(Record::Header(trace.header.clone()))
        .chain(trace.steps.iter().take(2).cloned().map(Record::Step))
        .collect();
    let mut feed = Feed::spawn(move |tx| {
        for r in recs {
            tx.send(r).map_err(|e| e.to_string())?;
        }
        Err("model: weights file truncated at tensor fc2.weight".into())
    })
    .unwrap();
    let mut app = App::new(
        Model::waiting("cfg.toml", SourceKind::Live),
        None,
        Theme::plain(),
    );
    drain(&mut feed, &mut app);
    assert_eq!(app.model().steps.len(), 2);
    assert_eq!(
        app.model().state,
        RunState::Failed("model: weights file truncated at tensor fc2.weight".into())
    );
    let s = screen(&draw(&mut app, 80, 24));
    assert!(s.contains("FAILED: model: weights file truncated"), "{s}");
    insta::assert_snapshot!("live_failed_overview_80x24", s);
}

#[test]
fn a_worker_that_panics_is_a_failed_run() {
    let mut feed = Feed::spawn(|_tx| panic!("index out of bounds in the test worker")).unwrap();
    let mut app = App::new(
        Model::waiting("cfg.toml", SourceKind::Live),
        None,
        Theme::plain(),
    );
    drain(&mut feed, &mut app);
    match &app.model().state {
        RunState::Failed(e) => {
            assert!(
                e.contains("panicked") && e.contains("index out of bounds"),
                "{e}"
            )
        }
        other => panic!("expected a failed run, got {other:?}"),
    }
}

#[test]
fn a_trace_cut_mid_line_opens_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let (_, path) = planted_trace(dir.path());
    let bytes = std::fs::read(&path).unwrap();
    // Cut the file in the middle of its last step line (the end record dropped too).
    let lines: Vec<usize> = bytes
        .iter()
        .enumerate()
        .filter(|(_, &b)| b == b'\n')
        .map(|(i, _)| i)
        .collect();
    let (prev, last_step_end) = (lines[lines.len() - 3], lines[lines.len() - 2]);
    // A fixed 300 bytes of that line (its length varies with the written times).
    assert!(last_step_end - prev > 600);
    let cut = prev + 1 + 300;
    let cut_path = dir.path().join("cut.jsonl");
    std::fs::write(&cut_path, &bytes[..cut]).unwrap();
    let mut t = read_trace(&cut_path).unwrap();
    let tr = t.truncated.expect("a truncation");
    assert_eq!(tr.line, 5, "header + 3 whole steps, the 4th step cut");
    assert_eq!(tr.bytes, 300);
    normalise(&mut t);
    let mut app = app(Model::from_trace(t, "cut.jsonl"), None);
    assert_eq!(app.model().steps.len(), 3);
    assert_eq!(app.model().state, RunState::Incomplete);
    let s = screen(&draw(&mut app, 80, 24));
    assert!(s.contains("TRUNCATED: line 5 cut"), "{s}");
    assert!(s.contains("cut mid-line: line 5"), "{s}");
    insta::assert_snapshot!("truncated_overview_80x24", s);
}

#[test]
fn a_growing_trace_is_followed_to_its_end() {
    let dir = tempfile::tempdir().unwrap();
    let (_, path) = planted_trace(dir.path());
    let bytes = std::fs::read(&path).unwrap();
    let nl: Vec<usize> = bytes
        .iter()
        .enumerate()
        .filter(|(_, &b)| b == b'\n')
        .map(|(i, _)| i)
        .collect();
    // Start with the header and one step plus half of the next line.
    let live = dir.path().join("live.jsonl");
    let first = nl[1] + 1;
    let half = first + (nl[2] - first) / 2;
    std::fs::write(&live, &bytes[..half]).unwrap();
    let mut feed = Feed::follow(live.clone(), Duration::from_millis(10)).unwrap();
    let mut app = App::new(
        Model::waiting("live.jsonl", SourceKind::Follow),
        None,
        Theme::plain(),
    );
    let t0 = Instant::now();
    while app.model().steps.is_empty() {
        feed.pump(&mut app, Duration::from_millis(20));
        assert!(t0.elapsed() < Duration::from_secs(10));
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(50));
    feed.pump(&mut app, Duration::from_millis(20));
    // The half line is held back until its newline arrives.
    assert_eq!(app.model().steps.len(), 1);
    assert_eq!(app.model().state, RunState::Running);
    let s = screen(&draw(&mut app, 80, 24));
    assert!(s.contains("follow live.jsonl · following · 1 steps"), "{s}");
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(&live)
        .unwrap();
    f.write_all(&bytes[half..]).unwrap();
    drop(f);
    drain(&mut feed, &mut app);
    assert_eq!(app.model().steps.len(), 4);
    assert_eq!(app.model().state, RunState::Finished);
    assert_eq!(app.model().verdict().0, "forward-nonfinite");
}
