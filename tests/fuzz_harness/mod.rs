//! The fuzzer behind tests/fuzz.rs: the counting allocator, the inputs, the runner and the
//! `AMPROBE_*` target.

pub mod alloc;
pub mod env;
pub mod mutate;
pub mod run;
