//! amprobe: finds where mixed-precision training goes numerically wrong, says why, and
//! proves the fix.
//!
//! The modules below are grouped by layer, lowest first ([`LAYERS`]): a module may use its
//! own layer's neighbours only where [`SIDEWAYS`] allows it, and lower layers never. The
//! test `tests/layering.rs` holds the source to this order.

// Layer 0: numbers and errors.
pub mod dtype;
pub mod error;
pub mod host_memory;
pub mod numfmt;
pub mod rng;

// Layer 1: the records a run writes (plain data).
pub mod trace;

// Layer 2: the device runtime under tensor storage (CUDA context, buffers, kernels).
pub mod device;

// Layer 3: tensors, on the host or a device.
pub mod tensor;

// Layer 4: the autocast policy and the gradient scalers.
pub mod amp;

// Layer 5: the op recorder (autograd tape, autocast casts, probe events).
pub mod engine;

// Layer 6: the ops, their kernels and backwards.
pub mod ops;

// Layer 7: probes that observe ops; optimizers and clipping.
pub mod optim;
pub mod probe;

// Layer 8: models and the backends by name.
pub mod backend;
pub mod models;

// Layer 9: the training step.
pub mod train;

// Layer 10: which backend a run uses, run configuration and diagnosis of records.
pub mod backend_choice;
pub mod config;
pub mod diagnose;

// Layer 11: a whole run, and runs that search (the smallest failing batch).
pub mod runner;
pub mod shrink;

// Layer 12: readers of records.
pub mod report;
pub mod tui;

pub use dtype::DType;
pub use error::{Error, Result};
pub use tensor::Tensor;

/// The layers of the crate, lowest first: a module uses modules of lower layers only (and
/// the pairs in [`SIDEWAYS`] within a layer). `cli` is the binary on top.
pub const LAYERS: &[&[&str]] = &[
    &["dtype", "error", "host_memory", "numfmt", "rng"],
    &["trace"],
    &["device"],
    &["tensor"],
    &["amp"],
    &["engine"],
    &["ops"],
    &["optim", "probe"],
    &["backend", "models"],
    &["train"],
    &["backend_choice", "config", "diagnose"],
    &["runner", "shrink"],
    &["report", "tui"],
    &["cli"],
];

/// Uses allowed within one layer, as (user, used).
pub const SIDEWAYS: &[(&str, &str)] = &[("shrink", "runner")];
