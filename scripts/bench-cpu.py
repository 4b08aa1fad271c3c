#!/usr/bin/env python3
"""amprobe and PyTorch side by side on the T5-mini CPU training step, in one command.

    /path/to/venv-with-torch/bin/python scripts/bench-cpu.py      # both halves
    python3 scripts/bench-cpu.py                                  # amprobe alone if no torch
    python3 scripts/bench-cpu.py --rounds 1 --reps 3              # quicker, noisier
    python3 scripts/bench-cpu.py --models gpt2,llama,bert,t5      # and the Hugging Face models

Run it from anywhere inside the repository checkout. It builds the bench with
`cargo bench --bench t5_step --no-run --message-format=json-render-diagnostics` (the
binary's path comes from cargo's JSON; with --models, `--bench t5_step --bench hf_step`
in the same cargo call), then runs every configuration in a child process of its own:

  amprobe  (benches/t5_step.rs, AMPROBE_BENCH_ONLY=MODE:on|off AMPROBE_BENCH_JSON=1):
           fp32, fp16 autocast, bf16 autocast, each with probes on and off;
           and (AMPROBE_BENCH_ONLY=rounds) all six of those in one process, stepping in
           --reps interleaved rounds (below);
  PyTorch  (scripts/bench_t5_torch.py CONFIG --json, run with the python running this
           script): fp32, bf16 autocast, fp16 autocast, fp32 + per-module forward hooks,
           fp32 + autograd anomaly mode.

With --models LIST (a comma-separated subset of gpt2,llama,bert,t5; none by default, and
without it nothing here changes), each round also runs, for each listed model, in every
mode of --hf-modes (comma-separated subset of fp32,fp16,bf16; default fp32):

  amprobe  (benches/hf_step.rs, AMPROBE_BENCH_ONLY=MODEL:MODE:on|off AMPROBE_BENCH_JSON=1),
           probes off and on: GPT-2-mini, LLaMA-mini, BERT-mini or the full T5-mini
           (encoder and decoder), each at the T5-mini encoder's sizes;
  PyTorch  (scripts/bench_hf_torch.py MODEL MODE --json) in the same modes, except fp16
           autocast, which takes several seconds a step on the CPU and runs only with
           --hf-torch-fp16 (then as the T5 encoder's does: --torch-fp16-reps steps, in the
           first round only).

(--hf-bench-exe names an hf_step executable to use instead of building it, as --bench-exe
does for t5_step.)

PyTorch is used only when `import torch, transformers` works in the python that runs this
script (sys.executable); otherwise the table has amprobe's half alone and says PyTorch was
not found.

Timing: each child does one untimed warm-up step, then --reps timed steps (default 5;
PyTorch fp16 autocast, 5 s or more a step on CPU, does --torch-fp16-reps, default 2, in the
first round only). There are --rounds rounds (default 5); within a round the amprobe and
PyTorch children alternate, and the order rotates from one round to the next (with
--models, the models' amprobe and PyTorch children join the same two lists, after the T5
encoder's). The time shown is the median of all the timed steps of a configuration,
pooled over its rounds. The probes on / off ratio is paired instead: in each round, the
probed child's median over the unprobed child's of the same round, and the median of
those ratios over the rounds, so that a slow spell of the machine weighs on both sides of
a ratio rather than on one configuration's pool.

Children run seconds to minutes apart, and on a shared machine whose speed swings by a
quarter within minutes that still leaves a ratio of two children several points off. So
each round also runs one child that holds all six amprobe configurations, and a third
trainer per mode that computes every op's full statistics in every step (the cost of a step
whose op records are kept; the probed trainers keep them only for a step with a non-finite
value, and these steps are finite), and steps them in turn (benches/t5_step.rs with
AMPROBE_BENCH_ONLY=rounds): per interleaved round a probed, a full-statistics and an
unprobed step back to back for each mode, the starting mode moving on each round. Over all those rounds of all the children, the median of probed / unprobed per
mode, and of each mode's unprobed step over the fp32 one of the same round, are the
"steps paired in one process" figures; the goal lines for the probe ratio and for fp16
and bf16 against fp32 use them, and the table shows both kinds.
Both sides use --threads threads (default 2; RAYON_NUM_THREADS for amprobe,
torch.set_num_threads for PyTorch). Progress goes to stderr, the tables to stdout. The
defaults take about 3 to 5 minutes on an idle 2-core machine; each (model, mode) of
--models adds three children a round (two without PyTorch). Other work on the machine
spoils the figures (PyTorch's OpenMP threads slow down many times over when they share
their cores with another process), so the table shows how many cores other processes
kept busy during the runs (from /proc/stat, less this script's own CPU time), and a note
at the end names every configuration, the Hugging Face models' included, whose
single-process medians differ by more than 25% (a time goal that involves one of them has
"(noisy)" after its mark).

Peak resident memory: the parent reaps each child with os.wait4(), which returns that one
child's resource usage, and reads its ru_maxrss (KiB on Linux): the kernel's high-water
mark of the child's resident set over its whole life, including start-up and, for
PyTorch, the Python interpreter and the torch/transformers imports. That is the same
counter resource.getrusage(RUSAGE_CHILDREN).ru_maxrss reports, but per child:
RUSAGE_CHILDREN keeps the largest value over every child reaped so far (cargo included),
so it could not tell one configuration from the next. The same measurement is applied to
both sides; the table shows the largest value over a configuration's rounds, and, for
scale, the peak of a child that only imports torch and transformers.

The goal lines (marked from the measured numbers) are those of the "CPU step speed"
issue: amprobe fp32 probes-off / PyTorch fp32 <= 1.2; amprobe fp16 and bf16 probes-off /
amprobe fp32 probes-off <= 1.2 (steps paired in one process); probes on / off per mode
<= 1.10 (steps paired in one process); amprobe / PyTorch peak RSS for the fp32 step <= 1.5.

With --models a second table, "Hugging Face models", follows, one row per (model, mode):
amprobe probes-off ms, probes-on ms, on / off, amprobe peak RSS (off / on), PyTorch ms,
PyTorch peak RSS and amprobe off / PyTorch (the PyTorch cells are "–" where PyTorch was
not run: not found, or fp16 without --hf-torch-fp16). Under it come the goal lines of the
issue point "each model's step on the CPU within the same ratio of PyTorch as the T5
encoder's": for each model, its amprobe fp32 probes-off / PyTorch fp32 ratio next to the
T5-mini encoder's same ratio from the same run, and the quotient model / encoder, marked
✓ when the model's ratio is at most the encoder's (they need fp32 in --hf-modes and
PyTorch).

Exit status: 0 once the tables are printed (whatever the goal marks), 1 if cargo, a child
process or the output of one fails, 2 for bad arguments (an unknown name in --models or
--hf-modes, or an --hf-* option without --models). Standard library only; Linux
(os.wait4, /proc/cpuinfo).
"""
import argparse
import json
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCH_SCRIPT = os.path.join(ROOT, "scripts", "bench_t5_torch.py")

AMPROBE_MODES = [("fp32", "fp32"), ("fp16", "fp16 autocast"), ("bf16", "bf16 autocast")]
# PyTorch configurations: (bench_t5_torch.py name, table row, amprobe mode on that row or None).
TORCH_CONFIGS = [
    ("fp32", "fp32", "fp32"),
    ("fp16", "fp16 autocast", "fp16"),
    ("bf16", "bf16 autocast", "bf16"),
    ("hooks", "fp32 + per-module hooks", None),
    ("anomaly", "fp32 + anomaly mode", None),
]
# The Hugging Face models of benches/hf_step.rs and scripts/bench_hf_torch.py, and their modes.
HF_MODELS = {"gpt2": "GPT-2-mini", "llama": "LLaMA-mini", "bert": "BERT-mini", "t5": "T5-mini (full)"}
HF_MODES = {"fp32": "fp32", "fp16": "fp16 autocast", "bf16": "bf16 autocast"}
HF_TORCH_SCRIPT = os.path.join(ROOT, "scripts", "bench_hf_torch.py")
# The key of the child that steps all six amprobe configurations in interleaved rounds.
ROUNDS = ("amprobe", "rounds")
GOAL_SPEED = 1.2
GOAL_PROBES = 1.10
GOAL_RSS = 1.5
# Child medians of one configuration further apart than this (largest / smallest) get a note
# under the table: the machine was probably busy.
NOISY = 1.25


class BenchError(Exception):
    pass


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def build_benches(names):
    """Builds the benches `names` (t5_step, hf_step) in one cargo call; returns {name: executable path}."""
    cmd = ["cargo", "bench"]
    for name in names:
        cmd += ["--bench", name]
    cmd += ["--no-run", "--message-format=json-render-diagnostics"]
    log(f"building: {shlex.join(cmd)}")
    try:
        p = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    except FileNotFoundError:
        raise BenchError("cargo was not found on PATH; install Rust (https://rustup.rs) or put cargo on PATH")
    if p.returncode != 0:
        raise BenchError(f"`{shlex.join(cmd)}` failed with exit status {p.returncode} (cargo's messages are above)")
    exes = {}
    for line in p.stdout.splitlines():
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        name = msg.get("target", {}).get("name")
        if msg.get("reason") == "compiler-artifact" and name in names and msg.get("executable"):
            exes[name] = msg["executable"]
    for name in names:
        if not exes.get(name) or not os.path.isfile(exes[name]):
            raise BenchError(f"`{shlex.join(cmd)}` succeeded but named no {name} executable in its JSON output")
    return exes


def spawn(argv, env, label):
    """Runs one child to completion: (exit status, stdout, stderr, peak RSS in KiB, seconds)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        try:
            p = subprocess.Popen(argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err)
        except OSError as e:
            raise BenchError(f"{label}: could not start {shlex.join(argv)}: {e}")
        try:
            # wait4 gives this child's own rusage; ru_maxrss is its peak resident set in KiB.
            _, status, usage = os.wait4(p.pid, 0)
        except BaseException:
            p.kill()
            p.wait()
            raise
        p.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - t0
        out.seek(0)
        err.seek(0)
        return (p.returncode, out.read().decode(errors="replace"), err.read().decode(errors="replace"),
                usage.ru_maxrss, wall)


def run_child(argv, env, label):
    """Runs one configuration's child; returns (its JSON result, its peak RSS in KiB, seconds)."""
    rc, stdout, stderr, kib, wall = spawn(argv, env, label)
    if rc != 0:
        tail = "\n".join((stdout + stderr).strip().splitlines()[-25:]) or "(it printed nothing)"
        raise BenchError(f"{label}: `{shlex.join(argv)}` failed with exit status {rc}:\n{tail}")
    for line in reversed(stdout.splitlines()):
        if line.startswith("{"):
            try:
                res = json.loads(line)
            except ValueError:
                break
            if res.get("times_ms"):
                return res, kib, wall
    raise BenchError(f"{label}: `{shlex.join(argv)}` printed no JSON result line; its output was:\n"
                     + ((stdout[-2000:] + stderr[-2000:]).strip() or "(nothing)"))


def rounds_of(res, label):
    """The interleaved rounds of an AMPROBE_BENCH_ONLY=rounds child's JSON line: a list, per
    round, of {mode: (probed ms, unprobed ms, kept ms)}, kept being the step with every op's full
    statistics."""
    try:
        modes, probed, unprobed, kept = res["modes"], res["probed_ms"], res["unprobed_ms"], res["kept_ms"]
        n = len(probed[0])
        ok = len(modes) == len(probed) == len(unprobed) == len(kept) and \
            all(len(v) == n for v in probed + unprobed + kept)
    except (KeyError, TypeError, IndexError):
        ok = False
    if not ok or set(modes) != {m for m, _ in AMPROBE_MODES}:
        raise BenchError(f"{label}: its JSON line needs \"modes\" ({', '.join(m for m, _ in AMPROBE_MODES)}) and "
                         f"\"probed_ms\", \"unprobed_ms\" and \"kept_ms\", one list of equal length per mode; "
                         f"it was {res}")
    return [{m: (probed[i][k], unprobed[i][k], kept[i][k]) for i, m in enumerate(modes)} for k in range(n)]


def torch_probe(env):
    """Imports torch and transformers in a child of this python: ((torch version, transformers
    version), None, the child's peak RSS in KiB) when both import, else (None, the error, None)."""
    code = "import torch, transformers; print(torch.__version__, transformers.__version__)"
    try:
        rc, stdout, stderr, kib, _ = spawn([sys.executable, "-c", code], env, "import torch")
    except BenchError as e:
        return None, str(e), None
    if rc != 0:
        lines = stderr.strip().splitlines()
        return None, (lines[-1] if lines else f"exit status {rc}"), None
    return tuple(stdout.split()[:2]), None, kib


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.split(":")[0].strip() in ("model name", "Model", "Hardware"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def git_rev():
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True).stdout.strip()
    except OSError:
        return None
    return (rev + (" (with uncommitted changes)" if dirty else "")) if rev else None


def cpu_busy_s():
    """(seconds of CPU time the whole machine has spent busy, seconds this process and its reaped
    children have used), or None without /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    # user nice system idle iowait irq softirq steal [guest guest_nice]: guest time is in user.
    busy = sum(fields[:8]) - fields[3] - fields[4]
    own = sum(getattr(resource.getrusage(w), f) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
              for f in ("ru_utime", "ru_stime"))
    return busy / os.sysconf("SC_CLK_TCK"), own


def cell(s):
    return str(s).replace("|", "\\|")


def row(*cells):
    return "| " + " | ".join(cell(c) for c in cells) + " |"


def fmt_ms(x):
    return "–" if x is None else f"{x:.1f}"


def fmt_mib(kib):
    return "–" if kib is None else f"{kib / 1024:.0f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5, help="child processes per configuration (default 5)")
    ap.add_argument("--reps", type=int, default=5, help="timed steps per child after one warm-up (default 5)")
    ap.add_argument("--torch-fp16-reps", type=int, default=2,
                    help="timed steps of PyTorch fp16 autocast, run in the first round only (default 2)")
    ap.add_argument("--threads", type=int, default=2, help="threads on both sides (default 2)")
    ap.add_argument("--no-torch", action="store_true", help="amprobe's half alone")
    ap.add_argument("--bench-exe", help="use this t5_step executable instead of building it with cargo")
    ap.add_argument("--models", metavar="LIST",
                    help="also run these Hugging Face models (comma-separated subset of "
                         f"{','.join(HF_MODELS)}) and print their table and goal lines (default none)")
    ap.add_argument("--hf-modes", metavar="LIST",
                    help=f"modes of the --models runs (comma-separated subset of {','.join(HF_MODES)}; "
                         "default fp32)")
    ap.add_argument("--hf-torch-fp16", action="store_true",
                    help="with fp16 in --hf-modes, run PyTorch fp16 autocast of the models too "
                         "(several seconds a step; --torch-fp16-reps steps, first round only)")
    ap.add_argument("--hf-bench-exe", help="use this hf_step executable instead of building it with cargo")
    args = ap.parse_args()
    for name in ("rounds", "reps", "torch_fp16_reps", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")

    def parse_list(opt, value, allowed):
        items = [x.strip() for x in value.split(",") if x.strip()]
        if not items:
            ap.error(f"{opt} needs a comma-separated list of some of {', '.join(allowed)}")
        bad = [x for x in items if x not in allowed]
        if bad:
            ap.error(f"{opt}: unknown {'name' if len(bad) == 1 else 'names'} {', '.join(map(repr, bad))} "
                     f"(choose from {', '.join(allowed)}, comma-separated)")
        return list(dict.fromkeys(items))  # in the order given, each once

    if args.models is None:
        for opt, given in (("--hf-modes", args.hf_modes is not None), ("--hf-torch-fp16", args.hf_torch_fp16),
                           ("--hf-bench-exe", args.hf_bench_exe is not None)):
            if given:
                ap.error(f"{opt} needs --models")
        hf_models, hf_modes = [], []
    else:
        hf_models = parse_list("--models", args.models, list(HF_MODELS))
        hf_modes = parse_list("--hf-modes", "fp32" if args.hf_modes is None else args.hf_modes, list(HF_MODES))

    command = shlex.join([sys.executable] + sys.argv)
    to_build = ([] if args.bench_exe else ["t5_step"]) + (["hf_step"] if hf_models and not args.hf_bench_exe else [])
    built = build_benches(to_build) if to_build else {}
    exe = args.bench_exe or built["t5_step"]
    hf_exe = (args.hf_bench_exe or built["hf_step"]) if hf_models else None
    base_env = dict(os.environ)
    base_env["RAYON_NUM_THREADS"] = str(args.threads)
    base_env.pop("AMPROBE_BENCH_ONLY", None)
    if args.no_torch:
        versions, torch_err, import_kib = None, "--no-torch", None
    else:
        log(f"checking for torch and transformers in {sys.executable}")
        versions, torch_err, import_kib = torch_probe(base_env)
    have_torch = versions is not None
    if not have_torch:
        log(f"PyTorch was not found ({torch_err}); measuring amprobe alone")

    def amprobe_job(mode, probes):
        env = dict(base_env, AMPROBE_BENCH_ONLY=f"{mode}:{probes}", AMPROBE_BENCH_JSON="1",
                   AMPROBE_BENCH_REPS=str(args.reps))
        return (("amprobe", mode, probes), f"amprobe {mode} probes {probes}", [exe], env)

    def amprobe_rounds_job():
        env = dict(base_env, AMPROBE_BENCH_ONLY="rounds", AMPROBE_BENCH_JSON="1", AMPROBE_BENCH_REPS=str(args.reps))
        return (ROUNDS, "amprobe all six, interleaved", [exe], env)

    def torch_job(name, reps):
        argv = [sys.executable, TORCH_SCRIPT, name, "--json", "--reps", str(reps), "--threads", str(args.threads)]
        return (("torch", name), f"PyTorch {name}", argv, base_env)

    def hf_amprobe_job(model, mode, probes):
        env = dict(base_env, AMPROBE_BENCH_ONLY=f"{model}:{mode}:{probes}", AMPROBE_BENCH_JSON="1",
                   AMPROBE_BENCH_REPS=str(args.reps))
        return (("hf-amprobe", model, mode, probes), f"amprobe {model} {mode} probes {probes}", [hf_exe], env)

    def hf_torch_job(model, mode, reps):
        argv = [sys.executable, HF_TORCH_SCRIPT, model, mode, "--json", "--reps", str(reps),
                "--threads", str(args.threads)]
        return (("hf-torch", model, mode), f"PyTorch {model} {mode}", argv, base_env)

    a_jobs = [amprobe_job(m, p) for m, _ in AMPROBE_MODES for p in ("off", "on")] + [amprobe_rounds_job()]
    t_jobs = [torch_job(n, args.reps) for n, _, _ in TORCH_CONFIGS if n != "fp16"] if have_torch else []
    # The Hugging Face models join the same two lists, so they alternate and rotate with the T5 encoder's.
    a_jobs += [hf_amprobe_job(m, mode, p) for m in hf_models for mode in hf_modes for p in ("off", "on")]
    if have_torch:
        t_jobs += [hf_torch_job(m, mode, args.reps) for m in hf_models for mode in hf_modes if mode != "fp16"]
    # PyTorch fp16 autocast of a model runs only with --hf-torch-fp16, in the first round, as T5's does.
    hf_torch_fp16 = have_torch and args.hf_torch_fp16 and "fp16" in hf_modes

    times = {}  # key -> pooled step times
    child_medians = {}  # key -> each child's own median
    labels = {}
    rss = {}  # key -> largest peak RSS (KiB)
    interleaved = []  # per interleaved round: {mode: (probed ms, unprobed ms)}
    busy_start = cpu_busy_s()
    t_start = time.perf_counter()
    for r in range(args.rounds):
        # Alternate the two sides, rotating the order each round.
        ka, kt = r % len(a_jobs), (r % len(t_jobs)) if t_jobs else 0
        aj, tj = a_jobs[ka:] + a_jobs[:ka], t_jobs[kt:] + t_jobs[:kt]
        jobs = []
        for i in range(max(len(aj), len(tj))):
            jobs += aj[i:i + 1] + tj[i:i + 1]
        if have_torch and r == 0:
            jobs.append(torch_job("fp16", args.torch_fp16_reps))
            if hf_torch_fp16:
                jobs += [hf_torch_job(m, "fp16", args.torch_fp16_reps) for m in hf_models]
        for key, label, argv, env in jobs:
            res, kib, wall = run_child(argv, env, label)
            if key == ROUNDS:
                interleaved += rounds_of(res, label)
            times.setdefault(key, []).extend(res["times_ms"])
            child_medians.setdefault(key, []).append(statistics.median(res["times_ms"]))
            labels[key] = label
            rss[key] = max(rss.get(key, 0), kib)
            log(f"round {r + 1}/{args.rounds}: {label:<28} median {statistics.median(res['times_ms']):8.1f} ms  "
                f"peak RSS {kib / 1024:6.0f} MiB  ({wall:.1f} s)")
    elapsed = time.perf_counter() - t_start
    busy_end = cpu_busy_s()
    # Cores kept busy by processes other than this script and its children, on average.
    others = None
    if busy_start and busy_end and elapsed > 0:
        others = max(0.0, (busy_end[0] - busy_start[0]) - (busy_end[1] - busy_start[1])) / elapsed

    def med(key):
        v = times.get(key)
        return statistics.median(v) if v else None

    def steps(key):
        return len(times.get(key, ()))

    def paired(on_key, off_key):
        # Median over the rounds of the two children's ratio within a round.
        on_v, off_v = child_medians.get(on_key, []), child_medians.get(off_key, [])
        return statistics.median(a / b for a, b in zip(on_v, off_v))

    a_off = {m: med(("amprobe", m, "off")) for m, _ in AMPROBE_MODES}
    a_on = {m: med(("amprobe", m, "on")) for m, _ in AMPROBE_MODES}
    a_probe = {m: paired(("amprobe", m, "on"), ("amprobe", m, "off")) for m, _ in AMPROBE_MODES}
    # The same two kinds of ratio from the steps paired in one process.
    i_probe = {m: statistics.median(r[m][0] / r[m][1] for r in interleaved) for m, _ in AMPROBE_MODES}
    i_vs32 = {m: statistics.median(r[m][1] / r["fp32"][1] for r in interleaved) for m, _ in AMPROBE_MODES}
    # A step that computes every op's full statistics (one whose op records are kept) against off.
    i_kept = {m: statistics.median(r[m][2] / r[m][1] for r in interleaved) for m, _ in AMPROBE_MODES}

    out = []
    out.append("| | |")
    out.append("|---|---|")
    out.append(row("CPU", f"{cpu_model()}, {os.cpu_count()} logical cores"))
    out.append(row("threads", f"{args.threads} on each side"))
    if others is not None:
        out.append(row("other load", f"other processes kept {others:.2f} of {os.cpu_count()} cores busy "
                                     f"on average during the runs (/proc/stat less this script's own)"))
    if have_torch:
        out.append(row("PyTorch", f"torch {versions[0]}, transformers {versions[1]}"))
    else:
        out.append(row("PyTorch", f"not found in {sys.executable} ({torch_err}); amprobe alone"))
    rev = git_rev()
    if rev:
        out.append(row("amprobe", f"git {rev}"))
    out.append(row("command", f"`{command}`"))
    if hf_models:
        out.append(row("Hugging Face models", f"{', '.join(HF_MODELS[m] for m in hf_models)} in "
                                              f"{', '.join(hf_modes)} (--models, --hf-modes)"))
    fp16_note = ""
    if have_torch:
        also = " (the models' too)" if hf_torch_fp16 else ""
        fp16_note = f"; PyTorch fp16{also}: 1 child x {args.torch_fp16_reps} steps"
    out.append(row("timing", f"median of {args.rounds} child process(es) x {args.reps} steps per configuration, "
                             f"after one warm-up step each{fp16_note}; {elapsed / 60:.1f} min in all"))
    out.append(row("steps paired in one process", f"{len(interleaved)} interleaved rounds ({args.rounds} "
                                                  f"child(ren) x {args.reps}), a probed, a full-statistics and an "
                                                  f"unprobed step of each mode per round"))
    out.append(row("probes on", "every op observed, op records kept for a step with a non-finite value (none "
                                "here): a step checks its outputs for non-finite values; \"every op's full "
                                "statistics\" is the cost of a step whose records are kept"))
    out.append(row("peak RSS", "ru_maxrss of each configuration's own process (os.wait4), largest over its runs"))
    if have_torch:
        out.append(row("PyTorch baseline", f"`import torch, transformers` alone peaks at {fmt_mib(import_kib)} MiB"))
    out.append("")

    head = ["configuration", "amprobe probes off ms", "amprobe probes on ms", "probes on / off (paired children)",
            "probes on / off (steps paired in one process)",
            "every op's full statistics / off (steps paired in one process)",
            "amprobe off / fp32 off (steps paired in one process)", "amprobe peak RSS MiB (off / on)"]
    if have_torch:
        head += ["PyTorch ms", "PyTorch peak RSS MiB", "amprobe off / PyTorch"]
    out.append(row(*head))
    out.append("|" + "---|" * len(head))
    rows = [(label, mode, torch_name) for torch_name, label, mode in TORCH_CONFIGS] if have_torch else \
        [(label, mode, None) for mode, label in AMPROBE_MODES]
    for label, mode, torch_name in rows:
        cells = [label]
        if mode:
            off, on = a_off[mode], a_on[mode]
            cells += [fmt_ms(off), fmt_ms(on), f"{a_probe[mode]:.3f}", f"{i_probe[mode]:.3f}", f"{i_kept[mode]:.3f}",
                      f"{i_vs32[mode]:.3f}", f"{fmt_mib(rss.get(('amprobe', mode, 'off')))} / {fmt_mib(rss.get(('amprobe', mode, 'on')))}"]
        else:
            cells += ["–"] * 7
        if have_torch:
            tm = med(("torch", torch_name))
            cells += [fmt_ms(tm), fmt_mib(rss.get(("torch", torch_name))),
                      f"{a_off[mode] / tm:.2f}" if mode else "–"]
        out.append(row(*cells))
    out.append("")

    out.append(row("goal", "measured", "target", "met"))
    out.append("|---|---|---|---|")

    # (The interleaved child's median mixes six configurations; it says nothing of noise.)
    noisy_keys = {k for k, v in child_medians.items() if k != ROUNDS and len(v) > 1 and max(v) > NOISY * min(v)}

    def goal(name, value, limit, keys=()):
        # A time goal whose configurations ran noisily gets "(noisy)" after its mark.
        mark = ("✓" if value <= limit else "✗") + (" (noisy)" if noisy_keys.intersection(keys) else "")
        out.append(row(name, f"{value:.3f}", f"<= {limit:.2f}", mark))

    t32, a32 = ("torch", "fp32"), ("amprobe", "fp32", "off")
    if have_torch:
        goal("amprobe fp32 probes off / PyTorch fp32 (time)", a_off["fp32"] / med(t32), GOAL_SPEED, (a32, t32))
    for m in ("fp16", "bf16"):
        goal(f"amprobe {m} probes off / amprobe fp32 probes off (time, steps paired in one process)", i_vs32[m],
             GOAL_SPEED)
    for m, _ in AMPROBE_MODES:
        goal(f"amprobe {m} probes on / probes off (time, steps paired in one process)", i_probe[m], GOAL_PROBES)
    if have_torch:
        for p in ("off", "on"):
            goal(f"amprobe fp32 probes {p} / PyTorch fp32 (peak RSS)", rss[("amprobe", "fp32", p)] / rss[t32],
                 GOAL_RSS)
    else:
        out.append("")
        out.append(f"PyTorch was not found ({torch_err}), so the PyTorch columns and the two goals against "
                   f"PyTorch are left out; run this script with a python that has torch and transformers.")

    if hf_models:
        out.append("")
        out.append("Hugging Face models (amprobe: benches/hf_step.rs; PyTorch: scripts/bench_hf_torch.py; "
                   "the T5-mini encoder is the table above):")
        out.append("")
        head = ["model", "mode", "amprobe probes off ms", "amprobe probes on ms", "probes on / off (paired)",
                "amprobe peak RSS MiB (off / on)", "PyTorch ms", "PyTorch peak RSS MiB", "amprobe off / PyTorch"]
        out.append(row(*head))
        out.append("|" + "---|" * len(head))
        for m in hf_models:
            for mode in hf_modes:
                off, on = med(("hf-amprobe", m, mode, "off")), med(("hf-amprobe", m, mode, "on"))
                tm = med(("hf-torch", m, mode))  # None where PyTorch did not run
                pr = paired(("hf-amprobe", m, mode, "on"), ("hf-amprobe", m, mode, "off"))
                out.append(row(HF_MODELS[m], HF_MODES[mode], fmt_ms(off), fmt_ms(on), f"{pr:.3f}",
                               f"{fmt_mib(rss.get(('hf-amprobe', m, mode, 'off')))} / "
                               f"{fmt_mib(rss.get(('hf-amprobe', m, mode, 'on')))}",
                               fmt_ms(tm), fmt_mib(rss.get(("hf-torch", m, mode))),
                               "–" if tm is None else f"{off / tm:.2f}"))
        out.append("")
        point = "each model's step on the CPU within the same ratio of PyTorch as the T5 encoder's"
        if have_torch and "fp32" in hf_modes:
            enc = a_off["fp32"] / med(t32)
            out.append(f"Goal \"{point}\": amprobe fp32 probes off / PyTorch fp32 of each model against the "
                       f"T5-mini encoder's from this run ({enc:.3f}); met (✓) when the model's ratio is at most "
                       f"the encoder's.")
            out.append("")
            out.append(row("model", "model: amprobe off / PyTorch (fp32)", "T5-mini encoder: amprobe off / PyTorch "
                           "(fp32)", "model / encoder", "met"))
            out.append("|---|---|---|---|---|")
            for m in hf_models:
                ka, kt = ("hf-amprobe", m, "fp32", "off"), ("hf-torch", m, "fp32")
                ratio = med(ka) / med(kt)
                mark = ("✓" if ratio <= enc else "✗") + \
                    (" (noisy)" if noisy_keys.intersection((ka, kt, a32, t32)) else "")
                out.append(row(HF_MODELS[m], f"{ratio:.3f}", f"{enc:.3f}", f"{ratio / enc:.3f}", mark))
        elif not have_torch:
            out.append(f"PyTorch was not found ({torch_err}), so the models' PyTorch cells are blank and the goal "
                       f"\"{point}\" is left out; run this script with a python that has torch and transformers.")
        else:
            out.append(f"The goal \"{point}\" compares fp32 steps; --hf-modes ({','.join(hf_modes)}) left fp32 "
                       f"out, so it is not shown.")
        if have_torch and "fp16" in hf_modes and not hf_torch_fp16:
            out.append("")
            out.append("PyTorch fp16 autocast of the models was not run (several seconds a step on the CPU), so its "
                       "cells are blank; --hf-torch-fp16 runs it.")
    if noisy_keys:
        ranges = [f"{labels[k]} {min(v):.0f}–{max(v):.0f} ms" for k, v in child_medians.items() if k in noisy_keys]
        out.append("")
        out.append(f"Note (noisy): the medians of single child processes differed by more than {NOISY - 1:.0%} "
                   f"for " + "; ".join(ranges) + ". The machine was probably busy; rerun on an idle one.")
    print("\n".join(out), flush=True)


if __name__ == "__main__":
    try:
        main()
    except BenchError as e:
        print(f"bench-cpu.py: error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("bench-cpu.py: interrupted", file=sys.stderr)
        sys.exit(130)
