#!/bin/bash
# one run, one machine: the planner before session 53 (6523c77) and at HEAD, back to back
run() {  # run LABEL SRC_DIR PLAN_ARGS...: one planner, its process time and the planning time it prints
  local label=$1 path=$2; shift 2
  local t0; t0=$(date +%s.%N)
  PYTHONPATH=$path /work/main/.venv/bin/python -m opengem.cli.main plan "$@" > "out_$label.txt" 2>&1
  local t1; t1=$(date +%s.%N)
  echo "$label $(echo "$t1 - $t0" | bc) s (process), $(grep 'planned in' "out_$label.txt")"
}
run before_4096 /tmp/s53/before/src --cluster h100 --gpus 4096
run after_4096 /work/main/src --cluster h100 --gpus 4096
run before_65536 /tmp/s53/before/src --cluster big1k.toml --gpus 65536
run after_65536 /work/main/src --cluster big1k.toml --gpus 65536
run after_1048576 /work/main/src --cluster big4k.toml
for n in 4096 65536; do
  if diff <(grep -v "planned in" "out_before_$n.txt") <(grep -v "planned in" "out_after_$n.txt") > /dev/null; then
    echo "$n: same plans"
  else
    echo "$n: PLANS DIFFER"
  fi
done
