"""Keras layer forward + backward: Dense under mixed_bfloat16 vs FP8Dense.

    python benchmarks/keras_layer.py [--processes 3] [--backends torch,jax] [--shapes 16384x4096x14336]
    python benchmarks/keras_layer.py --dry-run       # CPU, a tiny shape: the table code

Variants, each a layer without bias built for (M, K) -> N, interleaved
within each process:

- `dense_bf16`: `keras.layers.Dense` under `mixed_bfloat16`;
- `fp8_delayed`, `fp8_current`, `fp8_block`: `keras_fp8.layers.FP8Dense`
  under `fp8_hybrid`, `fp8_hybrid[scaling=current]` and
  `fp8_e4m3[scaling=block]`;
- `fp8_delayed_xla` (JAX only): `fp8_delayed` traced with the backend's
  custom calls off (`jax_gemm.set_enabled(False)`: XLA's quantize fusions
  and FP8 dot; the other variants run the fused quantize and GEMM custom
  calls, the default).

One step is the layer's forward on a bf16 x (training=True) and the
backward of a random bf16 output gradient, giving dx and the kernel's
gradient. torch: eager autograd (each layer called through `Layer.__call__`),
timed by CUDA events. JAX: one jitted `stateless_call` + `jax.vjp` per step
(the FP8 state threaded from step to step), timed to `block_until_ready` of
all its outputs (y, dx, the variables' gradients, the new state; without y
among them XLA drops the forward product). A sample is `--calls` steps
issued back to back (default 3), as a training loop issues them: the
host's dispatch of a step overlaps the step before it (a one-layer JAX
program's dispatch, about 0.2 ms, is paid once per model step, not per
layer); `--calls 1` synchronizes every step. After each step the
variables Keras's optimizers overwrite with their gradient
(`overwrite_with_gradient`: an FP8 layer's `grad_amax_pending`) take it, as
in `fit`, so the output gradient's amax history fills as in training (with
it left empty, every step's gradient quantize would seed its scale from a
first pass over the gradient; `--no-overwrite` measures that).

Memory of one step: torch, `torch.cuda.max_memory_allocated()` during the
step minus what was allocated before it (x, the gradient, the layers'
variables); JAX, the compiled step's own buffers from XLA's buffer
assignment (`memory_analysis()`: temporaries + outputs; what the step
allocates beside its arguments), and, for the variant a process runs
first, the rise of the device's `peak_bytes_in_use` over that step as a
cross-check.

The parent runs `--processes` workers per backend (KERAS_BACKEND set for
each); a worker measures the backend it was started with.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import timing  # noqa: E402

VARIANTS = ["dense_bf16", "fp8_delayed", "fp8_current", "fp8_block", "fp8_delayed_xla"]
JAX_ONLY = ("fp8_delayed_xla",)
POLICIES = {
    "dense_bf16": "mixed_bfloat16",
    "fp8_delayed": "fp8_hybrid",
    "fp8_current": "fp8_hybrid[scaling=current]",
    "fp8_block": "fp8_e4m3[scaling=block]",
    "fp8_delayed_xla": "fp8_hybrid",
}
LABELS = {"dense_bf16": "Dense bf16", "fp8_delayed": "FP8Dense delayed", "fp8_current": "FP8Dense current",
          "fp8_block": "FP8Dense block", "fp8_delayed_xla": "FP8Dense delayed, XLA fusions + dot"}
SHAPES = "16384x4096x14336"
DRY_RUN_SHAPES = "64x128x256"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Keras Dense bf16 vs FP8Dense, forward + backward.")
    p.add_argument("--backends", default="torch,jax", help="backends the parent runs workers for")
    p.add_argument("--shapes", default=None, help=f"MxKxN,... (default {SHAPES})")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--calls", type=int, default=3, help="back-to-back steps per sample (1: each synchronized)")
    p.add_argument("--no-overwrite", dest="overwrite", action="store_false",
                   help="leave the gradient channel without its gradient (the ablation: the output gradient's "
                        "history stays empty)")
    p.add_argument("--no-memory", dest="memory", action="store_false", help="skip the peak-memory step")
    p.add_argument("--dry-run", action="store_true")
    timing.add_process_arguments(p)
    args = p.parse_args(argv)
    timing.check_choices(p, "--variants", args.variants.split(","), VARIANTS)
    bad = sorted(set(args.backends.split(",")) - {"torch", "jax"})
    if bad:
        p.error(f"--backends: expected torch and/or jax, got {bad}")
    text = args.shapes or (DRY_RUN_SHAPES if args.dry_run else SHAPES)
    try:
        args.shape_list = [tuple(int(v) for v in s.split("x")) for s in text.split(",")]
    except ValueError:
        p.error(f"--shapes: expected MxKxN[,MxKxN...], got {text!r}")
    if args.dry_run:
        args.rounds, args.iters, args.warmup = 1, 2, 1
    if args.calls < 1:
        p.error(f"--calls: expected an integer >= 1, got {args.calls}")
    return args


def make_layer(variant, k, n):
    import keras

    import keras_fp8

    policy = POLICIES[variant]
    if variant == "dense_bf16":
        layer = keras.layers.Dense(n, use_bias=False, dtype=policy)
    else:
        layer = keras_fp8.layers.FP8Dense(n, use_bias=False, dtype=policy)
    layer.build((None, k))
    return layer


def _overwrites(variable):
    """Whether Keras's optimizers overwrite `variable` with its gradient."""
    return bool(getattr(variable, "overwrite_with_gradient", False))


# --------------------------------------------------------------------------- torch
def _torch_steps(layers, m, k, n, overwrite=True):
    import torch

    # The data goes where Keras put the variables (the GPU even in a dry run).
    device = next(iter(layers.values())).trainable_variables[0].value.device
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(m, n, device=device, dtype=torch.bfloat16)

    def make(layer):
        params = [v.value for v in layer.trainable_variables]
        overwritten = [v.value for v in layer.trainable_variables if overwrite and _overwrites(v)]

        def step():
            x.grad = None
            for p in params:
                p.grad = None
            layer(x, training=True).backward(g)
            with torch.no_grad():  # what the optimizer does with these variables' gradients
                for p in overwritten:
                    if p.grad is not None:
                        p.copy_(p.grad)

        return step

    return {v: make(layer) for v, layer in layers.items()}


def _torch_memory(step):
    import torch

    step()  # leaves the gradients allocated: cleared by the step itself
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**30


# --------------------------------------------------------------------------- JAX
def _jax_steps(layers, m, k, n, overwrite=True):
    import jax
    import jax.numpy as jnp
    import keras

    kx, kg = jax.random.split(jax.random.PRNGKey(0))
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    g = jax.random.normal(kg, (m, n), jnp.bfloat16)
    steps, compiled = {}, {}
    for v, layer in layers.items():
        # A model's stateless_call runs the layer's __call__ (the autocast
        # scope included), as the trainer does.
        model = keras.Sequential([keras.Input((k,), dtype="bfloat16"), layer])
        trainable = [[w.value for w in model.trainable_variables]]
        overwritten = [overwrite and _overwrites(w) for w in model.trainable_variables]
        state = [[w.value for w in model.non_trainable_variables]]

        def fwd_bwd(trainable, non_trainable, x, g, model=model):
            def f(t, x):
                return model.stateless_call(t, non_trainable, x, training=True)

            y, vjp, new_nt = jax.vjp(f, trainable, x, has_aux=True)
            dt, dx = vjp(g)
            # y is an output: XLA would drop an unused forward product.
            return dt, dx, new_nt, y

        jitted = jax.jit(fwd_bwd)
        cache = {}

        def lazy_compiled(jitted=jitted, trainable=trainable, state=state, cache=cache, xla_way=v in JAX_ONLY):
            # Compiled once ahead of time: the memory analysis and the steps
            # share the executable.
            if "exe" not in cache:
                from keras_fp8.backends import jax_gemm

                before = jax_gemm.enabled()
                jax_gemm.set_enabled(before and not xla_way)
                try:
                    cache["exe"] = jitted.lower(trainable[0], state[0], x, g).compile()
                finally:
                    jax_gemm.set_enabled(before)
            return cache["exe"]

        def step(trainable=trainable, state=state, compiled=lazy_compiled, overwritten=overwritten):
            # Every output, so that the timer waits for the whole step (a
            # kernel gradient still computing would run into the next
            # variant's sample).
            dt, dx, state[0], y = compiled()(trainable[0], state[0], x, g)
            trainable[0] = [d if o else t for t, d, o in zip(trainable[0], dt, overwritten)]
            return dt, dx, state[0], y

        steps[v] = step
        compiled[v] = lazy_compiled
    return steps, compiled


def _jax_memory_analysis(compile_fn):
    analysis = compile_fn().memory_analysis()
    if analysis is None:
        return None
    return (analysis.temp_size_in_bytes + analysis.output_size_in_bytes - analysis.alias_size_in_bytes) / 2**30


def _jax_peak_rise(step):
    """GiB the device's peak_bytes_in_use rose above what was in use before
    `step()` (None where the device keeps no stats or the peak did not rise)."""
    import jax

    stats = jax.devices()[0].memory_stats()
    if not stats or "peak_bytes_in_use" not in stats:
        return None
    before, peak0 = stats["bytes_in_use"], stats["peak_bytes_in_use"]
    jax.block_until_ready(step())
    peak1 = jax.devices()[0].memory_stats()["peak_bytes_in_use"]
    return (peak1 - before) / 2**30 if peak1 > peak0 else None


# --------------------------------------------------------------------------- worker
def worker(args):
    import keras

    import keras_fp8  # noqa: F401 (registers the FP8 policies)

    backend = keras.backend.backend()
    if backend == "torch":
        import torch

        cuda = torch.cuda.is_available() and not args.dry_run
        timer = timing.cuda_timer if cuda else timing.wall_timer()
    else:
        import jax

        cuda = jax.devices()[0].platform == "gpu" and not args.dry_run
        timer = timing.wall_timer(jax.block_until_ready)
    env = timing.environment()
    env["backend"] = backend
    timing.emit({"env": env})
    names = [v for v in args.variants.split(",") if backend == "jax" or v not in JAX_ONLY]
    for m, k, n in args.shape_list:
        row = f"{backend} {m}x{k}x{n}"
        layers, problems = {}, {}
        for v in names:
            try:
                layers[v] = make_layer(v, k, n)
            except Exception as e:  # noqa: BLE001
                problems[v] = timing.failure(e)
        extra = {v: {} for v in names}
        if backend == "torch":
            steps = _torch_steps(layers, m, k, n, args.overwrite)
        else:
            steps, compiled = _jax_steps(layers, m, k, n, args.overwrite)
            if args.memory:
                # The peak rise is clean only for the first step a process runs.
                first = names[(args.worker or 0) % len(names)]
                for v in sorted(steps, key=lambda v: v != first):
                    try:
                        extra[v]["mem_gib"] = _jax_memory_analysis(compiled[v])
                        if v == first:
                            extra[v]["peak_rise_gib"] = _jax_peak_rise(steps[v])
                    except Exception as e:  # noqa: BLE001
                        extra[v]["mem_error"] = timing.describe_error(e)
        medians = timing.interleaved_medians(steps, rounds=args.rounds, iters=args.iters, warmup=args.warmup,
                                             calls=args.calls, timer=timer, seed=args.worker or 0)
        if backend == "torch" and cuda and args.memory:
            for v, step in steps.items():
                if not isinstance(medians.get(v), BaseException):
                    extra[v]["mem_gib"] = _torch_memory(step)
        for v in names:
            value = problems.get(v, medians.get(v))
            timing.emit(timing.variant_record(v, value, row=row, policy=POLICIES[v], **extra[v]))
        keras.backend.clear_session()


# --------------------------------------------------------------------------- table
HEADER = ("| backend | M x K x N | Dense bf16 | FP8Dense delayed | FP8Dense current | FP8Dense block "
          "| FP8Dense delayed, XLA fusions + dot | delayed / bf16 | current / bf16 | block / bf16 | XLA way / bf16 |")
MEM_HEADER = ("| backend | M x K x N | Dense bf16 | FP8Dense delayed | FP8Dense current | FP8Dense block "
              "| FP8Dense delayed, XLA fusions + dot | delayed / bf16 |")


def _sep(h):
    return "|" + "---|" * (h.count("|") - 1)


def tables(per_process, args=None):
    res = timing.Results(per_process, row_key="row")
    out = [f"# {timing.env_line(res.env())}; processes per backend: {len(per_process)}", "",
           "Forward + backward, ms per step (median over processes [range]); ratio = speed-up over Dense bf16:",
           "", HEADER, _sep(HEADER)]
    for row in res.rows():
        backend, shape = row.split(" ", 1)
        cells = [res.ms(row, v) for v in VARIANTS]
        cells += [res.ratio(row, v, "dense_bf16") for v in ("fp8_delayed", "fp8_current", "fp8_block",
                                                              "fp8_delayed_xla")]
        out.append(f"| {backend} | {shape.replace('x', ' x ')} | " + " | ".join(cells) + " |")
    out += ["", "Step memory, GiB above the resident tensors (torch: max_memory_allocated; JAX: the compiled "
            "step's temporaries + outputs); ratio fp8 / bf16:", "", MEM_HEADER, _sep(MEM_HEADER)]
    for row in res.rows():
        backend, shape = row.split(" ", 1)
        cells = [res.ms(row, v, field="mem_gib", fmt="{:.2f}") for v in VARIANTS]
        cells.append(res.ratio(row, "fp8_delayed", "dense_bf16", field="mem_gib", inverse=False))
        out.append(f"| {backend} | {shape.replace('x', ' x ')} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv=None):
    return timing.main(__file__, argv, parse_args, worker, tables, backends=True)


if __name__ == "__main__":
    main()
