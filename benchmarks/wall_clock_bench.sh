#!/usr/bin/env bash
# Wall-clock of the demo and of the cpu_math run at two commits, run back to back on one machine
# (issue 37: nothing of the trust work may cost either more than 5%). Run by hand, alone:
#
#   benchmarks/wall_clock_bench.sh BASE_REV [OUT_DIR]
#
# BASE_REV is checked out in a throw-away worktree; the working tree is the other side. Both
# use this checkout's .venv (run from their own directory, each imports its own code). Each side
# makes its own wordmath data and checkpoint first (`reval make-data`, `reval make-model`, as in
# docs/demo.md; not timed), then `reval train` of configs/demo.toml and configs/cpu_math.toml is
# timed. Prints one line per run: side, config, exit status, seconds, and the run's success line.
set -euo pipefail
base=${1:?usage: wall_clock_bench.sh BASE_REV [OUT_DIR]}
root=$(cd "$(dirname "$0")/.." && pwd)
out=${2:-$(mktemp -d /tmp/reval-wall-clock-XXXXXX)}
py=$root/.venv/bin/python
tree=$out/base-tree
git -C "$root" worktree add --detach -f "$tree" "$base" >/dev/null
trap 'git -C "$root" worktree remove --force "$tree" >/dev/null 2>&1 || true' EXIT
for side in base head; do
  dir=$([[ $side == base ]] && echo "$tree" || echo "$root")
  (cd "$dir" && "$py" -m services.cli make-data "$out/$side/data" \
    --kinds decimal,expression,fraction >/dev/null 2>&1)
  (cd "$dir" && "$py" -m services.cli make-model "$out/$side/model" \
    --data "$out/$side/data/train.jsonl" --template plain --pretrain-steps 300 >/dev/null 2>&1)
done
run() {  # side config extra-args...
  local side=$1 config=$2; shift 2
  local dir; dir=$([[ $side == base ]] && echo "$tree" || echo "$root")
  local log=$out/$side/$config.log t0 t1 rc=0
  t0=$(date +%s.%N)
  (cd "$dir" && "$py" -m services.cli train --no-progress --config "configs/$config.toml" \
    --set "output_dir=$out/$side/runs" "$@" >"$log" 2>&1) || rc=$?
  t1=$(date +%s.%N)
  printf '%s %s rc=%d %.1f s | %s\n' "$side" "$config" "$rc" "$(echo "$t1 - $t0" | bc)" \
    "$(grep -o 'success rate .* ->[^;]*' "$log" | tail -1)"
}
for side in base head; do
  run "$side" demo
  run "$side" cpu_math --set "model.name_or_path=$out/$side/model" \
    --set "task.dataset=$out/$side/data/train.jsonl" --set "eval.dataset=$out/$side/data/test.jsonl"
done
