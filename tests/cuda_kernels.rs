//! The CUDA kernel sources compile with NVRTC under amprobe's exact-arithmetic options.
//! Needs libnvrtc only (no GPU); skips where it cannot be loaded, unless
//! `AMPROBE_REQUIRE_GPU=1` asks for every CUDA check to run.

fn nvrtc_or_skip() -> bool {
    match amprobe::device::detect::nvrtc_version() {
        Ok(_) => true,
        Err(e) => {
            assert!(
                !amprobe::device::gpu_required(),
                "AMPROBE_REQUIRE_GPU=1 but NVRTC is unusable: {e}"
            );
            eprintln!("skipped: {e}");
            false
        }
    }
}

#[test]
#[ignore = "needs a GPU or the simulated device: scripts/test.sh runs it on the simulated device"]
fn kernels_compile_for_hopper_and_export_every_entry() {
    if !nvrtc_or_skip() {
        return;
    }
    let program = amprobe::backend::device_program();
    let ptx = program.compile(Some("sm_90")).expect("kernels compile");
    let src = ptx.to_src();
    for name in &program.kernels {
        assert!(
            src.contains(&format!(".entry {name}(")),
            "PTX lacks the entry point {name}"
        );
    }
    // Every f32 arithmetic instruction rounds to nearest on its own: no flush-to-zero, no
    // approximate division or square root. An f32 FMA appears only where a kernel calls
    // fmaf (the optimizers, as PyTorch's CPU kernels fuse there): `--fmad=false` keeps the
    // compiler from contracting anything else, which `no_contraction_into_fma` checks.
    // (libdevice's f64 routines seed with approximate instructions internally; their
    // results are f64 and rounded once more to f32, so f64 instructions are not checked.)
    let mut seen = 0;
    for line in src.lines() {
        let Some(ins) = line.split_whitespace().next() else {
            continue;
        };
        let arith = [
            "add.", "sub.", "mul.", "div.", "sqrt.", "rcp.", "fma.", "mad.",
        ]
        .iter()
        .any(|p| ins.starts_with(p));
        if arith && ins.ends_with(".f32") {
            seen += 1;
            assert!(
                ins.ends_with(".rn.f32") && !ins.starts_with("mad."),
                "inexact f32 instruction in the kernels: {line}"
            );
        }
    }
    assert!(
        seen > 50,
        "too few f32 instructions ({seen}): was the PTX parsed?"
    );
}

#[test]
#[ignore = "needs a GPU or the simulated device: scripts/test.sh runs it on the simulated device"]
fn no_contraction_into_fma() {
    if !nvrtc_or_skip() {
        return;
    }
    let src = "extern \"C\" __global__ void k(float* x) { x[0] = x[1] * x[2] + x[3]; }";
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(
        src,
        amprobe::device::cuda::program::compile_options(Some("sm_90")),
    )
    .expect("compiles")
    .to_src();
    assert!(ptx.contains("mul.rn.f32"), "{ptx}");
    assert!(!ptx.contains("fma."), "a*b+c was contracted: {ptx}");
}

#[test]
#[ignore = "needs a GPU or the simulated device: scripts/test.sh runs it on the simulated device"]
fn a_broken_source_reports_nvrtcs_log() {
    if !nvrtc_or_skip() {
        return;
    }
    let bad = "extern \"C\" __global__ void k(float* x) { x[0] = undefined_name; }";
    let err = cudarc::nvrtc::compile_ptx_with_opts(
        bad,
        amprobe::device::cuda::program::compile_options(Some("sm_90")),
    )
    .expect_err("must not compile");
    assert!(format!("{err:?}").contains("undefined_name"));
}
