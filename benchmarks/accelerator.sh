#!/usr/bin/env bash
# The benchmarks at accelerator sizes, each under a wall-clock cap (a capped run loses only
# its own figures), on one GPU/TPU. Logs and results JSON go to OUT_DIR.
#
#   benchmarks/accelerator.sh OUT_DIR [PYTHON]      # e.g. benchmarks/accelerator.sh /tmp/b .venv/bin/python
#
# DILOCO_JAX_COMMIT names the library's commit in a copied tree (whose .git may be stale).
# CAP_SCALE multiplies every cap (default 1: at most 10 min in all). The H200 figures in
# benchmarks/README.md were taken with XLA_FLAGS=--xla_gpu_autotune_level=0 (faster compiles).
set -u
out=${1:?usage: benchmarks/accelerator.sh OUT_DIR [PYTHON]}
py=${2:-python3}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}
scale=${CAP_SCALE:-1}

# bench NAME CAP_SECONDS SCRIPT ARGS...: runs benchmarks/SCRIPT.py, keeps its log and JSON.
bench() {
    local name=$1 cap=$2 script=$3
    shift 3
    echo "== $name: $script.py $* (cap ${cap}s x $scale)"
    local start=$SECONDS
    timeout "$(awk "BEGIN {print int($cap * $scale)}")" "$py" "benchmarks/$script.py" "$@" \
        >"$out/$name.txt" 2>&1
    local rc=$?
    cat "$out/$name.txt"
    echo "== $name: exit $rc after $((SECONDS - start)) s"
    [ $rc -eq 0 ] && cp "benchmarks/results/$script.json" "$out/$name.json"
}

"$py" -c 'import jax, flax, optax; print("jax", jax.__version__, "flax", flax.__version__,
"optax", optax.__version__, jax.devices())'
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,clocks.max.sm \
    --format=csv,noheader

# Compiles take ~7-10 s a program on an H200 even without autotuning (README, Findings 6):
# the caps below fit that, in order of what the README still lacks. Batch sizes keep the 60m
# round (M = 4 workers on one chip) at ~28 GiB of temporaries.
bench scaling_h 90 scaling_h --reps 1
bench network 100 network --dtype bfloat16 --batch-size 8 --presets tiny,small,60m
bench overhead 200 overhead --quick --reps 5
bench throughput_bf16_60m 110 throughput --dtype bfloat16 --batch-size 8 --presets 60m \
    --samples 2 --profile "$out/traces"
bench throughput_bf16 100 throughput --dtype bfloat16 --batch-size 32 --presets micro,tiny,small
echo "== done"
