//! The PyTorch companion (`python/`, `amprobe_torch`) under its own tests: pytest over
//! python/tests, with torch from the cache `scripts/python-tests.sh` keeps (installed there
//! on first use, with a message), and this build's `amprobe` reading the traces it writes.

use std::process::Command;

#[test]
fn the_companions_pytest_suite_passes() {
    let root = env!("CARGO_MANIFEST_DIR");
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
    println!("{text}");
    assert!(
        out.status.success(),
        "the companion's tests failed:\n{text}"
    );
    assert!(
        text.contains(" passed") && !text.contains(" skipped"),
        "every companion test runs:\n{text}"
    );
}
