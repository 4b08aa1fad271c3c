//! Styles of the UI, with a plain variant for terminals without colour.

use ratatui::style::{Color, Modifier, Style};

/// The styles every view draws with. Without colour only text attributes (bold, reversed)
/// are used, and every state a colour shows is also written out in text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Theme {
    /// Whether colours may be used.
    pub color: bool,
}

impl Theme {
    /// Colours on.
    pub fn colored() -> Theme {
        Theme { color: true }
    }

    /// No colours: attributes only.
    pub fn plain() -> Theme {
        Theme { color: false }
    }

    /// Colours unless the environment says the terminal has none: `NO_COLOR` set to
    /// anything non-empty (no-color.org), `TERM=dumb`, or no `TERM` at all.
    pub fn detect() -> Theme {
        Theme::from_env(
            std::env::var_os("NO_COLOR").as_deref(),
            std::env::var("TERM").ok().as_deref(),
        )
    }

    /// The rule of [`Theme::detect`] over given values of `NO_COLOR` and `TERM`.
    pub fn from_env(no_color: Option<&std::ffi::OsStr>, term: Option<&str>) -> Theme {
        let no_color = no_color.is_some_and(|v| !v.is_empty());
        let term = term.unwrap_or("");
        Theme {
            color: !no_color && !term.is_empty() && term != "dumb",
        }
    }

    fn fg(&self, c: Color) -> Style {
        if self.color {
            Style::new().fg(c)
        } else {
            Style::new()
        }
    }

    /// Text without emphasis.
    pub fn normal(&self) -> Style {
        Style::new()
    }

    /// Secondary text (labels, hints).
    pub fn dim(&self) -> Style {
        if self.color {
            Style::new().fg(Color::DarkGray)
        } else {
            Style::new()
        }
    }

    /// Headings and the active tab.
    pub fn accent(&self) -> Style {
        self.fg(Color::Cyan).add_modifier(Modifier::BOLD)
    }

    /// Non-finite values, failures, overflows.
    pub fn bad(&self) -> Style {
        self.fg(Color::Red).add_modifier(Modifier::BOLD)
    }

    /// Underflows, skipped steps, warnings.
    pub fn warn(&self) -> Style {
        self.fg(Color::Yellow)
    }

    /// A clean outcome.
    pub fn good(&self) -> Style {
        self.fg(Color::Green)
    }

    /// The selected row.
    pub fn selected(&self) -> Style {
        Style::new().add_modifier(Modifier::REVERSED)
    }

    /// Table headers.
    pub fn header(&self) -> Style {
        Style::new().add_modifier(Modifier::BOLD)
    }

    /// A first series in a chart (the loss scale, side A).
    pub fn series(&self) -> Style {
        self.fg(Color::Cyan)
    }

    /// A second series in a chart (the loss, side B).
    pub fn series2(&self) -> Style {
        self.fg(Color::Magenta)
    }
}
