"""The statistics on their own: the check, the full statistics on the host's bit paths and
the general path, the device path run on the CPU, and the parameters' figures, against
computations by PyTorch itself (no training)."""

import pytest
import torch

from amprobe_torch import _host_stats, _stats


def test_statistics_match_a_host_computation():
    x = torch.tensor(
        [0.0, -0.0, 1.0, -3.5, 65504.0, 2.0**-20, float("inf"), float("-inf"), float("nan"), 7e-8],
        dtype=torch.float16,
    )
    st = _stats.from_full(_stats.full(x))
    assert (st["numel"], st["nan"], st["pos_inf"], st["neg_inf"], st["zeros"]) == (10, 1, 1, 1, 2)
    # fp16 subnormals: |x| < 2^-14, nonzero: 2^-20 and 7e-8 (which fp16 holds as 2^-24·1).
    assert st["subnormal"] == 2
    assert st["max_abs"] == 65504.0 and st["min_abs_nonzero"] == 2.0**-24
    want = sum(float(v) ** 2 for v in x.float().tolist() if abs(v) != float("inf") and v == v)
    # Σx² accumulates in f32 on the CPU (torch's cascade summation).
    assert st["sum_sq"] == pytest.approx(want, rel=1e-6)
    # floor(log2 |x|): -24, -20, 0, 1, 15.
    h = st["exp_hist"]
    assert h["lo"] == -24 and len(h["counts"]) == 15 - (-24) + 1
    assert {h["lo"] + i: c for i, c in enumerate(h["counts"]) if c} == {-24: 1, -20: 1, 0: 1, 1: 1, 15: 1}
    # 65504 and 2^-24 are fp16 values: rounding to fp16 keeps them.
    assert st["to_f16"] == {"overflow": 0, "underflow": 0}
    y = torch.tensor([65520.0, 65519.0, 2.0**-25, 2.0**-24, 1e-40], dtype=torch.float32)
    st = _stats.from_full(_stats.full(y))
    # 65520 rounds to inf in fp16, 65519 to 65504; 2^-25 (a tie) and 1e-40 to zero.
    assert st["to_f16"] == {"overflow": 1, "underflow": 2}
    assert st["subnormal"] == 1 and st["to_bf16"] == {"overflow": 0, "underflow": 0}


def test_the_check_counts_exactly_whatever_its_shortcut():
    inf, nan = float("inf"), float("nan")
    cases = [
        ([1.0, -2.0, 3.0], (3, 0, 0, 0)),
        ([1.0, nan, inf, -inf, inf], (5, 1, 2, 1)),
        ([inf, -inf], (2, 0, 1, 1)),
        # Finite values whose f32 sum overflows: counted, and found clean.
        ([3e38, 3e38, 3e38], (3, 0, 0, 0)),
    ]
    for values, want in cases:
        for dtype in (torch.float32, torch.float64):
            got = tuple(int(v) for v in _stats.check(torch.tensor(values, dtype=dtype)))
            assert got == want, (values, dtype)
    assert tuple(_stats.check(torch.tensor([1.0, inf], dtype=torch.bfloat16))) == (2, 0, 1, 0)
    # fp16 decides by its extremes: one NaN or infinity anywhere in a long tensor is found.
    half = torch.float16
    for values, want in cases[:3] + [([65504.0, -65504.0, 1.0], (3, 0, 0, 0))]:
        assert tuple(int(v) for v in _stats.check(torch.tensor(values, dtype=half))) == want, values
    for at in (0, 17, 999):
        for bad, want in ((nan, (1000, 1, 0, 0)), (-inf, (1000, 0, 0, 1)), (inf, (1000, 0, 1, 0))):
            x = torch.ones(1000, dtype=half)
            x[at] = bad
            assert tuple(int(v) for v in _stats.check(x)) == want, (at, bad)
    assert tuple(_stats.check(torch.ones(0, dtype=half))) == (0, 0, 0, 0)
    assert tuple(int(v) for v in _stats.check(torch.ones(64, 64, dtype=half).t())) == (4096, 0, 0, 0)


def test_a_device_check_is_read_back_with_the_step_and_counts_as_the_host_does():
    # The device's check (no synchronisation: counts stay tensors until `gather`) run on
    # the CPU, gathered beside host checks and full vectors, in their order.
    inf, nan = float("inf"), float("nan")
    tensors = [
        torch.tensor([1.0, nan, inf, -inf, inf, nan, nan]),
        torch.tensor([0.5, -0.25], dtype=torch.float16),
        torch.tensor([[inf, 1.0], [2.0, -inf]], dtype=torch.bfloat16).t(),
        torch.empty(0),
    ]
    vecs = []
    for t in tensors:
        vecs.append(_stats.device_check(t))
        vecs.append(_stats.check(t))
    vecs.append(_stats._full_device(tensors[0]))
    got = _stats.gather(vecs)
    assert isinstance(vecs[0], _stats.DeviceCheck) and isinstance(vecs[0][1], torch.Tensor)
    for i, want in enumerate([(7, 3, 2, 1), (2, 0, 0, 0), (4, 0, 1, 1), (0, 0, 0, 0)]):
        assert tuple(got[2 * i]) == want and tuple(got[2 * i + 1]) == want, (i, got[2 * i])
    assert got[-1] == list(_host_stats.full_host(tensors[0]))


@pytest.mark.parametrize("device_path,bit_count", [(False, True), (False, False), (True, True)])
def test_parameter_figures_are_the_same_with_or_without_the_shortcut(monkeypatch, device_path, bit_count):
    # The device path (multi-tensor norms of every gradient) runs here on the CPU; the host
    # path counts the values it keeps by their bits, or (where a torch's kernel would write
    # -0) as floats.
    from amprobe_torch import _params
    from amprobe_torch._params import begin_param_vectors, param_vector, param_vectors

    monkeypatch.setattr(_stats, "DEVICE_PATH_ON_CPU", device_path)
    assert _params._plain_zeros(torch.float32) and _params._plain_zeros(torch.float64)
    if not bit_count:
        monkeypatch.setattr(_params, "_plain_zeros", lambda dtype: False)

    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(1000))
    g = torch.randn(1000) * 1e-3
    g[::7] = 0.0
    g[::11] = 2.0**-27  # flushed by fp16 unscaled; not once scaled by 2^16
    g[5] = -3.0
    p.grad = g
    clean = torch.nn.Parameter(torch.randn(50))  # no zeros, nothing small: no count read
    clean.grad = torch.randn(50).sign() * (1.0 + torch.rand(50))
    bad = torch.nn.Parameter(torch.randn(20))  # non-finite: the general path
    bad.grad = torch.randn(20)
    bad.grad[3] = float("inf")
    bad.grad[4] = float("nan")
    none = torch.nn.Parameter(torch.randn(3))  # no gradient
    # Past the multi-tensor size: reduced one by one.
    big = torch.nn.Parameter(torch.randn(10000))
    big.grad = torch.randn(10000) * 1e-3
    big.grad[::5] = 0.0
    big.grad[::13] = 2.0**-27
    big.grad[1::17] = -0.0
    big.grad[2::19] = -(2.0**-27)
    # Zeros, none of them -0: counted by their bits.
    big_plus = torch.nn.Parameter(torch.randn(10000))
    big_plus.grad = torch.randn(10000) * 1e-3
    big_plus.grad[::3] = 0.0
    big_plus.grad[1::29] = -(2.0**-26)
    big_clean = torch.nn.Parameter(torch.randn(10000))
    big_clean.grad = torch.randn(10000).sign() * (1.0 + torch.rand(10000))
    tiny = torch.nn.Parameter(torch.randn(10000))  # squares vanish in f32: scaled norm
    tiny.grad = torch.randn(10000) * 1e-30
    # At and beside each threshold: 2^-25 unscaled, 2^-25 / scale scaled.
    edge = torch.nn.Parameter(torch.randn(9000))
    edge.grad = torch.randn(9000)
    for k, t in enumerate((2.0**-25, 2.0**-41, 2.0**-24, 2.0**-26)):
        t = torch.tensor(t)
        for j, v in enumerate((t, torch.nextafter(t, torch.tensor(0.0)), torch.nextafter(t, torch.tensor(1.0)))):
            edge.grad[100 * k + j::1000] = v * (-1) ** j
    wide = torch.nn.Parameter(torch.randn(9000, dtype=torch.float64))  # f64: the scaled copy
    wide.grad = edge.grad.double() * (1 + 2.0**-40)
    # No zeros, its smallest |g| at the threshold: the shortcut that skips the counts must not.
    at_bound = torch.nn.Parameter(torch.randn(300))
    at_bound.grad = torch.randn(300).sign() * (1.0 + torch.rand(300))
    at_bound.grad[7] = -(2.0**-25)
    params = [p, clean, bad, none, big, big_plus, big_clean, tiny, edge, wide, at_bound]
    for scale in (1.0, 65536.0, 0.5, 3.0):
        fast = param_vectors(params, scale)
        # Begun with the flush counts of every parameter before the read back, as for those
        # that needed them the step before, with the scale as the scaler holds it (unread),
        # and no guess of it, the right one, or a wrong one (the script set another).
        begun = []
        for kind in ("counts", "general"):
            for guess in (None, scale, scale * 2.0):
                counted = {id(q): kind for q in params}
                pending = begin_param_vectors(params, torch.tensor(scale), counted=counted, guess=guess)
                begun.append(pending.finish(_stats.gather(pending.parts), scale))
        for q, *figures in zip(params, fast, *begun):
            slow = param_vector(q, scale).tolist()
            for f in figures:
                f = list(f) if isinstance(f, list) else f.tolist()
                assert f[0] == slow[0] and f[2:] == slow[2:], (scale, q.numel())
                # Σg² accumulates in f32 on the shortcut (torch's cascade summation), in f64 off it.
                assert f[1] == pytest.approx(slow[1], rel=1e-6)
        if device_path:
            # Those whose rows did not settle their figures: zeros, values at the bound, a
            # non-finite gradient; not the clean ones.
            assert id(clean) not in pending.counted and id(big_clean) not in pending.counted
            assert all(pending.counted[id(q)] == "counts" for q in (p, big, edge, at_bound))
            assert all(pending.counted[id(q)] == "general" for q in (bad, tiny))
    v = param_vectors([p], 65536.0)[0]
    assert v[4] > 0 and v[5] == 0 and v[2] == 3.0
    b = param_vectors([bad], 1.0)[0]
    assert b[7] == 2 and b[6] == 18


def test_the_cpu_statistics_are_the_general_paths():
    # The CPU path reads counts from the values' bits and skips what the exponent histogram
    # rules out; on random tensors with every kind of special value, in every dtype, it
    # must give the figures of the general path (each figure by its own reduction).
    import random

    rng = random.Random(0)
    torch.manual_seed(0)
    specials = [0.0, float("inf"), float("nan"), 65504.0, 65520.0, 65519.0, 2.0**-25, 2.0**-24, 2.0**-134,
                1e-40, 3.39e38, 3.3961e38, 3.4e38, 2.0**-149, 1e-300, 1e300, 5e-324]
    for _ in range(300):
        dt = rng.choice([torch.float16, torch.bfloat16, torch.float32, torch.float64])
        n = rng.choice([0, 1, 2, 5, 17, 100, 1000])
        x = torch.randn(n, dtype=torch.float64) * 10.0 ** rng.uniform(-45, 40)
        for i in range(n):
            if rng.random() < 0.15:
                x[i] = rng.choice(specials) * rng.choice([1, -1])
        _same_full(x.to(dt), (dt, n))


def _same_full(x, tag):
    fast, general = _host_stats.full_host(x), _stats._full_device(x).tolist()
    for k, (a, b) in enumerate(zip(fast, general)):
        if k == _stats.FIELDS.index("sum_sq"):
            assert a == pytest.approx(b, rel=1e-6), (tag, k)
        else:
            assert a == b or (a != a and b != b), (tag, k, a, b)


def test_the_cpu_statistics_of_every_16_bit_value_and_of_f32_at_every_split():
    # fp16 and bf16 count each of the 32768 magnitudes: every bit pattern of both, whole,
    # transposed, and shuffled into tensors of mixed content. f32 reads its top 16 bits and
    # resolves the bins a threshold falls inside by a pass: values at and beside every
    # threshold, with random bits, subnormals (also those below 2^-133, all in the low
    # half), zeros and non-contiguous tensors.
    g = torch.Generator().manual_seed(0)
    for dt in (torch.float16, torch.bfloat16):
        every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dt)
        _same_full(every, dt)
        _same_full(every.view(256, 256).t(), (dt, "transposed"))
        for i, c in enumerate(every[torch.randperm(65536, generator=g)].split(4099)):
            _same_full(c, (dt, "shuffled", i))
        finite = every[every.isfinite()]
        for i, c in enumerate(finite[torch.randperm(finite.numel(), generator=g)].split(5000)):
            _same_full(c, (dt, "finite", i))
        _same_full(torch.zeros(5000, dtype=dt), (dt, "zeros"))
    splits = [p for p in _host_stats._bounds(torch.float32) if p is not None]
    splits += [0x7F800000, 0x00800000, 0x10000, 0x8000, 1, 0x477F0000, 0x7F7F0000, 0x33000000]
    near = [q | s for p in splits for q in range(p - 3, p + 4) if 0 <= q < 2**31 for s in (0, -(2**31))]
    near = torch.tensor(near, dtype=torch.int64).to(torch.int32)
    _same_full(near.view(torch.float32), "f32 splits")
    for i in range(120):
        r = torch.randint(-(2**31), 2**31, (5000,), generator=g, dtype=torch.int64).to(torch.int32)
        kind = i % 6
        if kind == 0:
            r &= 0x807FFFFF
        elif kind == 1:
            r &= 0x8000FFFF
        elif kind == 2:
            r[::3] = 0
        r[:50] = near[torch.randint(0, near.numel(), (50,), generator=g)]
        x = r.view(torch.float32)
        if kind == 3:
            x = torch.randn(5000, generator=g) * 10.0 ** (i % 60 - 30)
        elif kind == 4:
            x = torch.relu(torch.randn(100, 50, generator=g)).t()
        _same_full(x, ("f32", i))


@pytest.mark.parametrize("wide_below", [0, 1 << 40])
def test_the_f32_statistics_take_either_key_path(monkeypatch, wide_below):
    # Below _WIDE_KEYS_BELOW values the f32 path counts its shifted 32-bit magnitudes, above
    # the values' upper halves: each way, the general path's figures, at every threshold.
    monkeypatch.setattr(_host_stats, "_WIDE_KEYS_BELOW", wide_below)
    g = torch.Generator().manual_seed(4)
    splits = [p for p in _host_stats._bounds(torch.float32) if p is not None] + [0x7F800000, 0x00800000, 0x10000, 1]
    near = torch.tensor([q | s for p in splits for q in range(p - 2, p + 3) for s in (0, -(2**31))], dtype=torch.int64)
    near = near.to(torch.int32).view(torch.float32)
    for i in range(12):
        x = torch.randn(3000, generator=g) * 10.0 ** (i * 6 - 36)
        x[::5] = 0.0
        x[:near.numel()] = near
        _same_full(x[torch.randperm(3000, generator=g)], ("f32", wide_below, i))
    _same_full(torch.relu(torch.randn(70, 60, generator=g)).t(), ("f32", wide_below, "relu"))
    _same_full(torch.randn(70, 60, generator=g)[:, ::3], ("f32", wide_below, "gaps"))


def test_a_multi_tensor_ops_statistics_join_host_and_device_vectors(monkeypatch):
    # A multi-tensor op's outputs taken together: host vectors (tuples) joined in Python;
    # where one took the general path (a small f64 tensor), all of them as float64 vectors.
    # Either way the figures of every tensor through the general path, joined there.
    g = torch.Generator().manual_seed(5)
    a = torch.randn(5000, generator=g)
    b = torch.randn(3000, generator=g) * 1e3
    b[7] = float("inf")
    b[9] = 0.0
    c = (torch.randn(40, generator=g) * 1e-30).to(torch.float64)
    host, mixed = _stats.full_many([a, b]), _stats.full_many([a, b, c])
    assert type(host) is tuple and isinstance(mixed, torch.Tensor)
    got = _stats.gather([host, mixed])
    monkeypatch.setattr(_stats, "on_host", lambda x: False)
    want = _stats.gather([_stats.full_many([a, b]), _stats.full_many([a, b, c])])
    for x, y in zip(got, want):
        for k, (p, q) in enumerate(zip(x, y)):
            if k == _stats.FIELDS.index("sum_sq"):
                assert p == pytest.approx(q, rel=1e-6)
            else:
                assert p == q, (k, p, q)
    figures = dict(zip(_stats.FIELDS, got[1]))
    assert (figures["numel"], figures["pos_inf"], figures["zeros"]) == (8040, 1, 1)
    assert figures["min_abs_nonzero"] == float(c.abs().min())


def test_the_cpu_statistics_read_any_layout():
    # Dense tensors in any order of their dimensions (an offset into their storage too) are
    # read in memory order; others (gaps, broadcast dimensions) through their strides.
    g = torch.Generator().manual_seed(1)
    for dt in (torch.float16, torch.bfloat16, torch.float32):
        base = (torch.randn(6, 40, 70, generator=g) * 300.0).to(dt)
        base.view(-1)[::97] = 0.0
        base.view(-1)[5::389] = float("inf")
        for tag, x in [
            ("permuted", base.permute(2, 0, 1)),
            ("transposed", base.transpose(0, 1)),
            ("size-1 dims", base.unsqueeze(1).transpose(0, 2)),
            ("gaps", base[:, :, ::2]),
            ("offset", base[3:].transpose(1, 2)),
            ("broadcast", base[0].unsqueeze(0).expand(5, 40, 70)),
        ]:
            _same_full(x, (dt, tag))
            assert _host_stats._flat(x).numel() == x.numel()
            assert sorted(_host_stats._flat(x).reshape(-1).tolist()) == sorted(x.reshape(-1).tolist())
            assert (_host_stats._flat(x).dim() == 1) == (tag not in ("gaps", "broadcast")), tag


def test_a_records_exponent_histogram_is_its_occupied_bins():
    # The bins from the first to the last nonzero count, found from the counts' bytes:
    # against a loop over every bin, for counts whose low bytes are zero (1, 256, 2^16,
    # 2^40) and whose high bytes are not, at the histogram's ends and inside it.
    import random

    rng = random.Random(0)
    nf = len(_stats.FIELDS)
    for t in range(3000):
        hist = [0.0] * _stats.N_BINS
        for _ in range(rng.choice([0, 1, 2, 3, 30])):
            i = rng.choice([0, 1, _stats.N_BINS - 1, _stats.N_BINS - 2, rng.randrange(_stats.N_BINS)])
            hist[i] = float(rng.choice([1, 2, 255, 256, 65536, 2**40, 2**40 + 1, rng.randrange(1, 2**53)]))
        nonzero = [i for i, c in enumerate(hist) if c]
        want = (
            {"lo": _stats.EXP_LO + nonzero[0], "counts": [int(c) for c in hist[nonzero[0] : nonzero[-1] + 1]]}
            if nonzero
            else {"lo": 0, "counts": []}
        )
        assert _stats.from_full([1.0] * nf + hist)["exp_hist"] == want, (t, nonzero)


def test_a_batch_check_says_whether_a_nan_is_there_and_whether_an_inf_may_be():
    clean = [torch.ones(3), torch.zeros(0), torch.full((2, 2), 5.0)]
    inf = clean + [torch.tensor([1.0, float("inf")])]
    nan = clean + [torch.tensor([float("nan"), 1.0])]
    both = inf + nan
    got = [[float(c) for c in _stats.batch_check(ts)] for ts in (clean, inf, nan, both)]
    assert got == [[7, 0, 0, 0], [9, 0, 1, 0], [9, 1, 1, 0], [18, 1, 1, 0]]


@pytest.mark.parametrize("device_path", [False, True])
def test_a_sparse_gradients_figures_are_its_dense_equivalents(monkeypatch, device_path):
    from amprobe_torch._params import param_vector, param_vectors

    monkeypatch.setattr(_stats, "DEVICE_PATH_ON_CPU", device_path)
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(50, 4))
    # Uncoalesced, as an embedding's backward leaves it: row 3 twice (its values summed),
    # one value 2^-27 (flushed by fp16 unscaled), one an exact zero.
    idx = torch.tensor([[3, 7, 3, 9]])
    vals = torch.randn(4, 4) * 1e-3
    vals[1, 2] = 2.0**-27
    vals[3, 0] = 0.0
    p.grad = torch.sparse_coo_tensor(idx, vals, (50, 4), check_invariants=True)
    dense = torch.nn.Parameter(p.detach().clone())
    dense.grad = p.grad.to_dense()
    bad = torch.nn.Parameter(torch.randn(50, 4))
    v2 = vals.clone()
    v2[2, 1] = float("inf")
    bad.grad = torch.sparse_coo_tensor(idx, v2, (50, 4), check_invariants=True)
    bad_dense = torch.nn.Parameter(bad.detach().clone())
    bad_dense.grad = bad.grad.to_dense()
    for scale in (1.0, 65536.0):
        got = param_vectors([p, bad], scale)
        for sparse, d, f in zip((p, bad), (dense, bad_dense), got):
            want = param_vector(d, scale).tolist()
            f = list(f) if isinstance(f, list) else f.tolist()
            assert f == pytest.approx(want, rel=1e-12), (scale, sparse is bad)
            assert param_vector(sparse, scale).tolist() == pytest.approx(want, rel=1e-12)
