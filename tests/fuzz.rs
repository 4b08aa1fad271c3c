//! Fuzzing every parser a user feeds: run config TOML, Hugging Face `config.json`,
//! safetensors files (weights and inputs), trace JSONL (as `report`, `tui --trace`,
//! `compare` and `export` read it) and `--overflow-steps` lists and files.
//!
//! Inputs are the saved corpus (`tests/fuzz_corpus/TARGET/`) and mutants of it: byte
//! flips, insertions, deletions, duplicated spans, tokens of the target's grammar, extreme
//! numbers in place of numbers; and structure-aware ones that stay well-formed so as to reach
//! the checks behind the parser: run configs built from the schema's sections and keys,
//! JSON (config.json, trace lines) with one value changed, safetensors headers built from
//! random shapes, dtypes and offsets. A run fails on a panic, on an input that takes more than a second,
//! and on any single allocation larger than [`alloc_limit`] (the allocator below refuses
//! it, which aborts the process; the input is saved first to `target/fuzz/TARGET.current`,
//! for `scripts/fuzz.sh` to keep).
//!
//! In CI, `corpus_and_mutants_parse_without_panics` replays the corpus (every crash found
//! is kept there) and a few thousand mutants; `scripts/fuzz.sh` runs the ignored
//! `fuzz_long` with a million inputs per target.

use amprobe::amp::simulate::{parse_overflow_steps, parse_overflow_steps_file};
use amprobe::config::RunConfig;
use amprobe::models::bert::BertConfig;
use amprobe::models::gpt2::Gpt2Config;
use amprobe::models::llama::LlamaConfig;
use amprobe::models::t5::{inputs_from, T5Config};
use amprobe::models::t5_seq2seq::T5Seq2Seq;
use amprobe::models::weights::parse_safetensors;
use amprobe::report::compare::compare;
use amprobe::report::facts::Facts;
use amprobe::report::perfetto::to_trace_events;
use amprobe::report::TraceFile;
use amprobe::tui::Model;
use std::alloc::{GlobalAlloc, Layout, System};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Refuses any single allocation above the current limit (0: none), first saving the
/// input being run (when a path for it is set) since the refusal aborts the process.
struct Capped;

static LIMIT: AtomicUsize = AtomicUsize::new(0);
/// The input being run and where to save it if an allocation is refused.
static CURRENT: Mutex<Vec<u8>> = Mutex::new(Vec::new());
static CURRENT_PATH: OnceLock<PathBuf> = OnceLock::new();

fn refuse(size: usize) -> *mut u8 {
    if let (Some(path), Ok(input)) = (CURRENT_PATH.get(), CURRENT.try_lock()) {
        let _ = std::fs::write(path, &*input);
    }
    eprintln!("an allocation of {size} bytes was refused");
    std::ptr::null_mut()
}

unsafe impl GlobalAlloc for Capped {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let limit = LIMIT.load(Ordering::Relaxed);
        if limit > 0 && layout.size() > limit {
            return refuse(layout.size());
        }
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `alloc` above, that is from the system allocator.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let limit = LIMIT.load(Ordering::Relaxed);
        if limit > 0 && new_size > limit {
            return refuse(new_size);
        }
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Capped = Capped;

/// The largest single allocation an input of `len` bytes may cause: what the file holds,
/// generously (64 times its size, at least 32 MiB for the parsers' own tables).
fn alloc_limit(len: usize) -> usize {
    (len.saturating_mul(64)).max(32 << 20)
}

/// The parsers under test.
const TARGETS: [&str; 5] = [
    "run_config",
    "hf_config",
    "safetensors",
    "trace",
    "overflow_steps",
];

/// Feeds `bytes` to `target` the way the command line does; errors are fine, panics not.
fn run_target(target: &str, bytes: &[u8]) {
    let text = String::from_utf8_lossy(bytes);
    match target {
        "run_config" => {
            if let Ok(cfg) = RunConfig::parse(&text, Path::new("fuzz/run.toml")) {
                let _ = cfg.train_config();
                let _ = cfg.backend_choice();
            }
        }
        "hf_config" => {
            let path = Path::new("fuzz/config.json");
            if let Ok(cfg) = T5Config::parse(&text, path) {
                let _ = cfg.shapes();
            }
            if let Ok(m) = T5Seq2Seq::parse_config(&text, path) {
                let _ = m.shapes();
            }
            if let Ok(cfg) = Gpt2Config::parse(&text, path) {
                let _ = cfg.shapes();
            }
            if let Ok(cfg) = LlamaConfig::parse(&text, path) {
                let _ = cfg.shapes();
            }
            if let Ok(cfg) = BertConfig::parse(&text, path) {
                let _ = cfg.shapes();
            }
        }
        "safetensors" => {
            if let Ok(map) = parse_safetensors(bytes, Path::new("fuzz/x.safetensors")) {
                let _ = inputs_from(map, Path::new("fuzz/x.safetensors"));
            }
        }
        "trace" => {
            if let Ok(tf) = TraceFile::from_bytes(bytes, "fuzz/trace.jsonl") {
                let _ = Facts::new(&tf.trace, &tf.skip_causes);
                let _ = to_trace_events(&tf);
                let _ = Model::from_trace(tf.trace.clone(), "fuzz");
                let _ = compare(&[tf.clone(), tf], 0.05, None);
            }
        }
        "overflow_steps" => {
            let _ = parse_overflow_steps(&text);
            let _ = parse_overflow_steps_file(&text, Path::new("fuzz/steps.txt"));
        }
        other => panic!("unknown fuzz target {other}"),
    }
}

fn corpus_dir(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fuzz_corpus")
        .join(target)
}

fn corpus(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(corpus_dir(target))
        .unwrap_or_else(|e| panic!("corpus of {target}: {e}"))
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

/// xorshift64*: the mutator's randomness, seeded per run.
struct Rand(u64);

impl Rand {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next() % n as u64) as usize
        }
    }
}

/// Tokens of each target's grammar, spliced into mutants.
fn tokens(target: &str) -> &'static [&'static str] {
    match target {
        "run_config" => &[
            "[model]",
            "[data]",
            "[train]",
            "[scaler]",
            "[probe]",
            "kind = \"t5\"",
            "precision = \"fp16\"",
            "precision = \"half\"",
            "steps = ",
            "accumulate = 0",
            "clip = -1.0",
            "init_scale = ",
            "max_scale = ",
            "growth_interval = 0",
            "batch = ",
            "seq = ",
            "hidden = ",
            "inputs = ",
            "classes = ",
            "keep_fp32 = [\"",
            "optimizer = \"adamw\"",
            "lr = ",
            "backend = \"cuda\"",
            "kind = \"hysteresis\"",
            "sample_every = 0",
            "= inf",
            "= nan",
            "=",
            "\"",
            "[[",
            "]]",
        ],
        "hf_config" | "trace" => &[
            "{",
            "}",
            "[",
            "]",
            "\"",
            ":",
            ",",
            "null",
            "true",
            "\"NaN\"",
            "\"inf\"",
            "\"-inf\"",
            "\"type\":\"step\"",
            "\"type\":\"header\"",
            "\"type\":\"end\"",
            "\"ops\":",
            "\"stats\":",
            "\"origins\":",
            "\"model_type\":\"t5\"",
            "\"d_model\":",
            "\"num_layers\":",
            "\"vocab_size\":",
            "\"schema_version\":",
            "\"step\":",
            "\"op_index\":",
            "\"shape\":",
            "\n",
        ],
        "safetensors" => &[
            "{",
            "}",
            "\"dtype\":\"F32\"",
            "\"dtype\":\"I64\"",
            "\"dtype\":\"BF16\"",
            "\"shape\":[",
            "\"data_offsets\":[",
            "\"input_ids\"",
            "\"labels\"",
            "\"__metadata__\":{}",
            "9999999999",
        ],
        _ => &[
            "-",
            ",",
            "[",
            "]",
            "#",
            "\n",
            "0",
            "18446744073709551615",
            "1-",
            "99999999",
        ],
    }
}

/// Numbers that break parsers that trust them.
const EXTREMES: [&str; 12] = [
    "0",
    "-1",
    "1e309",
    "-1e309",
    "4294967296",
    "18446744073709551615",
    "18446744073709551616",
    "9223372036854775807",
    "1e-320",
    "NaN",
    "10000000000",
    "65505",
];

/// One mutant of `input`.
fn mutate(target: &str, input: &[u8], r: &mut Rand) -> Vec<u8> {
    let mut v = input.to_vec();
    for _ in 0..1 + r.below(4) {
        let n = v.len();
        match r.below(8) {
            0 if n > 0 => {
                let i = r.below(n);
                v[i] ^= 1 << r.below(8);
            }
            1 if n > 0 => {
                let i = r.below(n);
                v[i] = r.next() as u8;
            }
            2 => {
                let i = r.below(n + 1);
                let k = 1 + r.below(8);
                let bytes: Vec<u8> = (0..k).map(|_| r.next() as u8).collect();
                v.splice(i..i, bytes);
            }
            3 if n > 0 => {
                let i = r.below(n);
                let k = 1 + r.below((n - i).min(64));
                v.drain(i..i + k);
            }
            4 if n > 0 => {
                let i = r.below(n);
                let k = 1 + r.below((n - i).min(256));
                let span = v[i..i + k].to_vec();
                let j = r.below(n + 1);
                v.splice(j..j, span);
            }
            5 => {
                let t = tokens(target);
                let tok = t[r.below(t.len())].as_bytes().to_vec();
                let i = r.below(n + 1);
                v.splice(i..i, tok);
            }
            6 => {
                // Replace a run of digits with an extreme number.
                let digits: Vec<usize> = (0..n).filter(|&i| v[i].is_ascii_digit()).collect();
                if let Some(&i) = digits.get(r.below(digits.len().max(1))) {
                    let mut j = i;
                    while j < n && (v[j].is_ascii_digit() || v[j] == b'.') {
                        j += 1;
                    }
                    let e = EXTREMES[r.below(EXTREMES.len())].as_bytes().to_vec();
                    v.splice(i..j, e);
                }
            }
            _ => {
                if n > 0 {
                    let k = r.below(n);
                    v.truncate(k);
                }
            }
        }
    }
    v
}

/// A safetensors file built from random parts: a header whose shapes, dtypes and offsets
/// may disagree with each other and with the data that follows.
fn random_safetensors(r: &mut Rand) -> Vec<u8> {
    let dtypes = [
        "F32", "F16", "BF16", "F64", "I64", "I32", "U8", "BOOL", "F8_E4M3", "X",
    ];
    let names = ["input_ids", "labels", "x", "y", "w"];
    let mut entries = Vec::new();
    let mut offset = 0u64;
    for _ in 0..1 + r.below(3) {
        let rank = r.below(4);
        let shape: Vec<u64> = (0..rank)
            .map(|_| match r.below(4) {
                0 => r.next() % 4,
                1 => r.next() % 64,
                2 => 10_000_000_000,
                _ => r.next(),
            })
            .collect();
        let len = match r.below(3) {
            0 => shape.iter().fold(4u64, |a, &b| a.wrapping_mul(b)),
            1 => r.next() % 256,
            _ => r.next(),
        };
        let end = offset.wrapping_add(len);
        entries.push(format!(
            "\"{}\":{{\"dtype\":\"{}\",\"shape\":{:?},\"data_offsets\":[{},{}]}}",
            names[r.below(names.len())],
            dtypes[r.below(dtypes.len())],
            shape,
            offset,
            end
        ));
        offset = end;
    }
    let header = format!("{{{}}}", entries.join(","));
    let claimed = match r.below(4) {
        0 => r.next(),
        _ => header.len() as u64,
    };
    let mut out = claimed.to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    let data = r.below(300);
    out.extend((0..data).map(|_| r.next() as u8));
    out
}

/// A run config built from the schema: known sections and keys with values of the right
/// type or a wrong one, extreme numbers included, so that most inputs parse and reach the
/// checks behind the parser.
fn random_run_config(r: &mut Rand) -> Vec<u8> {
    let keys: [(&str, &[&str]); 5] = [
        (
            "model",
            &[
                "kind",
                "hf",
                "hf_config",
                "t5_clamp",
                "inputs",
                "hidden",
                "classes",
                "weights",
            ],
        ),
        ("data", &["batch_file", "batch", "inputs", "seq"]),
        (
            "train",
            &[
                "precision",
                "steps",
                "accumulate",
                "clip",
                "clip_norm",
                "optimizer",
                "lr",
                "momentum",
                "weight_decay",
                "seed",
                "policy",
                "keep_fp32",
                "backend",
            ],
        ),
        (
            "scaler",
            &[
                "kind",
                "init_scale",
                "growth_factor",
                "backoff_factor",
                "growth_interval",
                "max_scale",
                "min_scale",
                "hysteresis",
                "enabled",
            ],
        ),
        (
            "probe",
            &["enabled", "sample_every", "trace", "summary_json"],
        ),
    ];
    let values = [
        "0",
        "1",
        "-1",
        "3",
        "1e309",
        "-0.0",
        "nan",
        "inf",
        "0.5",
        "65504.0",
        "1e-45",
        "18446744073709551615",
        "9223372036854775807",
        "4294967296",
        "true",
        "false",
        r#""fp16""#,
        r#""bf16""#,
        r#""half""#,
        r#""o2""#,
        r#""fp8""#,
        r#""t5""#,
        r#""mlp""#,
        r#""cuda""#,
        r#""cpu""#,
        r#""gpu""#,
        r#""auto""#,
        r#""adamw""#,
        r#""sgd""#,
        r#""l2""#,
        r#""inf""#,
        r#""hysteresis""#,
        r#""maxclip""#,
        r#""fixed""#,
        r#""none""#,
        r#""""#,
        r#"["encoder"]"#,
        "[]",
        r#""../x""#,
        "{}",
    ];
    let mut out = String::new();
    for _ in 0..1 + r.below(5) {
        let (section, names) = keys[r.below(keys.len())];
        out.push_str(&format!("[{section}]\n"));
        for _ in 0..r.below(6) {
            let k = names[r.below(names.len())];
            let v = values[r.below(values.len())];
            out.push_str(&format!("{k} = {v}\n"));
        }
    }
    out.into_bytes()
}

/// A JSON document (or JSON Lines) with one value changed: a number made extreme, a string
/// replaced, an array cut or grown, a key removed. The text stays valid JSON, so the input
/// reaches the checks behind the parser.
fn json_mutant(input: &[u8], r: &mut Rand) -> Vec<u8> {
    let text = String::from_utf8_lossy(input);
    let mut lines: Vec<String> = text.lines().map(String::from).collect();
    if lines.is_empty() {
        return input.to_vec();
    }
    let i = r.below(lines.len());
    let Ok(mut v) = serde_json::from_str::<serde_json::Value>(&lines[i]) else {
        return input.to_vec();
    };
    for _ in 0..1 + r.below(3) {
        mutate_value(&mut v, r, 0);
    }
    lines[i] = v.to_string();
    (lines.join("\n") + "\n").into_bytes()
}

fn mutate_value(v: &mut serde_json::Value, r: &mut Rand, depth: usize) {
    use serde_json::Value;
    match v {
        Value::Object(m) if !m.is_empty() && depth < 8 => {
            let k = m.keys().nth(r.below(m.len())).cloned().unwrap_or_default();
            if r.below(8) == 0 {
                m.remove(&k);
            } else if let Some(x) = m.get_mut(&k) {
                mutate_value(x, r, depth + 1);
            }
        }
        Value::Array(a) if !a.is_empty() && depth < 8 => match r.below(6) {
            0 => a.truncate(r.below(a.len())),
            1 => {
                let x = a[r.below(a.len())].clone();
                a.push(x);
            }
            _ => {
                let j = r.below(a.len());
                mutate_value(&mut a[j], r, depth + 1);
            }
        },
        _ => {
            *v = match r.below(9) {
                0 => serde_json::json!(u64::MAX),
                1 => serde_json::json!(-1),
                2 => serde_json::json!(1e300),
                3 => serde_json::json!("NaN"),
                4 => serde_json::json!("inf"),
                5 => serde_json::json!(null),
                6 => serde_json::json!([]),
                7 => serde_json::json!({}),
                _ => serde_json::json!(r.next() % 100_000),
            }
        }
    }
}

/// Runs one input under the allocation limit; `Err` describes a failure.
fn check(target: &str, input: &[u8]) -> Result<(), String> {
    LIMIT.store(alloc_limit(input.len()), Ordering::Relaxed);
    let t0 = Instant::now();
    let r = catch_unwind(AssertUnwindSafe(|| run_target(target, input)));
    LIMIT.store(0, Ordering::Relaxed);
    match r {
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            Err(format!("panic: {msg}"))
        }
        Ok(()) if t0.elapsed() > Duration::from_secs(1) => {
            Err(format!("took {:.1} s", t0.elapsed().as_secs_f64()))
        }
        Ok(()) => Ok(()),
    }
}

/// What a fuzz run of one target found.
struct Outcome {
    inputs: u64,
    failures: Vec<(Vec<u8>, String)>,
}

/// Runs the corpus of `target`, then `mutants` mutants from `seed`; with `current`, an
/// input whose allocation is refused (which aborts) is saved there first.
fn fuzz(target: &str, mutants: u64, seed: u64, current: Option<&Path>) -> Outcome {
    let seeds = corpus(target);
    assert!(!seeds.is_empty(), "the corpus of {target} is empty");
    let mut r = Rand(seed | 1);
    let mut out = Outcome {
        inputs: 0,
        failures: Vec::new(),
    };
    let run = |input: Vec<u8>, out: &mut Outcome| {
        if current.is_some() {
            let mut g = CURRENT.lock().unwrap_or_else(|e| e.into_inner());
            g.clear();
            g.extend_from_slice(&input);
        }
        out.inputs += 1;
        if let Err(why) = check(target, &input) {
            if out.failures.len() < 20 {
                out.failures.push((input, why));
            }
        }
    };
    for (_, bytes) in &seeds {
        run(bytes.clone(), &mut out);
    }
    for i in 0..mutants {
        let input = if target == "safetensors" && i % 4 == 0 {
            random_safetensors(&mut r)
        } else if target == "run_config" && i % 3 == 0 {
            random_run_config(&mut r)
        } else if matches!(target, "trace" | "hf_config") && i % 3 == 0 {
            let base = &seeds[r.below(seeds.len())].1;
            json_mutant(base, &mut r)
        } else {
            let base = &seeds[r.below(seeds.len())].1;
            mutate(target, base, &mut r)
        };
        run(input, &mut out);
    }
    out
}

fn show(input: &[u8]) -> String {
    let s = String::from_utf8_lossy(&input[..input.len().min(300)]);
    format!("{} bytes: {:?}", input.len(), s)
}

#[test]
fn corpus_and_mutants_parse_without_panics() {
    let mut bad = Vec::new();
    for t in TARGETS {
        let o = fuzz(t, 1500, 0x5eed ^ t.len() as u64, None);
        for (input, why) in o.failures {
            bad.push(format!("{t}: {why}\n  input {}", show(&input)));
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// The issue's example: a header claiming 10^10 elements in a file of about 100 bytes is
/// refused, under an allocation limit far below what the claim would need.
#[test]
fn a_header_claiming_more_than_the_file_holds_is_refused_before_allocating() {
    let header = r#"{"x":{"dtype":"F32","shape":[10000000000],"data_offsets":[0,40000000000]}}"#;
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(header.as_bytes());
    file.extend_from_slice(&[0u8; 16]);
    LIMIT.store(alloc_limit(file.len()), Ordering::Relaxed);
    let r = parse_safetensors(&file, Path::new("claims.safetensors"));
    LIMIT.store(0, Ordering::Relaxed);
    let e = r.expect_err("refused").to_string();
    assert!(e.contains("claims.safetensors"), "{e}");
    // A header length beyond the file.
    let mut file = (1u64 << 40).to_le_bytes().to_vec();
    file.extend_from_slice(b"{}");
    LIMIT.store(alloc_limit(file.len()), Ordering::Relaxed);
    let r = parse_safetensors(&file, Path::new("claims.safetensors"));
    LIMIT.store(0, Ordering::Relaxed);
    assert!(r.is_err());
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

/// `scripts/fuzz.sh`: a million inputs per target (`AMPROBE_FUZZ_INPUTS`), one target with
/// `AMPROBE_FUZZ_TARGET`. Failing inputs are saved into the corpus as `crash-*`.
#[test]
#[ignore]
fn fuzz_long() {
    let n: u64 = std::env::var("AMPROBE_FUZZ_INPUTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000_000);
    let only = std::env::var("AMPROBE_FUZZ_TARGET").ok();
    let seed: u64 = std::env::var("AMPROBE_FUZZ_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0x0a3b_7c2d);
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/fuzz");
    std::fs::create_dir_all(&dir).unwrap();
    let mut total_failures = 0;
    for t in TARGETS {
        if only.as_deref().is_some_and(|o| o != t) {
            continue;
        }
        let t0 = Instant::now();
        let current = dir.join(format!("{t}.current"));
        let _ = std::fs::remove_file(&current);
        let _ = CURRENT_PATH.set(current.clone());
        let o = fuzz(t, n, seed ^ t.len() as u64, Some(&current));
        for (input, why) in &o.failures {
            let h = input.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
                (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
            });
            let path = corpus_dir(t).join(format!("crash-{h:016x}"));
            std::fs::write(&path, input).unwrap();
            eprintln!("{t}: {why} (saved {})", path.display());
        }
        total_failures += o.failures.len();
        println!(
            "{t}: {} inputs, {} failures, {:.1} s",
            o.inputs,
            o.failures.len(),
            t0.elapsed().as_secs_f64()
        );
    }
    assert_eq!(total_failures, 0);
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
