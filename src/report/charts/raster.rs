//! PNG text laid out as the SVG's: plotters' bitmap text drops each glyph's side bearing
//! and rounds its pen position and vertical offset separately per glyph, so letters sit
//! unevenly ("en coder") and small glyphs such as dots land a pixel off the baseline. This
//! backend wraps the bitmap backend and draws text itself: glyph positions kept in
//! fractional pixels along one baseline (kerning included), coverage anti-aliased, at the
//! em size the SVG's `font-size` gives (`size / 1.24`), with the SVG's anchors (`0.76em`
//! below a top anchor, half an x-height for a centred or bottom one). Everything else is
//! the wrapped backend's.

use crate::error::{Error, Result};
use ab_glyph::{point, Font, FontRef, GlyphId, PxScale, ScaleFont};
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, VPos};
use plotters_backend::{
    BackendColor, BackendCoord, BackendStyle, BackendTextStyle, DrawingErrorKind,
};

/// The SVG backend writes `font-size` as the style's size divided by this.
const SVG_EM_DIVISOR: f64 = 1.24;

/// A backend whose text is laid out like the SVG's (see the module docs).
pub struct TextBackend<DB> {
    inner: DB,
    regular: FontRef<'static>,
    bold: FontRef<'static>,
}

/// A line of text laid out: its font, scale, glyphs at their pen positions, and width.
struct Line<'f> {
    font: &'f FontRef<'static>,
    scale: PxScale,
    em: f32,
    glyphs: Vec<(GlyphId, f32)>,
    width: f32,
}

impl<DB: DrawingBackend> TextBackend<DB> {
    /// Wraps `inner`, drawing text in the embedded DejaVu Sans.
    pub fn new(inner: DB) -> Result<Self> {
        let font = |b: &'static [u8]| {
            FontRef::try_from_slice(b)
                .map_err(|_| Error::Invalid("embedded DejaVu Sans: not a valid font file".into()))
        };
        Ok(TextBackend {
            inner,
            regular: font(dejavu::sans::regular())?,
            bold: font(dejavu::sans::bold())?,
        })
    }

    fn layout<S: BackendTextStyle>(&self, text: &str, style: &S) -> Line<'_> {
        let font = match style.style() {
            FontStyle::Bold => &self.bold,
            _ => &self.regular,
        };
        let em = (style.size() / SVG_EM_DIVISOR) as f32;
        let upem = font.units_per_em().unwrap_or(2048.0);
        let scale = PxScale::from(em * font.height_unscaled() / upem);
        let sf = font.as_scaled(scale);
        let mut pen = 0f32;
        let mut prev = None;
        let mut glyphs = Vec::with_capacity(text.len());
        for c in text.chars() {
            let id = sf.glyph_id(c);
            if let Some(p) = prev {
                pen += sf.kern(p, id);
            }
            glyphs.push((id, pen));
            pen += sf.h_advance(id);
            prev = Some(id);
        }
        Line {
            font,
            scale,
            em,
            glyphs,
            width: pen,
        }
    }
}

impl<DB: DrawingBackend> DrawingBackend for TextBackend<DB> {
    type ErrorType = DB::ErrorType;

    fn get_size(&self) -> (u32, u32) {
        self.inner.get_size()
    }

    fn ensure_prepared(&mut self) -> std::result::Result<(), DrawingErrorKind<Self::ErrorType>> {
        self.inner.ensure_prepared()
    }

    fn present(&mut self) -> std::result::Result<(), DrawingErrorKind<Self::ErrorType>> {
        self.inner.present()
    }

    fn draw_pixel(
        &mut self,
        point: BackendCoord,
        color: BackendColor,
    ) -> std::result::Result<(), DrawingErrorKind<Self::ErrorType>> {
        self.inner.draw_pixel(point, color)
    }

    fn draw_line<S: BackendStyle>(
        &mut self,
        from: BackendCoord,
        to: BackendCoord,
        style: &S,
    ) -> std::result::Result<(), DrawingErrorKind<Self::ErrorType>> {
        self.inner.draw_line(from, to, style)
    }

    fn draw_rect<S: BackendStyle>(
        &mut self,
        upper_left: BackendCoord,
        bottom_right: BackendCoord,
        style: &S,
        fill: bool,
    ) -> std::result::Result<(), DrawingErrorKind<Self::ErrorType>> {
        self.inner.draw_rect(upper_left, bottom_right, style, fill)
    }

    fn draw_path<S: BackendStyle, I: IntoIterator<Item = BackendCoord>>(
        &mut self,
        path: I,
        style: &S,
    ) -> std::result::Result<(), DrawingErrorKind<Self::ErrorType>> {
        self.inner.draw_path(path, style)
    }

    fn draw_circle<S: BackendStyle>(
        &mut self,
        center: BackendCoord,
        radius: u32,
        style: &S,
        fill: bool,
    ) -> std::result::Result<(), DrawingErrorKind<Self::ErrorType>> {
        self.inner.draw_circle(center, radius, style, fill)
    }

    fn fill_polygon<S: BackendStyle, I: IntoIterator<Item = BackendCoord>>(
        &mut self,
        vert: I,
        style: &S,
    ) -> std::result::Result<(), DrawingErrorKind<Self::ErrorType>> {
        self.inner.fill_polygon(vert, style)
    }

    fn blit_bitmap(
        &mut self,
        pos: BackendCoord,
        size: (u32, u32),
        src: &[u8],
    ) -> std::result::Result<(), DrawingErrorKind<Self::ErrorType>> {
        self.inner.blit_bitmap(pos, size, src)
    }

    fn estimate_text_size<S: BackendTextStyle>(
        &self,
        text: &str,
        style: &S,
    ) -> std::result::Result<(u32, u32), DrawingErrorKind<Self::ErrorType>> {
        let line = self.layout(text, style);
        Ok((line.width.ceil() as u32, line.em.ceil() as u32))
    }

    fn draw_text<S: BackendTextStyle>(
        &mut self,
        text: &str,
        style: &S,
        pos: BackendCoord,
    ) -> std::result::Result<(), DrawingErrorKind<Self::ErrorType>> {
        let color = style.color();
        if color.alpha == 0.0 {
            return Ok(());
        }
        let line = self.layout(text, style);
        let sf = line.font.as_scaled(line.scale);
        let x_height = line
            .font
            .outline(line.font.glyph_id('x'))
            .map_or(0.5 * line.em, |o| {
                // Outline bounds keep the font's y-up sign convention.
                (o.bounds.max.y - o.bounds.min.y).abs() * sf.v_scale_factor()
            });
        let anchor = style.anchor();
        let x0 = match anchor.h_pos {
            HPos::Left => 0.0,
            HPos::Center => -line.width / 2.0,
            HPos::Right => -line.width,
        };
        let baseline = match anchor.v_pos {
            VPos::Top => 0.76 * line.em,
            VPos::Center => 0.5 * x_height,
            VPos::Bottom => -0.5 * x_height,
        };
        let trans = style.transform();
        let (w, h) = self.inner.get_size();
        let mut pixels = Vec::new();
        for &(id, x) in &line.glyphs {
            let glyph = id.with_scale_and_position(line.scale, point(x0 + x, baseline));
            if let Some(outline) = line.font.outline_glyph(glyph) {
                let b = outline.px_bounds();
                outline.draw(|gx, gy, coverage| {
                    if coverage > 0.0 {
                        let (px, py) = (b.min.x as i32 + gx as i32, b.min.y as i32 + gy as i32);
                        let (tx, ty) = trans.transform(px, py);
                        pixels.push(((pos.0 + tx, pos.1 + ty), coverage));
                    }
                });
            }
        }
        for ((x, y), coverage) in pixels {
            if x >= 0 && y >= 0 && (x as u32) < w && (y as u32) < h {
                let c = BackendColor {
                    alpha: color.alpha * f64::from(coverage.min(1.0)),
                    rgb: color.rgb,
                };
                self.inner.draw_pixel((x, y), c)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use plotters::style::text_anchor::Pos;

    /// Draws `text` at (20, 40), anchored left and centred, in a 200×80 bitmap; returns the
    /// inked pixels as (x, y).
    fn ink(text: &str) -> Vec<(u32, u32)> {
        let (w, h) = (200u32, 80u32);
        let mut buf = vec![255u8; (w * h * 3) as usize];
        {
            let b = BitMapBackend::with_buffer(&mut buf, (w, h));
            let mut tb = TextBackend::new(b).unwrap();
            let style = ("sans-serif", 24.8)
                .into_font()
                .color(&BLACK)
                .pos(Pos::new(HPos::Left, VPos::Center));
            tb.draw_text(text, &style, (20, 40)).unwrap();
            tb.present().unwrap();
        }
        let mut out = Vec::new();
        for y in 0..h {
            for x in 0..w {
                if buf[((y * w + x) * 3) as usize] < 128 {
                    out.push((x, y));
                }
            }
        }
        out
    }

    #[test]
    fn letters_share_one_baseline_and_the_centre_is_mid_x_height() {
        super::super::ensure_fonts().unwrap();
        let x = ink("x");
        let (top, bottom) = (
            x.iter().map(|p| p.1).min().unwrap(),
            x.iter().map(|p| p.1).max().unwrap(),
        );
        // x-height of DejaVu Sans at a 20 px em is about 11 px, centred on y = 40.
        assert!(
            (top as i32 - 35).abs() <= 1 && (bottom as i32 - 45).abs() <= 1,
            "{top}..{bottom}"
        );
        // A dot sits on the baseline, not above it.
        let dot = ink(".");
        let dot_bottom = dot.iter().map(|p| p.1).max().unwrap();
        assert_eq!(dot_bottom, bottom);
    }

    #[test]
    fn repeated_letters_are_evenly_spaced() {
        super::super::ensure_fonts().unwrap();
        let p = ink("llllllll");
        let mut cols: Vec<u32> = p.iter().map(|p| p.0).collect();
        cols.sort_unstable();
        cols.dedup();
        // The first inked column of each stem.
        let starts: Vec<u32> = cols
            .iter()
            .enumerate()
            .filter(|&(i, &c)| i == 0 || cols[i - 1] + 1 < c)
            .map(|(_, &c)| c)
            .collect();
        assert_eq!(starts.len(), 8, "{starts:?}");
        let gaps: Vec<u32> = starts.windows(2).map(|w| w[1] - w[0]).collect();
        let (lo, hi) = (gaps.iter().min().unwrap(), gaps.iter().max().unwrap());
        assert!(hi - lo <= 1, "uneven spacing: {gaps:?}");
    }

    #[test]
    fn each_letter_starts_where_the_font_puts_it() {
        super::super::ensure_fonts().unwrap();
        let text = "encoder.weight";
        let font = FontRef::try_from_slice(dejavu::sans::regular()).unwrap();
        let em = (24.8 / SVG_EM_DIVISOR) as f32;
        let scale = PxScale::from(em * font.height_unscaled() / font.units_per_em().unwrap());
        let sf = font.as_scaled(scale);
        // Ideal left ink edge of each letter: pen position (advances and kerning) plus the
        // letter's left side bearing, in fractional pixels from x = 20.
        let mut pen = 20f32;
        let mut prev = None;
        let mut ideal = Vec::new();
        for c in text.chars() {
            let id = sf.glyph_id(c);
            if let Some(p) = prev {
                pen += sf.kern(p, id);
            }
            let lsb = font
                .outline(id)
                .map_or(0.0, |o| o.bounds.min.x * sf.h_scale_factor());
            ideal.push(pen + lsb);
            pen += sf.h_advance(id);
            prev = Some(id);
        }
        for (i, c) in text.char_indices() {
            // Ink of the text up to and including letter i, minus the ink up to letter i-1,
            // leaves letter i (letters do not overlap here).
            let upto: std::collections::BTreeSet<(u32, u32)> =
                ink(&text[..=i]).into_iter().collect();
            let before: std::collections::BTreeSet<(u32, u32)> =
                ink(&text[..i]).into_iter().collect();
            let left = upto.difference(&before).map(|p| p.0).min().unwrap();
            assert!(
                (left as f32 - ideal[i]).abs() <= 1.0,
                "`{c}` (letter {i}) starts at {left}, the font says {:.2}",
                ideal[i]
            );
        }
    }
}
