//! Layer 7 of `amprobe::LAYERS`: may use layers 0–6 (`dtype` … `ops`).
//!
//! Numerical probes: what every op's output looks like, computed from the raw bits.
mod f32_scan;
pub mod nonfinite;
pub mod params;
pub mod tensor_stats;

pub use tensor_stats::{CastCounts, ExpHist, TensorStats};
pub mod recorder;

/// The xorshift64 (13, 7, 17) sequence from `seed`, for the probes' test data.
#[cfg(test)]
fn xorshift(mut x: u64) -> impl FnMut() -> u64 {
    move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    }
}
