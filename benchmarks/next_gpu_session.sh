#!/usr/bin/env bash
# The measurements waiting for a GPU (benchmarks/NOTES.md, "Waiting for the next GPU session"), in order
# of value, each capped so that a part fits one 600 s device call:
#   bash benchmarks/next_gpu_session.sh OUT_DIR PART   (PART = 1, 2 or 3)
# Logs and result JSON go to OUT_DIR; a one-line status per step is printed at the end.
set -u
out=$1; part=$2
export PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 OMP_NUM_THREADS=4
mkdir -p "$out/logs" "$out/results"
status=()
step() {  # step NAME SECONDS COMMAND...
  local name=$1 cap=$2; shift 2
  local start=$SECONDS
  timeout "$cap" "$@" > "$out/logs/$name.log" 2>&1
  local rc=$?
  status+=("rc=$rc $((SECONDS - start))s $name :: $(tail -n 1 "$out/logs/$name.log" | cut -c1-160)")
}
tests() { python -m pytest -v -n 4 -p no:cacheprovider "$@"; }
if [ "$part" = 1 ]; then
  step fixed_failures 150 tests tests/gpu/test_embedding_gpu.py::test_hot_row_many_duplicates \
    tests/gpu/test_train_distributed_gpu.py tests/gpu/test_flops_gpu.py tests/gpu/test_step_sync_gpu.py
  step new_gpu_tests 120 tests tests/gpu/test_fp8_attention_gpu.py tests/gpu/test_calibrate_gpu.py \
    tests/gpu/test_gem_curves_gpu.py tests/gpu/test_block_attention_gpu.py
  step host_profile 100 python -m benchmarks.step_profile --runs gem-small:2048:bf16:compile:fresh:host:noprofile \
    --steps 6 --out "$out/results"
  step bench_train 150 python -m opengem.cli.main bench train --preset gem-small --batch-size 2048 --compile \
    --steps 20 --warmup 8 --num-workers 12 --with-layers --out "$out/results/train_gem-small.json"
elif [ "$part" = 2 ]; then
  step gem_curves 300 python -m benchmarks.gem_curves --no-control
  step attention_fp8 60 python -m benchmarks.attention_fp8 --quick
  step block_attention 70 python -m benchmarks.block_attention --quick
  step fp8_mlp_train 110 python -m opengem.cli.main bench train --preset gem-small --batch-size 2048 --compile \
    --steps 20 --warmup 8 --num-workers 12 --low-precision-mlp fp8_rowwise --out "$out/results/train_gem-small_fp8.json"
else
  step calibrate 60 python -m opengem.cli.main bench calibrate --quick --out "$out/results/calibration_quick.json"
  step gem_large 200 python -m opengem.cli.main bench train --preset gem-large --compile --steps 10 --warmup 5 \
    --num-workers 12 --out "$out/results/train_gem-large.json"
  step jfa_full 300 python -m benchmarks.jfa
fi
cp benchmarks/results/*.json "$out/results/" 2>/dev/null
printf '%s\n' "${status[@]}"
