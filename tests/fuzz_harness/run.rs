//! Runs a target's inputs on every core and counts what they did: accepted, rejected,
//! panics (caught, with the panic message kept quiet), hangs (an input that takes more than
//! [`HANG`]; one stuck for [`STUCK`] stops the process, its input saved) and
//! over-allocations (an input whose peak of bytes held passes [`alloc_limit`]; past
//! [`HARD_CAP`] the allocation is refused, which aborts).

use super::alloc;
use super::mutate::Rand;
use std::cell::Cell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// An input slower than this is a hang.
pub const HANG: Duration = Duration::from_secs(1);
/// An input still running after this stops the run.
const STUCK: Duration = Duration::from_secs(30);
/// No input may hold more than this at once: the allocation that would is refused.
pub const HARD_CAP: usize = 1 << 30;
/// The stack of the command line's main thread, which the parsers run on there.
const STACK: usize = 8 << 20;

/// The most an input of `len` bytes may hold at once: what the file holds, generously (64
/// times its size), and at least 32 MiB for the parsers' own tables.
pub fn alloc_limit(len: usize) -> usize {
    len.saturating_mul(128).max(32 << 20)
}

/// A parser under test.
pub struct Target {
    pub name: &'static str,
    /// Feeds one input to the parser as the command line does; true: accepted.
    pub run: fn(&[u8]) -> bool,
    /// Makes a new input from the seeds.
    pub make: fn(&[Vec<u8>], &mut Rand) -> Vec<u8>,
    /// False where the inputs share process state (the environment): one thread.
    pub parallel: bool,
}

/// An input that failed and why; `index` is `None` for a seed.
pub struct Failure {
    pub index: Option<u64>,
    pub input: Vec<u8>,
    pub why: String,
}

/// What a run of one target did.
#[derive(Default)]
pub struct Tally {
    pub inputs: u64,
    pub accepted: u64,
    pub rejected: u64,
    pub panics: u64,
    pub hangs: u64,
    pub over_allocations: u64,
    pub slowest: Duration,
    pub peak: usize,
    pub elapsed: Duration,
    /// The first failures (at most [`KEPT`]).
    pub failures: Vec<Failure>,
}

const KEPT: usize = 20;

impl Tally {
    fn record(&mut self, index: Option<u64>, input: &[u8], o: Outcome) {
        self.inputs += 1;
        self.slowest = self.slowest.max(o.took);
        self.peak = self.peak.max(o.peak);
        let mut why = Vec::new();
        match o.accepted {
            Ok(true) => self.accepted += 1,
            Ok(false) => self.rejected += 1,
            Err(m) => {
                self.panics += 1;
                why.push(format!("panic: {m}"));
            }
        }
        if o.took > HANG {
            self.hangs += 1;
            why.push(format!("took {:.1} s", o.took.as_secs_f64()));
        }
        if o.peak > alloc_limit(input.len()) {
            self.over_allocations += 1;
            why.push(format!("held {} bytes at once", o.peak));
        }
        if !why.is_empty() && self.failures.len() < KEPT {
            let (input, why) = (input.to_vec(), why.join("; "));
            self.failures.push(Failure { index, input, why });
        }
    }

    fn add(&mut self, o: Tally) {
        self.inputs += o.inputs;
        self.accepted += o.accepted;
        self.rejected += o.rejected;
        self.panics += o.panics;
        self.hangs += o.hangs;
        self.over_allocations += o.over_allocations;
        self.slowest = self.slowest.max(o.slowest);
        self.peak = self.peak.max(o.peak);
        let room = KEPT.saturating_sub(self.failures.len());
        self.failures.extend(o.failures.into_iter().take(room));
    }
}

struct Outcome {
    accepted: Result<bool, String>,
    took: Duration,
    peak: usize,
}

thread_local! {
    /// Set on fuzzing threads: their panics are counted, not printed.
    static QUIET: Cell<bool> = const { Cell::new(false) };
}

fn quiet_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !QUIET.with(Cell::get) {
                default(info)
            }
        }));
    });
}

fn run_one(t: &Target, input: &[u8]) -> Outcome {
    let t0 = Instant::now();
    let (r, peak) = alloc::measure(HARD_CAP, || {
        catch_unwind(AssertUnwindSafe(|| (t.run)(input)))
    });
    let took = t0.elapsed();
    let accepted = r.map_err(|p| {
        p.downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default()
    });
    Outcome {
        accepted,
        took,
        peak,
    }
}

/// When each thread's current input started (milliseconds since the run began, plus 1;
/// 0: between inputs), for the watchdog.
struct Clock {
    t0: Instant,
    started: Vec<AtomicU64>,
}

impl Clock {
    fn now_ms(&self) -> u64 {
        self.t0.elapsed().as_millis() as u64 + 1
    }
}

/// Runs `input` on thread `w`, keeping it where a refusal or the watchdog saves it from.
fn watched(t: &Target, input: &[u8], w: usize, clock: &Clock) -> Outcome {
    {
        let mut slot = alloc::CURRENT[w].lock().unwrap_or_else(|e| e.into_inner());
        slot.clear();
        slot.extend_from_slice(input);
    }
    clock.started[w].store(clock.now_ms(), Ordering::Relaxed);
    let o = run_one(t, input);
    clock.started[w].store(0, Ordering::Relaxed);
    o
}

/// Thread `w` of `threads`: the seeds (thread 0), then inputs `w`, `w + threads`, ...
fn worker(t: &Target, seeds: &[Vec<u8>], n: u64, seed: u64, w: usize, clock: &Clock) -> Tally {
    alloc::set_slot(w);
    QUIET.with(|q| q.set(true));
    let threads = clock.started.len() as u64;
    let mut tally = Tally::default();
    if w == 0 {
        for s in seeds {
            tally.record(None, s, watched(t, s, w, clock));
        }
    }
    let mut i = w as u64;
    while i < n {
        let input = (t.make)(seeds, &mut Rand::for_input(seed, i));
        tally.record(Some(i), &input, watched(t, &input, w, clock));
        i += threads;
    }
    tally
}

/// Stops the process when an input has run for [`STUCK`], saving it first.
fn watchdog(name: &str, clock: &Clock, done: &AtomicBool) {
    while !done.load(Ordering::Relaxed) {
        std::thread::sleep(Duration::from_millis(20));
        for (w, s) in clock.started.iter().enumerate() {
            let since = s.load(Ordering::Relaxed);
            if since != 0 && clock.now_ms() - since > STUCK.as_millis() as u64 {
                eprintln!("{name}: an input has run for {} s: a hang", STUCK.as_secs());
                alloc::save_current(w);
                std::process::exit(3);
            }
        }
    }
}

/// Runs the seeds of `t`, then `n` inputs made from them with `seed`.
pub fn fuzz(t: &Target, seeds: &[Vec<u8>], n: u64, seed: u64) -> Tally {
    quiet_panics();
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    let threads = if t.parallel {
        cores.min(alloc::SLOTS)
    } else {
        1
    };
    let clock = Clock {
        t0: Instant::now(),
        started: (0..threads).map(|_| AtomicU64::new(0)).collect(),
    };
    let done = AtomicBool::new(false);
    let mut total = std::thread::scope(|s| {
        let dog = s.spawn(|| watchdog(t.name, &clock, &done));
        let workers: Vec<_> = (0..threads)
            .map(|w| {
                std::thread::Builder::new()
                    .stack_size(STACK)
                    .spawn_scoped(s, {
                        let clock = &clock;
                        move || worker(t, seeds, n, seed, w, clock)
                    })
                    .expect("a fuzzing thread")
            })
            .collect();
        let mut total = Tally::default();
        for h in workers {
            total.add(h.join().expect("fuzzing threads catch their panics"));
        }
        done.store(true, Ordering::Relaxed);
        dog.join().expect("the watchdog");
        total
    });
    total.elapsed = clock.t0.elapsed();
    total
}

/// The table's header, as Markdown.
pub const TABLE_HEAD: &str = "| parser | inputs | accepted | rejected | panics | hangs (> 1 s) \
    | over-allocations | peak held | slowest | inputs/s |\n\
    |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|";

/// One row of the table.
pub fn table_row(name: &str, t: &Tally) -> String {
    let rate = t.inputs as f64 / t.elapsed.as_secs_f64().max(1e-9);
    format!(
        "| {name} | {} | {} | {} | {} | {} | {} | {:.1} MiB | {:.1} ms | {} |",
        thousands(t.inputs),
        thousands(t.accepted),
        thousands(t.rejected),
        t.panics,
        t.hangs,
        t.over_allocations,
        t.peak as f64 / (1 << 20) as f64,
        t.slowest.as_secs_f64() * 1e3,
        thousands(rate as u64),
    )
}

fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}
