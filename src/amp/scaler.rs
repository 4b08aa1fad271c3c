//! Loss scaling (to be written).
