"""What one Keras-JAX training step of the model benchmark costs to build.

    KERAS_BACKEND=jax python benchmarks/jax_step.py --policy fp8_hybrid [sizes]

Builds the decoder of `benchmarks/model.py` (same flags), then traces,
lowers and compiles Keras's own `train_step` (what `model.fit` jits) and
prints one `STEP` line (JSON): trace/lower/compile seconds, jaxpr equation
count, compiled-HLO size, how many matrix products have FP8 operands, whether
attention went to cuDNN (`__cudnn$fmha` custom calls), the largest f32
buffers, and the median time of the compiled step run directly (no fit loop).
`PHASE` lines are printed as each stage ends, so a run cut off by a timeout
still says how far it got. XLA flags come from `XLA_FLAGS`.
"""

import argparse
import collections
import gzip
import json
import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import model as model_bench  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    model_bench.add_model_arguments(parser)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--dump", default=None, help="write the HLO here (.gz)")
    args = parser.parse_args()
    args.warmup, args.steps, args.jit = 1, args.iters, "auto"

    import jax
    import numpy as np

    t_build = time.perf_counter()
    model = model_bench.keras_model(args)
    x, y = model_bench.data(args)
    x, y = x[: args.batch], y[: args.batch]
    model._symbolic_build(data_batch=(x, y))
    model.optimizer.build(model.trainable_variables)
    state = model._get_jax_state(
        trainable_variables=True, non_trainable_variables=True,
        optimizer_variables=True, metrics_variables=True,
    )
    data = (jax.numpy.asarray(x), jax.numpy.asarray(y))
    step = jax.jit(model.train_step, donate_argnums=0)

    def phase(name, seconds):
        print(f"PHASE {name} {seconds:.2f} s", flush=True)

    phase("build", time.perf_counter() - t_build)

    t0 = time.perf_counter()
    jaxpr = jax.make_jaxpr(model.train_step)(state, data)
    t1 = time.perf_counter()
    phase("trace", t1 - t0)
    lowered = step.lower(state, data)
    t2 = time.perf_counter()
    phase("lower", t2 - t1)
    compiled = lowered.compile()
    t3 = time.perf_counter()
    phase("compile", t3 - t2)
    hlo = compiled.as_text()
    if args.dump:
        with gzip.open(args.dump, "wt") as f:
            f.write(hlo)
    gemms = collections.Counter()
    for line in hlo.splitlines():
        target = re.search(r'custom_call_target="(__cublas[^"]*)"', line)
        if target:
            out = re.search(r"=\s*\(?([a-z0-9]+)\[([0-9,]*)\]", line)
            gemms[f"{target.group(1)} -> {out.group(1) if out else '?'}"] += 1
        elif re.search(r"\bdot\(", line):
            out = re.search(r"=\s*([a-z0-9]+)\[", line)
            gemms[f"dot -> {out.group(1) if out else '?'}"] += 1

    try:  # JAX >= 0.11 (jax.core's copy was removed there)
        from jax.extend.core import jaxprs_in_params
    except ImportError:
        jaxprs_in_params = jax.core.jaxprs_in_params

    def count_eqns(jpr):
        n = 0
        for eqn in jpr.eqns:
            n += 1
            for sub in jaxprs_in_params(eqn.params):
                n += count_eqns(sub)
        return n

    prims = collections.Counter(e.primitive.name for e in jaxpr.jaxpr.eqns)
    f8_types = re.findall(r"f8e4m3fn|f8e5m2", hlo)
    buffers = collections.Counter()
    for m in re.finditer(r"(f32|bf16)\[(\d+(?:,\d+)*)\]", hlo):
        size = int(np.prod([int(d) for d in m.group(2).split(",")]))
        buffers[(m.group(1), m.group(2))] = size
    largest = [f"{t}[{s}]" for (t, s), _ in buffers.most_common(4)]

    print("GEMMS " + json.dumps(dict(gemms)), flush=True)
    times = []
    for _ in range(args.iters + 1):
        start = time.perf_counter()
        logs, state = compiled(state, data)
        jax.block_until_ready(logs)
        times.append((time.perf_counter() - start) * 1e3)
    result = {
        "policy": args.policy,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "device": str(jax.devices()[0]),
        "jax": jax.__version__,
        "trace_s": round(t1 - t0, 2),
        "lower_s": round(t2 - t1, 2),
        "compile_s": round(t3 - t2, 2),
        "jaxpr_eqns": count_eqns(jaxpr.jaxpr),
        "top_primitives": prims.most_common(6),
        "hlo_lines": hlo.count("\n"),
        "hlo_while": len(re.findall(r"\bwhile\(", hlo)),
        "hlo_callbacks": len(re.findall(r"callback", hlo)),
        "cudnn_fmha_calls": len(re.findall(r'custom_call_target="__cudnn\$fmha', hlo)),
        "gemms": dict(gemms),
        "f8_type_mentions": len(f8_types),
        "largest_buffers": largest,
        "step_ms": [round(t, 2) for t in times],
        "step_ms_median": round(statistics.median(times[1:]), 2),
        "loss": float(logs["loss"]),
    }
    print("STEP " + json.dumps(result))


if __name__ == "__main__":
    main()
