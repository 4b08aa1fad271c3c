//! amprobe: finds where mixed-precision training goes numerically wrong, says why, and
//! proves the fix.
pub mod amp;
pub mod dtype;
pub mod engine;
pub mod error;
pub mod models;
pub mod ops;
pub mod optim;
pub mod rng;
pub mod tensor;
pub mod trace;

pub use dtype::DType;
pub use error::{Error, Result};
pub use tensor::Tensor;
