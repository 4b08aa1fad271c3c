//! The help overlay: every key, drawn over the current panel.

use super::theme::Theme;
use ratatui::buffer::Buffer;
use ratatui::layout::{Constraint, Rect};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Borders, Clear, Paragraph, Widget};

/// The keys and what they do, as listed in the overlay.
pub const KEYS: &[(&str, &str)] = &[
    ("q", "quit"),
    ("Esc", "close details / filter / help, else quit"),
    ("Tab S-Tab 1-5", "next / previous panel, or panel by number"),
    (
        "← →",
        "previous / next step (End: latest, follows a live run)",
    ),
    ("Home", "first step"),
    ("j k ↑ ↓", "scroll / move the selection"),
    ("PgUp PgDn g G", "page up / down, top / bottom"),
    ("/", "filter the ops by text (Ops)"),
    ("n N", "next / previous anomaly (op, step or differing op)"),
    ("f", "jump to the first non-finite op"),
    ("Enter", "op details: stats and exponent histogram (Ops)"),
    ("p", "layers by module or by parameter (Layers)"),
    ("?", "this help"),
];

/// Renders the help overlay centred over `area`.
pub struct HelpView {
    /// Styles.
    pub theme: Theme,
}

impl Widget for HelpView {
    fn render(self, area: Rect, buf: &mut Buffer) {
        let th = self.theme;
        let h = (KEYS.len() as u16 + 3).min(area.height);
        let w = 76u16.min(area.width);
        let r = area.centered(Constraint::Length(w), Constraint::Length(h));
        Clear.render(r, buf);
        let mut lines: Vec<Line> = KEYS
            .iter()
            .map(|(k, what)| {
                Line::from(vec![
                    Span::styled(format!(" {k:<15}"), th.accent()),
                    Span::raw(*what),
                ])
            })
            .collect();
        lines.push(Line::styled(" any key closes this help", th.dim()));
        Paragraph::new(lines)
            .block(
                Block::default()
                    .borders(Borders::ALL)
                    .title(Span::styled(" Keys ", th.accent())),
            )
            .render(r, buf);
    }
}
