//! Each panel of the terminal UI drawn on a test backend at 80×24 and 160×48 over traces
//! of real runs (snapshots), and the keys that move through them.

mod tui_fixture;

use amprobe::trace::record::Phase;
use amprobe::tui::app::Tab;
use amprobe::tui::view_model::is_anomaly;
use ratatui::crossterm::event::KeyCode;
use tui_fixture::*;

const SIZES: [(u16, u16); 2] = [(80, 24), (160, 48)];

fn snap(name: &str, app: &mut amprobe::tui::App) {
    for (w, h) in SIZES {
        let t = draw(app, w, h);
        insta::assert_snapshot!(format!("{name}_{w}x{h}"), screen(&t));
    }
}

#[test]
fn overview_shows_the_first_nan_card() {
    let dir = tempfile::tempdir().unwrap();
    let (trace, _) = planted_trace(dir.path());
    // The first op of step 1 whose output holds a NaN, found in the records themselves.
    let nan = trace.steps[1]
        .ops
        .as_ref()
        .unwrap()
        .iter()
        .find(|o| o.stats.nan > 0)
        .unwrap()
        .clone();
    let mut app = app(
        amprobe::tui::Model::from_trace(trace, "planted.jsonl"),
        None,
    );
    assert_eq!(app.tab(), Tab::Overview);
    let t = draw(&mut app, 80, 24);
    let s = screen(&t);
    // The planted Inf is the first Inf; the NaN follows it in the same step.
    assert!(s.contains("first Inf step 1 · fwd #7 linear @ fc2"), "{s}");
    let want = format!(
        "first NaN step 1 · {} #{} {} @ {}",
        amprobe::tui::format::phase(nan.phase),
        nan.index,
        nan.op,
        nan.module
    );
    assert!(s.contains(&want), "{want}\n{s}");
    assert!(s.contains("FORWARD-NONFINITE"), "{s}");
    snap("overview_planted", &mut app);
}

#[test]
fn overview_of_overflow_run() {
    let dir = tempfile::tempdir().unwrap();
    let mut app = app(overflow_model(dir.path()), None);
    snap("overview_overflow", &mut app);
}

#[test]
fn scale_panel_marks_skips_on_a_log2_axis() {
    let dir = tempfile::tempdir().unwrap();
    let mut app = app(overflow_model(dir.path()), None);
    type_keys(&mut app, "2");
    assert_eq!(app.tab(), Tab::Scale);
    let s = screen(&draw(&mut app, 80, 24));
    // Scales fall from 2^24 to 2^18: the axis is labelled in powers of two over that range.
    assert!(s.contains("2^24") && s.contains("2^18"), "{s}");
    assert!(s.contains("steps 0-5, 9") || s.contains("steps 0-3"), "{s}");
    snap("scale_overflow", &mut app);
    // n walks the anomalous (skipped) steps: 0 → 1 … 5 → 9.
    app.handle_key(key(KeyCode::Home));
    let mut visited = vec![app.cursor().idx.unwrap()];
    for _ in 0..6 {
        type_keys(&mut app, "n");
        visited.push(app.cursor().idx.unwrap());
    }
    assert_eq!(visited, vec![0, 1, 2, 3, 4, 5, 9]);
    type_keys(&mut app, "n");
    assert!(app.message().unwrap().contains("no anomalous step after"));
    type_keys(&mut app, "N");
    assert_eq!(app.cursor().idx, Some(5));
}

#[test]
fn layers_panel_per_layer_and_per_parameter() {
    let dir = tempfile::tempdir().unwrap();
    let mut app = app(overflow_model(dir.path()), None);
    type_keys(&mut app, "3");
    // Step 7: applied, finite gradients.
    app.handle_key(key(KeyCode::Home));
    for _ in 0..7 {
        app.handle_key(key(KeyCode::Right));
    }
    assert_eq!(app.cursor().idx, Some(7));
    snap("layers_step7", &mut app);
    type_keys(&mut app, "p");
    assert!(app.layers().by_param);
    snap("layers_step7_params", &mut app);
}

#[test]
fn ops_jump_to_the_first_nonfinite_op() {
    let dir = tempfile::tempdir().unwrap();
    let (trace, _) = planted_trace(dir.path());
    // The planted op, found independently in the step's op records.
    let planted = trace.steps[1]
        .ops
        .as_ref()
        .unwrap()
        .iter()
        .find(|o| o.phase == Phase::Forward && o.op == "linear" && o.module == "fc2")
        .unwrap()
        .index;
    let mut app = app(
        amprobe::tui::Model::from_trace(trace, "planted.jsonl"),
        None,
    );
    // Start elsewhere: step 3, Scale panel.
    type_keys(&mut app, "2");
    app.handle_key(key(KeyCode::End));
    assert_eq!(app.cursor().idx, Some(3));
    type_keys(&mut app, "f");
    assert_eq!(app.tab(), Tab::Ops);
    assert_eq!(app.cursor().idx, Some(1));
    let op = app.ops().selected_op(app.model(), Some(1)).unwrap();
    assert_eq!(op.index, planted);
    assert!(op.stats.pos_inf > 0);
    snap("ops_first_nonfinite", &mut app);
    // Enter: the details of that op.
    type_keys(&mut app, "\n");
    assert!(app.ops().details_open());
    let s = screen(&draw(&mut app, 80, 24));
    assert!(s.contains("first Inf of step 1"), "{s}");
    assert!(s.contains("exponent histogram"), "{s}");
    snap("ops_details", &mut app);
    // Esc closes the details, not the app.
    type_keys(&mut app, "\x1b");
    assert!(!app.ops().details_open() && !app.should_quit());
}

#[test]
fn ops_next_and_previous_anomaly_cross_steps() {
    let dir = tempfile::tempdir().unwrap();
    let mut app = app(overflow_model(dir.path()), None);
    type_keys(&mut app, "4");
    app.handle_key(key(KeyCode::Home));
    type_keys(&mut app, "g");
    let mut seen = Vec::new();
    for _ in 0..40 {
        type_keys(&mut app, "n");
        let s = app.cursor().idx.unwrap();
        let op = app.ops().selected_op(app.model(), Some(s)).unwrap();
        assert!(is_anomaly(op), "n stopped on a clean op {op:?}");
        seen.push((s, op.index));
    }
    // Strictly forward through (step, op) order, into later steps.
    assert!(seen.windows(2).all(|w| w[0] < w[1]), "{seen:?}");
    assert!(seen.last().unwrap().0 > 0);
    let last = *seen.last().unwrap();
    type_keys(&mut app, "N");
    let s = app.cursor().idx.unwrap();
    let back = (
        s,
        app.ops().selected_op(app.model(), Some(s)).unwrap().index,
    );
    assert_eq!(back, seen[seen.len() - 2]);
    assert!(back < last);
}

#[test]
fn ops_filter_by_text() {
    let dir = tempfile::tempdir().unwrap();
    let mut app = app(planted_model(dir.path()), None);
    type_keys(&mut app, "4");
    app.handle_key(key(KeyCode::Home));
    type_keys(&mut app, "/bwd fc1\n");
    assert!(!app.ops().editing());
    assert_eq!(app.ops().filter(), "bwd fc1");
    let ops = app.model().ops(0).unwrap().to_vec();
    let rows = app.ops().rows().to_vec();
    let expected: Vec<usize> = (0..ops.len())
        .filter(|&i| ops[i].phase == Phase::Backward && ops[i].module == "fc1")
        .collect();
    assert!(!expected.is_empty());
    assert_eq!(rows, expected);
    snap("ops_filtered", &mut app);
    // Typing goes to the filter, not to the panels: "q" does not quit while editing.
    type_keys(&mut app, "/q");
    assert!(!app.should_quit());
    assert_eq!(app.ops().filter(), "bwd fc1q");
    type_keys(&mut app, "\x1b");
    assert_eq!(app.ops().filter(), "");
    assert_eq!(app.ops().rows().len(), ops.len());
}

#[test]
fn ops_of_a_step_without_records() {
    let dir = tempfile::tempdir().unwrap();
    let mut app = app(overflow_model(dir.path()), None);
    type_keys(&mut app, "4");
    app.handle_key(key(KeyCode::Home));
    for _ in 0..6 {
        app.handle_key(key(KeyCode::Right));
    }
    // Step 6 is clean and not sampled (every 4th): no op records.
    assert!(app.model().steps[6].ops.is_none());
    let s = screen(&draw(&mut app, 80, 24));
    assert!(s.contains("were not kept"), "{s}");
}

#[test]
fn compare_two_traces() {
    let dir = tempfile::tempdir().unwrap();
    let a = overflow_model(dir.path());
    let b = overflow_fp32_model(dir.path());
    let mut app = app(a, Some(b));
    type_keys(&mut app, "5");
    assert_eq!(app.tab(), Tab::Compare);
    app.handle_key(key(KeyCode::Home));
    let s = screen(&draw(&mut app, 80, 24));
    assert!(s.contains("(fp16)") && s.contains("(fp32)"), "{s}");
    snap("compare_step0", &mut app);
    // n selects a row present on both sides whose values differ.
    type_keys(&mut app, "n");
    let row = app.compare().rows()[app.compare().selected()];
    assert!(row.a.is_some() && row.b.is_some());
    let oa = &app.model().ops(0).unwrap()[row.a.unwrap()];
    let ob = &app.other().unwrap().ops(0).unwrap()[row.b.unwrap()];
    let (sa, sb) = (&app.model().steps[0], &app.other().unwrap().steps[0]);
    assert!(amprobe::tui::compare::difference(oa, sa, ob, sb).is_some());
}

#[test]
fn compare_tab_needs_a_second_trace() {
    let dir = tempfile::tempdir().unwrap();
    let mut app = app(planted_model(dir.path()), None);
    assert_eq!(app.tabs().len(), 4);
    type_keys(&mut app, "5");
    assert_eq!(app.tab(), Tab::Overview);
    assert!(app.message().unwrap().contains("--compare"));
    // Tab cycles over the four panels and back.
    let mut order = Vec::new();
    for _ in 0..4 {
        type_keys(&mut app, "\t");
        order.push(app.tab());
    }
    assert_eq!(
        order,
        vec![Tab::Scale, Tab::Layers, Tab::Ops, Tab::Overview]
    );
    app.handle_key(key(KeyCode::BackTab));
    assert_eq!(app.tab(), Tab::Ops);
}

#[test]
fn help_overlay_lists_the_keys() {
    let dir = tempfile::tempdir().unwrap();
    let mut app = app(planted_model(dir.path()), None);
    type_keys(&mut app, "?");
    assert!(app.help_open());
    let s = screen(&draw(&mut app, 80, 24));
    for k in ["q", "Tab", "/", "n N", "Enter", "?"] {
        assert!(s.contains(&format!(" {k}")), "{k} missing:\n{s}");
    }
    insta::assert_snapshot!("help_80x24", s);
    // Any key closes the help without acting; q then quits.
    type_keys(&mut app, "4");
    assert!(!app.help_open());
    assert_eq!(app.tab(), Tab::Overview);
    type_keys(&mut app, "q");
    assert!(app.should_quit());
}

#[test]
fn esc_quits_when_nothing_is_open() {
    let dir = tempfile::tempdir().unwrap();
    let mut app = app(planted_model(dir.path()), None);
    type_keys(&mut app, "\x1b");
    assert!(app.should_quit());
}

#[test]
fn every_panel_draws_at_any_size() {
    let dir = tempfile::tempdir().unwrap();
    let mut app = app(
        overflow_model(dir.path()),
        Some(overflow_fp32_model(dir.path())),
    );
    let sizes = [
        (1, 1),
        (10, 3),
        (20, 5),
        (40, 10),
        (60, 15),
        (80, 24),
        (100, 30),
        (200, 60),
    ];
    for tab in "12345".chars() {
        for details in [false, true] {
            type_keys(&mut app, &tab.to_string());
            if details && tab == '4' {
                type_keys(&mut app, "\n");
            }
            for (w, h) in sizes {
                let t = draw(&mut app, w, h);
                assert_eq!(t.backend().buffer().area.width, w);
            }
            if details && tab == '4' {
                type_keys(&mut app, "\n");
            }
        }
    }
    // Resizing one terminal redraws cleanly at the new size.
    let mut t = terminal(80, 24);
    t.draw(|f| app.draw(f)).unwrap();
    t.backend_mut().resize(120, 40);
    t.draw(|f| app.draw(f)).unwrap();
    let s = screen(&t);
    assert_eq!(s.lines().count(), 40);
    assert!(s.lines().all(|l| l.chars().count() == 120));
}

#[test]
fn plain_theme_draws_no_colour() {
    use ratatui::style::Color;
    let dir = tempfile::tempdir().unwrap();
    for (theme, expect_colour) in [
        (amprobe::tui::Theme::plain(), false),
        (amprobe::tui::Theme::colored(), true),
    ] {
        let mut app = amprobe::tui::App::new(planted_model(dir.path()), None, theme);
        let mut coloured = 0;
        for tab in "1234".chars() {
            type_keys(&mut app, &tab.to_string());
            let t = draw(&mut app, 80, 24);
            coloured += t
                .backend()
                .buffer()
                .content
                .iter()
                .filter(|c| c.fg != Color::Reset || c.bg != Color::Reset)
                .count();
        }
        assert_eq!(
            coloured > 0,
            expect_colour,
            "{theme:?}: {coloured} coloured cells"
        );
    }
}

#[test]
fn theme_follows_no_color_and_term() {
    use amprobe::tui::Theme;
    use std::ffi::OsStr;
    assert!(Theme::from_env(None, Some("xterm-256color")).color);
    assert!(!Theme::from_env(Some(OsStr::new("1")), Some("xterm")).color);
    // NO_COLOR set but empty does not count (no-color.org).
    assert!(Theme::from_env(Some(OsStr::new("")), Some("xterm")).color);
    assert!(!Theme::from_env(None, Some("dumb")).color);
    assert!(!Theme::from_env(None, None).color);
}

/// A trace shaped like a transformer's: the planted run's step ops repeated over 24
/// blocks with dotted module paths (600+ ops per step) and 96 parameters.
fn transformer_like(dir: &std::path::Path) -> amprobe::tui::Model {
    let (mut t, _) = planted_trace(dir);
    for s in &mut t.steps {
        if let Some(ops) = s.ops.take() {
            let mut big = Vec::new();
            for b in 0..24 {
                for o in &ops {
                    let mut o = o.clone();
                    o.module = format!("encoder.block.{b}.layer.1.DenseReluDense.{}", o.module);
                    o.index = big.len() as u64;
                    big.push(o);
                }
            }
            s.op_count = big.len() as u64;
            s.ops = Some(big);
        }
        let params = std::mem::take(&mut s.params);
        for b in 0..24 {
            for p in &params {
                let mut p = p.clone();
                p.name = format!("encoder.block.{b}.layer.1.DenseReluDense.{}", p.name);
                s.params.push(p);
            }
        }
        s.origins = Default::default();
    }
    amprobe::tui::Model::from_trace(t, "t5-like.jsonl")
}

#[test]
fn a_large_trace_with_dotted_paths_draws_quickly_and_clips_paths() {
    let dir = tempfile::tempdir().unwrap();
    let model = transformer_like(dir.path());
    assert_eq!(model.ops(1).unwrap().len(), 24 * 28);
    let mut app = app(model.clone(), Some(model));
    app.handle_key(key(KeyCode::Home));
    app.handle_key(key(KeyCode::Right));
    for tab in "12345".chars() {
        type_keys(&mut app, &tab.to_string());
        for (w, h) in [(80, 24), (200, 60)] {
            let t0 = std::time::Instant::now();
            let t = draw(&mut app, w, h);
            let ms = t0.elapsed().as_secs_f64() * 1e3;
            assert!(ms < 50.0, "panel {tab} at {w}x{h} took {ms:.1} ms");
            let s = screen(&t);
            if tab == '3' && w == 80 {
                // Long module paths keep their block numbers and their last segment.
                assert!(s.contains("e.b.0.l.1.DRD.fc1"), "{s}");
                assert!(s.contains("e.b.1.l.1.DRD.fc2"), "{s}");
            }
        }
    }
    // Without origins the jump still finds the first non-finite op (scan).
    type_keys(&mut app, "f");
    assert_eq!(app.tab(), Tab::Ops);
    let s = app.cursor().idx.unwrap();
    let op = app.ops().selected_op(app.model(), Some(s)).unwrap();
    assert_eq!((s, op.index), (1, 7));
    // The same step compared with itself: nothing differs.
    type_keys(&mut app, "5");
    assert_eq!(app.compare().rows().len(), 24 * 28);
    type_keys(&mut app, "n");
    assert!(app.message().unwrap().contains("no differing op"));
}

#[test]
fn a_trace_without_steps_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let (mut t, _) = planted_trace(dir.path());
    t.steps.clear();
    t.end = None;
    let mut app = app(amprobe::tui::Model::from_trace(t, "empty.jsonl"), None);
    assert_eq!(app.cursor().idx, None);
    let s = screen(&draw(&mut app, 80, 24));
    assert!(s.contains("no step yet"), "{s}");
    for tab in "234".chars() {
        type_keys(&mut app, &tab.to_string());
        let s = screen(&draw(&mut app, 80, 24));
        assert!(s.contains("the trace has no step"), "{tab}: {s}");
    }
    // Keys that need a step do nothing harmful.
    for k in [
        KeyCode::Left,
        KeyCode::Right,
        KeyCode::End,
        KeyCode::Char('n'),
        KeyCode::Char('f'),
    ] {
        app.handle_key(key(k));
    }
    assert_eq!(app.cursor().idx, None);
}

#[test]
fn ops_of_a_blamed_step_show_the_error_each_introduces() {
    let dir = tempfile::tempdir().unwrap();
    let (t, _) = trace(
        dir.path(),
        "blamed",
        |c| {
            c.train.precision = Some("fp16".into());
            c.train.steps = Some(1);
            c.probe.blame = Some(true);
        },
        vec![],
    );
    let ops = t.steps[0].ops.clone().unwrap();
    let mut app = app(amprobe::tui::Model::from_trace(t, "blamed.jsonl"), None);
    type_keys(&mut app, "4");
    app.handle_key(key(KeyCode::Home));
    let s = screen(&draw(&mut app, 160, 48));
    assert!(s.contains("intro"), "{s}");
    // The first forward op's introduced error, as the column writes it.
    let b = ops[0].blame.unwrap();
    let want = if b.introduced == 0.0 {
        "0".to_string()
    } else {
        format!("{:.1e}", b.introduced)
    };
    let first_row = s.lines().find(|l| l.contains("#0 ")).unwrap();
    assert!(first_row.trim_end().ends_with(&want), "{want}\n{s}");
    // Its details say all of its blame.
    app.handle_key(key(KeyCode::Enter));
    let s = screen(&draw(&mut app, 160, 48));
    let line = s
        .lines()
        .find(|l| l.contains("vs f64"))
        .unwrap_or_else(|| panic!("{s}"));
    assert!(
        line.contains(&format!("introduced {:.2e}", b.introduced))
            && line.contains(&format!("total {:.2e}", b.total)),
        "{line}"
    );
    // A step without blame keeps the old columns.
    let mut plain = app_of_planted(dir.path());
    let s = screen(&draw(&mut plain, 160, 48));
    assert!(!s.contains("intro"), "{s}");
}

fn app_of_planted(dir: &std::path::Path) -> amprobe::tui::App {
    let mut a = app(planted_model(dir), None);
    type_keys(&mut a, "4");
    a.handle_key(key(KeyCode::Home));
    a
}
