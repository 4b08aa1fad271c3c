//! What a training step asks of the device, counted by the simulated device: one
//! device-to-host read per step, no allocations once the memory cache is warm, the same
//! launches every step. Alone in its test binary, since the counters are the process's.

#[path = "device_step/common.rs"]
mod common;
use amprobe::amp::mode::Precision;
use amprobe::backend::BackendKind;
use amprobe::train::{FixedBatch, Trainer};
use common::*;

#[test]
fn a_step_reads_the_device_once_and_allocates_nothing_once_the_pool_is_warm() {
    if !device_or_skip() {
        return;
    }
    use amprobe::device::cuda::counters::sim_counters;
    let mut cfg = base(Precision::Fp16);
    cfg.backend = BackendKind::Cuda;
    cfg.clip = Some(1.0);
    let mut t = Trainer::new(
        cfg,
        Box::new(SumMlp),
        params(3, 0.5),
        Box::new(FixedBatch(batch(5, 1.0))),
    )
    .unwrap();
    let Some(mut before) = sim_counters() else {
        eprintln!("skipped: counters exist on the simulated device only");
        return;
    };
    let mut launches = Vec::new();
    for s in 0..5 {
        t.step(s).unwrap();
        let now = sim_counters().unwrap();
        let d = now.since(&before);
        before = now;
        assert_eq!(d.dtoh_copies, 1, "step {s}: device-to-host reads {d:?}");
        // The cache of freed memory fills over two steps: during step 1 the trainer still
        // holds step 0's starting parameters (what a replay of the last step needs) beside
        // step 0's results, one more set than step 0 had alive.
        if s >= 2 {
            assert_eq!(d.allocs, 0, "step {s}: device allocations {d:?}");
        } else {
            assert!(d.allocs > 0);
            continue;
        }
        assert!(d.launches > 0);
        launches.push(d.launches);
    }
    assert!(
        launches.windows(2).all(|w| w[0] == w[1]),
        "every step launches the same kernels: {launches:?}"
    );

    // The T5 sample in pure fp16 with transformers' clamp, whose blocks overflow: the clamp's
    // choice of bound is made on the device, so a step still reads once. (Here, not in a
    // test of its own: the counters are the process's and tests run side by side.)
    let dir = std::path::PathBuf::from("samples/t5_overflow_small");
    let mut rc = amprobe::config::RunConfig::default();
    rc.model.hf = Some(dir.clone());
    rc.model.t5_clamp = Some(true);
    rc.data.inputs = Some(dir.join("inputs.safetensors"));
    let mut train = rc.train_config().unwrap();
    train.precision = Precision::Half;
    train.backend = BackendKind::Cuda;
    let (m, p, d) = amprobe::runner::build(&rc, &train).unwrap();
    let mut t = Trainer::new(train, m, p, d).unwrap();
    assert!(t.model().describe().contains("fp16 clamp"));
    let mut before = sim_counters().unwrap();
    for s in 0..2 {
        t.step(s).unwrap();
        let now = sim_counters().unwrap();
        let d = now.since(&before);
        before = now;
        assert_eq!(
            d.dtoh_copies, 1,
            "t5 clamp step {s}: device-to-host reads {d:?}"
        );
    }
}
