#!/usr/bin/env bash
# The benchmarks at accelerator sizes, each under a wall-clock cap (a capped run loses only
# its own figures), on one GPU/TPU. Logs and results JSON go to OUT_DIR.
#
#   benchmarks/accelerator.sh OUT_DIR [PYTHON]      # e.g. benchmarks/accelerator.sh /tmp/b .venv/bin/python
#
# DILOCO_JAX_COMMIT names the library's commit in a copied tree (whose .git may be stale).
# CAP_SCALE multiplies every cap (default 1: the MFU part at most 8.5 min, the rest at most
# 10 min). ONLY=mfu runs just the MFU part. XLA_FLAGS is left as the caller sets it: XLA's
# default autotuning (level 4) is what the MFU figures need (the first H200 figures in
# benchmarks/README.md were taken with --xla_gpu_autotune_level=0: faster compiles, slower
# kernels).
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

# MFU of the paper's shapes in bf16 compute with float32 master weights (the defaults), at the
# per-worker batches benchmarks/memory.py fits to an H200: one worker (train_sync's step) at
# the batch M = 4 workers share, then DiLoCo and sync with M = 4 workers on the chip. Targets
# (issue 12): 150m sync M=1 >= 35% MFU, 60m >= 25%, DiLoCo M=4 within 5% of sync tokens/s.
mfu() {
    bench mfu_150m_sync1 150 throughput --presets 150m --dtype bfloat16 --batch-size 64 \
        --modes sync1 --samples 3 --profile "$out/traces"
    bench mfu_150m_m4 150 throughput --presets 150m --dtype bfloat16 --batch-size 16 \
        --modes diloco,sync --samples 3
    bench mfu_60m_sync1 100 throughput --presets 60m --dtype bfloat16 --batch-size 128 \
        --modes sync1 --samples 3 --profile "$out/traces"
    bench mfu_60m_m4 100 throughput --presets 60m --dtype bfloat16 --batch-size 32 \
        --modes diloco,sync --samples 3
}
mfu
[ "${ONLY:-}" = mfu ] && { echo "== done"; exit 0; }

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
