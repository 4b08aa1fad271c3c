//! Automatic mixed precision: autocast policy tables, precision modes, loss scaling.
pub mod mode;
pub mod policy;
pub mod scaler;
pub mod simulate;
