//! What the engine's tape keeps for the backward pass: only the values a gradient formula
//! reads. An activation that fed only ops whose gradients do not read it (a sum, a scaling,
//! the left side of an add) is freed as soon as the model drops it, as PyTorch frees what
//! no backward formula saves; the gradients and the backward records stay the same.

use amprobe::engine::Engine;
use amprobe::probe::recorder::Recorder;
use amprobe::tensor::Storage;
use amprobe::trace::record::Phase;
use amprobe::{DType, Tensor};
use std::sync::{Arc, Weak};

fn leaf(values: &[f32]) -> Tensor {
    Tensor::from_f32(values.to_vec(), &[values.len()], DType::F32)
        .unwrap()
        .as_leaf(true)
}

/// A handle on a host tensor's values that does not keep them alive.
fn watch(t: &Tensor) -> Weak<Vec<f32>> {
    match t.storage() {
        Storage::F32(v) => Arc::downgrade(v),
        _ => panic!("a host f32 tensor"),
    }
}

/// loss = sum((2x + x) · x · x): `a = 2x` is read by no gradient (scaling, then the left
/// side of an add), `b = a + x` is read by the gradient of `c = b · x` with respect to x.
fn forward(e: &mut Engine, x: &Tensor) -> (Tensor, Weak<Vec<f32>>, Weak<Vec<f32>>) {
    let a = e.mul_scalar(x, 2.0).unwrap();
    let b = e.add(&a, x).unwrap();
    let c = e.mul(&b, x).unwrap();
    let d = e.mul(&c, x).unwrap();
    let loss = e.sum(&d, &[0], false).unwrap();
    (loss, watch(&a), watch(&b))
}

#[test]
fn activations_no_gradient_reads_are_freed_before_the_backward() {
    let xs = [0.5f32, -1.25, 3.0];
    let x = leaf(&xs);
    let mut e = Engine::new();
    let (loss, a, b) = forward(&mut e, &x);
    assert!(a.upgrade().is_none(), "2x is read by no gradient: freed");
    assert!(
        b.upgrade().is_some(),
        "2x + x is read by the gradient of (2x + x)·x"
    );
    let grads = e.backward(&loss).unwrap();
    // d/dx of 3x³ is 9x² (exact in f32 for these values).
    let g = grads[&x.id()].f32s().unwrap().to_vec();
    let want: Vec<f32> = xs.iter().map(|v| 9.0 * v * v).collect();
    assert_eq!(g, want);
}

#[test]
fn backward_records_still_name_every_input_of_the_forward_op() {
    let x = leaf(&[0.5, -1.25, 3.0]);
    let mut e = Engine::new();
    e.add_observer(Box::new(Recorder::new()));
    e.begin_step(0);
    let (loss, a, _) = forward(&mut e, &x);
    assert!(a.upgrade().is_none(), "freed with a recorder attached too");
    e.backward(&loss).unwrap();
    let mut obs = e.take_observers();
    let rec = obs[0].as_any_mut().downcast_mut::<Recorder>().unwrap();
    let ops = rec.ops();
    let add_fwd = ops
        .iter()
        .find(|o| o.op == "add" && o.phase == Phase::Forward)
        .unwrap();
    let add_bwd: Vec<_> = ops
        .iter()
        .filter(|o| o.op == "add" && o.phase == Phase::Backward)
        .collect();
    assert_eq!(add_bwd.len(), 2, "a gradient for each side of the add");
    for o in add_bwd {
        assert_eq!(o.forward_op, Some(add_fwd.index));
        // The output gradient, then the forward op's two inputs, one of them released.
        assert_eq!(o.inputs.len(), 3);
        assert!(o
            .inputs
            .iter()
            .all(|m| m.shape == [3] && m.dtype == DType::F32));
    }
}
