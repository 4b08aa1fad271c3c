//! Blame: each op done again in f64, from its own inputs and from their all-f64 shadows,
//! and the relative errors between the three that observers hear of ([`Blame`]).

use super::observer::Blame;
use super::{Engine, NodeBlame, Recompute};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::{Tensor, TensorId};

/// Does an op again on `engine` from `values` (in its inputs' places), taped where
/// `needs` says which inputs need a gradient; returns the output and the inputs as the
/// engine's leaves.
fn redo(
    engine: &mut Engine,
    values: &[Tensor],
    needs: Option<&[bool]>,
    recompute: &Recompute,
) -> Result<(Tensor, Vec<TensorId>)> {
    engine.set_grad_enabled(needs.is_some());
    let leaves: Vec<Tensor> = values
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let need = needs.is_some_and(|n| n.get(i).copied().unwrap_or(false));
            v.as_leaf(need && v.dtype().is_float())
        })
        .collect();
    let output = recompute(engine, &leaves)?;
    Ok((output, leaves.iter().map(Tensor::id).collect()))
}

/// A floating tensor widened exactly to f64 (others as they are), in host memory.
fn widen(t: &Tensor) -> Result<Tensor> {
    if t.dtype().is_float() && t.dtype() != DType::F64 {
        Tensor::from_f64(t.to_f64_vec()?, t.shape())
    } else {
        t.to_host()
    }
}

/// `‖a − b‖₂ / ‖b‖₂` over the positions where both are finite (0 when equal, infinite
/// when only `b` is 0 there).
pub fn relative_error(a: &Tensor, b: &Tensor) -> Result<f64> {
    let (x, y) = (a.to_f64_vec()?, b.to_f64_vec()?);
    if x.len() != y.len() {
        return Err(Error::Invalid(format!(
            "relative error of {} values against {}",
            x.len(),
            y.len()
        )));
    }
    let (mut diff, mut norm) = (0.0f64, 0.0f64);
    for (p, q) in x.iter().zip(&y) {
        if p.is_finite() && q.is_finite() {
            diff += (p - q) * (p - q);
            norm += q * q;
        }
    }
    Ok(if diff == 0.0 {
        0.0
    } else if norm == 0.0 {
        f64::INFINITY
    } else {
        (diff / norm).sqrt()
    })
}

/// The blame of an output against `exact`, its recomputation in f64 from its own inputs,
/// and against `shadow`, its all-f64 shadow, with its inputs' error `input`.
pub fn blame(output: &Tensor, exact: &Tensor, shadow: &Tensor, input: f64) -> Result<Blame> {
    Ok(Blame {
        introduced: relative_error(output, exact)?,
        inherited: relative_error(exact, shadow)?,
        total: relative_error(output, shadow)?,
        input,
    })
}

/// `a + b` in f64, in host memory.
fn add_f64(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let (x, y) = (a.to_f64_vec()?, b.to_f64_vec()?);
    Tensor::from_f64(x.iter().zip(&y).map(|(p, q)| p + q).collect(), a.shape())
}

/// The f64 gradients of a blamed op's inputs ([`Engine::blamed_gradients`]).
pub(super) struct BlamedGradients {
    exact: Vec<Option<Tensor>>,
    shadow: Vec<Option<Tensor>>,
    input: f64,
}

impl BlamedGradients {
    /// Input `i`'s exact gradient, its shadow and the error the op's inputs carry.
    fn of(&self, i: usize) -> Option<(&Tensor, &Tensor, f64)> {
        let exact = self.exact.get(i)?.as_ref()?;
        let shadow = self.shadow.get(i)?.as_ref()?;
        Some((exact, shadow, self.input))
    }

    /// The blame of `tensor`, the gradient the op's backward made for input `i`, and its
    /// shadow; none where that input's gradient was not done again.
    pub(super) fn blame_of_input(
        &self,
        i: usize,
        tensor: &Tensor,
    ) -> Result<(Option<Blame>, Option<&Tensor>)> {
        Ok(match self.of(i) {
            Some((exact, shadow, input)) => {
                (Some(blame(tensor, exact, shadow, input)?), Some(shadow))
            }
            None => (None, None),
        })
    }
}

impl Engine {
    /// Blames the ops that follow (until turned off): each forward op is done again in f64
    /// from its own inputs and from the inputs' all-f64 shadows, and each backward op of
    /// those forward ops is done again in f64 from its own output gradient and from that
    /// gradient's shadow, through the same ops' f64 backward; observers hear of the
    /// relative errors ([`Blame`]). A device op's inputs and output are read back and
    /// recomputed on the host. Turning it off frees the shadows.
    pub fn set_blame(&mut self, on: bool) {
        self.blame = on;
        if !on {
            self.shadows.clear();
        }
    }

    /// Whether ops are blamed.
    pub fn blaming(&self) -> bool {
        self.blame
    }

    /// The blame of a forward op with these inputs and the shadow of its output; and when
    /// the op goes on the tape (`taped`), what its backward needs for blame.
    pub(super) fn blame_of(
        &self,
        inputs: &[&Tensor],
        output: &Tensor,
        recompute: Recompute,
        taped: bool,
    ) -> Result<(Blame, Tensor, Option<Box<NodeBlame>>)> {
        // (device tensors come back to the host: the recomputations run on the host's f64
        // kernels, which is what makes them exact, at one read back per op)
        let own: Vec<Tensor> = inputs.iter().map(|t| widen(t)).collect::<Result<_>>()?;
        // An input no op of the step made (a parameter, the batch) is its own shadow: the
        // widened copy above, not a second read.
        let shadows: Vec<Tensor> = inputs
            .iter()
            .zip(&own)
            .map(|(t, w)| self.shadows.get(&t.id()).unwrap_or(w).clone())
            .collect();
        let module = self.module_path();
        let (exact, _) = redo(&mut self.scratch(&module), &own, None, &recompute)?;
        let (shadow, _) = redo(&mut self.scratch(&module), &shadows, None, &recompute)?;
        let mut input = 0.0f64;
        for (t, s) in inputs.iter().zip(&shadows) {
            if t.dtype().is_float() {
                input = input.max(relative_error(t, s)?);
            }
        }
        let blame = Blame {
            introduced: relative_error(output, &exact)?,
            inherited: relative_error(&exact, &shadow)?,
            total: relative_error(output, &shadow)?,
            input,
        };
        let node = taped.then(|| {
            Box::new(NodeBlame {
                inputs: inputs.iter().map(|t| (*t).clone()).collect(),
                output: output.clone(),
                shadows,
                needs: inputs.iter().map(|t| t.requires_grad()).collect(),
                input,
                recompute,
            })
        });
        Ok((blame, shadow, node))
    }

    /// A blamed op's input gradients done again in f64, with a tape: from its own inputs
    /// and output gradient `g`, and from their shadows (`g` itself, widened, where no
    /// shadow of it was made).
    pub(super) fn blamed_gradients(
        &self,
        nb: &NodeBlame,
        module: &str,
        g: &Tensor,
        g_shadow: Option<Tensor>,
    ) -> Result<BlamedGradients> {
        let own_g = widen(g)?;
        let g_shadow = match g_shadow {
            Some(s) => s,
            None => own_g.clone(),
        };
        let input = nb.input.max(relative_error(g, &g_shadow)?);
        let gradients = |values: &[Tensor],
                         seed: Tensor,
                         saved: Option<Tensor>|
         -> Result<Vec<Option<Tensor>>> {
            let mut e = self.scratch(module);
            e.saved_output = saved;
            let (out, leaves) = redo(&mut e, values, Some(&nb.needs), &nb.recompute)?;
            let mut grads = e.backward_with(&out, seed)?;
            Ok(leaves.iter().map(|id| grads.remove(id)).collect())
        };
        let own: Vec<Tensor> = nb.inputs.iter().map(widen).collect::<Result<_>>()?;
        Ok(BlamedGradients {
            exact: gradients(&own, own_g, Some(widen(&nb.output)?))?,
            shadow: gradients(&nb.shadows, g_shadow, None)?,
            input,
        })
    }

    /// The blame of `sum`, the accumulated gradient `a + b`, from the two gradients'
    /// `shadows`, and the sum's shadow.
    pub(super) fn blame_of_sum(
        &self,
        (a, b): (&Tensor, &Tensor),
        (sa, sb): (&Tensor, &Tensor),
        sum: &Tensor,
    ) -> Result<(Option<Blame>, Option<Tensor>)> {
        let exact = add_f64(&widen(a)?, &widen(b)?)?;
        let shadow = add_f64(sa, sb)?;
        let input = relative_error(a, sa)?.max(relative_error(b, sb)?);
        Ok((Some(blame(sum, &exact, &shadow, input)?), Some(shadow)))
    }
}
