#!/usr/bin/env bash
# Branches side by side on the GPU host, in one device call: one source tree a branch under .t/ (ignored by git).
#   here:      bash benchmarks/branch_trees.sh main gemv-pdl-prefetch rope-inputs-before-wait
#   run(command="bash .t/main/benchmarks/branch_trees.sh --run decode-small", carry=[".whl", ".t"])
# --run STAGE...: in each tree, gpu_run.sh's stages with that tree's code; logs and graph profiles to $OUT as
# TREE-STAGE.log and TREE-graph.txt (at most 8 files come back: keep trees x stages small).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" != "--run" ]; then
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
shift
cd ..  # .t/
OUT=${OUT:-/tmp/atom-out}
for tree in */; do
  tree=${tree%/}
  for stage in "$@"; do
    (cd "$tree" && ln -sfn ../../.whl .whl && OUT=/tmp/trees/$tree bash benchmarks/gpu_run.sh "$stage" \
      > "$OUT/$tree-$stage.log" 2>&1)
    cp /tmp/trees/$tree/*-graph.txt "$OUT/$tree-graph.txt" 2>/dev/null
  done
done
