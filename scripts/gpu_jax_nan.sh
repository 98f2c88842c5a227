#!/usr/bin/env bash
# Diagnose the JAX-GPU FitState NaN at tiny shapes (scripts/jax_fp8_probe2.py).
source "$(dirname "$0")/lib.sh"
device_init 120
XLA_FLAGS=--xla_allow_excess_precision=false step probe2 70 python3 scripts/jax_fp8_probe2.py
grep -v "Warning\|warn" "$OUT/probe2.txt" | tail -40 | tee -a "$LOG"
say "[$(($(date +%s) - T0))s] done"
