//! `amprobe run CONFIG [flags]`: AMP training steps with probes, a trace and a summary.

use super::companion;
use super::out::{out, outln};
use amprobe::config::RunConfig;
use amprobe::report::gate::{self, Gate};
use amprobe::runner::{run as run_training, RunOptions, RunSummary};
use amprobe::trace::record::Record;
use anyhow::Context;
use clap::Args;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct RunArgs {
    /// Run configuration (TOML); optional when --hf or --hf-config is given.
    config: Option<PathBuf>,
    #[command(flatten)]
    pub(super) flags: RunFlags,
    #[command(flatten)]
    pub(super) diag: super::diagnose_args::DiagnoseArgs,
    /// With several precisions (`--precision fp16,bf16,fp32`): where the comparison goes
    /// (default: next to the traces, `TRACE-compare/`).
    #[arg(long, value_name = "DIR")]
    pub(super) compare_out: Option<PathBuf>,
    /// CI gate: exit 1 when a rule breaks (nonfinite, skip-rate>X%, headroom>X%,
    /// underflow>X%, scale-collapse, drift[=FILE]; comma-separated). `drift` holds the run
    /// to a lockfile from `amprobe baseline` (default amprobe.lock) and keeps every step's
    /// op records unless --sample-every says otherwise.
    #[arg(long, value_name = "RULES")]
    pub(super) fail_on: Option<String>,
    /// A PyTorch training script to run instead (after `--`): the companion amprobe carries
    /// is put on its Python's path and attaches to the model, optimizers and scaler it
    /// makes (or to those its own `amprobe_torch.watch(...)` names), and the captured trace
    /// is diagnosed as a run of amprobe's own (only --trace, --summary-json, --sample-every
    /// and the diagnosis and gate flags apply).
    #[arg(last = true, value_name = "CMD")]
    pub(super) command: Vec<String>,
}

/// The flags that override a run configuration, shared by `run` and `tui CONFIG`.
#[derive(Args, Debug, Default)]
pub struct RunFlags {
    /// Hugging Face T5 checkpoint directory (config.json + model.safetensors or an index).
    #[arg(long, value_name = "DIR")]
    pub hf: Option<PathBuf>,
    /// Hugging Face config.json (with --weights).
    #[arg(long, value_name = "FILE")]
    pub hf_config: Option<PathBuf>,
    /// Weights (safetensors file, or a checkpoint directory).
    #[arg(long, value_name = "FILE")]
    weights: Option<PathBuf>,
    /// Token ids: safetensors with `input_ids` [batch, seq] and optional `labels`.
    #[arg(long, value_name = "FILE")]
    inputs: Option<PathBuf>,
    /// Batch size of seeded synthetic data.
    #[arg(long)]
    batch: Option<usize>,
    /// Sequence length of seeded synthetic token ids.
    #[arg(long)]
    seq: Option<usize>,
    /// transformers' fp16 clamp in T5Block.
    #[arg(long)]
    t5_clamp: bool,
    /// Turn on one of the model's fp16 switches from transformers' config (GPT-2:
    /// reorder_and_upcast_attn, scale_attn_by_inverse_layer_idx); repeatable.
    #[arg(long = "switch", value_name = "NAME")]
    switches: Vec<String>,
    /// Precision mode: fp32, fp16, bf16, o2, o2-bf16, half, bfloat16-pure.
    #[arg(long)]
    pub precision: Option<String>,
    /// Optimizer steps.
    #[arg(long)]
    steps: Option<u64>,
    /// Micro-batches per optimizer step.
    #[arg(long)]
    accumulate: Option<u32>,
    /// Clip the total gradient norm (after unscaling).
    #[arg(long, value_name = "MAX_NORM")]
    clip: Option<f32>,
    /// sgd, adam or adamw.
    #[arg(long)]
    optimizer: Option<String>,
    /// Loss scaler: default, maxclip, hysteresis, fixed, none.
    #[arg(long)]
    scaler: Option<String>,
    /// Initial loss scale.
    #[arg(long)]
    init_scale: Option<f32>,
    /// Clean steps before the scale grows.
    #[arg(long)]
    growth_interval: Option<u32>,
    /// Scale growth factor.
    #[arg(long)]
    growth_factor: Option<f64>,
    /// Scale backoff factor.
    #[arg(long)]
    backoff_factor: Option<f64>,
    /// Cap of the `maxclip` scaler.
    #[arg(long)]
    max_scale: Option<f32>,
    /// Learning rate.
    #[arg(long)]
    lr: Option<f64>,
    /// Seed.
    #[arg(long)]
    seed: Option<u64>,
    /// Autocast policy table: cuda (default) or cpu.
    #[arg(long)]
    policy: Option<String>,
    /// Keep modules matching this dotted pattern in fp32 (repeatable).
    #[arg(long = "keep-fp32", value_name = "PATTERN")]
    keep_fp32: Vec<String>,
    /// Write the trace (JSON Lines) here.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Write the summary JSON here.
    #[arg(long)]
    pub summary_json: Option<PathBuf>,
    /// Keep full op records every N steps.
    #[arg(long)]
    pub sample_every: Option<u64>,
    /// Switch probes off (to measure their cost).
    #[arg(long)]
    no_probes: bool,
    /// Blame precision loss: every op of a step with op records (forward, backward,
    /// optimizer) is recomputed in f64 from its own inputs and from an all-f64 shadow of the step, giving
    /// the error it introduces and the error it inherits (on a device, each op is read back
    /// for it).
    #[arg(long)]
    blame: bool,
    /// Where the step runs: auto (default: a GPU that passes a step check against the CPU
    /// emulator, else the CPU; never the simulated device), cpu, or cuda (the device, a
    /// simulated one included).
    #[arg(long, value_name = "auto|cpu|cuda")]
    backend: Option<String>,
}

impl RunFlags {
    /// True when any flag that configures a run is given (`--trace` aside, which `tui` also
    /// uses to name a trace to replay).
    pub fn configures_a_run(&self) -> bool {
        self.configures_training() || self.summary_json.is_some() || self.sample_every.is_some()
    }

    /// True when a flag sets the model, data, precision or training of amprobe's own run:
    /// nothing a script that trains itself (`run -- CMD`) can take.
    pub fn configures_training(&self) -> bool {
        let opts = [
            self.hf.is_some(),
            self.hf_config.is_some(),
            self.weights.is_some(),
            self.inputs.is_some(),
            self.batch.is_some(),
            self.seq.is_some(),
            self.t5_clamp,
            !self.switches.is_empty(),
            self.precision.is_some(),
            self.steps.is_some(),
            self.accumulate.is_some(),
            self.clip.is_some(),
            self.optimizer.is_some(),
            self.scaler.is_some(),
            self.init_scale.is_some(),
            self.growth_interval.is_some(),
            self.growth_factor.is_some(),
            self.backoff_factor.is_some(),
            self.max_scale.is_some(),
            self.lr.is_some(),
            self.seed.is_some(),
            self.policy.is_some(),
            !self.keep_fp32.is_empty(),
            self.no_probes,
            self.blame,
            self.backend.is_some(),
        ];
        opts.iter().any(|&x| x)
    }
}

/// Sets every given flag in the config (flags win over the file).
pub fn apply_flags(cfg: &mut RunConfig, a: &RunFlags) {
    // Paths given on the command line are relative to the working directory.
    let cwd = |p: &Option<PathBuf>| {
        p.as_ref()
            .map(|p| std::path::absolute(p).unwrap_or(p.clone()))
    };
    // A checkpoint on the command line names its own architecture (config.json's
    // model_type), whatever kind the config file had.
    if a.hf.is_some() {
        cfg.model.hf = cwd(&a.hf);
        cfg.model.kind = None;
    }
    if a.hf_config.is_some() {
        cfg.model.hf_config = cwd(&a.hf_config);
        cfg.model.kind = None;
    }
    if a.weights.is_some() {
        cfg.model.weights = cwd(&a.weights);
    }
    if a.inputs.is_some() {
        cfg.data.inputs = cwd(&a.inputs);
    }
    if let Some(b) = a.batch {
        cfg.data.batch = Some(b);
    }
    if let Some(s) = a.seq {
        cfg.data.seq = Some(s);
    }
    if a.t5_clamp {
        cfg.model.t5_clamp = Some(true);
    }
    if !a.switches.is_empty() {
        let s = cfg.model.switches.get_or_insert_with(Vec::new);
        for name in &a.switches {
            if !s.contains(name) {
                s.push(name.clone());
            }
        }
    }
    let t = &mut cfg.train;
    macro_rules! set {
        ($dst:expr, $src:expr) => {
            if let Some(v) = $src.clone() {
                $dst = Some(v);
            }
        };
    }
    set!(t.precision, a.precision);
    set!(t.steps, a.steps);
    set!(t.accumulate, a.accumulate);
    set!(t.clip, a.clip);
    set!(t.optimizer, a.optimizer);
    set!(t.lr, a.lr);
    set!(t.seed, a.seed);
    set!(t.policy, a.policy);
    set!(t.backend, a.backend);
    if !a.keep_fp32.is_empty() {
        t.keep_fp32 = Some(a.keep_fp32.clone());
    }
    let s = &mut cfg.scaler;
    set!(s.kind, a.scaler);
    set!(s.init_scale, a.init_scale);
    set!(s.growth_interval, a.growth_interval);
    set!(s.growth_factor, a.growth_factor);
    set!(s.backoff_factor, a.backoff_factor);
    set!(s.max_scale, a.max_scale);
    let p = &mut cfg.probe;
    set!(p.trace, a.trace);
    set!(p.summary_json, a.summary_json);
    set!(p.sample_every, a.sample_every);
    if a.no_probes {
        p.enabled = Some(false);
    }
    if a.blame {
        p.blame = Some(true);
    }
}

/// A scale as a person reads it: plain up to 2^24, then in scientific notation.
fn scale(x: f64) -> String {
    if x != 0.0 && !(1e-3..=16777216.0).contains(&x.abs()) {
        format!("{x:.3e}")
    } else {
        format!("{x}")
    }
}

/// The run's summary for a person, on stdout.
pub(super) fn print_human(s: &RunSummary) -> std::io::Result<()> {
    if let Some(w) = &s.backend_warning {
        eprintln!("amprobe: warning: {w}");
    }
    match &s.device {
        Some(d) if d.contains("(simulated)") => outln!(
            "amprobe: {} under {} on {d} — a simulated device: its results check the CUDA \
             path, they are not a GPU's",
            s.model,
            s.precision
        )?,
        Some(d) => outln!("amprobe: {} under {} on {d}", s.model, s.precision)?,
        None => outln!("amprobe: {} under {}", s.model, s.precision)?,
    }
    for note in &s.capture_notes {
        outln!("  {note}")?;
    }
    if let Some(h) = amprobe::diagnose::text::steps_heading(s) {
        outln!("{h}")?;
    }
    for st in &s.steps {
        outln!(
            "  step {:>4}  loss {:>12.6}  scale {:>10} -> {:<10} {}",
            st.step,
            st.loss.unwrap_or(f64::NAN),
            scale(st.scale_before),
            scale(st.scale_after),
            match (&st.skip_cause, st.skipped) {
                (Some(c), _) => format!("SKIPPED ({})", c.kind),
                (None, true) => "SKIPPED (inf/nan gradient)".to_string(),
                _ => String::new(),
            }
        )?;
    }
    outln!("verdict: {}", s.verdict)?;
    for line in amprobe::diagnose::text::origin_lines(s) {
        outln!("{line}")?;
    }
    if s.skipped_steps > 0 {
        outln!("  skipped steps: {} of {}", s.skipped_steps, s.steps.len())?;
    }
    for e in &s.events {
        outln!("  event: {e}")?;
    }
    for line in amprobe::diagnose::text::diagnosis_lines(s) {
        outln!("{line}")?;
    }
    if let Some(t) = &s.trace {
        outln!("trace: {}", t.display())?;
    }
    Ok(())
}

/// The run configuration the arguments describe (config file, then flags).
pub(super) fn config(a: &RunArgs) -> anyhow::Result<RunConfig> {
    let mut cfg = match &a.config {
        Some(p) => RunConfig::load(p)?,
        None if a.flags.hf.is_some() || a.flags.hf_config.is_some() => RunConfig::default(),
        None => anyhow::bail!("give a run configuration (TOML) or --hf DIR / --hf-config FILE"),
    };
    apply_flags(&mut cfg, &a.flags);
    Ok(cfg)
}

/// The gate of `--fail-on`, its lockfiles read; `None` without the flag.
pub(super) fn gate_of(a: &RunArgs) -> anyhow::Result<Option<Gate>> {
    a.fail_on
        .as_deref()
        .map(|r| Gate::new(gate::parse_rules(r)?))
        .transpose()
        .context("--fail-on")
}

/// Runs with these diagnosis options and writes the summary JSON when configured.
pub(super) fn run_with(
    cfg: &RunConfig,
    diagnose: amprobe::diagnose::DiagnoseOptions,
) -> anyhow::Result<RunSummary> {
    run_gated(cfg, diagnose, None)
}

/// Runs, feeding every step record (op records included) to `gate` when one is given.
fn run_gated(
    cfg: &RunConfig,
    diagnose: amprobe::diagnose::DiagnoseOptions,
    gate: Option<&mut Gate>,
) -> anyhow::Result<RunSummary> {
    let (tx, rx) = std::sync::mpsc::channel();
    let opts = RunOptions {
        command_line: std::env::args().collect(),
        progress: true,
        diagnose,
        live: gate.is_some().then_some(tx),
        ..RunOptions::default()
    };
    let summary = run_training(cfg, &opts)?;
    drop(opts);
    if let Some(g) = gate {
        for r in rx.try_iter() {
            match r {
                Record::Header(h) => g.observe_header(&h),
                Record::Step(s) => g.observe(&s),
                Record::End(_) => {}
            }
        }
    }
    if let Some(p) = &cfg.probe.summary_json {
        let text = serde_json::to_string_pretty(&summary)?;
        std::fs::write(p, text + "\n")
            .with_context(|| format!("writing summary {}", p.display()))?;
    }
    Ok(summary)
}

/// `--precision A,B[,C]`: one run per precision on the same weights, data and seed, each
/// with its own trace (`TRACE-<precision>.jsonl`, op records kept every step), then the
/// comparison of all of them against the fp32 run (or the first).
fn run_compared(a: &RunArgs, precisions: &[String]) -> anyhow::Result<i32> {
    use amprobe::report::compare::{
        first_divergence_lines, write_compare, CompareOptions, DEFAULT_THRESHOLD,
    };
    use amprobe::report::TraceFile;
    let base = config(a)?;
    let stem = base
        .probe
        .trace
        .clone()
        .unwrap_or_else(|| PathBuf::from("amprobe-trace.jsonl"));
    let stem = stem.with_extension("");
    let mut traces = Vec::new();
    let mut code = 0;
    for p in precisions {
        let mut cfg = base.clone();
        cfg.train.precision = Some(p.clone());
        if cfg.probe.sample_every.unwrap_or(0) == 0 {
            cfg.probe.sample_every = Some(1);
        }
        let path = PathBuf::from(format!("{}-{p}.jsonl", stem.display()));
        cfg.probe.trace = Some(path.clone());
        cfg.probe.summary_json = base
            .probe
            .summary_json
            .as_ref()
            .map(|s| PathBuf::from(format!("{}-{p}.json", s.with_extension("").display())));
        let mut gate = gate_of(a)?;
        if gate.as_ref().is_some_and(Gate::has_drift) && base.probe.sample_every.is_none() {
            cfg.probe.sample_every = Some(1);
        }
        let summary = run_gated(&cfg, a.diag.options()?, gate.as_mut())?;
        print_human(&summary)?;
        if let Some(g) = gate {
            let outcomes = g.outcomes();
            out!("{}", gate::format_outcomes(&outcomes, gate::stdout_color()))?;
            code = code.max(gate::exit_code(&outcomes));
        }
        outln!()?;
        traces.push(TraceFile::open(&path)?);
    }
    let reference = precisions.iter().position(|p| {
        amprobe::amp::mode::Precision::parse(p).ok() == Some(amprobe::amp::mode::Precision::Fp32)
    });
    let out_dir = a
        .compare_out
        .clone()
        .unwrap_or_else(|| PathBuf::from(format!("{}-compare", stem.display())));
    let out = write_compare(
        &traces,
        &CompareOptions {
            out_dir,
            threshold: DEFAULT_THRESHOLD,
            reference,
        },
    )?;
    for line in first_divergence_lines(&out.comparison) {
        outln!("{line}")?;
    }
    outln!("comparison: {}", out.index_html.display())?;
    Ok(code)
}

/// What a script run under the companion left: its exit status, the header of its trace
/// (rank 0's under torchrun), the diagnosis and every step record (every rank's).
pub(super) struct ScriptRun {
    /// The command's exit status.
    pub status: std::process::ExitStatus,
    /// The trace's header.
    pub header: amprobe::trace::record::Header,
    /// The run's summary.
    pub summary: RunSummary,
    /// Every step record, rank after rank.
    pub steps: Vec<amprobe::trace::record::StepRecord>,
}

/// Runs `command` with the companion amprobe carries ([`super::companion::prepare`]) and
/// its trace path set (`AMPROBE_TRACE`, and `AMPROBE_SAMPLE_EVERY` when given), then reads
/// the trace it wrote. Under torchrun each rank writes its own trace next to the path
/// (`.rank{N}` before the suffix): they are read together (`diagnose::ranks`).
pub(super) fn capture_script(
    command: &[String],
    trace: Option<&std::path::Path>,
    sample_every: Option<u64>,
    opts: amprobe::diagnose::DiagnoseOptions,
) -> anyhow::Result<ScriptRun> {
    use amprobe::diagnose::ranks;
    let trace = trace
        .map(std::path::Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("amprobe-trace.jsonl"));
    let trace =
        std::path::absolute(&trace).with_context(|| format!("trace path {}", trace.display()))?;
    // Traces left by an earlier run (one file or one per rank) must not pass for this one's.
    let old = std::iter::once(trace.clone())
        .chain(ranks::rank_files(&trace)?.into_iter().map(|(_, p)| p));
    for p in old {
        match std::fs::remove_file(&p) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(e).with_context(|| format!("removing the old trace {}", p.display()))
            }
            _ => {}
        }
    }
    let report = companion::discovery_report(&trace);
    companion::remove_old_report(&report)?;
    let mut cmd = std::process::Command::new(&command[0]);
    cmd.args(&command[1..]).env("AMPROBE_TRACE", &trace);
    if let Some(n) = sample_every {
        cmd.env("AMPROBE_SAMPLE_EVERY", n.to_string());
    }
    companion::prepare(&mut cmd, &report)?;
    let status = cmd
        .status()
        .with_context(|| format!("running `{}`", command.join(" ")))?;
    if trace.exists() {
        let t = amprobe::trace::io::read_trace(&trace)?;
        if let Some(src) = t.header.source.as_ref().filter(|s| s.world_size > 1) {
            anyhow::bail!(
                "{} was written by rank {} of {}, in the one file every rank was given: \
                 initialize torch.distributed before amprobe_torch.watch, so that each rank \
                 writes its own ({}, …)",
                trace.display(),
                src.rank,
                src.world_size,
                ranks::rank_path(&trace, 0).display()
            );
        }
        let summary = amprobe::diagnose::summary::summary_of_trace(&t, Some(trace.clone()), opts)?;
        Ok(ScriptRun {
            status,
            header: t.header,
            summary,
            steps: t.steps,
        })
    } else if !ranks::rank_files(&trace)?.is_empty() {
        let rs = ranks::read_rank_traces(&trace)?;
        let summary = ranks::summary_of_ranks(&rs, opts)?;
        let header = rs[0].trace.header.clone();
        Ok(ScriptRun {
            status,
            header,
            summary,
            steps: rs.into_iter().flat_map(|r| r.trace.steps).collect(),
        })
    } else {
        anyhow::bail!(
            "`{}` wrote no trace at {} (nor one per rank, {}) ({status}): {}",
            command.join(" "),
            trace.display(),
            ranks::rank_path(&trace, 0).display(),
            companion::why_no_trace(&report)
        );
    }
}

/// `run [flags] -- CMD ARGS...`: runs the command under the companion
/// ([`capture_script`]), then prints, writes and gates its summary as for a run of
/// amprobe's own. Exits with the command's status when it failed, else the gate's.
fn run_script(a: &RunArgs) -> anyhow::Result<i32> {
    if a.config.is_some() || a.flags.configures_training() {
        anyhow::bail!(
            "a script given after `--` trains itself: a run configuration and the model, data \
             and training flags do not apply to it (--trace, --summary-json, --sample-every, \
             the diagnosis flags and --fail-on do)"
        );
    }
    let mut gate = gate_of(a)?;
    // A lockfile holds every step's ops: they are kept unless the flag says otherwise.
    let drift = gate.as_ref().is_some_and(Gate::has_drift);
    let run = capture_script(
        &a.command,
        a.flags.trace.as_deref(),
        a.flags.sample_every.or(drift.then_some(1)),
        a.diag.options()?,
    )?;
    print_human(&run.summary)?;
    if let Some(p) = &a.flags.summary_json {
        let text = serde_json::to_string_pretty(&run.summary)?;
        std::fs::write(p, text + "\n")
            .with_context(|| format!("writing summary {}", p.display()))?;
    }
    let mut code = 0;
    if let Some(g) = gate.as_mut() {
        g.observe_header(&run.header);
        // Over several ranks the gate sees every rank's steps.
        for s in &run.steps {
            g.observe(s);
        }
        let outcomes = g.outcomes();
        out!("{}", gate::format_outcomes(&outcomes, gate::stdout_color()))?;
        code = gate::exit_code(&outcomes);
    }
    if !run.status.success() {
        eprintln!("amprobe: `{}` failed ({})", a.command.join(" "), run.status);
        return Ok(run.status.code().unwrap_or(1).max(1));
    }
    Ok(code)
}

pub fn run(a: RunArgs) -> anyhow::Result<i32> {
    if !a.command.is_empty() {
        return run_script(&a);
    }
    if let Some(list) = a.flags.precision.as_deref().filter(|p| p.contains(',')) {
        let ps: Vec<String> = list
            .split(',')
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
            .collect();
        for p in &ps {
            amprobe::amp::mode::Precision::parse(p)?;
        }
        return run_compared(&a, &ps);
    }
    let mut cfg = config(&a)?;
    // Rules are checked (and lockfiles read) before training, so a typo fails at once.
    let mut gate = gate_of(&a)?;
    if gate.as_ref().is_some_and(Gate::has_drift) && cfg.probe.sample_every.is_none() {
        cfg.probe.sample_every = Some(1);
    }
    let summary = run_gated(&cfg, a.diag.options()?, gate.as_mut())?;
    print_human(&summary)?;
    match gate {
        Some(g) => {
            let outcomes = g.outcomes();
            out!("{}", gate::format_outcomes(&outcomes, gate::stdout_color()))?;
            Ok(gate::exit_code(&outcomes))
        }
        None => Ok(0),
    }
}
