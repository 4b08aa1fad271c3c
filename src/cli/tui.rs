//! `amprobe tui CONFIG [run flags]` (train on a worker thread and watch it live),
//! `amprobe tui --trace FILE` (replay a recorded trace; `--follow` to watch it grow) and
//! `amprobe tui [--trace FILE] -- CMD ARGS...` (run a PyTorch script that calls
//! `amprobe_torch.watch` and watch its trace grow).

use super::run::{apply_flags, RunFlags};
use super::script::{Script, TraceFollower, POLL};
use amprobe::config::RunConfig;
use amprobe::runner::{run as run_training, RunOptions};
use amprobe::trace::io::read_trace;
use amprobe::tui::session::{run_loop, Input, TerminalInput};
use amprobe::tui::view_model::SourceKind;
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

impl Keys {
    /// The terminal's keys, with the panic key of `PANIC_KEY_VAR` when it is set.
    fn from_env() -> Self {
        Keys {
            panic_key: std::env::var(PANIC_KEY_VAR)
                .ok()
                .and_then(|v| v.chars().next()),
        }
    }
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
                  `amprobe run`; without CONFIG, --trace names the trace to replay. After \
                  `--`, a PyTorch script that calls amprobe_torch.watch is run and watched: \
                  --trace is where its trace goes (default amprobe-trace.jsonl), its output \
                  goes next to it (TRACE.log)."
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
    /// A PyTorch training script to run and watch live (after `--`), which calls
    /// `amprobe_torch.watch(...)` (only --trace, --sample-every, --compare and --no-color
    /// apply).
    #[arg(last = true, value_name = "CMD", conflicts_with_all = ["config", "follow"])]
    command: Vec<String>,
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
    if !a.command.is_empty() {
        let other = a.compare.as_deref().map(load).transpose()?;
        return run_script(&a, other, theme);
    }
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
            &mut Keys::from_env(),
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

/// `tui -- CMD`: the script runs with its trace at --trace (and its output in TRACE.log, off
/// the screen), and the UI follows the trace as it grows. Leaving the UI stops the script.
fn run_script(a: &TuiArgs, other: Option<Model>, theme: Theme) -> anyhow::Result<i32> {
    if a.flags.configures_training() || a.flags.summary_json.is_some() {
        bail!(
            "a script given after `--` trains itself: only --trace (where its trace goes), \
             --sample-every, --compare and --no-color apply to `tui -- CMD`"
        );
    }
    let trace = a
        .flags
        .trace
        .clone()
        .unwrap_or_else(|| PathBuf::from("amprobe-trace.jsonl"));
    let mut script = Script::new(&a.command, &trace)?;
    script.sample_every = a.flags.sample_every;
    let log = script.trace.with_extension("log");
    script.log = Some(log.clone());
    let mut app = App::new(
        Model::waiting(script.label(), SourceKind::Live),
        other,
        theme,
    );
    let mut session = TerminalSession::start()?;
    let running = script.start()?;
    let child = running.child();
    let mut follower = TraceFollower::new(&script.trace);
    let s = script.clone();
    let mut feed = Feed::spawn(move |tx| loop {
        let exited = child.try_wait().map_err(|e| e.to_string())?;
        for r in follower.read_new().map_err(|e| e.to_string())? {
            if tx.send(r).is_err() {
                return Ok(None);
            }
        }
        match exited {
            Some(st) if !st.success() => {
                return Err(format!(
                    "`{}` failed ({st}); its output is in {}",
                    s.label(),
                    log.display()
                ))
            }
            Some(st) if !s.trace.exists() => {
                return Err(format!(
                    "`{}` wrote no trace ({st}): does it call amprobe_torch.watch? Its output \
                     is in {}",
                    s.label(),
                    log.display()
                ))
            }
            Some(_) => return Ok(None),
            None => std::thread::sleep(POLL),
        }
    })?;
    run_loop(
        session.terminal(),
        &mut app,
        Some(&mut feed),
        &mut Keys::from_env(),
        &mut |_| {},
    )?;
    drop(session);
    let stopped = running.child().stop()?;
    drop(running);
    let m = app.model();
    if let RunState::Failed(e) = &m.state {
        eprintln!("error: {e}");
        return Ok(1);
    }
    if stopped {
        eprintln!(
            "amprobe tui: left while `{}` was at step {}; it was stopped ({} keeps the finished \
             steps)",
            script.label(),
            m.steps.len(),
            script.trace.display()
        );
    }
    Ok(0)
}
