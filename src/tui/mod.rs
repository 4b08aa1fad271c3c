//! Layer 12 of `amprobe::LAYERS`: may use layers 0–11 (`dtype` … `shrink`).
//!
//! The terminal UI: watch a run live or replay a trace, then walk the ops of the failing
//! step to the origin of its first Inf / NaN.
//!
//! Everything shown is built from trace records ([`crate::trace::Record`]), whether they
//! come from a file or from a run's live channel. [`view_model::Model`] holds the records and
//! answers questions about them; each panel is a state (owns its derived data, handles its
//! keys, draws through its view) driven through the [`panel::Panel`] trait; [`app::App`]
//! ties them together, a [`feed::Feed`] brings live records, and [`session::run_loop`]
//! drives it against a terminal.

pub mod app;
pub mod compare;
pub mod feed;
pub mod format;
pub mod help;
pub mod layers;
pub mod ops;
pub mod overview;
pub mod panel;
pub mod scale;
pub mod session;
pub mod theme;
pub mod view_model;

pub use app::{App, Outcome, Tab};
pub use feed::Feed;
pub use session::{run_loop, Input, TerminalInput, TerminalSession};
pub use theme::Theme;
pub use view_model::{Model, RunState};
