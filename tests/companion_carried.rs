//! The companion this amprobe carries, as a command `amprobe run -- CMD` starts sees it:
//! its copy first on the command's PYTHONPATH (before the caller's own), the discovery
//! variables, and what a run that wrote no trace is told. Checked without PyTorch: the runs
//! of real scripts are in python/tests.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

/// `amprobe run --trace DIR/t.jsonl -- CMD`, the companion's cache in `DIR/companion-cache`
/// (its copy's path then names the companion).
fn run(dir: &Path, cmd: &[&str], pythonpath: Option<&str>) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_amprobe"));
    c.args(["run", "--trace"])
        .arg(dir.join("t.jsonl"))
        .arg("--")
        .args(cmd)
        .current_dir(dir)
        .stdin(Stdio::null())
        .env("AMPROBE_COMPANION_CACHE", dir.join("companion-cache"));
    match pythonpath {
        Some(p) => c.env("PYTHONPATH", p),
        None => c.env_remove("PYTHONPATH"),
    };
    c.output().expect("amprobe runs")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn a_commands_python_gets_the_carried_companion_first() {
    let d = tempfile::tempdir().unwrap();
    let cache = d.path().join("companion-cache");
    let script = "import sys; print([p for p in sys.path if 'companion' in p][0]); \
                  print(sys.modules['sitecustomize'].__file__)";
    let o = run(d.path(), &["python3", "-c", script], None);
    let (out, err) = (text(&o.stdout), text(&o.stderr));
    let lines: Vec<&str> = out.lines().collect();
    let [site, sitecustomize] = lines[..] else {
        panic!("{out}\n{err}");
    };
    let site = PathBuf::from(site);
    assert!(site.starts_with(&cache), "{out}\n{err}");
    for f in ["amprobe_torch/__init__.py", "sitecustomize.py", ".complete"] {
        assert!(site.join(f).is_file(), "{} has no {f}", site.display());
    }
    // The carried sitecustomize is the one Python ran at its start.
    assert_eq!(Path::new(sitecustomize), site.join("sitecustomize.py"));
    // No trace: exit 2, and the message is about the companion.
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("wrote no trace") && err.contains("companion amprobe carries"),
        "{err}"
    );
    assert!(!err.contains("pip install"), "{err}");
    // Its Python never imported torch: the message names that Python, and says whether
    // torch is installed for it.
    assert!(err.contains("never imported torch"), "{err}");
    let has_torch = Command::new("python3")
        .args([
            "-c",
            "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)",
        ])
        .status()
        .expect("python3 runs")
        .success();
    assert_eq!(
        err.contains("torch is not installed for it"),
        !has_torch,
        "{err}"
    );
}

#[test]
fn the_callers_pythonpath_follows_the_companions() {
    let d = tempfile::tempdir().unwrap();
    let body = "echo \"$PYTHONPATH|$AMPROBE_AUTO|$AMPROBE_DISCOVERY_REPORT\"";
    let o = run(d.path(), &["sh", "-c", body], Some("/planted/a:/planted/b"));
    let out = text(&o.stdout);
    let fields: Vec<&str> = out.trim().split('|').collect();
    let [path, auto, report] = fields[..] else {
        panic!("{out}");
    };
    let (site, rest) = path.split_once(':').expect("two parts");
    assert!(
        Path::new(site).starts_with(d.path().join("companion-cache")),
        "{out}"
    );
    assert_eq!(rest, "/planted/a:/planted/b");
    assert_eq!(auto, "1");
    assert_eq!(
        Path::new(report),
        d.path().join("t.jsonl.discovery.json"),
        "{out}"
    );
    // An empty PYTHONPATH is dropped, not kept as an empty entry (the working directory).
    let o = run(d.path(), &["sh", "-c", "echo \"$PYTHONPATH\""], Some(""));
    assert_eq!(text(&o.stdout).trim(), site);
}

#[test]
fn a_run_that_wrote_no_trace_gives_the_companions_word() {
    let d = tempfile::tempdir().unwrap();
    let report = d.path().join("t.jsonl.discovery.json");
    let body = r#"printf '{"message": "saw no optimizer: planted", "seen": {"modules": 1}}' > "$AMPROBE_DISCOVERY_REPORT""#;
    let o = run(d.path(), &["sh", "-c", body], None);
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("wrote no trace") && err.contains("saw no optimizer: planted"),
        "{err}"
    );
    // A report an earlier run left does not pass for this one's.
    std::fs::write(
        &report,
        r#"{"message": "left by an earlier run", "seen": {}}"#,
    )
    .unwrap();
    let o = run(d.path(), &["sh", "-c", "exit 0"], None);
    let err = text(&o.stderr);
    assert!(!err.contains("left by an earlier run"), "{err}");
    assert!(err.contains("did not load the companion"), "{err}");
}
