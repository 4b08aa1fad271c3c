//! Layer 9 of `amprobe::LAYERS`: may use layers 0–8 (`dtype` … `models`).
//!
//! The step engine: forward under the autocast policy, loss, loss scaling, backward,
//! unscale, clipping, optimizer step and scale update, with probes on every op.
//!
//! Layer 9 (train). [`trainer`] holds the trainer and the backend-free phases, [`step`]
//! the one sequence of phases, [`host`] and [`device`] each backend's part in it
//! ([`phases::StepSide`]); this file only declares and re-exports them.

mod config;
mod data;
mod device;
mod device_state;
mod grad_blame;
mod grads;
mod host;
mod phases;
mod replay;
mod step;
mod step_record;
mod trainer;

pub use config::{OpSampling, TrainConfig};
pub use data::{DataSource, FixedBatch, Synthetic};
pub use replay::{Replay, Variant};
pub use trainer::{StepOutput, Trainer};
