"""keras_hub models under the FP8 policy: the whole-model training step.

    python benchmarks/zoo.py --models llama --processes 3
    python benchmarks/zoo.py --models llama,gemma,gpt2,bert --sizes large,small
    python benchmarks/zoo.py --models llama --max-batch          # also the largest batch per variant
    python benchmarks/zoo.py --dry-run                           # CPU, tiny models: the table code

Models, built from keras_hub configs with random weights (no downloads, no
tokenizer, no preprocessor), trained with AdamW by `keras.Model.fit` on
random tokens:

- `llama`: `LlamaCausalLM` (grouped-query attention, SwiGLU, RMS norms, an
  untied vocabulary projection); large: 4 layers, hidden 4096, FFN 14336,
  32 query / 8 key-value heads, vocabulary 32000, sequence 2048, batch 4;
- `gemma`: `GemmaCausalLM` (GeGLU, tied embeddings, head size 256); large:
  4 layers, hidden 2048, FFN 16384, 8 query / 1 key-value heads, vocabulary
  32000 (Gemma's own is 256000), sequence 2048, batch 4;
- `gpt2`: `GPT2CausalLM` (LayerNorm, GELU, learned positions, tied head);
  large: 4 layers, hidden 2048, FFN 8192, 16 heads, vocabulary 50304,
  sequence 1024, batch 8;
- `bert`: `BertMaskedLM` (an encoder; its masked-LM head projects 15% of
  the positions back to the vocabulary through the tied embedding); large:
  4 layers, hidden 2048, FFN 8192, 16 heads, vocabulary 30528, sequence
  1024, batch 8.

Each also has a `small` size (hidden 512-1024, sequence 512) and a `tiny`
one (`--dry-run`). Any size field can be overridden (`--hidden`, ...).

Variants, interleaved within each process (each round one `fit` of
`--steps` steps per variant, in a shuffled order; a sample is one step, the
first step of each fit left out), per model and backend:

- `mixed_bfloat16`; `fp8_hybrid` (the global policy alone);
- `keras_float8`: built under `mixed_bfloat16`, then Keras's own
  `model.quantize("float8")`;
- torch: `mixed_bfloat16+compiled` and `fp8_hybrid+compiled`, the same
  models and optimizer state trained by a `jit_compile=True` train
  function; on request (`--variants`) `mixed_bfloat16+blocks` and
  `fp8_hybrid+blocks`, models whose transformer blocks
  `keras_fp8.compile_blocks` compiled, with an optimizer
  `keras_fp8.compile_optimizer` compiled. Each fit of a compiled variant runs
  under `--compile-budget` seconds: one that does not finish is recorded as
  a timeout and the run goes on. The warm-up fit's seconds (compilation)
  are reported apart, and the compilations after it as recompiles;
- on request, `fp8_hybrid+moments` (and `fp8_hybrid+blocks+moments`):
  AdamW with its moments in FP8 (`keras_fp8.optimizers.FP8AdamW`), and
  `fp8_hybrid+requant` (and `fp8_hybrid+blocks+requant`): the backward
  quantizes each kernel again instead of keeping its FP8 copy
  (`requantize_weight_in_backward`);
- torch on a GPU, where `benchmarks/model.py` has the architecture in
  plain PyTorch (the Llama-style decoder, with grouped-query attention):
  `torch-bf16` (bf16 autocast, fused AdamW, compiled blocks) and `torchao`
  (float8 tensorwise on every projection but the output layer). Five
  models of the large Llama do not fit one 80 GB GPU together, so by
  default the peers are timed in a second phase of the same process, after
  the Keras models are freed (`--one-phase`: all interleaved, where memory
  allows).

`--isolate` runs one process per variant instead (`--processes` rounds of
them, the ratios taken within a round): for models too large to share a
device, and for compiled variants, whose compilations must not share a
process.

Reported per variant: ms per step, tokens per second, the step's memory
above the resident (as in model.py), the resident weights and optimizer
state, their sum (the peak step memory of that model alone), and the
warm-up seconds. Per model:

- where the step goes (torch on a GPU, first process): one profiled fit per
  eager Keras policy, its CUDA kernels' time per step by category (FP8
  GEMMs, other GEMMs, attention, quantize, loss, optimizer, norms and
  element-wise) and the host gaps (the step's wall time minus its kernels').
  JAX: torch only;
- the FP8 roofline (on a GPU): the GEMMs of every layer that runs FP8
  (forward, input gradient and weight gradient, at the shapes the layers
  recorded) timed in this process, in FP8 (`torch._scaled_mm` on torch,
  the custom call on JAX) and as the `mixed_bfloat16` model runs them
  (bf16; float32 for Keras's vocabulary projection); the roofline is the
  `mixed_bfloat16` step with those GEMMs replaced by their FP8 times, and
  the table gives the fraction of it `fp8_hybrid` reaches (roofline /
  fp8_hybrid step time).

`--max-batch`: afterwards, per variant alone (the other models freed), the
largest batch that trains: doubling from `--batch`, then bisecting, an
out-of-memory error marking the limit (each new batch size compiles anew
under JAX).
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import random
import re
import statistics
import sys
import time
import types
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import model as decoder  # noqa: E402
from benchmarks import timing  # noqa: E402

MODELS = ("llama", "gemma", "gpt2", "bert")
FIELDS = ("layers", "hidden", "ffn", "heads", "kv_heads", "head_dim", "vocab", "seq", "batch")
SIZES = {
    "llama": {
        "large": dict(layers=4, hidden=4096, ffn=14336, heads=32, kv_heads=8, vocab=32000, seq=2048, batch=4),
        "small": dict(layers=4, hidden=1024, ffn=2816, heads=8, kv_heads=4, vocab=8000, seq=512, batch=8),
        "tiny": dict(layers=2, hidden=64, ffn=128, heads=4, kv_heads=2, vocab=256, seq=32, batch=2),
    },
    "gemma": {
        "large": dict(layers=4, hidden=2048, ffn=16384, heads=8, kv_heads=1, head_dim=256, vocab=32000, seq=2048,
                      batch=4),
        "small": dict(layers=4, hidden=768, ffn=3072, heads=4, kv_heads=1, head_dim=192, vocab=8000, seq=512,
                      batch=8),
        "tiny": dict(layers=1, hidden=64, ffn=128, heads=2, kv_heads=1, head_dim=32, vocab=256, seq=32, batch=2),
    },
    "gpt2": {
        "large": dict(layers=4, hidden=2048, ffn=8192, heads=16, vocab=50304, seq=1024, batch=8),
        "small": dict(layers=4, hidden=768, ffn=3072, heads=12, vocab=8000, seq=512, batch=8),
        "tiny": dict(layers=1, hidden=64, ffn=128, heads=2, vocab=256, seq=32, batch=2),
    },
    "bert": {
        "large": dict(layers=4, hidden=2048, ffn=8192, heads=16, vocab=30528, seq=1024, batch=8),
        "small": dict(layers=4, hidden=768, ffn=3072, heads=12, vocab=8000, seq=512, batch=8),
        "tiny": dict(layers=1, hidden=64, ffn=128, heads=2, vocab=256, seq=32, batch=2),
    },
}
MASKED_FRACTION = 0.15  # BERT's masked positions
COMPILED = "+compiled"  # Keras's jit_compile=True step
BLOCKS = "+blocks"  # keras_fp8.compile_blocks
MOMENTS = "+moments"  # keras_fp8.optimizers.FP8AdamW
REQUANT = "+requant"  # the policy's requantize_weight_in_backward=true
KERAS_FLOAT8 = "keras_float8"
PEERS = decoder.PEERS
PEER_MODELS = ("llama",)  # architectures benchmarks/model.py has in plain PyTorch
STACKS = decoder.STACKS
ALL_VARIANTS = ("mixed_bfloat16", "fp8_hybrid", KERAS_FLOAT8, "mixed_bfloat16" + COMPILED, "fp8_hybrid" + COMPILED,
                "mixed_bfloat16" + BLOCKS, "fp8_hybrid" + BLOCKS, "fp8_hybrid" + MOMENTS,
                "fp8_hybrid" + BLOCKS + MOMENTS, "fp8_hybrid" + REQUANT,
                "fp8_hybrid" + BLOCKS + REQUANT) + tuple(PEERS)


# --------------------------------------------------------------------------- arguments
def parse_args(argv=None):
    p = argparse.ArgumentParser(description="keras_hub models: model.fit step under mixed_bfloat16 and FP8.")
    p.add_argument("--backends", default="torch,jax", help="backends the parent runs workers for")
    p.add_argument("--models", default="llama", help=f"comma list of {', '.join(MODELS)}")
    p.add_argument("--sizes", default=None, help="comma list of large, small, tiny (default large; tiny with "
                                                 "--dry-run)")
    for key in FIELDS:
        p.add_argument(f"--{key.replace('_', '-')}", dest=key, type=int, default=None,
                       help=f"override every model's {key}")
    p.add_argument("--variants", default=None,
                   help="comma list of the variants to run (default: every one the backend has; see the "
                        "module docstring), e.g. mixed_bfloat16,fp8_hybrid,fp8_hybrid+blocks")
    p.add_argument("--isolate", action="store_true",
                   help="one worker process per variant (large models that do not fit together, "
                        "or compilations that must not share a process); --processes rounds of them")
    p.add_argument("--compiled", choices=["auto", "none"], default="auto",
                   help="auto: the torch workers add the jit_compile=True variants")
    p.add_argument("--compile-budget", type=float, default=120.0,
                   help="seconds one fit of a compiled variant may take (its warm-up compiles)")
    p.add_argument("--no-keras-float8", dest="keras_float8", action="store_false",
                   help="skip Keras's own quantize('float8') variant")
    p.add_argument("--peers", choices=["auto", "none"], default="auto",
                   help="auto: the plain-PyTorch peers in the torch workers on a GPU, where model.py has the "
                        "architecture")
    p.add_argument("--one-phase", action="store_true",
                   help="interleave the peers with the Keras variants (needs the memory of all five models)")
    p.add_argument("--profile", choices=["first", "all", "none"], default="first",
                   help="where the step goes (torch on a GPU): in the first process, every process, or none")
    p.add_argument("--no-roofline", dest="roofline", action="store_false")
    p.add_argument("--max-batch", action="store_true", help="also search the largest batch per variant")
    p.add_argument("--max-batch-limit", type=int, default=256, help="the largest batch tried")
    p.add_argument("--warmup", type=int, default=2, help="steps of the untimed first fit per variant")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=4, help="steps per fit call (the first is not timed)")
    p.add_argument("--no-memory", dest="memory", action="store_false")
    p.add_argument("--dry-run", action="store_true", help="CPU, the tiny sizes, one round")
    timing.add_process_arguments(p)
    args = p.parse_args(argv)
    args.model_list = [m for m in args.models.split(",") if m]
    timing.check_choices(p, "--models", args.model_list, MODELS)
    args.size_list = (args.sizes or ("tiny" if args.dry_run else "large")).split(",")
    timing.check_choices(p, "--sizes", args.size_list, ("large", "small", "tiny"))
    if args.dry_run:
        args.warmup, args.rounds, args.steps = 1, 1, 3
    if args.steps < 2:
        p.error("--steps: at least 2 (the first step of each fit is not timed)")
    if args.variants is not None:
        args.variant_list = [v for v in args.variants.split(",") if v]
        timing.check_choices(p, "--variants", args.variant_list, ALL_VARIANTS)
    else:
        args.variant_list = None
    if args.compile_budget <= 0:
        p.error(f"--compile-budget: expected a positive number of seconds, got {args.compile_budget}")
    return args


def config(args, name, size):
    """The size's fields for model `name`, with the command line's
    overrides (a SimpleNamespace; `kv_heads`/`head_dim` None where the
    model has none)."""
    fields = dict.fromkeys(FIELDS)
    fields.update(SIZES[name][size])
    for key in FIELDS:
        if getattr(args, key) is not None:
            fields[key] = getattr(args, key)
    if fields["hidden"] % fields["heads"]:
        raise ValueError(f"{name}: hidden {fields['hidden']} must be a multiple of heads {fields['heads']}")
    return types.SimpleNamespace(name=name, size=size, **fields)


def keras_variants(args, backend):
    """The Keras variants this backend runs (`--variants` filters them;
    the compiled and block-compiled ones are torch's)."""
    out = ["mixed_bfloat16", "fp8_hybrid"]
    if args.keras_float8:
        out.append(KERAS_FLOAT8)
    if backend == "torch" and args.compiled == "auto":
        out += ["mixed_bfloat16" + COMPILED, "fp8_hybrid" + COMPILED]
    if args.variant_list is not None:
        extra = [v for v in args.variant_list if v not in out and v not in PEERS
                 and (backend == "torch" or parse_variant(v)[1] == "eager")]
        out = [v for v in out if v in args.variant_list] + extra
    return out


def peer_variants(args, backend, cfg):
    """The plain-PyTorch peers this model runs (torch on the architectures
    model.py has)."""
    if backend != "torch" or args.peers != "auto" or cfg.name not in PEER_MODELS:
        return []
    return [p for p in PEERS if args.variant_list is None or p in args.variant_list]


def parse_variant(name):
    """`(policy, step, moments)` of a Keras variant name: its dtype policy,
    how the step runs ("eager", "compiled": jit_compile=True, "blocks":
    keras_fp8.compile_blocks) and whether the optimizer keeps FP8 moments.
    `+requant` is in the policy (`requantize_weight_in_backward=true`)."""
    parts = name.split("+")
    policy = "mixed_bfloat16" if parts[0] == KERAS_FLOAT8 else parts[0]
    if REQUANT[1:] in parts:
        policy += "[requantize_weight_in_backward=true]"
    step = "compiled" if COMPILED[1:] in parts else "blocks" if BLOCKS[1:] in parts else "eager"
    return policy, step, MOMENTS[1:] in parts


def row_name(cfg, stack):
    return f"{cfg.name}/{cfg.size}/{stack}"


# --------------------------------------------------------------------------- models and data
def build_task(cfg):
    """The keras_hub task of `cfg` under the global policy in effect."""
    import keras_hub

    m = keras_hub.models
    if cfg.name == "llama":
        backbone = m.LlamaBackbone(vocabulary_size=cfg.vocab, num_layers=cfg.layers, num_query_heads=cfg.heads,
                                   num_key_value_heads=cfg.kv_heads, hidden_dim=cfg.hidden,
                                   intermediate_dim=cfg.ffn, dropout=0.0, tie_word_embeddings=False)
        return m.LlamaCausalLM(backbone=backbone, preprocessor=None)
    if cfg.name == "gemma":
        # keras_hub's Gemma splits `intermediate_dim` between its gate and
        # up projections: twice the FFN width.
        backbone = m.GemmaBackbone(vocabulary_size=cfg.vocab, num_layers=cfg.layers, num_query_heads=cfg.heads,
                                   num_key_value_heads=cfg.kv_heads, hidden_dim=cfg.hidden,
                                   intermediate_dim=2 * cfg.ffn, head_dim=cfg.head_dim, dropout=0.0)
        return m.GemmaCausalLM(backbone=backbone, preprocessor=None)
    if cfg.name == "gpt2":
        backbone = m.GPT2Backbone(vocabulary_size=cfg.vocab, num_layers=cfg.layers, num_heads=cfg.heads,
                                  hidden_dim=cfg.hidden, intermediate_dim=cfg.ffn, dropout=0.0,
                                  max_sequence_length=cfg.seq)
        return m.GPT2CausalLM(backbone=backbone, preprocessor=None)
    backbone = m.BertBackbone(vocabulary_size=cfg.vocab, num_layers=cfg.layers, num_heads=cfg.heads,
                              hidden_dim=cfg.hidden, intermediate_dim=cfg.ffn, dropout=0.0,
                              max_sequence_length=cfg.seq)
    return m.BertMaskedLM(backbone=backbone, preprocessor=None)


def keras_task(cfg, variant):
    """The variant's task, compiled with AdamW (eager on torch; a
    `+compiled` variant shares the task of its name without `+compiled`)."""
    import keras

    import keras_fp8

    policy, step, moments = parse_variant(variant)
    keras.mixed_precision.set_global_policy(policy)
    try:
        keras.utils.set_random_seed(0)
        task = build_task(cfg)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    if variant.startswith(KERAS_FLOAT8):
        with warnings.catch_warnings():
            # One warning per layer Keras's float8 does not quantize (norms,
            # embeddings, ...): it quantizes the Dense/EinsumDense layers.
            warnings.simplefilter("ignore", UserWarning)
            task.quantize("float8")
    if step == "blocks":
        keras_fp8.compile_blocks(task)
    optimizer = keras_fp8.optimizers.FP8AdamW(1e-4) if moments else keras.optimizers.AdamW(1e-4)
    if step == "blocks":  # the optimizer's update compiled too: the step's element-wise chains fused
        keras_fp8.compile_optimizer(optimizer)
    # Keras's own compile: a keras_hub task's adds sampling and metrics.
    keras.Model.compile(task, optimizer=optimizer,
                        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return task


def data(cfg, rows):
    """Random tokens: `(x, y)` for `rows` sequences (dicts of arrays)."""
    import numpy as np

    rng = np.random.default_rng(0)
    tokens = rng.integers(1, cfg.vocab, (rows, cfg.seq + 1)).astype("int32")
    ones = np.ones((rows, cfg.seq), "int32")
    if cfg.name != "bert":
        return {"token_ids": tokens[:, :-1], "padding_mask": ones}, tokens[:, 1:]
    masked = max(1, int(MASKED_FRACTION * cfg.seq))
    positions = np.sort(np.argsort(rng.random((rows, cfg.seq)), axis=1)[:, :masked], axis=1).astype("int32")
    ids = tokens[:, :-1]
    x = {"token_ids": ids, "segment_ids": np.zeros_like(ones), "padding_mask": ones, "mask_positions": positions}
    return x, np.take_along_axis(ids, positions, axis=1)


def tokens_per_step(cfg):
    return cfg.batch * cfg.seq


class ZooVariant(decoder.KerasVariant):
    """A Keras variant of model.py's bookkeeping whose fits run a train
    function of its own (eager and compiled variants share a task)."""

    def __init__(self, name, task, train_function, **kwargs):
        super().__init__(name, task, None, **kwargs)
        self.train_function = train_function
        self.warmup_s = None
        self.recompiles = 0

    def fit(self, x, y, steps, batch, measure_memory=False):
        if self.train_function is not None:  # torch: the eager or the compiled one
            self.model.train_function = self.train_function
        return super().fit(x, y, steps, batch, measure_memory)


def train_functions(task, compiled):
    """`{False: eager, True: jit_compile=True}` train functions of a torch
    task (the compiled one compiles at its first call)."""
    out = {}
    for jit in (False, True) if compiled else (False,):
        task.jit_compile = jit
        task.train_function = None
        task.make_train_function(force=True)  # (torch's returns nothing when it makes one)
        out[jit] = task.train_function
    task.jit_compile = False
    return out


def peer_args(cfg):
    """model.py's decoder arguments for the Llama-style config."""
    return types.SimpleNamespace(hidden=cfg.hidden, mlp=cfg.ffn, heads=cfg.heads, kv_heads=cfg.kv_heads,
                                 blocks=cfg.layers, seq=cfg.seq, batch=cfg.batch, vocab=cfg.vocab)


# --------------------------------------------------------------------------- where the step goes
CATEGORIES = (
    # First match wins: the quantize kernels name FP8 types too.
    ("quantize", r"quantiz|amax|fold|scale_update|cast_fp8|to_fp8|_to_copy.*float8"),
    ("FP8 GEMMs", r"(gemm|xmma|cutlass|nvjet|scaled_mm|matmul).*(e4m3|e5m2|f8|fp8|float8|_qq)|"
                  r"(e4m3|e5m2|f8f8|fp8|float8).*(gemm|xmma|cutlass|mma)"),
    ("attention", r"flash|fmha|attention|attn|mha_|sdpa"),
    ("loss", r"log_softmax|softmax|nll_loss|cross_entropy|logsumexp"),
    ("optimizer", r"foreach|multi_tensor|adam|fused_adam"),
    ("other GEMMs", r"gemm|gemv|xmma|cutlass|nvjet|cublas|sm90_|sm80_|ampere_|hopper_|matmul"),
    ("norms and element-wise", r""),
)
CATEGORY_NAMES = tuple(c for c, _ in CATEGORIES) + ("host gaps",)


def categorize(kernel_name):
    for category, pattern in CATEGORIES:
        if re.search(pattern, kernel_name, re.IGNORECASE):
            return category
    return CATEGORIES[-1][0]


def kernel_times_ms(prof):
    """`{kernel name: total ms}` of a torch profile's CUDA kernels."""
    import torch

    out = {}
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            out[evt.name] = out.get(evt.name, 0.0) + evt.time_range.elapsed_us() / 1e3
    return out


def profile_step(variant, x, y, steps, batch):
    """Profiles one fit of `steps` steps (torch on a GPU). Returns the ms
    per step by category, host gaps included, and the top kernels."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile

    variant.fit(x, y, 2, batch)  # settled allocator and caches
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        ms, _ = variant.fit(x, y, steps, batch)
    kernels = kernel_times_ms(prof)
    per_step = {c: 0.0 for c in CATEGORY_NAMES}
    for name, t in kernels.items():
        per_step[categorize(name)] += t / steps
    # The fit's timed steps (the first left out) against its kernels per
    # step: the difference is time the GPU waited for the host.
    wall = statistics.median(ms)
    busy = sum(per_step.values())
    per_step["host gaps"] = max(0.0, wall - busy)
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:12]
    return {"wall_ms": wall, "categories": per_step,
            "top": [[name[:120], categorize(name), t / steps] for name, t in top]}


# --------------------------------------------------------------------------- FP8 roofline
def fp8_gemm_shapes(task):
    """`[(M, K, N, plain_float32, count)]`: the GEMMs of the task's FP8
    layers' last calls (plain_float32: the layer is Keras's vocabulary
    projection, which computes in float32 under mixed_bfloat16)."""
    import keras

    from keras_fp8 import inspection

    counts = {}
    for layer in inspection.fp8_layers(task):
        runs, dims, _ = layer.fp8_execution()
        if runs != "FP8" or dims is None or None in dims:
            continue
        key = tuple(int(d) for d in dims) + (isinstance(layer, keras.layers.ReversibleEmbedding),)
        counts[key] = counts.get(key, 0) + 1
    return [key + (n,) for key, n in sorted(counts.items())]


def _torch_gemms(m, k, n, plain_float32):
    """`{"fp8": fn, "plain": fn}` running the forward, input-gradient and
    weight-gradient GEMMs of an (M, K, N) layer once each."""
    import torch

    dev = "cuda"
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    one = torch.ones((), device=dev)
    x = torch.randn(m, k, device=dev).to(e4)
    w_t = torch.randn(n, k, device=dev).to(e4)  # (N, K): column-major (K, N)
    g = torch.randn(m, n, device=dev).to(e5)
    w = torch.randn(k, n, device=dev).to(e4)
    x_t = torch.randn(k, m, device=dev).to(e4)
    g_cm = torch.randn(n, m, device=dev).to(e5)

    def fp8():
        torch._scaled_mm(x, w_t.t(), one, one, out_dtype=torch.bfloat16)  # y = x w
        torch._scaled_mm(g, w.t(), one, one, out_dtype=torch.bfloat16)  # dx = g w^T
        torch._scaled_mm(x_t, g_cm.t(), one, one, out_dtype=torch.float32)  # dw = x^T g

    dtype = torch.float32 if plain_float32 else torch.bfloat16
    a, b = torch.randn(m, k, device=dev, dtype=dtype), torch.randn(k, n, device=dev, dtype=dtype)
    gp = torch.randn(m, n, device=dev, dtype=dtype)

    def plain():
        a @ b
        gp @ b.t()
        a.t() @ gp

    return {"fp8": fp8, "plain": plain}


def _jax_gemms(m, k, n, plain_float32):
    import jax
    import jax.numpy as jnp

    from keras_fp8.backends import jax_gemm

    key = jax.random.PRNGKey(0)
    e4, e5 = jnp.float8_e4m3fn, jnp.float8_e5m2
    x = jax.random.normal(key, (m, k)).astype(e4)
    w_t = jax.random.normal(key, (n, k)).astype(e4)
    w = jax.random.normal(key, (k, n)).astype(e4)
    g = jax.random.normal(key, (m, n)).astype(e5)
    g_t = jax.random.normal(key, (n, m)).astype(e5)
    x_t = jax.random.normal(key, (k, m)).astype(e4)
    one = jnp.ones((), jnp.float32)
    if jax_gemm.available():
        def nt(a, b_t, out):
            return jax_gemm.scaled_matmul_nt(a, b_t, one, out)
    else:  # XLA's FP8 dot
        def nt(a, b_t, out):
            return jax.lax.dot_general(a, b_t, (((1,), (1,)), ((), ())), preferred_element_type=out)

    fp8 = jax.jit(lambda: (nt(x, w_t, jnp.bfloat16), nt(g, w, jnp.bfloat16), nt(x_t, g_t, jnp.float32)))
    dtype = jnp.float32 if plain_float32 else jnp.bfloat16
    a, b = jax.random.normal(key, (m, k), dtype), jax.random.normal(key, (k, n), dtype)
    gp = jax.random.normal(key, (m, n), dtype)
    plain = jax.jit(lambda a, b, gp: (a @ b, gp @ b.T, a.T @ gp))
    return {"fp8": fp8, "plain": lambda: plain(a, b, gp)}


def measure_gemms(shapes, backend):
    """`{"fp8": ms, "plain": ms}` per step: every shape's three GEMMs times
    its count, timed in this process."""
    if backend == "torch":
        timer = timing.cuda_timer
        make = _torch_gemms
    else:
        import jax

        timer = timing.wall_timer(jax.block_until_ready)
        make = _jax_gemms
    total = {"fp8": 0.0, "plain": 0.0}
    for m, k, n, plain_float32, count in shapes:
        fns = make(m, k, n, plain_float32)
        med = timing.interleaved_medians(fns, rounds=3, iters=5, warmup=2, timer=timer)
        for key, value in med.items():
            if isinstance(value, BaseException):
                raise value
            total[key] += count * value
    return total


# --------------------------------------------------------------------------- largest batch
def fits_batch(variant, cfg, batch):
    """Whether two steps of `variant` train at `batch` (False on OOM)."""
    x, y = data(cfg, 2 * batch)
    try:
        variant.fit(x, y, 2, batch)
        return True
    except Exception as e:  # noqa: BLE001
        timing.failure(e)
        if not timing.is_out_of_memory(e):
            raise
        return False
    finally:
        release()


def largest_batch(variant, cfg, limit):
    """Doubling from `cfg.batch`, then bisecting: the largest batch that
    trains (None: not even `cfg.batch`; `limit` caps the search)."""
    good, bad, b = None, None, cfg.batch
    while b <= limit:
        if fits_batch(variant, cfg, b):
            good, b = b, 2 * b
        else:
            bad = b
            break
    if good is None or bad is None:
        return good, good is not None and bad is None
    while bad - good > 1:
        mid = (good + bad) // 2
        if fits_batch(variant, cfg, mid):
            good = mid
        else:
            bad = mid
    return good, False


def release():
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:
        pass


# --------------------------------------------------------------------------- worker
def build_variants(cfg, names, backend, cuda, args, problems):
    """The variants `names` of `cfg` (Keras ones and peers)."""
    variants = {}
    tasks = {}
    x, y = data(cfg, cfg.batch * max(args.warmup, args.steps))
    for name in names:
        try:
            if name in PEERS:
                if not cuda:
                    problems[name] = "GPU only"
                    continue
                if name == "torchao":
                    import torchao  # noqa: F401
                variants[name] = decoder.TorchPeerVariant(name, peer_args(cfg), x["token_ids"], y)
                continue
            base, compiled = name.removesuffix(COMPILED), name.endswith(COMPILED)
            if base not in tasks:
                task = keras_task(cfg, base)
                tasks[base] = (task, train_functions(task, backend == "torch" and base + COMPILED in names))
            task, fns = tasks[base]
            variants[name] = ZooVariant(name, task, fns.get(compiled) if backend == "torch" else None,
                                        torch_memory=cuda and args.memory and backend == "torch",
                                        torch_cuda=cuda and backend == "torch")
        except ImportError as e:
            problems[name] = f"not importable: {type(e).__name__}"
        except Exception as e:  # noqa: BLE001
            problems[name] = timing.failure(e)
    return variants


def is_compiled(name):
    return name not in PEERS and parse_variant(name)[1] != "eager"


def dynamo_graphs():
    """torch.compile's graph count so far in this process (0 elsewhere)."""
    if "torch" not in sys.modules:
        return 0
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def run_fit(variant, x, y, steps, batch, budget, measure_memory=False):
    limit = budget if is_compiled(variant.name) else None
    try:
        with timing.time_limit(limit, f"{variant.name} fit"):
            return variant.fit(x, y, steps, batch, measure_memory)
    except Exception as e:  # noqa: BLE001
        # torch.compile wraps what interrupted it: the timeout is the record.
        link, seen = e, set()
        while link is not None and id(link) not in seen:
            seen.add(id(link))
            if isinstance(link, timing.VariantTimeout):
                raise timing.VariantTimeout(str(link)) from None
            link = link.__cause__ or link.__context__
        raise


def time_phase(cfg, variants, problems, args, backend, x, y, jax_mem):
    """Warm-up and interleaved rounds of `variants`; returns samples and
    losses per variant."""
    order = list(variants)
    shift = (args.worker or 0) % max(1, len(order))
    order = order[shift:] + order[:shift]
    for i, name in enumerate(order):
        t0 = time.perf_counter()
        try:
            run_fit(variants[name], x, y, args.warmup, cfg.batch, args.compile_budget)
        except Exception as e:  # noqa: BLE001
            problems[name] = timing.failure(e)
            del variants[name]
            _after_failure(backend, name)
            continue
        variants[name].warmup_s = time.perf_counter() - t0
        print(f"{cfg.name}/{cfg.size} warm-up {name}: {variants[name].warmup_s:.1f} s", flush=True)
        if backend == "jax" and i == 0 and args.memory and not args.dry_run:
            jax_mem[name] = decoder._jax_memory()
    def fit(name, r):
        graphs = dynamo_graphs()
        result = run_fit(variants[name], x, y, args.steps, cfg.batch, args.compile_budget,
                         measure_memory=(r == 0 and args.memory))
        if is_compiled(name):  # compilations after the warm-up fit: recompiles
            variants[name].recompiles += dynamo_graphs() - graphs
        return result

    return timing.interleaved_rounds(list(variants), args.rounds, args.worker or 0, fit, problems,
                                     on_failure=lambda name: _after_failure(backend, name),
                                     label=f"{cfg.name}/{cfg.size} ")


def _after_failure(backend, name):
    if backend == "torch" and is_compiled(name):
        import torch

        torch._dynamo.reset()  # a compilation cut short leaves nothing half-done behind
    release()


def emit_variant(cfg, name, variant, problems, samples, losses, backend, jax_mem):
    stack = "torch" if name in PEERS else f"keras-{backend}"
    row = row_name(cfg, stack)
    if name in problems or not samples.get(name):
        problem = problems.get(name, "no samples")
        timing.emit(timing.variant_record(name, problem, row=row))
        return
    med = statistics.median(samples[name])
    mem = variant.mem_gib if (backend == "torch" or name in PEERS) else jax_mem.get(name)
    resident = variant.resident_gib()
    timing.emit(timing.variant_record(
        name, med, row=row, tok_per_s=tokens_per_step(cfg) / med * 1e3, steps=len(samples[name]),
        mem_gib=mem, resident_gib=resident, peak_gib=None if mem is None else resident + mem,
        warmup_s=getattr(variant, "warmup_s", None), loss_first=losses[name][0], loss_last=losses[name][-1],
        recompiles=variant.recompiles if is_compiled(name) else None))


def worker(args):
    import keras

    import keras_fp8  # noqa: F401 (registers the FP8 policies)

    backend = keras.backend.backend()
    if backend == "torch":
        import torch

        cuda = torch.cuda.is_available() and not args.dry_run
    else:
        import jax

        cuda = jax.devices()[0].platform == "gpu" and not args.dry_run
    env = timing.environment()
    env.update(backend=backend)
    timing.emit({"env": env})
    for size in args.size_list:
        for name in args.model_list:
            cfg = config(args, name, size)
            run_model(cfg, args, backend, cuda)
            release()


def run_model(cfg, args, backend, cuda):
    problems, jax_mem = {}, {}
    keras_names = keras_variants(args, backend)
    peer_names = peer_variants(args, backend, cfg)
    phases = [keras_names + peer_names] if args.one_phase else [keras_names, peer_names]
    x, y = data(cfg, cfg.batch * max(args.warmup, args.steps))
    for phase in phases:
        if not phase:
            continue
        variants = build_variants(cfg, phase, backend, cuda, args, problems)
        samples, losses = time_phase(cfg, variants, problems, args, backend, x, y, jax_mem)
        for name in phase:
            emit_variant(cfg, name, variants.get(name), problems, samples, losses, backend, jax_mem)
        profiled = backend == "torch" and cuda and (args.profile == "all" or
                                                    (args.profile == "first" and not args.worker))
        if profiled:
            for name in ("mixed_bfloat16", "fp8_hybrid"):
                if name in variants and name not in problems:
                    try:
                        prof = profile_step(variants[name], x, y, args.steps, cfg.batch)
                        timing.emit({"profile": prof, "row": row_name(cfg, f"keras-{backend}"), "of": name})
                    except Exception as e:  # noqa: BLE001
                        print(f"profile of {name} failed: {timing.describe_error(timing.failure(e))}", flush=True)
        if args.roofline and "fp8_hybrid" in variants and "fp8_hybrid" not in problems:
            roofline(cfg, variants["fp8_hybrid"].model, backend, cuda)
        if args.max_batch:
            search_max_batch(cfg, variants, problems, args)
        variants.clear()
        release()


def roofline(cfg, task, backend, cuda):
    """Times the GEMMs of the FP8 layers of `task` (after its fits) in FP8
    and as the mixed_bfloat16 model runs them; the table combines them with
    the step times of the same process (`_roofline_table`)."""
    row = row_name(cfg, f"keras-{backend}")
    shapes = fp8_gemm_shapes(task)
    record = {"roofline": True, "row": row, "shapes": [list(s) for s in shapes]}
    if not cuda:
        record["skipped"] = "GPU only"
    elif not shapes:
        record["skipped"] = "no layer ran FP8"
    else:
        try:
            gemm = measure_gemms(shapes, backend)
            record.update(gemm_fp8_ms=gemm["fp8"], gemm_plain_ms=gemm["plain"])
        except Exception as e:  # noqa: BLE001
            record["error"] = timing.describe_error(timing.failure(e))
    timing.emit(record)


def search_max_batch(cfg, variants, problems, args):
    """The largest batch per variant, each with the others freed."""
    import copy

    names = [n for n in variants if n not in problems and not n.endswith(COMPILED)]
    for name in names:
        variant = variants[name]
        # Free every other model (compiled twins included): the variant's
        # memory alone.
        for other in list(variants):
            if other != name:
                variants[other] = None
        release()
        try:
            found, capped = largest_batch(variant, copy.copy(cfg), args.max_batch_limit)
            record = {"max_batch": found, "capped": capped}
        except Exception as e:  # noqa: BLE001
            record = {"error": timing.describe_error(timing.failure(e))}
        timing.emit({"variant": name, "row": row_name(cfg, "torch" if name in PEERS else
                                                      f"keras-{_backend()}") + "/max-batch", **record})
        variants[name] = None
        release()


def _backend():
    import keras

    return keras.backend.backend()


# --------------------------------------------------------------------------- tables
HEADER = ("| model | stack | variant | ms per step | tok/s | speed-up over the stack's mixed_bfloat16 "
          "| over Keras float8 | step memory, GiB | peak step memory, GiB | warm-up, s | recompiles |")
PROFILE_HEADER = "| model | stack | category | mixed_bfloat16, ms per step | fp8_hybrid, ms per step |"
ROOFLINE_HEADER = ("| model | stack | FP8-able GEMMs, bf16 ms | the same in FP8, ms | the rest of the bf16 step, ms "
                   "| FP8 roofline, ms | fp8_hybrid, ms | fraction of the roofline reached |")
MAX_BATCH_HEADER = "| model | stack | variant | largest batch that trains |"
COMPILED_HEADER = ("| model | Keras-torch variant | ms per step | over mixed_bfloat16 with the same step "
                   "| torchao compiled, ms | torchao time / ours |")
STEP_LABELS = {"compiled": "jit_compile=True", "blocks": "compile_blocks and compile_optimizer"}


def label(name):
    if name in PEERS:
        return decoder.LABELS[name]
    if name == KERAS_FLOAT8:
        return 'Keras quantize("float8")'
    policy, step, moments = parse_variant(name)
    return ", ".join([policy] + ([STEP_LABELS[step]] if step in STEP_LABELS else [])
                     + (["FP8 moments"] if moments else []))


def _sep(h):
    return "|" + "---|" * (h.count("|") - 1)


def _split(row):
    model, size, stack = row.split("/")[:3]
    return f"{model} ({size})", stack


def tables(per_process, args=None):
    res = timing.Results(per_process, row_key="row")
    out = [f"# {timing.env_line(res.env())}; processes per backend: {len(per_process)}", "", HEADER, _sep(HEADER)]
    rows = [r for r in res.rows() if not r.endswith("/max-batch")]
    for row in rows:
        model, stack = _split(row)
        base = "torch-bf16" if stack == "torch" else "mixed_bfloat16"
        for v in decoder._variants_of(res, row):
            name = STACKS.get(stack, stack)
            if timing.summary(res.values(row, v)) is None:
                out.append(f"| {model} | {name} | {label(v)} | {res.problem(row, v)} | - | - | - | - | - | - | - |")
                continue
            ratio = "1.00x" if v == base else res.ratio(row, v, base)
            over_float8 = ("-" if stack == "torch" or v in (KERAS_FLOAT8, base)
                           or KERAS_FLOAT8 not in decoder._variants_of(res, row)
                           else res.ratio(row, v, KERAS_FLOAT8))
            out.append(f"| {model} | {name} | {label(v)} | {res.ms(row, v, fmt='{:.1f}')} "
                       f"| {res.ms(row, v, field='tok_per_s', fmt='{:.0f}')} | {ratio} | {over_float8} "
                       f"| {res.ms(row, v, field='mem_gib', fmt='{:.2f}')} "
                       f"| {res.ms(row, v, field='peak_gib', fmt='{:.2f}')} "
                       f"| {res.ms(row, v, field='warmup_s', fmt='{:.0f}')} "
                       f"| {res.ms(row, v, field='recompiles', fmt='{:.0f}')} |")
    out += (_compiled_table(res) + _profile_table(per_process) + _roofline_table(per_process)
            + _max_batch_table(res))
    return "\n".join(out)


def _compiled_table(res):
    """The compiled Keras-torch FP8 variants against the same step under
    mixed_bfloat16 and against torchao's compiled float8 peer."""
    out = []
    for row in res.rows():
        model_name, size, stack = row.split("/")[:3]
        if stack != "keras-torch":
            continue
        peer_row = f"{model_name}/{size}/torch"
        for v in decoder._variants_of(res, row):
            policy, step, moments = parse_variant(v) if v != KERAS_FLOAT8 else (None, "eager", False)
            if policy != "fp8_hybrid" or step == "eager" or timing.summary(res.values(row, v)) is None:
                continue
            same_step = "mixed_bfloat16" + {"compiled": COMPILED, "blocks": BLOCKS}[step]
            over_bf16 = res.ratio(row, v, same_step)
            peer = res.values(peer_row, "torchao")
            over_peer = timing.ratio_cell(list(zip(peer, res.values(row, v))))
            out.append(f"| {model_name} ({size}) | {label(v)} | {res.ms(row, v, fmt='{:.1f}')} | {over_bf16} "
                       f"| {res.ms(peer_row, 'torchao', fmt='{:.1f}')} | {over_peer} |")
    if not out:
        return []
    return ["", "Compiled Keras-torch FP8 against the same compile under mixed_bfloat16 and against plain PyTorch "
            "with torchao float8, compiled (above 1.00x: ours is faster):", "", COMPILED_HEADER,
            _sep(COMPILED_HEADER)] + out


def _extra(per_process, key):
    return [r for records in per_process for r in records if key in r]


def _profile_table(per_process):
    profiles = _extra(per_process, "profile")
    out = ["", "Where the step goes (CUDA kernel time per step by category, one profiled fit; host gaps: the step's "
           "wall time minus its kernels'). JAX: torch only.", "", PROFILE_HEADER, _sep(PROFILE_HEADER)]
    if not profiles:
        return out + ["| - | - | n/a (torch on a GPU only) | - | - |"]
    by_row = {}
    for r in profiles:
        by_row.setdefault(r["row"], {}).setdefault(r["of"], []).append(r["profile"])
    for row, of in by_row.items():
        model, stack = _split(row)
        for category in CATEGORY_NAMES + ("step (wall)",):
            cells = []
            for policy in ("mixed_bfloat16", "fp8_hybrid"):
                if category == "step (wall)":
                    values = [p["wall_ms"] for p in of.get(policy, [])]
                else:
                    values = [p["categories"].get(category) for p in of.get(policy, [])]
                cells.append(timing.cell(values, "{:.1f}"))
            out.append(f"| {model} | {STACKS.get(stack, stack)} | {category} | {cells[0]} | {cells[1]} |")
    return out


def _roofline_table(per_process):
    res = timing.Results(per_process, row_key="row")
    out = ["", "The FP8 roofline: the mixed_bfloat16 step with every FP8-able GEMM (forward, input and weight "
           "gradients of each layer that runs FP8, the vocabulary projection included) at the FP8 GEMM time "
           "measured in the same process.", "", ROOFLINE_HEADER, _sep(ROOFLINE_HEADER)]
    by_row = {}
    for i, records in enumerate(per_process):
        for r in records:
            if "roofline" in r:
                by_row.setdefault(r["row"], []).append((i, r))
    for row, recs in by_row.items():
        model, stack = _split(row)
        ok = []
        for i, r in recs:
            bf16, fp8 = (res.index[i].get((row, v), {}).get("ms") for v in ("mixed_bfloat16", "fp8_hybrid"))
            if "gemm_fp8_ms" in r and bf16 is not None and fp8 is not None:
                rest = bf16 - r["gemm_plain_ms"]
                ok.append(dict(r, rest_ms=rest, roofline_ms=rest + r["gemm_fp8_ms"], fp8_ms=fp8,
                               fraction=(rest + r["gemm_fp8_ms"]) / fp8))
        if not ok:
            why = next((r.get("skipped") or f"error: {r['error']}" for _, r in recs if "skipped" in r or "error" in r),
                       "mixed_bfloat16 or fp8_hybrid has no step time")
            out.append(f"| {model} | {STACKS.get(stack, stack)} | n/a ({why}) | - | - | - | - | - |")
            continue
        cells = [timing.cell([r[k] for r in ok], "{:.1f}") for k in
                 ("gemm_plain_ms", "gemm_fp8_ms", "rest_ms", "roofline_ms", "fp8_ms")]
        fraction = timing.cell([100 * r["fraction"] for r in ok], "{:.0f}", "%")
        out.append(f"| {model} | {STACKS.get(stack, stack)} | " + " | ".join(cells) + f" | {fraction} |")
    return out


def _max_batch_table(res):
    rows = [r for r in res.rows() if r.endswith("/max-batch")]
    if not rows:
        return []
    out = ["", "The largest batch that trains, each variant alone on the device (doubling, then bisecting):", "",
           MAX_BATCH_HEADER, _sep(MAX_BATCH_HEADER)]
    for row in rows:
        model, stack = _split(row)
        for v in decoder._variants_of(res, row):
            recs = [r for r in res.records(row, v) if r is not None]
            values = [r.get("max_batch") for r in recs]
            text = timing.cell(values, "{:.0f}")
            if any(r.get("capped") for r in recs):
                text += " (the search's limit)"
            if text.startswith("-"):
                text = next((f"n/a (error: {r['error']})" for r in recs if "error" in r), "-")
            out.append(f"| {model} | {STACKS.get(stack, stack)} | {label(v)} | {text} |")
    return out


def run_isolated(argv, args):
    """`--isolate`: per backend, one worker process per variant (all models
    and sizes of that variant in it), `--processes` rounds of them; the
    records of round i of every variant form process i's records."""
    envs, extra = [], []
    for backend in args.backends.split(","):
        names = keras_variants(args, backend)
        if any(m in PEER_MODELS for m in args.model_list):
            names += peer_variants(args, backend, types.SimpleNamespace(name=PEER_MODELS[0]))
        if args.variant_list is not None:  # in the order asked for
            names = [v for v in args.variant_list if v in names]
        for name in names:
            envs.append({**os.environ, "KERAS_BACKEND": backend})
            extra.append(["--variants", name])
    runs = timing.run_processes(os.path.abspath(__file__), timing.worker_argv(argv), args.processes,
                                args.process_timeout, envs, args.time_budget, extra_argvs=extra)
    per_process = [[] for _ in range(args.processes)]
    for env_runs in runs:
        for i, records in enumerate(env_runs):
            per_process[i] += records
    return [p for p in per_process if p]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if not args.isolate or args.worker is not None or args.processes <= 0:
        return timing.main(__file__, argv, parse_args, worker, tables, backends=True)
    per_process = run_isolated(argv, args)
    timing.write_json(args.json, per_process)
    print(tables(per_process, args))
    return per_process


if __name__ == "__main__":
    main()
