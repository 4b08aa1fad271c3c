//! What the CPU step benches share: medians, and probed against unprobed steps in pairs.

use amprobe::train::Trainer;
use std::time::Instant;

/// The median (the upper one of an even count).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The median of the ratios `a[i] / b[i]` of steps taken side by side.
pub fn median_ratio(a: &[f64], b: &[f64]) -> f64 {
    median(a.iter().zip(b).map(|(x, y)| x / y).collect())
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
#[allow(dead_code)] // t5_step steps its trainers through `rounds`
pub fn paired_ms(on: &mut Trainer, off: &mut Trainer, pairs: u64) -> (f64, f64, f64) {
    let mut ts = [vec![on, off]];
    let times = rounds(&mut ts, pairs);
    let (a, b) = (&times[0][0], &times[0][1]);
    (median(a.clone()), median(b.clone()), median_ratio(a, b))
}

/// `rounds` rounds of single steps, from step 1, of every group of trainers: in each
/// round every group takes one step of each of its trainers back to back (which goes
/// first moves on from round to round, so a pair alternates), and the group that starts
/// the round moves on by one, so that a slow spell of the machine weighs on all of them
/// alike. The step times in milliseconds, per group and trainer, in round order; every
/// trainer has taken its warm-up step.
pub fn rounds(groups: &mut [Vec<&mut Trainer>], rounds: u64) -> Vec<Vec<Vec<f64>>> {
    let n = groups.len();
    let mut times: Vec<Vec<Vec<f64>>> = groups.iter().map(|g| vec![Vec::new(); g.len()]).collect();
    for s in 1..=rounds {
        for k in 0..n {
            let i = (k + s as usize - 1) % n;
            let m = groups[i].len();
            for t in 0..m {
                let j = (t + s as usize - 1) % m;
                times[i][j].push(step_ms(groups[i][j], s));
            }
        }
    }
    times
}
