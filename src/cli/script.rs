//! A user's PyTorch training script, run by `amprobe tui|compare|fix -- CMD ARGS...`: the
//! command with the companion amprobe carries on its Python's path (src/cli/companion.rs)
//! and the companion's environment (where the trace goes, how often full op records are
//! kept, and the plan: what the companion changes in the script's process), and its trace
//! followed as the script writes it, step by step, so that a run is stopped once the step
//! it was started for is in the file.
//!
//! A script run by torchrun writes one trace per rank (`.rank{N}` before the suffix): rank
//! 0's is the one followed and read.
//!
//! The script is the user's: every run starts it from scratch. A run this module stops is
//! [`Ended::Stopped`], never a failure of the script.

use super::companion;
use amprobe::diagnose::ranks;
use amprobe::trace::io::{read_trace, Trace, TraceReader};
use amprobe::trace::record::{Record, StepRecord};
use anyhow::{bail, Context};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Where the companion writes the trace.
pub const TRACE_VAR: &str = "AMPROBE_TRACE";
/// Full op records every N steps besides the first.
pub const SAMPLE_EVERY_VAR: &str = "AMPROBE_SAMPLE_EVERY";
/// Turns `watch` into a no-op; never passed on to a script amprobe runs.
pub const DISABLE_VAR: &str = "AMPROBE_DISABLE";
/// The plan: autocast's dtype forced (`fp16`, `bf16`) or autocast off (`fp32`).
pub const AUTOCAST_VAR: &str = "AMPROBE_AUTOCAST";
/// The plan: module patterns (comma-separated) whose forward runs outside autocast.
pub const FP32_MODULES_VAR: &str = "AMPROBE_FP32_MODULES";
/// The plan: the GradScaler's initial loss scale.
pub const INIT_SCALE_VAR: &str = "AMPROBE_INIT_SCALE";

/// How often the follower looks for new lines and for the script's exit.
pub const POLL: Duration = Duration::from_millis(50);

/// The precision the plan forces on the script's autocast regions (the companion also
/// takes `fp16`, which no form of the command line asks for).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Autocast {
    /// Autocast to bfloat16 (and the scaler off).
    Bf16,
    /// Autocast off (and the scaler off).
    Fp32,
}

impl Autocast {
    /// The value of `AMPROBE_AUTOCAST`, also the precision a trace header names.
    pub fn name(self) -> &'static str {
        match self {
            Autocast::Bf16 => "bf16",
            Autocast::Fp32 => "fp32",
        }
    }
}

/// What the companion changes in the script's process (the plan's environment variables);
/// the default changes nothing.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Plan {
    /// Autocast forced to a precision, or off.
    pub autocast: Option<Autocast>,
    /// Module patterns kept in fp32 (run outside autocast on float32 inputs).
    pub fp32_modules: Vec<String>,
    /// The scaler's initial loss scale.
    pub init_scale: Option<f64>,
}

impl Plan {
    /// The plan's variables that are set, with their values.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        let mut v = Vec::new();
        if let Some(a) = self.autocast {
            v.push((AUTOCAST_VAR, a.name().to_string()));
        }
        if !self.fp32_modules.is_empty() {
            v.push((FP32_MODULES_VAR, self.fp32_modules.join(",")));
        }
        if let Some(s) = self.init_scale {
            v.push((INIT_SCALE_VAR, format!("{s}")));
        }
        v
    }

    /// The plan as shell assignments (`AMPROBE_AUTOCAST=bf16`), empty for no plan.
    pub fn shell(&self) -> String {
        self.env()
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(" ")
    }
}

/// One run of the user's command.
#[derive(Debug, Clone)]
pub struct Script {
    /// The command and its arguments.
    pub command: Vec<String>,
    /// Where the trace goes (absolute, so that a script that changes directory still
    /// writes it here).
    pub trace: PathBuf,
    /// `AMPROBE_SAMPLE_EVERY` for the script; `None` leaves the environment's.
    pub sample_every: Option<u64>,
    /// The plan.
    pub plan: Plan,
    /// Where the script's stdout and stderr go (its stdin is then empty); `None`: this
    /// process's.
    pub log: Option<PathBuf>,
}

impl Script {
    /// The command `command` writing its trace to `trace`, with no plan.
    pub fn new(command: &[String], trace: &Path) -> anyhow::Result<Script> {
        if command.is_empty() || command[0].is_empty() {
            bail!("give the command to run after `--` (e.g. `-- python train.py`)");
        }
        let trace = std::path::absolute(trace)
            .with_context(|| format!("trace path {}", trace.display()))?;
        Ok(Script {
            command: command.to_vec(),
            trace,
            sample_every: None,
            plan: Plan::default(),
            log: None,
        })
    }

    /// The command as one line.
    pub fn label(&self) -> String {
        self.command.join(" ")
    }

    /// Removes a trace (one per rank, and a discovery report) an earlier run left (they must
    /// not pass for this one's) and starts the command with the companion amprobe carries
    /// ([`companion::prepare`]) and its environment: the trace path, the sampling, and
    /// exactly this plan's variables (the caller's own plan variables and
    /// `AMPROBE_DISABLE` are not passed on).
    pub fn start(&self) -> anyhow::Result<Running> {
        match std::fs::remove_file(&self.trace) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(e)
                    .with_context(|| format!("removing the old trace {}", self.trace.display()))
            }
            _ => {}
        }
        for (_, p) in ranks::rank_files(&self.trace)? {
            std::fs::remove_file(&p)
                .with_context(|| format!("removing the old trace {}", p.display()))?;
        }
        let report = companion::discovery_report(&self.trace);
        companion::remove_old_report(&report)?;
        let mut cmd = Command::new(&self.command[0]);
        cmd.args(&self.command[1..]).env(TRACE_VAR, &self.trace);
        for var in [DISABLE_VAR, AUTOCAST_VAR, FP32_MODULES_VAR, INIT_SCALE_VAR] {
            cmd.env_remove(var);
        }
        for (k, v) in self.plan.env() {
            cmd.env(k, v);
        }
        if let Some(n) = self.sample_every {
            cmd.env(SAMPLE_EVERY_VAR, n.to_string());
        }
        companion::prepare(&mut cmd, &report)?;
        if let Some(log) = &self.log {
            let f = std::fs::File::create(log)
                .with_context(|| format!("creating the script's log {}", log.display()))?;
            let g = f
                .try_clone()
                .with_context(|| format!("opening the script's log {}", log.display()))?;
            cmd.stdin(Stdio::null()).stdout(f).stderr(g);
        }
        let child = cmd
            .spawn()
            .with_context(|| format!("running `{}`", self.label()))?;
        Ok(Running {
            child: ChildHandle(Arc::new(Mutex::new(child))),
            follower: TraceFollower::new(&self.trace),
        })
    }

    /// Runs the script, following its trace, until `stop` says a step record is the last
    /// one needed (the script is then stopped) or the script exits; then reads the trace
    /// up to that step (a script may write another before it stops). Fails when the
    /// script wrote no trace, or failed before `stop` was satisfied.
    pub fn run_until(&self, mut stop: impl FnMut(&StepRecord) -> bool) -> anyhow::Result<Finished> {
        let mut reached = false;
        let mut last = None;
        let ended = self.start()?.follow(POLL, |r| {
            if let Record::Step(s) = r {
                reached = stop(s);
                if reached {
                    last = Some(s.step);
                }
            }
            reached
        })?;
        let Some(path) = self.written() else {
            bail!("{}", self.no_trace(&ended));
        };
        if let Ended::Exited(status) = &ended {
            if !status.success() && !reached {
                bail!("`{}` failed ({status}){}", self.label(), self.log_note());
            }
        }
        let mut trace = read_trace(&path)
            .with_context(|| format!("reading the trace of `{}`", self.label()))?;
        if let Some(last) = last {
            if trace.steps.iter().any(|s| s.step > last) {
                trace.steps.retain(|s| s.step <= last);
                trace.end = None;
            }
        }
        Ok(Finished { trace, ended, path })
    }

    /// The trace the run wrote: at `trace`, or rank 0's under torchrun; None when neither is
    /// there.
    pub fn written(&self) -> Option<PathBuf> {
        let rank0 = ranks::rank_path(&self.trace, 0);
        [self.trace.clone(), rank0].into_iter().find(|p| p.exists())
    }

    /// What to say when the script wrote no trace.
    pub fn no_trace(&self, ended: &Ended) -> String {
        let how = match ended {
            Ended::Exited(s) => format!(" ({s})"),
            Ended::Stopped => String::new(),
        };
        format!(
            "`{}` wrote no trace at {}{how}: {}{}",
            self.label(),
            self.trace.display(),
            companion::why_no_trace(&companion::discovery_report(&self.trace)),
            self.log_note()
        )
    }

    /// The end of the script's log, when it has one, to follow an error message.
    pub fn log_note(&self) -> String {
        let Some(log) = &self.log else {
            return String::new();
        };
        let text = std::fs::read_to_string(log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        let tail = &lines[lines.len().saturating_sub(12)..];
        if tail.is_empty() {
            format!(" (its output, empty, is in {})", log.display())
        } else {
            format!(
                "; the end of its output ({}):\n  {}",
                log.display(),
                tail.join("\n  ")
            )
        }
    }
}

/// A run that ended, with its trace.
#[derive(Debug)]
pub struct Finished {
    /// The trace as written (a stopped run's last line may be cut: see its `truncated`).
    pub trace: Trace,
    /// How the script ended.
    pub ended: Ended,
    /// Where the trace is (rank 0's under torchrun).
    pub path: PathBuf,
}

/// How a run of the script ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// The script exited by itself with this status.
    Exited(ExitStatus),
    /// amprobe stopped it: it had written what was needed.
    Stopped,
}

/// The running script, shared between the thread that follows its trace and the one that
/// may stop it.
#[derive(Debug, Clone)]
pub struct ChildHandle(Arc<Mutex<Child>>);

impl ChildHandle {
    /// The exit status, once the script has exited.
    pub fn try_wait(&self) -> std::io::Result<Option<ExitStatus>> {
        self.lock().try_wait()
    }

    /// Stops the script if it is still running and waits for it; true if it was running.
    /// It is asked first (SIGTERM, which a launcher such as torchrun passes on to its
    /// workers), then killed after a grace period.
    pub fn stop(&self) -> std::io::Result<bool> {
        let mut c = self.lock();
        if c.try_wait()?.is_some() {
            return Ok(false);
        }
        if let Ok(pid) = libc::pid_t::try_from(c.id()) {
            // SAFETY: kill(2) on the child's own pid, which has not been waited for, so it
            // cannot have been reused.
            unsafe { libc::kill(pid, libc::SIGTERM) };
            for _ in 0..60 {
                if c.try_wait()?.is_some() {
                    return Ok(true);
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        match c.kill() {
            Ok(()) => {}
            // It exited between the two calls.
            Err(e) if e.kind() == std::io::ErrorKind::InvalidInput => return Ok(false),
            Err(e) => return Err(e),
        }
        c.wait()?;
        Ok(true)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Child> {
        // A panic elsewhere while holding the lock leaves the child as it was.
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A started script; dropping it stops the script if it is still running, so that no
/// error path leaves it behind.
pub struct Running {
    child: ChildHandle,
    follower: TraceFollower,
}

impl Running {
    /// A handle on the script, to wait for it or stop it from another thread.
    pub fn child(&self) -> ChildHandle {
        self.child.clone()
    }

    /// Hands each record of the trace to `on_record` as its line is written, checking for
    /// new lines every `poll`, until `on_record` returns true (the script is then stopped)
    /// or the script exits (after the records it wrote are handed over).
    pub fn follow(
        mut self,
        poll: Duration,
        mut on_record: impl FnMut(&Record) -> bool,
    ) -> anyhow::Result<Ended> {
        loop {
            // The exit is looked at before the file, so the last read sees every line.
            let exited = self.child.try_wait().context("waiting for the script")?;
            for r in self.follower.read_new()? {
                if on_record(&r) {
                    self.child.stop().context("stopping the script")?;
                    return Ok(Ended::Stopped);
                }
            }
            if let Some(status) = exited {
                return Ok(Ended::Exited(status));
            }
            std::thread::sleep(poll);
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.stop();
    }
}

/// Reads a trace file as another process writes it, from before the file exists (the
/// companion creates it when the first step ends); rank 0's, when that is what appears.
pub struct TraceFollower {
    path: PathBuf,
    reader: Option<TraceReader>,
}

impl TraceFollower {
    /// Follows the trace at `path`, which may not exist yet.
    pub fn new(path: &Path) -> TraceFollower {
        TraceFollower {
            path: path.to_path_buf(),
            reader: None,
        }
    }

    /// The records whose lines were completed since the last call; none while the file
    /// does not exist.
    pub fn read_new(&mut self) -> amprobe::Result<Vec<Record>> {
        if self.reader.is_none() {
            let rank0 = ranks::rank_path(&self.path, 0);
            let Some(path) = [self.path.clone(), rank0].into_iter().find(|p| p.exists()) else {
                return Ok(Vec::new());
            };
            self.reader = Some(TraceReader::open(&path)?);
            self.path = path;
        }
        self.reader
            .as_mut()
            .map_or(Ok(Vec::new()), |r| r.read_new())
    }
}

/// The header of a trace (its first line); `None` when the file is missing or its first
/// line is not a header.
pub fn header_of(trace: &Path) -> Option<amprobe::trace::record::Header> {
    use std::io::BufRead;
    let f = std::fs::File::open(trace).ok()?;
    let mut line = String::new();
    std::io::BufReader::new(f).read_line(&mut line).ok()?;
    match serde_json::from_str(&line).ok()? {
        Record::Header(h) => Some(h),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use amprobe::trace::io::TraceWriter;
    use amprobe::trace::record::Header;
    use std::time::Instant;

    /// The lines of a trace with `steps` steps and no end record, as the companion writes
    /// them.
    fn trace_lines(steps: u64) -> Vec<String> {
        let mut buf = Vec::new();
        {
            let mut w = TraceWriter::from_writer(&mut buf, &Header::new()).unwrap();
            for i in 0..steps {
                let s = StepRecord {
                    step: i,
                    ..StepRecord::default()
                };
                w.write_step(&s).unwrap();
            }
        }
        String::from_utf8(buf)
            .unwrap()
            .lines()
            .map(str::to_string)
            .collect()
    }

    /// A shell script that writes `lines` to $AMPROBE_TRACE one by one, `pause` apart, then
    /// runs `tail` (a shell command).
    fn writer(dir: &Path, lines: &[String], pause: f64, tail: &str) -> Vec<String> {
        let data = dir.join("lines");
        std::fs::write(&data, lines.join("\n") + "\n").unwrap();
        let body = format!(
            "while IFS= read -r l; do printf '%s\\n' \"$l\" >> \"$AMPROBE_TRACE\"; sleep {pause}; done < '{}'; {tail}",
            data.display()
        );
        vec!["sh".into(), "-c".into(), body]
    }

    fn tmp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("amprobe-script-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn a_run_stops_once_the_step_it_needs_is_written() {
        let d = tmp("stop");
        // Without the stop the script would write 6 steps and wait for a minute; asked to
        // stop, it notes it (as torchrun stops its workers).
        let marker = d.join("asked");
        let tail = format!(
            "trap \"echo asked > '{}'; exit 0\" TERM; i=0; while [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done",
            marker.display()
        );
        let cmd = writer(&d, &trace_lines(6), 0.1, &tail);
        let s = Script::new(&cmd, &d.join("t.jsonl")).unwrap();
        std::fs::write(&s.trace, "left by an earlier run\n").unwrap();
        let t0 = Instant::now();
        let f = s.run_until(|st| st.step == 2).unwrap();
        assert_eq!(f.ended, Ended::Stopped, "stopped, not failed");
        assert!(t0.elapsed() < Duration::from_secs(20));
        let steps: Vec<u64> = f.trace.steps.iter().map(|s| s.step).collect();
        assert_eq!(steps, [0, 1, 2]);
    }

    #[test]
    fn a_run_hands_over_the_steps_up_to_the_one_it_needs_however_many_were_written() {
        let d = tmp("past");
        // The script writes all its steps before the stop can reach it.
        let cmd = writer(&d, &trace_lines(5), 0.0, "exit 0");
        let s = Script::new(&cmd, &d.join("t.jsonl")).unwrap();
        let f = s.run_until(|st| st.step == 1).unwrap();
        let steps: Vec<u64> = f.trace.steps.iter().map(|s| s.step).collect();
        assert_eq!(steps, [0, 1]);
        assert!(f.trace.end.is_none());
    }

    #[test]
    fn a_script_that_exits_hands_over_every_record() {
        let d = tmp("exit");
        let cmd = writer(&d, &trace_lines(3), 0.0, "exit 0");
        let s = Script::new(&cmd, &d.join("t.jsonl")).unwrap();
        let mut seen = Vec::new();
        let ended = s
            .start()
            .unwrap()
            .follow(POLL, |r| {
                seen.push(matches!(r, Record::Header(_)));
                false
            })
            .unwrap();
        assert!(matches!(ended, Ended::Exited(st) if st.success()));
        assert_eq!(seen, [true, false, false, false]);
    }

    #[test]
    fn a_failing_script_is_an_error_with_its_output_unless_it_got_far_enough() {
        let d = tmp("fail");
        let cmd = writer(&d, &trace_lines(2), 0.0, "echo planted failure >&2; exit 3");
        let mut s = Script::new(&cmd, &d.join("t.jsonl")).unwrap();
        s.log = Some(d.join("t.log"));
        let e = s.run_until(|st| st.step == 5).unwrap_err().to_string();
        assert!(
            e.contains("failed (exit status: 3)") && e.contains("planted failure"),
            "{e}"
        );
        // The step it was run for is there: its failure afterwards is its own business.
        let f = s.run_until(|st| st.step == 1).unwrap();
        assert_eq!(f.trace.steps.len(), 2);
    }

    #[test]
    fn a_script_run_by_torchrun_is_followed_by_rank_0s_trace() {
        let d = tmp("ranks");
        let trace = d.join("t.jsonl");
        let (rank0, rank1) = (ranks::rank_path(&trace, 0), ranks::rank_path(&trace, 1));
        std::fs::write(&rank1, "left by an earlier run\n").unwrap();
        let data = d.join("lines");
        std::fs::write(&data, trace_lines(3).join("\n") + "\n").unwrap();
        let cmd: Vec<String> = vec![
            "sh".into(),
            "-c".into(),
            format!("cp '{}' '{}'", data.display(), rank0.display()),
        ];
        let f = Script::new(&cmd, &trace)
            .unwrap()
            .run_until(|st| st.step == 1)
            .unwrap();
        assert_eq!(f.path, rank0);
        let steps: Vec<u64> = f.trace.steps.iter().map(|s| s.step).collect();
        assert_eq!(steps, [0, 1]);
        assert!(
            !rank1.exists(),
            "an earlier run's rank file must not pass for this one's"
        );
    }

    #[test]
    fn a_script_without_a_trace_says_what_is_missing() {
        let d = tmp("none");
        let cmd: Vec<String> = ["sh", "-c", "exit 0"].map(String::from).to_vec();
        let s = Script::new(&cmd, &d.join("t.jsonl")).unwrap();
        let e = s.run_until(|_| false).unwrap_err().to_string();
        assert!(
            e.contains("wrote no trace") && e.contains("amprobe_torch.watch"),
            "{e}"
        );
        assert!(Script::new(&[], &d.join("t.jsonl")).is_err());
    }

    #[test]
    fn the_script_gets_exactly_the_plans_variables() {
        let d = tmp("env");
        let out = d.join("env");
        let cmd: Vec<String> = vec![
            "sh".into(),
            "-c".into(),
            format!(
                "echo \"${{AMPROBE_AUTOCAST-unset}} ${{AMPROBE_FP32_MODULES-unset}} ${{AMPROBE_INIT_SCALE-unset}} ${{AMPROBE_SAMPLE_EVERY-unset}} $AMPROBE_TRACE\" > '{}'",
                out.display()
            ),
        ];
        let mut s = Script::new(&cmd, &d.join("t.jsonl")).unwrap();
        s.plan = Plan {
            autocast: Some(Autocast::Bf16),
            fp32_modules: vec!["a.b".into(), "wo".into()],
            init_scale: None,
        };
        s.sample_every = Some(3);
        let ended = s.start().unwrap().follow(POLL, |_| false).unwrap();
        assert!(matches!(ended, Ended::Exited(st) if st.success()));
        let text = std::fs::read_to_string(&out).unwrap();
        assert_eq!(
            text.trim(),
            format!("bf16 a.b,wo unset 3 {}", s.trace.display())
        );
        assert_eq!(
            s.plan.shell(),
            "AMPROBE_AUTOCAST=bf16 AMPROBE_FP32_MODULES=a.b,wo"
        );
    }

    #[test]
    fn the_follower_waits_for_the_file_and_for_whole_lines() {
        let d = tmp("follow");
        let p = d.join("t.jsonl");
        let mut f = TraceFollower::new(&p);
        assert!(f.read_new().unwrap().is_empty());
        let lines = trace_lines(1);
        let half = lines[1].len() / 2;
        std::fs::write(&p, format!("{}\n{}", lines[0], &lines[1][..half])).unwrap();
        assert_eq!(f.read_new().unwrap().len(), 1);
        use std::io::Write;
        let mut h = std::fs::OpenOptions::new().append(true).open(&p).unwrap();
        writeln!(h, "{}", &lines[1][half..]).unwrap();
        let r = f.read_new().unwrap();
        assert!(matches!(&r[..], [Record::Step(s)] if s.step == 0));
        let h = header_of(&p).unwrap();
        assert_eq!(h.schema_version, amprobe::trace::record::SCHEMA_VERSION);
        assert!(h.source.is_none());
    }
}
