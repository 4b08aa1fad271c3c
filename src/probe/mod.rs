//! Numerical probes: what every op's output looks like, computed from the raw bits.
mod f32_scan;
pub mod params;
pub mod stats;

pub use stats::{CastCounts, ExpHist, TensorStats};
pub mod recorder;
