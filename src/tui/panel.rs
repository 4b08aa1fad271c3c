//! What every panel shares: the [`Panel`] trait the app drives them through, the selected
//! step, a panel's answer to a key, and what a view needs besides its own state.

use super::theme::Theme;
use super::view_model::Model;
use ratatui::buffer::Buffer;
use ratatui::crossterm::event::KeyEvent;
use ratatui::layout::Rect;

/// What a panel sees of the app: the run's records, the compared run's, the styles.
#[derive(Clone, Copy)]
pub struct Scene<'a> {
    /// The run (live or replayed).
    pub model: &'a Model,
    /// The run it is compared with, if any.
    pub other: Option<&'a Model>,
    /// Styles.
    pub theme: Theme,
}

impl<'a> Scene<'a> {
    /// The view context of the selected step.
    pub fn ctx(&self, step: Option<usize>) -> Ctx<'a> {
        Ctx {
            model: self.model,
            step,
            theme: self.theme,
        }
    }
}

/// One panel of the UI: its own state (derived data, selection), its keys, its drawing.
pub trait Panel {
    /// Brings derived data up to date with the records and the selected step (before keys
    /// and drawing); nothing by default.
    fn sync(&mut self, _scene: &Scene<'_>, _step: Option<usize>) {}
    /// Answers a key the app did not take; may move the shared step cursor.
    fn handle_key(&mut self, key: KeyEvent, scene: &Scene<'_>, cursor: &mut StepCursor) -> Reply;
    /// Draws the panel for the selected step.
    fn render(&self, scene: &Scene<'_>, step: Option<usize>, area: Rect, buf: &mut Buffer);
}

/// The selected step, shared by every panel.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepCursor {
    /// Index into [`Model::steps`]; `None` before the first step.
    pub idx: Option<usize>,
    /// Track the newest step as steps arrive (live runs, until the user moves).
    pub follow: bool,
}

impl StepCursor {
    /// Selects the step at index `i` and stops following.
    pub fn set(&mut self, i: usize) {
        self.idx = Some(i);
        self.follow = false;
    }
}

/// What a panel did with a key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// Not a key of this panel.
    Ignored,
    /// Handled.
    Handled,
    /// Handled, with a note for the status bar.
    Message(String),
}

/// What a view needs besides its panel's state.
#[derive(Clone, Copy)]
pub struct Ctx<'a> {
    /// The run's records.
    pub model: &'a Model,
    /// Index of the selected step.
    pub step: Option<usize>,
    /// Styles.
    pub theme: Theme,
}
