//! The elementwise functions themselves: each unary map and binary op with its value and
//! derivative, shared by the op definitions (`mod.rs`) and every backend's kernels.

use crate::tensor::Real;

/// A unary elementwise function with its derivative.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Unary {
    /// -x
    Neg,
    /// max(x, 0)
    Relu,
    /// x·Φ(x) with the exact error function.
    GeluErf,
    /// The tanh approximation of GELU.
    GeluTanh,
    /// x·sigmoid(x)
    Silu,
    /// tanh(x)
    Tanh,
    /// 1 / (1 + e^-x)
    Sigmoid,
    /// e^x
    Exp,
    /// ln x
    Log,
    /// √x
    Sqrt,
    /// 1/√x
    Rsqrt,
    /// x^p for a scalar exponent.
    Pow(f64),
    /// min(max(x, lo), hi)
    Clamp(Option<f64>, Option<f64>),
    /// x·s for a scalar s.
    MulScalar(f64),
    /// x + s for a scalar s.
    AddScalar(f64),
}

impl Unary {
    /// ATen name of the op (its autocast lookup key).
    pub fn name(self) -> &'static str {
        match self {
            Unary::Neg => "neg",
            Unary::Relu => "relu",
            Unary::GeluErf | Unary::GeluTanh => "gelu",
            Unary::Silu => "silu",
            Unary::Tanh => "tanh",
            Unary::Sigmoid => "sigmoid",
            Unary::Exp => "exp",
            Unary::Log => "log",
            Unary::Sqrt => "sqrt",
            Unary::Rsqrt => "rsqrt",
            Unary::Pow(_) => "pow",
            Unary::Clamp(..) => "clamp",
            Unary::MulScalar(_) => "mul",
            Unary::AddScalar(_) => "add",
        }
    }

    /// f(x), computed in T.
    #[inline(always)]
    pub fn f<T: Real>(self, x: T) -> T {
        let half = T::of(0.5);
        let one = T::one();
        match self {
            Unary::Neg => -x,
            Unary::Relu => {
                if x > T::zero() || x.is_nan() {
                    x
                } else {
                    T::zero()
                }
            }
            Unary::GeluErf => half * x * (one + (x * T::of(std::f64::consts::FRAC_1_SQRT_2)).erf()),
            Unary::GeluTanh => {
                let k = T::of((2.0 / std::f64::consts::PI).sqrt());
                half * x * (one + (k * (x + T::of(0.044715) * x * x * x)).tanh_op())
            }
            Unary::Silu => x / (one + (-x).exp_op()),
            Unary::Tanh => x.tanh_op(),
            Unary::Sigmoid => one / (one + (-x).exp_op()),
            Unary::Exp => x.exp_op(),
            Unary::Log => x.ln(),
            Unary::Sqrt => x.sqrt(),
            Unary::Rsqrt => one / x.sqrt(),
            // PyTorch's pow with a scalar exponent: 2 and 3 as products ((x·x)·x for 3, two
            // roundings), 0.5 as sqrt, the rest through pow.
            Unary::Pow(p) => {
                if p == 2.0 {
                    x * x
                } else if p == 3.0 {
                    x * x * x
                } else if p == 0.5 {
                    x.sqrt()
                } else if p == 1.0 {
                    x
                } else {
                    x.powf(T::of(p))
                }
            }
            Unary::Clamp(lo, hi) => {
                let mut y = x;
                if let Some(l) = lo {
                    y = if y < T::of(l) { T::of(l) } else { y };
                }
                if let Some(h) = hi {
                    y = if y > T::of(h) { T::of(h) } else { y };
                }
                y
            }
            Unary::MulScalar(s) => x * T::of(s),
            Unary::AddScalar(s) => x + T::of(s),
        }
    }

    /// Which of the input x and the output y [`Unary::df`] reads: the backward keeps only
    /// those alive (an argument it does not read may be given any value of its length).
    pub fn reads(self) -> (bool, bool) {
        match self {
            Unary::Neg | Unary::MulScalar(_) | Unary::AddScalar(_) => (false, false),
            Unary::Relu
            | Unary::Tanh
            | Unary::Sigmoid
            | Unary::Exp
            | Unary::Sqrt
            | Unary::Rsqrt => (false, true),
            Unary::GeluErf
            | Unary::GeluTanh
            | Unary::Silu
            | Unary::Log
            | Unary::Pow(_)
            | Unary::Clamp(..) => (true, false),
        }
    }

    /// dL/dx from the input x, the output y and dL/dy, computed in T.
    #[inline(always)]
    pub fn df<T: Real>(self, x: T, y: T, g: T) -> T {
        let one = T::one();
        let half = T::of(0.5);
        match self {
            Unary::Neg => -g,
            Unary::Relu => {
                if y > T::zero() {
                    g
                } else {
                    T::zero()
                }
            }
            Unary::GeluErf => {
                let cdf = half * (one + (x * T::of(std::f64::consts::FRAC_1_SQRT_2)).erf());
                let pdf =
                    (-half * x * x).exp_op() * T::of(1.0 / (2.0 * std::f64::consts::PI).sqrt());
                g * (cdf + x * pdf)
            }
            Unary::GeluTanh => {
                let k = T::of((2.0 / std::f64::consts::PI).sqrt());
                let c = T::of(0.044715);
                let inner = k * (x + c * x * x * x);
                let t = inner.tanh_op();
                let dinner = k * (one + T::of(3.0) * c * x * x);
                g * (half * (one + t) + half * x * (one - t * t) * dinner)
            }
            Unary::Silu => {
                let s = one / (one + (-x).exp_op());
                g * s * (one + x * (one - s))
            }
            Unary::Tanh => g * (one - y * y),
            Unary::Sigmoid => g * y * (one - y),
            Unary::Exp => g * y,
            Unary::Log => g / x,
            Unary::Sqrt => g / (T::of(2.0) * y),
            Unary::Rsqrt => T::of(-0.5) * g * y * y * y,
            // PyTorch's pow_backward: g · (p · x^(p−1)), x^(p−1) as its forward computes it.
            Unary::Pow(p) => {
                if p == 2.0 {
                    g * (T::of(2.0) * x)
                } else if p == 3.0 {
                    g * (T::of(3.0) * (x * x))
                } else if p == 1.0 {
                    g
                } else {
                    g * (T::of(p) * x.powf(T::of(p - 1.0)))
                }
            }
            Unary::Clamp(lo, hi) => {
                let ok_lo = lo.is_none_or(|l| x >= T::of(l));
                let ok_hi = hi.is_none_or(|h| x <= T::of(h));
                if ok_lo && ok_hi {
                    g
                } else {
                    T::zero()
                }
            }
            Unary::MulScalar(s) => g * T::of(s),
            Unary::AddScalar(_) => g,
        }
    }
}

/// A broadcasting binary arithmetic op.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Binary {
    /// a + b
    Add,
    /// a - b
    Sub,
    /// a · b
    Mul,
    /// a / b
    Div,
}

impl Binary {
    /// ATen name.
    pub fn name(self) -> &'static str {
        match self {
            Binary::Add => "add",
            Binary::Sub => "sub",
            Binary::Mul => "mul",
            Binary::Div => "div",
        }
    }

    /// Which operands' values the gradients of the operands in `need` read (an add's or
    /// a subtraction's read none): the backward keeps only those alive.
    pub fn grad_reads(self, need: [bool; 2]) -> (bool, bool) {
        match self {
            Binary::Add | Binary::Sub => (false, false),
            Binary::Mul => (need[1], need[0]),
            Binary::Div => (need[1], need[0] || need[1]),
        }
    }

    #[inline(always)]
    pub(crate) fn f<T: Real>(self, a: T, b: T) -> T {
        match self {
            Binary::Add => a + b,
            Binary::Sub => a - b,
            Binary::Mul => a * b,
            Binary::Div => a / b,
        }
    }
}
