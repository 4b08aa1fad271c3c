//! amprobe: finds where mixed-precision training goes numerically wrong, says why, and
//! proves the fix.
pub mod amp;
pub mod dtype;
pub mod error;
pub mod optim;
pub mod probe;
pub mod trace;

pub use dtype::DType;
pub use error::{Error, Result};
