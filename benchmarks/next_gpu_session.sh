#!/usr/bin/env bash
# The measurements waiting for a GPU (benchmarks/NOTES.md, "Waiting for the next GPU session"), each step
# capped so that a part fits one 600 s device call. On a 2-GPU host the two chains of a part run side by
# side, one per GPU; on one GPU they run one after the other (then a part needs two calls).
#   bash benchmarks/next_gpu_session.sh OUT_DIR PART   (PART = 1, 2, 3 or 4)
# 1: GPU tests + gem_curves (GPU 0) | gem-large 1-GPU baseline, calibration, kernel benchmarks (GPU 1)
# 2: gem_curves, GPU tests (GPU 0) | failed GPU tests again, calibration, 1-GPU loss curves (GPU 1)
# 3: issue 11 on 2 GPUs: the FSDP loss curve, every layout of gem-large, FSDP with the SM-free all-gather
# 4: gem-small bench train with layers | with fp8 MLPs
# 5: the session-3 fixes: FP8 attention GPU tests | bench train test; gem-large FSDP/HSDP on 2 GPUs
# The device returns at most 8 files: logs and result JSON go to OUT_DIR/results.tgz, the one-line status
# per step to OUT_DIR/status (also printed).
set -u
final=$1; part=$2
out=$final/work
export PYTHONPATH=src:. PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$out/logs" "$out/results"
gpus=$(python -c "import torch; print(torch.cuda.device_count())")
step() {  # step NAME SECONDS COMMAND...   (appends its status line to $out/status)
  local name=$1 cap=$2; shift 2
  local start=$SECONDS
  timeout "$cap" bash -c '"$@"' _ "$@" > "$out/logs/$name.log" 2>&1  # bash -c: the command may be a function
  local rc=$?
  echo "rc=$rc $((SECONDS - start))s $name :: $(tail -n 1 "$out/logs/$name.log" | cut -c1-200)" >> "$out/status"
  tar czf "$final/results.tgz" -C "$out" logs results status 2>/dev/null  # a call cut short keeps what finished
}
on_gpu() {  # on_gpu INDEX FUNCTION: the chain on one GPU (in the background when there are two)
  if [ "$gpus" -ge 2 ]; then (export CUDA_VISIBLE_DEVICES=$1; $2) & else $2; fi
}
tests() { python -m pytest -v -n 4 -p no:cacheprovider --timeout 170 --tb=short "$@"; }
train() { python -m opengem.cli.main "$@"; }
multi() { local n=$1; shift; python -m torch.distributed.run --standalone --nproc-per-node "$n" -m benchmarks.multi_gpu "$@"; }
large_single() {  # large_single BATCH NAME: gem-large on one GPU with the multi-GPU harness (part 2's baseline)
  multi 1 --preset gem-large --layouts single --batch-per-gpu "$1" --warmup 6 --steps 10 --out "$out/results/$2.json"
}
chain_1a() {
  step fixed_failures 140 tests tests/gpu/test_embedding_gpu.py::test_hot_row_many_duplicates \
    tests/gpu/test_train_distributed_gpu.py tests/gpu/test_flops_gpu.py tests/gpu/test_step_sync_gpu.py
  step new_gpu_tests 110 tests tests/gpu/test_fp8_attention_gpu.py tests/gpu/test_calibrate_gpu.py \
    tests/gpu/test_gem_curves_gpu.py tests/gpu/test_block_attention_gpu.py
  step gem_curves 290 python -m benchmarks.gem_curves --no-control
}
chain_2a() {
  step gem_curves 400 python -m benchmarks.gem_curves --no-control
  step new_gpu_tests 110 tests tests/gpu/test_fp8_attention_gpu.py tests/gpu/test_calibrate_gpu.py \
    tests/gpu/test_gem_curves_gpu.py tests/gpu/test_block_attention_gpu.py
}
chain_2b() {
  step retests 190 tests tests/gpu/test_flops_gpu.py::test_bench_train_on_the_gpu tests/gpu/test_train_distributed_gpu.py \
    tests/gpu/test_flops_gpu.py::test_analytic_flops_equal_the_flop_counter_on_the_triton_path
  step calibrate 40 train bench calibrate --quick --out "$out/results/calibration_quick.json"
  step curve_single 130 curves_single --out "$out/results/curve_single.json"
  step curve_single_fp32 150 curves_single --set precision=fp32 --out "$out/results/curve_single_fp32.json"
}
chain_1b() {
  step large_single 200 large_single 256 multi_gpu_single
  step calibrate 60 train bench calibrate --quick --out "$out/results/calibration_quick.json"
  step large_single_b512 120 large_single 512 multi_gpu_single_b512
  step host_profile 90 python -m benchmarks.step_profile --runs gem-small:2048:bf16:compile:fresh:host:noprofile \
    --steps 6 --out "$out/results"
  step block_attention 60 python -m benchmarks.block_attention --quick
}
curves_single() {
  multi 1 --curve --preset gem-small --layouts single --batch-per-gpu 1024 --warmup 1 --steps 199 \
    --set compile=false "$@"
}
chain_3c() {
  step bench_train 150 train bench train --preset gem-small --batch-size 2048 --compile \
    --steps 20 --warmup 8 --num-workers 12 --with-layers --out "$out/results/train_gem-small.json"
}
chain_3d() {
  step fp8_mlp_train 130 train bench train --preset gem-small --batch-size 2048 --compile \
    --steps 20 --warmup 8 --num-workers 12 --low-precision-mlp fp8_rowwise --out "$out/results/train_gem-small_fp8.json"
}
export out
export -f tests train multi large_single curves_single
chain_5a() { step fp8_tests 85 tests tests/gpu/test_fp8_attention_gpu.py; }
chain_5b() { step bench_train_test 85 python -m pytest -x -p no:cacheprovider --tb=long tests/gpu/test_flops_gpu.py::test_bench_train_on_the_gpu; }
if [ "$part" = 1 ]; then
  on_gpu 0 chain_1a; on_gpu 1 chain_1b; wait
elif [ "$part" = 2 ]; then
  on_gpu 0 chain_2a; on_gpu 1 chain_2b; wait
elif [ "$part" = 3 ]; then
  step curve_fsdp 110 multi "$gpus" --curve --preset gem-small --layouts fsdp --batch-per-gpu $((1024 / gpus)) \
    --warmup 1 --steps 199 --set compile=false --out "$out/results/curve_fsdp.json"
  step layouts 340 multi "$gpus" --preset gem-large --layouts fsdp,hsdp,expert,sparse2d,sparse1d --batch-per-gpu 256 \
    --warmup 4 --steps 8 --single-gpu-mfu "${SINGLE_GPU_MFU:?the 1-GPU E2E MFU of part 1}" --out "$out/results/multi_gpu.json"
  step copy_engine 100 multi "$gpus" --preset gem-large --layouts fsdp --batch-per-gpu 256 --warmup 4 --steps 8 \
    --collectives copy_engine --single-gpu-mfu "$SINGLE_GPU_MFU" --out "$out/results/multi_gpu_copy_engine.json"
elif [ "$part" = 4 ]; then
  on_gpu 0 chain_3c; on_gpu 1 chain_3d; wait
else
  on_gpu 0 chain_5a; on_gpu 1 chain_5b; wait
  step layouts 130 multi "$gpus" --preset gem-large --layouts fsdp,hsdp --batch-per-gpu 256 \
    --warmup 3 --steps 5 --single-gpu-mfu "${SINGLE_GPU_MFU:?the 1-GPU E2E MFU of part 1}" --out "$out/results/multi_gpu.json"
fi
cp benchmarks/results/*.json benchmarks/results/*.png "$out/results/" 2>/dev/null
cp "$out/status" "$final/status"
tar czf "$final/results.tgz" -C "$out" . && rm -rf "$out"
cat "$final/status"
