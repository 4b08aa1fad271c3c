//! What a T5-base-size encoder training step asks of a GPU, counted by the simulated device
//! (`crates/cudasim`) and turned into an H100 roofline estimate: kernel launches, bytes
//! moved and GEMM flops per step, probes on and off, fp16 autocast.
//!
//! The workload is T5EncoderModel with the relu FFN, d_model 768, 12 layers, d_ff 3072,
//! 12 heads, d_kv 64, seq 512, batch 8, the LM objective on the tied embedding, SGD, with a
//! 512-word vocabulary (see `VOCAB`). The simulated device runs every kernel on the CPU, far
//! too slowly for that step, so smaller steps are measured and the full one extrapolated:
//! at fixed widths and sequence length, a step's launches grow with the layer count only,
//! and its bytes and flops are `a + b·layers + c·batch + d·layers·batch` (each layer's
//! weights are batch-independent, its activations proportional to the batch). Four sizes
//! fix the four coefficients; a fifth, measured, must match its prediction within 1%.
//!
//! Run with the simulated device on the library path:
//! `LD_LIBRARY_PATH="$(scripts/cudasim.sh):<NVRTC's lib dir>" cargo bench --bench t5_base_device`.

mod common;

use amprobe::amp::mode::Precision;
use amprobe::device::cuda::counters::{measure_traffic, sim_counters, SimCounters};
use amprobe::device::{detect, Detection};
use amprobe::train::Trainer;
use std::time::Instant;

/// The smaller of the two batches the model is fitted at (the check runs at this + 2).
const FIT_BATCH: usize = 2;
/// Sequence length (T5-base's pre-training length).
const SEQ: usize = 512;
/// The vocabulary: 512 words rather than T5's 32128. The vocabulary only sizes the tied
/// embedding and the LM head's logits; at 32128 words they hold 25M values (and 16M logits
/// per sequence), which would more than double the simulated device's time per step.
const VOCAB: usize = 512;
/// The full size the measurements are extrapolated to.
const LAYERS: usize = 12;
const BATCH: usize = 8;

/// H100 SXM: HBM bandwidth (bytes/s), dense fp16/bf16 tensor-core and f32 throughput
/// (flop/s).
const HBM: f64 = 3.35e12;
const TENSOR_FLOPS: f64 = 990e12;
const F32_FLOPS: f64 = 67e12;

/// What one steady-state step did.
#[derive(Clone, Copy, Debug, Default)]
struct Step {
    /// Kernel launches plus cuBLAS GEMM calls.
    launches: f64,
    /// Bytes kernels read and wrote (measured), GEMM operand bytes, and copy bytes.
    bytes: f64,
    /// GEMM flops with fp16/bf16 operands.
    flops: f64,
    /// GEMM flops with f32 operands.
    f32_flops: f64,
}

impl Step {
    fn from(c: &SimCounters) -> Step {
        Step {
            launches: (c.launches + c.gemm_calls) as f64,
            bytes: (c.kernel_read_bytes
                + c.kernel_written_bytes
                + c.gemm_bytes
                + c.htod_bytes
                + c.dtoh_bytes
                + c.dtod_bytes) as f64,
            flops: (c.gemm_flops - c.gemm_f32_flops) as f64,
            f32_flops: c.gemm_f32_flops as f64,
        }
    }

    fn fields(&self) -> [f64; 4] {
        [self.launches, self.bytes, self.flops, self.f32_flops]
    }

    fn from_fields(f: [f64; 4]) -> Step {
        Step {
            launches: f[0],
            bytes: f[1],
            flops: f[2],
            f32_flops: f[3],
        }
    }

    /// Seconds to move the bytes at full HBM bandwidth.
    fn memory_s(&self) -> f64 {
        self.bytes / HBM
    }

    /// Seconds of GEMM math at peak throughput.
    fn math_s(&self) -> f64 {
        self.flops / TENSOR_FLOPS + self.f32_flops / F32_FLOPS
    }
}

/// Probed and unprobed steps of one size, and how long the simulated device took.
struct Measured {
    layers: usize,
    batch: usize,
    probed: Step,
    unprobed: Step,
    seconds: f64,
}

fn trainer(precision: Precision, probes: bool, layers: usize, batch: usize) -> Trainer {
    let size = common::Size {
        layers,
        batch,
        seq: SEQ,
        vocab: VOCAB,
    };
    common::t5_base_trainer(precision, probes, size).expect("trainer")
}

/// Step 2 of a probed and an unprobed trainer, traffic measured; steps 0 and 1 fill the
/// device's memory cache (unmeasured, which is faster).
fn measure(precision: Precision, layers: usize, batch: usize) -> Measured {
    let t0 = Instant::now();
    let mut trainers = [
        trainer(precision, true, layers, batch),
        trainer(precision, false, layers, batch),
    ];
    for t in &mut trainers {
        for s in 0..2 {
            t.step(s).expect("warm-up step");
        }
    }
    let mut steps = [Step::default(); 2];
    for (t, out) in trainers.iter_mut().zip(&mut steps) {
        measure_traffic(true);
        let before = sim_counters().expect("counters");
        t.step(2).expect("step");
        let d = sim_counters().expect("counters").since(&before);
        measure_traffic(false);
        if d.allocs != 0 {
            eprintln!(
                "note: {layers} layers, batch {batch}: step 2 allocated {} times",
                d.allocs
            );
        }
        *out = Step::from(&d);
    }
    Measured {
        layers,
        batch,
        probed: steps[0],
        unprobed: steps[1],
        seconds: t0.elapsed().as_secs_f64(),
    }
}

/// `a + b·l + c·n + d·l·n` through the four corners (1, 1), (2, 1), (1, 2), (2, 2).
struct Bilinear {
    a: [f64; 4],
    b: [f64; 4],
    c: [f64; 4],
    d: [f64; 4],
}

impl Bilinear {
    /// The coefficients from 1 and 2 layers at batches `b1` and `b1 + 1`.
    fn fit(b1: usize, f11: Step, f21: Step, f12: Step, f22: Step) -> Bilinear {
        let b1 = b1 as f64;
        let (f11, f21, f12, f22) = (f11.fields(), f21.fields(), f12.fields(), f22.fields());
        let mut m = Bilinear {
            a: [0.0; 4],
            b: [0.0; 4],
            c: [0.0; 4],
            d: [0.0; 4],
        };
        for i in 0..4 {
            m.d[i] = f22[i] - f21[i] - f12[i] + f11[i];
            m.b[i] = f21[i] - f11[i] - m.d[i] * b1;
            m.c[i] = f12[i] - f11[i] - m.d[i];
            m.a[i] = f11[i] - m.b[i] - (m.c[i] + m.d[i]) * b1;
        }
        m
    }

    fn at(&self, layers: usize, batch: usize) -> Step {
        let (l, n) = (layers as f64, batch as f64);
        let mut f = [0.0; 4];
        for (i, v) in f.iter_mut().enumerate() {
            *v = self.a[i] + self.b[i] * l + self.c[i] * n + self.d[i] * l * n;
        }
        Step::from_fields(f)
    }
}

fn relative_error(predicted: f64, measured: f64) -> f64 {
    if measured == 0.0 {
        predicted.abs()
    } else {
        (predicted - measured).abs() / measured.abs()
    }
}

/// Fails loudly unless every prediction is within 1% of the measurement.
fn check(what: &str, predicted: Step, measured: Step) {
    let names = [
        "launches",
        "bytes",
        "fp16/bf16 GEMM flops",
        "f32 GEMM flops",
    ];
    for ((name, p), m) in names.iter().zip(predicted.fields()).zip(measured.fields()) {
        let e = relative_error(p, m);
        println!(
            "  {what:<9} {name:<21} predicted {p:>16.0}  measured {m:>16.0}  off {:.4}%",
            e * 100.0
        );
        if e > 0.01 {
            eprintln!(
                "error: the extrapolation model does not hold: {what} {name} predicted {p:.0}, \
                 measured {m:.0} ({:.2}% off, over 1%)",
                e * 100.0
            );
            std::process::exit(2);
        }
    }
}

fn main() {
    if let Detection::Unavailable { reason } = detect() {
        eprintln!(
            "skipped: no CUDA device ({reason}); this bench reads the simulated device's \
             counters: put scripts/cudasim.sh's folder and NVRTC first on LD_LIBRARY_PATH"
        );
        return;
    }
    if sim_counters().is_none() {
        eprintln!(
            "skipped: the CUDA driver is not the simulated device, whose counters this bench \
             reads (run it with scripts/cudasim.sh's folder first on LD_LIBRARY_PATH)"
        );
        return;
    }
    let precision = Precision::Fp16;
    println!(
        "T5 encoder, d_model 768, d_ff 3072, 12 heads, d_kv 64, seq {SEQ}, vocab {VOCAB}, \
         {} autocast, SGD; step 2 of each trainer",
        precision.name()
    );
    let mut runs = Vec::new();
    // From batch 2: at 12 heads × 512 positions a batch of 2 has the 8192 lines from which
    // the softmax runs its grouped kernels, as batch 8 does (batch 1 runs the per-line ones).
    for (layers, batch) in [
        (1, FIT_BATCH),
        (2, FIT_BATCH),
        (1, FIT_BATCH + 1),
        (2, FIT_BATCH + 1),
        (1, FIT_BATCH + 2),
    ] {
        let m = measure(precision, layers, batch);
        println!(
            "measured {layers} layer(s), batch {batch}: {:.0} s on the simulated device \
             (probed and unprobed, 3 steps each)",
            m.seconds
        );
        runs.push(m);
    }
    let model = |pick: fn(&Measured) -> Step| {
        Bilinear::fit(
            FIT_BATCH,
            pick(&runs[0]),
            pick(&runs[1]),
            pick(&runs[2]),
            pick(&runs[3]),
        )
    };
    let probed = model(|m| m.probed);
    let unprobed = model(|m| m.unprobed);
    let last = &runs[4];
    println!(
        "check: {} layers, batch {} predicted from the four sizes above, then measured:",
        last.layers, last.batch
    );
    check("probed", probed.at(last.layers, last.batch), last.probed);
    check(
        "unprobed",
        unprobed.at(last.layers, last.batch),
        last.unprobed,
    );
    // The same layer count at other batches: (1, b) against (1, b + 1) and (1, b + 2),
    // (2, b) against (2, b + 1).
    for (x, y) in [(0, 2), (0, 4), (1, 3)] {
        let (a, b) = (&runs[x], &runs[y]);
        if a.probed.launches != b.probed.launches || a.unprobed.launches != b.unprobed.launches {
            eprintln!(
                "error: launches depend on the batch ({} layers: batch {} and {})",
                a.layers, a.batch, b.batch
            );
            std::process::exit(2);
        }
    }

    let full = [probed.at(LAYERS, BATCH), unprobed.at(LAYERS, BATCH)];
    println!();
    println!(
        "{LAYERS} layers, batch {BATCH}, per step (extrapolated from the measured sizes; \
         GEMM flops only, other kernels' flops not counted: they are memory-bound):"
    );
    println!(
        "{:<9} {:>9} {:>10} {:>12} {:>12} {:>10} {:>10} {:>12} {:>12}",
        "probes",
        "launches",
        "GB moved",
        "GEMM TFLOP",
        "f32 TFLOP",
        "memory ms",
        "math ms",
        "serial ms",
        "bound ms"
    );
    for (name, s) in ["on", "off"].iter().zip(&full) {
        println!(
            "{:<9} {:>9.0} {:>10.2} {:>12.3} {:>12.3} {:>10.2} {:>10.2} {:>12.2} {:>12.2}",
            name,
            s.launches,
            s.bytes / 1e9,
            s.flops / 1e12,
            s.f32_flops / 1e12,
            s.memory_s() * 1e3,
            s.math_s() * 1e3,
            (s.memory_s() + s.math_s()) * 1e3,
            s.memory_s().max(s.math_s()) * 1e3,
        );
    }
    let (on, off) = (full[0], full[1]);
    println!(
        "probed/unprobed: launches {:.3}, bytes {:.3}, serial estimate {:.3}, bound {:.3} \
         (target ≤ 1.10)",
        on.launches / off.launches,
        on.bytes / off.bytes,
        (on.memory_s() + on.math_s()) / (off.memory_s() + off.math_s()),
        on.memory_s().max(on.math_s()) / off.memory_s().max(off.math_s()),
    );
    println!(
        "H100 roofline: {:.2} TB/s HBM, {:.0} TFLOP/s fp16/bf16 dense, {:.0} TFLOP/s f32. \
         serial = bytes/bandwidth + flops/throughput (a serial bound: no overlap of memory \
         and math); bound = the larger of the two (no kernel can beat it). Launch overheads \
         and memsets are not in either.",
        HBM / 1e12,
        TENSOR_FLOPS / 1e12,
        F32_FLOPS / 1e12
    );
}
