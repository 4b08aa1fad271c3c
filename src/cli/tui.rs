//! `amprobe tui CONFIG [run flags]` (train on a worker thread and watch it live) and
//! `amprobe tui --trace FILE` (replay a recorded trace; `--follow` to watch it grow).

use super::run::{apply_flags, RunFlags};
use amprobe::config::RunConfig;
use amprobe::runner::{run as run_training, RunOptions};
use amprobe::trace::io::read_trace;
use amprobe::tui::model::SourceKind;
use amprobe::tui::session::{run_loop, Input, TerminalInput};
use amprobe::tui::{App, Feed, Model, RunState, TerminalSession, Theme};
use anyhow::{bail, Context};
use clap::Args;
use ratatui::crossterm::event::{Event, KeyCode};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Test hook: with `AMPROBE_TUI_PANIC_KEY=c` set, pressing `c` panics on the UI thread, so
/// that scripts can check the terminal is restored after a panic.
const PANIC_KEY_VAR: &str = "AMPROBE_TUI_PANIC_KEY";

struct Keys {
    panic_key: Option<char>,
}

impl Input for Keys {
    fn next_event(&mut self, timeout: Duration) -> std::io::Result<Option<Event>> {
        let ev = TerminalInput.next_event(timeout)?;
        if let (Some(Event::Key(k)), Some(c)) = (&ev, self.panic_key) {
            if k.code == KeyCode::Char(c) {
                panic!("{PANIC_KEY_VAR}: key `{c}` pressed");
            }
        }
        Ok(ev)
    }
}

/// Arguments of `amprobe tui`.
#[derive(Args, Debug)]
#[command(
    about = "Watch a run live (CONFIG) or replay a trace (--trace FILE) in a terminal UI",
    after_help = "With CONFIG, every run flag applies and --trace writes the trace as in \
                  `amprobe run`; without CONFIG, --trace names the trace to replay."
)]
pub struct TuiArgs {
    /// Run configuration (TOML) to train live; omit it to replay --trace FILE.
    config: Option<PathBuf>,
    #[command(flatten)]
    flags: RunFlags,
    /// A second trace to compare with, step by step (the Compare panel).
    #[arg(long, value_name = "FILE")]
    compare: Option<PathBuf>,
    /// Keep reading the replayed trace as another process appends to it.
    #[arg(long, conflicts_with = "config")]
    follow: bool,
    /// No colours (also when NO_COLOR is set or TERM is dumb).
    #[arg(long)]
    no_color: bool,
}

fn load(path: &Path) -> anyhow::Result<Model> {
    let trace = read_trace(path).with_context(|| format!("reading trace {}", path.display()))?;
    Ok(Model::from_trace(trace, path.display().to_string()))
}

pub fn run(a: TuiArgs) -> anyhow::Result<i32> {
    let theme = if a.no_color {
        Theme::plain()
    } else {
        Theme::detect()
    };
    if a.config.is_none() && a.flags.configures_a_run() {
        eprintln!("error: run flags need a <CONFIG> to train live; `tui --trace FILE` replays a trace as it is");
        return Ok(2);
    }
    let other = a.compare.as_deref().map(load).transpose()?;
    let (model, mut feed, trace_out) = match (&a.config, &a.flags.trace) {
        (Some(config), _) => {
            let mut cfg = RunConfig::load(config)?;
            apply_flags(&mut cfg, &a.flags);
            // Checked here so that a bad config fails before the screen is taken over.
            cfg.train_config()?;
            let summary_path = cfg.probe.summary_json.clone();
            let trace_out = cfg.probe.trace.clone();
            let opts = RunOptions {
                command_line: std::env::args().collect(),
                ..RunOptions::default()
            };
            let feed = Feed::spawn(move |tx| {
                let opts = RunOptions {
                    live: Some(tx),
                    ..opts
                };
                let summary = run_training(&cfg, &opts).map_err(|e| e.to_string())?;
                if let Some(p) = summary_path {
                    let text = serde_json::to_string_pretty(&summary).map_err(|e| e.to_string())?;
                    std::fs::write(&p, text + "\n")
                        .map_err(|e| format!("writing summary {}: {e}", p.display()))?;
                }
                Ok(Some(summary.verdict.to_string()))
            })?;
            let label = config.display().to_string();
            (
                Model::waiting(label, SourceKind::Live),
                Some(feed),
                trace_out,
            )
        }
        (None, Some(trace)) if a.follow => {
            let feed = Feed::follow(trace.clone(), Duration::from_millis(200))?;
            let label = trace.display().to_string();
            (Model::waiting(label, SourceKind::Follow), Some(feed), None)
        }
        (None, Some(trace)) => (load(trace)?, None, None),
        (None, None) => bail!(
            "give a CONFIG to train and watch live, or --trace FILE to replay a trace \
             (see amprobe tui --help)"
        ),
    };
    let mut app = App::new(model, other, theme);
    {
        let mut session = TerminalSession::start()?;
        run_loop(
            session.terminal(),
            &mut app,
            feed.as_mut(),
            &mut Keys {
                panic_key: std::env::var(PANIC_KEY_VAR)
                    .ok()
                    .and_then(|v| v.chars().next()),
            },
            &mut |_| {},
        )?;
    }
    let m = app.model();
    match &m.state {
        RunState::Failed(e) => {
            eprintln!("error: the run failed: {e}");
            return Ok(1);
        }
        RunState::Running | RunState::Waiting if m.source == SourceKind::Live => {
            eprintln!(
                "amprobe tui: left while the run was at step {}{}; the run was stopped{}",
                m.steps.len(),
                m.expected_steps()
                    .map_or(String::new(), |t| format!(" of {t}")),
                trace_out.map_or(String::new(), |p| format!(
                    " ({} keeps the finished steps)",
                    p.display()
                ))
            );
        }
        _ => {}
    }
    Ok(0)
}
