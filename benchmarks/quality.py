"""Training quality on a language model: mixed_bfloat16 vs each FP8 recipe.

    KERAS_BACKEND=jax python benchmarks/quality.py --size cpu --plot docs/quality_cpu.png
    KERAS_BACKEND=jax python benchmarks/quality.py --size gpu --plot $OUT/quality_gpu.png --json $OUT/quality_gpu.json
    python benchmarks/quality.py --across-seeds seed0.json,seed1.json   # gaps per seed and their mean

A small decoder LM (pre-norm blocks: causal self-attention and a SwiGLU MLP,
learned positions, RMS norms; every projection an `FP8Dense`, the output
layer a plain `Dense` in the compute dtype) on byte tokens (vocabulary 256),
trained once per recipe from the same initial weights on the same batches in
the same order:

- `bf16`: `mixed_bfloat16` (the FP8Dense layers run exactly `Dense`);
- `delayed`: `fp8_hybrid` (delayed scaling, the default recipe);
- `current`: `fp8_hybrid[scaling=current]`;
- `block`: `fp8_e4m3[scaling=block]` (1 x 128 tiles, 128 x 128 weight blocks);

each FP8 policy with `min_gemm_size=0`, so that every projection runs FP8 at
these sizes. AdamW (beta_2 0.95, weight decay 0.1, global gradient norm
clipped at 1), linear warm-up then cosine decay to a tenth. With
`--fp8-moments` every recipe but bf16 trains with
`keras_fp8.optimizers.FP8AdamW` (the same arguments, its moments in FP8), so
the gaps to bf16 (plain AdamW) include the moments' effect.

Data (no downloads): `--corpus docs` is `benchmarks/data/python_docs.txt`
(CPython's documentation topics and standard-library docstrings, shipped;
`benchmarks/data/build_corpus.py` builds it); `--corpus stdlib` reads the
`.py` files of the running Python's standard library (tens of MB). Either
is cut into 64 KiB chunks, every 20th chunk held out for validation.
Training batches are windows at seeded random offsets of the training text.

Reported per recipe: final training loss (mean over the last evaluation
interval) and validation loss (the fixed validation windows), their
relative gap to bf16, the largest gap over the curve (every evaluation after
the first), non-finite step losses, skipped optimizer steps (steps the
optimizer's iteration counter did not count), the step time; a PNG of the
curves (`--plot`) and every number as JSON (`--json`). On CPU, FP8 runs the
exact emulation (much slower than bf16, numerically the GPU's).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import timing  # noqa: E402

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "python_docs.txt")
RECIPES = {
    "bf16": "mixed_bfloat16",
    "delayed": "fp8_hybrid[min_gemm_size=0]",
    "current": "fp8_hybrid[scaling=current,min_gemm_size=0]",
    "block": "fp8_e4m3[scaling=block,min_gemm_size=0]",
}
# dims: hidden, layers, heads, mlp; seq, batch; steps, eval_every, warmup; lr; val_windows; corpus
SIZES = {
    "tiny": dict(hidden=32, layers=1, heads=2, mlp=64, seq=32, batch=4, steps=6, eval_every=3, warmup=2,
                 lr=3e-3, val_windows=4, corpus="docs"),
    "cpu": dict(hidden=128, layers=2, heads=4, mlp=384, seq=128, batch=16, steps=400, eval_every=40, warmup=20,
                lr=3e-3, val_windows=96, corpus="docs"),
    "gpu": dict(hidden=512, layers=6, heads=8, mlp=1536, seq=512, batch=32, steps=1000, eval_every=100,
                warmup=50, lr=1.5e-3, val_windows=256, corpus="stdlib"),
}
CHUNK = 64 * 1024
VAL_EVERY = 20


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="LM training quality: bf16 vs FP8 recipes.")
    p.add_argument("--size", choices=sorted(SIZES), default="cpu")
    for key, value in SIZES["cpu"].items():
        kind = type(value) if key != "corpus" else str
        p.add_argument(f"--{key.replace('_', '-')}", dest=key, type=kind, default=None,
                       help=f"override the size's {key}")
    p.add_argument("--recipes", default=",".join(RECIPES), help="comma list of " + ",".join(RECIPES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=None, help="write the curves to this PNG")
    p.add_argument("--json", default=None, help="write every number and curve to this file (rewritten after each recipe)")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds: a recipe is not started where less is left than the longest one took")
    p.add_argument("--dry-run", action="store_true", help="the tiny size")
    p.add_argument("--fp8-moments", action="store_true",
                   help="every recipe but bf16 trains with keras_fp8.optimizers.FP8AdamW (Adam's moments in FP8)")
    p.add_argument("--jax-xla-fp8", action="store_true",
                   help="JAX: XLA's quantize fusions and FP8 dot instead of the backend's custom calls "
                        "(jax_gemm.set_enabled(False))")
    p.add_argument("--baseline-json", default=None,
                   help="take the bf16 run from this earlier --json file (same size and seed) instead of training "
                        "it again; bf16 must then be left out of --recipes")
    p.add_argument("--across-seeds", default=None,
                   help="no training: per recipe, the final validation gap to bf16 at each seed and the mean over "
                        "the seeds, from --json files of runs of one size at different seeds (comma-separated; each "
                        "file holds its own seed's bf16)")
    p.add_argument("--from-json", default=None,
                   help="no training: the table (and --plot, and with --json one merged file) from files earlier "
                        "runs of the same size and seed wrote with --json (comma-separated; a recipe in a later "
                        "file replaces the same recipe of an earlier one)")
    args = p.parse_args(argv)
    size = "tiny" if args.dry_run else args.size
    for key, value in SIZES[size].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.size = size
    args.recipe_list = args.recipes.split(",")
    timing.check_choices(p, "--recipes", args.recipe_list, RECIPES)
    if args.from_json and args.across_seeds:
        p.error("--from-json, --across-seeds: one at a time")
    if args.baseline_json and "bf16" in args.recipe_list:
        p.error("--baseline-json: leave bf16 out of --recipes (the file holds it)")
    if args.corpus not in ("docs", "stdlib"):
        p.error(f"--corpus: expected docs or stdlib, got {args.corpus!r}")
    if args.hidden % args.heads:
        p.error(f"--hidden {args.hidden} must be a multiple of --heads {args.heads}")
    if args.steps % args.eval_every:
        p.error(f"--steps {args.steps} must be a multiple of --eval-every {args.eval_every}")
    return args


# --------------------------------------------------------------------------- data
def corpus_bytes(kind):
    """The corpus as bytes, and a line naming its source."""
    if kind == "docs":
        with open(DATA, "rb") as f:
            text = f.read()
        return text, f"benchmarks/data/python_docs.txt ({len(text) / 1e6:.2f} MB)"
    import sysconfig

    root = sysconfig.get_paths()["stdlib"]
    parts = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        for name in sorted(filenames):
            if name.endswith(".py"):
                with open(os.path.join(dirpath, name), "rb") as f:
                    parts.append(f.read())
    text = b"\n".join(parts)
    return text, f"the .py files of {root} ({len(text) / 1e6:.1f} MB)"


def split(text):
    """(train, validation) bytes: every VAL_EVERY-th CHUNK held out."""
    chunks = [text[i:i + CHUNK] for i in range(0, len(text), CHUNK)]
    val = b"".join(c for i, c in enumerate(chunks) if i % VAL_EVERY == VAL_EVERY - 1)
    train = b"".join(c for i, c in enumerate(chunks) if i % VAL_EVERY != VAL_EVERY - 1)
    return train, val


def batches(args, train, val):
    """Training windows (steps*batch, seq) + targets, validation windows."""
    import numpy as np

    t = np.frombuffer(train, dtype=np.uint8)
    rng = np.random.default_rng(args.seed)
    n = args.steps * args.batch
    starts = rng.integers(0, len(t) - args.seq - 1, n)
    windows = np.stack([t[s:s + args.seq + 1] for s in starts]).astype("int32")
    v = np.frombuffer(val, dtype=np.uint8)
    count = min(args.val_windows, (len(v) - 1) // args.seq)
    vw = np.stack([v[i * args.seq:i * args.seq + args.seq + 1] for i in range(count)]).astype("int32")
    return windows[:, :-1], windows[:, 1:], vw[:, :-1], vw[:, 1:]


# --------------------------------------------------------------------------- model
def build_model(args, policy, fp8_moments=False):
    import keras
    from keras import ops

    from keras_fp8.layers import FP8Dense

    class Positions(keras.layers.Layer):
        def build(self, input_shape):
            self.table = self.add_weight(shape=(args.seq, args.hidden), initializer=keras.initializers.RandomNormal(
                stddev=0.02), name="table")

        def call(self, x):
            return x + ops.cast(self.table, x.dtype)

    class Block(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.n1 = keras.layers.RMSNormalization()
            self.n2 = keras.layers.RMSNormalization()
            self.qkv = FP8Dense(3 * args.hidden, use_bias=False)
            self.out = FP8Dense(args.hidden, use_bias=False)
            self.gate = FP8Dense(args.mlp, use_bias=False)
            self.up = FP8Dense(args.mlp, use_bias=False)
            self.down = FP8Dense(args.hidden, use_bias=False)

        def call(self, h):
            b, s = ops.shape(h)[0], ops.shape(h)[1]
            qkv = ops.reshape(self.qkv(self.n1(h)), (b, s, 3, args.heads, args.hidden // args.heads))
            q, k, v = ops.unstack(qkv, axis=2)
            a = ops.dot_product_attention(q, k, v, is_causal=True)
            h = h + self.out(ops.reshape(a, (b, s, args.hidden)))
            m = self.n2(h)
            return h + self.down(ops.silu(self.gate(m)) * self.up(m))

    keras.mixed_precision.set_global_policy(policy)
    try:
        keras.utils.set_random_seed(args.seed)
        tokens = keras.Input((args.seq,), dtype="int32")
        h = Positions()(keras.layers.Embedding(256, args.hidden)(tokens))
        for _ in range(args.layers):
            h = Block()(h)
        h = keras.layers.RMSNormalization()(h)
        logits = keras.layers.Dense(256, use_bias=False, dtype="mixed_bfloat16")(h)
        model = keras.Model(tokens, logits)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    schedule = keras.optimizers.schedules.CosineDecay(
        0.0, decay_steps=args.steps - args.warmup, alpha=0.1, warmup_target=args.lr, warmup_steps=args.warmup)
    optimizer = keras.optimizers.AdamW(schedule, beta_2=0.95, weight_decay=0.1, global_clipnorm=1.0)
    if fp8_moments:
        import keras_fp8

        optimizer = keras_fp8.optimizers.fp8_moments(optimizer)
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def train(args, policy, x, y, xv, yv, fp8_moments=False):
    """Trains one model (its AdamW's moments in FP8 with `fp8_moments`);
    returns its curves and counters."""
    import keras

    model = build_model(args, policy, fp8_moments)
    step_losses = []

    class StepLosses(keras.callbacks.Callback):
        """Each step's own loss from Keras's running mean over the fit call."""

        def on_epoch_begin(self, epoch, logs=None):
            self.prev = 0.0

        def on_train_batch_end(self, batch, logs=None):
            mean = float(logs["loss"])
            step_losses.append((batch + 1) * mean - batch * self.prev)
            self.prev = mean

    curve = [{"step": 0, "val": float(model.evaluate(xv, yv, batch_size=args.batch, verbose=0))}]
    n = args.eval_every * args.batch
    t_train = t_timed = 0.0
    for i in range(args.steps // args.eval_every):
        t0 = time.perf_counter()
        model.fit(x[i * n:(i + 1) * n], y[i * n:(i + 1) * n], batch_size=args.batch, epochs=1, shuffle=False,
                  verbose=0, callbacks=[StepLosses()])
        t_train += time.perf_counter() - t0
        if i:  # the first interval holds the compilation
            t_timed += time.perf_counter() - t0
        interval = step_losses[-args.eval_every:]
        val = float(model.evaluate(xv, yv, batch_size=args.batch, verbose=0))
        curve.append({"step": (i + 1) * args.eval_every, "train": sum(interval) / len(interval), "val": val})
        print(f"  step {curve[-1]['step']}: train {curve[-1]['train']:.4f}, val {val:.4f} "
              f"({t_train:.0f} s)", flush=True)
    iterations = int(keras.ops.convert_to_numpy(model.optimizer.iterations))
    out = {
        "policy": policy,
        "fp8_moments": fp8_moments,
        "curve": curve,
        "step_losses": step_losses,
        "final_train": curve[-1]["train"],
        "final_val": curve[-1]["val"],
        "nonfinite": sum(1 for v in step_losses if not math.isfinite(v)),
        "skipped": args.steps - iterations,
        "ms_per_step": (1e3 * t_timed / (args.steps - args.eval_every) if args.steps > args.eval_every
                        else 1e3 * t_train / args.steps),
    }
    keras.backend.clear_session()
    return out


# --------------------------------------------------------------------------- report
def gaps(result, base):
    """Relative gaps to `base`: final train/val and the largest |gap| over
    the curve (every evaluation after the first), signed."""

    def rel(a, b):
        return (a - b) / b if b and math.isfinite(a) and math.isfinite(b) else float("nan")

    val_gaps = [rel(p["val"], q["val"]) for p, q in zip(result["curve"][1:], base["curve"][1:])]
    train_gaps = [rel(p["train"], q["train"]) for p, q in zip(result["curve"][1:], base["curve"][1:])]

    def largest(gs):
        finite = [g for g in gs if math.isfinite(g)]
        return max(finite, key=abs) if finite else float("nan")

    return {
        "gap_train": rel(result["final_train"], base["final_train"]),
        "gap_val": rel(result["final_val"], base["final_val"]),
        "max_gap_val": largest(val_gaps),
        "max_gap_train": largest(train_gaps),
    }


HEADER = ("| recipe | policy | final train loss | final val loss | val gap to bf16 | max val gap over the curve "
          "| max train gap | non-finite steps | skipped steps | ms/step |")


def table(results):
    base = results.get("bf16")
    out = [HEADER, "|" + "---|" * (HEADER.count("|") - 1)]
    for name, r in results.items():
        if "error" in r:
            out.append(f"| {name} | `{RECIPES[name]}` | n/a (error: {r['error']}) | | | | | | | |")
            continue
        g = gaps(r, base) if base and "error" not in base and name != "bf16" else None

        def pct(v):
            return "-" if g is None or not math.isfinite(v) else f"{100 * v:+.2f}%"

        moments = " + FP8 moments" if r.get("fp8_moments") else ""
        out.append(f"| {name} | `{r['policy']}`{moments} | {r['final_train']:.4f} | {r['final_val']:.4f} "
                   f"| {pct(g['gap_val']) if g else '-'} | {pct(g['max_gap_val']) if g else '-'} "
                   f"| {pct(g['max_gap_train']) if g else '-'} | {r['nonfinite']} | {r['skipped']} "
                   f"| {r['ms_per_step']:.1f} |")
    return "\n".join(out)


def plot(results, args, path, backend=None):
    """The loss curves and the validation gap to bf16, as a PNG at `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens_per_step = args.batch * args.seq
    if backend is None:
        import keras

        backend = keras.backend.backend()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    base = results.get("bf16")
    for name, r in results.items():
        if "error" in r:
            continue
        steps = [p["step"] * tokens_per_step / 1e6 for p in r["curve"]]
        line, = ax1.plot(steps, [p["val"] for p in r["curve"]], label=f"{name} val", marker=".")
        ax1.plot(steps[1:], [p["train"] for p in r["curve"][1:]], color=line.get_color(), alpha=0.4,
                 linestyle="--", label=f"{name} train")
        if base and "error" not in base and name != "bf16":
            gap = [100 * (p["val"] - q["val"]) / q["val"] for p, q in zip(r["curve"][1:], base["curve"][1:])]
            ax2.plot(steps[1:], gap, color=line.get_color(), marker=".", label=name)
    ax1.set_xlabel("training tokens (M)")
    ax1.set_ylabel("loss (nats per byte)")
    # The first evaluation (the untrained ln 256) would squash the rest.
    shown = [p[k] for r in results.values() if "error" not in r for p in r["curve"][1:] for k in ("train", "val")
             if math.isfinite(p.get(k, float("nan")))]
    if shown:
        lo, hi = min(shown), max(shown)
        pad = 0.05 * (hi - lo) or 0.05
        ax1.set_ylim(lo - pad, hi + pad)
    ax1.legend(fontsize=7, ncol=2)
    ax1.set_title(f"{args.size} size, Keras {backend}: d={args.hidden}, {args.layers} blocks, seq {args.seq}, "
                  f"{args.steps * tokens_per_step / 1e6:.2f}M tokens", fontsize=9)
    ax2.axhline(0.0, color="gray", linewidth=0.8)
    ax2.axhspan(-1.0, 1.0, color="green", alpha=0.08, label="within 1%")
    ax2.set_xlabel("training tokens (M)")
    ax2.set_ylabel("validation loss gap to bf16 (%)")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# The arguments two runs must share for their recipes to be compared.
SAME_SIZE = ("hidden", "layers", "heads", "mlp", "seq", "batch", "steps", "eval_every", "warmup", "lr",
             "val_windows", "corpus")
SAME_RUN = SAME_SIZE + ("seed",)


def check_same_run(saved_args, args, flag, path, keys=SAME_RUN):
    """Exits naming `flag` and `path` where the saved run's `keys` (size and
    seed) differ from `args`."""
    differ = [k for k in keys if saved_args.get(k) != getattr(args, k)]
    if differ:
        raise SystemExit(f"{flag}: {path} was run with other {differ}")


def seeds_table(runs):
    """Per FP8 recipe: the final validation gap to the same seed's bf16 at
    each seed, and their mean over the seeds where both ran. `runs` maps a
    seed to its results."""
    seeds = list(runs)
    header = ("| recipe | policy |" + "".join(f" val gap, seed {s} |" for s in seeds)
              + " mean val gap | seeds |")
    out = [header, "|" + "---|" * (header.count("|") - 1)]
    for name in RECIPES:
        if name == "bf16" or not any(name in r for r in runs.values()):
            continue
        cells, values = [], []
        for seed in seeds:
            r, base = runs[seed].get(name), runs[seed].get("bf16")
            if r is None or base is None or "error" in r or "error" in base:
                cells.append("n/a")
                continue
            values.append(gaps(r, base)["gap_val"])
            cells.append(f"{100 * values[-1]:+.2f}%")
        mean = f"{100 * sum(values) / len(values):+.2f}%" if values else "n/a"
        out.append(f"| {name} | `{RECIPES[name]}` | " + " | ".join(cells) + f" | {mean} | {len(values)} |")
    return "\n".join(out)


def across_seeds(args):
    """The final validation gaps of runs of one size at several seeds."""
    runs = {}
    for i, path in enumerate(args.across_seeds.split(",")):
        with open(path) as f:
            saved = json.load(f)
        if i == 0:
            for key in SAME_SIZE:
                setattr(args, key, saved["args"].get(key))
        else:
            check_same_run(saved["args"], args, "--across-seeds", path, keys=SAME_SIZE)
        seed = saved["args"].get("seed")
        if seed in runs:
            raise SystemExit(f"--across-seeds: {path} repeats seed {seed}")
        runs[seed] = saved["results"]
    print(seeds_table(runs))
    return runs


def from_json(args):
    """The table (and the plot) of earlier runs' `--json` files, merged."""
    paths = args.from_json.split(",")
    results, notes = {}, []
    for i, path in enumerate(paths):
        with open(path) as f:
            saved = json.load(f)
        if saved.get("note"):
            notes.append(saved["note"])
        if i == 0:
            first = saved
            for key, value in saved["args"].items():
                if key not in ("plot", "json", "from_json"):
                    setattr(args, key, value)
        else:
            check_same_run(saved["args"], args, "--from-json", path)
        results.update(saved["results"])
    order = [name for name in RECIPES if name in results]
    results = {name: results[name] for name in order}
    args.recipes = ",".join(order)
    env, tokens, source = first["env"], first["tokens"], first["source"]
    print(f"# {timing.env_line(env)}; backend {env.get('backend')}")
    print(f"# {tokens:,} training tokens; corpus {source}")
    print(table(results))
    if args.plot:
        plot(results, args, args.plot, backend=env.get("backend"))
    if args.json and len(paths) > 1:
        save_json(args, env, tokens, source, results, note="; ".join(notes) or None)
    return results


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.from_json:
        return from_json(args)
    if args.across_seeds:
        return across_seeds(args)
    import keras

    import keras_fp8  # noqa: F401 (registers the FP8 policies)

    if keras.backend.backend() == "jax":
        from keras_fp8.backends import jax_gemm

        jax_gemm.set_enabled(not args.jax_xla_fp8)
    text, source = corpus_bytes(args.corpus)
    train_text, val_text = split(text)
    x, y, xv, yv = batches(args, train_text, val_text)
    tokens = args.steps * args.batch * args.seq
    env = timing.environment()
    env["backend"] = keras.backend.backend()
    print(f"# {timing.env_line(env)}; backend {env['backend']}")
    print(f"# size {args.size}: hidden {args.hidden}, {args.layers} blocks, {args.heads} heads, MLP {args.mlp}, "
          f"sequence {args.seq}, batch {args.batch}; {args.steps} steps = {tokens:,} training tokens; "
          f"validation {len(xv)} windows = {xv.size:,} tokens; corpus {source}", flush=True)
    results = {}
    if args.baseline_json:
        with open(args.baseline_json) as f:
            saved = json.load(f)
        check_same_run(saved["args"], args, "--baseline-json", args.baseline_json)
        results["bf16"] = saved["results"]["bf16"]
        print(f"bf16: from {args.baseline_json}", flush=True)
    start, longest = time.perf_counter(), 0.0
    for name in args.recipe_list:
        print(f"{name} ({RECIPES[name]}):", flush=True)
        t0 = time.perf_counter()
        left = None if args.time_budget is None else args.time_budget - (t0 - start)
        if left is not None and left < 1.1 * longest:
            results[name] = {"policy": RECIPES[name], "error": f"not run: {left:.0f} s left of the time budget"}
            timing.emit({"recipe": name, **results[name]})
            continue
        try:
            results[name] = train(args, RECIPES[name], x, y, xv, yv,
                                  fp8_moments=args.fp8_moments and name != "bf16")
        except Exception as e:  # noqa: BLE001 (the row says n/a)
            results[name] = {"policy": RECIPES[name], "error": timing.describe_error(e)}
            keras.backend.clear_session()
        results[name]["wall_s"] = time.perf_counter() - t0
        longest = max(longest, results[name]["wall_s"])
        summary = {k: v for k, v in results[name].items() if k not in ("curve", "step_losses")}
        if "bf16" in results and "error" not in results["bf16"] and name != "bf16" and "error" not in results[name]:
            summary.update(gaps(results[name], results["bf16"]))
        timing.emit({"recipe": name, **summary})
        if args.json:  # after every recipe: a run cut short keeps the recipes that finished
            save_json(args, env, tokens, source, results)
    print()
    print(table(results))
    if args.plot:
        plot(results, args, args.plot)
        print(f"\nplot: {args.plot}")
    return results


def save_json(args, env, tokens, source, results, note=None):
    """Writes every number and curve so far to `args.json` (replacing it
    whole), with `note` (how the runs were assembled) where given."""
    tmp = args.json + ".tmp"
    saved = {"args": {k: v for k, v in vars(args).items()}, "env": env, "tokens": tokens, "source": source}
    if note:
        saved["note"] = note
    saved["results"] = results
    with open(tmp, "w") as f:
        json.dump(saved, f, indent=1)
    os.replace(tmp, args.json)


if __name__ == "__main__":
    main()
