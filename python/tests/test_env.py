"""The companion's environment variables: a value a variable does not take is refused with
a message naming the variable and what it takes, by `watch` in a script run without the
CLI, and by the CLI before the command starts."""

import os
import subprocess
import sys

import pytest
import torch

import amprobe_torch
from amprobe_torch import _env
from test_watch import amprobe_bin

BAD = [
    ("AMPROBE_SAMPLE_EVERY", "abc", "a whole number of steps, 0 or more"),
    ("AMPROBE_SAMPLE_EVERY", "-3", "a whole number of steps, 0 or more"),
    ("AMPROBE_SAMPLE_EVERY", "2.5", "a whole number of steps, 0 or more"),
    ("AMPROBE_CHECK", "sometimes", "`modules` (the default) or `ops`"),
    ("AMPROBE_DISABLE", "yes", "1 (on) or 0 (off)"),
]


def watch(tmp_path):
    model = torch.nn.Linear(2, 2)
    return amprobe_torch.watch(model, torch.optim.SGD(model.parameters(), lr=0.1), None, trace=str(tmp_path / "t"))


@pytest.mark.parametrize("name,value,takes", BAD)
def test_watch_refuses_a_bad_value_naming_the_variable(tmp_path, monkeypatch, name, value, takes):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError) as e:
        watch(tmp_path)
    assert str(e.value).startswith(f"{name}={value!r}") and takes in str(e.value), e.value


def test_good_values_are_taken(tmp_path, monkeypatch):
    monkeypatch.setenv("AMPROBE_SAMPLE_EVERY", "3")
    monkeypatch.setenv("AMPROBE_DISABLE", "0")
    w = watch(tmp_path)
    try:
        assert w is not None and w.sample_every == 3
    finally:
        w.close()


@pytest.mark.parametrize("bad", [-3, 1.5, "2", True])
def test_watch_refuses_a_bad_sample_every_argument(tmp_path, bad):
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="sample_every= takes a whole number"):
        amprobe_torch.watch(model, torch.optim.SGD(model.parameters(), lr=0.1), sample_every=bad,
                            trace=str(tmp_path / "t"))


@pytest.mark.parametrize("value", ["\u00b2", "1\u00b2", "\u0663", "\uff11\uff12", "9" * 4301, "18446744073709551616"])
def test_sample_every_takes_what_the_cli_takes_and_refuses_the_rest_naming_it(value):
    # Found by scripts/fuzz_env.py: int()'s own message for "²" and 4301 digits, and other
    # scripts' digits taken where the CLI refuses them.
    with pytest.raises(ValueError, match="^AMPROBE_SAMPLE_EVERY=.*a whole number of steps"):
        _env.sample_every({"AMPROBE_SAMPLE_EVERY": value})


def test_sample_every_reads_leading_zeros_and_the_largest_count():
    assert _env.sample_every({"AMPROBE_SAMPLE_EVERY": "0" * 5000 + "7"}) == 7
    assert _env.sample_every({"AMPROBE_SAMPLE_EVERY": "18446744073709551615"}) == 2**64 - 1


def test_the_fuzzer_of_these_readers_finds_nothing():
    # scripts/fuzz.sh runs it with ten million values per variable; here a few thousand.
    script = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "fuzz_env.py")
    r = subprocess.run([sys.executable, script, "3000", "--jobs", "1"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "AMPROBE_INIT_SCALE | 3,000" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("name,value,takes", [
    ("AMPROBE_SAMPLE_EVERY", "abc", "a whole number of steps, 0 or more"),
    ("AMPROBE_SAMPLE_EVERY", "-3", "a whole number of steps, 0 or more"),
    ("AMPROBE_CHECK", "sometimes", "one of modules, ops"),
    ("AMPROBE_DISABLE", "yes", "1 (on) or 0 (off)"),
    ("AMPROBE_AUTOCAST", "fp8", "one of fp16, bf16, fp32"),
    ("AMPROBE_INIT_SCALE", "-1", "a positive finite number"),
])
def test_the_cli_refuses_a_bad_value_before_the_command_starts(tmp_path, name, value, takes):
    marker = tmp_path / "started"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env[name] = value
    r = subprocess.run([amprobe_bin(), "run", "--trace", str(tmp_path / "t.jsonl"), "--",
                        sys.executable, "-c", f"open({str(marker)!r}, 'w')"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"error: {name}={value!r}".replace("'", '"') in r.stderr and takes in r.stderr, r.stderr
    assert not marker.exists()
