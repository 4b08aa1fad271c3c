//! Losses: cross-entropy (mean, ignore_index) and mean squared error.

use super::{expect_float, grad};
use crate::amp::policy::Category;
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

mod cpu;
pub mod cuda;
mod kernels;
mod labels;

pub use kernels::{ClassKept, Kernels, Valid};
pub use labels::check_labels;

/// The loss kernels of the backend that holds `t`.
pub fn kernels(t: &Tensor) -> &'static dyn Kernels {
    if super::on_device(t) {
        &cuda::Device
    } else {
        &cpu::Host
    }
}

impl Engine {
    /// Mean negative log-likelihood of log-probabilities `lp` [..., C] at integer `targets`
    /// (`torch.nn.functional.nll_loss`).
    pub fn nll_loss(
        &mut self,
        lp: &Tensor,
        targets: &Tensor,
        ignore_index: Option<i64>,
    ) -> Result<Tensor> {
        expect_float(lp, "nll_loss", "log-probabilities")?;
        let ins = self.prepare("nll_loss", &[lp, targets])?;
        let (x, t) = (&ins[0], &ins[1]);
        let kern = kernels(x);
        let (out, kept) = kern.nll(x, t, ignore_index)?;
        let (shape, dtype) = (x.shape().to_vec(), x.dtype());
        let bw = Box::new(move |g: &Tensor| {
            let dx = kern.nll_backward(&shape, dtype, &kept, g, ignore_index)?;
            Ok(vec![grad(dx), None])
        });
        self.record(
            "nll_loss",
            &[x, t],
            &["input", "target"],
            out,
            Some(bw),
            Box::new(move |e: &mut Engine, r: &[Tensor]| e.nll_loss(&r[0], &r[1], ignore_index)),
        )
    }

    /// Mean cross-entropy of `logits` [..., C] against integer `targets` [...], skipping
    /// positions equal to `ignore_index` (`torch.nn.functional.cross_entropy`).
    pub fn cross_entropy(
        &mut self,
        logits: &Tensor,
        targets: &Tensor,
        ignore_index: Option<i64>,
    ) -> Result<Tensor> {
        expect_float(logits, "cross_entropy_loss", "logits")?;
        if self.autocast_category("cross_entropy_loss") == Some(Category::Passthrough) {
            // CUDA autocast has no cross_entropy kernel: PyTorch's decomposition runs,
            // log_softmax with the logits' dtype passed explicitly (autocast keeps it),
            // then nll_loss from the fp32 list.
            let lp = self.autocast_off(|e| e.log_softmax(logits, -1))?;
            return self.nll_loss(&lp, targets, ignore_index);
        }
        let ins = self.prepare("cross_entropy_loss", &[logits, targets])?;
        let (x, t) = (&ins[0], &ins[1]);
        let kern = kernels(x);
        let (out, kept) = kern.cross_entropy(x, t, ignore_index)?;
        let xt = x.clone();
        let bw = Box::new(move |g: &Tensor| {
            let dx = kern.cross_entropy_backward(&xt, &kept, g, ignore_index)?;
            Ok(vec![grad(dx), None])
        });
        self.record(
            "cross_entropy_loss",
            &[x, t],
            &["input", "target"],
            out,
            Some(bw),
            Box::new(move |e: &mut Engine, r: &[Tensor]| {
                e.cross_entropy(&r[0], &r[1], ignore_index)
            }),
        )
    }

    /// Mean squared error of `a` against `b` (same shape).
    pub fn mse_loss(&mut self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        expect_float(a, "mse_loss", "input")?;
        expect_float(b, "mse_loss", "target")?;
        let ins = self.prepare("mse_loss", &[a, b])?;
        let (a, b) = (&ins[0], &ins[1]);
        if a.shape() != b.shape() {
            return Err(Error::shape(
                "mse_loss",
                format!(
                    "input {:?} and target {:?} differ in shape",
                    a.shape(),
                    b.shape()
                ),
            ));
        }
        // A device operand puts the op on its device (the other moves there or is refused).
        let kern = kernels(if super::on_device(b) { b } else { a });
        let out = kern.mse(a, b)?;
        let (at, bt) = (a.clone(), b.clone());
        let bw = Box::new(move |g: &Tensor| kern.mse_backward(&at, &bt, g));
        self.record(
            "mse_loss",
            &[a, b],
            &["input", "target"],
            out,
            Some(bw),
            Box::new(move |e: &mut Engine, r: &[Tensor]| e.mse_loss(&r[0], &r[1])),
        )
    }
}
