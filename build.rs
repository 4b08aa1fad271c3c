//! Embeds the PyTorch companion's sources (`python/amprobe_torch/*.py`) in the binary, so
//! that `amprobe run -- python train.py` can hand them to the script's Python
//! (src/cli/companion.rs) without a pip-installed copy.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

fn main() {
    let root = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let dir = root.join("python").join("amprobe_torch");
    println!("cargo:rerun-if-changed=build.rs");
    // The directory too, so that a file added or removed is seen.
    println!("cargo:rerun-if-changed=python/amprobe_torch");
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|entry| entry.unwrap_or_else(|e| panic!("reading {}: {e}", dir.display())))
        .filter(|entry| entry.file_type().is_ok_and(|t| t.is_file()))
        .filter_map(|entry| entry.file_name().into_string().ok())
        .filter(|name| name.ends_with(".py"))
        .collect();
    names.sort();
    assert!(
        names.iter().any(|n| n == "__init__.py"),
        "{} holds no __init__.py",
        dir.display()
    );
    let mut code = String::from(
        "/// The companion's files, `(name, text)`, sorted by name.\n\
         pub const FILES: &[(&str, &str)] = &[\n",
    );
    for name in &names {
        println!("cargo:rerun-if-changed=python/amprobe_torch/{name}");
        let path = dir.join(name);
        let path = path
            .to_str()
            .unwrap_or_else(|| panic!("{} is not UTF-8", path.display()));
        writeln!(code, "    ({name:?}, include_str!({path:?})),").unwrap();
    }
    code.push_str("];\n");
    let out = Path::new(&std::env::var_os("OUT_DIR").expect("OUT_DIR")).join("companion_files.rs");
    std::fs::write(&out, code).unwrap_or_else(|e| panic!("writing {}: {e}", out.display()));
}
