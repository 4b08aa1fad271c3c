//! Every op's backward against central finite differences in f64.

use amprobe::engine::Engine;
use amprobe::ops::elementwise::Unary;
use amprobe::ops::gradcheck::check;
use amprobe::rng::Rng;
use amprobe::{Result, Tensor};

fn randn(shape: &[usize], seed: u64) -> Tensor {
    let mut r = Rng::new(seed);
    let n: usize = shape.iter().product();
    Tensor::from_f64((0..n).map(|_| r.normal()).collect(), shape).unwrap()
}

fn positive(shape: &[usize], seed: u64) -> Tensor {
    let mut r = Rng::new(seed);
    let n: usize = shape.iter().product();
    Tensor::from_f64((0..n).map(|_| 0.5 + 2.0 * r.uniform()).collect(), shape).unwrap()
}

/// Values kept away from the kinks of relu/clamp so central differences are valid.
fn away_from(shape: &[usize], seed: u64, kinks: &[f64]) -> Tensor {
    let mut r = Rng::new(seed);
    let n: usize = shape.iter().product();
    let v = (0..n)
        .map(|_| loop {
            let x = r.normal() * 2.0;
            if kinks.iter().all(|k| (x - k).abs() > 0.05) {
                break x;
            }
        })
        .collect();
    Tensor::from_f64(v, shape).unwrap()
}

fn assert_ok(name: &str, inputs: &[Tensor], f: impl Fn(&mut Engine, &[Tensor]) -> Result<Tensor>) {
    let r = check(inputs, f, 1e-6, 1e-7, 1e-5).unwrap();
    assert!(r.checked > 0, "{name}: nothing checked");
    assert!(r.worst_ratio <= 1.0, "{name}: gradient mismatch {:?}", r);
}

#[test]
fn unary_ops() {
    let x = randn(&[3, 5], 1);
    let p = positive(&[3, 5], 2);
    for op in [
        Unary::Neg,
        Unary::GeluErf,
        Unary::GeluTanh,
        Unary::Silu,
        Unary::Tanh,
        Unary::Sigmoid,
        Unary::Exp,
        Unary::Pow(2.0),
        Unary::Pow(3.0),
        Unary::MulScalar(0.37),
        Unary::AddScalar(-1.5),
    ] {
        assert_ok(op.name(), std::slice::from_ref(&x), |e, i| {
            e.unary(op, &i[0])
        });
    }
    for op in [
        Unary::Log,
        Unary::Sqrt,
        Unary::Rsqrt,
        Unary::Pow(-1.5),
        Unary::Pow(0.5),
    ] {
        assert_ok(op.name(), std::slice::from_ref(&p), |e, i| {
            e.unary(op, &i[0])
        });
    }
    let k = away_from(&[4, 6], 3, &[0.0, -1.0, 1.0]);
    assert_ok("relu", std::slice::from_ref(&k), |e, i| e.relu(&i[0]));
    assert_ok("clamp", std::slice::from_ref(&k), |e, i| {
        e.clamp(&i[0], Some(-1.0), Some(1.0))
    });
}

#[test]
fn binary_ops_with_broadcasting() {
    let a = randn(&[2, 3, 4], 4);
    let b = randn(&[3, 1], 5);
    let c = positive(&[4], 6);
    assert_ok("add", &[a.clone(), b.clone()], |e, i| e.add(&i[0], &i[1]));
    assert_ok("sub", &[b.clone(), a.clone()], |e, i| e.sub(&i[0], &i[1]));
    assert_ok("mul", &[a.clone(), b.clone()], |e, i| e.mul(&i[0], &i[1]));
    assert_ok("div", &[a.clone(), c.clone()], |e, i| e.div(&i[0], &i[1]));
    assert_ok(
        "mul same shape",
        &[a.clone(), randn(&[2, 3, 4], 9)],
        |e, i| e.mul(&i[0], &i[1]),
    );
}

#[test]
fn linear_matmul_bmm() {
    let x = randn(&[2, 3, 5], 10);
    let w = randn(&[4, 5], 11);
    let b = randn(&[4], 12);
    assert_ok("linear+bias", &[x.clone(), w.clone(), b], |e, i| {
        e.linear(&i[0], &i[1], Some(&i[2]))
    });
    assert_ok("linear", &[x.clone(), w], |e, i| {
        e.linear(&i[0], &i[1], None)
    });
    let m = randn(&[5, 2], 13);
    assert_ok("matmul shared", &[x.clone(), m], |e, i| {
        e.matmul(&i[0], &i[1])
    });
    let y = randn(&[2, 5, 3], 14);
    assert_ok("bmm", &[x, y], |e, i| e.bmm(&i[0], &i[1]));
}

#[test]
fn losses_and_cast() {
    let x = randn(&[6, 5], 20);
    let t = Tensor::from_i64(vec![0, 4, 2, -100, 1, 3], &[6]).unwrap();
    assert_ok("cross_entropy", &[x.clone(), t], |e, i| {
        e.cross_entropy(&i[0], &i[1], Some(-100))
    });
    let y = randn(&[6, 5], 21);
    assert_ok("mse_loss", &[x.clone(), y], |e, i| e.mse_loss(&i[0], &i[1]));
    // A cast to f64 and back is the identity for f64 inputs: the gradient passes through.
    assert_ok("to", std::slice::from_ref(&x), |e, i| {
        e.to_dtype(&i[0], amprobe::DType::F64)
    });
}
