//! Cost of the probes: step time with every probe on vs off, for the seed MLP and a larger
//! MLP, per precision mode. Prints a table; run with `cargo bench --bench probe_cost`.

use amprobe::config::RunConfig;
use amprobe::runner::build;
use amprobe::train::Trainer;
use std::time::Instant;

fn trainer(
    inputs: usize,
    hidden: usize,
    classes: usize,
    batch: usize,
    precision: &str,
    probes: bool,
) -> Trainer {
    let mut cfg = RunConfig::default();
    cfg.model.kind = Some("mlp".into());
    cfg.model.inputs = Some(inputs);
    cfg.model.hidden = Some(hidden);
    cfg.model.classes = Some(classes);
    cfg.data.batch = Some(batch);
    cfg.train.precision = Some(precision.into());
    cfg.probe.enabled = Some(probes);
    // Keep op records only when something is non-finite, as a long run does.
    cfg.probe.sample_every = Some(0);
    let train = cfg.train_config().expect("config");
    let (m, p, d) = build(&cfg, &train).expect("model");
    Trainer::new(train, m, p, d).expect("trainer")
}

/// Median step time in ms over `reps` steps after `warm` warm-up steps.
fn time(t: &mut Trainer, warm: u64, reps: u64) -> f64 {
    for s in 0..warm {
        t.step(s).expect("step");
    }
    let mut v: Vec<f64> = (0..reps)
        .map(|s| {
            let t0 = Instant::now();
            t.step(warm + s).expect("step");
            t0.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let cases = [
        ("seed MLP 100-50-10, batch 16", 100, 50, 10, 16, 200),
        ("MLP 1024-4096-1024, batch 256", 1024, 4096, 1024, 256, 15),
    ];
    println!(
        "{:<32} {:<6} {:>12} {:>12} {:>8}",
        "model", "mode", "probed ms", "unprobed ms", "ratio"
    );
    for (name, i, h, c, b, reps) in cases {
        for mode in ["fp32", "fp16", "bf16"] {
            let mut on = trainer(i, h, c, b, mode, true);
            let mut off = trainer(i, h, c, b, mode, false);
            // Interleave to share the machine's state fairly.
            let (mut a, mut z) = (Vec::new(), Vec::new());
            for round in 0..3 {
                a.push(time(&mut on, if round == 0 { 3 } else { 0 }, reps));
                z.push(time(&mut off, if round == 0 { 3 } else { 0 }, reps));
            }
            a.sort_by(f64::total_cmp);
            z.sort_by(f64::total_cmp);
            let (p, u) = (a[1], z[1]);
            println!(
                "{:<32} {:<6} {:>12.3} {:>12.3} {:>8.3}",
                name,
                mode,
                p,
                u,
                p / u
            );
        }
    }
}
