//! The `AMPROBE_*` variables as the command line checks them before a command starts
//! (src/cli/env_check.rs, compiled in here since the command line is not the library's):
//! an input is `NAME=value`, checked as one variable of an environment.

#[path = "../../src/cli/env_check.rs"]
#[allow(dead_code)]
mod env_check;

use super::mutate::{mutate, Rand};
use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;

/// The variables whose values are checked, with values each takes (and a few it does not)
/// as seeds: the plan's (AUTOCAST, FP32_MODULES, INIT_SCALE) and the companion's.
const VARIABLES: &[(&str, &[&str])] = &[
    (
        "AMPROBE_AUTOCAST",
        &["fp16", "bf16", "fp32", "BF16", " fp16 ", "fp8"],
    ),
    (
        "AMPROBE_FP32_MODULES",
        &["wo", "encoder.block.*.layer.1", "a,b.c", " x , y ", "a..b"],
    ),
    (
        "AMPROBE_INIT_SCALE",
        &["65536", "1024.0", "1e-3", "2.5e4", "-1", "inf"],
    ),
    (
        "AMPROBE_SAMPLE_EVERY",
        &["0", "12", " 3 ", "18446744073709551615", "abc", "-3"],
    ),
    ("AMPROBE_DISABLE", &["1", "0", "", "yes"]),
    ("AMPROBE_AUTO", &["1", "0"]),
    ("AMPROBE_CHECK", &["modules", "ops", "sometimes"]),
    ("AMPROBE_REPRODUCIBLE", &["1", "true", "FALSE", "on"]),
    ("AMPROBE_REQUIRE_GPU", &["0", "true"]),
    ("AMPROBE_TUI_PANIC_KEY", &["q", "\u{e9}", "", "ab"]),
    ("AMPROBE_BENCH_REPS", &["3", "0"]),
];

/// Every `NAME=value` of [`VARIABLES`].
pub fn seeds() -> Vec<Vec<u8>> {
    VARIABLES
        .iter()
        .flat_map(|(name, values)| values.iter().map(move |v| format!("{name}={v}")))
        .map(String::into_bytes)
        .collect()
}

fn split(input: &[u8]) -> Option<(&str, &[u8])> {
    let eq = input.iter().position(|&b| b == b'=')?;
    let name = std::str::from_utf8(&input[..eq]).ok()?;
    Some((name, &input[eq + 1..]))
}

/// A seed with its value mutated (the name kept: an unknown name is only warned about).
pub fn mutant(seeds: &[Vec<u8>], r: &mut Rand) -> Vec<u8> {
    let seed = r.pick(seeds);
    let Some((name, value)) = split(seed) else {
        return seed.clone();
    };
    let values: Vec<Vec<u8>> = seeds
        .iter()
        .filter_map(|s| split(s).map(|(_, v)| v.to_vec()))
        .collect();
    let mut v = mutate("env", value, &values, r);
    // The environment cannot hold a NUL.
    v.retain(|&b| b != 0);
    let mut out = format!("{name}=").into_bytes();
    out.extend_from_slice(&v);
    out
}

/// Checks one `NAME=value` as the command line checks its environment's (not set in this
/// process's: glibc's `setenv` keeps every string it was given, and ten million of them
/// took this process past 24 GB): a refusal must name the variable.
pub fn run(input: &[u8]) -> bool {
    let Some((name, value)) = split(input) else {
        return false;
    };
    // (an environment cannot hold a NUL)
    if !VARIABLES.iter().any(|(n, _)| *n == name) || value.contains(&0) {
        return false;
    }
    let r = env_check::check_vars([(OsString::from(name), OsString::from_vec(value.to_vec()))]);
    if let Err(e) = &r {
        let e = e.to_string();
        assert!(
            e.starts_with(name),
            "a refusal that does not name {name}: {e}"
        );
    }
    r.is_ok()
}
