"""The statistics' layout and the facts about dtypes and ops they rest on: the fields of a
full vector, the exponent histogram's bins, each dtype's limits, and the op sets the recorder
reads (random, allocating, finite-preserving, value-copying)."""

from __future__ import annotations

import torch

# Exponent histogram bins: floor(log2 |x|) from EXP_LO to EXP_HI - 1. fp32's subnormals
# reach 2^-149 and its largest values 2^127; f64 values outside are counted in the end bins.
EXP_LO, EXP_HI = -150, 128
N_BINS = EXP_HI - EXP_LO

# Layout of a full vector: these fields, then N_BINS histogram counts.
FIELDS = (
    "numel",
    "nan",
    "pos_inf",
    "neg_inf",
    "zeros",
    "subnormal",
    "max_abs",
    "min_abs_nonzero",
    "sum_sq",
    "f16_over",
    "f16_under",
    "bf16_over",
    "bf16_under",
)
FULL_LEN = len(FIELDS) + N_BINS
CHECK_LEN = 4

# The smallest normal magnitude of each dtype: nonzero values below it are subnormal.
NORMAL_MIN = {
    torch.float16: 2.0**-14,
    torch.bfloat16: 2.0**-126,
    torch.float32: 2.0**-126,
    torch.float64: 2.0**-1022,
}
F16_OVERFLOW = 65520.0
F16_UNDERFLOW = 2.0**-25
BF16_OVERFLOW = (2.0 - 2.0**-8) * 2.0**127
BF16_UNDERFLOW = 2.0**-134

DTYPE_NAMES = {
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
    torch.float64: "float64",
    torch.int64: "int64",
}


FLOATING = frozenset(NORMAL_MIN)

# The largest finite value of each dtype: a conversion to a dtype that reaches as far as
# the source cannot overflow.
RANGE = {
    torch.float16: 65504.0,
    torch.bfloat16: BF16_OVERFLOW,
    torch.float32: 3.4028234663852886e38,
    torch.float64: 1.7976931348623157e308,
}

# Ops that draw random values: data, like the batch (a script that makes its batch with
# them inside the step), never constants of the model.
RANDOM = frozenset(
    """
    rand rand_like randn randn_like randint randint_like randperm normal normal_ uniform_
    bernoulli bernoulli_ multinomial exponential_ geometric_ log_normal_ cauchy_ random_
    """.split()
)

# Ops that only allocate: their output holds whatever the memory held.
ALLOCATING = frozenset("empty empty_like empty_strided new_empty new_empty_strided".split())

# Ops whose floating outputs are finite whenever their floating inputs and scalars are
# finite and the output's dtype reaches as far as every input's: they move, select,
# compare, clamp or normalise values, or convert them to a dtype at least as wide; none
# multiplies, adds or divides values of its own. (Not as_strided: it may read storage
# outside its input's view.)
FINITE_PRESERVING = frozenset(
    """
    _to_copy copy_ clone contiguous expand view _unsafe_view reshape t transpose permute
    squeeze unsqueeze slice select split split_with_sizes chunk unbind alias
    detach cat stack index_select gather embedding index where masked_fill fill fill_
    zeros zeros_like ones ones_like full full_like new_zeros new_ones new_full
    relu threshold_backward clamp clamp_min clamp_max maximum minimum max min amax amin
    abs neg sign softmax _softmax _safe_softmax
    """.split()
)


# Ops whose output holds exactly its one input's values, in the same order or not (with the
# output's dtype, equal numel, and the input's dtype the same or bf16 to f32): the output's
# statistics are the input's.
VALUE_COPIES = frozenset(
    """
    _to_copy clone contiguous alias detach view _unsafe_view reshape t transpose permute squeeze
    unsqueeze flatten _reshape_alias
    """.split()
)
