//! Layer 0 of `amprobe::LAYERS`: uses no other module of the crate.
//!
//! How numbers read in every report and in the terminal UI: one rule for where plain
//! notation gives way to scientific (1e-3 ≤ |x| < 1e6), in a long form for reports and a
//! short form (at most 9 characters) for table cells.

/// The text of a non-finite or zero value, if `x` is one.
fn special(x: f64) -> Option<String> {
    if x.is_nan() {
        Some("NaN".into())
    } else if x.is_infinite() {
        Some(if x > 0.0 { "inf" } else { "-inf" }.into())
    } else if x == 0.0 {
        Some("0".into())
    } else {
        None
    }
}

/// True when |x| reads best in plain notation.
fn plain(x: f64) -> bool {
    (1e-3..1e6).contains(&x.abs())
}

/// A number as a report prints it: plain with up to six decimals between 1e-3 and 1e6,
/// else scientific with four significant digits (`1.000e30`).
pub fn long(x: f64) -> String {
    if let Some(s) = special(x) {
        return s;
    }
    if plain(x) {
        let s = format!("{x:.6}");
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        format!("{x:.3e}")
    }
}

/// A number in at most 9 characters: four significant digits between 1e-3 and 1e6 (no
/// decimals from 1e3 up), else scientific (`1.23e-7`, `1e7`).
pub fn short(x: f64) -> String {
    if let Some(s) = special(x) {
        return s;
    }
    if plain(x) {
        let digits = (3 - x.abs().log10().floor() as i32).clamp(0, 6) as usize;
        let s = format!("{x:.digits$}");
        if s.contains('.') {
            s.trim_end_matches('0').trim_end_matches('.').to_string()
        } else {
            s
        }
    } else {
        let s = format!("{x:.2e}");
        match s.split_once('e') {
            Some((m, e)) if m.contains('.') => {
                format!("{}e{e}", m.trim_end_matches('0').trim_end_matches('.'))
            }
            _ => s,
        }
    }
}

/// The exponent `k` when `x` is exactly `2^k`.
pub fn power_of_two(x: f64) -> Option<i32> {
    if x > 0.0 && x.is_finite() {
        let k = x.log2().round();
        if (-1074.0..=1023.0).contains(&k) && 2f64.powi(k as i32) == x {
            return Some(k as i32);
        }
    }
    None
}

/// A loss scale in a report: `2^k` when it is a power of two (loss scales usually are),
/// else [`long`].
pub fn scale_long(x: f64) -> String {
    power_of_two(x).map_or_else(|| long(x), |k| format!("2^{k}"))
}

/// A loss scale in a table cell: `2^k` when it is a power of two, else [`short`].
pub fn scale_short(x: f64) -> String {
    power_of_two(x).map_or_else(|| short(x), |k| format!("2^{k}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_cut_between_plain_and_scientific() {
        for (x, l, s) in [
            (999_999.0, "999999", "999999"),
            (1e6, "1.000e6", "1e6"),
            (123_456.789, "123456.789", "123457"),
            (0.001, "0.001", "0.001"),
            (0.000_999, "9.990e-4", "9.99e-4"),
            (-2.5, "-2.5", "-2.5"),
            (f64::NEG_INFINITY, "-inf", "-inf"),
        ] {
            assert_eq!((long(x), short(x)), (l.to_string(), s.to_string()), "{x}");
            assert!(short(x).len() <= 9, "{x}");
        }
    }

    #[test]
    fn scales_read_as_powers_of_two_only_when_exact() {
        assert_eq!(scale_long(65536.0), "2^16");
        assert_eq!(scale_short(2f64.powi(-24)), "2^-24");
        assert_eq!(scale_long(1e30), "1.000e30");
        // A neighbour of 2^10 whose log2 rounds to exactly 10.0 is not a power of two.
        let near = f64::from_bits(1024f64.to_bits() + 1);
        assert_eq!(near.log2(), 10.0);
        assert_eq!(scale_short(near), "1024");
        assert_eq!(power_of_two(3.0), None);
    }
}
