//! Optimizers (to be written).
