//! The fuzzer's inputs: mutants of seeds (bit flips, random bytes, insertions, deletions,
//! duplicated spans, splices with another seed, tokens of the target's grammar, extreme
//! numbers in place of numbers, deep nesting, invalid UTF-8, truncation) and
//! structure-aware ones that stay well-formed so as to reach the checks behind the parser:
//! run configs built from the schema, JSON and TOML documents with values changed,
//! safetensors headers with random shapes, dtypes and offsets.

/// xorshift64*: the mutator's randomness. Each input has its own, from the run's seed and
/// the input's index, so that any input can be made again alone and the inputs do not
/// depend on how many threads share the run.
pub struct Rand(u64);

impl Rand {
    pub fn for_input(seed: u64, index: u64) -> Rand {
        // splitmix64's finalizer: neighbouring indices give unrelated streams.
        let mut z = seed ^ index.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        Rand((z ^ (z >> 31)) | 1)
    }
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next() % n as u64) as usize
        }
    }
    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}

const RUN_CONFIG_TOKENS: &[&str] = &[
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
];

const JSON_TOKENS: &[&str] = &[
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
];

const SAFETENSORS_TOKENS: &[&str] = &[
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
];

const STEP_TOKENS: &[&str] = &[
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
];

const LOCK_TOKENS: &[&str] = &[
    "lock_version = ",
    "[tolerances]",
    "[envelopes]",
    "[[envelopes.ops]]",
    "[[envelopes.scale]]",
    "max_abs_factor = ",
    "headroom_binades = nan",
    "min_exp_drop = -1",
    "unmatched_ops = \"fail\"",
    "steps = ",
    "nth = ",
    "micro = ",
    "phase = \"backward\"",
    "sixteen_bit = \"bfloat16\"",
    "= nan",
    "= inf",
    "= -inf",
    "= ",
    "\"",
    "[",
    "]",
    "{",
    "}",
    ",",
    "\n",
];

const ENV_TOKENS: &[&str] = &[
    "1",
    "0",
    "true",
    "FALSE",
    "fp16",
    "bf16",
    "fp32",
    "modules",
    "ops",
    ",",
    ".",
    "*",
    " ",
    "\t",
    "\n",
    "-",
    "+",
    "_",
    "e",
    "E",
    "1e309",
    "nan",
    "inf",
    "0x10",
    "\u{b2}",
    "\u{663}",
    "\u{ff11}",
    "\u{a0}",
    "\u{1c}",
    "\u{3000}",
    "\u{feff}",
    "wo",
    "encoder.block.*.layer.1",
];

/// Tokens of each target's grammar, spliced into mutants.
pub fn tokens(target: &str) -> &'static [&'static str] {
    match target {
        "run_config" => RUN_CONFIG_TOKENS,
        "hf_config" | "trace" => JSON_TOKENS,
        "safetensors" => SAFETENSORS_TOKENS,
        "lockfile" => LOCK_TOKENS,
        "env" => ENV_TOKENS,
        _ => STEP_TOKENS,
    }
}

/// Numbers that break parsers that trust them.
const EXTREMES: &[&str] = &[
    "0",
    "-0",
    "-1",
    "1e309",
    "-1e309",
    "1e-400",
    "65505",
    "65536",
    "2147483648",
    "4294967296",
    "9223372036854775807",
    "-9223372036854775808",
    "18446744073709551615",
    "18446744073709551616",
    "1e-320",
    "NaN",
    "10000000000",
    "340282366920938463463374607431768211456",
];

/// Sequences that are not UTF-8 (a stray continuation byte, an overlong NUL, a surrogate,
/// a code point past U+10FFFF, a cut sequence) and two that are but trip naive readers.
const NOT_UTF8: &[&[u8]] = &[
    &[0xff],
    &[0x80],
    &[0xc0, 0x80],
    &[0xed, 0xa0, 0x80],
    &[0xf4, 0x90, 0x80, 0x80],
    &[0xe2, 0x82],
    &[0xef, 0xbb, 0xbf],
    &[0],
];

/// Openers and closers that nest: a parser that recurses per level must stop early.
const NESTS: &[(&str, &str)] = &[("[", "]"), ("{\"a\":", "}"), ("{a=", "}")];

/// One mutant of `input`; `others` are seeds to splice with.
pub fn mutate(target: &str, input: &[u8], others: &[Vec<u8>], r: &mut Rand) -> Vec<u8> {
    let mut v = input.to_vec();
    for _ in 0..1 + r.below(4) {
        mutate_once(target, &mut v, others, r);
    }
    v
}

fn mutate_once(target: &str, v: &mut Vec<u8>, others: &[Vec<u8>], r: &mut Rand) {
    let n = v.len();
    match r.below(11) {
        0 if n > 0 => {
            let i = r.below(n);
            v[i] ^= 1 << r.below(8);
        }
        1 if n > 0 => {
            let i = r.below(n);
            v[i] = r.next() as u8;
        }
        2 => {
            let bytes: Vec<u8> = (0..1 + r.below(8)).map(|_| r.next() as u8).collect();
            insert(v, &bytes, r);
        }
        3 if n > 0 => {
            let i = r.below(n);
            let k = 1 + r.below((n - i).min(64));
            v.drain(i..i + k);
        }
        4 if n > 0 => {
            let i = r.below(n);
            let span = v[i..i + 1 + r.below((n - i).min(256))].to_vec();
            insert(v, &span, r);
        }
        5 => insert(v, r.pick(tokens(target)).as_bytes(), r),
        6 => extreme_number(v, r),
        7 => insert(v, &nesting(r), r),
        8 => {
            let bytes: &[u8] = r.pick::<&[u8]>(NOT_UTF8);
            insert(v, bytes, r)
        }
        9 if !others.is_empty() => {
            let other = r.pick(others);
            v.truncate(r.below(n + 1));
            v.extend_from_slice(&other[r.below(other.len() + 1)..]);
        }
        _ if n > 0 => v.truncate(r.below(n)),
        _ => {}
    }
}

fn insert(v: &mut Vec<u8>, bytes: &[u8], r: &mut Rand) {
    let i = r.below(v.len() + 1);
    v.splice(i..i, bytes.iter().copied());
}

/// Replaces a run of digits with an extreme number.
fn extreme_number(v: &mut Vec<u8>, r: &mut Rand) {
    let n = v.len();
    let digits: Vec<usize> = (0..n).filter(|&i| v[i].is_ascii_digit()).collect();
    if let Some(&i) = digits.get(r.below(digits.len().max(1))) {
        let mut j = i;
        while j < n && (v[j].is_ascii_digit() || v[j] == b'.') {
            j += 1;
        }
        v.splice(i..j, r.pick(EXTREMES).bytes());
    }
}

/// Nesting around the recursion limits parsers have (128 in serde_json) and far past them,
/// closed or left open.
fn nesting(r: &mut Rand) -> Vec<u8> {
    // Far past any limit, but rarely: such an input costs a thousand small ones.
    let depth = match r.below(32) {
        0 => 100_000,
        _ => *r.pick(&[2, 64, 127, 128, 129, 1000, 10_000]),
    };
    let (open, close) = *r.pick(NESTS);
    let mut s = open.repeat(depth);
    if r.below(2) == 0 {
        s.push_str(&close.repeat(depth));
    }
    s.into_bytes()
}

/// A safetensors file built from random parts: a header whose shapes, dtypes and offsets
/// may disagree with each other and with the data that follows.
pub fn random_safetensors(r: &mut Rand) -> Vec<u8> {
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
                2 => *r.pick(&[10_000_000_000, 1 << 32, 1 << 62, u64::MAX]),
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
            r.pick(&names),
            r.pick(&dtypes),
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

/// The run config's sections and their keys.
const RUN_CONFIG_KEYS: [(&str, &[&str]); 5] = [
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

/// Values of every type the run config's keys take, and wrong ones.
const RUN_CONFIG_VALUES: &[&str] = &[
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

/// A run config built from the schema: known sections and keys with values of the right
/// type or a wrong one, extreme numbers included, so that most inputs parse and reach the
/// checks behind the parser.
pub fn random_run_config(r: &mut Rand) -> Vec<u8> {
    let mut out = String::new();
    for _ in 0..1 + r.below(5) {
        let (section, names) = *r.pick(&RUN_CONFIG_KEYS);
        out.push_str(&format!("[{section}]\n"));
        for _ in 0..r.below(6) {
            let k = r.pick(names);
            let v = r.pick(RUN_CONFIG_VALUES);
            out.push_str(&format!("{k} = {v}\n"));
        }
    }
    out.into_bytes()
}

/// A JSON document (or JSON Lines) with one value changed: a number made extreme, a string
/// replaced, an array cut or grown, a key removed. The text stays valid JSON, so the input
/// reaches the checks behind the parser.
pub fn json_mutant(input: &[u8], r: &mut Rand) -> Vec<u8> {
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

/// Values put in place of a TOML value: extreme numbers, the specials, other types.
const TOML_VALUES: &[&str] = &[
    "0",
    "-1",
    "1e308",
    "-0.0",
    "nan",
    "inf",
    "-inf",
    "+inf",
    "4294967296",
    "9223372036854775807",
    "18446744073709551615",
    "true",
    "\"\"",
    "\"fp16\"",
    "\"bfloat16\"",
    "\"backward\"",
    "\"ignore\"",
    "[]",
    "{}",
    "[1, 2]",
    "{ a = 1 }",
];

/// A TOML document with values changed in its text: the value after a ` = ` replaced, a
/// line repeated (a key twice, an op twice) or dropped. Most results stay TOML, so they
/// reach the checks behind the parser; the text is not read and written again, which
/// would cost more than the parse under test.
pub fn toml_mutant(input: &[u8], r: &mut Rand) -> Vec<u8> {
    let mut v = input.to_vec();
    for _ in 0..1 + r.below(3) {
        match r.below(4) {
            0 => line_edit(&mut v, r, true),
            1 => line_edit(&mut v, r, false),
            _ => replace_value(&mut v, r),
        }
    }
    v
}

fn replace_value(v: &mut Vec<u8>, r: &mut Rand) {
    let eqs: Vec<usize> = v
        .windows(3)
        .enumerate()
        .filter(|(_, w)| w == b" = ")
        .map(|(i, _)| i + 3)
        .collect();
    let Some(&at) = eqs.get(r.below(eqs.len().max(1))) else {
        return;
    };
    let mut end = at;
    let mut quoted = false;
    while end < v.len() && (quoted || !b",}\n".contains(&v[end])) {
        quoted ^= v[end] == b'"';
        end += 1;
    }
    v.splice(at..end, r.pick(TOML_VALUES).bytes());
}

/// Repeats (`twice`) or drops a random line.
fn line_edit(v: &mut Vec<u8>, r: &mut Rand, twice: bool) {
    let starts: Vec<usize> = std::iter::once(0)
        .chain(
            v.iter()
                .enumerate()
                .filter(|(_, &b)| b == b'\n')
                .map(|(i, _)| i + 1),
        )
        .filter(|&i| i < v.len())
        .collect();
    let Some(&a) = starts.get(r.below(starts.len().max(1))) else {
        return;
    };
    let b = v[a..]
        .iter()
        .position(|&c| c == b'\n')
        .map_or(v.len(), |k| a + k + 1);
    if twice {
        let line = v[a..b].to_vec();
        v.splice(b..b, line);
    } else {
        v.drain(a..b);
    }
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
        _ => *v = extreme_value(r),
    }
}

fn extreme_value(r: &mut Rand) -> serde_json::Value {
    use serde_json::json;
    match r.below(11) {
        0 => json!(u64::MAX),
        1 => json!(-1),
        2 => json!(1e300),
        3 => json!("NaN"),
        4 => json!("inf"),
        5 => json!(null),
        6 => json!([]),
        7 => json!({}),
        8 => json!(i64::MIN),
        9 => json!(-0.0),
        _ => json!(r.next() % 100_000),
    }
}
