"""Steps checked by modules (the default after the first): the model's own ops only run, each
module's output, the script's own ops, the loss and the gradients are checked, and a failing
step is replayed under the capture. The replay must record what full statistics of the same
step record, and change nothing in the training."""

import pytest
import torch

import amprobe_torch
from amprobe_torch import _capture
from scripts import train
from test_watch import close_all, read, watcher


def steps_of(path):
    return [r for r in read(path) if r["type"] == "step"]


def _same(r, f):
    """The same op with the same figures: full statistics equal, or for an op of the
    script's own that was only checked, the counts of full statistics."""
    key = ("micro", "phase", "op", "module", "inputs", "output")
    if {k: r[k] for k in key} != {k: f[k] for k in key}:
        return False
    if r["stats"]["exp_hist"]["counts"]:
        return r["stats"] == f["stats"]
    return all(r["stats"][k] == f["stats"][k] for k in ("numel", "nan", "pos_inf", "neg_inf"))


def assert_replay_records_full_statistics(full_step, replayed_step):
    """The replayed step's ops are the fully recorded run's ops of the same step, in the
    same order, with the same figures, less those that accumulate gradients into `.grad`
    (a detach of the first, an add_ of the next: a replay keeps its gradients to itself);
    the origins are the same ops."""
    assert full_step["step"] == replayed_step["step"]
    full, replayed = full_step["ops"], replayed_step["ops"]
    at = {}  # index in the full run -> index in the replayed step
    i = 0
    for r in replayed:
        while i < len(full) and not _same(r, full[i]):
            f = full[i]
            assert f["op"] in ("detach", "add_") and f["phase"] == "backward", (
                "replayed", (r["index"], r["op"], r["module"]), "full", (f["index"], f["op"], f["module"]))
            i += 1
        assert i < len(full), ("not in the full run", r["index"], r["op"], r["module"])
        at[full[i]["index"]] = r["index"]
        i += 1
    assert all(f["op"] in ("detach", "add_") for f in full[i:])
    for k in ("first_inf", "first_nan"):
        a, b = full_step["origins"][k], replayed_step["origins"][k]
        assert (a is None) == (b is None), k
        if a is not None:
            assert {**a, "op_index": at[a["op_index"]]} == b, k
    assert [at[o["op_index"]] for o in full_step["origins"]["chain"]] == [
        o["op_index"] for o in replayed_step["origins"]["chain"]]
    # The model's ops came from the replay, with full statistics where the full run has
    # them (equal above).
    model = [r for r in replayed if r["module"] and r["phase"] != "optimizer"]
    assert len(model) > 10 and any(r["stats"]["exp_hist"]["counts"] for r in model)


def test_a_failing_step_is_replayed_as_full_statistics_record_it(tmp_path):
    full, fast = tmp_path / "full.jsonl", tmp_path / "fast.jsonl"
    train(torch.float16, steps=4, boom_step=2, watch=watcher(full, sample_every=1))
    close_all()
    train(torch.float16, steps=4, boom_step=2, watch=watcher(fast))
    close_all()
    a, b = steps_of(full), steps_of(fast)
    assert [s["ops"] is None for s in b] == [False, True, False, True]
    assert b[2]["skipped"] and b[2]["origins"]["first_inf"]["module"] == "embed"
    assert_replay_records_full_statistics(a[2], b[2])
    # Clean steps: same parameters' figures and losses, no op records.
    for x, y in zip(a, b):
        assert (x["loss"], x["scale_before"], x["scale_after"], x["params"]) == (
            y["loss"], y["scale_before"], y["scale_after"], y["params"])


class Noisy(torch.nn.Module):
    """Dropout and batch norm (random state and buffers a replay must restore), a block
    whose gain can overflow fp16, and a loss computed by the model itself."""

    def __init__(self, d=16, gain=1.0):
        super().__init__()
        self.inp = torch.nn.Linear(8, d)
        self.norm = torch.nn.BatchNorm1d(d)
        self.drop = torch.nn.Dropout(0.3)
        self.boom = torch.nn.Linear(d, d)
        self.out = torch.nn.Linear(d, 5)
        with torch.no_grad():
            self.boom.weight.mul_(gain)

    def forward(self, x, y, k=1.0):
        h = self.drop(torch.relu(self.norm(self.inp(x))))
        h = self.out(torch.tanh(self.boom(h * k)))
        return torch.nn.functional.cross_entropy(h.float(), y)


def train_noisy(dtype, steps=4, boom_step=2, watch=None, seed=0, micro=1):
    torch.manual_seed(seed)
    model = Noisy()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, enabled=dtype == torch.float16)
    if watch is not None:
        watch(model, opt, scaler)
    g = torch.Generator().manual_seed(seed + 1)
    xs = torch.randn(steps, micro, 12, 8, generator=g)
    ys = torch.randint(0, 5, (steps, micro, 12), generator=g)
    losses, scales = [], []
    for s in range(steps):
        opt.zero_grad(set_to_none=True)
        for m in range(micro):
            # The overflow is planted after the batch norm (its running statistics stay
            # finite) by a keyword argument the replay must pass again.
            k = 1.0e39 if s == boom_step and m == micro - 1 else 1.0
            with torch.autocast("cpu", dtype=dtype):
                loss = model(xs[s, m], ys[s, m], k=k) / micro
            scaler.scale(loss).backward()
            losses.append(loss.detach().clone())
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    state = {n: t.detach().clone() for n, t in model.state_dict().items()}
    state.update({"rng": torch.get_rng_state()})
    return losses, scales, state


def assert_same_bits(plain, seen):
    """Losses, scales and the final state (parameters, buffers, the generator) bitwise
    equal, NaN payloads included."""

    def bits(t):
        return t.view(torch.int16 if t.element_size() == 2 else torch.int32) if t.is_floating_point() else t

    for a, b in zip(plain[0], seen[0]):
        assert torch.equal(bits(a), bits(b))
    assert plain[1] == seen[1]
    for n in plain[2]:
        assert torch.equal(bits(plain[2][n]), bits(seen[2][n])), n


def against_full(tmp_path, train_fn, *args, check="modules", name="", make_watcher=None, **kw):
    """Runs `train_fn(*args, **kw)` three times: plain, watched with full statistics every
    step, and watched checking `check` (by default by modules); asserts the last trained
    bit for bit as the plain run did, and returns the steps of the full run's trace and of
    the checked one's (written to `full{name}.jsonl` and `fast{name}.jsonl` in `tmp_path`).
    `make_watcher(path, **options)` makes the watch hook (default: `watcher`), and
    `make_watcher(None)` the plain run's."""
    make = make_watcher or watcher
    plain = train_fn(*args, **kw) if make_watcher is None else train_fn(*args, watch=make_watcher(None), **kw)
    full, fast = tmp_path / f"full{name}.jsonl", tmp_path / f"fast{name}.jsonl"
    train_fn(*args, watch=make(full, sample_every=1), **kw)
    close_all()
    options = {} if check == "modules" else {"check": check}
    seen = train_fn(*args, watch=make(fast, **options), **kw)
    close_all()
    assert_same_bits(plain, seen)
    return steps_of(full), steps_of(fast)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("micro", [1, 2])
def test_a_replay_changes_nothing_and_records_what_full_statistics_record(tmp_path, dtype, micro):
    # Dropout draws from the generator and batch norm updates its running statistics: a
    # replay that did not restore them would change the training or its own records.
    a, b = against_full(tmp_path, train_noisy, dtype, micro=micro)
    assert b[2]["ops"] is not None and b[2]["origins"]["first_inf"] is not None
    assert b[2]["origins"]["first_inf"]["micro"] == micro - 1
    assert_replay_records_full_statistics(a[2], b[2])
    assert b[1]["ops"] is None
    # In fp16 the scaler skips the failing step; bf16 runs unscaled, and its NaN update
    # fails the next step too (replayed as well).
    assert (b[3]["ops"] is None) == (dtype == torch.float16)


def test_a_replay_keeps_a_frozen_batch_norm_in_eval_mode(tmp_path):
    # Fine-tuning with a frozen batch norm: the model trains, its norm runs in eval mode
    # (running statistics). A replay that set the whole model to train would normalise by
    # the batch instead and record other values.
    def freeze(path=None, sample_every=0):
        def w(model, opt, scaler):
            model.norm.eval()
            if path is not None:
                amprobe_torch.watch(model, opt, scaler, trace=str(path), sample_every=sample_every)

        return w

    a, b = against_full(tmp_path, train_noisy, torch.float16, make_watcher=freeze)
    assert b[2]["ops"] is not None and b[1]["ops"] is None
    assert_replay_records_full_statistics(a[2], b[2])


class Clamped(torch.nn.Module):
    """T5's fp16 guard: a block's output that overflows is clamped by its parent, so the
    loss and the gradients stay finite while a module made an infinity."""

    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 1)
        with torch.no_grad():
            self.up.weight.fill_(1.0)

    def forward(self, x):
        h = self.up(x)
        h = torch.clamp(h, -60000.0, 60000.0)
        return self.head(h * 1.0e-3)


def test_a_module_output_that_the_model_clamps_back_is_still_found(tmp_path):
    torch.manual_seed(0)
    model = Clamped()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    path = tmp_path / "t.jsonl"
    amprobe_torch.watch(model, opt, None, trace=str(path))
    for scale in (1.0, 1.0, 3.0e4, 1.0):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.ones(2, 4) * scale).float().sum()
        loss.backward()
        assert loss.isfinite()
        opt.step()
    close_all()
    s = steps_of(path)
    assert [x["ops"] is None for x in s] == [False, True, False, True]
    o = s[2]["origins"]["first_inf"]
    assert (o["module"], o["op"], o["phase"]) == ("up", "addmm", "forward")


def test_gradients_that_overflow_without_a_scaler_replay_before_the_update(tmp_path):
    # fp16 without a GradScaler: the forward is finite, the backward overflows; the step is
    # replayed where the optimizer is called, before it writes the non-finite update.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    path = tmp_path / "t.jsonl"
    amprobe_torch.watch(model, opt, None, trace=str(path))
    for weight in (1.0, 1.0, 1.0e9, 1.0):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(torch.ones(3, 4))
        (out.float().sum() * weight).backward()
        opt.step()
    close_all()
    s = steps_of(path)
    assert [x["ops"] is None for x in s][:3] == [False, True, False]
    o = s[2]["origins"]["first_inf"]
    # The script's own loss casts its gradient back to fp16 (the backward of `.float()`).
    assert (o["phase"], o["module"], o["op"]) == ("backward", "", "_to_copy"), o
    # The replay ran before the update: the model's backward saw the parameters of the
    # forward, and its gradients went non-finite with the one that entered it.
    mm = [r for r in s[2]["ops"] if r["phase"] == "backward" and r["module"] and r["op"] == "mm"]
    assert mm and all(r["stats"]["pos_inf"] + r["stats"]["neg_inf"] + r["stats"]["nan"] for r in mm)
    assert all(p["nonfinite"] for p in s[2]["params"])


def test_a_step_the_capture_cannot_replay_says_so_and_later_steps_check_every_op(tmp_path, monkeypatch):
    monkeypatch.setattr(_capture, "MAX_CALLS", 0)
    path = tmp_path / "t.jsonl"
    train(torch.float16, steps=5, boom_step=2, watch=watcher(path))
    close_all()
    s = steps_of(path)
    assert s[2]["ops"] is not None and s[2]["skipped"]
    assert any("could not be replayed" in e for e in s[2]["events"])
    assert all(r["module"] == "" for r in s[2]["ops"] if r["phase"] != "optimizer")
    assert s[2]["origins"]["first_inf"] is None


def test_a_check_mode_that_is_not_one_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("AMPROBE_CHECK", "sometimes")
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="AMPROBE_CHECK"):
        amprobe_torch.watch(model, torch.optim.SGD(model.parameters(), lr=0.1), None, trace=str(tmp_path / "t"))


class Checkpointed(torch.nn.Module):
    """Blocks under activation checkpointing (recomputed in the backward, where their
    module hooks run again), reentrant or not."""

    def __init__(self, reentrant):
        super().__init__()
        self.inp = torch.nn.Linear(8, 8)
        self.blocks = torch.nn.ModuleList(
            [torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)) for _ in range(3)]
        )
        self.head = torch.nn.Linear(8, 4)
        self.reentrant = reentrant

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        x = self.inp(x)
        for b in self.blocks:
            x = x + checkpoint(b, x, use_reentrant=self.reentrant)
        return self.head(x)


def train_checkpointed(reentrant, watch):
    torch.manual_seed(0)
    model = Checkpointed(reentrant)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    watch(model, opt, scaler)
    xs = torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(1))
    for s in range(4):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(xs[s] * (1e5 if s == 2 else 1.0)).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_blocks_keep_the_capture_and_their_failing_step_is_found(tmp_path, reentrant):
    # A checkpointed block's forward runs again inside the backward, with its module hooks:
    # that call must not resume the mode the backward paused (the engine drops it when the
    # node ends, and no op of any later step was seen). The failing step is found and
    # named as checking every op names it, and the steps after it are checked as before.
    # Reentrant checkpointing refuses the replay's `autograd.grad`: the replayed forward
    # names the origin, the step says its backward was not replayed, and the steps after
    # it check every op.
    fast, ops = tmp_path / "fast.jsonl", tmp_path / "ops.jsonl"
    train_checkpointed(reentrant, watcher(fast))
    close_all()
    train_checkpointed(reentrant, watcher(ops, check="ops"))
    close_all()
    a, b = steps_of(fast), steps_of(ops)
    assert [s["skipped"] for s in a] == [s["skipped"] for s in b] == [False, False, True, False]
    name = lambda o: None if o is None else (o["phase"], o["op"], o["module"])  # noqa: E731
    for k in ("first_inf", "first_nan"):
        assert name(a[2]["origins"][k]) == name(b[2]["origins"][k]), k
    assert name(a[2]["origins"]["first_inf"]) == ("forward", "_to_copy", "inp")
    assert a[1]["op_count"] > 0
    if reentrant:
        assert len(a[2]["events"]) == 1 and "backward could not be replayed" in a[2]["events"][0], a[2]["events"]
        assert a[3]["op_count"] == b[3]["op_count"] > a[1]["op_count"]
    else:
        assert a[2]["events"] == [] and a[3]["op_count"] == a[1]["op_count"]


class _GradTimes(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, k):
        ctx.k = k
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.k, None


class Boost(torch.nn.Module):
    """Multiplies by `k` twice (k = 1e20 overflows fp16 and bf16 alike), and its gradient
    by `kg`; the script sets them where it plants an overflow."""

    def __init__(self):
        super().__init__()
        self.k = 1.0
        self.kg = 1.0

    def forward(self, x):
        return _GradTimes.apply(x * self.k * self.k, self.kg)


class Split(torch.nn.Module):
    """A model the script calls part by part: an encoder, then a head on its output (two
    outermost calls a step, the second reading what the first made)."""

    def __init__(self):
        super().__init__()
        self.encoder = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), Boost(), torch.nn.Linear(16, 16))
        self.head = torch.nn.Linear(16, 5)


def train_split(dtype, steps=4, boom_step=2, watch=None, seed=0):
    torch.manual_seed(seed)
    model = Split()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, enabled=dtype == torch.float16)
    if watch is not None:
        watch(model, opt, scaler)
    g = torch.Generator().manual_seed(seed + 1)
    xs = torch.randn(steps, 12, 8, generator=g)
    ys = torch.randint(0, 5, (steps, 12), generator=g)
    losses, scales = [], []
    for s in range(steps):
        opt.zero_grad(set_to_none=True)
        # fp16: the gradient the loss sends back overflows in the backward (the scaler
        # skips the step); bf16: the encoder's forward overflows.
        boom = s == boom_step
        model.encoder[2].k = 1.0e20 if boom and dtype == torch.bfloat16 else 1.0
        with torch.autocast("cpu", dtype=dtype):
            h = model.encoder(xs[s])
            logits = model.head(h)
        loss = torch.nn.functional.cross_entropy(logits.float(), ys[s])
        scaler.scale(loss * (1.0e4 if boom and dtype == torch.float16 else 1.0)).backward()
        losses.append(loss.detach().clone())
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    state = {n: t.detach().clone() for n, t in model.state_dict().items()}
    return losses, scales, state


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_call_that_reads_another_calls_output_is_replayed_from_what_it_received(tmp_path, dtype):
    # The head's input is the encoder call's output: replayed as it ran, its backward would
    # go back into the first run's graph of the encoder, already freed.
    a, b = against_full(tmp_path, train_split, dtype)
    assert b[1]["ops"] is None and b[2]["ops"] is not None
    first = b[2]["origins"]["first_inf"]
    assert first is not None
    if dtype == torch.float16:
        assert first["phase"] == "backward"
    else:
        assert (first["phase"], first["op"], first["module"]) == ("forward", "mul", "encoder.2")
    assert b[2]["events"] == [], b[2]["events"]
    assert_replay_records_full_statistics(a[2], b[2])


def train_gan(dtype, steps=4, plant=None, d_every=1, watch=None, seed=0):
    """A GAN: each step the discriminator's loss, backward and update (every `d_every`-th
    step), then the generator's through the discriminator as that update left it; one
    scaler over both in fp16, none in bf16. `plant` = (step, where): "g-forward" makes the
    discriminator's forward overflow in the generator's part, "d-backward" the
    discriminator's backward in its own part (a gradient inside the model, which only a
    replay would see in a step checked by modules)."""
    torch.manual_seed(seed)
    gen = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    disc = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), Boost(), torch.nn.Linear(32, 1))
    og = torch.optim.Adam(gen.parameters(), lr=1e-3)
    od = torch.optim.Adam(disc.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, enabled=dtype == torch.float16)
    if watch is not None:
        watch({"G": gen, "D": disc}, [od, og], scaler)
    g = torch.Generator().manual_seed(seed + 1)
    zs = torch.randn(steps, 16, 8, generator=g)
    reals = torch.randn(steps, 16, 16, generator=g)
    bce = torch.nn.BCEWithLogitsLoss()
    ones, zeros = torch.ones(16, 1), torch.zeros(16, 1)
    losses, scales = [], []
    for s in range(steps):
        where = plant[1] if plant is not None and plant[0] == s else None
        disc[2].kg = 1.0e20 if where == "d-backward" else 1.0
        with torch.autocast("cpu", dtype=dtype):
            fake = gen(zs[s])
            ld = bce(disc(reals[s]), ones) + bce(disc(fake.detach()), zeros)
        if s % d_every == d_every - 1:
            od.zero_grad(set_to_none=True)
            scaler.scale(ld).backward()
            scaler.step(od)
        # (reset after the discriminator's part, which a replay runs again before its
        # update: it must overflow there as it did)
        disc[2].kg = 1.0
        disc[2].k = 1.0e20 if where == "g-forward" else 1.0
        with torch.autocast("cpu", dtype=dtype):
            lg = bce(disc(fake), ones)
        og.zero_grad(set_to_none=True)
        scaler.scale(lg).backward()
        scaler.step(og)
        scaler.update()
        disc[2].k = 1.0
        losses += [ld.detach().clone(), lg.detach().clone()]
        scales.append(scaler.get_scale())
    state = {f"G.{n}": t.detach().clone() for n, t in gen.state_dict().items()}
    state.update({f"D.{n}": t.detach().clone() for n, t in disc.state_dict().items()})
    return losses, scales, state


def _origin(step, kind="first_inf"):
    o = step["origins"][kind]
    return None if o is None else (o["phase"], o["op"], o["module"], o["op_index"])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_gan_is_two_models_and_two_optimizers_in_one_step(tmp_path, dtype):
    # The generator's part runs on the discriminator its update just changed: a replay of
    # all the step's calls at its end would not run them as they ran. Each update ends a
    # segment of calls, decided (and replayed, if it failed) before the update changes
    # anything: a step that updates twice is still checked by modules, and finds what full
    # statistics find. (It was checked op by op, and every step after it.)
    a, b = against_full(tmp_path, train_gan, dtype, plant=(2, "g-forward"))
    header = read(tmp_path / "fast.jsonl")[0]
    assert (header["model"], header["optimizer"]["kind"]) == ("Sequential + Sequential", "Adam + Adam")
    assert [s["step"] for s in b] == [0, 1, 2, 3]
    assert [s["ops"] is None for s in b[:3]] == [False, True, False]
    # Checked by modules: the model's own ops only run.
    assert b[1]["op_count"] < a[1]["op_count"]
    if dtype == torch.float16:
        # (in bf16, with no scaler to skip it, the failing step's update made the next
        # step's values NaN: it fails too, and is replayed)
        assert b[3]["ops"] is None and b[3]["op_count"] < a[3]["op_count"]
    first = _origin(b[2])
    assert first[:3] == ("forward", "mul", "D.2") == _origin(a[2])[:3]
    # The generator's part, replayed, comes after the discriminator's update.
    ops = b[2]["ops"]
    assert any(r["phase"] == "optimizer" and r["index"] < first[3] for r in ops)
    assert b[2]["events"] == []


def test_a_failure_before_a_second_update_is_found_by_replaying_its_segment(tmp_path):
    # The discriminator steps only every other step. A failure in the generator's part,
    # after the discriminator's update, and one in the discriminator's backward before it
    # (only a replay sees it: the scaler skips the discriminator's update, and its segment
    # replays before the generator's part runs) are both found where full statistics find
    # them; the step said its origin was not known, and every later step was checked op
    # by op.
    a, b = against_full(tmp_path, train_gan, torch.float16, plant=(1, "g-forward"), d_every=2)
    assert b[1]["op_count"] < a[1]["op_count"]
    # (op indices differ: the part checked by modules counted only the ops it saw)
    assert _origin(b[1])[:3] == _origin(a[1])[:3] == ("forward", "mul", "D.2")
    assert b[3]["op_count"] < a[3]["op_count"]
    a, b = against_full(tmp_path, train_gan, torch.float16, plant=(1, "d-backward"), d_every=2, name="2")
    assert b[1]["skipped"] and b[1]["events"] == []
    assert _origin(b[1])[:3] == _origin(a[1])[:3] == ("backward", "mul", "D.2")
    assert b[2]["op_count"] < a[2]["op_count"]
    # The same failure two steps later is found where it was made.
    fast = tmp_path / "fast3.jsonl"
    train_gan(torch.float16, plant=(3, "d-backward"), d_every=2, watch=watcher(fast))
    close_all()
    b = steps_of(fast)
    assert b[3]["skipped"] and _origin(b[3])[:3] == ("backward", "mul", "D.2")


class SAM(torch.optim.Optimizer):
    """Sharpness-aware minimisation: the step climbs to the worst point near the
    parameters, has the closure compute the loss and gradients there, comes back and takes
    SGD's step with those gradients."""

    def __init__(self, params, lr, rho=0.05):
        super().__init__(params, {"lr": lr, "rho": rho})
        self.base = torch.optim.SGD(self.param_groups, lr=lr)

    @torch.no_grad()
    def step(self, closure):
        ps = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.stack([p.grad.norm() for p in ps]).norm()
        for p in ps:
            e = p.grad * (self.param_groups[0]["rho"] / (norm + 1e-12))
            p.add_(e)
            self.state[p]["e"] = e
        with torch.enable_grad():
            closure()
        for p in ps:
            p.sub_(self.state[p]["e"])
        self.base.step()


def train_sam(dtype, steps=4, boom_step=2, watch=None, seed=0):
    torch.manual_seed(seed)
    model = Split()
    opt = SAM(model.parameters(), lr=0.1)
    if watch is not None:
        watch(model, opt, None)
    g = torch.Generator().manual_seed(seed + 1)
    xs = torch.randn(steps, 12, 8, generator=g)
    ys = torch.randint(0, 5, (steps, 12), generator=g)
    losses = []
    for s in range(steps):

        def closure(planted=False):
            opt.zero_grad(set_to_none=True)
            model.encoder[2].k = 1.0e20 if planted else 1.0
            with torch.autocast("cpu", dtype=dtype):
                logits = model.head(model.encoder(xs[s]))
            model.encoder[2].k = 1.0
            loss = torch.nn.functional.cross_entropy(logits.float(), ys[s])
            loss.backward()
            losses.append(loss.detach().clone())
            return loss

        closure()
        # The overflow is planted in the forward the optimizer's step asks for.
        opt.step(lambda: closure(planted=s == boom_step))
    state = {n: t.detach().clone() for n, t in model.state_dict().items()}
    return losses, [], state


def train_closure(dtype, steps=4, boom_step=2, watch=None, seed=0, lights=None):
    """torch's SGD with a closure it evaluates first (the forward and backward as
    Lightning's automatic optimization runs them); `lights` gets, at each forward of the
    watched run, whether its step is checked by modules."""
    torch.manual_seed(seed)
    model = Split()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if watch is not None:
        w = watch(model, opt, None)
        lights.clear()
        model.encoder.register_forward_hook(lambda *_: w.st.replaying or lights.append(w.st.light))
    g = torch.Generator().manual_seed(seed + 1)
    xs = torch.randn(steps, 12, 8, generator=g)
    ys = torch.randint(0, 5, (steps, 12), generator=g)
    losses = []
    for s in range(steps):

        def closure():
            opt.zero_grad()
            model.encoder[2].k = 1.0e20 if s == boom_step else 1.0
            with torch.autocast("cpu", dtype=dtype):
                logits = model.head(model.encoder(xs[s]))
            loss = torch.nn.functional.cross_entropy(logits.float(), ys[s])
            loss.backward()
            return loss

        losses.append(opt.step(closure).detach().clone())
    return losses, [], {n: t.detach().clone() for n, t in model.state_dict().items()}


def test_a_closure_the_update_evaluates_first_keeps_the_step_checked_by_modules(tmp_path):
    # The step's `record_function` marker (every torch optimizer's step opens one) once
    # counted as an op of the update, and every step was checked op by op from its closure;
    # and the step after a failing one was decided before its closure, on the gradients
    # the failing step left, then "could not be replayed".
    lights = []
    a, b = against_full(tmp_path, train_closure, torch.bfloat16, lights=lights)
    assert lights == [False, True, True, True]
    assert b[1]["op_count"] < a[1]["op_count"]
    assert _origin(b[2])[:3] == _origin(a[2])[:3] == ("forward", "mul", "encoder.2")
    assert _origin(b[3]) == _origin(a[3]) and b[3]["events"] == a[3]["events"] == []


@pytest.mark.parametrize("check", ["modules", "ops"])
def test_a_forward_and_backward_the_optimizer_asks_for_are_forward_and_backward(tmp_path, check):
    # SAM's step calls a closure that runs the model again: its ops are the forward's
    # and the backward's, not the optimizer's.
    a, b = against_full(tmp_path, train_sam, torch.bfloat16, check=check)
    assert [s["micro_batches"] for s in b] == [2, 2, 2, 2]
    ops = a[0]["ops"]
    phases = [r["phase"] for r in ops if r["module"].startswith("encoder")]
    assert phases.count("forward") > 0 and phases.count("backward") > 0 and "optimizer" not in phases
    assert _origin(b[2])[:3] == _origin(a[2])[:3] == ("forward", "mul", "encoder.2")


def _boosted_fp16(seed, watch):
    """A small model with a `Boost` at index 2, SGD and an fp16 GradScaler, watched when
    `watch` is given."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), Boost(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    if watch is not None:
        watch(model, opt, scaler)
    return model, opt, scaler


def _batches(steps, seed):
    g = torch.Generator().manual_seed(seed + 1)
    return [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(steps)]


def _plant(boost, plant, s):
    """Sets `boost` to overflow the forward or the backward where `plant` = (step, where)
    says, else to pass values through."""
    boost.k = 1.0e20 if plant == (s, "forward") else 1.0
    boost.kg = 1.0e20 if plant == (s, "backward") else 1.0


def train_penalty(steps=4, plant=None, watch=None, seed=0):
    """A gradient penalty as PyTorch's AMP examples write it: the scaled loss's gradients
    by `torch.autograd.grad` with their graph, unscaled, their norm added to the loss,
    which is backpropagated. `plant` = (step, "forward" | "backward")."""
    model, opt, scaler = _boosted_fp16(seed, watch)
    losses, scales = [], []
    for s, (x, y) in enumerate(_batches(steps, seed)):
        opt.zero_grad()
        _plant(model[2], plant, s)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        scaled = torch.autograd.grad(outputs=scaler.scale(loss), inputs=list(model.parameters()), create_graph=True)
        inv = 1.0 / scaler.get_scale()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss + torch.stack([(p * inv).pow(2).sum() for p in scaled]).sum().sqrt()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.detach().clone())
        scales.append(scaler.get_scale())
    return losses, scales, {n: t.detach().clone() for n, t in model.state_dict().items()}


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_gradient_penalty_step_is_decided_at_its_autograd_grad_and_found_where_full_statistics_find_it(
    tmp_path, where
):
    # Two backwards and a double backward a step: a replay's one backward cannot stand
    # for them (it found no origin of a gradient that overflowed in the first). The step is
    # decided where it calls `autograd.grad`, before any backward, and checked op by op
    # from there; the next step is checked by modules again (it was checked op by op).
    plant = (2, where)
    a, b = against_full(tmp_path, train_penalty, plant=plant)
    # Checked by modules up to the penalty's `autograd.grad` (the model's forward ops only
    # ran), op by op from there, in every step.
    assert b[1]["op_count"] < a[1]["op_count"] and b[3]["op_count"] < a[3]["op_count"]
    assert b[1]["ops"] is None and b[3]["ops"] is None
    assert b[2]["skipped"] and b[2]["events"] == []
    for k in ("first_inf", "first_nan"):
        assert _origin(b[2], k)[:3] == _origin(a[2], k)[:3]
    assert _origin(b[2])[:3] == (where, "mul", "2")
    # Its backward ops, seen from the cut on, are those full statistics record, named by
    # the module whose (unseen) forward made their nodes.
    full = [(r["op"], r["module"]) for r in a[2]["ops"] if r["phase"] == "backward"]
    seen = [(r["op"], r["module"]) for r in b[2]["ops"] if r["phase"] == "backward"]
    assert seen == full[len(full) - len(seen) :] and any(m == "2" for _, m in seen)


def train_two_heads(form, steps=4, plant=None, watch=None, seed=0):
    """Two losses, backpropagated by `loss.backward()` of their sum ("tensor") or by
    `torch.autograd.backward` of the pair ("function"). `plant` = (step, "forward" |
    "backward")."""
    model, opt, scaler = _boosted_fp16(seed, watch)
    losses, scales = [], []
    for s, (x, y) in enumerate(_batches(steps, seed)):
        opt.zero_grad()
        _plant(model[2], plant, s)
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x).float()
        a = torch.nn.functional.cross_entropy(out, y)
        b = out.pow(2).mean()
        if form == "tensor":
            scaler.scale(a + b).backward()
        else:
            torch.autograd.backward([scaler.scale(a), scaler.scale(b)])
        scaler.step(opt)
        scaler.update()
        losses.append((a + b).detach().clone())
        scales.append(scaler.get_scale())
    return losses, scales, {n: t.detach().clone() for n, t in model.state_dict().items()}


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_torch_autograd_backward_is_a_backward_as_a_tensors_is(tmp_path, where):
    # Its losses were not kept (every step's loss empty) and a step checked by modules
    # did not pause for the model's nodes.
    plant = (2, where)
    plain = train_two_heads("function", plant=plant)
    traces = {}
    for form in ("tensor", "function"):
        traces[form] = tmp_path / f"{form}.jsonl"
        seen = train_two_heads(form, plant=plant, watch=watcher(traces[form]))
        close_all()
        if form == "function":
            assert_same_bits(plain, seen)
    a, b = steps_of(traces["tensor"]), steps_of(traces["function"])
    assert all(s["loss"] is not None and s["micro_batches"] == 1 for s in b)
    # One micro-batch's loss: the sum of the roots (to the last bits: the sum is taken in
    # f64 here, in f32 by the script).
    for x, y in zip(a, b):
        assert (x["loss"] == y["loss"] == "NaN") or x["loss"] == pytest.approx(y["loss"], rel=1e-6)
    assert b[1]["op_count"] < b[0]["op_count"]
    assert b[2]["skipped"] and _origin(b[2])[:3] == _origin(a[2])[:3] == (where, "mul", "2")


def train_skipping(steps=5, boom_step=2, watch=None, seed=0):
    """bf16 without a scaler, skipping a batch whose gradients are not finite: the script
    zeroes them at the top of the next iteration (after a `continue`)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), Boost(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    if watch is not None:
        watch(model, opt, None)
    g = torch.Generator().manual_seed(seed + 1)
    losses = []
    for s in range(steps):
        x = torch.randn(8, 16, generator=g)
        y = torch.randint(0, 4, (8,), generator=g)
        opt.zero_grad()
        # (planted by the batch: a replay runs the call from the inputs it kept)
        x = x * (3.0e38 if s == boom_step else 1.0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        loss.backward()
        losses.append(loss.detach().clone())
        if not all(torch.isfinite(p.grad).all() for p in model.parameters()):
            continue
        opt.step()
    return losses, [], {n: t.detach().clone() for n, t in model.state_dict().items()}


@pytest.mark.parametrize("check", ["modules", "ops"])
def test_gradients_zeroed_without_an_update_end_a_skipped_step(tmp_path, check):
    # Before, the skipped batch and the next were one step of two micro-batches.
    a, b = against_full(tmp_path, train_skipping, check=check)
    assert [s["skipped"] for s in b] == [False, False, True, False, False]
    assert [s["micro_batches"] for s in b] == [1] * 5
    assert b[2]["loss"] == "NaN" and b[3]["loss"] != "NaN"
    assert len(b[2]["events"]) == 1 and "without an optimizer update" in b[2]["events"][0]
    for k in ("first_inf", "first_nan"):
        assert _origin(b[2], k)[:3] == _origin(a[2], k)[:3]
    assert _origin(b[2])[0] == "forward"
    assert b[1]["ops"] is None and b[3]["ops"] is None


def train_two_optimizers(steps=4, boom_step=2, watch=None, seed=0):
    """One model, one backward, two optimizers (the body's parameters and the head's)
    stepped by one scaler; at `boom_step` a hook makes the head's weight gradient
    infinite, so the scaler steps the body's optimizer and skips the head's."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    body = torch.optim.SGD(model[0].parameters(), lr=0.1)
    head = torch.optim.SGD(model[2].parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    if watch is not None:
        watch(model, [body, head], scaler)
    boom = [False]
    model[2].weight.register_hook(lambda g: torch.full_like(g, float("inf")) if boom[0] else g)
    g = torch.Generator().manual_seed(seed + 1)
    xs = torch.randn(steps, 6, 8, generator=g)
    losses, scales = [], []
    for s in range(steps):
        boom[0] = s == boom_step
        body.zero_grad()
        head.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(xs[s]).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(body)
        scaler.step(head)
        scaler.update()
        losses.append(loss.detach().clone())
        scales.append(scaler.get_scale())
    return losses, scales, {n: t.detach().clone() for n, t in model.state_dict().items()}


def test_two_optimizers_after_one_backward_say_when_a_skip_cannot_be_replayed(tmp_path):
    # The scaler steps the body's optimizer, then skips the head's: the step's calls ran
    # before the body's update changed their parameters, so no replay runs them as they
    # ran. The step says its origin is not known (it replayed them on the changed
    # parameters, or checked every later step op by op), and the steps after it are
    # still checked by modules.
    plain = train_two_optimizers()
    path = tmp_path / "t.jsonl"
    seen = train_two_optimizers(watch=watcher(path))
    close_all()
    assert_same_bits(plain, seen)
    b = steps_of(path)
    assert b[2]["skipped"] and _origin(b[2]) is None
    assert len(b[2]["events"]) == 1 and "origin is not known" in b[2]["events"][0], b[2]["events"]
    assert b[3]["ops"] is None and not b[3]["skipped"]


def train_wgan(steps=3, n_critic=3, plant=None, watch=None, seed=0):
    """A WGAN without a scaler (bf16): each step the critic steps `n_critic` times, then
    the generator once; one step of the trace ends when both have stepped. `plant` =
    (step, critic iteration): that iteration's critic forward overflows."""
    torch.manual_seed(seed)
    gen = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    critic = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), Boost(), torch.nn.Linear(32, 1))
    og = torch.optim.RMSprop(gen.parameters(), lr=1e-4)
    oc = torch.optim.RMSprop(critic.parameters(), lr=1e-4)
    if watch is not None:
        watch({"G": gen, "C": critic}, [oc, og], None)
    g = torch.Generator().manual_seed(seed + 1)
    losses = []
    for s in range(steps):
        for i in range(n_critic):
            z = torch.randn(16, 8, generator=g)
            real = torch.randn(16, 16, generator=g)
            critic[2].k = 1.0e20 if plant == (s, i) else 1.0
            with torch.autocast("cpu", dtype=torch.bfloat16):
                lc = critic(gen(z).detach()).float().mean() - critic(real).float().mean()
            oc.zero_grad(set_to_none=True)
            lc.backward()
            oc.step()
            # (reset after the update, before which a replay runs the forward again)
            critic[2].k = 1.0
            losses.append(lc.detach().clone())
        z = torch.randn(16, 8, generator=g)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lg = -critic(gen(z)).float().mean()
        og.zero_grad(set_to_none=True)
        lg.backward()
        og.step()
        losses.append(lg.detach().clone())
    state = {f"G.{n}": t.detach().clone() for n, t in gen.state_dict().items()}
    state.update({f"C.{n}": t.detach().clone() for n, t in critic.state_dict().items()})
    return losses, [], state


def test_a_wgans_critic_steps_are_segments_checked_by_modules(tmp_path):
    # Four updates a step (three of the critic's, the generator's): each segment of calls
    # is decided before its update, so the steps after the first are checked by modules
    # (they were checked op by op), and a failure in a second critic iteration is found
    # where full statistics find it.
    plant = (2, 1)
    a, b = against_full(tmp_path, train_wgan, plant=plant)
    assert len(a) == len(b) == 3
    assert b[1]["ops"] is None and b[1]["op_count"] < a[1]["op_count"]
    assert _origin(b[2])[:3] == _origin(a[2])[:3] == ("forward", "mul", "C.2")
    assert b[2]["events"] == []


def test_an_update_that_raises_is_the_scripts_error_alone(tmp_path, capsys):
    # The scaler's step raising before the optimizer's (here: no gradient to unscale) went
    # on to replay the step's calls, as for an update the scaler skipped, while the
    # script's error propagated.
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    w = amprobe_torch.watch(model, opt, scaler, trace=str(tmp_path / "t.jsonl"))
    replays = []
    original = w._replay
    w._replay = lambda: replays.append(1) or original()
    x = torch.randn(3, 4)
    for step in range(3):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        if step == 2:
            with pytest.raises(AssertionError, match="No inf checks"):
                scaler.step(opt)
            break
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    close_all()
    assert replays == [] and "capture stopped" not in capsys.readouterr().err
