#!/usr/bin/env bash
# The fourth to sixth sessions' device calls (capped at $BUDGET s), by PHASES:
#   build   python -m torch_ops build
#   tests   tests/torch_ops + torch dispatch/saving/training tests (torch backend)
#   qbench  benchmarks/quantize.py (tile kernels and the lean kernel's options side by side; also at $QBENCH_SHAPES)
#   ncumem  Nsight Compute memory metrics of the lean quantize kernel and of a device copy
#   leanpick  export TORCH_OPS_LEAN: qbench's fastest lean-kernel options, for the later phases
#   linear  benchmarks/linear.py at all six shapes ($LINEAR_ARGS)
#   profile benchmarks/profile_linear.py at $PROFILE_SHAPE ($PROFILE_ARGS)
#   timeline profile_linear.py --timeline at the two small shapes (host + GPU time line of one step)
#   host    benchmarks/host_overhead.py at the small shapes
#   small   the small Keras model, mixed_bfloat16 and fp8_hybrid interleaved in one process
#   bigab   the issue's Keras model, both policies interleaved in one process ($BIGAB_ARGS)
#   bigabn  bigab in $BIGAB_PROCS processes (default 3) and the median of their ratios
#   bigflat the same with --loss flat (the cross-entropy on 2-D logits: a diagnostic)
#   bigidx  the same with --qkv index (q/k/v by three index-selects, the benchmark's code before session 6)
#   model   the issue's Keras model, mixed_bfloat16 then fp8_hybrid
#   mprof   profile_keras_torch.py for both policies (kernel tables, kern_*.json)
#   qmodel  benchmarks/quant_in_model.py: the quantize kernels in the issue model's step vs the same calls alone
source "$(dirname "$0")/lib.sh"
device_init 550
PHASES=${PHASES:-"build tests qbench"}
say "$(nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader) $(python3 -c 'import torch; print(torch.__version__, torch.version.cuda)') $(git log -1 --format=%h 2>/dev/null) phases: $PHASES"
if has build; then
  step build 200 python3 -m torch_ops build; rc=$?; tail -3 "$OUT/build.txt" | tee -a "$LOG"
  ((rc == 0)) || { say "build failed: stopping"; exit 1; }
fi
if has tests; then
  step cxxerr 120 python3 scripts/cxx_errors.py; cat "$OUT/cxxerr.txt" | tee -a "$LOG"
  if has probe; then step cxxprobe 200 python3 scripts/cxx_throw_probe.py; tail -40 "$OUT/cxxprobe.txt" | tee -a "$LOG"; fi
  KERAS_BACKEND=torch step tests ${TESTS_LIMIT:-260} python3 -m pytest tests/torch_ops tests/test_torch_dispatch.py \
    tests/test_saving.py tests/test_loss_scaling.py -q -p no:cacheprovider --tb=short -W ignore ${PYTEST_K:+-k "$PYTEST_K"}
  tail -1 "$OUT/tests.txt" | tee -a "$LOG"; grep -E "^FAILED|^ERROR|Error" "$OUT/tests.txt" | head -20 | tee -a "$LOG"
fi
if has qbench; then
  step qbench 60 python3 benchmarks/quantize.py; grep "^|" "$OUT/qbench.txt" | tee -a "$LOG"
  # Other shapes ($QBENCH_SHAPES): e.g. strides that are not powers of two, to test for L2/DRAM partition camping.
  for shp in ${QBENCH_SHAPES:-}; do
    step "qbench_$shp" 60 python3 benchmarks/quantize.py --shape "$shp"
    say "qbench $shp:"; grep -E "^\| (device copy|ours: quantize_delayed, q \+ q_t|ours: the same, tile kernel v5)" "$OUT/qbench_$shp.txt" | tee -a "$LOG"
  done
fi
if has leanpick; then
  # The fastest delayed lean-kernel option of qbench's table, for the phases after this one.
  TORCH_OPS_LEAN=$(python3 - "$OUT/qbench.txt" <<'PY'
import re, sys
rows = {"tile kernel v5 (lean": "1,2", "v5, 2 tiles per warp, 8 side by side |": "2,1", "v5, blocks of 4 x 2": "1,4"}
best = ("1,2", float("inf"))
for line in open(sys.argv[1]):
    for key, opt in rows.items():
        if key in line:
            us = float(line.split("|")[2])
            best = min(best, (opt, us), key=lambda b: b[1])
print(best[0])
PY
)
  export TORCH_OPS_LEAN; say "TORCH_OPS_LEAN=$TORCH_OPS_LEAN (fastest in qbench)"
fi
if has ncumem; then
  # Memory traffic of the lean quantize kernel next to a device copy (the question left by session 9:
  # DRAM 68% and L2 82% busy for v5 against a copy's ~86% of DRAM; what does v5 move that a copy does not?).
  M=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed
  M=$M,lts__t_sectors_op_read.sum,lts__t_sectors_op_write.sum,lts__t_sector_hit_rate.pct,lts__throughput.avg.pct_of_peak_sustained_elapsed
  M=$M,l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum
  M=$M,l1tex__t_requests_pipe_lsu_mem_global_op_st.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum
  M=$M,lts__t_sectors_srcunit_tex_op_write_lookup_miss.sum,lts__t_sectors_srcunit_ltcfabric.sum,sm__warps_active.avg.pct_of_peak_sustained_active
  for k in quant_lean copy; do
    step "ncu_$k" 90 ncu --clock-control none --csv --metrics "$M" -k regex:$k --launch-skip 2 --launch-count 1 \
      python3 scripts/ncu_quant.py 5
    python3 -c 'import csv, sys; rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 14 and r[0] != "ID"]
[print(r[4][:40], r[12], r[13], r[14]) for r in rows]' "$OUT/ncu_$k.txt" | tee -a "$LOG"
  done
fi
if has linear; then
  step linear ${LINEAR_LIMIT:-300} python3 benchmarks/linear.py ${LINEAR_ARGS:---iters 30 --rounds 5}
  sed -n '/### summary/,$p' "$OUT/linear.txt" | tee -a "$LOG"
fi
if has host; then
  step host ${HOST_LIMIT:-120} python3 benchmarks/host_overhead.py --shape ${HOST_SHAPES:-4096x1024x1024,1024x2048x1024} --iters 3000 ${HOST_ARGS:-}
  grep -E "^\||^###" "$OUT/host.txt" | tee -a "$LOG"
fi
if has profile; then
  step profile 90 python3 benchmarks/profile_linear.py --shape ${PROFILE_SHAPE:-16384x4096x4096} ${PROFILE_ARGS:-}
  grep -E "^### |^between" "$OUT/profile.txt" | tee -a "$LOG"
fi
if has timeline; then
  for shape in 4096x1024x1024 1024x2048x1024; do
    step "timeline_$shape" 90 python3 benchmarks/profile_linear.py --shape $shape --timeline
  done
fi
if has small; then
  KERAS_BACKEND=torch step small 120 python3 benchmarks/model.py --stack keras --interleave mixed_bfloat16,fp8_hybrid \
    --rounds 5 --hidden 1024 --mlp 2816 --heads 8 --seq 512 --vocab 8000 --warmup 3 --steps 8
  grep -E "^RATIO|^round" "$OUT/small.txt" | tee -a "$LOG"; tail -2 "$OUT/small.txt" | grep -v RATIO | cut -c1-300 | tee -a "$LOG"
fi
for ab in bigab bigflat bigidx; do
  if has $ab; then
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True KERAS_BACKEND=torch step $ab ${BIGAB_LIMIT:-150} python3 \
      benchmarks/model.py --stack keras --interleave mixed_bfloat16,fp8_hybrid ${BIGAB_ARGS:---rounds 3 --warmup 3 --steps 4} \
      --loss $([[ $ab == bigflat ]] && echo flat || echo keras) --qkv $([[ $ab == bigidx ]] && echo index || echo unstack)
    grep -E "^RATIO|^round|Error" "$OUT/$ab.txt" | tee -a "$LOG"
  fi
done
if has bigabn; then
  # The same as bigab in $BIGAB_PROCS processes one after another (default 3): the ratio moves by ~0.8%
  # between processes (docs/benchmarks.md, eleventh session), so one process is one sample.
  for i in $(seq 1 ${BIGAB_PROCS:-3}); do
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True KERAS_BACKEND=torch step "bigab_$i" ${BIGAB_LIMIT:-150} python3 \
      benchmarks/model.py --stack keras --interleave mixed_bfloat16,fp8_hybrid ${BIGAB_ARGS:---rounds 4 --warmup 3 --steps 5}
    grep -E "^RATIO|Error" "$OUT/bigab_$i.txt" | tee -a "$LOG"
  done
  python3 - "$OUT" <<'PY' | tee -a "$LOG"
import glob, re, statistics, sys
r = []
for f in sorted(glob.glob(sys.argv[1] + "/bigab_*.txt")):
    m = re.search(r"\(([0-9.]+) vs ([0-9.]+) ms/step", open(f).read())
    if m:
        r.append(float(m.group(1)) / float(m.group(2)))
if r:
    print(f"bigabn: {len(r)} processes, ratios {', '.join(f'{x:.4f}' for x in r)}; median {statistics.median(r):.4f}")
PY
fi
if has mprof; then
  for p in ${MPROF_POLICIES:-mixed_bfloat16 fp8_hybrid}; do
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True KERAS_BACKEND=torch step "mprof_$p" 150 python3 \
      benchmarks/profile_keras_torch.py --policy $p --steps 2 --top 40 --json "$OUT/kern_$p.json"
    grep -E "^# |^host-sync" "$OUT/mprof_$p.txt" | tee -a "$LOG"
  done
fi
if has qmodel; then
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True KERAS_BACKEND=torch step qmodel 150 python3 benchmarks/quant_in_model.py
  grep -E "^\||^quantize" "$OUT/qmodel.txt" | tee -a "$LOG"
fi
if has model; then
  for p in mixed_bfloat16 fp8_hybrid; do
    KERAS_BACKEND=torch step "model_$p" 60 python3 benchmarks/model.py --stack keras --policy $p --warmup 3 --steps 6
    { grep RESULT "$OUT/model_$p.txt" || tail -3 "$OUT/model_$p.txt"; } | tail -1 | cut -c1-400 | tee -a "$LOG"
  done
fi
say "[$(($(date +%s) - T0))s] done"
