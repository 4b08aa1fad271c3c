//! Serde helpers that write an `f64` as a JSON number when finite and as the string
//! `"NaN"`, `"inf"` or `"-inf"` otherwise (JSON has no non-finite numbers). Reading
//! accepts numbers and those strings (also `"nan"`, `"+inf"`, `"Infinity"`,
//! `"-Infinity"`).

use serde::de::{self, Deserializer, Visitor};
use serde::Serializer;
use std::fmt;

/// Writes one `f64`.
pub fn serialize<S: Serializer>(x: &f64, s: S) -> Result<S::Ok, S::Error> {
    if x.is_finite() {
        s.serialize_f64(*x)
    } else if x.is_nan() {
        s.serialize_str("NaN")
    } else if *x > 0.0 {
        s.serialize_str("inf")
    } else {
        s.serialize_str("-inf")
    }
}

/// Reads one `f64`.
pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    d.deserialize_any(F64Visitor)
}

struct F64Visitor;

impl Visitor<'_> for F64Visitor {
    type Value = f64;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a number or one of \"NaN\", \"inf\", \"-inf\"")
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<f64, E> {
        Ok(v)
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<f64, E> {
        Ok(v as f64)
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<f64, E> {
        Ok(v as f64)
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<f64, E> {
        match v {
            "NaN" | "nan" => Ok(f64::NAN),
            "inf" | "+inf" | "Infinity" | "+Infinity" => Ok(f64::INFINITY),
            "-inf" | "-Infinity" => Ok(f64::NEG_INFINITY),
            _ => Err(E::invalid_value(de::Unexpected::Str(v), &self)),
        }
    }
}

/// The same for `Option<f64>` (`None` is `null`).
pub mod option {
    use super::*;

    /// Writes one `Option<f64>`.
    pub fn serialize<S: Serializer>(x: &Option<f64>, s: S) -> Result<S::Ok, S::Error> {
        match x {
            Some(v) => super::serialize(v, s),
            None => s.serialize_none(),
        }
    }

    /// Reads one `Option<f64>`.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<f64>, D::Error> {
        d.deserialize_option(OptVisitor)
    }

    struct OptVisitor;

    impl<'de> Visitor<'de> for OptVisitor {
        type Value = Option<f64>;

        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("null, a number or one of \"NaN\", \"inf\", \"-inf\"")
        }
        fn visit_none<E: de::Error>(self) -> Result<Option<f64>, E> {
            Ok(None)
        }
        fn visit_unit<E: de::Error>(self) -> Result<Option<f64>, E> {
            Ok(None)
        }
        fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Option<f64>, D::Error> {
            super::deserialize(d).map(Some)
        }
    }
}

/// Writes an `f32` as the `f64` of the same value, so that every JSON reader (which reads
/// numbers as `f64`) gets the exact value back: 2^-12 is written `0.000244140625`, not the
/// shortest text of the `f32` (`0.00024414062`), which an `f64` reader takes for another
/// number. Non-finite values are written as `null`, as `serde_json` does for any float.
pub mod f32_exact {
    use serde::Serializer;

    /// Writes one `f32`.
    pub fn serialize<S: Serializer>(x: &f32, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(f64::from(*x))
    }

    /// The same for `Option<f32>` (`None` is `null`).
    pub mod option {
        use serde::Serializer;

        /// Writes one `Option<f32>`.
        pub fn serialize<S: Serializer>(x: &Option<f32>, s: S) -> Result<S::Ok, S::Error> {
            match x {
                Some(v) => super::serialize(v, s),
                None => s.serialize_none(),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use serde::Serialize;

    #[derive(Serialize)]
    struct One {
        #[serde(serialize_with = "super::f32_exact::serialize")]
        x: f32,
        #[serde(serialize_with = "super::f32_exact::option::serialize")]
        y: Option<f32>,
    }

    /// The value a JSON reader that reads numbers as `f64` gets back.
    fn read_back(x: f32) -> (f64, f64) {
        let text = serde_json::to_string(&One { x, y: Some(x) }).unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        (v["x"].as_f64().unwrap(), v["y"].as_f64().unwrap())
    }

    #[test]
    fn powers_of_two_read_back_exactly() {
        for k in -40..=40 {
            let x = 2f32.powi(k);
            assert_eq!(read_back(x), (f64::from(x), f64::from(x)), "2^{k}");
        }
        let text = serde_json::to_string(&One {
            x: 2f32.powi(-12),
            y: None,
        })
        .unwrap();
        assert_eq!(text, r#"{"x":0.000244140625,"y":null}"#);
    }

    #[test]
    fn random_f32s_read_back_exactly() {
        // Random bit patterns (xorshift), every finite one kept: subnormals included.
        let mut s = 0x9e37_79b9_7f4a_7c15u64;
        let mut n = 0;
        let mut subnormal = 0;
        while n < 10_000 {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let x = f32::from_bits((s >> 32) as u32);
            if !x.is_finite() {
                continue;
            }
            subnormal += x.is_subnormal() as u32;
            assert_eq!(read_back(x), (f64::from(x), f64::from(x)), "{x:e}");
            n += 1;
        }
        // A few subnormals by construction, in case the draw has none.
        for bits in [1u32, 0x0000_0fff, 0x007f_ffff, 0x8000_0001] {
            let x = f32::from_bits(bits);
            assert_eq!(read_back(x), (f64::from(x), f64::from(x)), "{x:e}");
        }
        assert!(subnormal > 0, "the draw holds subnormals");
    }
}
