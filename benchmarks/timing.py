"""How every benchmark measures: timers, interleaved medians, fresh processes.

Speed is a ratio within one run. Each benchmark script times its variants
side by side in one process (`interleaved_medians`: rounds in a shuffled
order, so drifts of clocks, power and temperature fall on all variants
alike), repeats that in `--processes` fresh processes (`run_processes`), and
reports per cell the median over the processes of the per-process medians,
with their range: `cell([...])` -> "2.391 [2.385-2.402]". A ratio is taken
within each process first, then summarized the same way (`ratio_cell`).

A worker process prints its measurements as `RESULT {json}` lines; the
parent collects them from every worker (`parse_results`), so a worker that
dies still leaves what it printed. A variant that cannot run is a record
with `"error"` (it raised) or `"skipped"` (not importable, GPU only): its
cells read "n/a (...)" and the run goes on.
"""

from __future__ import annotations

import json
import math
import os
import platform
import random
import contextlib
import re
import signal
import statistics
import subprocess
import sys
import threading
import time

RESULT_PREFIX = "RESULT "


# --------------------------------------------------------------------------- timers
def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def cuda_timer(fn, calls: int = 1) -> float:
    """Milliseconds per call of `calls` back-to-back `fn()` calls between
    two CUDA events, synchronized once at the end (host time before the
    first kernel counts)."""
    import torch

    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


def wall_timer(sync=None):
    """A timer like `cuda_timer` on the host clock; `sync(result)` waits for
    a call's result (e.g. `jax.block_until_ready`; None: nothing to wait for)."""

    def timer(fn, calls: int = 1) -> float:
        t0 = time.perf_counter()
        out = None
        for _ in range(calls):
            out = fn()
        if sync is not None:
            sync(out)
        return (time.perf_counter() - t0) * 1e3 / calls

    return timer


def interleaved_medians(fns, *, rounds=5, iters=6, warmup=3, calls=1, timer=cuda_timer, seed=0):
    """Median milliseconds per call of each function, measured side by side.

    Each of `rounds` rounds times every function `iters` times in turn, in
    an order shuffled from round to round (seeded), so that slow drifts and
    the effect of a neighbour fall on all functions alike. A function that
    raises (in warm-up or later) is dropped and its error returned instead.

    Args:
        fns: Dict from name to a function of no arguments.
        rounds, iters: `rounds * iters` samples per function.
        warmup: Untimed calls per function first (compilation, autotuning).
        calls: Back-to-back calls per sample (1: each call synchronized).
        timer: `timer(fn, calls) -> ms per call` (`cuda_timer`, `wall_timer`).

    Returns:
        Dict from name to the median ms, or to the exception it raised.
    """
    out = {}
    live = {}
    for name, fn in fns.items():
        try:
            for _ in range(warmup):
                fn()
            timer(fn, 1)
            live[name] = fn
        except Exception as e:  # noqa: BLE001 (reported as the variant's cell)
            out[name] = failure(e)
    samples = {name: [] for name in live}
    order = list(live)
    rng = random.Random(seed)
    for r in range(rounds):
        if r:
            rng.shuffle(order)
        for name in order:
            if name in out:
                continue
            try:
                samples[name] += [timer(live[name], calls) for _ in range(iters)]
            except Exception as e:  # noqa: BLE001
                out[name] = failure(e)
    for name, times in samples.items():
        if name not in out:
            out[name] = statistics.median(times)
    return {name: out[name] for name in fns}


def describe_error(e: BaseException, limit: int = 80) -> str:
    """`Type: the message's first informative line`, cut to `limit`
    characters (Keras's "Exception encountered when calling ..." wrapper
    line and terminal colour codes dropped)."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in str(e).splitlines()]
    lines = [line for line in lines if line and not line.startswith("Exception encountered when calling")]
    text = type(e).__name__ + (f": {lines[0]}" if lines else "")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def interleaved_rounds(names, rounds, seed, fit, problems, on_failure=None, label=""):
    """`rounds` rounds of `fit(name, round)` over `names`, the order shuffled
    after the first round (a variant's place in the round biases nothing).

    Args:
        names: The variants' names.
        rounds: How many rounds.
        seed: Seeds the shuffles (the worker's index: processes differ).
        fit: `fit(name, round) -> (step times in ms, losses)`.
        problems: name -> exception; a variant in it is skipped, one that
            raises is added (`failure`) and skipped from then on.
        on_failure: Called with the name after a variant raised.
        label: Printed before each round's line of medians.

    Returns:
        `(samples, losses)`: name -> the step times, name -> the losses.
    """
    samples = {name: [] for name in names}
    losses = {name: [] for name in names}
    rng = random.Random(seed)
    names = list(names)
    for r in range(rounds):
        if r:
            rng.shuffle(names)
        for name in names:
            if name in problems:
                continue
            try:
                ms, ls = fit(name, r)
            except Exception as e:  # noqa: BLE001
                problems[name] = failure(e)
                if on_failure is not None:
                    on_failure(name)
                continue
            samples[name] += ms
            losses[name] += ls
        print(f"{label}round {r}: " + ", ".join(
            f"{n} {statistics.median(samples[n]):.2f}" for n in names if samples[n] and n not in problems)
            + " ms/step", flush=True)
    return samples, losses


def failure(e: BaseException) -> BaseException:
    """`e`, and the exceptions it chains, without their tracebacks: kept for
    a variant's record, a traceback's frames would keep the failed
    variant's tensors (device memory) alive, and an out-of-memory error
    would then fail every variant after it.

    Returns:
        `e` itself.
    """
    seen, link = set(), e
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        link.__traceback__ = None
        link = link.__cause__ or link.__context__
    return e


class VariantTimeout(Exception):
    """A variant ran past its time budget (`time_limit`)."""


@contextlib.contextmanager
def time_limit(seconds, what):
    """Raises `VariantTimeout` in this (main) thread when the block runs
    longer than `seconds` (None: no limit), so that a variant that would
    hang (e.g. a compilation that does not finish) becomes a recorded
    failure and the process goes on. Python code is interrupted at its next
    bytecode; a long call into C returns first."""
    if seconds is None or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise VariantTimeout(f"{what}: no result within {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def is_out_of_memory(e: BaseException) -> bool:
    """Whether `e` is a device out-of-memory error (torch's
    `OutOfMemoryError`, XLA's RESOURCE_EXHAUSTED), chained ones included."""
    seen, link = set(), e
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        if type(link).__name__ == "OutOfMemoryError" or re.search(
                r"RESOURCE_EXHAUSTED|out of memory|Out of memory", str(link)):
            return True
        link = link.__cause__ or link.__context__
    return False


# --------------------------------------------------------------------------- data and memory
def take(x, n):
    """The first `n` rows of an array, or of each array of a dict."""
    if isinstance(x, dict):
        return {k: v[:n] for k, v in x.items()}
    return x[:n]


_ITEM_BYTES = {"float64": 8, "int64": 8, "float32": 4, "int32": 4, "bfloat16": 2, "float16": 2, "int16": 2,
               "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}


def keras_resident_gib(model):
    """GiB held by a Keras model's variables and its optimizer's (what
    stays allocated between steps: weights, FP8 state, moments)."""
    variables = list(model.weights)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        variables += list(optimizer.variables)
    seen, total = set(), 0
    for v in variables:
        if id(v) in seen:
            continue
        seen.add(id(v))
        total += math.prod(v.shape) * _ITEM_BYTES.get(str(v.dtype), 4)
    return total / 2**30


def torch_resident_gib(module, optimizer):
    """GiB held by a torch module's parameters and buffers and its
    optimizer's state tensors."""
    tensors = list(module.parameters()) + list(module.buffers())
    for state in optimizer.state.values():
        tensors += [t for t in state.values() if hasattr(t, "element_size")]
    seen, total = set(), 0
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total / 2**30


# --------------------------------------------------------------------------- records
def emit(record: dict) -> None:
    """Prints one measurement as a `RESULT` line (JSON)."""
    print(RESULT_PREFIX + json.dumps(record, sort_keys=True), flush=True)


def parse_results(text: str) -> list:
    """The records of the `RESULT` lines in `text` (other lines ignored)."""
    out = []
    for line in text.splitlines():
        if line.startswith(RESULT_PREFIX):
            try:
                out.append(json.loads(line[len(RESULT_PREFIX):]))
            except json.JSONDecodeError:
                continue
    return out


def variant_record(name: str, value, **fields) -> dict:
    """A record for variant `name`: `ms` for a number, `error` for an
    exception, `skipped` for a string (the reason)."""
    record = {"variant": name, **fields}
    if isinstance(value, BaseException):
        record["error"] = describe_error(value)
    elif isinstance(value, str):
        record["skipped"] = value
    elif value is not None:
        record["ms"] = float(value)
    return record


def environment() -> dict:
    """Versions and the device of this process (the table's header). Reads
    package metadata and nvidia-smi: imports nothing."""
    from importlib import metadata

    env = {"python": platform.python_version(), "date": time.strftime("%Y-%m-%d", time.gmtime())}
    for key, dist in (("torch", "torch"), ("torchao", "torchao"), ("transformer_engine", "transformer_engine"),
                      ("jax", "jax"), ("keras", "keras")):
        try:
            env[key] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    if "torch" in sys.modules:
        env["cuda"] = sys.modules["torch"].version.cuda
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        if smi.returncode == 0 and smi.stdout.strip():
            name, _, driver = smi.stdout.strip().splitlines()[0].rpartition(",")
            env["gpu"], env["driver"] = name.strip(), driver.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return env


# --------------------------------------------------------------------------- processes
def add_process_arguments(parser, default=3):
    """`--processes N`, and the worker flags the parent passes on."""
    parser.add_argument("--processes", type=int, default=default,
                        help="fresh worker processes, run one after the other (default %(default)s); "
                             "0 measures in this process")
    parser.add_argument("--process-timeout", type=float, default=900.0,
                        help="seconds one worker may take before it is stopped (what it printed counts)")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds for all workers: no worker is started where less is left than the one "
                             "before it took")
    parser.add_argument("--json", default=None, help="also write every worker's records to this file")
    parser.add_argument("--worker", type=int, default=None, help=argparse_suppress())
    return parser


def argparse_suppress():
    import argparse

    return argparse.SUPPRESS


PARENT_FLAGS = ("--processes", "--json", "--process-timeout", "--time-budget")


def worker_argv(argv):
    """`argv` without the parent's own flags (--processes, --json, ...)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in PARENT_FLAGS:
            skip = True
            continue
        if a.startswith(tuple(f + "=" for f in PARENT_FLAGS)):
            continue
        out.append(a)
    return out


def run_processes(script, argv, n, timeout=900.0, envs=(None,), budget=None, echo=True, extra_argvs=None):
    """Runs `script` with `argv` in `n` fresh Python processes per
    environment in `envs` (each with `--worker i`), one after the other and
    interleaved across environments (process 0 of each, then 1, ...),
    echoing their output prefixed with `[i]`.

    Args:
        timeout: Seconds one process may take (then it is stopped; what it
            printed counts).
        envs: Environment dicts (None: this process's), e.g. one per Keras
            backend.
        budget: Seconds for all of them: a process is not started where
            less is left than the previous process of its environment took
            (the table is then made from the processes that ran).
        extra_argvs: Arguments appended per environment (a list as long as
            `envs`), e.g. one variant per process.

    Returns:
        One list per environment of each process's records.
    """
    out = [[] for _ in envs]
    start = time.time()
    last = [0.0 for _ in envs]
    for i in range(n):
        for j, env in enumerate(envs):
            left = None if budget is None else budget - (time.time() - start)
            if left is not None and (left < 1.1 * last[j] or left <= 5):
                print(f"[{i}] not started: {left:.0f} s left of the {budget:.0f}-s budget", flush=True)
                continue
            limit = timeout if left is None else min(timeout, left)
            extra = [] if extra_argvs is None else list(extra_argvs[j])
            cmd = [sys.executable, script, *argv, *extra, "--worker", str(i)]
            t0 = time.time()
            lines = []
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                    env=env)

            def read(proc=proc, lines=lines, i=i):
                for line in proc.stdout:
                    lines.append(line)
                    if echo:  # RESULT lines too: the log then holds every number
                        print(f"[{i}] {line}", end="", flush=True)

            reader = threading.Thread(target=read, daemon=True)
            reader.start()
            try:
                proc.wait(timeout=max(1.0, limit))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                print(f"[{i}] stopped after {limit:.0f} s", flush=True)
            reader.join(timeout=10)
            took = time.time() - t0
            last[j] = took
            records = parse_results("".join(lines))
            label = "" if env is None else f" ({' '.join([env.get('KERAS_BACKEND', ''), *extra]).strip()})"
            print(f"[{i}]{label} exit {proc.returncode} after {took:.1f} s, {len(records)} records", flush=True)
            out[j].append(records)
    return out


def run_per_backend(script, argv, args, backends):
    """`run_processes` once per Keras backend (KERAS_BACKEND set for each),
    the records of process i of every backend merged into one list."""
    envs = [{**os.environ, "KERAS_BACKEND": b} for b in backends]
    runs = run_processes(os.path.abspath(script), worker_argv(argv), args.processes, args.process_timeout, envs,
                         args.time_budget)
    per_process = [[] for _ in range(args.processes)]
    for backend_runs in runs:
        for i, records in enumerate(backend_runs):
            per_process[i] += records
    return [p for p in per_process if p]


def write_json(path, per_process):
    if path:
        with open(path, "w") as f:
            json.dump(per_process, f, indent=1)


# --------------------------------------------------------------------------- summaries
def summary(values):
    """(median, min, max) of the finite numbers in `values`, or None."""
    vals = [v for v in values if v is not None and isinstance(v, (int, float)) and math.isfinite(v)]
    if not vals:
        return None
    return statistics.median(vals), min(vals), max(vals)


def cell(values, fmt="{:.3f}", suffix=""):
    """"median [min-max]" of `values` (one value: no range), or "-"."""
    s = summary(values)
    if s is None:
        return "-"
    med, lo, hi = s
    if len([v for v in values if v is not None]) == 1:
        return fmt.format(med) + suffix
    return f"{fmt.format(med)}{suffix} [{fmt.format(lo)}-{fmt.format(hi)}]"


def ratio_cell(pairs, fmt="{:.2f}"):
    """The ratio num/den taken per process, summarized as `cell` with an
    "x" suffix; `pairs` is a list of (num, den) per process."""
    return cell([n / d for n, d in pairs if n is not None and d is not None and d > 0], fmt, "x")


class Results:
    """The records of all workers, indexed by (row, variant) per process.

    Args:
        per_process: One list of records per worker (`run_processes`).
        row_key: The record field naming the table row (e.g. "shape").
    """

    def __init__(self, per_process, row_key="row"):
        self.per_process = per_process
        self.row_key = row_key
        self.index = []
        for records in per_process:
            d = {}
            for r in records:
                if "variant" in r:
                    d[(r.get(row_key), r["variant"])] = r
            self.index.append(d)

    def env(self):
        for records in self.per_process:
            for r in records:
                if "env" in r:
                    return r["env"]
        return {}

    def rows(self):
        seen = []
        for d in self.index:
            for row, _ in d:
                if row not in seen:
                    seen.append(row)
        return seen

    def records(self, row, variant):
        return [d.get((row, variant)) for d in self.index]

    def values(self, row, variant, field="ms"):
        return [None if r is None else r.get(field) for r in self.records(row, variant)]

    def problem(self, row, variant):
        """"n/a (...)" when the variant has no value in any process."""
        recs = [r for r in self.records(row, variant) if r is not None]
        if not recs:
            return "n/a (not run)"
        for key, label in (("error", "error: "), ("skipped", "")):
            for r in recs:
                if key in r:
                    return f"n/a ({label}{r[key]})"
        return None

    def ms(self, row, variant, field="ms", fmt="{:.3f}", suffix=""):
        if summary(self.values(row, variant, field)) is None:
            return self.problem(row, variant) or "-"
        return cell(self.values(row, variant, field), fmt, suffix)

    def ratio(self, row, num, den, field="ms", fmt="{:.2f}", inverse=True):
        """Per-process ratio of two variants, summarized. `inverse` (time):
        den_time / num_time, i.e. the speed-up of `num` over `den`."""
        a, b = self.values(row, num, field), self.values(row, den, field)
        pairs = [(y, x) if inverse else (x, y) for x, y in zip(a, b)]
        text = ratio_cell(pairs, fmt)
        if text == "-":
            return self.problem(row, num) or self.problem(row, den) or "-"
        return text


def env_line(env: dict) -> str:
    keys = ("gpu", "driver", "cuda", "torch", "torchao", "transformer_engine", "jax", "keras", "python", "date")
    return "; ".join(f"{k} {env[k]}" for k in keys if env.get(k))


def check_choices(parser, flag, given, allowed):
    """`parser.error` naming `flag` unless every name of `given` (a list)
    is one of `allowed`."""
    unknown = sorted(set(given) - set(allowed))
    if unknown:
        parser.error(f"{flag}: unknown {unknown}; expected some of {list(allowed)}")


def main(script, argv, parse_args, worker_fn, table_fn, backends=False):
    """A script's `main`: `argv` (default `sys.argv[1:]`) parsed, then
    `main_or_worker`; with `backends`, the parent runs its processes once
    per backend of `--backends` (`run_per_backend`)."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if not backends or args.worker is not None or args.processes <= 0:
        return main_or_worker(script, argv, args, worker_fn, table_fn)
    per_process = run_per_backend(script, argv, args, args.backends.split(","))
    write_json(args.json, per_process)
    print(table_fn(per_process, args))
    return per_process


def main_or_worker(script, argv, args, worker_fn, table_fn):
    """The scripts' common entry: a worker measures and prints records; the
    parent runs `args.processes` workers (or measures in-process for 0)
    and prints `table_fn(Results-like per_process, args)`."""
    if args.worker is not None:
        worker_fn(args)
        return None
    if args.processes <= 0:
        import contextlib
        import io

        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            worker_fn(args)
        per_process = [parse_results(buf.getvalue())]
    else:
        per_process = run_processes(os.path.abspath(script), worker_argv(argv), args.processes,
                                    args.process_timeout, budget=args.time_budget)[0]
    write_json(args.json, per_process)
    text = table_fn(per_process, args)
    print(text)
    return per_process
