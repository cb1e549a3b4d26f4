#!/usr/bin/env bash
# One GPU-machine session: GPU tests and benchmarks, every log and result bundled into one archive.
#   usage: benchmarks/gpu_session.sh OUT_DIR BUDGET_SECONDS STEP...
#   STEP: tests:<pytest path> | quick:<family> | full:<family> | train:<preset>, optionally @SECONDS
#   to cap that step (e.g. quick:jfa@75)
#   (train: 150 steps of `opengem train` on the GPU, metrics.jsonl kept; steady-state samples/s is read
#   from the later log windows)
# Each step gets at most what is left of the budget, so the call ends inside the device's time limit.
set -u
out=$1; budget=$2; shift 2
export PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
work=$(mktemp -d)
mkdir -p "$work/logs" "$work/results"
nvidia-smi > "$work/logs/nvidia-smi.txt" 2>&1
python -c 'import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())' \
  > "$work/logs/versions.txt" 2>&1
deadline=$((SECONDS + budget))
for step in "$@"; do
  kind=${step%%:*}; target=${step#*:}; cap=
  case $target in *@*) cap=${target##*@}; target=${target%@*} ;; esac
  left=$((deadline - SECONDS))
  if [ -n "$cap" ] && [ "$cap" -lt "$left" ]; then left=$cap; fi
  if [ "$left" -lt 20 ]; then echo "SKIPPED (budget) $step"; continue; fi
  name=$(echo "$step" | tr '/:.' '___')
  start=$SECONDS
  case $kind in
    tests) timeout "$left" python -m pytest -q -n 4 -p no:cacheprovider "$target" > "$work/logs/$name.log" 2>&1 ;;
    quick) timeout "$left" python -m "benchmarks.$target" --quick > "$work/logs/$name.log" 2>&1 ;;
    full) timeout "$left" python -m "benchmarks.$target" > "$work/logs/$name.log" 2>&1 ;;
    train) timeout "$left" python -m opengem.cli.main train --preset "$target" --steps 150 --no-progress \
             --set eval_every=100000 --set eval_samples=4000 --set "out_dir=$work/runs" > "$work/logs/$name.log" 2>&1 ;;
  esac
  rc=$?
  echo "rc=$rc $((SECONDS - start))s $step :: $(tail -n 1 "$work/logs/$name.log")"
  echo "rc=$rc seconds=$((SECONDS - start)) $step" >> "$work/logs/steps.txt"
done
cp benchmarks/results/*.json "$work/results/" 2>/dev/null
tar czf "$out/session.tar.gz" -C "$work" .
