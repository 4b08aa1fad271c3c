//! amprobe's environment variables, checked before any command runs: a value a variable
//! does not take is refused with a message naming the variable and what it takes, so that
//! under `amprobe run|tui|compare|fix|baseline -- CMD` the error is the CLI's, before the
//! command starts (the companion refuses the same values itself when run without the CLI:
//! python/amprobe_torch/_env.py and _plan.py). A variable that starts with `AMPROBE_` but is
//! none of amprobe's is named in a warning (a misspelt one would otherwise do nothing).

use anyhow::{bail, Result};
use std::ffi::OsString;

/// What a variable takes, as its check and as the message says it.
#[derive(Clone, Copy)]
enum Takes {
    /// `1` or `0` (empty: unset); `lenient` also takes `true` and `false`.
    Switch { lenient: bool },
    /// A whole number, 0 or more (what it counts, as the message says it).
    Count(&'static str),
    /// One of these words (empty: the default), compared without case where `fold`.
    Word(&'static [&'static str], bool),
    /// A positive finite number.
    Positive,
    /// Comma-separated dotted module paths.
    Patterns,
    /// One character.
    Char,
    /// Any path or text.
    Anything,
}

const VARIABLES: &[(&str, Takes)] = &[
    ("AMPROBE_TRACE", Takes::Anything),
    ("AMPROBE_DISABLE", Takes::Switch { lenient: false }),
    ("AMPROBE_AUTO", Takes::Switch { lenient: false }),
    (
        "AMPROBE_SAMPLE_EVERY",
        Takes::Count("a whole number of steps, 0 or more"),
    ),
    ("AMPROBE_CHECK", Takes::Word(&["modules", "ops"], false)),
    (
        "AMPROBE_AUTOCAST",
        Takes::Word(&["fp16", "bf16", "fp32"], true),
    ),
    ("AMPROBE_FP32_MODULES", Takes::Patterns),
    ("AMPROBE_INIT_SCALE", Takes::Positive),
    ("AMPROBE_DISCOVERY_REPORT", Takes::Anything),
    ("AMPROBE_COMPANION_CACHE", Takes::Anything),
    ("AMPROBE_CACHE_DIR", Takes::Anything),
    ("AMPROBE_REPRODUCIBLE", Takes::Switch { lenient: true }),
    ("AMPROBE_REQUIRE_GPU", Takes::Switch { lenient: true }),
    ("AMPROBE_TUI_PANIC_KEY", Takes::Char),
    // The project's own test and benchmark scripts' (set around the CLI, not read by it).
    ("AMPROBE_TORCH_VENV", Takes::Anything),
    ("AMPROBE_LINT_VENV", Takes::Anything),
    ("AMPROBE_BIN", Takes::Anything),
    ("AMPROBE_MODES", Takes::Anything),
    ("AMPROBE_BENCH_ONLY", Takes::Anything),
    ("AMPROBE_BENCH_JSON", Takes::Anything),
    (
        "AMPROBE_BENCH_REPS",
        Takes::Count("a whole number of repetitions, 0 or more"),
    ),
    ("AMPROBE_FUZZ_TARGET", Takes::Anything),
    (
        "AMPROBE_FUZZ_INPUTS",
        Takes::Count("a whole number of inputs, 0 or more"),
    ),
    (
        "AMPROBE_FUZZ_SEED",
        Takes::Count("a whole number, 0 or more"),
    ),
];

/// Checks this process's environment: the first refused value is the error; unknown
/// `AMPROBE_` names are warned about on stderr.
pub fn check() -> Result<()> {
    for name in check_vars(std::env::vars_os())? {
        eprintln!(
            "amprobe: warning: {name} is not one of amprobe's variables (they are: {})",
            VARIABLES
                .iter()
                .map(|(n, _)| *n)
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    Ok(())
}

/// Checks `vars`; returns the `AMPROBE_` names that are none of amprobe's.
pub fn check_vars(vars: impl IntoIterator<Item = (OsString, OsString)>) -> Result<Vec<String>> {
    let mut unknown = Vec::new();
    for (name, value) in vars {
        let Some(name) = name.to_str().filter(|n| n.starts_with("AMPROBE_")) else {
            continue;
        };
        let Some((_, takes)) = VARIABLES.iter().find(|(n, _)| *n == name) else {
            unknown.push(name.to_string());
            continue;
        };
        let Some(value) = value.to_str() else {
            bail!("{name}: its value is not valid UTF-8 ({})", what(*takes));
        };
        if !accepts(*takes, value.trim()) {
            bail!("{name}={value:?}: expected {}", what(*takes));
        }
    }
    Ok(unknown)
}

fn accepts(takes: Takes, v: &str) -> bool {
    match takes {
        Takes::Switch { lenient } => {
            matches!(v, "" | "0" | "1")
                || (lenient && (v.eq_ignore_ascii_case("true") || v.eq_ignore_ascii_case("false")))
        }
        Takes::Count(_) => {
            v.is_empty() || (v.bytes().all(|b| b.is_ascii_digit()) && v.parse::<u64>().is_ok())
        }
        Takes::Word(words, fold) => {
            v.is_empty()
                || words.iter().any(|w| {
                    if fold {
                        w.eq_ignore_ascii_case(v)
                    } else {
                        *w == v
                    }
                })
        }
        Takes::Positive => v.is_empty() || v.parse::<f64>().is_ok_and(|x| x > 0.0 && x.is_finite()),
        Takes::Patterns => v
            .split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .all(|p| {
                p.split('.')
                    .all(|s| !s.is_empty() && !s.contains(char::is_whitespace))
            }),
        Takes::Char => v.chars().count() <= 1,
        Takes::Anything => true,
    }
}

fn what(takes: Takes) -> String {
    match takes {
        Takes::Switch { lenient: false } => "1 (on) or 0 (off)".into(),
        Takes::Switch { lenient: true } => "1 or true (on), 0 or false (off)".into(),
        Takes::Count(what) => what.into(),
        Takes::Word(words, _) => format!("one of {}", words.join(", ")),
        Takes::Positive => "a positive finite number".into(),
        Takes::Patterns => {
            "comma-separated dotted module paths (`wo`, `encoder.block.*.layer.1`)".into()
        }
        Takes::Char => "one character".into(),
        Takes::Anything => "any text".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(pairs: &[(&str, &str)]) -> Result<Vec<String>> {
        check_vars(
            pairs
                .iter()
                .map(|(n, v)| (OsString::from(n), OsString::from(v))),
        )
    }

    #[test]
    fn bad_values_are_refused_naming_the_variable_and_what_it_takes() {
        for (name, bad, takes) in [
            ("AMPROBE_SAMPLE_EVERY", "abc", "whole number"),
            ("AMPROBE_SAMPLE_EVERY", "-3", "whole number"),
            ("AMPROBE_SAMPLE_EVERY", "1.5", "whole number"),
            ("AMPROBE_DISABLE", "yes", "1 (on) or 0"),
            ("AMPROBE_CHECK", "sometimes", "modules, ops"),
            ("AMPROBE_AUTOCAST", "fp8", "fp16, bf16, fp32"),
            ("AMPROBE_INIT_SCALE", "-1", "positive finite"),
            ("AMPROBE_INIT_SCALE", "inf", "positive finite"),
            ("AMPROBE_FP32_MODULES", "a..b", "dotted module paths"),
            ("AMPROBE_REPRODUCIBLE", "on", "true (on)"),
            ("AMPROBE_TUI_PANIC_KEY", "ab", "one character"),
        ] {
            let e = run(&[(name, bad)]).unwrap_err().to_string();
            assert!(
                e.starts_with(&format!("{name}=")) && e.contains(takes),
                "{e}"
            );
        }
    }

    #[test]
    fn good_values_and_unset_ones_pass_and_unknown_names_are_returned() {
        let ok = [
            ("AMPROBE_SAMPLE_EVERY", "0"),
            ("AMPROBE_SAMPLE_EVERY", " 12 "),
            ("AMPROBE_DISABLE", ""),
            ("AMPROBE_AUTOCAST", "BF16"),
            ("AMPROBE_INIT_SCALE", "1024"),
            ("AMPROBE_FP32_MODULES", "wo, encoder.block.*.layer.1"),
            ("AMPROBE_REQUIRE_GPU", "true"),
            ("AMPROBE_TRACE", "t.jsonl"),
            ("PATH", "x"),
        ];
        assert!(run(&ok).unwrap().is_empty());
        assert_eq!(
            run(&[("AMPROBE_SAMPLE_EVRY", "3")]).unwrap(),
            ["AMPROBE_SAMPLE_EVRY"]
        );
    }
}
