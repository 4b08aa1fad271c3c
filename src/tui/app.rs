//! The application: the panels' states, the shared step cursor, key dispatch and drawing.

use super::compare::CompareState;
use super::format::{clip, rpad};
use super::help::HelpView;
use super::layers::LayersState;
use super::ops::OpsState;
use super::overview::OverviewState;
use super::panel::{Panel, Reply, Scene, StepCursor};
use super::scale::ScaleState;
use super::theme::Theme;
use super::view_model::{Model, RunState, SourceKind};
use crate::trace::record::Record;
use ratatui::crossterm::event::{Event, KeyCode, KeyEvent, KeyEventKind, KeyModifiers};
use ratatui::layout::{Constraint, Layout};
use ratatui::text::{Line, Span};
use ratatui::widgets::Paragraph;
use ratatui::Frame;

/// The panels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tab {
    /// Run, verdict, first Inf / NaN card, progress.
    Overview,
    /// Loss-scale history and loss curve.
    Scale,
    /// Per-layer gradient magnitudes.
    Layers,
    /// Every op of the selected step.
    Ops,
    /// Two traces side by side.
    Compare,
}

impl Tab {
    /// Every panel in key order (1-5).
    pub const ALL: [Tab; 5] = [
        Tab::Overview,
        Tab::Scale,
        Tab::Layers,
        Tab::Ops,
        Tab::Compare,
    ];

    /// The panel's name on its tab.
    pub fn title(self) -> &'static str {
        match self {
            Tab::Overview => "Overview",
            Tab::Scale => "Scale",
            Tab::Layers => "Layers",
            Tab::Ops => "Ops",
            Tab::Compare => "Compare",
        }
    }
}

/// The whole UI state: the model(s), the panels' states, the selected panel and step.
pub struct App {
    model: Model,
    other: Option<Model>,
    theme: Theme,
    tab: Tab,
    cursor: StepCursor,
    overview: OverviewState,
    scale: ScaleState,
    layers: LayersState,
    ops: OpsState,
    compare: CompareState,
    help: bool,
    message: Option<String>,
    quit: bool,
}

impl App {
    /// An app over `model`, optionally compared with `other`. A replay opens on the step of
    /// the first non-finite op (else the last step); a live model follows the newest step.
    pub fn new(model: Model, other: Option<Model>, theme: Theme) -> App {
        let live = model.source != SourceKind::Replay;
        let idx = if live {
            model.steps.len().checked_sub(1)
        } else {
            model
                .first_nonfinite()
                .map(|(s, _)| s)
                .or(model.steps.len().checked_sub(1))
        };
        App {
            model,
            other,
            theme,
            tab: Tab::Overview,
            cursor: StepCursor { idx, follow: live },
            overview: OverviewState::default(),
            scale: ScaleState,
            layers: LayersState::default(),
            ops: OpsState::default(),
            compare: CompareState::default(),
            help: false,
            message: None,
            quit: false,
        }
    }

    /// The run's records.
    pub fn model(&self) -> &Model {
        &self.model
    }

    /// The second trace, when comparing.
    pub fn other(&self) -> Option<&Model> {
        self.other.as_ref()
    }

    /// The selected panel.
    pub fn tab(&self) -> Tab {
        self.tab
    }

    /// The selected step.
    pub fn cursor(&self) -> StepCursor {
        self.cursor
    }

    /// The Ops panel's state.
    pub fn ops(&self) -> &OpsState {
        &self.ops
    }

    /// The Layers panel's state.
    pub fn layers(&self) -> &LayersState {
        &self.layers
    }

    /// The Compare panel's state.
    pub fn compare(&self) -> &CompareState {
        &self.compare
    }

    /// True while the help overlay is shown.
    pub fn help_open(&self) -> bool {
        self.help
    }

    /// The note shown in the status bar, if any.
    pub fn message(&self) -> Option<&str> {
        self.message.as_deref()
    }

    /// True once the user asked to quit.
    pub fn should_quit(&self) -> bool {
        self.quit
    }

    /// Panels on offer: Compare only with a second trace.
    pub fn tabs(&self) -> Vec<Tab> {
        Tab::ALL
            .into_iter()
            .filter(|&t| t != Tab::Compare || self.other.is_some())
            .collect()
    }

    /// Adds a record that arrived from the feed.
    pub fn push(&mut self, rec: Record) {
        self.model.push(rec);
        if self.cursor.follow || self.cursor.idx.is_none() {
            self.cursor.idx = self.model.steps.len().checked_sub(1);
        }
    }

    /// Records how the feed ended (see [`Model::finish`]).
    pub fn finish(&mut self, outcome: std::result::Result<Option<String>, String>) {
        self.model.finish(outcome);
    }

    fn move_step(&mut self, delta: isize) {
        let n = self.model.steps.len();
        if n == 0 {
            return;
        }
        let cur = self.cursor.idx.unwrap_or(n - 1) as isize;
        let next = (cur + delta).clamp(0, n as isize - 1) as usize;
        self.cursor.set(next);
        if next == n - 1 && delta > 0 && self.model.source != SourceKind::Replay {
            self.cursor.follow = true;
        }
    }

    /// Selects the first non-finite op of the run in the Ops panel.
    pub fn jump_to_first_nonfinite(&mut self) {
        match self.model.first_nonfinite() {
            Some((s, p)) => {
                self.tab = Tab::Ops;
                self.ops.select(&self.model, &mut self.cursor, s, p);
                let o = &self.model.steps[s].ops.as_deref().unwrap_or(&[])[p];
                self.message = Some(format!(
                    "first non-finite: step {} #{} {}",
                    self.model.steps[s].step,
                    o.index,
                    super::format::op_at(&o.op, &o.module)
                ));
            }
            None => self.message = Some("no non-finite op in the steps so far".into()),
        }
    }

    /// Handles one terminal event; returns true when the screen should be redrawn.
    pub fn handle_event(&mut self, ev: Event) -> bool {
        match ev {
            Event::Key(k) => self.handle_key(k),
            Event::Resize(..) => true,
            _ => false,
        }
    }

    /// Handles one key; returns true when something may have changed.
    pub fn handle_key(&mut self, key: KeyEvent) -> bool {
        if key.kind == KeyEventKind::Release {
            return false;
        }
        self.message = None;
        if self.help {
            self.help = false;
            if key.code == KeyCode::Char('q') {
                self.quit = true;
            }
            return true;
        }
        if key.modifiers.contains(KeyModifiers::CONTROL) && key.code == KeyCode::Char('c') {
            self.quit = true;
            return true;
        }
        if self.tab == Tab::Ops && self.ops.editing() {
            let r = self.ops.handle_key(key, &self.model, &mut self.cursor);
            return self.reply(r);
        }
        let tabs = self.tabs();
        let pos = tabs.iter().position(|&t| t == self.tab).unwrap_or(0);
        match key.code {
            KeyCode::Char('q') => self.quit = true,
            KeyCode::Char('?') => self.help = true,
            KeyCode::Tab => self.tab = tabs[(pos + 1) % tabs.len()],
            KeyCode::BackTab => self.tab = tabs[(pos + tabs.len() - 1) % tabs.len()],
            KeyCode::Char(c @ '1'..='5') => {
                let t = Tab::ALL[c as usize - '1' as usize];
                if tabs.contains(&t) {
                    self.tab = t;
                } else {
                    self.message = Some("Compare needs a second trace (--compare FILE)".into());
                }
            }
            KeyCode::Left => self.move_step(-1),
            KeyCode::Right => self.move_step(1),
            KeyCode::Home => self.move_step(isize::MIN / 2),
            KeyCode::End => {
                self.move_step(isize::MAX / 2);
                self.cursor.follow = self.model.source != SourceKind::Replay;
            }
            KeyCode::Char('f') => self.jump_to_first_nonfinite(),
            _ => {
                let r = self.panel_key(key);
                if r == Reply::Ignored && key.code == KeyCode::Esc {
                    self.quit = true;
                    return true;
                }
                return self.reply(r);
            }
        }
        true
    }

    fn reply(&mut self, r: Reply) -> bool {
        match r {
            Reply::Ignored => false,
            Reply::Handled => true,
            Reply::Message(m) => {
                self.message = Some(m);
                true
            }
        }
    }

    fn panel_key(&mut self, key: KeyEvent) -> Reply {
        let scene = Scene {
            model: &self.model,
            other: self.other.as_ref(),
            theme: self.theme,
        };
        let panel: &mut dyn Panel = match self.tab {
            Tab::Overview => &mut self.overview,
            Tab::Scale => &mut self.scale,
            Tab::Layers => &mut self.layers,
            Tab::Ops => &mut self.ops,
            Tab::Compare => &mut self.compare,
        };
        panel.handle_key(key, &scene, &mut self.cursor)
    }

    fn tab_line(&self, width: usize) -> Line<'static> {
        let th = self.theme;
        let mut spans = vec![Span::styled(" amprobe ", th.accent())];
        for t in self.tabs() {
            let n = Tab::ALL.iter().position(|&x| x == t).unwrap_or(0) + 1;
            if t == self.tab {
                spans.push(Span::styled(format!("[{n} {}]", t.title()), th.selected()));
            } else {
                spans.push(Span::styled(format!(" {n} {} ", t.title()), th.dim()));
            }
        }
        let used: usize = spans.iter().map(|s| s.content.chars().count()).sum();
        let step = match self
            .cursor
            .idx
            .and_then(|i| self.model.steps.get(i).map(|s| (i, s)))
        {
            Some((i, s)) => format!(
                "step {} · {}/{}{} ",
                s.step,
                i + 1,
                self.model.steps.len(),
                if self.cursor.follow { " ▶" } else { "" }
            ),
            None => "no step ".into(),
        };
        spans.push(Span::raw(rpad(&step, width.saturating_sub(used))));
        Line::from(spans)
    }

    fn status_line(&self, width: usize) -> Line<'static> {
        let th = self.theme;
        let m = &self.model;
        let kind = match m.source {
            SourceKind::Replay => "replay",
            SourceKind::Live => "live",
            SourceKind::Follow => "follow",
        };
        let (state, style) = match &m.state {
            RunState::Waiting => ("waiting for the run".to_string(), th.dim()),
            RunState::Running if m.source == SourceKind::Follow => {
                (format!("following · {} steps", m.steps.len()), th.accent())
            }
            RunState::Running => (
                match m.expected_steps() {
                    Some(t) => format!("running · {}/{t} steps", m.steps.len()),
                    None => format!("running · {} steps", m.steps.len()),
                },
                th.accent(),
            ),
            RunState::Finished => (format!("finished · {} steps", m.steps.len()), th.good()),
            RunState::Incomplete => (
                format!("no end record · {} steps", m.steps.len()),
                th.warn(),
            ),
            RunState::Failed(e) => (format!("FAILED: {e}"), th.bad()),
        };
        let right = match &self.message {
            Some(msg) => Span::styled(format!(" {msg} "), th.accent()),
            None => Span::styled(" ? help · q quit ".to_string(), th.dim()),
        };
        // A cut trace says so before anything else about its state.
        let (state, style) = match m.truncated {
            Some(t) => (
                format!("TRUNCATED: line {} cut · {} steps", t.line, m.steps.len()),
                th.warn(),
            ),
            None => (state, style),
        };
        let left = vec![
            (format!(" {kind} "), th.dim()),
            (
                format!("{} · ", super::format::clip_left(&m.label, 28)),
                th.normal(),
            ),
            (state, style),
        ];
        // A message gets the room it needs (up to 3/5 of the line) before the state does.
        let right_w = super::format::width(&right.content).min(width * 3 / 5);
        let mut room = width.saturating_sub(right_w);
        let mut spans = Vec::new();
        for (text, style) in left {
            let t = clip(&text, room);
            room -= super::format::width(&t);
            spans.push(Span::styled(t, style));
        }
        let used: usize = spans.iter().map(|s| s.content.chars().count()).sum();
        let room = width.saturating_sub(used);
        spans.push(Span::styled(
            rpad(&clip(&right.content, room), room),
            right.style,
        ));
        Line::from(spans)
    }

    /// Draws the whole screen into `frame`.
    pub fn draw(&mut self, frame: &mut Frame) {
        let area = frame.area();
        let [top, body, bottom] = Layout::vertical([
            Constraint::Length(1),
            Constraint::Min(1),
            Constraint::Length(1),
        ])
        .areas(area);
        frame.render_widget(Paragraph::new(self.tab_line(area.width as usize)), top);
        let scene = Scene {
            model: &self.model,
            other: self.other.as_ref(),
            theme: self.theme,
        };
        let step = self.cursor.idx;
        // The ops and compare panels keep rows for the selected step, which a key on
        // another panel may have moved.
        Panel::sync(&mut self.ops, &scene, step);
        Panel::sync(&mut self.compare, &scene, step);
        let panel: &dyn Panel = match self.tab {
            Tab::Overview => &self.overview,
            Tab::Scale => &self.scale,
            Tab::Layers => &self.layers,
            Tab::Ops => &self.ops,
            Tab::Compare => &self.compare,
        };
        panel.render(&scene, step, body, frame.buffer_mut());
        frame.render_widget(
            Paragraph::new(self.status_line(area.width as usize)),
            bottom,
        );
        if self.help {
            frame.render_widget(HelpView { theme: self.theme }, body);
        }
    }
}

/// How a feed ended: the run's verdict (if it has one), or the error that stopped it.
pub type Outcome = std::result::Result<Option<String>, String>;
