//! The event loop and the terminal session that is always restored (also on panic).

use super::app::App;
use super::feed::Feed;
use crate::error::{Error, Result};
use ratatui::backend::{Backend, CrosstermBackend};
use ratatui::crossterm::event::{self, Event};
use ratatui::crossterm::{cursor, execute, terminal as ct};
use ratatui::Terminal;
use std::io::{IsTerminal, Stdout};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, Once};
use std::thread::ThreadId;
use std::time::{Duration, Instant};

/// Data-driven redraws happen at most this often; a key press redraws at once.
pub const FRAME_INTERVAL: Duration = Duration::from_millis(100);
/// Longest wait for input before looking at the feed again.
const POLL_INTERVAL: Duration = Duration::from_millis(50);
/// Longest time spent taking records off the feed before input is looked at again.
const PUMP_BUDGET: Duration = Duration::from_millis(20);

/// Where terminal events come from (the real terminal, or a script in tests).
pub trait Input {
    /// Waits up to `timeout` for the next event; `None` when none came.
    fn next_event(&mut self, timeout: Duration) -> std::io::Result<Option<Event>>;
}

/// Events of the real terminal (crossterm).
pub struct TerminalInput;

impl Input for TerminalInput {
    fn next_event(&mut self, timeout: Duration) -> std::io::Result<Option<Event>> {
        if event::poll(timeout)? {
            Ok(Some(event::read()?))
        } else {
            Ok(None)
        }
    }
}

/// Runs the UI until the user quits: takes records from `feed`, redraws at most every
/// [`FRAME_INTERVAL`] for new data and at once for a key, polls input with a timeout so
/// that a busy feed never blocks it. `on_draw` is called after every draw (tests use it to
/// time key answers).
pub fn run_loop<B: Backend>(
    terminal: &mut Terminal<B>,
    app: &mut App,
    mut feed: Option<&mut Feed>,
    input: &mut dyn Input,
    on_draw: &mut dyn FnMut(&App),
) -> Result<()> {
    let term_err = |e: B::Error| Error::Invalid(format!("terminal: {e}"));
    let mut draw = |terminal: &mut Terminal<B>, app: &mut App| -> Result<Instant> {
        terminal.draw(|f| app.draw(f)).map_err(term_err)?;
        on_draw(app);
        Ok(Instant::now())
    };
    let mut last = draw(terminal, app)?;
    let mut dirty = false;
    while !app.should_quit() {
        if let Some(f) = feed.as_deref_mut() {
            dirty |= f.pump(app, PUMP_BUDGET);
        }
        if dirty && last.elapsed() >= FRAME_INTERVAL {
            last = draw(terminal, app)?;
            dirty = false;
        }
        let timeout = if dirty {
            FRAME_INTERVAL
                .saturating_sub(last.elapsed())
                .min(POLL_INTERVAL)
        } else {
            POLL_INTERVAL
        };
        let ev = input
            .next_event(timeout)
            .map_err(|e| Error::Invalid(format!("reading terminal input: {e}")))?;
        if let Some(ev) = ev {
            if app.handle_event(ev) && !app.should_quit() {
                last = draw(terminal, app)?;
                dirty = false;
            }
        }
    }
    Ok(())
}

/// True while a [`TerminalSession`] holds the terminal.
static ACTIVE: AtomicBool = AtomicBool::new(false);
/// The thread that drives the UI; a panic there restores the terminal first.
static UI_THREAD: Mutex<Option<ThreadId>> = Mutex::new(None);
static HOOK: Once = Once::new();

fn restore_terminal() {
    let _ = ct::disable_raw_mode();
    let _ = execute!(std::io::stdout(), ct::LeaveAlternateScreen, cursor::Show);
}

/// Installs (once) a panic hook that, while a session is active, restores the terminal
/// before a panic on the UI thread is reported, and keeps a panic on another thread (the
/// training worker) off the screen: that one is reported in the UI through the worker's
/// result instead.
fn install_panic_hook() {
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let ui = UI_THREAD.lock().ok().and_then(|g| *g);
            let on_ui = ui == Some(std::thread::current().id());
            if ACTIVE.load(Ordering::SeqCst) && !on_ui {
                return;
            }
            if on_ui && ACTIVE.swap(false, Ordering::SeqCst) {
                restore_terminal();
            }
            previous(info);
        }));
    });
}

/// The terminal in raw mode on the alternate screen; dropping it (also while unwinding
/// from a panic) puts the terminal back as it was.
pub struct TerminalSession {
    terminal: Terminal<CrosstermBackend<Stdout>>,
}

impl TerminalSession {
    /// Takes over the terminal. Fails with a clear message when stdin or stdout is not a
    /// terminal instead of drawing into a pipe.
    pub fn start() -> Result<TerminalSession> {
        if !std::io::stdout().is_terminal() {
            return Err(Error::Invalid(
                "amprobe tui needs a terminal, but its output is not one (redirected or piped); \
                 run it in a terminal, or use `amprobe run` for a plain summary"
                    .into(),
            ));
        }
        if !std::io::stdin().is_terminal() {
            return Err(Error::Invalid(
                "amprobe tui needs a terminal for keys, but its input is not one".into(),
            ));
        }
        install_panic_hook();
        if let Ok(mut g) = UI_THREAD.lock() {
            *g = Some(std::thread::current().id());
        }
        ct::enable_raw_mode().map_err(|e| Error::Invalid(format!("terminal raw mode: {e}")))?;
        ACTIVE.store(true, Ordering::SeqCst);
        fn setup() -> std::io::Result<TerminalSession> {
            execute!(std::io::stdout(), ct::EnterAlternateScreen, cursor::Hide)?;
            let mut terminal = Terminal::new(CrosstermBackend::new(std::io::stdout()))?;
            terminal.clear()?;
            Ok(TerminalSession { terminal })
        }
        setup().map_err(|e| {
            ACTIVE.store(false, Ordering::SeqCst);
            restore_terminal();
            Error::Invalid(format!("setting up the terminal: {e}"))
        })
    }

    /// The terminal to draw on.
    pub fn terminal(&mut self) -> &mut Terminal<CrosstermBackend<Stdout>> {
        &mut self.terminal
    }
}

impl Drop for TerminalSession {
    fn drop(&mut self) {
        // Only once: leaving the alternate screen twice would move the cursor back to
        // where the session started, over what was printed since (a panic message).
        if ACTIVE.swap(false, Ordering::SeqCst) {
            restore_terminal();
        }
    }
}
