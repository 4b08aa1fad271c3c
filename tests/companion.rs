//! The PyTorch companion (`python/`, `amprobe_torch`) under its own tests: pytest over
//! python/tests, with torch from the cache `scripts/python-tests.sh` keeps (installed there
//! on first use, with a message), and this build's `amprobe` reading the traces it writes.
//! scripts/test.sh runs that suite beside the Rust tests and names its run's folder in
//! `AMPROBE_COMPANION_RUN` (pytest's output in `output`, then its exit status in `status`):
//! this test then waits for that run and judges it, instead of running its own.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

/// (whether pytest passed, what it printed), of a run made here.
fn run_here(root: &str) -> (bool, String) {
    let out = Command::new("bash")
        .arg(format!("{root}/scripts/python-tests.sh"))
        .current_dir(root)
        .env("AMPROBE_BIN", env!("CARGO_BIN_EXE_amprobe"))
        .output()
        .expect("run scripts/python-tests.sh");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// (whether pytest passed, what it printed), of the run scripts/test.sh started in `dir`,
/// once it has ended.
fn run_of_test_sh(dir: &Path) -> (bool, String) {
    let status = dir.join("status");
    let start = Instant::now();
    while !status.exists() {
        assert!(
            start.elapsed() < Duration::from_secs(3 * 3600),
            "the companion's run in {} (AMPROBE_COMPANION_RUN) wrote no status in 3 hours",
            dir.display()
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    // (test.sh writes it whole, by a rename, once the output is complete)
    let code = std::fs::read_to_string(&status).unwrap_or_default();
    let text = std::fs::read_to_string(dir.join("output")).unwrap_or_else(|e| {
        panic!(
            "the companion's run in {} has no readable output: {e}",
            dir.display()
        )
    });
    (code.trim() == "0", text)
}

#[test]
fn the_companions_pytest_suite_passes() {
    let root = env!("CARGO_MANIFEST_DIR");
    let (passed, text) = match std::env::var_os("AMPROBE_COMPANION_RUN") {
        Some(dir) => run_of_test_sh(Path::new(&dir)),
        None => run_here(root),
    };
    println!("{text}");
    assert!(passed, "the companion's tests failed:\n{text}");
    assert!(
        text.contains(" passed") && !text.contains(" skipped"),
        "every companion test runs:\n{text}"
    );
}
