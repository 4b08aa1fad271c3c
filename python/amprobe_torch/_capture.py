"""The capture: every ATen op of the user's steps seen through a TorchDispatchMode, named by
the module that ran it (ModTracker, backward included), reduced on its device, read back
once per step and written as an amprobe step record."""

import os
import sys
import time
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import _stats
from ._trace import SCHEMA_VERSION, TraceWriter, jfloat

try:
    from torch.distributed._tools.mod_tracker import ModTracker
except ImportError:  # pragma: no cover - older torch
    ModTracker = None

TOOL_VERSION = "0.1.0"


def _key(t):
    """Identity of a tensor's values within a step: where they are and how they are laid out
    (the Python objects that reach the dispatcher are not stable)."""
    return (t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()), t.device)


def _leaves(tree, kind):
    """The leaves of type `kind` in a tree of lists, tuples and dicts, in order."""
    out = []
    stack = [tree]
    while stack:
        x = stack.pop()
        if isinstance(x, kind):
            out.append(x)
        elif isinstance(x, (list, tuple)):
            stack.extend(reversed(x))
        elif isinstance(x, dict):
            stack.extend(reversed(list(x.values())))
    return out


def param_vector(p, scale, shortcut=True):
    """The ParamRecord figures of parameter `p` (its gradient unscaled, `scale` the step's
    loss scale) as a float64 vector on its device: [has a gradient, Σg² over finite values,
    max finite |g|, zeros, nonzero finite |g| that fp16 flushes, the same of g·scale (in
    f32), nonzero finite count, non-finite count, max |p| over non-NaN values after the
    step]. With `shortcut`, a CPU gradient whose sum is finite (so all of it is) takes
    fewer passes; the figures are the same."""
    g = p.grad
    dev = p.device
    f64 = torch.float64
    if g is None:
        return torch.zeros(9, dtype=f64, device=dev)
    x = g.detach().reshape(-1)
    x = x if x.dtype in (torch.float32, torch.float64) else x.float()
    pv = p.detach().reshape(-1)
    n = x.numel()
    zero = torch.zeros((), dtype=f64, device=dev)
    if shortcut and dev.type == "cpu" and n and pv.numel():
        sx, sp = float(x.sum()), float(pv.sum())
        if sx - sx == 0.0 and sp - sp == 0.0:
            a = x.abs()
            zeros = n - int(torch.count_nonzero(x))
            small = int(torch.count_nonzero(a <= _stats.F16_UNDERFLOW)) - zeros
            small_scaled = int(torch.count_nonzero((a * float(scale)).float() <= _stats.F16_UNDERFLOW)) - zeros
            lo, hi = torch.aminmax(pv)
            return torch.tensor(
                [
                    1.0,
                    float(torch.linalg.vector_norm(x, dtype=f64)) ** 2,
                    float(a.max()),
                    float(zeros),
                    float(small),
                    float(small_scaled),
                    float(n - zeros),
                    0.0,
                    max(abs(float(lo)), abs(float(hi))),
                ],
                dtype=f64,
            )
    fin = x.isfinite()
    a = torch.where(fin, x.abs(), torch.zeros((), dtype=x.dtype, device=dev))
    nz = fin & (a > 0)
    scaled = (a * float(scale)).float()
    pa = pv.abs()
    pa = torch.where(pv.isnan(), torch.zeros((), dtype=pa.dtype, device=dev), pa)
    return torch.stack(
        [
            torch.ones((), dtype=f64, device=dev),
            (a.to(f64) ** 2).sum(),
            a.max().to(f64) if n else zero,
            (x == 0).sum().to(f64),
            (nz & (a <= _stats.F16_UNDERFLOW)).sum().to(f64),
            (nz & (scaled <= _stats.F16_UNDERFLOW)).sum().to(f64),
            nz.sum().to(f64),
            (~fin).sum().to(f64),
            pa.max().to(f64) if pa.numel() else zero,
        ]
    )


def _mask_like(x):
    """A scalar that masks: -inf or a dtype's most negative value."""
    return x == float("-inf") or x <= -65504.0


def _meta(t):
    return {"dtype": _stats.DTYPE_NAMES[t.dtype], "shape": list(t.shape)}


class _Mode(TorchDispatchMode):
    """Sees every ATen op; inside `__torch_dispatch__` the mode is off, so the statistics'
    own ops are not seen."""

    def __init__(self, watcher):
        super().__init__()
        self.watcher = watcher

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        w = self.watcher
        if w.active and not w.busy:
            w.busy = True
            try:
                w.on_op(func, args, kwargs or {}, out)
            except Exception:  # never kill the user's training
                w.fail()
            finally:
                w.busy = False
        return out


class Watcher:
    """What `watch` returns: the capture of one model's training, step by step."""

    def __init__(self, model, optimizer, scaler, path, sample_every):
        self.model = model
        self.optimizer = optimizer
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self.path = path
        self.sample_every = sample_every
        self.active = True
        self.busy = False
        self.failed = None
        self.step = 0
        self.writer = None
        self.autocast_dtype = None
        self.optimizer_depth = 0
        self.closed = False
        self.root_prefix = type(model).__name__ + "."
        self.started = time.perf_counter()
        self._begin_step()
        self.tracker = ModTracker() if ModTracker is not None else None
        if self.tracker is not None:
            self.tracker.__enter__()
        # Autocast's state is read where the model's forward starts: inside the dispatcher,
        # autocast's own kernels hide it.
        model.register_forward_pre_hook(self._autocast_state)
        self.mode = _Mode(self)
        self.mode.__enter__()
        self._wrap()

    # ---- the step's state

    def _begin_step(self):
        self.kept = self.step == 0 or (self.sample_every > 0 and self.step % self.sample_every == 0)
        self.ops = []
        self.full_vecs = []
        self.check_vecs = []
        self.producer = {}
        self.external = {}
        self.derived = set()
        self.param_dep = set()
        self.maskish = set()
        self.param_keys = {_key(p) for p in self.model.parameters()}
        self.op_count = 0
        self.losses = []
        self.scaling_nodes = []
        self.t0 = time.perf_counter()

    def _autocast_state(self, module, args):
        if self.autocast_dtype is not None or not self.active:
            return
        dev = next((p.device.type for p in module.parameters()), "cpu")
        if torch.is_autocast_enabled(dev):
            self.autocast_dtype = torch.get_autocast_dtype(dev)

    def fail(self):
        """Reports the companion's own error once and stops capturing; training goes on."""
        if self.failed is None:
            self.failed = traceback.format_exc()
            sys.stderr.write(
                "amprobe_torch: capture stopped after an internal error "
                f"(training continues):\n{self.failed}"
            )
        self.active = False

    # ---- op by op

    def _module(self):
        if self.tracker is None:
            return ""
        best = ""
        for name in self.tracker.parents:
            if name == "Global":
                continue
            if name.count(".") >= best.count(".") and len(name) > len(best):
                best = name
        if best.startswith(self.root_prefix):
            return best[len(self.root_prefix) :]
        return "" if best == type(self.model).__name__ else best

    def _phase(self):
        if self.optimizer_depth:
            return "optimizer"
        if torch._C._current_graph_task_id() != -1:
            return "backward"
        return "forward"

    def _vector(self, t):
        if self.kept:
            self.full_vecs.append(_stats.full(t))
            return ("full", len(self.full_vecs) - 1)
        self.check_vecs.append(_stats.check(t))
        return ("check", len(self.check_vecs) - 1)

    def _same_values(self, o, ins):
        """The statistics of an input whose values the output only moves (a view, a
        transpose, a detach: same storage, same element count and dtype; never an op that
        writes in place), shared instead of computed again; None when there is none."""
        ptr = o.untyped_storage().data_ptr()
        for t in ins:
            if t.dtype == o.dtype and t.numel() == o.numel() and t.untyped_storage().data_ptr() == ptr:
                p = self.producer.get(_key(t))
                if p is not None:
                    return self.ops[p]["vec"]
        return None

    def on_op(self, func, args, kwargs, out):
        self.op_count += 1
        if self.scaling_nodes and torch._C._current_graph_task_id() != -1:
            node = torch._C._current_autograd_node()
            if node is not None and any(node is n for n in self.scaling_nodes):
                return
        outs = [t for t in _leaves(out, torch.Tensor) if _stats.floating(t)]
        if not outs:
            return
        phase = self._phase()
        ins = [t for t in _leaves((args, kwargs), torch.Tensor) if _stats.observed(t)]
        # What the output derives from: the parameters or the batch (then its Inf or NaN
        # can be an origin), or only constants the model made (T5's log(0) = -inf in its
        # position buckets is not); and whether it is, or reads, a mask.
        preds, ext = [], []
        derived = False
        mask_scalar = any(_mask_like(a) for a in _leaves((args, kwargs), float))
        maskish_in = const_in = param_in = False
        with torch.no_grad():
            for t in ins:
                k = _key(t)
                p = self.producer.get(k)
                if p is not None:
                    preds.append(p)
                    derived |= p in self.derived
                    const_in |= p not in self.derived
                    maskish_in |= p in self.maskish
                    param_in |= p in self.param_dep
                    continue
                derived = True
                param_in |= k in self.param_keys
                if _stats.floating(t):
                    if k not in self.external:
                        self.check_vecs.append(_stats.check(t))
                        self.external[k] = len(self.check_vecs) - 1
                    ext.append(self.external[k])
            o = outs[0]
            vec = (None if func._schema.is_mutable else self._same_values(o, ins)) or self._vector(o)
        idx = len(self.ops)
        self.ops.append(
            {
                "phase": phase,
                "op": func.overloadpacket.__name__,
                "module": self._module(),
                "inputs": [_meta(t) for t in ins],
                "output": _meta(o),
                "vec": vec,
                "preds": preds,
                "ext": ext,
                "eligible": phase != "forward" or derived,
                # -inf written by a mask (a scalar like finfo.min or -inf, a mask built from
                # one, or a constant the model made) is not an overflow.
                "masked": phase == "forward" and (mask_scalar or maskish_in or const_in),
                "index": self.op_count - 1,
            }
        )
        for t in outs:
            self.producer[_key(t)] = idx
        if derived:
            self.derived.add(idx)
        if param_in:
            self.param_dep.add(idx)
        if (mask_scalar or maskish_in) and not param_in:
            self.maskish.add(idx)

    # ---- step boundaries

    def _in_optimizer(self, f):
        """`f` with its ops counted in the optimizer phase (nested calls included: the
        scaler's step unscales)."""
        w = self

        def run(*a, **k):
            w.optimizer_depth += 1
            try:
                return f(*a, **k)
            finally:
                w.optimizer_depth -= 1

        return run

    def _wrap(self):
        w = self
        if self.scaler is not None:
            sc = self.scaler
            orig_update = sc.update

            def update(*a, **k):
                if not w.active:
                    return orig_update(*a, **k)
                w.busy = True
                try:
                    found = w._found_inf()
                    before = sc._scale.detach().clone() if sc._scale is not None else None
                finally:
                    w.busy = False
                r = w._in_optimizer(orig_update)(*a, **k)
                w._end_step(before, found)
                return r

            sc.update = update
            orig_scale = sc.scale

            def scale(*a, **k):
                # The loss scaling is the scaler's, not a model op (amprobe's own runs
                # record none either): neither it nor its gradient is recorded.
                was, w.busy = w.busy, True
                try:
                    out = orig_scale(*a, **k)
                finally:
                    w.busy = was
                if isinstance(out, torch.Tensor) and out.grad_fn is not None:
                    w.scaling_nodes.append(out.grad_fn)
                return out

            sc.scale = scale
            sc.unscale_ = self._in_optimizer(sc.unscale_)
            sc.step = self._in_optimizer(sc.step)
        else:
            orig = self._in_optimizer(self.optimizer.step)

            def opt_step(*a, **k):
                r = orig(*a, **k)
                if w.active:
                    w._end_step(None, None)
                return r

            self.optimizer.step = opt_step
        _install_backward_hook()

    def _found_inf(self):
        states = getattr(self.scaler, "_per_optimizer_states", {})
        found = []
        for st in states.values():
            for v in st.get("found_inf_per_device", {}).values():
                found.append(v.detach().reshape(-1).to(torch.float64))
        return torch.cat(found).sum() if found else None

    def on_backward(self, root):
        if self.active and root.numel() == 1:
            self.losses.append(root.detach().reshape(()).to(torch.float64).clone())

    def _param_vectors(self, scale):
        names, vecs = [], []
        for name, p in self.model.named_parameters():
            names.append((name, p))
            vecs.append(param_vector(p, scale))
        return names, vecs

    def _end_step(self, scale_before, found):
        self.busy = True
        try:
            self._finish(scale_before, found)
        except Exception:
            self.fail()
        finally:
            self.busy = False
        self.step += 1
        self._begin_step()

    def _finish(self, scale_before, found):
        sc = self.scaler
        with torch.no_grad():
            # One read back a step: everything gathered on the device goes to the host here.
            scale_after = sc._scale.detach().clone() if sc is not None else None
            scale_host = float(scale_before.item()) if scale_before is not None else 1.0
            names, pvecs = self._param_vectors(scale_host)
            pv = [v.cpu().tolist() for v in pvecs]
            full = [v.cpu().tolist() for v in self.full_vecs]
            check = [v.cpu().tolist() for v in self.check_vecs]
            losses = [float(l.item()) for l in self.losses]
            found_inf = bool(found is not None and float(found.item()) > 0)
            scale_after_host = float(scale_after.item()) if scale_after is not None else 1.0
            growth = int(sc._growth_tracker.item()) if sc is not None else 0
        stats = []
        for op in self.ops:
            kind, i = op["vec"]
            stats.append(_stats.from_full(full[i]) if kind == "full" else _stats.from_check(check[i]))
        origins = self._origins(stats, check)
        # A failing step: a value of it went non-finite, or the scaler found one, or the
        # loss is. (A non-finite value that only passes through, such as the last step's
        # loss kept by the script, does not make a step fail.)
        failing = (
            origins["first_inf"] is not None
            or origins["first_nan"] is not None
            or found_inf
            or any(l != l or abs(l) == float("inf") for l in losses)
        )
        records = None
        if self.kept or failing:
            records = []
            for op, st in zip(self.ops, stats):
                masked = st["neg_inf"] if op["masked"] else 0
                records.append(
                    {
                        "micro": 0,
                        "index": op["index"],
                        "phase": op["phase"],
                        "op": op["op"],
                        "module": op["module"],
                        "inputs": op["inputs"],
                        "output": op["output"],
                        "stats": st,
                        "rounding": {"overflow": 0, "underflow": 0},
                        "forward_op": None,
                        "wrt": None,
                        "masked_neg_inf": masked,
                    }
                )
        params = []
        for (name, p), v in zip(names, pv):
            has_grad = v[0] > 0
            finite_nonzero = v[6]
            params.append(
                {
                    "name": name,
                    "dtype": _stats.DTYPE_NAMES.get(p.dtype, "float32"),
                    "grad_dtype": _stats.DTYPE_NAMES.get(p.grad.dtype) if has_grad and p.grad is not None else None,
                    "numel": p.numel(),
                    "grad_l2": jfloat(v[1] ** 0.5),
                    "max_abs_grad": jfloat(v[2]),
                    "zero_frac": v[3] / p.numel() if p.numel() else 0.0,
                    "f16_underflow_frac_unscaled": v[4] / finite_nonzero if finite_nonzero else 0.0,
                    "f16_underflow_frac_scaled": v[5] / finite_nonzero if finite_nonzero else 0.0,
                    "nonfinite": int(v[7]),
                    "param_max_abs_after": jfloat(v[8]),
                }
            )
        loss = None
        scaled = None
        if losses:
            scaled = sum(losses) / len(losses)
            loss = scaled / scale_host if sc is not None else scaled
        if self.writer is None:
            self.writer = TraceWriter(self.path)
            self.writer.write("header", self._header())
        lr = self.optimizer.param_groups[0].get("lr", 0.0)
        self.writer.write(
            "step",
            {
                "step": self.step,
                "micro_batches": max(1, len(losses)),
                "loss": jfloat(loss),
                "scaled_loss": jfloat(scaled) if sc is not None else None,
                "scale_before": jfloat(scale_host),
                "scale_after": jfloat(scale_after_host),
                "found_inf": found_inf,
                "skipped": found_inf,
                "growth_tracker": growth,
                "grad_norm": None,
                "clip_coef": None,
                "lr": jfloat(float(lr)),
                "weight_casts": 0,
                "origins": origins,
                "params": params,
                "ops": records,
                "op_count": self.op_count,
                "events": [],
                "wall_ms": (time.perf_counter() - self.t0) * 1000.0,
                "skip_cause": None,
            },
        )

    def _origins(self, stats, check):
        """First Inf and first NaN (an op whose output has one that none of its inputs had)
        and the chain of ops that carried them on, from the records of this step."""
        n = len(self.ops)
        has_inf = [False] * n
        has_nan = [False] * n
        first_inf = first_nan = None
        for i, (op, st) in enumerate(zip(self.ops, stats)):
            masked = st["neg_inf"] if op["masked"] else 0
            out_inf = st["pos_inf"] + st["neg_inf"] - masked > 0
            out_nan = st["nan"] > 0
            in_inf = any(has_inf[p] for p in op["preds"]) or any(check[e][2] + check[e][3] > 0 for e in op["ext"])
            in_nan = any(has_nan[p] for p in op["preds"]) or any(check[e][1] > 0 for e in op["ext"])
            has_inf[i] = out_inf
            has_nan[i] = out_nan
            if op["eligible"]:
                if first_inf is None and out_inf and not in_inf:
                    first_inf = i
                if first_nan is None and out_nan and not in_nan:
                    first_nan = i
        chain = [self._ref(i) for i in self._chain(first_inf, first_nan)]
        return {
            "first_inf": self._ref(first_inf) if first_inf is not None else None,
            "first_nan": self._ref(first_nan) if first_nan is not None else None,
            "chain": chain,
        }

    def _chain(self, a, b):
        """Ops on a data path from the first Inf (a) to the first NaN (b), in execution
        order; just the origin when there is one, or when the NaN does not descend from
        the Inf (amprobe's own rule)."""
        if a is None or b is None:
            return [x for x in (a, b) if x is not None]
        if a == b:
            return [a]
        if b < a:
            return [b]
        parent, seen, stack = {}, {b}, [b]
        while stack:
            n = stack.pop()
            if n == a:
                path, cur = [a], a
                while cur in parent:
                    cur = parent[cur]
                    path.append(cur)
                return path
            for p in self.ops[n]["preds"]:
                if p >= a and p not in seen:
                    seen.add(p)
                    parent[p] = n
                    stack.append(p)
        return [a, b]

    def _ref(self, i):
        op = self.ops[i]
        return {
            "step": self.step,
            "micro": 0,
            "phase": op["phase"],
            "op_index": op["index"],
            "op": op["op"],
            "module": op["module"],
            "forward_op": None,
        }

    def _header(self):
        dev = next((p.device for p in self.model.parameters()), torch.device("cpu"))
        if self.autocast_dtype == torch.float16:
            precision = "fp16"
        elif self.autocast_dtype == torch.bfloat16:
            precision = "bf16"
        else:
            precision = "fp32"
        rank, world = 0, 1
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        device_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else None
        sc = self.scaler
        header = {
            "schema_version": SCHEMA_VERSION,
            "tool": "amprobe",
            "tool_version": TOOL_VERSION,
            "model": type(self.model).__name__,
            "precision": precision,
            "autocast_dtype": _stats.DTYPE_NAMES.get(self.autocast_dtype) if self.autocast_dtype else None,
            "policy_device": dev.type,
            "policy": None,
            "scaler": None
            if sc is None
            else {
                "init_scale": sc._init_scale,
                "growth_factor": sc._growth_factor,
                "backoff_factor": sc._backoff_factor,
                "growth_interval": sc._growth_interval,
            },
            "optimizer": {"kind": type(self.optimizer).__name__},
            "backend": dev.type,
            "seed": 0,
            "command_line": list(getattr(sys, "orig_argv", [sys.executable] + sys.argv)),
            "config": {},
            "source": {
                "kind": "pytorch",
                "torch": torch.__version__,
                "rank": rank,
                "world_size": world,
                "sample_every": self.sample_every,
            },
        }
        if device_name is not None:
            header["device"] = device_name
        return header

    def close(self):
        """Ends the capture: writes the end record and stops observing."""
        if self.closed:
            return
        self.closed = True
        self.active = False
        try:
            self.mode.__exit__(None, None, None)
        except Exception:
            pass
        if self.tracker is not None:
            try:
                self.tracker.__exit__(None, None, None)
            except Exception:
                pass
        if self.writer is not None:
            wall = (time.perf_counter() - self.started) * 1000.0
            self.writer.write("end", {"steps": self.step, "verdict": "", "wall_ms": wall})
            self.writer.close()


_WATCHERS = []
_BACKWARD = None


def _install_backward_hook():
    """Notes the root of every backward (the loss) for the watchers."""
    global _BACKWARD
    if _BACKWARD is not None:
        return
    orig = torch.Tensor.backward
    _BACKWARD = orig

    def backward(self, *a, **k):
        for w in _WATCHERS:
            if w.active and not w.busy:
                w.busy = True
                try:
                    w.on_backward(self)
                except Exception:
                    w.fail()
                finally:
                    w.busy = False
        return orig(self, *a, **k)

    torch.Tensor.backward = backward


def trace_path():
    """$AMPROBE_TRACE, else amprobe-trace.jsonl; `.rank{N}` before the suffix under a
    distributed run of more than one rank."""
    path = os.environ.get("AMPROBE_TRACE") or "amprobe-trace.jsonl"
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        world = torch.distributed.get_world_size()
        if world > 1:
            root, ext = os.path.splitext(path)
            path = f"{root}.rank{torch.distributed.get_rank()}{ext}"
    return path
