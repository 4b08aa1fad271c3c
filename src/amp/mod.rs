//! Layer 4 of `amprobe::LAYERS`: may use layers 0–3 (`dtype` … `tensor`).
//!
//! Automatic mixed precision: autocast policy tables, precision modes, loss scaling.
pub mod mode;
pub mod policy;
pub mod scaler;
pub mod simulate;
