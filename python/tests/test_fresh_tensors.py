"""Tensors the mode never sees made (`torch.tensor`'s values, which only `lift_fresh` then
reads) can have their values where a freed op output's were, under the same key: each must
be recorded as what it holds, not as that freed output."""

import json

import torch

import amprobe_torch
from test_watch import close_all


def records(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def lift_fresh_ops(recs):
    return [(r["step"], o) for r in recs if r["type"] == "step" and r["ops"] for o in r["ops"]
            if o["op"] == "lift_fresh"]


def test_a_fresh_tensor_where_a_freed_output_was_records_its_own_value(tmp_path):
    path = tmp_path / "t.jsonl"
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amprobe_torch.watch(model, opt, trace=str(path), sample_every=1)
    freed, fresh = set(), []
    try:
        for _ in range(3):
            loss = model(torch.randn(8, 4)).pow(2).mean()
            for _ in range(16):
                # A recorded op's 0-d output, freed, then a fresh 0-d tensor of the same
                # dtype: the allocator hands it the memory just freed.
                s = loss.detach() * 3.0 + 1.0
                freed.add(s.data_ptr())
                del s
                fresh.append(torch.tensor(0.0))
            loss.backward()
            opt.step()
            opt.zero_grad()
    finally:
        close_all()
    assert any(z.data_ptr() in freed for z in fresh), "no fresh tensor took a freed output's memory"
    lifted = lift_fresh_ops(records(path))
    assert len(lifted) == 3 * 16
    for step, op in lifted:
        assert (op["stats"]["max_abs"], op["stats"]["zeros"], op["stats"]["numel"]) == (0.0, 1, 1), (step, op)


def train_adamw(seed, path=None):
    """A few bf16-autocast steps of AdamW (its step counters: `torch.tensor(0.)` each),
    watched where `path` is given: (losses, final parameters)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if path is not None:
        amprobe_torch.watch(model, opt, trace=str(path), sample_every=1)
    losses = []
    try:
        for _ in range(3):
            x, y = torch.randn(4, 8), torch.randn(4, 1)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
            loss = torch.nn.functional.mse_loss(out.float(), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
    finally:
        close_all()
    return losses, [p.detach().clone() for p in model.parameters()]


def test_adamw_step_counters_are_recorded_as_zero_under_bf16_autocast(tmp_path):
    # Where a counter's memory lands differs from run to run: several trainings, each
    # held bitwise to the same one unwatched.
    for seed in range(12):
        path = tmp_path / f"t{seed}.jsonl"
        plain = train_adamw(seed)
        seen = train_adamw(seed, path)
        assert all(torch.equal(a, b) for a, b in zip(plain[0], seen[0])), seed
        assert all(torch.equal(a, b) for a, b in zip(plain[1], seen[1])), seed
        lifted = lift_fresh_ops(records(path))
        # One counter per parameter, made at the first update.
        assert [(s, o["phase"]) for s, o in lifted] == [(0, "optimizer")] * 4, seed
        for _, op in lifted:
            assert op["stats"]["max_abs"] == 0.0 and op["stats"]["zeros"] == 1, (seed, op)
