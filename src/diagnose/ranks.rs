//! A run over several ranks (torchrun, DDP, FSDP): one trace per rank, read together into
//! one summary that names the rank where the first Inf and NaN were made, tells it apart
//! from ranks that only received them through a collective, and says per step whether
//! the ranks agreed on found_inf.
//!
//! Values cross ranks only through collectives (an all-reduce of gradients, an all-gather
//! of parameters), and the j-th collective of a step on one rank meets the j-th of every
//! other rank. So an origin (an op whose output went non-finite while its inputs were
//! finite) that a rank recorded after its j-th collective of the step may have arrived
//! through it when another rank had an origin before its own j-th collective. Such an
//! origin is *received*; the others are *made* on their rank. The summary's first Inf and
//! first NaN are the first in the order step, made before received, phase (forward,
//! backward, optimizer), op index within the step, rank.

pub use super::rank_summary::{FirstFailure, FoundInfStep, RankFacts, RankOrigin, RanksSummary};
use super::summary::{summary_of_trace, RunSummary};
use super::DiagnoseOptions;
use crate::error::{Error, Result};
use crate::trace::io::{read_trace, Trace};
use crate::trace::record::{OpRef, Phase, StepRecord, Verdict};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Op names of the collectives of torch.distributed as PyTorch's dispatcher names them
/// (the `c10d` in-place ops, the functional `_c10d_functional` ops and their waits).
pub const COLLECTIVES: &[&str] = &[
    "allreduce_",
    "allreduce_coalesced_",
    "allgather_",
    "allgather_coalesced_",
    "allgather_into_tensor_coalesced_",
    "_allgather_base_",
    "reduce_scatter_",
    "reduce_scatter_tensor_coalesced_",
    "_reduce_scatter_base_",
    "reduce_",
    "broadcast_",
    "gather_",
    "scatter_",
    "alltoall_",
    "alltoall_base_",
    "recv_",
    "recv_any_source_",
    "all_reduce",
    "all_reduce_",
    "all_reduce_coalesced",
    "all_reduce_coalesced_",
    "all_gather_into_tensor",
    "all_gather_into_tensor_out",
    "all_gather_into_tensor_coalesced",
    "reduce_scatter_tensor",
    "reduce_scatter_tensor_coalesced",
    "all_to_all_single",
    "broadcast",
    "wait_tensor",
];

/// Ops that allocate a tensor without writing its values (FSDP's buffers for a collective's
/// output): what their output holds is whatever the memory held, so an Inf or NaN in it is
/// no origin.
pub const ALLOCATIONS: &[&str] = &[
    "empty",
    "empty_like",
    "empty_strided",
    "empty_permuted",
    "new_empty",
    "new_empty_strided",
];

/// True when `op` is a collective of torch.distributed ([`COLLECTIVES`]).
pub fn is_collective(op: &str) -> bool {
    COLLECTIVES.contains(&op)
}

/// The trace file of `rank` in a run whose trace path is `path`: `.rank{N}` before the
/// suffix (`t.jsonl` → `t.rank1.jsonl`), as the companion names it.
pub fn rank_path(path: &Path, rank: u32) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let file = match split_suffix(&name) {
        (stem, Some(ext)) => format!("{stem}.rank{rank}.{ext}"),
        (stem, None) => format!("{stem}.rank{rank}"),
    };
    path.with_file_name(file)
}

/// A file name split at its last dot, a leading dot not counting (Python's `splitext`).
fn split_suffix(name: &str) -> (&str, Option<&str>) {
    let lead = name.len() - name.trim_start_matches('.').len();
    match name[lead..].rfind('.') {
        Some(i) => (&name[..lead + i], Some(&name[lead + i + 1..])),
        None => (name, None),
    }
}

/// The rank traces that exist next to `path` (`STEM.rank{N}.EXT`), by rank.
pub fn rank_files(path: &Path) -> Result<Vec<(u32, PathBuf)>> {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let (stem, ext) = split_suffix(&name);
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let entries = match std::fs::read_dir(&dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::io(dir, e)),
    };
    let prefix = format!("{stem}.rank");
    let suffix = ext.map(|e| format!(".{e}")).unwrap_or_default();
    let mut out = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| Error::io(&dir, e))?;
        let n = entry.file_name().to_string_lossy().into_owned();
        let digits = n
            .strip_prefix(&prefix)
            .and_then(|rest| rest.strip_suffix(&suffix));
        if let Some(r) = digits
            .filter(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|d| d.parse::<u32>().ok())
        {
            out.push((r, rank_path(path, r)));
        }
    }
    out.sort();
    Ok(out)
}

/// One rank's trace.
#[derive(Debug, Clone)]
pub struct RankTrace {
    /// The rank.
    pub rank: u32,
    /// Its file.
    pub path: PathBuf,
    /// Its records, module and parameter names as the user's model names them
    /// ([`user_names`]).
    pub trace: Trace,
}

fn header_error(path: &Path, message: String) -> Error {
    Error::Trace {
        path: path.to_path_buf(),
        line: 1,
        message,
    }
}

/// Reads the traces of every rank of the run whose trace path is `path` (rank 0's header
/// gives the world size) and checks that they belong together: each file's header names
/// its own rank and the same world size, model, precision, command line and run id (when
/// written) as rank 0's, and no rank file past the world size lies next to them.
pub fn read_rank_traces(path: &Path) -> Result<Vec<RankTrace>> {
    let first = rank_path(path, 0);
    if !first.exists() {
        return Err(Error::Invalid(format!(
            "{}: no such file: a run over several ranks writes one trace per rank, rank 0's \
             first",
            first.display()
        )));
    }
    let t0 = read_trace(&first)?;
    let world = match &t0.header.source {
        Some(s) => s.world_size,
        None => {
            return Err(header_error(
                &first,
                "the header has no `source`: not a rank trace of the PyTorch companion".into(),
            ))
        }
    };
    if world == 0 {
        return Err(header_error(&first, "source.world_size is 0".into()));
    }
    let mut ranks = Vec::with_capacity(world as usize);
    for r in 0..world {
        let p = rank_path(path, r);
        let trace = if r == 0 {
            t0.clone()
        } else if !p.exists() {
            return Err(Error::Invalid(format!(
                "{}: no such file: rank 0's trace ({}) says the run had {world} ranks, and \
                 rank {r} wrote no trace (did every rank call amprobe_torch.watch?)",
                p.display(),
                first.display()
            )));
        } else {
            read_trace(&p)?
        };
        check_belongs(&p, r, world, &trace, &t0, &first)?;
        ranks.push(RankTrace {
            rank: r,
            path: p,
            trace,
        });
    }
    if let Some((r, p)) = rank_files(path)?.into_iter().find(|(r, _)| *r >= world) {
        return Err(Error::Invalid(format!(
            "{}: a trace of rank {r}, but rank 0's trace ({}) says the run had {world} ranks: \
             a file of another run? Remove it",
            p.display(),
            first.display()
        )));
    }
    for r in &mut ranks {
        user_names(&mut r.trace);
    }
    Ok(ranks)
}

fn check_belongs(
    path: &Path,
    rank: u32,
    world: u32,
    t: &Trace,
    t0: &Trace,
    first: &Path,
) -> Result<()> {
    let h = &t.header;
    let h0 = &t0.header;
    let Some(s) = &h.source else {
        return Err(header_error(
            path,
            "the header has no `source`: not a rank trace of the PyTorch companion".into(),
        ));
    };
    let want = |what: &str, got: String, expected: String| {
        header_error(
            path,
            format!(
                "{what} is {got}, expected {expected} as in rank 0's trace {}: a file of \
                 another run?",
                first.display()
            ),
        )
    };
    if s.rank != rank {
        return Err(header_error(
            path,
            format!(
                "source.rank is {}, expected {rank} (the rank in the file's name)",
                s.rank
            ),
        ));
    }
    if s.world_size != world {
        return Err(want(
            "source.world_size",
            s.world_size.to_string(),
            world.to_string(),
        ));
    }
    let s0 = h0.source.as_ref().map(|s| &s.run_id);
    if let (Some(a), Some(Some(b))) = (&s.run_id, s0) {
        if a != b {
            return Err(want("source.run_id", format!("`{a}`"), format!("`{b}`")));
        }
    }
    if h.model != h0.model {
        return Err(want(
            "model",
            format!("`{}`", h.model),
            format!("`{}`", h0.model),
        ));
    }
    if h.precision != h0.precision {
        return Err(want(
            "precision",
            format!("`{}`", h.precision),
            format!("`{}`", h0.precision),
        ));
    }
    if h.command_line != h0.command_line {
        return Err(want(
            "command_line",
            format!("`{}`", h.command_line.join(" ")),
            format!("`{}`", h0.command_line.join(" ")),
        ));
    }
    Ok(())
}

/// Names as the user's model names them in the trace of a model given to `watch` inside a
/// data-parallel wrapper, or as the wrapper: DistributedDataParallel's `module.` (a trace
/// whose header's model is `DistributedDataParallel`), a leading
/// `DistributedDataParallel.module.` and FullyShardedDataParallel's
/// `_fsdp_wrapped_module.` are taken out of module and parameter names.
pub fn user_names(t: &mut Trace) {
    let ddp = t.header.model == "DistributedDataParallel";
    let fix = |name: &mut String| {
        let mut n = name.replace("_fsdp_wrapped_module.", "");
        if n == "_fsdp_wrapped_module" {
            n.clear();
        }
        for p in [
            "DistributedDataParallel.module.",
            "FullyShardedDataParallel.",
        ] {
            if let Some(rest) = n.strip_prefix(p) {
                n = rest.to_string();
            }
        }
        if ddp {
            if let Some(rest) = n.strip_prefix("module.") {
                n = rest.to_string();
            } else if n == "module" {
                n.clear();
            }
        }
        *name = n;
    };
    for s in &mut t.steps {
        for o in [&mut s.origins.first_inf, &mut s.origins.first_nan]
            .into_iter()
            .flatten()
        {
            fix(&mut o.module);
        }
        for o in &mut s.origins.chain {
            fix(&mut o.module);
        }
        for op in s.ops.iter_mut().flatten() {
            fix(&mut op.module);
        }
        for p in &mut s.params {
            fix(&mut p.name);
        }
    }
}

fn phase_order(p: Phase) -> u8 {
    match p {
        Phase::Forward => 0,
        Phase::Backward => 1,
        Phase::Optimizer => 2,
    }
}

/// Collectives of `rec` up to op `index` (included), and their names.
fn collectives_up_to(rec: &StepRecord, index: u64) -> (u64, Vec<String>) {
    let mut n = 0;
    let mut names: Vec<String> = Vec::new();
    for op in rec.ops.iter().flatten() {
        if op.index <= index && is_collective(&op.op) {
            n += 1;
            if !names.contains(&op.op) {
                names.push(op.op.clone());
            }
        }
    }
    (n, names)
}

/// Every origin recorded in `step` on every rank, unclassified: (rank, is_inf, op,
/// collectives before, their names).
type Found = (u32, bool, OpRef, u64, Vec<String>);

fn origins_at(ranks: &[RankTrace], step: u64) -> Vec<Found> {
    let mut out = Vec::new();
    for r in ranks {
        let Some(rec) = r.trace.steps.iter().find(|s| s.step == step) else {
            continue;
        };
        for (is_inf, o) in [
            (true, &rec.origins.first_inf),
            (false, &rec.origins.first_nan),
        ] {
            if let Some(o) = o.as_ref().filter(|o| !ALLOCATIONS.contains(&o.op.as_str())) {
                let (n, names) = collectives_up_to(rec, o.op_index);
                out.push((r.rank, is_inf, o.clone(), n, names));
            }
        }
    }
    out
}

/// `f` classified against every origin of its step (`all`).
fn classify(f: &Found, all: &[Found]) -> RankOrigin {
    let received = all.iter().any(|g| g.0 != f.0 && g.3 < f.3);
    RankOrigin {
        rank: f.0,
        op: f.2.clone(),
        collectives_before: f.3,
        received,
    }
}

fn order_key(o: &RankOrigin) -> (u64, bool, u8, u64, u32) {
    (
        o.op.step,
        o.received,
        phase_order(o.op.phase),
        o.op.op_index,
        o.rank,
    )
}

/// Reads the ranks' traces together: each rank's first origins classified as made or
/// received, the first Inf and NaN over all ranks, the first failing step and the
/// agreement on found_inf. `shown_rank` is recorded as the rank the caller's summary shows.
pub fn merge(ranks: &[RankTrace], shown_rank: u32) -> RanksSummary {
    let mut steps_with_origins: Vec<u64> = ranks
        .iter()
        .flat_map(|r| r.trace.steps.iter())
        .filter(|s| s.origins.first_inf.is_some() || s.origins.first_nan.is_some())
        .map(|s| s.step)
        .collect();
    steps_with_origins.sort_unstable();
    steps_with_origins.dedup();
    let mut by_step: BTreeMap<u64, Vec<Found>> = BTreeMap::new();
    for &s in &steps_with_origins {
        let found = origins_at(ranks, s);
        if !found.is_empty() {
            by_step.insert(s, found);
        }
    }
    let mut facts = Vec::new();
    let mut all_inf = Vec::new();
    let mut all_nan = Vec::new();
    for r in ranks {
        let first_of = |want_inf: bool| {
            by_step.values().find_map(|found| {
                found
                    .iter()
                    .find(|f| f.0 == r.rank && f.1 == want_inf)
                    .map(|f| classify(f, found))
            })
        };
        let first_inf = first_of(true);
        let first_nan = first_of(false);
        all_inf.extend(first_inf.clone());
        all_nan.extend(first_nan.clone());
        facts.push(RankFacts {
            rank: r.rank,
            trace: r.path.clone(),
            verdict: rank_verdict(&r.trace),
            steps: r.trace.steps.len() as u64,
            skipped_steps: r.trace.steps.iter().filter(|s| s.skipped).count() as u64,
            first_inf,
            first_nan,
        });
    }
    let first = |v: Vec<RankOrigin>| v.into_iter().min_by_key(order_key);
    let first_failure = by_step.iter().next().map(|(&step, found)| {
        let mut made_by: Vec<u32> = Vec::new();
        let mut received_by: Vec<u32> = Vec::new();
        let mut through: Vec<String> = Vec::new();
        for r in ranks {
            let mine: Vec<RankOrigin> = found
                .iter()
                .filter(|f| f.0 == r.rank)
                .map(|f| classify(f, found))
                .collect();
            if mine.is_empty() {
                continue;
            }
            if mine.iter().any(|o| !o.received) {
                made_by.push(r.rank);
            } else {
                received_by.push(r.rank);
                for f in found.iter().filter(|f| f.0 == r.rank) {
                    for n in &f.4 {
                        if !through.contains(n) {
                            through.push(n.clone());
                        }
                    }
                }
            }
        }
        FirstFailure {
            step,
            made_by,
            received_by,
            through,
        }
    });
    let (found_inf, found_inf_agreed) = found_inf_steps(ranks);
    let first_inf = first(all_inf);
    let first_nan = first(all_nan);
    let chain_rank = lead_chain(ranks, &first_inf, &first_nan).map(|(r, _)| r);
    RanksSummary {
        world_size: ranks.len() as u32,
        shown_rank,
        first_inf,
        first_nan,
        chain_rank,
        first_failure,
        found_inf_agreed,
        found_inf,
        ranks: facts,
    }
}

/// The chain of the rank the earlier of `first_inf` and `first_nan` is on, at its step,
/// with that rank; `None` when that record has no chain.
fn lead_chain(
    ranks: &[RankTrace],
    first_inf: &Option<RankOrigin>,
    first_nan: &Option<RankOrigin>,
) -> Option<(u32, Vec<OpRef>)> {
    let lead = [first_inf, first_nan]
        .into_iter()
        .flatten()
        .min_by_key(|o| order_key(o))?;
    let r = ranks.iter().find(|r| r.rank == lead.rank)?;
    let rec = r.trace.steps.iter().find(|st| st.step == lead.op.step)?;
    (!rec.origins.chain.is_empty()).then(|| (lead.rank, rec.origins.chain.clone()))
}

fn rank_verdict(t: &Trace) -> Verdict {
    let params_finite = t.steps.last().is_none_or(StepRecord::params_finite);
    super::summary::verdict(&t.steps, params_finite)
}

fn found_inf_steps(ranks: &[RankTrace]) -> (Vec<FoundInfStep>, bool) {
    let mut per_step: BTreeMap<u64, Vec<Option<bool>>> = BTreeMap::new();
    for (i, r) in ranks.iter().enumerate() {
        for s in &r.trace.steps {
            per_step
                .entry(s.step)
                .or_insert_with(|| vec![None; ranks.len()])[i] = Some(s.found_inf);
        }
    }
    let mut out = Vec::new();
    let mut agreed_all = true;
    for (step, v) in per_step {
        let pick = |want: Option<bool>| -> Vec<u32> {
            v.iter()
                .zip(ranks)
                .filter(|(x, _)| **x == want)
                .map(|(_, r)| r.rank)
                .collect()
        };
        let found = pick(Some(true));
        let not_found = pick(Some(false));
        let missing = pick(None);
        let agreed = missing.is_empty() && (found.is_empty() || not_found.is_empty());
        agreed_all &= agreed;
        if !found.is_empty() || !missing.is_empty() {
            out.push(FoundInfStep {
                step,
                found,
                not_found,
                missing,
                agreed,
            });
        }
    }
    (out, agreed_all)
}

fn severity(v: Verdict) -> u8 {
    match v {
        Verdict::Clean => 0,
        Verdict::OverflowSkips => 1,
        Verdict::ForwardNonfinite => 2,
        Verdict::Diverged => 3,
    }
}

/// The summary of a run over several ranks: rank 0's steps, parameters, headroom and
/// collapse flag (as [`summary_of_trace`] gives them), with the worst verdict of any rank,
/// the first Inf and NaN over all ranks (and the chain of the rank the earlier of them is
/// on, [`RanksSummary::chain_rank`]), and [`RunSummary::ranks`] from [`merge`]. `path` is
/// the trace path the ranks' files were named after.
pub fn summary_of_ranks(ranks: &[RankTrace], opts: DiagnoseOptions) -> Result<RunSummary> {
    let Some(shown) = ranks.first() else {
        return Err(Error::Invalid("no rank traces to summarize".into()));
    };
    let merged = merge(ranks, shown.rank);
    let mut s = summary_of_trace(&shown.trace, Some(shown.path.clone()), opts)?;
    for f in &merged.ranks {
        if severity(f.verdict) > severity(s.verdict) {
            s.verdict = f.verdict;
        }
    }
    s.first_inf = merged.first_inf.as_ref().map(|o| o.op.clone());
    s.first_nan = merged.first_nan.as_ref().map(|o| o.op.clone());
    s.chain = lead_chain(ranks, &merged.first_inf, &merged.first_nan)
        .map(|(_, c)| c)
        .unwrap_or_default();
    s.ranks = Some(merged);
    Ok(s)
}
