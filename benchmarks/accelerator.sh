#!/usr/bin/env bash
# Every benchmark at accelerator sizes, each under a wall-clock cap (a capped run loses only
# its own figures), on one GPU/TPU. Logs and results JSON go to OUT_DIR.
#
#   benchmarks/accelerator.sh OUT_DIR [PYTHON]      # e.g. benchmarks/accelerator.sh /tmp/b .venv/bin/python
#
# DILOCO_JAX_COMMIT names the library's commit where the tree has no .git (a copied checkout).
# CAP_SCALE multiplies every cap (default 1: at most 7 min 35 s in all).
set -u
out=${1:?usage: benchmarks/accelerator.sh OUT_DIR [PYTHON]}
py=${2:-python3}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# The 150m round at B=4 needs ~57 GiB of temporaries (f32 attention scores for 4 workers).
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

# Batch sizes keep the paper-sized presets' rounds (M = 4 workers on one chip) under ~60 GiB.
bench overhead 200 overhead --reps 7
bench throughput_bf16 45 throughput --dtype bfloat16 --batch-size 32 --presets micro,tiny,small
bench throughput_bf16_60m 50 throughput --dtype bfloat16 --batch-size 8 --presets 60m
bench throughput_bf16_150m 60 throughput --dtype bfloat16 --batch-size 4 --presets 150m
bench scaling_h 50 scaling_h --reps 1
bench network 50 network --dtype bfloat16 --batch-size 8 --presets tiny,small,60m
echo "== done"
