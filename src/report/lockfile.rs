//! The numerics lockfile (`amprobe baseline`, `--fail-on drift`): per op, the envelope a
//! run's values showed — exponent range, largest |x|, headroom to the 16-bit maximum, share
//! of zeros and subnormals, non-finite values, values flushed to zero or sent to inf by
//! rounding — and the loss-scale path, with the tolerances a later run is held to.
//!
//! Ops are keyed as `compare` pairs them (micro-batch, phase, op, module, gradient input)
//! plus their occurrence among such ops within a step, so an op another version adds or
//! drops leaves every other op's key alone. An op's envelope covers every step of the
//! baseline run that kept op records.
//!
//! The file is TOML, one line per op, written to be read in a review and edited where a
//! tolerance needs to change.

use super::facts::headroom_checked;
use crate::dtype::{DType, BF16, FP16};
use crate::error::{Error, Result};
use crate::trace::record::{Header, OpRecord, Phase, StepRecord};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::Path;

/// Layout version of the lockfile; a reader refuses a newer one.
pub const LOCK_VERSION: u32 = 1;

/// The lockfile's default name, for `--out` and `--fail-on drift`.
pub const DEFAULT_LOCK: &str = "amprobe.lock";

/// What a run that has ops the lock lacks, or lacks ops the lock has, does to the check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UnmatchedOps {
    /// Changed ops break the rule: the lock no longer describes the model.
    Fail,
    /// Changed ops are listed but do not break the rule.
    Ignore,
}

/// The limits a later run is held to. Every one is a field of the file's `[tolerances]`
/// table, documented in the file's own comments.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tolerances {
    /// An op's largest finite |x| may grow up to this factor over the lock's.
    pub max_abs_factor: f64,
    /// A forward op's headroom to the 16-bit maximum (binades, log2(max / max |x|)) may
    /// not fall below this, unless the lock's was already lower.
    pub headroom_binades: f64,
    /// A non-finite value in an op whose envelope has none breaks the rule.
    pub new_nonfinite: bool,
    /// Values flushed to zero by rounding, in an op whose envelope has none, break the
    /// rule when they are more than `new_flush_share` of the op's nonzero results.
    pub new_flush: bool,
    /// The share of an op's nonzero results a new flush must pass to count (0: any one
    /// value). Machines' kernels differ in the last bits of a product, which moves single
    /// values across the flush threshold.
    pub new_flush_share: f64,
    /// The share of an op's nonzero results that rounding flushed may grow by this much
    /// (a fraction: 0.01 is one percentage point) over the lock's.
    pub flush_share_delta: f64,
    /// The share of zeros in an op's output may leave the lock's range by this much.
    pub zero_share_delta: f64,
    /// The share of subnormal values may leave the lock's range by this much.
    pub subnormal_share_delta: f64,
    /// The smallest binade of an op's nonzero values may fall this many binades below the
    /// lock's (`inf`: not checked).
    pub min_exp_drop: f64,
    /// A step whose loss scale or skip differs from the lock's breaks the rule.
    pub scale_path: bool,
    /// Ops the lock has and the run lacks, or the other way round.
    pub unmatched_ops: UnmatchedOps,
}

impl Default for Tolerances {
    fn default() -> Self {
        Tolerances {
            max_abs_factor: 2.0,
            headroom_binades: 1.0,
            new_nonfinite: true,
            new_flush: true,
            new_flush_share: 1e-4,
            flush_share_delta: 0.01,
            zero_share_delta: 0.05,
            subnormal_share_delta: 0.05,
            min_exp_drop: f64::INFINITY,
            scale_path: true,
            unmatched_ops: UnmatchedOps::Fail,
        }
    }
}

/// One step of the loss-scale path.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScalePoint {
    /// Step number.
    pub step: u64,
    /// Loss scale of the step's backward.
    pub before: f64,
    /// Loss scale after the scaler's update.
    pub after: f64,
    /// The optimizer step was skipped.
    pub skipped: bool,
}

/// What identifies an op across runs: its kind and its occurrence among ops of that kind
/// within a step.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct OpKey {
    /// Micro-batch.
    pub micro: u32,
    /// Phase.
    pub phase: Phase,
    /// Op name.
    pub op: String,
    /// Dotted module path.
    pub module: String,
    /// For backward ops: the input the gradient is for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wrt: Option<String>,
    /// Occurrence among the step's ops of this kind (0-based).
    pub nth: u32,
}

impl OpKey {
    /// `forward `matmul` in `h.0.attn`` (with the occurrence when it is not the first,
    /// the micro-batch when it is not 0, and the gradient input of a backward op).
    pub fn describe(&self) -> String {
        let phase = self.phase.name();
        let module = crate::trace::record::module_name(&self.module);
        let mut s = format!("{phase} `{}` in `{module}`", self.op);
        if let Some(w) = &self.wrt {
            let _ = write!(s, " (grad of {w})");
        }
        if self.nth > 0 {
            let _ = write!(s, " #{}", self.nth + 1);
        }
        if self.micro > 0 {
            let _ = write!(s, ", micro-batch {}", self.micro);
        }
        s
    }
}

/// The envelope of one op over the baseline's steps with op records.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OpEnvelope {
    /// Micro-batch.
    pub micro: u32,
    /// Phase.
    pub phase: Phase,
    /// Op name.
    pub op: String,
    /// Dotted module path.
    pub module: String,
    /// For backward ops: the input the gradient is for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wrt: Option<String>,
    /// Occurrence among the step's ops of this kind (0-based).
    pub nth: u32,
    /// Output dtype (PyTorch's name).
    pub dtype: String,
    /// Steps the op was seen in.
    pub steps: u64,
    /// Largest finite |x|.
    pub max_abs: f64,
    /// Smallest and largest binade (`floor(log2 |x|)`) of the finite nonzero values;
    /// absent when there were none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exp: Option<[i32; 2]>,
    /// Binades between the largest finite |x| and the 16-bit maximum, at the step with
    /// the least (forward ops only; absent for scaler bookkeeping, masks and other phases).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub headroom_binades: Option<f64>,
    /// Lowest and highest share of zeros.
    pub zero_share: [f64; 2],
    /// Lowest and highest share of subnormal values.
    pub subnormal_share: [f64; 2],
    /// Most NaN and ±inf values in one step (an attention mask's own -inf left out).
    pub nonfinite: u64,
    /// Most values rounding flushed to zero in one step.
    pub flushed: u64,
    /// Highest share of the nonzero results that rounding flushed.
    pub flush_share: f64,
    /// Most finite values rounding sent to inf in one step.
    pub rounded_to_inf: u64,
}

impl OpEnvelope {
    /// The op's key.
    pub fn key(&self) -> OpKey {
        OpKey {
            micro: self.micro,
            phase: self.phase,
            op: self.op.clone(),
            module: self.module.clone(),
            wrt: self.wrt.clone(),
            nth: self.nth,
        }
    }
}

/// One op's figures in one step, as the envelope and the drift check read them.
#[derive(Debug, Clone, PartialEq)]
pub struct OpFigures {
    /// Output dtype.
    pub dtype: String,
    /// Largest finite |x|.
    pub max_abs: f64,
    /// Binade range of the finite nonzero values.
    pub exp: Option<[i32; 2]>,
    /// Headroom in binades, where it is checked.
    pub headroom_binades: Option<f64>,
    /// Share of zeros.
    pub zero_share: f64,
    /// Share of subnormals.
    pub subnormal_share: f64,
    /// Non-finite values not written by a mask.
    pub nonfinite: u64,
    /// Values flushed to zero by rounding.
    pub flushed: u64,
    /// Flushed share of the nonzero results.
    pub flush_share: f64,
    /// Finite values rounding sent to inf.
    pub rounded_to_inf: u64,
}

/// The largest finite value of the 16-bit type a run's headroom is measured against: the
/// autocast dtype when it is bf16, else fp16 (what an fp32 run would have to fit).
pub fn sixteen_bit_max(sixteen_bit: DType) -> f64 {
    if sixteen_bit == DType::BF16 {
        BF16.max
    } else {
        FP16.max
    }
}

/// The 16-bit type of a run, from its header: bf16 under bf16 autocast or storage, else
/// fp16.
pub fn sixteen_bit_of(h: &Header) -> DType {
    match h.autocast_dtype {
        Some(DType::BF16) => DType::BF16,
        _ if h.precision.contains("bf16") || h.precision.contains("bfloat16") => DType::BF16,
        _ => DType::F16,
    }
}

fn share(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        part as f64 / whole as f64
    }
}

/// The figures of `op`, headroom against `max16`.
pub fn figures(op: &OpRecord, max16: f64) -> OpFigures {
    let s = &op.stats;
    let exp = match (s.exp_hist.min_exp(), s.exp_hist.max_exp()) {
        (Some(lo), Some(hi)) => Some([lo, hi]),
        _ => None,
    };
    let headroom_binades = (headroom_checked(op) && !op.additive_mask).then(|| {
        if s.max_abs == 0.0 {
            f64::INFINITY
        } else {
            (max16 / s.max_abs).log2()
        }
    });
    let flushed = op.rounding.underflow;
    OpFigures {
        dtype: op.output.dtype.name().to_string(),
        max_abs: s.max_abs,
        exp,
        headroom_binades,
        zero_share: share(s.zeros, s.numel),
        subnormal_share: share(s.subnormal, s.numel),
        nonfinite: s.nonfinite().saturating_sub(op.masked_neg_inf),
        flushed,
        flush_share: share(flushed, s.finite_nonzero() + flushed),
        rounded_to_inf: op.rounding.overflow,
    }
}

/// The keys of a step's ops, in the step's order.
pub fn keys(ops: &[OpRecord]) -> Vec<OpKey> {
    let mut seen: HashMap<(u32, Phase, &str, &str, Option<&str>), u32> = HashMap::new();
    ops.iter()
        .map(|o| {
            let n = seen
                .entry((
                    o.micro,
                    o.phase,
                    o.op.as_str(),
                    o.module.as_str(),
                    o.wrt.as_deref(),
                ))
                .or_insert(0);
            let key = OpKey {
                micro: o.micro,
                phase: o.phase,
                op: o.op.clone(),
                module: o.module.clone(),
                wrt: o.wrt.clone(),
                nth: *n,
            };
            *n += 1;
            key
        })
        .collect()
}

/// A whole lockfile.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Lock {
    /// [`LOCK_VERSION`] of the writer.
    pub lock_version: u32,
    /// The run's model.
    pub model: String,
    /// The run's precision mode.
    pub precision: String,
    /// The 16-bit type headroom is measured against (`float16` or `bfloat16`).
    pub sixteen_bit: String,
    /// Steps of the run.
    pub steps: u64,
    /// Steps with op records (the envelopes cover these).
    pub steps_with_ops: u64,
    /// The host's GEMM kernels, when the trace said.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_gemm: Option<String>,
    /// The limits.
    pub tolerances: Tolerances,
    /// What the run showed.
    pub envelopes: Envelopes,
}

/// The `[envelopes]` table: the loss-scale path and every op's envelope.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Envelopes {
    /// The loss-scale path (empty without a scaler).
    #[serde(default)]
    pub scale: Vec<ScalePoint>,
    /// Every op's envelope, in the order the ops first ran.
    #[serde(default)]
    pub ops: Vec<OpEnvelope>,
}

/// Builds a lock from step records fed one at a time (op records are not kept).
#[derive(Debug, Clone)]
pub struct LockBuilder {
    lock: Lock,
    max16: f64,
    index: HashMap<OpKey, usize>,
    has_scaler: bool,
}

impl LockBuilder {
    /// A builder for a run with this header.
    pub fn new(h: &Header) -> LockBuilder {
        let sixteen = sixteen_bit_of(h);
        LockBuilder {
            lock: Lock {
                lock_version: LOCK_VERSION,
                model: h.model.clone(),
                precision: h.precision.clone(),
                sixteen_bit: sixteen.name().to_string(),
                steps: 0,
                steps_with_ops: 0,
                host_gemm: h.host_gemm.clone(),
                tolerances: Tolerances::default(),
                envelopes: Envelopes::default(),
            },
            max16: sixteen_bit_max(sixteen),
            index: HashMap::new(),
            has_scaler: !h.scaler.is_null()
                && h.scaler.get("kind").and_then(|k| k.as_str()) != Some("none"),
        }
    }

    /// Takes one step into the envelopes and the scale path.
    pub fn observe(&mut self, s: &StepRecord) {
        self.lock.steps += 1;
        if self.has_scaler {
            self.lock.envelopes.scale.push(ScalePoint {
                step: s.step,
                before: s.scale_before,
                after: s.scale_after,
                skipped: s.skipped,
            });
        }
        let Some(ops) = &s.ops else { return };
        self.lock.steps_with_ops += 1;
        for (key, op) in keys(ops).into_iter().zip(ops) {
            let f = figures(op, self.max16);
            match self.index.get(&key) {
                Some(&i) => widen(&mut self.lock.envelopes.ops[i], &f),
                None => {
                    self.index
                        .insert(key.clone(), self.lock.envelopes.ops.len());
                    self.lock.envelopes.ops.push(OpEnvelope {
                        micro: key.micro,
                        phase: key.phase,
                        op: key.op.clone(),
                        module: key.module.clone(),
                        wrt: key.wrt.clone(),
                        nth: key.nth,
                        dtype: f.dtype,
                        steps: 1,
                        max_abs: f.max_abs,
                        exp: f.exp,
                        headroom_binades: f.headroom_binades,
                        zero_share: [f.zero_share; 2],
                        subnormal_share: [f.subnormal_share; 2],
                        nonfinite: f.nonfinite,
                        flushed: f.flushed,
                        flush_share: f.flush_share,
                        rounded_to_inf: f.rounded_to_inf,
                    });
                }
            }
        }
    }

    /// The lock, with default tolerances; headroom rounded to a thousandth of a binade
    /// (what the file holds).
    pub fn finish(mut self) -> Lock {
        for e in &mut self.lock.envelopes.ops {
            e.headroom_binades = e.headroom_binades.map(|h| (h * 1000.0).round() / 1000.0);
        }
        self.lock
    }
}

fn widen(e: &mut OpEnvelope, f: &OpFigures) {
    e.steps += 1;
    e.max_abs = e.max_abs.max(f.max_abs);
    e.exp = match (e.exp, f.exp) {
        (Some(a), Some(b)) => Some([a[0].min(b[0]), a[1].max(b[1])]),
        (a, b) => a.or(b),
    };
    e.headroom_binades = match (e.headroom_binades, f.headroom_binades) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    };
    e.zero_share = [
        e.zero_share[0].min(f.zero_share),
        e.zero_share[1].max(f.zero_share),
    ];
    e.subnormal_share = [
        e.subnormal_share[0].min(f.subnormal_share),
        e.subnormal_share[1].max(f.subnormal_share),
    ];
    e.nonfinite = e.nonfinite.max(f.nonfinite);
    e.flushed = e.flushed.max(f.flushed);
    e.flush_share = e.flush_share.max(f.flush_share);
    e.rounded_to_inf = e.rounded_to_inf.max(f.rounded_to_inf);
}

/// A TOML basic string.
fn toml_str(s: &str) -> String {
    let mut o = String::with_capacity(s.len() + 2);
    o.push('"');
    for c in s.chars() {
        match c {
            '"' => o.push_str("\\\""),
            '\\' => o.push_str("\\\\"),
            '\n' => o.push_str("\\n"),
            '\t' => o.push_str("\\t"),
            c if c.is_control() => {
                let _ = write!(o, "\\u{:04X}", c as u32);
            }
            c => o.push(c),
        }
    }
    o.push('"');
    o
}

/// A TOML float: the shortest text that reads back as the same f64.
fn toml_f64(x: f64) -> String {
    if x.is_nan() {
        "nan".into()
    } else if x.is_infinite() {
        if x > 0.0 { "inf" } else { "-inf" }.into()
    } else {
        // `{:?}` always has a point or an exponent, as TOML wants.
        format!("{x:?}")
    }
}

const HEAD: &str = "\
# amprobe numerics lockfile: the envelope each op's values showed in a baseline run.
# Written by `amprobe baseline`; checked by `amprobe run ... --fail-on drift[=FILE]`
# (and `amprobe report TRACE --fail-on drift[=FILE]`). Commit it; rewrite it with
# `amprobe baseline` when a change to the numbers is intended.
#
# Per op (keyed by micro-batch, phase, op, module, gradient input and occurrence):
#   max_abs          largest finite |x|
#   exp              smallest and largest binade, floor(log2 |x|), of the nonzero values
#   headroom_binades log2(16-bit max / max_abs), forward ops only, least over the steps
#   zero_share, subnormal_share   lowest and highest share over the steps
#   nonfinite        most NaN/Inf values in a step (a mask's own -inf left out)
#   flushed, flush_share          values rounding flushed to zero (most; highest share)
#   rounded_to_inf   finite values rounding sent to inf (most in a step)
";

const TOLERANCES_DOC: &str = "\
# What a later run may do before the `drift` rule breaks (edit to taste):
#   max_abs_factor         an op's max |x| may grow up to this factor
#   headroom_binades       a forward op's headroom may not fall below this many binades
#                          (unless the lock's was already lower)
#   new_nonfinite          break on a NaN/Inf in an op that had none
#   new_flush              break on a flush to zero in an op that had none, when it
#                          takes more than new_flush_share of the op's nonzero results
#   new_flush_share        (0: any value; the default, one in 10,000, is above what the
#                          last bits of another machine's products move across the
#                          flush threshold)
#   flush_share_delta      the flushed share may grow this much (0.01 = one point)
#   zero_share_delta       the share of zeros may leave its range by this much
#   subnormal_share_delta  the share of subnormals may leave its range by this much
#   min_exp_drop           the smallest binade may fall this many binades (inf: off)
#   scale_path             break when a step's loss scale or skip differs
#   unmatched_ops          \"fail\" or \"ignore\": ops the lock has and the run lacks, or
#                          the other way round (a changed model or library)
";

impl Lock {
    /// The lock as the file's text.
    pub fn to_toml(&self) -> String {
        let mut o = String::from(HEAD);
        let _ = writeln!(o, "\nlock_version = {}", self.lock_version);
        let _ = writeln!(o, "model = {}", toml_str(&self.model));
        let _ = writeln!(o, "precision = {}", toml_str(&self.precision));
        let _ = writeln!(o, "sixteen_bit = {}", toml_str(&self.sixteen_bit));
        let _ = writeln!(o, "steps = {}", self.steps);
        let _ = writeln!(o, "steps_with_ops = {}", self.steps_with_ops);
        if let Some(g) = &self.host_gemm {
            let _ = writeln!(o, "host_gemm = {}", toml_str(g));
        }
        let t = &self.tolerances;
        let _ = writeln!(o, "\n{TOLERANCES_DOC}[tolerances]");
        let _ = writeln!(o, "max_abs_factor = {}", toml_f64(t.max_abs_factor));
        let _ = writeln!(o, "headroom_binades = {}", toml_f64(t.headroom_binades));
        let _ = writeln!(o, "new_nonfinite = {}", t.new_nonfinite);
        let _ = writeln!(o, "new_flush = {}", t.new_flush);
        let _ = writeln!(o, "new_flush_share = {}", toml_f64(t.new_flush_share));
        let _ = writeln!(o, "flush_share_delta = {}", toml_f64(t.flush_share_delta));
        let _ = writeln!(o, "zero_share_delta = {}", toml_f64(t.zero_share_delta));
        let _ = writeln!(
            o,
            "subnormal_share_delta = {}",
            toml_f64(t.subnormal_share_delta)
        );
        let _ = writeln!(o, "min_exp_drop = {}", toml_f64(t.min_exp_drop));
        let _ = writeln!(o, "scale_path = {}", t.scale_path);
        let unmatched = match t.unmatched_ops {
            UnmatchedOps::Fail => "fail",
            UnmatchedOps::Ignore => "ignore",
        };
        let _ = writeln!(o, "unmatched_ops = \"{unmatched}\"");
        o.push_str("\n[envelopes]\n# The loss-scale path, one step a line.\nscale = [\n");
        for p in &self.envelopes.scale {
            let _ = writeln!(
                o,
                "  {{ step = {}, before = {}, after = {}, skipped = {} }},",
                p.step,
                toml_f64(p.before),
                toml_f64(p.after),
                p.skipped
            );
        }
        o.push_str("]\n\n# One op a line, in the order the ops first ran.\nops = [\n");
        for e in &self.envelopes.ops {
            let k = e;
            let phase = k.phase.name();
            let _ = write!(
                o,
                "  {{ micro = {}, phase = \"{phase}\", op = {}, module = {}",
                k.micro,
                toml_str(&k.op),
                toml_str(&k.module)
            );
            if let Some(w) = &k.wrt {
                let _ = write!(o, ", wrt = {}", toml_str(w));
            }
            let _ = write!(
                o,
                ", nth = {}, dtype = {}, steps = {}, max_abs = {}",
                k.nth,
                toml_str(&e.dtype),
                e.steps,
                toml_f64(e.max_abs)
            );
            if let Some([lo, hi]) = e.exp {
                let _ = write!(o, ", exp = [{lo}, {hi}]");
            }
            if let Some(h) = e.headroom_binades {
                let _ = write!(o, ", headroom_binades = {}", toml_f64(h));
            }
            let _ = writeln!(
                o,
                ", zero_share = [{}, {}], subnormal_share = [{}, {}], nonfinite = {}, \
                 flushed = {}, flush_share = {}, rounded_to_inf = {} }},",
                toml_f64(e.zero_share[0]),
                toml_f64(e.zero_share[1]),
                toml_f64(e.subnormal_share[0]),
                toml_f64(e.subnormal_share[1]),
                e.nonfinite,
                e.flushed,
                toml_f64(e.flush_share),
                e.rounded_to_inf
            );
        }
        o.push_str("]\n");
        o
    }

    /// Writes the lock to `path`.
    pub fn write(&self, path: &Path) -> Result<()> {
        std::fs::write(path, self.to_toml()).map_err(|e| Error::io(path, e))
    }

    /// Parses a lockfile's text; `what` names it in errors.
    pub fn parse(text: &str, what: &str) -> Result<Lock> {
        let bad = |message: String| Error::Config {
            context: format!("lockfile {what}"),
            message,
        };
        let lock: Lock = toml::from_str(text).map_err(|e| bad(e.to_string()))?;
        if lock.lock_version > LOCK_VERSION {
            return Err(bad(format!(
                "lock_version {} is newer than this amprobe reads ({LOCK_VERSION})",
                lock.lock_version
            )));
        }
        let t = &lock.tolerances;
        let nonneg = [
            ("max_abs_factor", t.max_abs_factor),
            ("new_flush_share", t.new_flush_share),
            ("flush_share_delta", t.flush_share_delta),
            ("zero_share_delta", t.zero_share_delta),
            ("subnormal_share_delta", t.subnormal_share_delta),
            ("min_exp_drop", t.min_exp_drop),
        ];
        for (name, v) in nonneg {
            if v.is_nan() || v < 0.0 {
                return Err(bad(format!(
                    "tolerances.{name} = {v}: expected a number of 0 or more"
                )));
            }
        }
        if t.max_abs_factor < 1.0 {
            return Err(bad(format!(
                "tolerances.max_abs_factor = {}: expected 1 or more (a growth factor)",
                t.max_abs_factor
            )));
        }
        if t.headroom_binades.is_nan() {
            return Err(bad("tolerances.headroom_binades is NaN".into()));
        }
        let mut seen = std::collections::HashSet::new();
        for e in &lock.envelopes.ops {
            let k = e.key();
            if !seen.insert(k.clone()) {
                return Err(bad(format!(
                    "op {} appears twice (a key is micro, phase, op, module, wrt and nth)",
                    k.describe()
                )));
            }
        }
        Ok(lock)
    }

    /// Reads a lockfile.
    pub fn read(path: &Path) -> Result<Lock> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::Config {
            context: format!("lockfile {}", path.display()),
            message: format!("cannot be read ({e}); `amprobe baseline` writes one"),
        })?;
        Lock::parse(&text, &path.display().to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strings_and_floats_read_back() {
        for s in [
            "plain",
            "a\"b",
            "back\\slash",
            "tab\there",
            "new\nline",
            "\u{1}",
        ] {
            let t = format!("x = {}", toml_str(s));
            let v: toml::Table = toml::from_str(&t).unwrap();
            assert_eq!(v["x"].as_str(), Some(s));
        }
        for x in [0.0, 1.0, 65504.0, 1e-7, 3.0e38, 1e300, 0.1, f64::INFINITY] {
            let t = format!("x = {}", toml_f64(x));
            let v: toml::Table = toml::from_str(&t).unwrap();
            assert_eq!(v["x"].as_float(), Some(x), "{t}");
        }
    }

    #[test]
    fn bad_tolerances_name_the_field() {
        let mut lock = Lock {
            lock_version: 1,
            model: "m".into(),
            precision: "fp16-amp".into(),
            sixteen_bit: "float16".into(),
            steps: 0,
            steps_with_ops: 0,
            host_gemm: None,
            tolerances: Tolerances::default(),
            envelopes: Envelopes::default(),
        };
        assert_eq!(Lock::parse(&lock.to_toml(), "t").unwrap(), lock);
        lock.tolerances.zero_share_delta = -1.0;
        let e = Lock::parse(&lock.to_toml(), "t").unwrap_err().to_string();
        assert!(
            e.contains("lockfile t") && e.contains("zero_share_delta"),
            "{e}"
        );
        lock.tolerances.zero_share_delta = 0.0;
        lock.tolerances.max_abs_factor = 0.5;
        let e = Lock::parse(&lock.to_toml(), "t").unwrap_err().to_string();
        assert!(e.contains("max_abs_factor"), "{e}");
        lock.tolerances.max_abs_factor = 2.0;
        lock.lock_version = 99;
        let e = Lock::parse(&lock.to_toml(), "t").unwrap_err().to_string();
        assert!(e.contains("lock_version 99"), "{e}");
        let e = Lock::parse("lock_version = 1\n", "t")
            .unwrap_err()
            .to_string();
        assert!(e.contains("missing field"), "{e}");
    }
}
