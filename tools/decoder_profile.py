"""Where the decoder's training step goes on the GPU, per policy: the
kernels it launches (summed per step, slowest first) and the clocks and
power the GPU ran at while it trained.

    KERAS_BACKEND=jax python tools/decoder_profile.py [--policies P,...] [--top 30]

The model is `benchmarks/model.py`'s decoder (its `--size` and overrides).
Per policy: a warm-up fit, a timed fit (the step's wall time), a profiled
fit (`torch.profiler` on torch, `jax.profiler` on JAX: each kernel's time
summed over its steps, and the time at least one kernel ran), then
`--fits` more fits while `nvidia-smi` samples the SM clock, the power draw
and the clock event reasons every 50 ms (skipped where there is no
`nvidia-smi`). `--dry-run` runs the tiny decoder (on a CPU: no kernel
rows).
"""

import argparse
import collections
import glob
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import model as bm  # noqa: E402

SMI_FIELDS = "clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policies", default="mixed_bfloat16,fp8_hybrid", help="comma-separated dtype policies")
    p.add_argument("--steps", type=int, default=4, help="steps of each timed and profiled fit")
    p.add_argument("--fits", type=int, default=4, help="fits while the clocks are sampled")
    p.add_argument("--top", type=int, default=30, help="kernel rows printed per policy")
    p.add_argument("--dry-run", action="store_true", help="the tiny decoder")
    args, model_argv = p.parse_known_args(argv)
    policies = [s for s in args.policies.split(",") if s]
    if not policies:
        p.error(f"--policies: expected at least one policy, got {args.policies!r}")
    for name in ("steps", "fits", "top"):
        if getattr(args, name) < 1:
            p.error(f"--{name}: expected a positive integer, got {getattr(args, name)}")
    args.policies = policies
    model_args = bm.parse_args((["--size", "tiny"] if args.dry_run else []) + model_argv)
    model_args.steps = max(model_args.steps, args.steps)  # `bm.data` holds enough batches
    return args, model_args


def busy_time(intervals):
    """The length of the union of `(start, end)` intervals."""
    total, start, end = 0.0, None, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            if end is not None:
                total += end - start
            start, end = s, e
        else:
            end = max(end, e)
    return total if end is None else total + end - start


class ClockSampler:
    """`nvidia-smi` sampling every 50 ms between `start()` and `stop()`;
    `summary()` is one line (or why there is none)."""

    def __init__(self):
        self._proc, self._lines = None, []

    def start(self):
        if shutil.which("nvidia-smi") is None:
            return
        self._proc = subprocess.Popen(
            ["nvidia-smi", f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader,nounits", "-lms", "50"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

    def stop(self):
        if self._proc is not None:
            self._proc.terminate()
            self._lines = self._proc.communicate(timeout=10)[0].splitlines()

    def summary(self):
        if self._proc is None:
            return "clocks: not sampled (no nvidia-smi)"
        rows = [[f.strip() for f in line.split(",")] for line in self._lines]
        rows = [r for r in rows if len(r) == 4 and r[0].isdigit()]
        if not rows:
            return "clocks: nvidia-smi printed no samples"
        clock = [int(r[0]) for r in rows]
        power = [float(r[1]) for r in rows]
        reasons = collections.Counter(r[3] for r in rows).most_common(2)
        return (f"clocks: {len(rows)} samples, SM clock median {statistics.median(clock):.0f} MHz "
                f"[{min(clock)}-{max(clock)}], power median {statistics.median(power):.0f} W (max {max(power):.0f}), "
                f"temperature max {max(int(r[2]) for r in rows)} C, clock event reasons "
                + ", ".join(f"{code} in {n}" for code, n in reasons))


def kernel_table(by_name, steps, top):
    rows = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    return [f"{ms / steps:9.3f} ms {calls / steps:6.1f}x  {name[:150]}" for name, (ms, calls) in rows]


def torch_kernels(fit):
    """Runs `fit()` under `torch.profiler`: `({kernel: [ms, calls]}, busy ms)`."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        fit()
        return {}, 0.0
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fit()
        torch.cuda.synchronize()
    by_name, spans = collections.defaultdict(lambda: [0.0, 0]), []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            by_name[e.name][0] += (e.time_range.end - e.time_range.start) / 1e3
            by_name[e.name][1] += 1
            spans.append((e.time_range.start, e.time_range.end))
    return by_name, busy_time(spans) / 1e3


def jax_kernels(fit):
    """Runs `fit()` under `jax.profiler`: `({kernel: [ms, calls]}, busy ms)`
    from the trace's GPU planes (none on a CPU)."""
    import jax

    trace_dir = tempfile.mkdtemp(prefix="decoder_profile_")
    try:
        with jax.profiler.trace(trace_dir):
            fit()
        planes = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))
        by_name, spans = collections.defaultdict(lambda: [0.0, 0]), []
        if planes:
            data = jax.profiler.ProfileData.from_file(planes[-1])
            for plane in data.planes:
                if not plane.name.startswith("/device:GPU"):
                    continue
                for line in plane.lines:
                    if any(word in line.name for word in ("XLA Ops", "Modules", "Steps", "Source")):
                        continue  # annotations over the kernels, not kernels
                    for e in line.events:
                        by_name[e.name][0] += e.duration_ns / 1e6
                        by_name[e.name][1] += 1
                        spans.append((e.start_ns, e.start_ns + e.duration_ns))
        return by_name, busy_time(spans) / 1e6
    finally:
        shutil.rmtree(trace_dir, ignore_errors=True)


def profile_policy(args, model_args, policy, x, y):
    import keras

    model = bm.keras_model(model_args, policy, keras.layers.Dense)
    n = args.steps * model_args.batch

    def fit(callbacks=()):
        model.fit(x[:n], y[:n], batch_size=model_args.batch, epochs=1, shuffle=False, verbose=0,
                  callbacks=list(callbacks))
        float(keras.ops.convert_to_numpy(model.trainable_variables[0].value).ravel()[0])  # finished on the device

    fit()
    timer = bm._Timer.make()
    fit([timer])
    steps_ms = [1e3 * (b - a) for a, b in zip(timer.stamps, timer.stamps[1:])]
    wall = statistics.median(steps_ms) if steps_ms else float("nan")
    by_name, busy = (torch_kernels if keras.backend.backend() == "torch" else jax_kernels)(fit)
    total = sum(ms for ms, _ in by_name.values())
    sampler = ClockSampler()
    sampler.start()
    try:
        for _ in range(args.fits):
            fit()
    finally:
        sampler.stop()
    lines = [f"=== {keras.backend.backend()} decoder, {policy}: step {wall:.2f} ms (median), kernels "
             f"{total / args.steps:.2f} ms a step, some kernel running {busy / args.steps:.2f} ms a step",
             sampler.summary()]
    return lines + kernel_table(by_name, args.steps, args.top)


def main(argv=None):
    args, model_args = parse_args(argv)
    x, y = bm.data(model_args)
    for policy in args.policies:
        print("\n".join(profile_policy(args, model_args, policy, x, y)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
