#!/usr/bin/env bash
# Drives the real `amprobe tui` in tmux, as a person would, and checks the captured panes:
#   1. a live run: waits for steps, switches panels, jumps to the first non-finite op,
#      opens its details and the help, quits while the run goes on; the terminal is back
#      in cooked mode with echo afterwards, and colours were used;
#   2. a replay of the trace that run left (no end record) with NO_COLOR set: no colour
#      codes; then a panic on the UI thread (test hook) still restores the terminal.
#   3. with --device: only a live run of the T5 overflow sample with --backend cuda (on a GPU
#      or the simulated device): it names the device, and the first Inf and first NaN it
#      shows are the emulator's.
# Usage: scripts/tui-tmux-test.sh [path/to/amprobe] [--device]   (default: target/release/amprobe)
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
bin=${1:-$root/target/release/amprobe}
mode=${2:-}
[ -x "$bin" ] || { echo "tui-tmux-test: no binary at $bin (cargo build --release)" >&2; exit 2; }
command -v tmux >/dev/null || { echo "tui-tmux-test: tmux is not installed" >&2; exit 2; }

work=$(mktemp -d)
sock="amprobe-tui-test-$$"
tm() { tmux -L "$sock" -f /dev/null "$@"; }
cleanup() { tm kill-server 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT

fail() {
    echo "tui-tmux-test: FAIL: $*" >&2
    echo "---- last pane ----" >&2
    cat "$work/pane.txt" >&2 2>/dev/null || true
    exit 1
}

capture() { tm capture-pane -p -t "$1" > "$work/pane.txt"; }

# wait_for TARGET REGEX [SECONDS]: polls the pane until REGEX (grep -E) matches.
wait_for() {
    local target=$1 re=$2 limit=${3:-20}
    local t0=$(date +%s%N)
    while true; do
        capture "$target"
        if grep -Eq -- "$re" "$work/pane.txt"; then
            waited_ms=$(( ($(date +%s%N) - t0) / 1000000 ))
            return 0
        fi
        if (( ($(date +%s%N) - t0) / 1000000000 >= limit )); then
            fail "waited ${limit}s for /$re/ in $target"
        fi
        sleep 0.02
    done
}

# wait_gone TARGET REGEX [SECONDS]: polls the pane until REGEX no longer matches.
wait_gone() {
    local target=$1 re=$2 limit=${3:-5}
    local t0=$(date +%s%N)
    while true; do
        capture "$target"
        grep -Eq -- "$re" "$work/pane.txt" || return 0
        if (( ($(date +%s%N) - t0) / 1000000000 >= limit )); then
            fail "/$re/ still shown after ${limit}s in $target"
        fi
        sleep 0.02
    done
}

# expect TARGET MESSAGE GREP-ARGS...: the pane shows what grep GREP-ARGS matches, within
# three seconds. A live UI redraws while tmux is captured, so one capture can hold half a
# frame; a second look decides, and only a frame that never shows it fails.
expect() {
    local target=$1 msg=$2
    shift 2
    local t0=$(date +%s%N)
    while ! grep -q "$@" "$work/pane.txt"; do
        (( ($(date +%s%N) - t0) / 1000000000 >= 3 )) && fail "$msg"
        sleep 0.05
        capture "$target"
    done
}

# key TARGET KEY REGEX: sends a key and waits for its answer; the answer must come within
# a second (polling and tmux included; the UI's own bound, 100 ms, is tested in Rust).
key() {
    tm send-keys -t "$1" "$2"
    wait_for "$1" "$3" 5
    (( waited_ms < 1000 )) || fail "key $2 answered after ${waited_ms} ms"
    echo "  key $2 → /$3/ in ${waited_ms} ms"
}

if [ "$mode" = "--device" ]; then
    echo "tui-tmux-test: 3. live run on the device"
    tm new-session -d -s device -x 110 -y 30 \
        "cd '$work' && TERM=xterm-256color '$bin' tui '$root/samples/t5_overflow.toml' --backend cuda --trace device.jsonl;
         echo TUI-EXIT=\$?; sleep 600"
    wait_for device 'status +finished' 120
    expect device "the device is not named" -E 'backend +cuda on '
    expect device "not the emulator's first Inf" \
        -E 'first Inf +step 0 · fwd #201 linear @ encoder.block.3.layer.1.DenseReluDense.wo'
    expect device "not the emulator's first NaN" \
        -E 'first NaN +step 0 · fwd #208 mul @ encoder.final_layer_norm'
    key device 4 '\[4 Ops\]'
    key device f 'first non-finite: step 0 #201'
    tm send-keys -t device q
    wait_for device 'TUI-EXIT=0' 10
    echo "tui-tmux-test: ok"
    exit 0
fi

# A model big enough that steps take milliseconds; the first steps overflow (scale 1e30).
cat > "$work/run.toml" <<'EOF'
[model]
kind = "mlp"
inputs = 512
hidden = 2048
classes = 10
[data]
batch = 64
[train]
precision = "fp16"
steps = 5000
optimizer = "sgd"
lr = 0.01
EOF

echo "tui-tmux-test: 1. live run"
tm new-session -d -s live -x 100 -y 30 \
    "cd '$work' && TERM=xterm-256color '$bin' tui run.toml --init-scale 1e30 --trace live.jsonl;
     echo TUI-EXIT=\$?; stty -a > stty-live.txt; sleep 600"
wait_for live 'running · [1-9][0-9]*/5000 steps' 60
tm capture-pane -e -p -t live > "$work/colour.txt"
grep -q $'\e\\[[0-9;]*3[1-6]m\|\e\\[[0-9;]*38;5' "$work/colour.txt" || fail "no colour in a colour terminal"
key live 2 '\[2 Scale\]'
expect live "no scale chart" -F 'loss scale (log2)'
expect live "no 2^k axis labels" -E '│2\^[0-9]+ *│'
key live 3 '\[3 Layers\]'
expect live "no layer table" -F 'max|g|'
key live 4 '\[4 Ops\]'
key live f 'first non-finite: step 0 #[0-9]+'
expect live "the first Inf op is not the selected row" -F '▸I'
key live Enter 'origin +first Inf of step 0'
expect live "no histogram in the details" -F 'exponent histogram'
key live '?' 'any key closes this help'
tm send-keys -t live Escape
wait_gone live 'any key closes this help'
expect live "Esc on the help closed more than the help" -E 'origin +first Inf of step 0'
key live 1 '\[1 Overview\]'
expect live "no first-Inf card" -E 'first Inf +step 0 · bwd'
expect live "the run is no longer live" -E 'running · [0-9]+/5000'
before=$(grep -Eo 'running · [0-9]+' "$work/pane.txt" | grep -Eo '[0-9]+$')
sleep 0.5
wait_for live 'running · [0-9]+/5000'
after=$(grep -Eo 'running · [0-9]+' "$work/pane.txt" | grep -Eo '[0-9]+$')
(( after > before )) || fail "steps stopped arriving ($before then $after)"
tm send-keys -t live q
wait_for live 'TUI-EXIT=0' 10
grep -q '\[1 Overview\]' "$work/pane.txt" && fail "the UI is still on screen after quitting"
grep -q 'left while the run was at step' "$work/pane.txt" || fail "no note about the stopped run"
sleep 0.3
grep -qw -- '-icanon' "$work/stty-live.txt" && fail "terminal left in raw mode"
grep -qw -- '-echo' "$work/stty-live.txt" && fail "terminal left without echo"

echo "tui-tmux-test: 2. replay without colour, then a panic"
tm new-session -d -s replay -x 80 -y 24 \
    "cd '$work' && NO_COLOR=1 RUST_BACKTRACE=0 AMPROBE_TUI_PANIC_KEY=P '$bin' tui --trace live.jsonl;
     echo TUI-EXIT=\$?; stty -a > stty-panic.txt; sleep 600"
wait_for replay 'replay live.jsonl · (no end record|TRUNCATED)' 20
tm capture-pane -e -p -t replay > "$work/plain.txt"
grep -q $'\e\\[[0-9;]*3[1-7]m\|\e\\[[0-9;]*38;[25]\|\e\\[[0-9;]*4[0-7]m' "$work/plain.txt" \
    && fail "colour codes with NO_COLOR set"
key replay 4 '\[4 Ops\]'
tm send-keys -t replay P
wait_for replay 'TUI-EXIT=101' 10
grep -q "panicked at" "$work/pane.txt" || fail "the panic message is not shown"
grep -q "^TUI-EXIT=101" "$work/pane.txt" || fail "output after the panic overwrote it"
sleep 0.3
grep -qw -- '-icanon' "$work/stty-panic.txt" && fail "terminal left in raw mode after a panic"
grep -qw -- '-echo' "$work/stty-panic.txt" && fail "terminal left without echo after a panic"

echo "tui-tmux-test: ok"
