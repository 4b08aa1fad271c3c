//! What the summary of a run over several ranks adds (`ranks` in the summary JSON), as
//! plain data; [`super::ranks`] reads the rank traces and fills it in.

use crate::trace::record::{OpRef, Verdict};
use serde::Serialize;
use std::path::PathBuf;

/// One rank's first Inf or NaN, and whether it was made there or may have been received.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RankOrigin {
    /// The rank.
    pub rank: u32,
    /// The op, as that rank recorded it.
    pub op: OpRef,
    /// Collectives the rank ran in that step up to the op (the op itself included when it
    /// is one).
    pub collectives_before: u64,
    /// Another rank had an origin in the same step before fewer collectives, so the value
    /// may have arrived through one (see `diagnose::ranks`).
    pub received: bool,
}

/// What one rank's trace says.
#[derive(Debug, Clone, Serialize)]
pub struct RankFacts {
    /// The rank.
    pub rank: u32,
    /// Its trace file.
    pub trace: PathBuf,
    /// Its verdict, alone.
    pub verdict: Verdict,
    /// Steps it recorded.
    pub steps: u64,
    /// Steps it skipped.
    pub skipped_steps: u64,
    /// Its first Inf (first step with one).
    pub first_inf: Option<RankOrigin>,
    /// Its first NaN (first step with one).
    pub first_nan: Option<RankOrigin>,
}

/// found_inf at one step on every rank.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FoundInfStep {
    /// The step.
    pub step: u64,
    /// Ranks whose scaler found an Inf or NaN.
    pub found: Vec<u32>,
    /// Ranks whose scaler found none.
    pub not_found: Vec<u32>,
    /// Ranks with no record of the step (stopped before it).
    pub missing: Vec<u32>,
    /// Every rank recorded the step and all said the same.
    pub agreed: bool,
}

/// The first step with an origin on any rank: where it was made and where received.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FirstFailure {
    /// The step.
    pub step: u64,
    /// Ranks with an origin made there.
    pub made_by: Vec<u32>,
    /// Ranks whose origins in the step were all received.
    pub received_by: Vec<u32>,
    /// The collective ops the receiving ranks ran up to their origin (names, in order,
    /// without repeats).
    pub through: Vec<String>,
}

/// The part of a summary that only a run over several ranks has (`ranks` in the summary
/// JSON).
#[derive(Debug, Clone, Serialize)]
pub struct RanksSummary {
    /// Ranks in the run.
    pub world_size: u32,
    /// The rank whose steps, parameters and headroom the rest of the summary shows.
    pub shown_rank: u32,
    /// The first Inf over all ranks (order: step, made before received, phase, op index,
    /// rank).
    pub first_inf: Option<RankOrigin>,
    /// The first NaN over all ranks, in the same order.
    pub first_nan: Option<RankOrigin>,
    /// The rank whose chain the summary's `chain` is: that of the earlier of `first_inf`
    /// and `first_nan`, at its step; `None` when there is no chain.
    pub chain_rank: Option<u32>,
    /// The first step with an origin on any rank.
    pub first_failure: Option<FirstFailure>,
    /// Every rank recorded every step and found_inf was the same on all of them at each.
    pub found_inf_agreed: bool,
    /// The steps where some rank found an Inf or NaN, or some rank has no record.
    pub found_inf: Vec<FoundInfStep>,
    /// Each rank alone.
    pub ranks: Vec<RankFacts>,
}
