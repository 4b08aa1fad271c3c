//! Shared helpers of the report tests: MLP traces made through the library, and a small
//! SVG reader.
#![allow(dead_code)]

use amprobe::config::RunConfig;
use amprobe::engine::Injection;
use amprobe::runner::{run, RunOptions};
use amprobe::trace::record::Phase;
use std::path::{Path, PathBuf};

/// Runs the seed MLP for `steps` steps in `precision` with `injections`, after `edit`
/// changed the config, and returns the trace path `dir/NAME.jsonl`.
pub fn mlp_trace(
    dir: &Path,
    name: &str,
    precision: &str,
    steps: u64,
    injections: Vec<Injection>,
    edit: impl FnOnce(&mut RunConfig),
) -> PathBuf {
    let mut cfg = RunConfig::load(Path::new("samples/mlp.toml")).unwrap();
    cfg.train.precision = Some(precision.to_string());
    cfg.train.steps = Some(steps);
    let path = dir.join(format!("{name}.jsonl"));
    cfg.probe.trace = Some(path.clone());
    edit(&mut cfg);
    let opts = RunOptions {
        command_line: vec!["amprobe-test".into()],
        injections,
        ..RunOptions::default()
    };
    run(&cfg, &opts).unwrap();
    path
}

/// An Inf written into the output of `op` in `module` at `step`, in `phase`.
pub fn inject(step: u64, op: &str, module: &str, phase: Phase, value: f32) -> Injection {
    Injection {
        step: Some(step),
        op: op.into(),
        module: module.into(),
        phase,
        value,
    }
}

/// An SVG file parsed into the elements the tests look at.
pub struct Svg {
    pub text: String,
}

/// One `<text>` element: its content (trimmed), position and anchor.
#[derive(Debug, Clone)]
pub struct SvgText {
    pub content: String,
    pub x: f64,
    pub y: f64,
    pub anchor: String,
}

fn num(n: &roxmltree::Node, a: &str) -> f64 {
    n.attribute(a)
        .and_then(|v| v.parse().ok())
        .unwrap_or(f64::NAN)
}

fn points(s: &str) -> Vec<(f64, f64)> {
    s.split_whitespace()
        .filter_map(|p| {
            let (x, y) = p.split_once(',')?;
            Some((x.parse().ok()?, y.parse().ok()?))
        })
        .collect()
}

impl Svg {
    pub fn open(path: &Path) -> Svg {
        Svg {
            text: std::fs::read_to_string(path).unwrap(),
        }
    }

    fn doc(&self) -> roxmltree::Document<'_> {
        roxmltree::Document::parse(&self.text).expect("well-formed SVG")
    }

    /// (width, height) of the root element.
    pub fn size(&self) -> (f64, f64) {
        let d = self.doc();
        let r = d.root_element();
        (num(&r, "width"), num(&r, "height"))
    }

    pub fn texts(&self) -> Vec<SvgText> {
        self.doc()
            .descendants()
            .filter(|n| n.has_tag_name("text"))
            .map(|n| SvgText {
                content: n.text().unwrap_or("").trim().to_string(),
                x: num(&n, "x"),
                y: num(&n, "y"),
                anchor: n.attribute("text-anchor").unwrap_or("").to_string(),
            })
            .collect()
    }

    /// The text element whose content is exactly `s`.
    pub fn text_exact(&self, s: &str) -> Option<SvgText> {
        self.texts().into_iter().find(|t| t.content == s)
    }

    /// True when some text element contains `s`.
    pub fn has_text(&self, s: &str) -> bool {
        self.texts().iter().any(|t| t.content.contains(s))
    }

    /// Centres of `<circle>`s filled with `fill` (e.g. `#1F77B4`), in document order.
    pub fn circles(&self, fill: &str) -> Vec<(f64, f64)> {
        self.doc()
            .descendants()
            .filter(|n| n.has_tag_name("circle") && n.attribute("fill") == Some(fill))
            .map(|n| (num(&n, "cx"), num(&n, "cy")))
            .collect()
    }

    /// Points of `<polyline>`s stroked with `stroke`.
    pub fn polylines(&self, stroke: &str) -> Vec<Vec<(f64, f64)>> {
        self.doc()
            .descendants()
            .filter(|n| n.has_tag_name("polyline") && n.attribute("stroke") == Some(stroke))
            .map(|n| points(n.attribute("points").unwrap_or("")))
            .collect()
    }

    /// Points of `<polygon>`s filled with `fill`.
    pub fn polygons(&self, fill: &str) -> Vec<Vec<(f64, f64)>> {
        self.doc()
            .descendants()
            .filter(|n| n.has_tag_name("polygon") && n.attribute("fill") == Some(fill))
            .map(|n| points(n.attribute("points").unwrap_or("")))
            .collect()
    }

    /// `(x, y, w, h)` of `<rect>`s filled with `fill`.
    pub fn rects(&self, fill: &str) -> Vec<(f64, f64, f64, f64)> {
        self.doc()
            .descendants()
            .filter(|n| n.has_tag_name("rect") && n.attribute("fill") == Some(fill))
            .map(|n| {
                (
                    num(&n, "x"),
                    num(&n, "y"),
                    num(&n, "width"),
                    num(&n, "height"),
                )
            })
            .collect()
    }

    /// `(x1, y1, x2, y2)` of `<line>`s stroked with `stroke`.
    pub fn lines(&self, stroke: &str) -> Vec<(f64, f64, f64, f64)> {
        self.doc()
            .descendants()
            .filter(|n| n.has_tag_name("line") && n.attribute("stroke") == Some(stroke))
            .map(|n| (num(&n, "x1"), num(&n, "y1"), num(&n, "x2"), num(&n, "y2")))
            .collect()
    }
}

/// Width and height stored in a PNG's IHDR chunk.
pub fn png_size(path: &Path) -> (u32, u32) {
    let b = std::fs::read(path).unwrap();
    assert_eq!(&b[..8], b"\x89PNG\r\n\x1a\n", "{} is a PNG", path.display());
    assert_eq!(&b[12..16], b"IHDR");
    let w = u32::from_be_bytes([b[16], b[17], b[18], b[19]]);
    let h = u32::from_be_bytes([b[20], b[21], b[22], b[23]]);
    (w, h)
}
