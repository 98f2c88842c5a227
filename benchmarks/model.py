"""Model-level benchmark: a decoder-only transformer trained with model.fit.

    KERAS_BACKEND=torch python benchmarks/model.py --stack keras --policy fp8_hybrid
    KERAS_BACKEND=jax   python benchmarks/model.py --stack keras --policy mixed_bfloat16
    python benchmarks/model.py --stack torch [--torchao]

Architecture (ANCHORS.md): hidden 4096, SwiGLU MLP 14336, 32 heads, 4 blocks,
sequence 2048, batch 8 (16384 tokens), vocabulary 32000, causal attention,
RMS norms, output layer in the compute dtype (not FP8), AdamW with float32
master weights. `--stack keras` builds it from Keras layers (FP8Dense for the
projections; under mixed_bfloat16 they are plain Dense) and trains with
model.fit; `--stack torch` is the same network in plain PyTorch (bf16
autocast, fused AdamW, optionally torchao float8 tensorwise + torch.compile).
Prints ms/step (median over the timed steps) and the loss of every step, as
one `RESULT` line (JSON) for the side-by-side table.

`--interleave mixed_bfloat16,fp8_hybrid --rounds 5` builds both Keras models
in one process and alternates their fit() calls, so that the ratio is not at
the mercy of one process's luck (host-bound small models varied 0.83x-1.20x
between processes).

`--jit` (default `auto`): Keras's own default, i.e. `model.fit` is one XLA
program under JAX and eager under torch; `--jit` alone also compiles the
plain-torch stack with torch.compile. (An earlier version passed
`jit_compile=False` to Keras by default, which runs JAX op by op: the
420 ms/step of the first JAX runs.) `--attention auto|flash|xla` is Keras's
`flash_attention` argument (None/True/False); `auto` gives cuDNN flash
attention on a GPU for bf16 inputs. `benchmarks/jax_step.py` reports what the
JAX train step compiles to.
"""

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402


def data(args):
    rng = np.random.default_rng(0)
    n = args.batch * (args.warmup + args.steps)
    tokens = rng.integers(0, args.vocab, (n, args.seq + 1)).astype("int32")
    return tokens[:, :-1], tokens[:, 1:]


def keras_model(args):
    import keras
    from keras import ops

    from keras_fp8.layers import FP8Dense

    class CausalSelfAttention(keras.layers.Layer):
        def __init__(self, hidden, heads, **kwargs):
            super().__init__(**kwargs)
            self.hidden, self.heads = hidden, heads
            self.qkv = FP8Dense(3 * hidden, use_bias=False)
            self.out = FP8Dense(hidden, use_bias=False)

        def call(self, x):
            b, s = ops.shape(x)[0], ops.shape(x)[1]
            qkv = ops.reshape(self.qkv(x), (b, s, 3, self.heads, self.hidden // self.heads))
            if args.qkv == "unstack":
                # As the plain-torch stack's unbind(2): one stack in the backward.
                q, k, v = ops.unstack(qkv, axis=2)
            else:
                # Three index-selects: each backward zero-fills a full-size
                # gradient and copies into it (the earlier benchmark's code).
                q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
            a = ops.dot_product_attention(
                q, k, v, is_causal=True, flash_attention=flash
            )
            return self.out(ops.reshape(a, (b, s, self.hidden)))

    class SwiGLU(keras.layers.Layer):
        def __init__(self, hidden, mlp, **kwargs):
            super().__init__(**kwargs)
            self.gate = FP8Dense(mlp, use_bias=False)
            self.up = FP8Dense(mlp, use_bias=False)
            self.down = FP8Dense(hidden, use_bias=False)

        def call(self, x):
            return self.down(ops.silu(self.gate(x)) * self.up(x))

    # None: Keras decides (cuDNN flash attention on a GPU for bf16 inputs,
    # the XLA/torch SDPA path otherwise); True raises where flash can't run.
    flash = {"auto": None, "flash": True, "xla": False}[args.attention]
    keras.mixed_precision.set_global_policy(args.policy)
    keras.utils.set_random_seed(0)
    tokens = keras.Input((args.seq,), dtype="int32")
    h = keras.layers.Embedding(args.vocab, args.hidden)(tokens)
    for _ in range(args.blocks):
        a = keras.layers.RMSNormalization()(h)
        h = h + CausalSelfAttention(args.hidden, args.heads)(a)
        m = keras.layers.RMSNormalization()(h)
        h = h + SwiGLU(args.hidden, args.mlp)(m)
    h = keras.layers.RMSNormalization()(h)
    logits = keras.layers.Dense(args.vocab, use_bias=False, dtype="mixed_bfloat16")(h)
    model = keras.Model(tokens, logits)
    if args.loss == "flat":
        def loss(y_true, y_pred):
            # The same mean cross-entropy over (tokens, vocabulary) rows: the
            # class axis is already the last of a 2-D tensor.
            return keras.losses.sparse_categorical_crossentropy(
                ops.reshape(y_true, (-1,)), ops.reshape(y_pred, (-1, args.vocab)), from_logits=True)
    else:
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(
        optimizer=keras.optimizers.AdamW(1e-4),
        loss=loss,
        jit_compile={"auto": "auto", "true": True, "false": False}[args.jit],
    )
    return model


def timed_fit(model, x, y, batch_size, progress_from=None):
    """`model.fit` for one epoch over (x, y), unshuffled. Returns the time
    stamp at the end of each step and each step's loss (reading the loss
    forces the step to finish). `progress_from`: print one line per step
    with the seconds since that `time.perf_counter()` value (a run cut short
    still shows how far it got)."""
    import keras

    stamps, losses = [], []

    class Timer(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            losses.append(float(logs["loss"]))
            stamps.append(time.perf_counter())
            if progress_from is not None:
                print(f"step {batch} done at {stamps[-1] - progress_from:.1f} s", flush=True)

    model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0, callbacks=[Timer()])
    return stamps, losses


def run_keras(args):
    start = time.perf_counter()
    model = keras_model(args)
    x, y = data(args)
    return timed_fit(model, x, y, args.batch, progress_from=start)


def _set_prequantize(on):
    """Turns keras_fp8's kernels quantized ahead on or off (torch backend);
    returns the previous setting."""
    import keras

    if keras.backend.backend() != "torch":
        return on
    from keras_fp8.backends import torch as torch_backend

    was, torch_backend.PREQUANTIZE = torch_backend.PREQUANTIZE, on
    return was


def run_keras_interleaved(args):
    """Both policies of `--interleave` in one process, their fit() calls
    alternating for `--rounds` rounds (after one warm-up fit each), so that
    drifts of the machine fall on both alike. Returns {policy: (step ms
    list, losses)}; a sample is one step's time within a fit call (the first
    step of each call, which includes fit's setup, is left out)."""
    import keras

    policies = args.interleave.split(",")
    models = {}
    for policy in policies:
        args.policy = policy.split(":")[0]
        models[policy] = keras_model(args)
    keras.mixed_precision.set_global_policy("float32")
    x, y = data(args)
    steps = {p: [] for p in policies}
    losses = {p: [] for p in policies}

    def fit(policy, batches):
        n = batches * args.batch
        ahead = _set_prequantize(not policy.endswith(":noahead"))
        try:
            stamps, step_losses = timed_fit(models[policy], x[:n], y[:n], args.batch)
        finally:
            _set_prequantize(ahead)
        return list(np.diff(stamps) * 1e3), step_losses

    for policy in policies:
        fit(policy, args.warmup)
    for r in range(args.rounds):
        for policy in policies:
            ms, ls = fit(policy, args.steps)
            steps[policy] += ms
            losses[policy] += ls
        print(f"round {r}: " + ", ".join(f"{p} {statistics.median(steps[p]):.2f} ms/step so far" for p in policies),
              flush=True)
    return {p: (steps[p], losses[p]) for p in policies}


def run_torch(args):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    torch.manual_seed(0)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.n1, self.n2 = nn.RMSNorm(args.hidden), nn.RMSNorm(args.hidden)
            self.qkv = nn.Linear(args.hidden, 3 * args.hidden, bias=False)
            self.out = nn.Linear(args.hidden, args.hidden, bias=False)
            self.gate = nn.Linear(args.hidden, args.mlp, bias=False)
            self.up = nn.Linear(args.hidden, args.mlp, bias=False)
            self.down = nn.Linear(args.mlp, args.hidden, bias=False)

        def forward(self, h):
            b, s, _ = h.shape
            q, k, v = self.qkv(self.n1(h)).view(b, s, 3, args.heads, -1).unbind(2)
            a = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
            ).transpose(1, 2).reshape(b, s, -1)
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

    model = Decoder().cuda()
    if args.torchao:
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(
            model, module_filter_fn=lambda mod, fqn: fqn != "lm_head"
        )
    if args.torchao or args.jit == "true":
        model = torch.compile(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x, y = data(args)
    x, y = torch.tensor(x).long().cuda(), torch.tensor(y).long().cuda()
    stamps, losses = [], []
    for i in range(args.warmup + args.steps):
        xb, yb = x[i * args.batch:(i + 1) * args.batch], y[i * args.batch:(i + 1) * args.batch]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(xb)
        loss = F.cross_entropy(logits.float().view(-1, args.vocab), yb.view(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        stamps.append(time.perf_counter())
    return stamps, losses


def add_model_arguments(parser):
    """The architecture flags (ANCHORS.md defaults) and the attention choice."""
    parser.add_argument("--policy", default="fp8_hybrid")
    parser.add_argument("--attention", default="auto",
                        choices=["auto", "flash", "xla"])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--mlp", type=int, default=14336)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--qkv", default="unstack", choices=["unstack", "index"],
                        help="how attention takes q, k and v from the fused projection: ops.unstack (as the "
                             "plain-torch stack's unbind) or three index-selects qkv[:, :, i] (the benchmark's code "
                             "before the sixth session; their backward is three zero-fills and strided copies)")
    parser.add_argument("--loss", default="keras", choices=["keras", "flat"],
                        help="keras: SparseCategoricalCrossentropy on the (batch, seq, vocab) logits (the "
                             "benchmark's model). flat: the same loss on (batch*seq, vocab) rows, a diagnostic: "
                             "Keras's torch backend moves the class axis of 3-D logits to dimension 1, where "
                             "PyTorch runs its slow spatial log-softmax")


def parse_args(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--stack", choices=["keras", "torch"], default="keras")
    parser.add_argument("--torchao", action="store_true")
    parser.add_argument("--jit", nargs="?", const="true", default="auto",
                        choices=["auto", "true", "false"])
    add_model_arguments(parser)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--interleave", default=None,
                        help="e.g. mixed_bfloat16,fp8_hybrid: both Keras models in one process, fit() calls "
                             "alternating for --rounds rounds of --steps steps (after --warmup steps each)")
    parser.add_argument("--rounds", type=int, default=5)
    return parser.parse_args(argv)


def main():
    args = parse_args()
    start = time.perf_counter()
    if args.interleave:
        import keras

        results = run_keras_interleaved(args)
        med = {p: statistics.median(ms) for p, (ms, _) in results.items()}
        for p, (ms, ls) in results.items():
            print("RESULT " + json.dumps({"stack": f"keras-{keras.backend.backend()} {p} (interleaved)",
                                          "ms_per_step": med[p], "steps_timed": len(ms), "losses": ls}))
        a, *others = list(med)
        for b in others:
            print(f"RATIO {b} vs {a}: {med[a] / med[b]:.3f}x steps/s ({med[a]:.2f} vs {med[b]:.2f} ms/step, "
                  f"medians over {len(results[a][0])} steps each)")
        return
    stamps, losses = (run_keras if args.stack == "keras" else run_torch)(args)
    steps = np.diff(stamps[args.warmup - 1:]) * 1e3
    if args.stack == "keras":
        import keras

        label = f"keras-{keras.backend.backend()} {args.policy}"
    else:
        label = "torch " + ("torchao-float8 compiled" if args.torchao else "bf16" + (" compiled" if args.jit == "true" else " eager"))
    ms = statistics.median(steps)
    result = {
        "stack": label, "ms_per_step": ms,
        "tok_per_s": args.batch * args.seq / ms * 1e3,
        "losses": losses, "wall_s": time.perf_counter() - start,
        # Process start to the end of step 1: build + compile + one step.
        "first_step_s": stamps[0] - start,
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
