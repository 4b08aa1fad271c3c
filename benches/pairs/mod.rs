//! What the CPU step benches share: medians, and probed against unprobed steps in pairs.

use amprobe::train::Trainer;
use std::time::Instant;

/// The median (the upper one of an even count).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Wall time of step `s` of `t`, in milliseconds.
pub fn step_ms(t: &mut Trainer, s: u64) -> f64 {
    let t0 = Instant::now();
    t.step(s).expect("step");
    t0.elapsed().as_secs_f64() * 1e3
}

/// `pairs` single steps of each trainer, from step 1, taken in turn (which goes first
/// alternates too), so that a slow spell of the machine weighs on both sides of a pair:
/// the probed and unprobed medians in milliseconds and the median of the pairs' ratios.
/// Both trainers have taken their warm-up step.
pub fn paired_ms(on: &mut Trainer, off: &mut Trainer, pairs: u64) -> (f64, f64, f64) {
    let (mut a, mut b, mut r) = (Vec::new(), Vec::new(), Vec::new());
    for s in 1..=pairs {
        let (x, y) = if s % 2 == 1 {
            let x = step_ms(on, s);
            (x, step_ms(off, s))
        } else {
            let y = step_ms(off, s);
            (step_ms(on, s), y)
        };
        a.push(x);
        b.push(y);
        r.push(x / y);
    }
    (median(a), median(b), median(r))
}
