//! The PyTorch companion this amprobe carries: `python/amprobe_torch/*.py`, embedded at
//! build time (build.rs), written once into a cache directory named by its version and
//! content, and put first on the `PYTHONPATH` of every command amprobe runs, next to a
//! `sitecustomize.py` that starts it. A script with no amprobe line in it, and no companion
//! installed, is then watched: the companion attaches to the model, optimizers and scaler
//! as the script makes them (`AMPROBE_AUTO=1`).

use anyhow::{bail, Context};
use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

include!(concat!(env!("OUT_DIR"), "/companion_files.rs"));

/// Where the companion's copies go instead of the user's cache directory.
pub const CACHE_VAR: &str = "AMPROBE_COMPANION_CACHE";
/// Tells the companion to discover the model, optimizers and scaler as they are made.
pub const AUTO_VAR: &str = "AMPROBE_AUTO";
/// Where the companion writes, at exit, what it saw when it attached to nothing (JSON:
/// `message`, `seen`).
pub const DISCOVERY_REPORT_VAR: &str = "AMPROBE_DISCOVERY_REPORT";

/// The file that marks a copy as complete; written last.
const MARKER: &str = ".complete";

/// Python imports `sitecustomize` from the first directory of its path that has one, at
/// start-up: this one starts the companion and never stops the user's Python.
const SITECUSTOMIZE: &str = r#"# amprobe's: brings the companion amprobe carries into this Python process (amprobe_torch/_boot.py says what it does).
try:
    import amprobe_torch._boot as _amprobe_boot
except Exception as _amprobe_error:  # never stop the user's Python
    import sys as _sys
    _sys.stderr.write(f"amprobe: the companion could not start ({_amprobe_error!r}); the script runs unwatched\n")
else:
    _amprobe_boot.start(__file__)
"#;

/// The companion's version: the `TOOL_VERSION = "..."` line of `_version.py`, the
/// version its traces name (the crate's).
pub fn version() -> &'static str {
    FILES
        .iter()
        .find(|(name, _)| *name == "_version.py")
        .and_then(|(_, text)| {
            text.lines().find_map(|l| {
                l.strip_prefix("TOOL_VERSION = \"")
                    .and_then(|rest| rest.strip_suffix('"'))
            })
        })
        .unwrap_or("unversioned")
}

/// FNV-1a (64-bit) over every file the copy holds, name and text, each preceded by its
/// length: it names the copy, so a build with other sources never uses this one's.
pub fn hash() -> u64 {
    static HASH: OnceLock<u64> = OnceLock::new();
    *HASH.get_or_init(|| {
        let mut h = Fnv1a::new();
        let files = FILES
            .iter()
            .copied()
            .chain([("sitecustomize.py", SITECUSTOMIZE)]);
        for (name, text) in files {
            for part in [name, text] {
                h.write(&(part.len() as u64).to_le_bytes());
                h.write(part.as_bytes());
            }
        }
        h.0
    })
}

/// The 64-bit FNV-1a hash.
struct Fnv1a(u64);

impl Fnv1a {
    fn new() -> Fnv1a {
        Fnv1a(0xcbf2_9ce4_8422_2325)
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 ^= u64::from(b);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
}

/// The directory a command's Python gets first on its `PYTHONPATH`, holding
/// `amprobe_torch/` and `sitecustomize.py`: `<cache>/<version>-<hash>`, where the cache is
/// `$AMPROBE_COMPANION_CACHE`, else `${XDG_CACHE_HOME:-$HOME/.cache}/amprobe/companion`.
/// Written on first use (into a temporary sibling, then renamed, so that no process sees
/// half a copy); a complete copy is used as it is.
pub fn site_dir() -> anyhow::Result<PathBuf> {
    site_dir_in(&cache_root()?)
}

/// The cache directory copies go into (absolute: the command may change directory).
fn cache_root() -> anyhow::Result<PathBuf> {
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
    let root = match var(CACHE_VAR) {
        Some(d) => PathBuf::from(d),
        None => {
            let base = match var("XDG_CACHE_HOME") {
                Some(x) => PathBuf::from(x),
                None => PathBuf::from(var("HOME").with_context(|| {
                    format!(
                        "no directory for the companion amprobe carries: none of {CACHE_VAR}, \
                         XDG_CACHE_HOME and HOME is set"
                    )
                })?)
                .join(".cache"),
            };
            base.join("amprobe").join("companion")
        }
    };
    std::path::absolute(&root)
        .with_context(|| format!("the companion's cache directory {}", root.display()))
}

/// [`site_dir`] under `root`.
fn site_dir_in(root: &Path) -> anyhow::Result<PathBuf> {
    let dir = root.join(format!("{}-{:016x}", version(), hash()));
    if is_complete(&dir) {
        return Ok(dir);
    }
    std::fs::create_dir_all(root).with_context(|| {
        format!(
            "creating the companion's cache directory {} (set {CACHE_VAR} to put it elsewhere)",
            root.display()
        )
    })?;
    let tmp = fresh_sibling(&dir)?;
    let written = write_copy(&tmp).and_then(|()| publish(&tmp, &dir));
    if written.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    written.map(|()| dir)
}

fn is_complete(dir: &Path) -> bool {
    dir.join(MARKER).is_file()
}

/// A new empty directory next to `dir`, `<name>.tmp-<pid>-<nanos>`.
fn fresh_sibling(dir: &Path) -> anyhow::Result<PathBuf> {
    let name = dir.file_name().unwrap_or_default().to_string_lossy();
    loop {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let tmp = dir.with_file_name(format!("{name}.tmp-{}-{nanos}", std::process::id()));
        match std::fs::create_dir(&tmp) {
            Ok(()) => return Ok(tmp),
            // Another thread of this process took the same instant.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => {
                return Err(e).with_context(|| format!("creating {}", tmp.display()));
            }
        }
    }
}

/// Writes the copy into `tmp`: `amprobe_torch/<file>`, `sitecustomize.py`, then the marker.
fn write_copy(tmp: &Path) -> anyhow::Result<()> {
    let write = |path: PathBuf, text: &str| {
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))
    };
    let pkg = tmp.join("amprobe_torch");
    std::fs::create_dir(&pkg).with_context(|| format!("creating {}", pkg.display()))?;
    for (name, text) in FILES {
        write(pkg.join(name), text)?;
    }
    write(tmp.join("sitecustomize.py"), SITECUSTOMIZE)?;
    write(
        tmp.join(MARKER),
        &format!("amprobe_torch {} {:016x}\n", version(), hash()),
    )
}

/// Renames the complete copy `tmp` to `dir`; when another process got there first, its
/// copy is used and `tmp` removed. A copy at `dir` without its marker (cut short by hand
/// or by a cache cleaner) is replaced.
fn publish(tmp: &Path, dir: &Path) -> anyhow::Result<()> {
    let mut tries = 0;
    loop {
        let err = match std::fs::rename(tmp, dir) {
            Ok(()) => return Ok(()),
            Err(e) => e,
        };
        if is_complete(dir) {
            let _ = std::fs::remove_dir_all(tmp);
            return Ok(());
        }
        tries += 1;
        if tries == 3 {
            return Err(err)
                .with_context(|| format!("moving {} to {}", tmp.display(), dir.display()));
        }
        match std::fs::remove_dir_all(dir) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(e).with_context(|| {
                    format!(
                        "removing {}, an incomplete copy of the companion",
                        dir.display()
                    )
                });
            }
            _ => {}
        }
    }
}

/// Gives `cmd` the companion: [`site_dir`] first on its `PYTHONPATH` (the one it would
/// have otherwise follows), `AMPROBE_AUTO=1`, and `AMPROBE_DISCOVERY_REPORT=report`.
/// Returns the site directory.
pub fn prepare(cmd: &mut Command, report: &Path) -> anyhow::Result<PathBuf> {
    let site = site_dir().context("writing the companion amprobe carries")?;
    set_env(cmd, &site, report)?;
    Ok(site)
}

fn set_env(cmd: &mut Command, site: &Path, report: &Path) -> anyhow::Result<()> {
    if site.as_os_str().as_encoded_bytes().contains(&b':') {
        bail!(
            "the companion's directory {} holds a ':', which PYTHONPATH cannot carry: set \
             {CACHE_VAR} to another",
            site.display()
        );
    }
    let existing = match cmd.get_envs().find(|(k, _)| *k == "PYTHONPATH") {
        Some((_, v)) => v.map(OsStr::to_os_string),
        None => std::env::var_os("PYTHONPATH"),
    };
    cmd.env("PYTHONPATH", python_path(site, existing.as_deref()))
        .env(AUTO_VAR, "1")
        .env(DISCOVERY_REPORT_VAR, report);
    Ok(())
}

/// `site`, then `existing` after a ':' unless it is empty.
fn python_path(site: &Path, existing: Option<&OsStr>) -> OsString {
    let mut v = site.as_os_str().to_os_string();
    if let Some(e) = existing.filter(|e| !e.is_empty()) {
        v.push(":");
        v.push(e);
    }
    v
}

/// Where the companion says what it saw when it attached to nothing: the trace's file
/// name with `.discovery.json` appended.
pub fn discovery_report(trace: &Path) -> PathBuf {
    let mut name = trace.file_name().unwrap_or_default().to_os_string();
    name.push(".discovery.json");
    trace.with_file_name(name)
}

/// Removes a discovery report an earlier run left (it must not pass for this one's).
pub fn remove_old_report(report: &Path) -> anyhow::Result<()> {
    match std::fs::remove_file(report) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e)
            .with_context(|| format!("removing the old discovery report {}", report.display())),
        _ => Ok(()),
    }
}

/// Why a command wrote no trace, as far as the companion can say: its discovery report's
/// `message` when it wrote one, else that the command's Python did not load it.
pub fn why_no_trace(report: &Path) -> String {
    let Ok(text) = std::fs::read_to_string(report) else {
        return "the command's Python did not load the companion amprobe carries, or loaded \
                it and never imported torch, or could not start it (its output then says why): \
                a command that is not Python, or a Python run with -E, -I or -S (which ignore \
                PYTHONPATH), does not load it; amprobe_torch.watch(model, optimizer, scaler) \
                in the script, before its training loop, also works"
            .to_string();
    };
    let message = serde_json::from_str::<serde_json::Value>(&text)
        .ok()
        .and_then(|v| v.get("message")?.as_str().map(str::to_string));
    match message {
        Some(m) => format!(
            "the companion amprobe carries attached to nothing: {m} (what it saw: {})",
            report.display()
        ),
        None => format!(
            "the companion amprobe carries attached to nothing, and its report {} says no \
             more (no `message`)",
            report.display()
        ),
    }
}

/// The companion a command gets and from where, for `amprobe doctor`.
pub fn describe() -> String {
    let what = format!(
        "amprobe_torch {} (carried by this amprobe, {} files, hash {:016x})",
        version(),
        FILES.len(),
        hash()
    );
    match site_dir() {
        Ok(dir) => format!(
            "companion: {what} at {}; a command's python imports it first (PYTHONPATH)",
            dir.display()
        ),
        Err(e) => format!("companion: {what} NOT written: {e:#}; a command's python gets none"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn on_disk(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("python/amprobe_torch")
            .join(name)
    }

    #[test]
    fn the_embedded_files_are_the_sources_byte_for_byte() {
        let names: Vec<&str> = FILES.iter().map(|(n, _)| *n).collect();
        assert!(names.contains(&"__init__.py") && names.contains(&"_version.py"));
        assert!(names.windows(2).all(|w| w[0] < w[1]), "sorted: {names:?}");
        for (name, text) in FILES {
            let disk = std::fs::read_to_string(on_disk(name)).unwrap();
            assert!(disk == *text, "{name} differs from the source");
        }
        let mut disk: Vec<String> = std::fs::read_dir(on_disk(""))
            .unwrap()
            .filter_map(|e| e.unwrap().file_name().into_string().ok())
            .filter(|n| n.ends_with(".py"))
            .collect();
        disk.sort();
        assert_eq!(disk, names);
        assert_eq!(version(), env!("CARGO_PKG_VERSION"));
    }

    #[test]
    fn fnv1a_is_the_published_function() {
        let of = |s: &str| {
            let mut h = Fnv1a::new();
            h.write(s.as_bytes());
            h.0
        };
        assert_eq!(of(""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(of("a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(of("foobar"), 0x8594_4171_f739_67e8);
    }

    /// The copy in `dir` is complete and holds exactly what is carried.
    fn assert_complete(dir: &Path) {
        assert!(is_complete(dir), "{}", dir.display());
        for (name, text) in FILES {
            let got = std::fs::read_to_string(dir.join("amprobe_torch").join(name)).unwrap();
            assert!(got == *text, "{name}");
        }
        let site = std::fs::read_to_string(dir.join("sitecustomize.py")).unwrap();
        assert_eq!(site, SITECUSTOMIZE);
    }

    fn entries(root: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(root)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn the_site_dir_is_written_once_complete_and_then_reused() {
        let root = tempfile::tempdir().unwrap();
        let cache = root.path().join("a").join("b");
        let dir = site_dir_in(&cache).unwrap();
        assert_eq!(
            dir,
            cache.join(format!("{}-{:016x}", version(), hash())),
            "named by version and hash"
        );
        assert_complete(&dir);
        let stamp = std::fs::metadata(dir.join(MARKER))
            .unwrap()
            .modified()
            .unwrap();
        assert_eq!(site_dir_in(&cache).unwrap(), dir);
        let again = std::fs::metadata(dir.join(MARKER))
            .unwrap()
            .modified()
            .unwrap();
        assert_eq!(stamp, again, "a complete copy is not written again");
        assert_eq!(entries(&cache).len(), 1, "no temporary directory left");
    }

    #[test]
    fn a_copy_without_its_marker_is_replaced() {
        let root = tempfile::tempdir().unwrap();
        let dir = site_dir_in(root.path()).unwrap();
        std::fs::remove_file(dir.join(MARKER)).unwrap();
        std::fs::remove_file(dir.join("amprobe_torch/__init__.py")).unwrap();
        assert_eq!(site_dir_in(root.path()).unwrap(), dir);
        assert_complete(&dir);
        assert_eq!(entries(root.path()).len(), 1);
    }

    #[test]
    fn two_threads_at_once_both_get_a_complete_copy() {
        for _ in 0..5 {
            let root = tempfile::tempdir().unwrap();
            let start = std::sync::Barrier::new(2);
            let (start, cache) = (&start, root.path());
            let dirs: Vec<PathBuf> = std::thread::scope(|s| {
                let hs: Vec<_> = (0..2)
                    .map(|_| {
                        s.spawn(move || {
                            start.wait();
                            let d = site_dir_in(cache).unwrap();
                            assert_complete(&d);
                            d
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            });
            assert_eq!(dirs[0], dirs[1]);
            assert_eq!(entries(root.path()).len(), 1, "{:?}", entries(root.path()));
        }
    }

    #[test]
    fn the_childs_pythonpath_starts_with_the_companion_and_keeps_the_callers() {
        let site = Path::new("/c/0.1.0-00");
        let of = |e: Option<&str>| python_path(site, e.map(OsStr::new));
        assert_eq!(of(Some("/a:/b")), "/c/0.1.0-00:/a:/b");
        assert_eq!(of(Some("")), "/c/0.1.0-00");
        assert_eq!(of(None), "/c/0.1.0-00");
        let env = |cmd: &Command, key: &str| {
            cmd.get_envs()
                .find(|(k, _)| *k == key)
                .and_then(|(_, v)| v.map(OsStr::to_os_string))
        };
        let mut cmd = Command::new("true");
        cmd.env("PYTHONPATH", "/mine");
        set_env(&mut cmd, site, Path::new("/t/r.json")).unwrap();
        assert_eq!(
            env(&cmd, "PYTHONPATH").unwrap(),
            "/c/0.1.0-00:/mine",
            "the value the command was given"
        );
        assert_eq!(env(&cmd, AUTO_VAR).unwrap(), "1");
        assert_eq!(env(&cmd, DISCOVERY_REPORT_VAR).unwrap(), "/t/r.json");
        let mut cmd = Command::new("true");
        assert!(set_env(&mut cmd, Path::new("/a:b"), Path::new("/r")).is_err());
    }

    #[test]
    fn a_run_without_a_trace_says_what_the_companion_saw() {
        let d = tempfile::tempdir().unwrap();
        let report = discovery_report(&d.path().join("t.jsonl"));
        assert_eq!(report, d.path().join("t.jsonl.discovery.json"));
        assert!(why_no_trace(&report).contains("-E, -I or -S"));
        assert!(why_no_trace(&report).contains("amprobe_torch.watch(model, optimizer, scaler)"));
        std::fs::write(
            &report,
            r#"{"message": "no optimizer was made: planted", "seen": {}}"#,
        )
        .unwrap();
        let why = why_no_trace(&report);
        assert!(why.contains("no optimizer was made: planted"), "{why}");
        remove_old_report(&report).unwrap();
        assert!(!report.exists());
        remove_old_report(&report).unwrap();
    }

    #[test]
    fn doctor_names_the_companion() {
        let line = describe();
        assert!(
            line.starts_with(&format!("companion: amprobe_torch {}", version())),
            "{line}"
        );
        assert!(line.contains(&format!("{} files", FILES.len())), "{line}");
    }
}
