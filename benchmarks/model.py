"""Decoder model training step (`model.fit`): mixed_bfloat16 vs fp8_hybrid.

    python benchmarks/model.py [--processes 3] [--backends torch,jax] [--monitor]
    python benchmarks/model.py --size small --backends torch --peers none
    python benchmarks/model.py --dry-run             # CPU, a tiny model: the table code

The decoder of ANCHORS.md (`--size full`): hidden 4096, SwiGLU MLP 14336, 32
heads, 4 blocks, sequence 2048, batch 8 (16384 tokens), vocabulary 32000,
causal attention, RMS norms, AdamW with float32 master weights, the output
layer a plain `Dense` in the compute dtype (never FP8). `--size small`:
hidden 1024, MLP 2816, 8 heads, sequence 512, vocabulary 8000 (host-bound:
the shortcut's share shows there). Random tokens; the same data for every
variant.

Variants, interleaved within each process (each round one `fit` call of
`--steps` steps per variant, in a shuffled order; a sample is one step,
the first step of each call left out):

- `mixed_bfloat16`: the projections are `keras.layers.Dense`;
- `mixed_bfloat16+shortcut` (torch): the same model and weights, its
  projections' eager calls skipping Keras's `Layer.__call__`: the ablation
  that measures what `Layer.__call__`'s host time costs the model (the FP8
  layers, like every Keras layer, go through it);
- `fp8_hybrid` (and any other FP8 policy in `--policies`): the projections
  are `FP8Dense`;
- `fp8_hybrid+monitor` (`--monitor`): the same FP8 model, its `fit` with
  one `keras_fp8.callbacks.FP8Monitor` for the process (default
  `every_n_steps`, a probe batch of the training batch size, its
  statistics compiled in the warm-up). Its step count restarts with each
  `fit`, so each fit measures once, at its first step: that work falls in
  the first timed step. The median step is then the cost of the steps it
  does not measure, and the mean over the timed steps against
  `fp8_hybrid`'s gives one measurement's cost (x the timed steps per fit),
  from which the tables derive the overhead at the default
  `every_n_steps`. Each measurement is also timed directly (its
  `measure` call): the median and the slowest of the timed fits', which
  tell a measurement's own cost from other work the fit's steps took;
- torch peers (`--peers auto`: with the torch backend on a GPU), the same
  network in plain PyTorch: `torch-bf16` (bf16 autocast, fused AdamW, each
  block `torch.compile`d) and `torchao` (the same with torchao's float8
  tensorwise training on every projection but the output layer).

Memory of one step: torch, `torch.cuda.max_memory_allocated()` over one
step minus what was allocated before it (parameters, optimizer state and
every other model of the process stay resident); JAX, the device's
`peak_bytes_in_use` after the warm-up `fit` minus `bytes_in_use` then,
taken only for the variant a process warms up first (the peak never
resets; the warm-up order rotates with the process index, so with two
policies and two or more processes each gets measured). The peak step
memory adds the variant's own resident memory (its variables and optimizer
state) to that: what the step would peak at with that model alone. Torch on a GPU
also prints the device memory free when a process starts and counts, in
each Keras variant's record, the caching allocator's retries in its timed
fits (`alloc_retries`): both show memory pressure that step times alone
would hide.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import timing  # noqa: E402

SIZES = {
    "full": dict(hidden=4096, mlp=14336, heads=32, blocks=4, seq=2048, batch=8, vocab=32000),
    "small": dict(hidden=1024, mlp=2816, heads=8, blocks=4, seq=512, batch=8, vocab=8000),
    "tiny": dict(hidden=64, mlp=128, heads=2, blocks=2, seq=32, batch=2, vocab=256),
}
SHORTCUT = "+shortcut"
MONITOR = "+monitor"
BLOCKS = "+blocks"  # keras_fp8.compile_blocks
PEERS = ["torch-bf16", "torchao"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Decoder model.fit step: mixed_bfloat16 vs FP8 policies.")
    p.add_argument("--backends", default="torch,jax", help="backends the parent runs workers for")
    p.add_argument("--size", choices=sorted(SIZES), default=None, help="full (default), small, tiny (dry run)")
    for key in SIZES["full"]:
        p.add_argument(f"--{key}", type=int, default=None, help=f"override the size's {key}")
    p.add_argument("--policies", default="mixed_bfloat16,fp8_hybrid",
                   help="comma list: mixed_bfloat16 first, then FP8 policy names")
    p.add_argument("--no-shortcut-ablation", dest="shortcut", action="store_false",
                   help="torch: skip the mixed_bfloat16+shortcut variant")
    p.add_argument("--monitor", action="store_true", help="add fp8_hybrid+monitor (keras_fp8.callbacks.FP8Monitor)")
    p.add_argument("--compile-blocks", action="store_true",
                   help="torch: add a POLICY+blocks variant per policy (keras_fp8.compile_blocks)")
    p.add_argument("--peers", choices=["auto", "none"], default="auto",
                   help="auto: the plain-PyTorch peers in the torch workers on a GPU")
    p.add_argument("--attention", choices=["auto", "flash", "xla"], default="auto",
                   help="Keras's flash_attention argument: None / True / False")
    p.add_argument("--loss", choices=["keras", "flat"], default="keras",
                   help="keras: SparseCategoricalCrossentropy on (batch, seq, vocab); flat: the same loss on "
                        "(batch*seq, vocab) rows")
    p.add_argument("--warmup", type=int, default=2, help="steps of the untimed first fit per variant")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=5, help="steps per fit call (the first is not timed)")
    p.add_argument("--no-memory", dest="memory", action="store_false")
    p.add_argument("--jax-xla-fp8", action="store_true",
                   help="JAX: XLA's quantize fusions and FP8 dot instead of the backend's custom calls "
                        "(jax_gemm.set_enabled(False))")
    p.add_argument("--dry-run", action="store_true", help="CPU, the tiny size, one round")
    timing.add_process_arguments(p)
    args = p.parse_args(argv)
    size = args.size or ("tiny" if args.dry_run else "full")
    for key, value in SIZES[size].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.size = size
    if args.hidden % args.heads:
        p.error(f"--hidden {args.hidden} must be a multiple of --heads {args.heads}")
    args.policy_list = args.policies.split(",")
    if args.policy_list[0] != "mixed_bfloat16":
        p.error(f"--policies: expected mixed_bfloat16 first (the baseline), got {args.policies!r}")
    if args.dry_run:
        args.warmup, args.rounds, args.steps = 1, 1, 3
    if args.steps < 2:
        p.error("--steps: at least 2 (the first step of each fit is not timed)")
    return args


def keras_variants(args, backend):
    """The Keras variant names, in their order."""
    out = []
    for policy in args.policy_list:
        out.append(policy)
        if policy == "mixed_bfloat16" and args.shortcut and backend == "torch":
            out.append(policy + SHORTCUT)
    if args.monitor:
        fp8 = [p for p in args.policy_list if p != "mixed_bfloat16"]
        if fp8:
            out.append(fp8[0] + MONITOR)
    if getattr(args, "compile_blocks", False) and backend == "torch":
        out += [policy + BLOCKS for policy in args.policy_list]
    return out


def data(args):
    import numpy as np

    rng = np.random.default_rng(0)
    n = args.batch * max(args.warmup, args.steps)
    tokens = rng.integers(0, args.vocab, (n, args.seq + 1)).astype("int32")
    return tokens[:, :-1], tokens[:, 1:]


# --------------------------------------------------------------------------- Keras
def shortcut_dense_class():
    """`keras.layers.Dense` whose eager call on a plain torch tensor in its
    compute dtype skips `Layer.__call__` while `ShortcutDense.enabled` (no
    bias, no activation: the decoder's projections): the host time of
    `Layer.__call__`, measured."""
    import keras
    import torch

    from keras_fp8 import compat

    class ShortcutDense(keras.layers.Dense):
        enabled = False

        def __call__(self, *args, **kwargs):
            if ShortcutDense.enabled and len(args) == 1 and set(kwargs) <= {"training"}:
                x = args[0]
                if (type(x) is torch.Tensor and self.built and not self.use_bias and self.activation in
                        (None, keras.activations.linear) and not self.lora_enabled
                        and x.dtype == getattr(torch, self.compute_dtype) and x.device == self.kernel.value.device
                        and not compat.in_stateless_scope()
                        and compat.keras_mask(x) is None and not torch.compiler.is_compiling()
                        and not self._forward_hooks and not self._forward_pre_hooks):
                    return torch.matmul(x, compat.raw_value(self.kernel).to(x.dtype))
            return super().__call__(*args, **kwargs)

    return ShortcutDense


def keras_model(args, policy, dense_cls):
    import keras
    from keras import ops

    from keras_fp8.layers import FP8Dense

    fp8 = policy != "mixed_bfloat16"
    proj = FP8Dense if fp8 else dense_cls
    flash = {"auto": None, "flash": True, "xla": False}[getattr(args, "attention", "auto")]

    class CausalSelfAttention(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.qkv = proj(3 * args.hidden, use_bias=False)
            self.out = proj(args.hidden, use_bias=False)

        def call(self, x):
            b, s = ops.shape(x)[0], ops.shape(x)[1]
            qkv = ops.reshape(self.qkv(x), (b, s, 3, args.heads, args.hidden // args.heads))
            q, k, v = ops.unstack(qkv, axis=2)
            a = ops.dot_product_attention(q, k, v, is_causal=True, flash_attention=flash)
            return self.out(ops.reshape(a, (b, s, args.hidden)))

    class SwiGLU(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.gate = proj(args.mlp, use_bias=False)
            self.up = proj(args.mlp, use_bias=False)
            self.down = proj(args.hidden, use_bias=False)

        def call(self, x):
            return self.down(ops.silu(self.gate(x)) * self.up(x))

    keras.mixed_precision.set_global_policy(policy)
    try:
        keras.utils.set_random_seed(0)
        tokens = keras.Input((args.seq,), dtype="int32")
        h = keras.layers.Embedding(args.vocab, args.hidden)(tokens)
        for _ in range(args.blocks):
            h = h + CausalSelfAttention()(keras.layers.RMSNormalization()(h))
            h = h + SwiGLU()(keras.layers.RMSNormalization()(h))
        h = keras.layers.RMSNormalization()(h)
        logits = keras.layers.Dense(args.vocab, use_bias=False, dtype="mixed_bfloat16")(h)
        model = keras.Model(tokens, logits)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    if getattr(args, "loss", None) == "flat":
        def loss(y_true, y_pred):
            return keras.losses.sparse_categorical_crossentropy(
                ops.reshape(y_true, (-1,)), ops.reshape(y_pred, (-1, args.vocab)), from_logits=True)
    else:
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer=keras.optimizers.AdamW(1e-4), loss=loss)
    return model


class _Timer:
    """Keras callback factory: step end stamps, losses, one step's memory."""

    @staticmethod
    def make(memory_step=None):
        import keras

        class Timer(keras.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.stamps, self.losses, self.mem_gib = [], [], None
                self._before = None

            def on_train_batch_begin(self, batch, logs=None):
                if memory_step is not None and batch == memory_step:
                    import torch

                    torch.cuda.synchronize()
                    self._before = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()

            def on_train_batch_end(self, batch, logs=None):
                self.losses.append(float(logs["loss"]))
                self.stamps.append(time.perf_counter())
                if self._before is not None and batch == memory_step:
                    import torch

                    self.mem_gib = (torch.cuda.max_memory_allocated() - self._before) / 2**30
                    self._before = None

        return Timer()


def monitor_callback(probe=None):
    """A `keras_fp8.callbacks.FP8Monitor` at its default `every_n_steps`
    (imported here: optional)."""
    from keras_fp8.callbacks import FP8Monitor

    return FP8Monitor(probe=probe)


def _alloc_retries():
    """The CUDA caching allocator's retry count so far (torch on a GPU)."""
    import torch

    return torch.cuda.memory_stats().get("num_alloc_retries", 0)


class KerasVariant:
    """One Keras variant: a model (shared with its +shortcut / +monitor
    twin) and how its fit calls run."""

    def __init__(self, name, model, shortcut_cls, torch_memory, torch_cuda=False, monitor=None):
        self.name, self.model, self.shortcut_cls = name, model, shortcut_cls
        self.torch_memory, self.torch_cuda = torch_memory, torch_cuda
        self.monitor = monitor
        self.mem_gib = None
        # Each FP8Monitor.measure call's wall time. It starts after the timer's
        # callback has read the step's loss (the device is idle) and ends with
        # the table's transfer to the host, so no synchronization is added.
        self.measure_ms = []
        # The CUDA caching allocator's retries (a synchronizing free of its
        # cache and a new cudaMalloc, after one failed) in the timed fits;
        # counted under torch on a GPU only.
        self.alloc_retries = 0
        if monitor is not None:
            measure = monitor.measure

            def timed_measure(model):
                t0 = time.perf_counter()
                out = measure(model)
                self.measure_ms.append(1e3 * (time.perf_counter() - t0))
                return out

            monitor.measure = timed_measure

    def resident_gib(self):
        """GiB of the model's variables and optimizer state."""
        return timing.keras_resident_gib(self.model)

    def fit(self, x, y, steps, batch, measure_memory=False):
        import keras

        memory_step = 1 if (measure_memory and self.torch_memory) else None
        timer = _Timer.make(memory_step)
        callbacks = [timer]
        if self.monitor is not None:
            self.monitor.step = 0  # measures at this fit's first step
            callbacks.append(self.monitor)
        n = steps * batch
        if self.shortcut_cls is not None:
            self.shortcut_cls.enabled = self.name.endswith(SHORTCUT)
        retries = _alloc_retries() if self.torch_cuda else None
        try:
            # Keras's own fit (a keras_hub task's `fit` wants TensorFlow or
            # grain for NumPy inputs); dict inputs are sliced per entry.
            keras.Model.fit(self.model, timing.take(x, n), timing.take(y, n), batch_size=batch, epochs=1,
                            shuffle=False, verbose=0, callbacks=callbacks)
        finally:
            if self.shortcut_cls is not None:
                self.shortcut_cls.enabled = False
        if retries is not None:
            self.alloc_retries += _alloc_retries() - retries
        if timer.mem_gib is not None:
            self.mem_gib = timer.mem_gib
        return [1e3 * (b - a) for a, b in zip(timer.stamps, timer.stamps[1:])], timer.losses


# --------------------------------------------------------------------------- plain PyTorch
def torch_decoder(args):
    """The decoder of `keras_model` in plain PyTorch, float32 parameters
    (the caller seeds, places and converts it)."""
    import torch.nn as nn
    import torch.nn.functional as F

    # Grouped-query attention where `args.kv_heads` (a keras_hub Llama's
    # `num_key_value_heads`, benchmarks/zoo.py) is below `args.heads`.
    kv_heads = getattr(args, "kv_heads", None) or args.heads
    head_dim = args.hidden // args.heads
    kv = kv_heads * head_dim

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.n1, self.n2 = nn.RMSNorm(args.hidden), nn.RMSNorm(args.hidden)
            self.qkv = nn.Linear(args.hidden, args.hidden + 2 * kv, bias=False)
            self.out = nn.Linear(args.hidden, args.hidden, bias=False)
            self.gate = nn.Linear(args.hidden, args.mlp, bias=False)
            self.up = nn.Linear(args.hidden, args.mlp, bias=False)
            self.down = nn.Linear(args.mlp, args.hidden, bias=False)

        def forward(self, h):
            b, s, _ = h.shape
            if kv_heads == args.heads:
                q, k, v = self.qkv(self.n1(h)).view(b, s, 3, args.heads, -1).unbind(2)
                gqa = {}
            else:
                q, k, v = self.qkv(self.n1(h)).split([args.hidden, kv, kv], dim=-1)
                q = q.view(b, s, args.heads, head_dim)
                k, v = k.view(b, s, kv_heads, head_dim), v.view(b, s, kv_heads, head_dim)
                gqa = {"enable_gqa": True}
            a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=True, **gqa).transpose(1, 2).reshape(b, s, -1)
            h = h + self.out(a)
            m = self.n2(h)
            return h + self.down(F.silu(self.gate(m)) * self.up(m))

    class Decoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(args.vocab, args.hidden)
            self.blocks = nn.ModuleList(Block() for _ in range(args.blocks))
            self.norm = nn.RMSNorm(args.hidden)
            self.lm_head = nn.Linear(args.hidden, args.vocab, bias=False)

        def forward(self, t):
            h = self.embed(t)
            for block in self.blocks:
                h = block(h)
            return self.lm_head(self.norm(h))

    return Decoder()


def torch_peer(args, kind):
    """The decoder in plain PyTorch, its blocks compiled; `kind`:
    "torch-bf16" or "torchao" (float8 tensorwise on the projections)."""
    import torch

    torch.manual_seed(0)
    with torch.device("cuda"):  # initialized on the GPU: seconds, not minutes, for 1.2B parameters
        model = torch_decoder(args)
    if kind == "torchao":
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(model, module_filter_fn=lambda mod, fqn: fqn != "lm_head")
    for block in model.blocks:
        block.compile()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    return model, optimizer


class TorchPeerVariant:
    def __init__(self, name, args, x, y):
        import torch

        self.name, self.args = name, args
        self.model, self.optimizer = torch_peer(args, name)
        self.x = torch.tensor(x, dtype=torch.long, device="cuda")
        self.y = torch.tensor(y, dtype=torch.long, device="cuda")
        self.mem_gib = None

    def resident_gib(self):
        """GiB of the parameters and the optimizer state."""
        return timing.torch_resident_gib(self.model, self.optimizer)

    def fit(self, x, y, steps, batch, measure_memory=False):
        import torch
        import torch.nn.functional as F

        stamps, losses = [], []
        for i in range(steps):
            if measure_memory and i == 1:
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            xb, yb = self.x[i * batch:(i + 1) * batch], self.y[i * batch:(i + 1) * batch]
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = self.model(xb)
            loss = F.cross_entropy(logits.float().view(-1, self.args.vocab), yb.reshape(-1))
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            stamps.append(time.perf_counter())
            if measure_memory and i == 1:
                self.mem_gib = (torch.cuda.max_memory_allocated() - before) / 2**30
        return [1e3 * (b - a) for a, b in zip(stamps, stamps[1:])], losses


# --------------------------------------------------------------------------- worker
def _jax_memory():
    import jax

    stats = jax.devices()[0].memory_stats()
    if not stats or "peak_bytes_in_use" not in stats:
        return None
    return (stats["peak_bytes_in_use"] - stats["bytes_in_use"]) / 2**30


def worker(args):
    import keras

    import keras_fp8  # noqa: F401 (registers the FP8 policies)

    backend = keras.backend.backend()
    if backend == "torch":
        import torch

        cuda = torch.cuda.is_available() and not args.dry_run
        if cuda:  # another process holding device memory would show here
            free, total = torch.cuda.mem_get_info()
            print(f"device memory free at start: {free / 2**30:.1f} of {total / 2**30:.1f} GiB", flush=True)
    else:
        import jax

        from keras_fp8.backends import jax_gemm

        jax_gemm.set_enabled(not args.jax_xla_fp8)

        cuda = jax.devices()[0].platform == "gpu" and not args.dry_run
    env = timing.environment()
    env.update(backend=backend, size=args.size)
    timing.emit({"env": env})
    row = f"keras-{backend}"
    tokens = args.batch * args.seq
    x, y = data(args)
    variants, problems = {}, {}
    models = {}
    shortcut_cls = shortcut_dense_class() if backend == "torch" else None
    for name in keras_variants(args, backend):
        policy = name.split("+")[0]
        key = name if name.endswith(BLOCKS) else policy  # a compiled model of its own
        try:
            if key not in models:
                models[key] = keras_model(args, policy, shortcut_cls or keras.layers.Dense)
                if key.endswith(BLOCKS):
                    keras_fp8.compile_blocks(models[key])
            monitor = None
            if name.endswith(MONITOR):
                try:
                    monitor = monitor_callback(probe=(x[:args.batch], y[:args.batch]))
                except ImportError:
                    problems[name] = "keras_fp8.callbacks.FP8Monitor not available"
                    continue
            # The monitor's variant shares fp8_hybrid's model: its step memory is that one's (and the
            # probe tensors the monitor holds between steps would blur it).
            variants[name] = KerasVariant(name, models[key], shortcut_cls, torch_memory=cuda and args.memory
                                          and backend == "torch" and not name.endswith(MONITOR),
                                          torch_cuda=cuda and backend == "torch", monitor=monitor)
        except Exception as e:  # noqa: BLE001
            problems[name] = timing.failure(e)
    peer_names = []
    if backend == "torch" and args.peers == "auto":
        peer_names = PEERS
        for name in PEERS:
            if not cuda:
                problems[name] = "GPU only"
                continue
            try:
                if name == "torchao":
                    import torchao  # noqa: F401
                variants[name] = TorchPeerVariant(name, args, x, y)
            except ImportError as e:
                problems[name] = f"not importable: {type(e).__name__}"
            except Exception as e:  # noqa: BLE001
                problems[name] = timing.failure(e)
    # Warm-up: one fit per variant (compilation), in an order rotated by the
    # process index; under JAX the first one's memory is clean.
    order = list(variants)
    shift = (args.worker or 0) % max(1, len(order))
    order = order[shift:] + order[:shift]
    jax_mem = {}
    for i, name in enumerate(order):
        t0 = time.perf_counter()
        try:
            variants[name].fit(x, y, args.warmup, args.batch)
        except Exception as e:  # noqa: BLE001
            problems[name] = timing.failure(e)
            del variants[name]
            continue
        print(f"warm-up {name}: {time.perf_counter() - t0:.1f} s", flush=True)
        if backend == "jax" and i == 0 and args.memory:
            jax_mem[name] = _jax_memory()
    for variant in variants.values():
        if isinstance(variant, KerasVariant):
            variant.measure_ms.clear()  # the warm-up's measurement compiles
            variant.alloc_retries = 0
    samples, losses = timing.interleaved_rounds(
        list(variants), args.rounds, args.worker or 0,
        lambda name, r: variants[name].fit(x, y, args.steps, args.batch, measure_memory=(r == 0 and args.memory)),
        problems)
    for name in keras_variants(args, backend) + peer_names:
        stack = "torch" if name in PEERS else row
        if name in problems:
            timing.emit(timing.variant_record(name, problems[name], row=stack))
            continue
        med = statistics.median(samples[name])
        mem = variants[name].mem_gib if backend == "torch" else jax_mem.get(name)
        resident = variants[name].resident_gib()
        monitor = getattr(variants[name], "monitor", None)
        extra = {}
        if getattr(variants[name], "torch_cuda", False):
            extra["alloc_retries"] = variants[name].alloc_retries
        if monitor is not None:
            timed = variants[name].measure_ms
            extra.update(every_n_steps=monitor.every_n_steps, measurements=len(timed),
                         measure_ms=statistics.median(timed) if timed else None,
                         measure_ms_max=max(timed) if timed else None)
        timing.emit(timing.variant_record(name, med, row=stack, tok_per_s=tokens / med * 1e3, steps=len(samples[name]),
                                          ms_mean=statistics.fmean(samples[name]), timed_per_fit=args.steps - 1,
                                          mem_gib=mem, resident_gib=resident,
                                          peak_gib=None if mem is None else resident + mem,
                                          loss_first=losses[name][0], loss_last=losses[name][-1],
                                          **extra))


# --------------------------------------------------------------------------- tables
HEADER = "| stack | variant | ms per step | tok/s | speed-up over the stack's mixed_bfloat16 | step memory, GiB |"
RATIO_HEADER = "| ratio | value |"
MEMORY_HEADER = ("| stack | variant | resident: weights and optimizer state, GiB | step memory above it, GiB "
                 "| peak step memory, GiB |")
LABELS = {
    "mixed_bfloat16": "mixed_bfloat16 (Dense)",
    "mixed_bfloat16" + SHORTCUT: "mixed_bfloat16, Dense with the host-path shortcut",
    "mixed_bfloat16" + BLOCKS: "mixed_bfloat16 (Dense), compile_blocks",
    "fp8_hybrid" + BLOCKS: "fp8_hybrid, compile_blocks",
    "torch-bf16": "bf16 autocast, compiled blocks",
    "torchao": "torchao float8 tensorwise, compiled blocks",
}
STACKS = {"keras-torch": "Keras, torch backend", "keras-jax": "Keras, JAX backend", "torch": "plain PyTorch"}


def _sep(h):
    return "|" + "---|" * (h.count("|") - 1)


def _variants_of(res, row):
    seen = []
    for d in res.index:
        for (r, v) in d:
            if r == row and v not in seen:
                seen.append(v)
    return seen


def _monitor_rows(res, row, name, fp8):
    """FP8Monitor's cost: the steps it does not measure (medians), one
    measurement (from the means: one per fit), that measurement spread
    over the monitor's `every_n_steps`, and the measurements timed
    directly (each process's median and slowest)."""
    rows = [f"| {name}: FP8Monitor, a step it does not measure (step time with it over without, medians) "
            f"| {res.ratio(row, fp8, fp8 + MONITOR)} |"]
    extra, overhead, every = [], [], None
    for d in res.index:
        plain, watched = d.get((row, fp8), {}), d.get((row, fp8 + MONITOR), {})
        if "ms_mean" in plain and "ms_mean" in watched:
            # A fit's timed steps hold one measurement: their extra time is its cost.
            one = (watched["ms_mean"] - plain["ms_mean"]) * watched["timed_per_fit"]
            every = watched["every_n_steps"]
            extra.append(one)
            overhead.append(100 * one / (every * plain["ms_mean"]))
    rows.append(f"| {name}: FP8Monitor, one measurement with a probe batch (extra ms of a fit's timed steps) | "
                f"{timing.cell(extra, '{:.1f}')} |")
    spread = f"every_n_steps={every} (one measurement over {every} steps)" if every else "its every_n_steps"
    rows.append(f"| {name}: FP8Monitor at {spread}, % of the step time | {timing.cell(overhead, '{:.1f}', '%')} |")
    rows.append(f"| {name}: FP8Monitor, one measurement timed directly (FP8Monitor.measure, median ms) | "
                f"{timing.cell(res.values(row, fp8 + MONITOR, 'measure_ms'), '{:.1f}')} |")
    rows.append(f"| {name}: FP8Monitor, the slowest timed measurement (ms) | "
                f"{timing.cell(res.values(row, fp8 + MONITOR, 'measure_ms_max'), '{:.1f}')} |")
    return rows


def tables(per_process, args=None):
    res = timing.Results(per_process, row_key="row")
    out = [f"# {timing.env_line(res.env())}; processes per backend: {len(per_process)}", "", HEADER, _sep(HEADER)]
    for row in res.rows():
        for v in _variants_of(res, row):
            base = "torch-bf16" if row == "torch" else "mixed_bfloat16"
            label = LABELS.get(v, v.replace(MONITOR, " + FP8Monitor"))
            if timing.summary(res.values(row, v)) is None:
                out.append(f"| {STACKS.get(row, row)} | {label} | {res.problem(row, v)} | - | - | - |")
                continue
            ratio = res.ratio(row, v, base) if v != base else "1.00x"
            out.append(f"| {STACKS.get(row, row)} | {label} | {res.ms(row, v, fmt='{:.2f}')} "
                       f"| {res.ms(row, v, field='tok_per_s', fmt='{:.0f}')} | {ratio} "
                       f"| {res.ms(row, v, field='mem_gib', fmt='{:.2f}')} |")
    out += ["", "Peak step memory of each variant's own model (its variables and optimizer state, which stay "
            "allocated, plus what one step allocates above them; torch: max_memory_allocated, JAX: the device's "
            "peak_bytes_in_use, measured for the variant a process warms up first):", "", MEMORY_HEADER,
            _sep(MEMORY_HEADER)]
    for row in res.rows():
        for v in _variants_of(res, row):
            if timing.summary(res.values(row, v)) is None:
                continue
            label = LABELS.get(v, v.replace(MONITOR, " + FP8Monitor"))
            out.append(f"| {STACKS.get(row, row)} | {label} | {res.ms(row, v, field='resident_gib', fmt='{:.2f}')} "
                       f"| {res.ms(row, v, field='mem_gib', fmt='{:.2f}')} "
                       f"| {res.ms(row, v, field='peak_gib', fmt='{:.2f}')} |")
    out += ["", "Ratios (speed-ups; within each process, summarized over processes):", "", RATIO_HEADER,
            _sep(RATIO_HEADER)]
    fp8 = None
    for row in res.rows():
        for v in _variants_of(res, row):
            if row != "torch" and v not in ("mixed_bfloat16", "mixed_bfloat16" + SHORTCUT) and MONITOR not in v:
                fp8 = fp8 or v
    for row in ("keras-torch", "keras-jax"):
        if row not in res.rows() or fp8 is None:
            continue
        name = STACKS[row]
        out.append(f"| {name}: {fp8} over mixed_bfloat16 | {res.ratio(row, fp8, 'mixed_bfloat16')} |")
        if "mixed_bfloat16" + SHORTCUT in _variants_of(res, row):
            out.append(f"| {name}: {fp8} over mixed_bfloat16 with the shortcut (FP8's share) "
                       f"| {res.ratio(row, fp8, 'mixed_bfloat16' + SHORTCUT)} |")
            out.append(f"| {name}: the shortcut alone (bf16 with it over bf16 without) "
                       f"| {res.ratio(row, 'mixed_bfloat16' + SHORTCUT, 'mixed_bfloat16')} |")
        if fp8 + MONITOR in _variants_of(res, row):
            out += _monitor_rows(res, row, name, fp8)
    if "torch" in res.rows():
        out.append(f"| plain PyTorch: torchao over bf16 | {res.ratio('torch', 'torchao', 'torch-bf16')} |")
        if "keras-jax" in res.rows() and fp8:
            # Different processes (the JAX and torch workers): medians of the two.
            a = timing.summary(res.values("torch", "torchao"))
            b = timing.summary(res.values("keras-jax", fp8))
            text = (f"{a[0] / b[0]:.2f}x (medians of separate processes)" if a and b
                    else res.problem("torch", "torchao") or res.problem("keras-jax", fp8) or "-")
            out.append(f"| Keras JAX {fp8} over plain PyTorch + torchao | {text} |")
    return "\n".join(out)


def main(argv=None):
    return timing.main(__file__, argv, parse_args, worker, tables, backends=True)


if __name__ == "__main__":
    main()
