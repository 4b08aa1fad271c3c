//! amprobe: finds where mixed-precision training goes numerically wrong, says why, and
//! proves the fix.
pub mod amp;
pub mod backend;
pub mod config;
pub mod diagnose;
pub mod dtype;
pub mod engine;
pub mod error;
pub mod models;
pub mod ops;
pub mod optim;
pub mod probe;
pub mod report;
pub mod rng;
pub mod runner;
pub mod tensor;
pub mod trace;
pub mod train;
pub mod tui;

pub use dtype::DType;
pub use error::{Error, Result};
pub use tensor::Tensor;
