//! `amprobe doctor`: what this machine offers the CUDA backend, a device self-test, and the
//! companion a command amprobe runs gets.

use super::out::outln;
use amprobe::backend::BackendChoice;
use amprobe::backend_choice::parity;
use amprobe::device::cuda::program::arch_name;
use amprobe::device::detect::{self, detect, Detection};
use clap::Args;

/// Arguments of `amprobe doctor`.
#[derive(Args, Debug)]
pub struct DoctorArgs {
    /// Also run every device op against the CPU emulator (needs a GPU; exit 1 on a
    /// mismatch).
    #[arg(long)]
    selftest: bool,
    /// Print the findings as JSON.
    #[arg(long)]
    json: bool,
    /// Elements per tensor in the self-test.
    #[arg(long, default_value_t = 4099)]
    elements: usize,
}

/// Prints what was found; returns the exit code.
pub fn run(a: DoctorArgs) -> anyhow::Result<i32> {
    let found = detect();
    let resolved = amprobe::backend_choice::resolve_backend(BackendChoice::Auto)?;
    let nvrtc = detect::nvrtc_version();
    // Compiling needs only libnvrtc: say whether the kernels build here (a PTX this NVRTC
    // made from these sources before, kept on disk, says so without the seconds a compile
    // takes).
    let compiled = nvrtc.as_ref().ok().map(|_| {
        let arch = match &found {
            Detection::Available(i) => i.devices.first().map(|d| d.compute_capability),
            Detection::Unavailable { .. } => None,
        };
        let arch = arch.map(|(a, b)| arch_name(a, b)).unwrap_or("sm_90");
        (
            arch,
            amprobe::backend::device_program()
                .compile_cached(arch)
                .map(|_| ()),
        )
    });
    if a.json {
        let v = serde_json::json!({
            "version": env!("CARGO_PKG_VERSION"),
            "gpu": found,
            "nvrtc": nvrtc.as_ref().ok().map(|(a, b)| format!("{a}.{b}")),
            "nvrtc_error": nvrtc.as_ref().err(),
            "kernels_compile": compiled.as_ref().map(|(arch, r)| serde_json::json!({
                "arch": arch,
                "ok": r.is_ok(),
                "error": r.as_ref().err().map(|e| e.to_string()),
            })),
            "auto_backend": format!("{:?}", resolved.kind).to_lowercase(),
            "auto_reason": resolved.reason,
            "companion": super::companion::describe(),
        });
        outln!("{}", serde_json::to_string_pretty(&v)?)?;
    } else {
        outln!("amprobe {}", env!("CARGO_PKG_VERSION"))?;
        super::out::write(format_args!("{}", detect::describe(&found)))?;
        if !found.is_available() {
            match &nvrtc {
                Ok((x, y)) => outln!("NVRTC: {x}.{y}")?,
                Err(e) => outln!("NVRTC: {e}")?,
            }
        }
        match &compiled {
            Some((arch, Ok(()))) => outln!("kernels: compile for {arch}")?,
            Some((arch, Err(e))) => outln!("kernels: do NOT compile for {arch}: {e}")?,
            None => outln!("kernels: not compiled (no NVRTC)")?,
        }
        outln!(
            "backend auto -> {}: {}",
            format!("{:?}", resolved.kind).to_lowercase(),
            resolved.reason
        )?;
        outln!("{}", super::companion::describe())?;
    }
    if !a.selftest {
        return Ok(0);
    }
    if let Detection::Unavailable { reason } = &found {
        anyhow::bail!("--selftest needs a usable GPU: {reason}");
    }
    let dev = amprobe::backend::open_device(0, false)?;
    let checks = parity::run_all(&dev, 7, a.elements)?;
    let mut failed = 0;
    outln!(
        "{:<48} {:>5} {:>7} {:>8}  result",
        "check",
        "dtype",
        "n",
        "max ulp"
    )?;
    for c in &checks {
        failed += usize::from(!c.ok());
        outln!(
            "{:<48} {:>5} {:>7} {:>8}  {}",
            c.name,
            c.dtype.to_string(),
            c.n,
            c.max_ulp,
            if c.ok() {
                "ok".to_string()
            } else {
                format!(
                    "FAIL {} ({})",
                    c.failures,
                    c.first
                        .as_deref()
                        .unwrap_or("")
                        .lines()
                        .next()
                        .unwrap_or("")
                )
            }
        )?;
    }
    outln!("{} checks, {failed} failed", checks.len())?;
    Ok(i32::from(failed > 0))
}
