//! Fuzzing every parser a user feeds: run config TOML, Hugging Face `config.json` (as T5,
//! the full T5, GPT-2, LLaMA and BERT read it), safetensors files (weights and inputs),
//! trace JSONL (as `report`, `tui --trace`, `compare` and `export` read it),
//! `--overflow-steps` lists and files, the numerics lockfile (read and held against a
//! trace, as `--fail-on drift` does) and the `AMPROBE_*` variables the command line checks.
//!
//! Inputs are the seeds (`tests/fuzz_corpus/TARGET/`, and lockfiles and variables built
//! here) and inputs made from them (tests/fuzz_harness/mutate.rs), each from the run's seed
//! and its index. A run counts panics, hangs (an input over a second) and over-allocations
//! (an input holding more than 64 times its size at once, at least 32 MiB; past 1 GiB the
//! allocation is refused, which aborts, the input saved first to `target/fuzz/TARGET.current`
//! for `scripts/fuzz.sh` to keep).
//!
//! In CI, `corpus_and_mutants_parse_without_panics` runs the seeds and 20,000 inputs per
//! target; `scripts/fuzz.sh` runs the ignored `fuzz_long` with ten million per target.

mod fuzz_harness;

use amprobe::amp::simulate::{parse_overflow_steps, parse_overflow_steps_file};
use amprobe::config::RunConfig;
use amprobe::models::bert::BertConfig;
use amprobe::models::gpt2::Gpt2Config;
use amprobe::models::llama::LlamaConfig;
use amprobe::models::t5::{inputs_from, T5Config};
use amprobe::models::t5_seq2seq::T5Seq2Seq;
use amprobe::models::weights::parse_safetensors;
use amprobe::report::compare::compare;
use amprobe::report::drift::DriftCheck;
use amprobe::report::facts::Facts;
use amprobe::report::lockfile::{Lock, LockBuilder};
use amprobe::report::perfetto::to_trace_events;
use amprobe::report::TraceFile;
use amprobe::tui::Model;
use fuzz_harness::mutate::{self, Rand};
use fuzz_harness::run::{alloc_limit, fuzz, table_row, Tally, Target, TABLE_HEAD};
use fuzz_harness::{alloc, env};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

#[global_allocator]
static ALLOC: alloc::Counting = alloc::Counting;

fn run_config(bytes: &[u8]) -> bool {
    let text = String::from_utf8_lossy(bytes);
    let Ok(cfg) = RunConfig::parse(&text, Path::new("fuzz/run.toml")) else {
        return false;
    };
    let _ = cfg.backend_choice();
    cfg.train_config().is_ok()
}

fn hf_config(bytes: &[u8]) -> bool {
    let text = String::from_utf8_lossy(bytes);
    let path = Path::new("fuzz/config.json");
    let shapes = [
        T5Config::parse(&text, path).map(|c| c.shapes().len()).ok(),
        T5Seq2Seq::parse_config(&text, path)
            .map(|m| m.shapes().len())
            .ok(),
        Gpt2Config::parse(&text, path)
            .map(|c| c.shapes().len())
            .ok(),
        LlamaConfig::parse(&text, path)
            .map(|c| c.shapes().len())
            .ok(),
        BertConfig::parse(&text, path)
            .map(|c| c.shapes().len())
            .ok(),
    ];
    shapes.iter().any(Option::is_some)
}

fn safetensors(bytes: &[u8]) -> bool {
    let path = Path::new("fuzz/x.safetensors");
    let Ok(map) = parse_safetensors(bytes, path) else {
        return false;
    };
    let _ = inputs_from(map, path);
    true
}

fn trace(bytes: &[u8]) -> bool {
    let Ok(tf) = TraceFile::from_bytes(bytes, "fuzz/trace.jsonl") else {
        return false;
    };
    let _ = Facts::new(&tf.trace, &tf.skip_causes);
    let _ = to_trace_events(&tf);
    let _ = Model::from_trace(tf.trace.clone(), "fuzz");
    let _ = compare(&[tf.clone(), tf], 0.05, None);
    true
}

fn overflow_steps(bytes: &[u8]) -> bool {
    let text = String::from_utf8_lossy(bytes);
    let list = parse_overflow_steps(&text).is_ok();
    let file = parse_overflow_steps_file(&text, Path::new("fuzz/steps.txt")).is_ok();
    list || file
}

/// The trace a lockfile is held against.
fn lock_trace() -> &'static TraceFile {
    static TRACE: OnceLock<TraceFile> = OnceLock::new();
    TRACE.get_or_init(|| {
        let path = corpus_dir("trace").join("mlp_fp16.jsonl");
        TraceFile::open(&path).expect("the corpus's fp16 trace")
    })
}

fn lockfile(bytes: &[u8]) -> bool {
    let text = String::from_utf8_lossy(bytes);
    let path = Path::new("fuzz/amprobe.lock");
    let Ok(lock) = Lock::parse(&text, "fuzz/amprobe.lock") else {
        return false;
    };
    let _ = Lock::parse(&lock.to_toml(), "fuzz/amprobe.lock (written back)");
    let t = &lock_trace().trace;
    let mut check = DriftCheck::new(path, lock);
    check.observe_header(&t.header);
    for s in &t.steps {
        check.observe(s);
    }
    let _ = check.outcome();
    true
}

/// The lockfiles `amprobe baseline` writes for the corpus's traces, whole and with their
/// first few ops only (reading TOML is slow: most inputs are made from these).
fn lockfile_seeds() -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for name in ["mlp_bf16.jsonl", "mlp_fp16.jsonl"] {
        let tf = TraceFile::open(corpus_dir("trace").join(name)).expect("a corpus trace");
        let mut b = LockBuilder::new(&tf.trace.header);
        for s in &tf.trace.steps {
            b.observe(s);
        }
        let mut lock = b.finish();
        out.push(lock.to_toml().into_bytes());
        for keep in [1, 3] {
            lock.envelopes.ops.truncate(keep);
            out.push(lock.to_toml().into_bytes());
        }
    }
    out
}

fn byte_mutant(target: &str, seeds: &[Vec<u8>], r: &mut Rand) -> Vec<u8> {
    let base = r.pick(seeds);
    mutate::mutate(target, base, seeds, r)
}

fn make_run_config(seeds: &[Vec<u8>], r: &mut Rand) -> Vec<u8> {
    match r.below(3) {
        0 => mutate::random_run_config(r),
        _ => byte_mutant("run_config", seeds, r),
    }
}

fn make_json(target: &str, seeds: &[Vec<u8>], r: &mut Rand) -> Vec<u8> {
    match r.below(3) {
        0 => {
            let base: &Vec<u8> = r.pick(seeds);
            mutate::json_mutant(base, r)
        }
        _ => byte_mutant(target, seeds, r),
    }
}

fn make_safetensors(seeds: &[Vec<u8>], r: &mut Rand) -> Vec<u8> {
    match r.below(4) {
        0 => mutate::random_safetensors(r),
        _ => byte_mutant("safetensors", seeds, r),
    }
}

fn make_lockfile(seeds: &[Vec<u8>], r: &mut Rand) -> Vec<u8> {
    match r.below(3) {
        0 => {
            let base: &Vec<u8> = r.pick(seeds);
            mutate::toml_mutant(base, r)
        }
        _ => byte_mutant("lockfile", seeds, r),
    }
}

/// The parsers under test.
const TARGETS: [Target; 7] = [
    Target {
        name: "run_config",
        run: run_config,
        make: make_run_config,
        parallel: true,
    },
    Target {
        name: "hf_config",
        run: hf_config,
        make: |s, r| make_json("hf_config", s, r),
        parallel: true,
    },
    Target {
        name: "safetensors",
        run: safetensors,
        make: make_safetensors,
        parallel: true,
    },
    Target {
        name: "trace",
        run: trace,
        make: |s, r| make_json("trace", s, r),
        parallel: true,
    },
    Target {
        name: "overflow_steps",
        run: overflow_steps,
        make: |s, r| byte_mutant("overflow_steps", s, r),
        parallel: true,
    },
    Target {
        name: "lockfile",
        run: lockfile,
        make: make_lockfile,
        parallel: true,
    },
    // The environment is the process's: one thread.
    Target {
        name: "env",
        run: env::run,
        make: env::mutant,
        parallel: false,
    },
];

fn corpus_dir(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fuzz_corpus")
        .join(target)
}

/// The saved inputs of `target` (crash files included), by name.
fn corpus(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let Ok(dir) = std::fs::read_dir(corpus_dir(target)) else {
        return Vec::new();
    };
    let mut files: Vec<PathBuf> = dir
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    files
        .into_iter()
        .map(|p| {
            let b = std::fs::read(&p).unwrap();
            (p, b)
        })
        .collect()
}

/// The saved inputs of `target` and those built here.
fn seeds(target: &str) -> Vec<Vec<u8>> {
    let mut out: Vec<Vec<u8>> = corpus(target).into_iter().map(|(_, b)| b).collect();
    match target {
        "lockfile" => out.extend(lockfile_seeds()),
        "env" => out.extend(env::seeds()),
        _ => {}
    }
    assert!(!out.is_empty(), "no seeds for {target}");
    out
}

fn show(input: &[u8]) -> String {
    let s = String::from_utf8_lossy(&input[..input.len().min(300)]);
    format!("{} bytes: {:?}", input.len(), s)
}

/// The failures of a run, one a line.
fn failures(name: &str, t: &Tally) -> Vec<String> {
    t.failures
        .iter()
        .map(|f| {
            let at = f.index.map_or("a seed".into(), |i| format!("input {i}"));
            format!("{name} ({at}): {}\n  {}", f.why, show(&f.input))
        })
        .collect()
}

#[test]
fn corpus_and_mutants_parse_without_panics() {
    let mut bad = Vec::new();
    println!("{TABLE_HEAD}");
    for t in &TARGETS {
        let tally = fuzz(t, &seeds(t.name), 20_000, 0x5eed);
        println!("{}", table_row(t.name, &tally));
        bad.extend(failures(t.name, &tally));
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// A stand-in parser that panics on `p`, holds 40 MiB on `a` and takes 1.1 s on `h`.
fn faulty(input: &[u8]) -> bool {
    match input {
        b"p" => panic!("planted"),
        b"a" => !std::hint::black_box(vec![1u8; 40 << 20]).is_empty(),
        b"h" => {
            std::thread::sleep(std::time::Duration::from_millis(1100));
            true
        }
        _ => input == b"ok",
    }
}

/// The harness counts what it is there to find, each once.
#[test]
fn the_harness_counts_panics_hangs_and_over_allocations() {
    let t = Target {
        name: "faulty",
        run: faulty,
        make: |_, r| vec![b"ok", b"no"][r.below(2)].to_vec(),
        parallel: true,
    };
    let seeds: Vec<Vec<u8>> = ["p", "a", "h", "ok"].map(|s| s.as_bytes().to_vec()).into();
    let tally = fuzz(&t, &seeds, 100, 1);
    let counts = (
        tally.inputs,
        tally.panics,
        tally.hangs,
        tally.over_allocations,
    );
    assert_eq!(counts, (104, 1, 1, 1));
    assert_eq!(tally.accepted + tally.rejected, 103);
    assert!(tally.peak >= 40 << 20 && tally.slowest.as_millis() >= 1100);
    let why: Vec<&str> = tally.failures.iter().map(|f| f.why.as_str()).collect();
    assert!(why.iter().any(|w| w.contains("planted")), "{why:?}");
}

/// The issue's example: a header claiming 10^10 elements in a file of about 100 bytes is
/// refused, holding far less than the claim would need.
#[test]
fn a_header_claiming_more_than_the_file_holds_is_refused_before_allocating() {
    let header = r#"{"x":{"dtype":"F32","shape":[10000000000],"data_offsets":[0,40000000000]}}"#;
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(header.as_bytes());
    file.extend_from_slice(&[0u8; 16]);
    let cap = alloc_limit(file.len());
    let (r, peak) = alloc::measure(cap, || {
        parse_safetensors(&file, Path::new("claims.safetensors"))
    });
    let e = r.expect_err("refused").to_string();
    assert!(
        e.contains("claims.safetensors") && peak < cap,
        "{e} ({peak} bytes held)"
    );
    // A header length beyond the file.
    let mut file = (1u64 << 40).to_le_bytes().to_vec();
    file.extend_from_slice(b"{}");
    let (r, peak) = alloc::measure(cap, || {
        parse_safetensors(&file, Path::new("claims.safetensors"))
    });
    assert!(r.is_err() && peak < cap);
}

/// A `config.json` cannot make amprobe set aside memory: huge dimensions are refused with
/// a message naming the file, before any parameter list is built.
#[test]
fn a_config_describing_an_impossible_model_is_refused() {
    let text = r#"{"model_type":"t5","d_model":1000000000,"d_ff":1000000000,"d_kv":64,
        "num_heads":1000000,"num_layers":100000000000,"vocab_size":32128}"#;
    let e = T5Config::parse(text, Path::new("big/config.json"))
        .expect_err("refused")
        .to_string();
    assert!(
        e.contains("big/config.json") && e.contains("num_layers"),
        "{e}"
    );
    let text = r#"{"model_type":"t5","d_model":4000000000,"d_ff":4000000000,"d_kv":64,
        "num_heads":12,"num_layers":2,"vocab_size":32128}"#;
    let e = T5Config::parse(text, Path::new("big/config.json"))
        .expect_err("refused")
        .to_string();
    assert!(e.contains("parameters"), "{e}");
    let toml = "[model]\nhidden = 1000000000000\n";
    let e = RunConfig::parse(toml, Path::new("big.toml"))
        .unwrap()
        .train_config()
        .expect_err("refused")
        .to_string();
    assert!(e.contains("model.inputs / hidden / classes"), "{e}");
}

/// `scripts/fuzz.sh`: ten million inputs per target (`AMPROBE_FUZZ_INPUTS`), one target
/// with `AMPROBE_FUZZ_TARGET`, inputs made from `AMPROBE_FUZZ_SEED`. Prints the table;
/// failing inputs are saved into the corpus as `crash-*`.
#[test]
#[ignore]
fn fuzz_long() {
    let var = |name: &str| std::env::var(name).ok();
    let n: u64 = var("AMPROBE_FUZZ_INPUTS").map_or(10_000_000, |v| v.parse().expect("a count"));
    let seed: u64 = var("AMPROBE_FUZZ_SEED").map_or(0x0a3b_7c2d, |v| v.parse().expect("a seed"));
    let only = var("AMPROBE_FUZZ_TARGET");
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/fuzz");
    std::fs::create_dir_all(&dir).unwrap();
    println!("{TABLE_HEAD}");
    let mut bad = Vec::new();
    for t in TARGETS
        .iter()
        .filter(|t| only.as_deref().is_none_or(|o| o == t.name))
    {
        let current = dir.join(format!("{}.current", t.name));
        let _ = std::fs::remove_file(&current);
        *alloc::SAVE_TO.lock().unwrap() = Some(current);
        let tally = fuzz(t, &seeds(t.name), n, seed);
        println!("{}", table_row(t.name, &tally));
        keep_failures(t.name, &tally);
        bad.extend(failures(t.name, &tally));
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// Saves the failing inputs of a run into the corpus, which CI replays.
fn keep_failures(name: &str, t: &Tally) {
    for f in &t.failures {
        let h = f.input.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
            (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
        });
        std::fs::create_dir_all(corpus_dir(name)).unwrap();
        let path = corpus_dir(name).join(format!("crash-{h:016x}"));
        std::fs::write(&path, &f.input).unwrap();
        eprintln!("{name}: {} (saved {})", f.why, path.display());
    }
}

/// Trace statistics that count more values than the tensor holds (found by fuzzing: they
/// made `numel - zeros - nonfinite` wrap) are refused when read, naming the line.
#[test]
fn stats_counting_past_numel_are_a_line_error() {
    let mut seen = 0;
    for (path, bytes) in corpus("trace") {
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if !name.contains("stats-past-numel") {
            continue;
        }
        seen += 1;
        let e = TraceFile::from_bytes(&bytes, &path).err();
        let e = e.unwrap_or_else(|| panic!("{name} was read")).to_string();
        assert!(e.contains("line") && e.contains("numel"), "{name}: {e}");
    }
    assert!(seen > 0, "no stats-past-numel inputs in the corpus");
}
