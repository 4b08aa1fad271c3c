//! A small document model rendered both as Markdown (`summary.md`) and as a self-contained
//! HTML page (`index.html`, images embedded as base64 PNG), so the two always say the same.
//!
//! Text may hold two inline marks, as in Markdown: `` `code` `` and `**bold**`.

use crate::error::{Error, Result};
use base64::Engine as _;
use std::fmt::Write as _;
use std::path::Path;

/// One block of a document.
#[derive(Debug, Clone, PartialEq)]
pub enum Block {
    /// A heading of level 1–3.
    Heading(u8, String),
    /// A paragraph.
    Para(String),
    /// A paragraph set apart as a warning.
    Warning(String),
    /// A bulleted list.
    List(Vec<String>),
    /// A table: header cells and rows.
    Table(Vec<String>, Vec<Vec<String>>),
    /// A chart: its title and the file names of its PNG and SVG (relative to the
    /// document's folder).
    Image {
        /// Alt text and caption.
        title: String,
        /// PNG file name.
        png: String,
        /// SVG file name.
        svg: String,
    },
    /// Preformatted text.
    Code(String),
    /// Blocks shown collapsed under a one-line summary (`<details>` in Markdown and HTML).
    Details(String, Vec<Block>),
}

/// A document: a title and blocks.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Doc {
    /// Title (the page title and first heading).
    pub title: String,
    /// Blocks, in order.
    pub blocks: Vec<Block>,
}

fn md_cell(s: &str) -> String {
    s.replace('|', "\\|").replace('\n', " ")
}

impl Doc {
    /// A document titled `title`.
    pub fn new(title: impl Into<String>) -> Doc {
        Doc {
            title: title.into(),
            blocks: Vec::new(),
        }
    }

    /// Appends a block.
    pub fn push(&mut self, b: Block) {
        self.blocks.push(b);
    }

    /// Appends blocks.
    pub fn blocks_extend(&mut self, bs: impl IntoIterator<Item = Block>) {
        self.blocks.extend(bs);
    }

    /// The document as Markdown; images are linked (PNG, with the SVG beside it).
    pub fn to_markdown(&self) -> String {
        let mut o = format!("# {}\n\n", self.title);
        for b in &self.blocks {
            markdown_block(&mut o, b);
        }
        o
    }

    /// The document as one HTML page with its PNG images (read from `dir`) embedded, so the
    /// file can be moved or mailed alone.
    pub fn to_html(&self, dir: &Path) -> Result<String> {
        let mut o = String::new();
        let _ = write!(
            o,
            "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n\
             <title>{}</title>\n<style>{CSS}</style>\n</head>\n<body>\n<h1>{}</h1>\n",
            escape(&self.title),
            inline(&self.title)
        );
        for b in &self.blocks {
            html_block(&mut o, b, dir)?;
        }
        o.push_str("</body>\n</html>\n");
        Ok(o)
    }
}

/// Appends one block as Markdown.
fn markdown_block(o: &mut String, b: &Block) {
    match b {
        Block::Heading(l, t) => {
            // The title is the only level-1 heading.
            let _ = writeln!(o, "{} {t}\n", "#".repeat(usize::from((*l).clamp(1, 5)) + 1));
        }
        Block::Para(t) => {
            let _ = writeln!(o, "{t}\n");
        }
        Block::Warning(t) => {
            let _ = writeln!(o, "> **Warning.** {t}\n");
        }
        Block::List(items) => {
            for i in items {
                let _ = writeln!(o, "- {}", i.replace('\n', " "));
            }
            o.push('\n');
        }
        Block::Table(head, rows) => {
            let cells = |r: &[String]| r.iter().map(|c| md_cell(c)).collect::<Vec<_>>().join(" | ");
            let _ = writeln!(o, "| {} |", cells(head));
            let _ = writeln!(o, "|{}", "---|".repeat(head.len()));
            for r in rows {
                let _ = writeln!(o, "| {} |", cells(r));
            }
            o.push('\n');
        }
        Block::Image { title, png, svg } => {
            let _ = writeln!(o, "![{title}]({png})\n\n*{title}* ([SVG]({svg}))\n");
        }
        Block::Code(t) => {
            let _ = writeln!(o, "```\n{}\n```\n", t.trim_end());
        }
        Block::Details(summary, blocks) => {
            let _ = writeln!(o, "<details><summary>{}</summary>\n", escape(summary));
            for b in blocks {
                markdown_block(o, b);
            }
            o.push_str("</details>\n\n");
        }
    }
}

/// Appends one block as HTML (images read from `dir` and embedded).
fn html_block(o: &mut String, b: &Block, dir: &Path) -> Result<()> {
    match b {
        Block::Heading(l, t) => {
            let l = (*l).clamp(1, 6) + 1;
            let _ = writeln!(o, "<h{l}>{}</h{l}>", inline(t));
        }
        Block::Para(t) => {
            let _ = writeln!(o, "<p>{}</p>", inline(t));
        }
        Block::Warning(t) => {
            let _ = writeln!(
                o,
                "<p class=\"warn\"><strong>Warning.</strong> {}</p>",
                inline(t)
            );
        }
        Block::List(items) => {
            o.push_str("<ul>\n");
            for i in items {
                let _ = writeln!(o, "<li>{}</li>", inline(i));
            }
            o.push_str("</ul>\n");
        }
        Block::Table(head, rows) => {
            o.push_str("<table>\n<thead><tr>");
            for h in head {
                let _ = write!(o, "<th>{}</th>", inline(h));
            }
            o.push_str("</tr></thead>\n<tbody>\n");
            for r in rows {
                o.push_str("<tr>");
                for c in r {
                    let _ = write!(o, "<td>{}</td>", inline(c));
                }
                o.push_str("</tr>\n");
            }
            o.push_str("</tbody>\n</table>\n");
        }
        Block::Image { title, png, svg: _ } => {
            let path = dir.join(png);
            let bytes = std::fs::read(&path).map_err(|e| Error::io(&path, e))?;
            let b64 = base64::engine::general_purpose::STANDARD.encode(bytes);
            let _ = writeln!(
                o,
                "<figure><img alt=\"{t}\" src=\"data:image/png;base64,{b64}\">\
                 <figcaption>{t}</figcaption></figure>",
                t = escape(title)
            );
        }
        Block::Code(t) => {
            let _ = writeln!(o, "<pre>{}</pre>", escape(t.trim_end()));
        }
        Block::Details(summary, blocks) => {
            let _ = writeln!(o, "<details><summary>{}</summary>", inline(summary));
            for b in blocks {
                html_block(o, b, dir)?;
            }
            o.push_str("</details>\n");
        }
    }
    Ok(())
}

const CSS: &str = "body{font-family:system-ui,sans-serif;max-width:1250px;margin:2em auto;\
padding:0 1em;color:#222}table{border-collapse:collapse;margin:1em 0;font-size:.9em}\
th,td{border:1px solid #ccc;padding:.25em .6em;text-align:left}th{background:#f3f3f3}\
code{background:#f3f3f3;padding:0 .2em}pre{background:#f6f6f6;padding:.6em;overflow-x:auto}\
img{max-width:100%;border:1px solid #ddd}figure{margin:1em 0}figcaption{color:#555}\
.warn{background:#fff3cd;border-left:4px solid #e0a800;padding:.5em .8em}";

/// Escapes text for HTML.
pub fn escape(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => o.push_str("&amp;"),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '"' => o.push_str("&quot;"),
            '\'' => o.push_str("&#39;"),
            c => o.push(c),
        }
    }
    o
}

/// Escapes text and turns `` `code` `` and `**bold**` into HTML.
pub fn inline(s: &str) -> String {
    let mut o = String::new();
    for (i, part) in s.split('`').enumerate() {
        // An unmatched trailing backtick leaves an odd part count: its text stays plain.
        if i % 2 == 1 && i < s.split('`').count() - 1 {
            let _ = write!(o, "<code>{}</code>", escape(part));
        } else {
            if i % 2 == 1 {
                o.push('`');
            }
            for (j, seg) in part.split("**").enumerate() {
                if j % 2 == 1 && j < part.split("**").count() - 1 {
                    let _ = write!(o, "<strong>{}</strong>", escape(seg));
                } else {
                    if j % 2 == 1 {
                        o.push_str("**");
                    }
                    o.push_str(&escape(seg));
                }
            }
        }
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inline_marks() {
        assert_eq!(inline("a `x<y` b"), "a <code>x&lt;y</code> b");
        assert_eq!(inline("**v** & w"), "<strong>v</strong> &amp; w");
        assert_eq!(inline("odd ` tick"), "odd ` tick");
        assert_eq!(inline("odd ** star"), "odd ** star");
    }

    #[test]
    fn markdown_table_escapes_pipes() {
        let mut d = Doc::new("T");
        d.push(Block::Table(
            vec!["a".into(), "b".into()],
            vec![vec!["x|y".into(), "z".into()]],
        ));
        assert_eq!(
            d.to_markdown(),
            "# T\n\n| a | b |\n|---|---|\n| x\\|y | z |\n\n"
        );
    }
}
