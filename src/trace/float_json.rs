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
