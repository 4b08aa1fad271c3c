//! The device's failures as the library's error: a leaf that every part of `cuda` (and the
//! ops' device paths) uses to name what failed.

use crate::error::Error;

/// Turns a driver, NVRTC or cuBLAS error into the library's error, naming what failed.
pub fn dev_err(what: &str) -> impl Fn(&dyn std::fmt::Debug) -> Error + '_ {
    move |e| Error::Device(format!("{what}: {e:?}"))
}
