//! Autocast policy tables (to be written).
