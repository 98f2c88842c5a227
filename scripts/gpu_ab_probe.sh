#!/usr/bin/env bash
# The graph probe (scripts/gemm_amax_graph_probe.py) for two trees side by
# side on one machine: the working tree ("new") and an older one ("old"),
# built in parallel into separate extension directories, run interleaved
# old/new/old/new (session 18, call 8), then benchmarks/linear.py's small
# shapes the same way (session 21). Prepare the old tree here first:
#   mkdir _old && git archive REV torch_ops csrc benchmarks pyproject.toml | tar x -C _old
# (_old is git-ignored: name it in the device call's carry, with .whl), then
# on the GPU machine, after installing the wheels into /tmp/site:
#   bash scripts/gpu_ab_probe.sh _old
# Also runs the new tree's gemm_amax tests. Logs under $OUT/x.
OLD=${1:?usage: gpu_ab_probe.sh OLD_TREE}
ROOT=$PWD
OUT=${OUT:-/tmp/out}/x
mkdir -p "$OUT"
export MAX_JOBS=8
(cd "$OLD" && PYTHONPATH=/tmp/site:$ROOT/$OLD TORCH_EXTENSIONS_DIR=/tmp/ext_old timeout 200 python3 -m torch_ops build \
  > "$OUT/build_old.txt" 2>&1; echo "old build rc=$?") &
(PYTHONPATH=/tmp/site:$ROOT TORCH_EXTENSIONS_DIR=/tmp/ext_new timeout 200 python3 -m torch_ops build \
  > "$OUT/build_new.txt" 2>&1; echo "new build rc=$?") &
wait
for r in 1 2; do
  (cd "$OLD" && PYTHONPATH=/tmp/site:$ROOT/$OLD TORCH_EXTENSIONS_DIR=/tmp/ext_old timeout 60 \
    python3 "$ROOT/scripts/gemm_amax_graph_probe.py" 2>&1 | grep -v "Warn\|return Var" > "$OUT/old$r.txt")
  PYTHONPATH=/tmp/site:$ROOT TORCH_EXTENSIONS_DIR=/tmp/ext_new timeout 60 \
    python3 scripts/gemm_amax_graph_probe.py 2>&1 | grep -v "Warn\|return Var" > "$OUT/new$r.txt"
done
paste "$OUT/old1.txt" "$OUT/new1.txt" "$OUT/old2.txt" "$OUT/new2.txt" | sed 's/  */ /g'
# benchmarks/linear.py's small shapes (the graph column), old / new / old / new.
for r in 1 2; do
  (cd "$OLD" && PYTHONPATH=/tmp/site:$ROOT/$OLD TORCH_EXTENSIONS_DIR=/tmp/ext_old timeout 60 \
    python3 "$ROOT/benchmarks/linear.py" --shapes 4096x1024x1024,1024x2048x1024 --no-torchao --small-iters 1000 \
    > "$OUT/lb_old$r.txt" 2>&1)
  PYTHONPATH=/tmp/site:$ROOT TORCH_EXTENSIONS_DIR=/tmp/ext_new timeout 60 \
    python3 benchmarks/linear.py --shapes 4096x1024x1024,1024x2048x1024 --no-torchao --small-iters 1000 \
    > "$OUT/lb_new$r.txt" 2>&1
done
for f in lb_old1 lb_new1 lb_old2 lb_new2; do echo "$f"; grep -A4 "^| M x K x N" "$OUT/$f.txt" | sed -n 3,4p; done
PYTHONPATH=/tmp/site:$ROOT TORCH_EXTENSIONS_DIR=/tmp/ext_new KERAS_BACKEND=torch timeout 150 \
  python3 -m pytest tests/torch_ops/test_torch_ops_gemm_amax.py -q -p no:cacheprovider --tb=short -W ignore \
  > "$OUT/gtests.txt" 2>&1
tail -3 "$OUT/gtests.txt"
