//! Autocast in the engine: categories decide the dtype an op runs in, nested disabled
//! regions, keep-in-fp32 module patterns, native promotion and the weight-cast cache.

use amprobe::amp::policy::{DeviceType, PolicyTable};
use amprobe::engine::{Autocast, Engine};
use amprobe::{DType, Tensor};

fn engine(device: DeviceType) -> Engine {
    let mut e = Engine::new();
    e.set_autocast(Some(Autocast {
        dtype: DType::F16,
        table: PolicyTable::for_device(device),
    }));
    e
}

fn t(shape: &[usize], v: f32) -> Tensor {
    let n: usize = shape.iter().product();
    Tensor::from_f32(
        (0..n).map(|i| v + i as f32 * 0.01).collect(),
        shape,
        DType::F32,
    )
    .unwrap()
}

#[test]
fn categories_pick_the_dtype() {
    let mut e = engine(DeviceType::Cuda);
    let x = t(&[2, 3], 0.5);
    let w = t(&[4, 3], 0.1).as_leaf(true);
    let y = e.linear(&x, &w, None).unwrap();
    assert_eq!(y.dtype(), DType::F16, "linear is lower_precision_fp");
    let z = e.exp(&y).unwrap();
    assert_eq!(z.dtype(), DType::F32, "exp is fp32 on cuda");
    let r = e.relu(&y).unwrap();
    assert_eq!(r.dtype(), DType::F16, "relu runs in its input's type");
    let s = e.add(&y, &t(&[2, 4], 1.0)).unwrap();
    assert_eq!(s.dtype(), DType::F32, "fp16 + fp32 promotes natively");
    // On the CPU table exp is not listed: it runs in its input's type.
    let mut c = engine(DeviceType::Cpu);
    let y = c.linear(&x, &w, None).unwrap();
    assert_eq!(c.exp(&y).unwrap().dtype(), DType::F16);
}

#[test]
fn disabled_region_and_keep_fp32_patterns() {
    let mut e = engine(DeviceType::Cuda);
    let x = t(&[2, 3], 0.5);
    let w = t(&[4, 3], 0.1).as_leaf(true);
    let y = e.autocast_off(|e| e.linear(&x, &w, None)).unwrap();
    assert_eq!(y.dtype(), DType::F32, "autocast(enabled=False) region");
    e.set_keep_fp32(vec!["wo".into()]);
    let y = e
        .scope("encoder.block.0.layer.1.DenseReluDense.wo", |e| {
            e.linear(&x, &w, None)
        })
        .unwrap();
    assert_eq!(y.dtype(), DType::F32, "kept in fp32");
    let y = e
        .scope("encoder.block.0.layer.1.DenseReluDense.wi", |e| {
            e.linear(&x, &w, None)
        })
        .unwrap();
    assert_eq!(y.dtype(), DType::F16, "other modules still autocast");
}

#[test]
fn weights_are_cast_once_per_forward() {
    let mut e = engine(DeviceType::Cuda);
    let x = t(&[2, 3], 0.5);
    let w = t(&[3, 3], 0.1).as_leaf(true);
    e.begin_micro(0);
    let a = e.linear(&x, &w, None).unwrap();
    let _ = e.linear(&a, &w, None).unwrap();
    assert_eq!(e.take_weight_casts(), 1, "the cached fp16 copy is reused");
    e.begin_micro(1);
    let _ = e.linear(&x, &w, None).unwrap();
    assert_eq!(e.take_weight_casts(), 1, "a new forward casts again");
    // Non-leaf activations are cast every time (not cached).
    let _ = e.linear(&x, &w, None).unwrap();
    assert_eq!(e.take_weight_casts(), 0);
}

#[test]
fn cast_backward_returns_fp32_gradients_to_fp32_leaves() {
    let mut e = engine(DeviceType::Cuda);
    let x = t(&[2, 3], 0.5);
    let w = t(&[4, 3], 0.1).as_leaf(true);
    let y = e.linear(&x, &w, None).unwrap();
    let l = e.sum(&y, &[], false).unwrap();
    let g = e.backward(&l).unwrap();
    let gw = &g[&w.id()];
    assert_eq!(gw.dtype(), DType::F32);
    // d(sum(x wᵀ))/dw[j, k] = sum_i x[i, k], with x rounded to fp16 by autocast.
    let xs = x.to_f64_vec().unwrap();
    for j in 0..4 {
        for k in 0..3 {
            let want: f64 = (0..2)
                .map(|i| half::f16::from_f32(xs[i * 3 + k] as f32).to_f64())
                .sum();
            assert!(
                (gw.to_f64_vec().unwrap()[j * 3 + k] - want).abs() < 1e-3,
                "{j},{k}"
            );
        }
    }
}

/// Cross-entropy follows PyTorch per device type: on CUDA the decomposition runs
/// (log_softmax keeps the logits' dtype, nll_loss is fp32), on CPU the fused op is fp32.
#[test]
fn cross_entropy_dtypes_follow_pytorch() {
    use amprobe::amp::policy::cross_entropy_dtypes;
    use amprobe::engine::observer::{Observer, OpEvent};
    struct Log(Vec<(String, DType)>);
    impl Observer for Log {
        fn on_op(&mut self, ev: &OpEvent<'_>) {
            self.0.push((ev.op.to_string(), ev.output.dtype()));
        }
        fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
            self
        }
    }
    for device in [DeviceType::Cuda, DeviceType::Cpu] {
        let mut e = engine(device);
        e.add_observer(Box::new(Log(Vec::new())));
        let x = t(&[4, 3], 0.5);
        let w = t(&[5, 3], 0.1).as_leaf(true);
        let logits = e.linear(&x, &w, None).unwrap();
        let y = Tensor::from_i64(vec![0, 4, 2, 1], &[4]).unwrap();
        let loss = e.cross_entropy(&logits, &y, None).unwrap();
        let want = cross_entropy_dtypes(device, DType::F16);
        assert_eq!(loss.dtype(), want.loss, "{device:?}");
        let mut obs = e.take_observers();
        let log = &obs[0].as_any_mut().downcast_mut::<Log>().unwrap().0;
        if let Some((_, d)) = log.iter().find(|(op, _)| op == "log_softmax") {
            assert_eq!(*d, want.log_probs, "{device:?} log-probabilities");
        } else {
            assert_eq!(device, DeviceType::Cpu, "CUDA runs the decomposition");
        }
    }
}
