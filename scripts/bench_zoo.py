"""The zoo that `scripts/bench-capture.py --zoo` (or `--model NAME,...`) times: what the
PyTorch companion costs on real stacks, each model's variants interleaved round by round in
one process as the T5 benchmark's are, and printed per model and as one table.

    t5-mini            the T5-mini-sized encoder of capture_workload.Workload, the script's loop
    vit-tiny           timm vit_tiny_patch16_224, 2 blocks at 64 px, batch 8, the script's loop
    resnet             timm resnet18 at 64 px, batch 8, the script's loop
    gpt2-lora-trainer  GPT-2 (2 layers, n_embd 128) with PEFT LoRA, trained by transformers.Trainer
    lightning          a 2-layer transformer-encoder classifier trained by lightning.Trainer

Every model is built from its config (nothing is downloaded). The script's loop is
capture_workload.loop_times (SGD); the Trainer and Lightning run their own loops (AdamW,
SGD), bf16 mixed precision on the CPU (fp16 with their GradScaler on a GPU), each step
timed by a callback of the benchmark's own from the step's begin to its end, and watched
through amprobe_torch.TrainerCallback / LightningCallback; their anomaly variant is the
fit inside torch.autograd.set_detect_anomaly(True) (Lightning's
Trainer(detect_anomaly=True), as Lightning sets the mode itself). The first step of every run is
timed apart: it is the warm-up and watch's kept step (its full records)."""

import contextlib
import copy
import importlib
import logging
import os
import statistics
import time
import warnings

import torch

import amprobe_torch
import capture_workload
from capture_workload import ImageWorkload, Workload, loop_times, watch_options

ZOO = ("t5-mini", "vit-tiny", "resnet", "gpt2-lora-trainer", "lightning")
BOUND = 1.10  # the default mode's goal, by round, on every model


class LoopBench:
    """A workload of capture_workload trained by the script's own loop."""

    def __init__(self, name, work):
        self.name, self.work = name, work

    def describe(self):
        return f"{self.work.describe()}; the script's loop, SGD"

    def times(self, variant, steps, trace):
        return loop_times(self.work, self.work.model, variant, steps, trace)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


class _Clock:
    """Step times in ms, from a step's begin to its end, the device synced at both."""

    def __init__(self, device):
        self.device, self.times, self.t0 = device, [], None

    def begin(self):
        _sync(self.device)
        self.t0 = capture_workload.clock()

    def end(self):
        _sync(self.device)
        self.times.append((capture_workload.clock() - self.t0) * 1000.0)


def _anomaly(variant):
    """The fit's context: torch.autograd.set_detect_anomaly(True) for `anomaly`."""
    if variant != "anomaly":
        return contextlib.nullcontext()
    return torch.autograd.set_detect_anomaly(True)


class TrainerBench:
    """GPT-2 from `GPT2Config` with PEFT LoRA on its attention projections, a causal LM on
    one batch of random ids repeated, trained by `transformers.Trainer`."""

    def __init__(self, device, tmp, batch=4, seq=64, layers=2, embd=128):
        from peft import LoraConfig, get_peft_model
        from transformers import GPT2Config, GPT2LMHeadModel

        self.name, self.device, self.tmp = "gpt2-lora-trainer", torch.device(device), tmp
        self.batch, self.seq, self.layers, self.embd = batch, seq, layers, embd
        torch.manual_seed(0)
        cfg = GPT2Config(n_layer=layers, n_embd=embd, n_head=4, n_positions=seq,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["c_attn"],
                          fan_in_fan_out=True, task_type="CAUSAL_LM")
        self.base = get_peft_model(GPT2LMHeadModel(cfg), lora)
        self.ids = torch.randint(0, cfg.vocab_size, (batch, seq))

    def describe(self):
        return (f"GPT-2 {self.layers} layers, n_embd {self.embd}, LoRA r 8 on c_attn, batch {self.batch}, "
                f"seq {self.seq}; transformers.Trainer, AdamW")

    def times(self, variant, steps, trace):
        from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments

        clock = _Clock(self.device)

        class StepClock(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                clock.begin()

            def on_step_end(self, args, state, control, **kwargs):
                clock.end()

        callbacks = [StepClock()]
        if variant.startswith("watch"):
            callbacks.append(amprobe_torch.TrainerCallback(**watch_options(variant, trace)))
        cuda = self.device.type == "cuda"
        args = TrainingArguments(
            output_dir=os.path.join(self.tmp, "trainer"), max_steps=steps + 1,
            per_device_train_batch_size=self.batch, learning_rate=1e-3, bf16=not cuda, fp16=cuda,
            use_cpu=not cuda, report_to=[], save_strategy="no", logging_strategy="no",
            disable_tqdm=True, dataloader_pin_memory=False, seed=0)
        rows = [{"input_ids": i, "labels": i} for i in self.ids] * (steps + 1)
        trainer = Trainer(model=copy.deepcopy(self.base), args=args, train_dataset=rows, callbacks=callbacks)
        trainer.remove_callback(PrinterCallback)  # (its print of the run's metrics, every fit)
        with _anomaly(variant):
            trainer.train()
        return clock.times


def _lightning_module(L, net, lr):
    class Classifier(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = net

        def training_step(self, batch, index):
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x).float(), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=lr)

    return Classifier()


class _Encoder(torch.nn.Module):
    """A sequence classifier: `layers` transformer-encoder layers, mean-pooled, a linear head."""

    def __init__(self, width, layers, classes):
        super().__init__()
        layer = torch.nn.TransformerEncoderLayer(width, 4, 2 * width, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(width, classes)

    def forward(self, x):
        return self.head(self.encoder(x).mean(dim=1))


class LightningBench:
    """A LightningModule (`_Encoder`, 2 layers of width 128) on one batch of random
    sequences repeated, trained by `lightning.Trainer`."""

    def __init__(self, device, batch=16, seq=32, width=128, layers=2, classes=10):
        # (imported before its loggers are quietened: importing it sets them)
        importlib.import_module("lightning")

        self.name, self.device = "lightning", torch.device(device)
        self.batch, self.seq, self.width, self.layers = batch, seq, width, layers
        torch.manual_seed(0)
        self.base = _Encoder(width, layers, classes)
        self.x = torch.randn(batch, seq, width)
        self.y = torch.randint(0, classes, (batch,))
        # (Lightning's notes on a loader without workers and its device summary, every fit)
        for name in ("lightning.pytorch", "lightning.fabric"):
            logging.getLogger(name).setLevel(logging.ERROR)
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")

    def describe(self):
        return (f"{self.layers}-layer transformer encoder, width {self.width}, batch {self.batch}, seq "
                f"{self.seq}; lightning.Trainer, SGD")

    def times(self, variant, steps, trace):
        import lightning as L

        clock = _Clock(self.device)

        class StepClock(L.Callback):
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                clock.begin()

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                clock.end()

        callbacks = [StepClock()]
        if variant.startswith("watch"):
            callbacks.append(amprobe_torch.LightningCallback(**watch_options(variant, trace)))
        cuda = self.device.type == "cuda"
        trainer = L.Trainer(
            accelerator="gpu" if cuda else "cpu", devices=1, precision="16-mixed" if cuda else "bf16-mixed",
            max_steps=steps + 1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, callbacks=callbacks, detect_anomaly=variant == "anomaly")
        data = torch.utils.data.TensorDataset(self.x.repeat(steps + 1, 1, 1), self.y.repeat(steps + 1))
        loader = torch.utils.data.DataLoader(data, batch_size=self.batch)
        # (Lightning sets anomaly mode itself around its fit, from `detect_anomaly`)
        trainer.fit(_lightning_module(L, copy.deepcopy(self.base), 0.01), loader)
        return clock.times


def make(name, device, tmp):
    """The bench of the zoo's model `name`."""
    if name == "t5-mini":
        return LoopBench(name, Workload(device, "mini"))
    if name in ImageWorkload.MODELS:
        return LoopBench(name, ImageWorkload(device, name))
    if name == "gpt2-lora-trainer":
        return TrainerBench(device, tmp)
    if name == "lightning":
        return LightningBench(device)
    raise ValueError(f"no model {name!r} in the zoo ({', '.join(ZOO)})")


def measure(bench, variants, rounds, steps, tmp):
    """Each variant's timed steps (all rounds), first steps, and per round: the ratio of
    its median step to eager's, and of its run's whole time (first step included) to
    eager's. The variants are interleaved round by round."""
    r = {k: {v: [] for v in variants} for k in ("timed", "first", "ratio", "run")}
    for rnd in range(rounds):
        med, total = {}, {}
        for v in variants:
            trace = os.path.join(tmp, f"{bench.name}-{v}-{rnd}.jsonl")
            t = bench.times(v, steps, trace)
            if len(t) != steps + 1:
                raise RuntimeError(f"{bench.name} {v}: {len(t)} steps timed, not {steps + 1}")
            if os.path.exists(trace):
                os.remove(trace)
            r["first"][v].append(t[0])
            r["timed"][v].extend(t[1:])
            med[v], total[v] = statistics.median(t[1:]), sum(t)
        for v in variants:
            r["ratio"][v].append(med[v] / med["eager"])
            r["run"][v].append(total[v] / total["eager"])
    return r


def print_model(bench, r, variants):
    print(f"\n{bench.name}: {bench.describe()}")
    eager = statistics.median(r["timed"]["eager"])
    print(f"{'variant':<12} {'median ms':>10} {'min ms':>9} {'/ eager':>8} {'by round':>9} "
          f"{'first ms':>9} {'run ×':>7}")
    for v in variants:
        m = statistics.median(r["timed"][v])
        print(f"{v:<12} {m:>10.2f} {min(r['timed'][v]):>9.2f} {m / eager:>8.2f} "
              f"{statistics.median(r['ratio'][v]):>9.2f} {statistics.median(r['first'][v]):>9.1f} "
              f"{statistics.median(r['run'][v]):>7.2f}")


def print_summary(results, variants):
    cols = [v for v in variants if v != "eager"]
    print("\n| model | plain ms/step | " + " | ".join(f"{v} ×" for v in cols)
          + " | first step ms (plain / watch) | watch run × | watch ≤ 1.10× |")
    print("|---|---:|" + "---:|" * len(cols) + "---:|---:|:---:|")
    for name, r in results:
        by = {v: statistics.median(r["ratio"][v]) for v in cols}
        first = " / ".join(f"{statistics.median(r['first'][v]):.1f}" for v in ("eager", "watch") if v in variants)
        run = f"{statistics.median(r['run']['watch']):.2f}" if "watch" in variants else ""
        ok = ("yes" if by["watch"] <= BOUND else "no") if "watch" in variants else ""
        print(f"| {name} | {statistics.median(r['timed']['eager']):.2f} | "
              + " | ".join(f"{by[v]:.2f}" for v in cols) + f" | {first} | {run} | {ok} |")
    print("×: the median over rounds of each round's median step over eager's (the first step of each run "
          "apart); run ×: a whole run, first step included, over eager's")


def main(names, variants, rounds, steps, device, tmp):
    """Measures and prints every model of `names` in turn, then the table of them all."""
    warnings.filterwarnings("ignore", message="Anomaly Detection has been enabled")
    load = os.getloadavg()
    clock = "CPU time of the process" if capture_workload.clock is not time.perf_counter else "wall clock"
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs visible, {torch.get_num_threads()} threads, {clock}, "
          f"device {device}; {rounds} rounds x "
          f"{steps} timed steps (+1 first) per variant, interleaved; load average before "
          + ", ".join(f"{x:.2f}" for x in load))
    results = []
    for name in names:
        bench = make(name, device, tmp)
        r = measure(bench, variants, rounds, steps, tmp)
        print_model(bench, r, variants)
        results.append((name, r))
    print_summary(results, variants)
    print("load average after " + ", ".join(f"{x:.2f}" for x in os.getloadavg()))
