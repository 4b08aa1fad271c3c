//! Trace records (placeholder until the trace module lands).
pub mod record;
