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
    // GPT-2's Conv1D: the weight stored [in, out].
    let x2 = randn(&[6, 5], 15);
    let wio = randn(&[5, 4], 16);
    let b2 = randn(&[4], 17);
    assert_ok("addmm", &[b2, x2, wio], |e, i| e.addmm(&i[0], &i[1], &i[2]));
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

/// Distinct values 0.25 apart in a scrambled order, so every maximum is unique by far more
/// than the finite-difference step.
fn distinct(shape: &[usize]) -> Tensor {
    let n: usize = shape.iter().product();
    let v = (0..n).map(|i| ((i * 7) % n) as f64 * 0.25 - 2.0).collect();
    Tensor::from_f64(v, shape).unwrap()
}

#[test]
fn reductions() {
    let x = randn(&[2, 3, 4], 30);
    for (dims, keep) in [(&[][..], false), (&[1][..], false), (&[0, 2][..], true)] {
        assert_ok("sum", std::slice::from_ref(&x), |e, i| {
            e.sum(&i[0], dims, keep)
        });
        assert_ok("mean", std::slice::from_ref(&x), |e, i| {
            e.mean(&i[0], dims, keep)
        });
    }
    let d = distinct(&[2, 3, 4]);
    for (dim, keep) in [(0, false), (1, true), (-1, false)] {
        assert_ok("max", std::slice::from_ref(&d), |e, i| {
            e.max(&i[0], dim, keep)
        });
    }
    for dim in [0, 1, -1] {
        assert_ok("softmax", std::slice::from_ref(&x), |e, i| {
            e.softmax(&i[0], dim)
        });
        assert_ok("log_softmax", std::slice::from_ref(&x), |e, i| {
            e.log_softmax(&i[0], dim)
        });
    }
}

#[test]
fn layer_norm_embedding_dropout() {
    let x = randn(&[3, 5], 40);
    let w = randn(&[5], 41);
    let b = randn(&[5], 42);
    assert_ok("layer_norm", &[x.clone(), w.clone(), b.clone()], |e, i| {
        e.layer_norm(&i[0], 5, Some(&i[1]), Some(&i[2]), 1e-5)
    });
    assert_ok("layer_norm weight only", &[x.clone(), w], |e, i| {
        e.layer_norm(&i[0], 5, Some(&i[1]), None, 1e-5)
    });
    assert_ok("layer_norm bias only", &[x.clone(), b], |e, i| {
        e.layer_norm(&i[0], 5, None, Some(&i[1]), 1e-5)
    });
    assert_ok("layer_norm plain", std::slice::from_ref(&x), |e, i| {
        e.layer_norm(&i[0], 5, None, None, 0.0)
    });
    // Repeated ids: the weight gradient must add their rows.
    let table = randn(&[4, 3], 43);
    let ids = Tensor::from_i64(vec![3, 0, 3, 1, 3, 0], &[2, 3]).unwrap();
    assert_ok("embedding", &[table, ids], |e, i| e.embedding(&i[0], &i[1]));
    // padding_idx: the padding id's row gets no gradient, the others their rows' sums.
    let mut e = Engine::new();
    let table = randn(&[4, 3], 45).as_leaf(true);
    let ids = Tensor::from_i64(vec![3, 0, 3, 1, 3, 0], &[2, 3]).unwrap();
    let y = e.embedding_padded(&table, &ids, Some(3)).unwrap();
    let s = e.sum(&y, &[], false).unwrap();
    let g = e.backward(&s).unwrap();
    let gw = g[&table.id()].to_f64_vec().unwrap();
    assert_eq!(gw, [[2.0; 3], [1.0; 3], [0.0; 3], [0.0; 3]].concat());
    assert!(e.embedding_padded(&table, &ids, Some(4)).is_err());
    // The mask is the same in every evaluation (same seed, step, module and salt).
    let y = randn(&[4, 6], 44);
    assert_ok("dropout", std::slice::from_ref(&y), |e, i| {
        e.dropout(&i[0], 0.3, true, 5)
    });
}

#[test]
fn shape_ops() {
    let x = randn(&[2, 3, 4], 50);
    assert_ok("reshape", std::slice::from_ref(&x), |e, i| {
        let r = e.reshape(&i[0], &[4, -1])?;
        // A weighted op after the reshape, so order matters.
        let w = Tensor::from_f64((0..24).map(|k| k as f64 * 0.1).collect(), &[4, 6])?;
        e.mul(&r, &w)
    });
    assert_ok("view", std::slice::from_ref(&x), |e, i| {
        e.view(&i[0], &[24])
    });
    assert_ok("transpose", std::slice::from_ref(&x), |e, i| {
        e.transpose(&i[0], 0, 2)
    });
    assert_ok("permute", std::slice::from_ref(&x), |e, i| {
        e.permute(&i[0], &[1, 2, 0])
    });
    assert_ok("slice", std::slice::from_ref(&x), |e, i| {
        e.slice(&i[0], 2, 1, -1)
    });
    assert_ok("unsqueeze+squeeze", std::slice::from_ref(&x), |e, i| {
        let u = e.unsqueeze(&i[0], 1)?;
        let t = e.transpose(&u, 1, 3)?;
        e.squeeze(&t, 3)
    });
    let y = randn(&[2, 2, 4], 51);
    let z = randn(&[2, 1, 4], 52);
    assert_ok("cat", &[x.clone(), y, z], |e, i| {
        e.cat(&[&i[0], &i[1], &i[2]], 1)
    });
    // The same tensor twice: both gradients accumulate.
    assert_ok("cat self", std::slice::from_ref(&x), |e, i| {
        e.cat(&[&i[0], &i[0]], -1)
    });
}

#[test]
fn selection_ops() {
    let a = randn(&[2, 3], 60);
    let b = randn(&[3], 61);
    let c = Tensor::from_i64(vec![1, 0, 0, 1, 1, 0], &[2, 3]).unwrap();
    assert_ok("where", &[c.clone(), a.clone(), b.clone()], |e, i| {
        e.where_(&i[0], &i[1], &i[2])
    });
    let col = Tensor::from_i64(vec![0, 1], &[2, 1]).unwrap();
    assert_ok(
        "where broadcast cond",
        &[col, b.clone(), a.clone()],
        |e, i| e.where_(&i[0], &i[1], &i[2]),
    );
    let m = Tensor::from_i64(vec![0, 1, 0], &[3]).unwrap();
    assert_ok("masked_fill", &[a.clone(), m.clone()], |e, i| {
        e.masked_fill(&i[0], &i[1], -3.0)
    });
    // -inf in the output would break the projection; follow the fill with a softmax
    // as attention does.
    assert_ok("masked_fill -inf + softmax", &[a, m], |e, i| {
        let f = e.masked_fill(&i[0], &i[1], f64::NEG_INFINITY)?;
        e.softmax(&f, -1)
    });
}

/// A cast's Jacobian is the identity: its backward hands the gradient back, rounded once
/// to the input's dtype (exact here, the values being fp16-representable).
#[test]
fn cast_backward_returns_the_gradient_in_the_input_dtype() {
    use amprobe::DType;
    for (from, to) in [
        (DType::F32, DType::F16),
        (DType::F32, DType::BF16),
        (DType::F16, DType::F32),
        (DType::F64, DType::F32),
    ] {
        let vals: Vec<f32> = (0..12).map(|i| (i as f32 - 5.0) * 0.375).collect();
        let x = match from {
            DType::F64 => {
                Tensor::from_f64(vals.iter().map(|&v| v as f64).collect(), &[3, 4]).unwrap()
            }
            d => Tensor::from_f32(vals.clone(), &[3, 4], d).unwrap(),
        }
        .as_leaf(true);
        let mut e = Engine::new();
        let y = e.to_dtype(&x, to).unwrap();
        assert_eq!(y.dtype(), to);
        let g: Vec<f32> = (0..12).map(|i| 0.25 * i as f32 - 1.0).collect();
        let seed = Tensor::from_f32(g.clone(), &[3, 4], to).unwrap();
        let grads = e.backward_with(&y, seed).unwrap();
        let gx = &grads[&x.id()];
        assert_eq!(gx.dtype(), from, "{from} -> {to}");
        assert_eq!(
            gx.to_f64_vec().unwrap(),
            g.iter().map(|&v| v as f64).collect::<Vec<_>>()
        );
    }
}
