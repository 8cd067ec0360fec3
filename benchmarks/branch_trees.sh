#!/usr/bin/env bash
# Branches side by side on the GPU host, in one device call: one source tree a branch under .t/ (ignored by git).
#   here:      bash benchmarks/branch_trees.sh main gemv-pdl-prefetch rope-inputs-before-wait
#   run(command="bash .t/main/benchmarks/branch_trees.sh --run decode-small", carry=[".whl", ".t"])
# --run STAGE...: in each tree, gpu_run.sh's stages with that tree's code; logs and graph profiles to $OUT as
# TREE-STAGE.log and TREE-graph.txt (at most 8 files come back: keep trees x stages small).
# --run-parallel STAGE...: the same, each tree on a GPU of its own at the same time (a kind with as many GPUs as
# trees: the same host, the same moment, for figures to compare). Each tree has its own Triton and Inductor caches,
# so neither finds the other's kernels compiled, nor reads one the other is writing.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" != "--run" ] && [ "${1:-}" != "--run-parallel" ]; then
  root=$(git rev-parse --show-toplevel)
  grep -qx '/.t/' "$root/.git/info/exclude" || echo '/.t/' >> "$root/.git/info/exclude"
  rm -rf "$root/.t"
  for branch in "$@"; do
    mkdir -p "$root/.t/$branch"
    git -C "$root" archive "$branch" | tar -x -C "$root/.t/$branch" --exclude=atom_models/demo/model.safetensors
    git -C "$root" rev-parse --short "$branch" > "$root/.t/$branch/.commit"  # what the benchmarks' JSON names
    echo "$branch: $(git -C "$root" rev-parse --short "$branch")"
  done
  exit 0
fi
mode=$1
shift
cd ..  # .t/
OUT=${OUT:-/tmp/atom-out}
run_tree() {  # tree stage...
  local tree=$1 stage
  shift
  for stage in "$@"; do
    (cd "$tree" && ln -sfn ../../.whl .whl && OUT=/tmp/trees/$tree TRITON_CACHE_DIR=/tmp/trees/$tree-triton \
      TORCHINDUCTOR_CACHE_DIR=/tmp/trees/$tree-inductor bash benchmarks/gpu_run.sh "$stage" > "$OUT/$tree-$stage.log" 2>&1)
    cp /tmp/trees/$tree/*-graph.txt "$OUT/$tree-graph.txt" 2>/dev/null
  done
}
first=$(ls -d */ | head -1)
(cd "$first" && ln -sfn ../../.whl .whl && bash benchmarks/gpu_run.sh > /dev/null 2>&1)  # the wheels, once, before
gpu=0
for tree in */; do
  tree=${tree%/}
  if [ "$mode" = --run-parallel ]; then
    (export CUDA_VISIBLE_DEVICES=$gpu && run_tree "$tree" "$@") &
    gpu=$((gpu + 1))
  else
    run_tree "$tree" "$@"
  fi
done
wait
