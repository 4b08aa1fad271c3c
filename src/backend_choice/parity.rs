//! Device results against the CPU emulator, op by op, on random inputs in each dtype.
//!
//! Used by the GPU tests and by `amprobe doctor --selftest`. Each check states its bound:
//! - casts, the IEEE-arithmetic unary ops and broadcast binary ops (forward and gradient):
//!   identical (the same f32 operations in the same order; gradient sums in f64 in the
//!   CPU's row-major order);
//! - transcendental unary ops: the device evaluates exp/log/tanh/erf/pow in f64 and rounds
//!   to f32 (correctly rounded but for rare double roundings), while the CPU uses the f32
//!   libm routines (within 2 ulp). So an element passes at ≤ 2 ulp of the output dtype, or
//!   at |Δ| ≤ 2⁻²⁰·max(1, |x|): a ≤ 4-ulp difference of an inner value of magnitude ≤ 1
//!   (erf, tanh, a sigmoid) scaled by a factor of at most 4|x| in the GELU/SiLU formulas,
//!   where cancellation (1 + erf(x) near x = -3) makes ulps of the result meaningless;
//! - GEMM, against the exact product (f64, rounded once): an f32 sum of k products in any
//!   order is within γ_k·Σ|a||b| of it (γ_k = k·2⁻²⁴ / (1 - k·2⁻²⁴)), plus one ulp of the
//!   output dtype for the final rounding;
//! - probe statistics: every count, extreme and histogram bin identical; the f64 sum of
//!   squares within 2·n·2⁻⁵³ relative (two summation orders of n non-negative terms);
//! - the other families, run through the engine on host and device leaves (forward,
//!   backward through `backward_with`, and every recorded op's rounding counts, device
//!   counts read from the arena): shape ops, sums, means, max, gradient accumulation and
//!   T5's RMSNorm chain, layer norm, embedding and dropout (the CPU's mask) identical;
//!   softmax and log-softmax (an exp or log inside, f32
//!   libm on the CPU) within 4 ulp of the output dtype or |Δ| ≤ 2⁻¹⁸·max(1, |cpu|), their
//!   rounding counts identical; mean squared error, NLL (ignored rows included), `where`
//!   (both branches' gradients summed in f64 in the CPU's order) and `masked_fill` (with
//!   its masked -inf count, from the op's arena slot for a device mask) identical;
//!   cross-entropy, fused and as CUDA autocast decomposes it (log-softmax, then NLL),
//!   within the softmax bound.

use crate::device::cuda::arena::{self, StatsArena};
use crate::device::cuda::CudaDevice;
use crate::dtype::{DType, RoundCounts};
use crate::engine::observer::{Observer, OpEvent};
use crate::engine::Engine;
use crate::error::Result;
use crate::ops::cuda::Out;
use crate::ops::elementwise::{Binary, Unary};
use crate::ops::{cast::cuda as cast_dev, elementwise::cuda as ew_dev, linalg::cuda as mm_dev};
use crate::rng::Rng;
use crate::tensor::Tensor;
use crate::trace::stats::TensorStats;
use std::sync::{Arc, Mutex};

/// The outcome of one parity check.
#[derive(Debug, Clone)]
pub struct Check {
    /// Op and variant (`unary gelu forward`).
    pub name: String,
    /// The dtype checked.
    pub dtype: DType,
    /// Elements compared.
    pub n: usize,
    /// Elements outside the bound.
    pub failures: usize,
    /// Largest ulp distance seen (output dtype).
    pub max_ulp: u64,
    /// The first failure, described.
    pub first: Option<String>,
}

impl Check {
    /// True when every element is within the bound.
    pub fn ok(&self) -> bool {
        self.failures == 0
    }
}

/// Position of a value on the dtype's ordered grid (ulp distance = difference).
fn ordinal(dtype: DType, x: f32) -> i64 {
    let (bits, mag) = match dtype {
        DType::F16 => (i64::from(half::f16::from_f32(x).to_bits()), 0x7fff),
        DType::BF16 => (i64::from(x.to_bits() >> 16), 0x7fff),
        _ => (i64::from(x.to_bits()), 0x7fff_ffff),
    };
    let sign = match dtype {
        DType::F16 | DType::BF16 => 0x8000,
        _ => 0x8000_0000,
    };
    if bits & sign != 0 {
        -(bits & mag)
    } else {
        bits & mag
    }
}

/// Ulp distance in `dtype` (NaN equals NaN; NaN against a number is infinitely far).
pub fn ulp_distance(dtype: DType, a: f32, b: f32) -> u64 {
    match (a.is_nan(), b.is_nan()) {
        (true, true) => 0,
        (false, false) => ordinal(dtype, a).abs_diff(ordinal(dtype, b)),
        _ => u64::MAX,
    }
}

/// Random values of `dtype`: normal draws over a wide binade range, with zeros, signed
/// infinities, NaN and the dtype's subnormals mixed in.
pub fn random_tensor(rng: &mut Rng, shape: &[usize], dtype: DType, spread: i32) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let tiny = match dtype {
        DType::F16 => 2f32.powi(-20),
        _ => 2f32.powi(-130),
    };
    let v: Vec<f32> = (0..n)
        .map(|_| match rng.below(64) {
            0 => 0.0,
            1 => f32::INFINITY,
            2 => f32::NEG_INFINITY,
            3 => f32::NAN,
            4 => tiny * (1.0 + rng.below(8) as f32),
            _ => {
                let e = rng.below((2 * spread + 1) as u64) as i32 - spread;
                (rng.normal() as f32) * 2f32.powi(e)
            }
        })
        .collect();
    Tensor::from_f32(v, shape, dtype)
}

/// Random finite values (no specials), for GEMM and gradients.
fn finite_tensor(rng: &mut Rng, shape: &[usize], dtype: DType) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|_| rng.normal() as f32).collect();
    Tensor::from_f32(v, shape, dtype)
}

fn compare(
    name: &str,
    dtype: DType,
    dev: &[f32],
    cpu: &[f32],
    ok: impl Fn(usize, u64) -> bool,
) -> Check {
    let mut c = Check {
        name: name.into(),
        dtype,
        n: cpu.len(),
        failures: 0,
        max_ulp: 0,
        first: None,
    };
    if dev.len() != cpu.len() {
        c.failures = cpu.len().max(1);
        c.first = Some(format!("lengths differ: {} vs {}", dev.len(), cpu.len()));
        return c;
    }
    for i in 0..cpu.len() {
        let u = ulp_distance(dtype, dev[i], cpu[i]);
        if u != u64::MAX {
            c.max_ulp = c.max_ulp.max(u);
        }
        if !ok(i, u) {
            c.failures += 1;
            if c.first.is_none() {
                c.first = Some(format!(
                    "element {i}: device {:e}, cpu {:e} ({u} ulp)",
                    dev[i], cpu[i]
                ));
            }
        }
    }
    c
}

fn transcendental(op: Unary) -> bool {
    matches!(
        op,
        Unary::GeluErf
            | Unary::GeluTanh
            | Unary::Silu
            | Unary::Tanh
            | Unary::Sigmoid
            | Unary::Exp
            | Unary::Log
            | Unary::Pow(_)
    )
}

/// The unary ops checked, with the spread of input binades that suits each.
const UNARY: &[(Unary, i32)] = &[
    (Unary::Neg, 20),
    (Unary::Relu, 20),
    (Unary::GeluErf, 3),
    (Unary::GeluTanh, 3),
    (Unary::Silu, 4),
    (Unary::Tanh, 4),
    (Unary::Sigmoid, 4),
    (Unary::Exp, 3),
    (Unary::Log, 20),
    (Unary::Sqrt, 20),
    (Unary::Rsqrt, 20),
    (Unary::Pow(2.0), 10),
    (Unary::Pow(3.0), 6),
    (Unary::Clamp(Some(-1.5), Some(2.0)), 4),
    (Unary::MulScalar(0.125), 20),
    (Unary::AddScalar(1.0), 20),
];

/// Runs every check on `dev` with inputs drawn from `seed`; `n` elements per tensor.
pub fn run_all(dev: &Arc<CudaDevice>, seed: u64, n: usize) -> Result<Vec<Check>> {
    let mut out = Vec::new();
    let mut rng = Rng::new(seed);
    let dtypes = [DType::F32, DType::F16, DType::BF16];
    let mut arena = StatsArena::new(dev, 64)?;
    for &dt in &dtypes {
        cast_check(&mut out, dev, &mut rng, dt, &mut arena, n)?;
        unary_checks(&mut out, dev, &mut rng, dt, n)?;
        binary_checks(&mut out, dev, &mut rng, dt, n)?;
        gemm_checks(&mut out, dev, &mut rng, dt)?;
        family_checks(&mut out, dev, &mut rng, dt)?;
        stats_checks(&mut out, dev, &mut rng, dt, &mut arena)?;
    }
    Ok(out)
}

/// A cast from f32 into `dt`, with its rounding counts.
fn cast_check(
    out: &mut Vec<Check>,
    dev: &Arc<CudaDevice>,
    rng: &mut Rng,
    dt: DType,
    arena: &mut StatsArena,
    n: usize,
) -> Result<()> {
    let x = random_tensor(rng, &[n], DType::F32, 40)?;
    let xd = x.to_device(dev)?;
    arena.reset(dev)?;
    let slot = arena.slot(dev)?;
    let yd = cast_dev::cast(&xd, dt, Out::new(slot, arena.round_counts_ptr(dev, slot)))?;
    let y = yd.to_host()?;
    let cpu = crate::ops::cast::cast(&x, dt)?;
    let mut c = compare(
        &format!("cast f32 -> {dt}"),
        dt,
        y.f32s()?,
        cpu.tensor.f32s()?,
        |_, u| u == 0,
    );
    let counts = arena.read(dev)?[0].rounding;
    if counts != cpu.rounding {
        c.failures += 1;
        c.first = Some(format!(
            "rounding counts: device {counts:?}, cpu {:?}",
            cpu.rounding
        ));
    }
    out.push(c);
    Ok(())
}

/// The unary ops, forward and gradient.
fn unary_checks(
    out: &mut Vec<Check>,
    dev: &Arc<CudaDevice>,
    rng: &mut Rng,
    dt: DType,
    n: usize,
) -> Result<()> {
    for &(op, spread) in UNARY {
        let x = random_tensor(rng, &[n], dt, spread)?;
        let g = finite_tensor(rng, &[n], dt)?;
        let xd = x.to_device(dev)?;
        let gd = g.to_device(dev)?;
        let yd = ew_dev::unary(op, &xd, None, Out::NONE)?;
        let dxd = ew_dev::unary_backward(op, (&xd, &yd, &gd), None, Out::NONE)?;
        let mut eng = Engine::new();
        let xl = x.as_leaf(true);
        let y = eng.unary(op, &xl)?;
        let grads = eng.backward_with(&y, g.clone())?;
        let xs = x.f32s()?.to_vec();
        let dev_y = yd.to_host()?;
        let name = format!("unary {op:?} forward");
        let (dy, cy) = (dev_y.f32s()?, y.f32s()?);
        let bound = |u: u64, d: f32, c: f32, x: f32| {
            if transcendental(op) {
                u <= 2 || within_abs(d, c, x)
            } else {
                u == 0
            }
        };
        out.push(compare(&name, dt, dy, cy, |i, u| {
            bound(u, dy[i], cy[i], xs[i])
        }));
        if let Some(cpu_dx) = grads.get(&xl.id()) {
            let dev_dx = dxd.to_host()?;
            let (dd, cd) = (dev_dx.f32s()?, cpu_dx.f32s()?);
            out.push(compare(
                &format!("unary {op:?} backward"),
                dt,
                dd,
                cd,
                |i, u| bound(u, dd[i], cd[i], xs[i]),
            ));
        }
    }
    Ok(())
}

/// The broadcast binary ops, forward and gradients.
fn binary_checks(
    out: &mut Vec<Check>,
    dev: &Arc<CudaDevice>,
    rng: &mut Rng,
    dt: DType,
    n: usize,
) -> Result<()> {
    for op in [Binary::Add, Binary::Sub, Binary::Mul, Binary::Div] {
        for (sa, sb) in [
            (vec![n], vec![n]),
            (vec![4, n / 4], vec![n / 4]),
            (vec![4, 3, 5], vec![4, 1, 1]),
            (vec![2, 3, 1, 5], vec![3, 7, 1]),
            // Sums of 32 terms and more, a warp per element: over rows, over a middle
            // dim, over two dims.
            (vec![40, 6], vec![6]),
            (vec![2, 50, 3], vec![2, 1, 3]),
            (vec![3, 37, 2], vec![1, 37, 1]),
            (vec![33, 2, 5], vec![5]),
        ] {
            let a = random_tensor(rng, &sa, dt, 8)?;
            let b = random_tensor(rng, &sb, dt, 8)?;
            let mut eng = Engine::new();
            let (al, bl) = (a.as_leaf(true), b.as_leaf(true));
            let y = eng.binary(op, &al, &bl)?;
            let g = finite_tensor(rng, y.shape(), dt)?;
            let grads = eng.backward_with(&y, g.clone())?;
            let (ad, bd, gd) = (a.to_device(dev)?, b.to_device(dev)?, g.to_device(dev)?);
            let yd = ew_dev::binary(op, &ad, &bd, Out::NONE)?.to_host()?;
            let tag = format!("{op:?} {sa:?}x{sb:?}");
            out.push(compare(
                &format!("binary {tag} forward"),
                dt,
                yd.f32s()?,
                y.f32s()?,
                |_, u| u == 0,
            ));
            for (wrt_b, leaf) in [(false, &al), (true, &bl)] {
                let Some(cpu_g) = grads.get(&leaf.id()) else {
                    continue;
                };
                let dg = ew_dev::binary_grad(op, &ad, &bd, &gd, wrt_b, Out::NONE)?.to_host()?;
                out.push(compare(
                    &format!("binary {tag} grad {}", if wrt_b { "b" } else { "a" }),
                    dt,
                    dg.f32s()?,
                    cpu_g.f32s()?,
                    |_, u| u == 0,
                ));
            }
        }
    }
    Ok(())
}

/// GEMM: plain, transposed operands, batched, against the exact product.
fn gemm_checks(
    out: &mut Vec<Check>,
    dev: &Arc<CudaDevice>,
    rng: &mut Rng,
    dt: DType,
) -> Result<()> {
    for (sa, sb, ta, tb) in [
        (vec![33, 70], vec![70, 17], false, false),
        (vec![70, 33], vec![70, 17], true, false),
        (vec![33, 70], vec![17, 70], false, true),
        (vec![3, 9, 40], vec![3, 40, 11], false, false),
        (vec![3, 9, 40], vec![40, 11], false, false),
    ] {
        let a = finite_tensor(rng, &sa, dt)?;
        let b = finite_tensor(rng, &sb, dt)?;
        let cpu = host_matmul(&a, &b, ta, tb)?;
        let (ad, bd) = (a.to_device(dev)?, b.to_device(dev)?);
        let yd = mm_dev::matmul(&ad, &bd, ta, tb, Out::NONE)?.to_host()?;
        let k = if ta {
            sa[sa.len() - 2]
        } else {
            sa[sa.len() - 1]
        };
        let u = 2f64.powi(-24);
        let gamma = k as f64 * u / (1.0 - k as f64 * u);
        let dy = yd.f32s()?;
        let check = compare(
            &format!(
                "matmul {sa:?}{}x{sb:?}{}",
                if ta { "ᵀ" } else { "" },
                if tb { "ᵀ" } else { "" }
            ),
            dt,
            dy,
            &cpu.0,
            |i, ul| {
                let diff = (f64::from(dy[i]) - f64::from(cpu.0[i])).abs();
                ul <= 1 || diff <= gamma * cpu.1[i] + ulp_of(dt, cpu.0[i])
            },
        );
        out.push(check);
    }
    Ok(())
}

/// Probe statistics, small (batched launch) and large (own launch).
fn stats_checks(
    out: &mut Vec<Check>,
    dev: &Arc<CudaDevice>,
    rng: &mut Rng,
    dt: DType,
    arena: &mut StatsArena,
) -> Result<()> {
    for len in [1000usize, 3 * arena::SMALL + 7] {
        let x = random_tensor(rng, &[len], dt, 60)?;
        let xd = x.to_device(dev)?;
        arena.reset(dev)?;
        let slot = arena.slot(dev)?;
        arena.probe(dev, &xd.cuda("probe")?.buf, dt, slot)?;
        let got = arena.read(dev)?.remove(0).stats;
        let want = TensorStats::compute(dt, x.f32s()?);
        out.push(stats_check(
            &format!("probe stats n={len}"),
            dt,
            &got,
            &want,
        ));
    }
    Ok(())
}

/// How closely an engine-level device result must follow the CPU's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Bound {
    /// Identical values (NaN equals NaN, +0 equals -0).
    Exact,
    /// Bit-identical, signed zeros included (NaN equals NaN).
    Bitwise,
    /// Within 4 ulp of the output dtype, or |Δ| ≤ 2⁻¹⁸·max(1, |cpu|) (an exp/log inside).
    Transcendental,
}

impl Bound {
    fn ok(self, u: u64, d: f32, c: f32) -> bool {
        match self {
            Bound::Exact => u == 0,
            // The ulp distance of ±0 is 0: compare the bits.
            Bound::Bitwise => u == 0 && (d.is_nan() || d.to_bits() == c.to_bits()),
            Bound::Transcendental => {
                u <= 4 || {
                    let lim = 2f64.powi(-18) * f64::from(c.abs()).max(1.0);
                    (f64::from(d) - f64::from(c)).abs() <= lim
                }
            }
        }
    }
}

/// The rounding counts and masked -inf counts of every op an engine records, in order,
/// with their arena slots.
type Rounds = Arc<Mutex<Vec<(String, RoundCounts, u64, Option<u32>)>>>;

struct RoundsSeen(Rounds);

impl Observer for RoundsSeen {
    fn on_op(&mut self, ev: &OpEvent<'_>) {
        if let Ok(mut v) = self.0.lock() {
            v.push((ev.op.to_string(), ev.rounding, ev.masked_neg_inf, ev.slot));
        }
    }
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
}

/// One engine run: the output, the gradient of each input (None where not asked or not
/// reached), and each recorded op's rounding counts and masked -inf count, all on the
/// host.
struct EngineRun {
    y: Tensor,
    grads: Vec<Option<Tensor>>,
    rounds: Vec<(String, RoundCounts, u64)>,
}

/// An engine forward + backward of `f` over `inputs` (leaves requiring a gradient where
/// `want` says), on the host or on `dev`, with output gradient `g`.
fn engine_run(
    dev: Option<&Arc<CudaDevice>>,
    inputs: &[Tensor],
    want: &[bool],
    g: Option<&Tensor>,
    f: &dyn Fn(&mut Engine, &[Tensor]) -> Result<Tensor>,
) -> Result<EngineRun> {
    let put = |t: &Tensor| match dev {
        Some(d) => t.to_device(d),
        None => Ok(t.clone()),
    };
    if let Some(d) = dev {
        d.with_arena(|a| a.reset(d))?;
    }
    let leaves = inputs
        .iter()
        .zip(want)
        .map(|(t, &w)| Ok(put(t)?.as_leaf(w)))
        .collect::<Result<Vec<_>>>()?;
    let seen: Rounds = Arc::default();
    let mut eng = Engine::new();
    eng.set_seed(11);
    eng.begin_step(3);
    eng.add_observer(Box::new(RoundsSeen(seen.clone())));
    let y = f(&mut eng, &leaves)?;
    let grads = match g {
        Some(g) => {
            let gm = eng.backward_with(&y, put(g)?)?;
            leaves
                .iter()
                .map(|l| gm.get(&l.id()).map(Tensor::to_host).transpose())
                .collect::<Result<Vec<_>>>()?
        }
        None => vec![None; leaves.len()],
    };
    let y = y.to_host()?;
    let slots = match dev {
        Some(d) => d.with_arena(|a| a.read(d))?,
        None => Vec::new(),
    };
    let list = seen.lock().map(|v| v.clone()).unwrap_or_default();
    let rounds = list
        .into_iter()
        .map(
            |(op, r, masked, slot)| match slot.and_then(|s| slots.get(s as usize)) {
                // A device mask's -inf count arrives with the slot, a host mask's with the op.
                Some(x) => (op, x.rounding, masked + x.masked_neg_inf),
                None => (op, r, masked),
            },
        )
        .collect();
    Ok(EngineRun { y, grads, rounds })
}

fn values(t: &Tensor) -> Result<Vec<f32>> {
    Ok(match t.dtype() {
        DType::I64 => t.i64s()?.iter().map(|&v| v as f32).collect(),
        _ => t.f32s()?.to_vec(),
    })
}

/// Runs `f` on the host and on `dev` and compares the outputs, the gradients and the
/// rounding counts of every op (forward and backward), pushing one check for each.
#[allow(clippy::too_many_arguments)]
fn engine_parity(
    out: &mut Vec<Check>,
    dev: &Arc<CudaDevice>,
    name: &str,
    dt: DType,
    inputs: &[Tensor],
    want: &[bool],
    g: Option<&Tensor>,
    bound: Bound,
    f: &dyn Fn(&mut Engine, &[Tensor]) -> Result<Tensor>,
) -> Result<()> {
    let cpu = engine_run(None, inputs, want, g, f)?;
    let gpu = engine_run(Some(dev), inputs, want, g, f)?;
    let (dy, cy) = (values(&gpu.y)?, values(&cpu.y)?);
    let mut c = compare(&format!("{name} forward"), dt, &dy, &cy, |i, u| {
        bound.ok(u, dy[i], cy[i])
    });
    if gpu.y.shape() != cpu.y.shape() || gpu.y.dtype() != cpu.y.dtype() {
        c.failures += 1;
        c.first = Some(format!(
            "output {:?} {} on the device, {:?} {} on the cpu",
            gpu.y.shape(),
            gpu.y.dtype(),
            cpu.y.shape(),
            cpu.y.dtype()
        ));
    }
    out.push(c);
    for (k, (dg, cg)) in gpu.grads.iter().zip(&cpu.grads).enumerate() {
        let label = format!("{name} grad {k}");
        match (dg, cg) {
            (Some(dg), Some(cg)) => {
                let (dv, cv) = (values(dg)?, values(cg)?);
                out.push(compare(&label, dt, &dv, &cv, |i, u| {
                    bound.ok(u, dv[i], cv[i])
                }));
            }
            (None, None) => {}
            _ => out.push(Check {
                name: label,
                dtype: dt,
                n: 0,
                failures: 1,
                max_ulp: 0,
                first: Some("a gradient exists on one side only".into()),
            }),
        }
    }
    let mut c = Check {
        name: format!("{name} rounding counts"),
        dtype: dt,
        n: cpu.rounds.len(),
        failures: 0,
        max_ulp: 0,
        first: None,
    };
    if gpu.rounds != cpu.rounds {
        c.failures = 1;
        c.first = Some(format!("device {:?}\ncpu {:?}", gpu.rounds, cpu.rounds));
    }
    out.push(c);
    Ok(())
}

/// The engine-level checks of the families with device kernels beyond the elementwise
/// ones: shape, reduce, select, loss, nn and gradient accumulation.
fn family_checks(
    out: &mut Vec<Check>,
    dev: &Arc<CudaDevice>,
    rng: &mut Rng,
    dt: DType,
) -> Result<()> {
    let x = random_tensor(rng, &[3, 4, 5], dt, 8)?;
    shape_checks(out, dev, rng, dt, &x)?;
    accumulation_check(out, dev, rng, dt, &x)?;
    reduction_checks(out, dev, rng, dt, &x)?;
    nn_checks(out, dev, rng, dt)?;
    rms_norm_check(out, dev, rng, dt)?;
    loss_checks(out, dev, rng, dt)?;
    select_checks(out, dev, rng, dt)
}

/// Shape ops: permute, transpose, slice, cat, and unsqueeze-squeeze-reshape.
fn shape_checks(
    out: &mut Vec<Check>,
    dev: &Arc<CudaDevice>,
    rng: &mut Rng,
    dt: DType,
    x: &Tensor,
) -> Result<()> {
    use Bound::Exact;
    let g = |rng: &mut Rng, s: &[usize]| finite_tensor(rng, s, dt);
    let one = [true];
    let x = x.clone();
    // Shape ops.
    let gy = g(rng, &[5, 3, 4])?;
    engine_parity(
        out,
        dev,
        "permute [3,4,5]->[5,3,4]",
        dt,
        std::slice::from_ref(&x),
        &one,
        Some(&gy),
        Exact,
        &|e, t| e.permute(&t[0], &[2, 0, 1]),
    )?;
    let gy = g(rng, &[3, 5, 4])?;
    engine_parity(
        out,
        dev,
        "transpose 1 2",
        dt,
        std::slice::from_ref(&x),
        &one,
        Some(&gy),
        Exact,
        &|e, t| e.transpose(&t[0], 1, 2),
    )?;
    let gy = g(rng, &[3, 2, 5])?;
    engine_parity(
        out,
        dev,
        "slice dim 1 1..3",
        dt,
        std::slice::from_ref(&x),
        &one,
        Some(&gy),
        Exact,
        &|e, t| e.slice(&t[0], 1, 1, 3),
    )?;
    let gy = g(rng, &[3, 4, 10])?;
    let x2 = random_tensor(rng, &[3, 4, 5], dt, 8)?;
    engine_parity(
        out,
        dev,
        "cat dim -1",
        dt,
        &[x.clone(), x2.clone()],
        &[true, true],
        Some(&gy),
        Exact,
        &|e, t| e.cat(&[&t[0], &t[1]], -1),
    )?;
    let gy = g(rng, &[12, 5])?;
    engine_parity(
        out,
        dev,
        "reshape + unsqueeze + squeeze",
        dt,
        std::slice::from_ref(&x),
        &one,
        Some(&gy),
        Exact,
        &|e, t| {
            let u = e.unsqueeze(&t[0], 0)?;
            let s = e.squeeze(&u, 0)?;
            e.reshape(&s, &[12, 5])
        },
    )?;
    Ok(())
}

/// Gradient accumulation: one leaf used twice.
fn accumulation_check(
    out: &mut Vec<Check>,
    dev: &Arc<CudaDevice>,
    rng: &mut Rng,
    dt: DType,
    x: &Tensor,
) -> Result<()> {
    use Bound::Exact;
    let g = |rng: &mut Rng, s: &[usize]| finite_tensor(rng, s, dt);
    let one = [true];
    let x = x.clone();
    // Gradient accumulation: x used twice.
    let gy = g(rng, &[3, 4, 5])?;
    engine_parity(
        out,
        dev,
        "accumulate_grad (x·x via two uses)",
        dt,
        std::slice::from_ref(&x),
        &one,
        Some(&gy),
        Exact,
        &|e, t| e.mul(&t[0], &t[0]),
    )?;
    Ok(())
}

/// Reductions: sums, means and max, short lines and lines longer than a warp.
fn reduction_checks(
    out: &mut Vec<Check>,
    dev: &Arc<CudaDevice>,
    rng: &mut Rng,
    dt: DType,
    x: &Tensor,
) -> Result<()> {
    use Bound::{Exact, Transcendental};
    let g = |rng: &mut Rng, s: &[usize]| finite_tensor(rng, s, dt);
    let one = [true];
    let x = x.clone();
    // Reductions; the last two sum 40 and 80 terms (a warp per output on the device).
    for (shape, dims, keep) in [
        ([3, 4, 5], vec![], false),
        ([3, 4, 5], vec![1], true),
        ([3, 4, 5], vec![0, 2], false),
        ([3, 4, 5], vec![2], false),
        ([3, 4, 5], vec![0], true),
        ([2, 40, 3], vec![1], false),
        ([2, 40, 3], vec![0, 1], true),
    ] {
        let xs = random_tensor(rng, &shape, dt, 6)?;
        let mut e = Engine::new();
        let y_shape = e.sum(&xs, &dims, keep)?.shape().to_vec();
        let gy = g(rng, &y_shape)?;
        let d2 = dims.clone();
        engine_parity(
            out,
            dev,
            &format!("sum {dims:?} of {shape:?} keepdim {keep}"),
            dt,
            std::slice::from_ref(&xs),
            &one,
            Some(&gy),
            Exact,
            &move |e, t| e.sum(&t[0], &d2, keep),
        )?;
        let d2 = dims.clone();
        engine_parity(
            out,
            dev,
            &format!("mean {dims:?} of {shape:?} keepdim {keep}"),
            dt,
            &[xs],
            &one,
            Some(&gy),
            Exact,
            &move |e, t| e.mean(&t[0], &d2, keep),
        )?;
    }
    for (dim, keep, shape) in [(1isize, false, vec![3, 5]), (-1, true, vec![3, 4, 1])] {
        let gy = g(rng, &shape)?;
        engine_parity(
            out,
            dev,
            &format!("max dim {dim} keepdim {keep}"),
            dt,
            std::slice::from_ref(&x),
            &one,
            Some(&gy),
            Exact,
            &move |e, t| e.max(&t[0], dim, keep),
        )?;
    }
    // Short lines, and lines longer than a warp (70 = 2 × 32 + 6), along the last dim and
    // along a middle one; then enough lines for the grouped kernels (GROUPED_MIN_LINES: a
    // warp per 32 lines), the last group partly filled, the lines shorter and longer than
    // a warp.
    for (dim, shape) in [
        (-1isize, [3, 4, 5]),
        (1, [3, 4, 5]),
        (-1, [2, 3, 70]),
        (1, [2, 70, 3]),
        (-1, [2, 4103, 7]),
        (1, [3, 37, 2737]),
    ] {
        let xs = random_tensor(rng, &shape, dt, 3)?;
        let gy = g(rng, &shape)?;
        engine_parity(
            out,
            dev,
            &format!("softmax dim {dim} of {shape:?}"),
            dt,
            std::slice::from_ref(&xs),
            &one,
            Some(&gy),
            Transcendental,
            &move |e, t| e.softmax(&t[0], dim),
        )?;
        engine_parity(
            out,
            dev,
            &format!("log_softmax dim {dim} of {shape:?}"),
            dt,
            &[xs],
            &one,
            Some(&gy),
            Transcendental,
            &move |e, t| e.log_softmax(&t[0], dim),
        )?;
    }
    Ok(())
}

/// nn: layer norm (with and without affine), embedding (device ids), dropout.
fn nn_checks(out: &mut Vec<Check>, dev: &Arc<CudaDevice>, rng: &mut Rng, dt: DType) -> Result<()> {
    layer_norm_checks(out, dev, rng, dt)?;
    embedding_checks(out, dev, rng, dt)?;
    dropout_checks(out, dev, rng, dt)
}

/// Layer norm with and without affine.
fn layer_norm_checks(
    out: &mut Vec<Check>,
    dev: &Arc<CudaDevice>,
    rng: &mut Rng,
    dt: DType,
) -> Result<()> {
    use Bound::Exact;
    let xs = random_tensor(rng, &[6, 16], dt, 4)?;
    let (w, b) = (
        finite_tensor(rng, &[16], dt)?,
        finite_tensor(rng, &[16], dt)?,
    );
    let gy = finite_tensor(rng, &[6, 16], dt)?;
    engine_parity(
        out,
        dev,
        "layer_norm affine",
        dt,
        &[xs.clone(), w, b],
        &[true, true, true],
        Some(&gy),
        Exact,
        &|e, t| e.layer_norm(&t[0], 16, Some(&t[1]), Some(&t[2]), 1e-5),
    )?;
    engine_parity(
        out,
        dev,
        "layer_norm plain",
        dt,
        &[xs],
        &[true],
        Some(&gy),
        Exact,
        &|e, t| e.layer_norm(&t[0], 16, None, None, 1e-5),
    )
}

/// Embedding with device ids: few positions, many, a frequent id, padding ids.
fn embedding_checks(
    out: &mut Vec<Check>,
    dev: &Arc<CudaDevice>,
    rng: &mut Rng,
    dt: DType,
) -> Result<()> {
    use Bound::Exact;
    let g = |rng: &mut Rng, s: &[usize]| finite_tensor(rng, s, dt);
    let w = random_tensor(rng, &[7, 5], dt, 6)?;
    let ids = Tensor::from_i64(vec![3, 0, 6, 3, 3, 1, 6, 2], &[2, 4])?;
    let gy = g(rng, &[2, 4, 5])?;
    engine_parity(
        out,
        dev,
        "embedding",
        dt,
        &[w, ids],
        &[true, false],
        Some(&gy),
        Exact,
        &|e, t| e.embedding(&t[0], &t[1]),
    )?;
    // Many positions (three chunks of the device's sort by id), a frequent id, rows no
    // position uses.
    let w = random_tensor(rng, &[50, 3], dt, 6)?;
    let ids: Vec<i64> = (0..600)
        .map(|_| {
            let r = rng.below(60) as i64;
            if r >= 40 {
                3
            } else {
                r
            }
        })
        .collect();
    let ids = Tensor::from_i64(ids, &[20, 30])?;
    let gy = g(rng, &[20, 30, 3])?;
    engine_parity(
        out,
        dev,
        "embedding, 600 positions",
        dt,
        &[w.clone(), ids.clone()],
        &[true, false],
        Some(&gy),
        Exact,
        &|e, t| e.embedding(&t[0], &t[1]),
    )?;
    // PyTorch's padding_idx: the frequent id's row gets no gradient.
    engine_parity(
        out,
        dev,
        "embedding, 600 positions, padding id 3",
        dt,
        &[w, ids],
        &[true, false],
        Some(&gy),
        Exact,
        &|e, t| e.embedding_padded(&t[0], &t[1], Some(3)),
    )?;
    // Four ids over 600 positions (as relative-position buckets repeat): a warp per
    // (id, column) on the device.
    let w = random_tensor(rng, &[4, 3], dt, 6)?;
    let ids: Vec<i64> = (0..600).map(|_| rng.below(4) as i64).collect();
    let ids = Tensor::from_i64(ids, &[20, 30])?;
    let gy = g(rng, &[20, 30, 3])?;
    engine_parity(
        out,
        dev,
        "embedding, 600 positions of 4 ids",
        dt,
        &[w.clone(), ids.clone()],
        &[true, false],
        Some(&gy),
        Exact,
        &|e, t| e.embedding(&t[0], &t[1]),
    )?;
    engine_parity(
        out,
        dev,
        "embedding, 600 positions of 4 ids, padding id 0",
        dt,
        &[w, ids],
        &[true, false],
        Some(&gy),
        Exact,
        &|e, t| e.embedding_padded(&t[0], &t[1], Some(0)),
    )
}

/// Dropout at three probabilities (the CPU's mask).
fn dropout_checks(
    out: &mut Vec<Check>,
    dev: &Arc<CudaDevice>,
    rng: &mut Rng,
    dt: DType,
) -> Result<()> {
    let xs = random_tensor(rng, &[8, 33], dt, 10)?;
    let gy = finite_tensor(rng, &[8, 33], dt)?;
    for p in [0.1, 0.5, 1.0] {
        engine_parity(
            out,
            dev,
            &format!("dropout p={p}"),
            dt,
            std::slice::from_ref(&xs),
            &[true],
            Some(&gy),
            Bound::Exact,
            &move |e, t| e.scope("enc.block.0", |e| e.dropout(&t[0], p, true, 2)),
        )?;
    }
    Ok(())
}

/// RMSNorm as T5 builds it: pow, mean, add_scalar, rsqrt, mul.
fn rms_norm_check(
    out: &mut Vec<Check>,
    dev: &Arc<CudaDevice>,
    rng: &mut Rng,
    dt: DType,
) -> Result<()> {
    use Bound::Exact;
    let g = |rng: &mut Rng, s: &[usize]| finite_tensor(rng, s, dt);
    // RMSNorm as T5 builds it: pow, mean, add_scalar, rsqrt, mul.
    let xs = finite_tensor(rng, &[4, 8], dt)?;
    let w = finite_tensor(rng, &[8], dt)?;
    let gy = g(rng, &[4, 8])?;
    engine_parity(
        out,
        dev,
        "rms_norm (pow mean add rsqrt mul)",
        dt,
        &[xs, w],
        &[true, true],
        Some(&gy),
        Exact,
        &|e, t| {
            let v = e.pow(&t[0], 2.0)?;
            let m = e.mean(&v, &[-1], true)?;
            let a = e.add_scalar(&m, 1e-6)?;
            let r = e.rsqrt(&a)?;
            let h = e.mul(&t[0], &r)?;
            e.mul(&t[1], &h)
        },
    )?;
    Ok(())
}

/// Finite values of `dtype`: normal draws scaled by 2^e for e in -spread..=spread.
fn spread_tensor(rng: &mut Rng, shape: &[usize], dtype: DType, spread: i32) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|_| {
            let e = rng.below((2 * spread + 1) as u64) as i32 - spread;
            (rng.normal() as f32) * 2f32.powi(e)
        })
        .collect();
    Tensor::from_f32(v, shape, dtype)
}

/// Cross-entropy (fused, and the decomposition CUDA autocast takes), NLL with ignored
/// rows and mean squared error, with device labels and with host labels.
fn loss_checks(
    out: &mut Vec<Check>,
    dev: &Arc<CudaDevice>,
    rng: &mut Rng,
    dt: DType,
) -> Result<()> {
    let x = spread_tensor(rng, &[2, 3, 5], dt, 3)?;
    let labels = Tensor::from_i64(vec![4, -100, 0, 2, 2, -100], &[2, 3])?;
    let g = finite_tensor(rng, &[], dt)?;
    let g32 = finite_tensor(rng, &[], DType::F32)?;
    cross_entropy_checks(out, dev, dt, &[x, labels], &g, &g32)?;
    nll_checks(out, dev, rng, dt, &g)?;
    empty_and_mse_checks(out, dev, rng, dt, &g)
}

/// The `ignore_index` every loss check uses.
const IGNORE: Option<i64> = Some(-100);

/// Cross-entropy of logits and labels `xl`: fused (device labels, host labels) and under
/// either device's autocast; `g` the loss gradient, `g32` an fp32 one.
fn cross_entropy_checks(
    out: &mut Vec<Check>,
    dev: &Arc<CudaDevice>,
    dt: DType,
    xl: &[Tensor; 2],
    g: &Tensor,
    g32: &Tensor,
) -> Result<()> {
    use crate::amp::policy::{DeviceType, PolicyTable};
    use crate::engine::Autocast;
    use Bound::Transcendental;
    let [x, labels] = xl;
    let want = [true, false];
    engine_parity(
        out,
        dev,
        "cross_entropy fused, ignore_index",
        dt,
        xl,
        &want,
        Some(g),
        Transcendental,
        &|e, t| e.cross_entropy(&t[0], &t[1], IGNORE),
    )?;
    let host_labels = labels.clone();
    engine_parity(
        out,
        dev,
        "cross_entropy fused, host labels",
        dt,
        std::slice::from_ref(x),
        &[true],
        Some(g),
        Transcendental,
        &move |e, t| e.cross_entropy(&t[0], &host_labels, IGNORE),
    )?;
    let low = if dt == DType::F32 { DType::F16 } else { dt };
    for (device, g) in [(DeviceType::Cuda, g32), (DeviceType::Cpu, g32)] {
        engine_parity(
            out,
            dev,
            &format!("cross_entropy under {device:?} autocast ({low})"),
            dt,
            xl,
            &want,
            Some(g),
            Transcendental,
            &move |e, t| {
                e.set_autocast(Some(Autocast {
                    dtype: low,
                    table: PolicyTable::for_device(device),
                }));
                e.cross_entropy(&t[0], &t[1], IGNORE)
            },
        )?;
    }
    Ok(())
}

/// NLL: ignored rows, rows in several device chunks, one row at +0, every row ignored.
fn nll_checks(
    out: &mut Vec<Check>,
    dev: &Arc<CudaDevice>,
    rng: &mut Rng,
    dt: DType,
    g: &Tensor,
) -> Result<()> {
    use Bound::Bitwise;
    let want = [true, false];
    let lp = spread_tensor(rng, &[6, 5], dt, 4)?;
    let rows = Tensor::from_i64(vec![3, -100, 0, 4, -100, 1], &[6])?;
    engine_parity(
        out,
        dev,
        "nll_loss, ignore_index rows",
        dt,
        &[lp.clone(), rows],
        &want,
        Some(g),
        Bitwise,
        &|e, t| e.nll_loss(&t[0], &t[1], IGNORE),
    )?;
    // 70 rows (three warp-sized chunks on the device), every third ignored.
    let many = spread_tensor(rng, &[70, 5], dt, 4)?;
    let labels: Vec<i64> = (0..70)
        .map(|r| if r % 3 == 1 { -100 } else { r % 5 })
        .collect();
    engine_parity(
        out,
        dev,
        "nll_loss, 70 rows, every third ignored",
        dt,
        &[many, Tensor::from_i64(labels, &[70])?],
        &want,
        Some(g),
        Bitwise,
        &|e, t| e.nll_loss(&t[0], &t[1], IGNORE),
    )?;
    // One row counts, its log-probability +0: the CPU's sum from -0.0 gives -0.0.
    let zero = Tensor::from_f32(vec![0.0, 1.0], &[1, 2], dt)?;
    engine_parity(
        out,
        dev,
        "nll_loss, one row at +0",
        dt,
        &[zero, Tensor::from_i64(vec![0], &[1])?],
        &want,
        Some(g),
        Bitwise,
        &|e, t| e.nll_loss(&t[0], &t[1], IGNORE),
    )?;
    let all_ignored = Tensor::from_i64(vec![-100; 6], &[6])?;
    engine_parity(
        out,
        dev,
        "nll_loss, every row ignored (NaN)",
        dt,
        &[lp, all_ignored],
        &want,
        Some(g),
        Bitwise,
        &|e, t| e.nll_loss(&t[0], &t[1], IGNORE),
    )
}

/// Cross-entropy of no rows, and mean squared error.
fn empty_and_mse_checks(
    out: &mut Vec<Check>,
    dev: &Arc<CudaDevice>,
    rng: &mut Rng,
    dt: DType,
    g: &Tensor,
) -> Result<()> {
    use Bound::Bitwise;
    let want = [true, false];
    engine_parity(
        out,
        dev,
        "cross_entropy, no rows (NaN)",
        dt,
        &[
            Tensor::from_f32(vec![], &[0, 5], dt)?,
            Tensor::from_i64(vec![], &[0])?,
        ],
        &want,
        Some(g),
        Bitwise,
        &|e, t| e.cross_entropy(&t[0], &t[1], IGNORE),
    )?;
    // Spread 8: squares reach 2^16 and beyond, so fp16's mean can overflow.
    let a = spread_tensor(rng, &[4, 7], dt, 8)?;
    let b = spread_tensor(rng, &[4, 7], dt, 8)?;
    engine_parity(
        out,
        dev,
        "mse_loss",
        dt,
        &[a, b],
        &[true, true],
        Some(g),
        Bitwise,
        &|e, t| e.mse_loss(&t[0], &t[1]),
    )?;
    Ok(())
}

/// `where` (forward and both branches' gradients, broadcast conditions of each kind, int64
/// branches) and `masked_fill` (-inf, an underflowing fill, device and host masks).
fn select_checks(
    out: &mut Vec<Check>,
    dev: &Arc<CudaDevice>,
    rng: &mut Rng,
    dt: DType,
) -> Result<()> {
    use Bound::Bitwise;
    let a = random_tensor(rng, &[3, 5], dt, 8)?;
    let b = random_tensor(rng, &[1], dt, 8)?;
    let gy = finite_tensor(rng, &[2, 3, 5], dt)?;
    let conds = [
        (
            "int64 cond [2,1,5]",
            Tensor::from_i64(
                (0..10).map(|i| (i * 7 % 3 == 0) as i64).collect(),
                &[2, 1, 5],
            )?,
        ),
        ("float cond [2,3,5]", random_tensor(rng, &[2, 3, 5], dt, 2)?),
    ];
    for (what, c) in &conds {
        engine_parity(
            out,
            dev,
            &format!("where {what}, branches [3,5] and [1]"),
            dt,
            &[c.clone(), a.clone(), b.clone()],
            &[false, true, true],
            Some(&gy),
            Bitwise,
            &|e, t| e.where_(&t[0], &t[1], &t[2]),
        )?;
    }
    // Branches of the output's shape (no sum), and a condition left on the host.
    let af = random_tensor(rng, &[2, 3, 5], dt, 8)?;
    let bf = random_tensor(rng, &[3, 5], dt, 8)?;
    let host_cond = Tensor::from_f64(
        (0..6)
            .map(|i| if i % 2 == 0 { 1e-300 } else { 0.0 })
            .collect(),
        &[2, 3, 1],
    )?;
    engine_parity(
        out,
        dev,
        "where host f64 cond [2,3,1], branches [2,3,5] and [3,5]",
        dt,
        &[af, bf],
        &[true, true],
        Some(&gy),
        Bitwise,
        &move |e, t| e.where_(&host_cond, &t[0], &t[1]),
    )?;
    let (ia, ib) = (
        Tensor::from_i64(vec![5, 6, 7, 8, 9], &[5])?,
        Tensor::from_i64(vec![-100], &[1])?,
    );
    engine_parity(
        out,
        dev,
        "where int64 branches",
        dt,
        &[conds[0].1.clone(), ia, ib],
        &[false, false, false],
        None,
        Bitwise,
        &|e, t| e.where_(&t[0], &t[1], &t[2]),
    )?;
    // masked_fill: the -inf count (device mask: from the slot; host mask: on the host),
    // and a fill that underflows fp16 (each masked element counts).
    let x = random_tensor(rng, &[4, 6], dt, 8)?;
    let gx = finite_tensor(rng, &[4, 6], dt)?;
    let m6 = Tensor::from_i64(vec![0, 1, 1, 0, 0, 1], &[6])?;
    let m41 = random_tensor(rng, &[4, 1], dt, 2)?;
    for value in [f64::NEG_INFINITY, -1e-9, 3.0] {
        for (what, m) in [("int64 mask [6]", &m6), ("float mask [4,1]", &m41)] {
            engine_parity(
                out,
                dev,
                &format!("masked_fill {value} {what}"),
                dt,
                &[x.clone(), m.clone()],
                &[true, false],
                Some(&gx),
                Bitwise,
                &move |e, t| e.masked_fill(&t[0], &t[1], value),
            )?;
        }
        let host_mask = m6.clone();
        engine_parity(
            out,
            dev,
            &format!("masked_fill {value} host mask"),
            dt,
            std::slice::from_ref(&x),
            &[true],
            Some(&gx),
            Bitwise,
            &move |e, t| e.masked_fill(&t[0], &host_mask, value),
        )?;
    }
    Ok(())
}

fn within_abs(a: f32, b: f32, x: f32) -> bool {
    let lim = 2f64.powi(-20) * f64::from(x.abs()).max(1.0);
    (f64::from(a) - f64::from(b)).abs() <= lim
}

/// One ulp of `dtype` at `x`.
fn ulp_of(dtype: DType, x: f32) -> f64 {
    let bits = match dtype {
        DType::F16 => 10,
        DType::BF16 => 7,
        _ => 23,
    };
    let e = if x == 0.0 {
        -126
    } else {
        f64::from(x.abs()).log2().floor() as i32
    };
    let e = e.max(if dtype == DType::F16 { -14 } else { -126 });
    2f64.powi(e - bits)
}

/// Row-major matmul on the host in f64 from the dtype's values, rounded once to the
/// dtype, and Σ|a||b| per output element (the error bound's scale).
fn host_matmul(a: &Tensor, b: &Tensor, ta: bool, tb: bool) -> Result<(Vec<f32>, Vec<f64>)> {
    let (sa, sb) = (a.shape(), b.shape());
    let batch = if sa.len() == 3 { sa[0] } else { 1 };
    let (ar, ac) = (sa[sa.len() - 2], sa[sa.len() - 1]);
    let (br, bc) = (sb[sb.len() - 2], sb[sb.len() - 1]);
    let (m, k) = if ta { (ac, ar) } else { (ar, ac) };
    let n = if tb { br } else { bc };
    let (av, bv) = (a.f32s()?, b.f32s()?);
    let mut vals = Vec::with_capacity(batch * m * n);
    let mut scale = Vec::with_capacity(batch * m * n);
    for p in 0..batch {
        let ao = p * ar * ac;
        let bo = if sb.len() == 3 { p * br * bc } else { 0 };
        for i in 0..m {
            for j in 0..n {
                let (mut s, mut t) = (0f64, 0f64);
                for q in 0..k {
                    let x = f64::from(av[ao + if ta { q * ac + i } else { i * ac + q }]);
                    let y = f64::from(bv[bo + if tb { j * bc + q } else { q * bc + j }]);
                    s += x * y;
                    t += (x * y).abs();
                }
                vals.push(crate::dtype::round_f64_to(a.dtype(), s) as f32);
                scale.push(t);
            }
        }
    }
    Ok((vals, scale))
}

fn stats_check(name: &str, dtype: DType, got: &TensorStats, want: &TensorStats) -> Check {
    let mut c = Check {
        name: name.into(),
        dtype,
        n: want.numel as usize,
        failures: 0,
        max_ulp: 0,
        first: None,
    };
    let mut exact = got.clone();
    exact.sum_sq = want.sum_sq;
    if &exact != want {
        c.failures += 1;
        c.first = Some(format!("device {exact:?}\ncpu {want:?}"));
    }
    let tol = 2.0 * want.numel as f64 * 2f64.powi(-53) * want.sum_sq;
    if (got.sum_sq - want.sum_sq).abs() > tol {
        c.failures += 1;
        c.first.get_or_insert(format!(
            "sum_sq device {} cpu {} (tolerance {tol:e})",
            got.sum_sq, want.sum_sq
        ));
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ulp_distances() {
        let next = f32::from_bits(1.0f32.to_bits() + 1);
        assert_eq!(ulp_distance(DType::F32, 1.0, next), 1);
        assert_eq!(ulp_distance(DType::F32, 0.0, -0.0), 0);
        let tiny = f32::from_bits(1);
        assert_eq!(ulp_distance(DType::F32, -tiny, tiny), 2);
        assert_eq!(ulp_distance(DType::F16, 1.0, 1.0 + 2f32.powi(-10)), 1);
        assert_eq!(ulp_distance(DType::BF16, 1.0, 1.0 + 2f32.powi(-7)), 1);
        assert_eq!(ulp_distance(DType::F16, f32::NAN, f32::NAN), 0);
        assert_eq!(ulp_distance(DType::F16, f32::NAN, 1.0), u64::MAX);
        assert_eq!(ulp_distance(DType::F16, 65504.0, f32::INFINITY), 1);
    }

    #[test]
    fn host_matmul_matches_hand_computed_products() {
        let a = Tensor::from_f32(vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3], DType::F32).unwrap();
        let b = Tensor::from_f32(vec![1.0, 0.0, -1.0, 2.0, 0.5, 1.0], &[3, 2], DType::F32).unwrap();
        let (v, s) = host_matmul(&a, &b, false, false).unwrap();
        assert_eq!(v, vec![0.5, 7.0, 2.0, 16.0]);
        assert_eq!(s, vec![4.5, 7.0, 12.0, 16.0]);
        // Aᵀ stored as 3×2 gives the same product.
        let at = Tensor::from_f32(vec![1.0, 4.0, 2.0, 5.0, 3.0, 6.0], &[3, 2], DType::F32).unwrap();
        assert_eq!(host_matmul(&at, &b, true, false).unwrap().0, v);
    }

    #[test]
    fn stats_check_flags_a_count_and_a_sum_mismatch() {
        let x = [1.0f32, -2.0, 0.0, f32::NAN];
        let want = TensorStats::compute(DType::F32, &x);
        assert!(stats_check("s", DType::F32, &want, &want).ok());
        let mut bad = want.clone();
        bad.nan += 1;
        assert!(!stats_check("s", DType::F32, &bad, &want).ok());
        let mut off = want.clone();
        off.sum_sq *= 1.0 + 1e-9;
        assert!(!stats_check("s", DType::F32, &off, &want).ok());
    }

    #[test]
    fn random_tensors_hold_every_special_class() {
        let mut rng = Rng::new(1);
        let t = random_tensor(&mut rng, &[4096], DType::F16, 10).unwrap();
        let s = TensorStats::compute(DType::F16, t.f32s().unwrap());
        assert!(s.nan > 0 && s.pos_inf > 0 && s.neg_inf > 0 && s.zeros > 0 && s.subnormal > 0);
    }
}
