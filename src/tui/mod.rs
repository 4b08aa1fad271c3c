//! The terminal UI: watch a run live or replay a trace, then walk the ops of the failing
//! step to the origin of its first Inf / NaN.
//!
//! Everything shown is built from trace records ([`crate::trace::Record`]), whether they
//! come from a file or from a run's live channel. [`model::Model`] holds the records and
//! answers questions about them; each panel is a state (owns its derived data, handles its
//! keys) and a view (renders the state); [`app::App`] ties them together and
//! [`app::run_loop`] drives it against a terminal.

pub mod app;
pub mod compare;
pub mod format;
pub mod help;
pub mod layers;
pub mod model;
pub mod ops;
pub mod overview;
pub mod scale;
pub mod theme;

pub use app::{run_loop, App, Feed, Input, Tab, TerminalSession};
pub use model::{Model, RunState};
pub use theme::Theme;
