//! Compiles the project's CUDA kernel sources for the host under `cpp/cudasim.cuh`, with a
//! table of every `extern "C" __global__` kernel, plus the fiber engine.

use std::path::{Path, PathBuf};

fn cu_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    let mut entries: Vec<PathBuf> = rd.filter_map(|e| e.ok().map(|e| e.path())).collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            cu_files(&p, out);
        } else if p.extension().is_some_and(|e| e == "cu") {
            out.push(p);
        }
    }
}

/// `extern "C" __global__ void NAME(` occurrences.
fn kernel_names(src: &str) -> Vec<String> {
    let mut names = Vec::new();
    let key = "__global__ void ";
    let mut rest = src;
    while let Some(i) = rest.find(key) {
        let after = &rest[i + key.len()..];
        let end = after.find('(').unwrap_or(0);
        let name = after[..end].trim();
        if !name.is_empty() && rest[..i].trim_end().ends_with("extern \"C\"") {
            names.push(name.to_string());
        }
        rest = &after[end..];
    }
    names
}

/// Rewrites `extern __shared__ T name[];` (dynamic shared memory) into a pointer to the
/// block's dynamic shared buffer; everything else is left as written.
fn host_source(src: &str) -> String {
    let mut out = String::new();
    for line in src.lines() {
        let t = line.trim();
        if let Some(decl) = t.strip_prefix("extern __shared__ ") {
            if let Some(decl) = decl.strip_suffix("[];") {
                let (ty, name) = decl.rsplit_once(' ').expect("type and name");
                let ty = ty.trim().trim_start_matches("__align__(16)").trim();
                out.push_str(&format!(
                    "{ty}* {name} = ({ty}*)cudasim::current()->dynamic_shared;\n"
                ));
                continue;
            }
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

fn main() {
    let here = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("manifest dir"));
    let root = here.join("../..");
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("out dir"));
    let common = root.join("src/device/cuda/common.cuh");
    let mut sources = Vec::new();
    cu_files(&root.join("src"), &mut sources);
    cu_files(&root.join("probes"), &mut sources);
    cu_files(&here.join("kernels"), &mut sources);

    let mut unit = String::from("#include \"cudasim.cuh\"\n#include \"registry.h\"\n");
    unit.push_str(&host_source(
        &std::fs::read_to_string(&common).expect("common.cuh"),
    ));
    let mut names = Vec::new();
    for s in &sources {
        let text = std::fs::read_to_string(s).expect("kernel source");
        names.extend(kernel_names(&text));
        unit.push_str(&format!("// ---- {}\n", s.display()));
        unit.push_str(&host_source(&text));
        println!("cargo:rerun-if-changed={}", s.display());
    }
    unit.push_str("\nstatic const KernelInfo CUDASIM_KERNELS[] = {\n");
    for n in &names {
        unit.push_str(&format!("    kernel_info(\"{n}\", &{n}),\n"));
    }
    unit.push_str(
        "};\nextern \"C\" const KernelInfo* cudasim_kernels(size_t* n) {\n    \
         *n = sizeof(CUDASIM_KERNELS) / sizeof(CUDASIM_KERNELS[0]);\n    \
         return CUDASIM_KERNELS;\n}\n",
    );
    let unit_path = out.join("kernels.cpp");
    println!("cargo:rerun-if-changed={}", common.display());
    println!("cargo:rerun-if-changed=cpp");
    println!("cargo:rerun-if-changed=kernels");
    // A new .cu file anywhere under src/ or probes/ must reach the host build: watch the
    // folders, and recompile only when the generated unit or the headers changed (the
    // folders change with every Rust edit too).
    println!("cargo:rerun-if-changed={}", root.join("src").display());
    println!("cargo:rerun-if-changed={}", root.join("probes").display());
    let stamp = out.join("kernels.stamp");
    let headers: String = ["cpp/cudasim.cuh", "cpp/engine.cpp", "cpp/registry.h"]
        .iter()
        .map(|f| std::fs::read_to_string(here.join(f)).unwrap_or_default())
        .collect();
    let key = format!("{unit}\n{headers}");
    let lib = out.join("libcudasim_kernels.a");
    if lib.exists() && std::fs::read_to_string(&stamp).is_ok_and(|s| s == key) {
        println!("cargo:rustc-link-search=native={}", out.display());
        println!("cargo:rustc-link-lib=static=cudasim_kernels");
        println!("cargo:rustc-link-lib=dylib=stdc++");
        return;
    }
    std::fs::write(&unit_path, unit).expect("write kernels.cpp");

    cc::Build::new()
        .cpp(true)
        .std("c++17")
        .include(here.join("cpp"))
        .file(here.join("cpp/engine.cpp"))
        .file(&unit_path)
        .flag("-ffp-contract=off")
        .flag("-fno-fast-math")
        .flag("-fno-strict-aliasing")
        .warnings(false)
        .opt_level(2)
        .compile("cudasim_kernels");
    std::fs::write(&stamp, key).expect("write kernels.stamp");
}
