//! What every panel shares: the selected step, a panel's answer to a key, and what a view
//! needs besides its own state.

use super::model::Model;
use super::theme::Theme;

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
