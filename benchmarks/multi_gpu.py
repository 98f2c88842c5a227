"""Multi-GPU benchmark: a decoder trained data-parallel, bf16 against FP8.

    python benchmarks/multi_gpu.py --engine torch --nproc 2      # FSDP2 over NCCL
    python benchmarks/multi_gpu.py --engine jax                  # Keras-JAX DataParallel, every local GPU
    python benchmarks/multi_gpu.py --engine torch --device cpu --nproc 2 --tiny   # dry run: gloo
    python benchmarks/multi_gpu.py --engine jax --device cpu --nproc 2 --tiny     # dry run: virtual devices

The model is the decoder of `benchmarks/model.py` (RMS norms, fused QKV,
causal attention, SwiGLU MLP, the output layer in bf16), defined here again
so that this script does not depend on that one; `--hidden`, `--mlp`,
`--blocks`, `--seq`, `--batch` (per device) scale it to fit.

`--engine torch`: one process per GPU, every block and the root under
`fully_shard` (FP32 master weights, `MixedPrecisionPolicy(param_dtype=
bf16, reduce_dtype=fp32)`), AdamW; the modes (`--modes`):

- `bf16`: `nn.Linear` everywhere;
- `fp8`: `torch_ops.convert_to_fp8` (all projections; the output layer
  stays bf16), amaxes reduced over the world, FSDP2 gathers bf16 weights;
- `fp8_all_gather`: the same with `torch_ops.fsdp.enable_fp8_all_gather`:
  the shards are quantized before the all-gather, which moves E4M3 bytes;
- `torchao`, `torchao_all_gather`: torchao's float8 training (tensorwise,
  `enable_fsdp_float8_all_gather` for the second, with
  `precompute_float8_dynamic_scale_for_fsdp` after each step), where
  torchao is importable (skipped otherwise).

Each mode reports tokens/s over all processes (the median step), the bytes
each process receives per step from FSDP2's all-gathers (counted at
`torch.distributed.all_gather_single` / `all_gather_into_tensor`), the peak
memory and the losses. `--compile` compiles each block (torchao's float8 is
meant to run compiled).

`--engine jax`: one process, `keras.distribution.DataParallel` over the
local devices, `model.fit`; modes `mixed_bfloat16` and `fp8_hybrid`
(FP8Dense projections). DataParallel replicates the weights: no all-gather.

Every result is one `RESULT {json}` line. On GPUs, `python -m torch_ops
build` first builds the kernels once (process 0 otherwise builds them while
the others wait).
"""

import argparse
import json
import os
import socket
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TORCH_MODES = ("bf16", "fp8", "fp8_all_gather", "torchao", "torchao_all_gather")
JAX_MODES = ("mixed_bfloat16", "fp8_hybrid")
TINY = dict(hidden=64, mlp=128, heads=4, blocks=2, seq=32, batch=2, vocab=128, warmup=1, steps=2)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=["torch", "jax"], default="torch")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: a dry run (gloo between processes for torch, virtual CPU devices for JAX)")
    parser.add_argument("--nproc", type=int, default=None,
                        help="processes (torch) or devices (jax); default: every GPU (cuda), 2 (cpu)")
    parser.add_argument("--modes", default=None, help="comma-separated; default: every mode of the engine")
    parser.add_argument("--tiny", action="store_true", help="a tiny model and two timed steps (dry runs)")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--mlp", type=int, default=14336)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=2, help="sequences per device")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--compile", action="store_true", help="torch: torch.compile each block")
    args = parser.parse_args(argv)
    if args.tiny:
        for name, value in TINY.items():
            setattr(args, name, value)
    if args.nproc is None:
        args.nproc = 2 if args.device == "cpu" else _gpu_count(args.engine)
    modes = JAX_MODES if args.engine == "jax" else TORCH_MODES
    args.modes = modes if args.modes is None else tuple(args.modes.split(","))
    unknown = [m for m in args.modes if m not in modes]
    if unknown:
        parser.error(f"--modes: {unknown[0]!r} is not a mode of --engine {args.engine}; expected some of {modes}")
    return args


def _gpu_count(engine):
    if engine == "torch":
        import torch

        return torch.cuda.device_count()
    return 0  # JAX: every local device


def batches(args, n, rank, world):
    """`n` batches of `args.batch` sequences for process `rank` (its slice of
    each global batch), token ids (inputs, targets)."""
    import numpy as np

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, args.vocab, (n, world * args.batch, args.seq + 1))
    rows = slice(rank * args.batch, (rank + 1) * args.batch)
    return [(t[rows, :-1], t[rows, 1:]) for t in tokens]


def report(result):
    print("RESULT " + json.dumps(result), flush=True)


# --------------------------------------------------------------------------- torch, FSDP2
def torch_decoder(args):
    """`benchmarks/model.py`'s decoder in plain PyTorch, seeded."""
    import torch

    from benchmarks.model import torch_decoder as decoder

    torch.manual_seed(0)
    return decoder(args)


class GatherCounter:
    """Bytes this process receives from all-gathers (the output buffers of
    `all_gather_single` / `all_gather_into_tensor`, FSDP2's collectives)."""

    def __init__(self):
        import torch.distributed as dist

        self.bytes = 0
        for name in ("all_gather_single", "all_gather_into_tensor"):
            original = getattr(dist, name, None)
            if original is not None:
                setattr(dist, name, self._counted(original))

    def _counted(self, original):
        def counted(output_tensor, input_tensor, *args, **kwargs):
            self.bytes += output_tensor.numel() * output_tensor.element_size()
            return original(output_tensor, input_tensor, *args, **kwargs)

        return counted


def torchao_available():
    try:
        import torchao.float8  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return False
    return True


def torch_mode(args, mode, rank, world, device, counter):
    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard

    import torch_ops

    model = torch_decoder(args).to(device)
    keep_bf16 = lambda fqn: fqn != "lm_head"  # noqa: E731
    precompute = None
    if mode in ("fp8", "fp8_all_gather"):
        # min_gemm_size 0: FP8 at every projection, whatever the shapes.
        torch_ops.convert_to_fp8(model, filter_fn=lambda name, m: keep_bf16(name), min_gemm_size=0)
        if mode == "fp8_all_gather":
            torch_ops.fsdp.enable_fp8_all_gather(model)
    elif mode.startswith("torchao"):
        from torchao.float8 import Float8LinearConfig
        from torchao.float8 import convert_to_float8_training
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        config = Float8LinearConfig(enable_fsdp_float8_all_gather=mode == "torchao_all_gather")
        convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: keep_bf16(fqn))
        if mode == "torchao_all_gather":
            precompute = precompute_float8_dynamic_scale_for_fsdp
    mesh = init_device_mesh(device.type, (world,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for i, block in enumerate(model.blocks):
        fully_shard(block, mesh=mesh, mp_policy=policy)
        if args.compile:
            model.blocks[i] = torch.compile(block)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    data = batches(args, args.warmup + args.steps, rank, world)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    stamps, losses, gathered = [], [], []
    sync()
    start = time.perf_counter()
    for x, y in data:
        x, y = torch.as_tensor(x, device=device), torch.as_tensor(y, device=device)
        before = counter.bytes
        logits = model(x)
        loss = F.cross_entropy(logits.float().view(-1, args.vocab), y.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if precompute is not None:
            precompute(model)
        losses.append(float(loss.detach()))  # synchronizes
        sync()
        stamps.append(time.perf_counter())
        gathered.append(counter.bytes - before)
    step_s = [b - a for a, b in zip([start] + stamps[:-1], stamps)][args.warmup:]
    median = statistics.median(step_s)
    return {
        "engine": "torch-fsdp2", "mode": mode, "processes": world, "device": device.type,
        "compiled": args.compile, "ms_per_step": median * 1e3,
        "tokens_per_s": world * args.batch * args.seq / median,
        "all_gather_bytes_per_step": statistics.median(gathered[args.warmup:]),
        "peak_memory_gb": (torch.cuda.max_memory_allocated(device) / 2**30) if device.type == "cuda" else None,
        "losses": losses,
    }


def torch_worker(rank, world, port, args):
    import datetime

    import torch
    import torch.distributed as dist

    if args.device == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        backend = "nccl"
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
        backend = "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    counter = GatherCounter()
    if args.device == "cuda" and any(m.startswith("fp8") for m in args.modes):
        import torch_ops

        # Process 0 builds the kernels (or finds them cached) before the others load them.
        if rank == 0:
            torch_ops.is_available(device)
        dist.barrier()
        if not torch_ops.is_available(device):
            raise SystemExit(f"torch_ops kernels unavailable: {torch_ops.unavailable_reason(device)}")
    try:
        for mode in args.modes:
            if mode.startswith("torchao") and (args.device != "cuda" or not torchao_available()):
                if rank == 0:
                    why = "needs CUDA" if args.device != "cuda" else "torchao is not importable"
                    report({"engine": "torch-fsdp2", "mode": mode, "skipped": why})
                continue
            result = torch_mode(args, mode, rank, world, device, counter)
            if rank == 0:
                report(result)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            dist.barrier()
    finally:
        dist.destroy_process_group()
    # A spawned process otherwise ends through the interpreter's full
    # shutdown, where torch's static objects are destroyed in an order that
    # has aborted a gloo run ("terminate called without an active exception")
    # after every result was out. Nothing is left to do: leave at once.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_torch(args):
    import torch

    if args.nproc < 1:
        raise SystemExit("--nproc: no GPU visible; pass --device cpu for a dry run")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(torch_worker, args=(args.nproc, port, args), nprocs=args.nproc)


# --------------------------------------------------------------------------- Keras-JAX, DataParallel
def keras_decoder(args, policy):
    """`benchmarks/model.py`'s Keras decoder (FP8Dense projections under an
    FP8 policy), compiled."""
    import keras

    from benchmarks.model import keras_model

    return keras_model(args, policy, keras.layers.Dense)


def run_jax(args):
    if args.device == "cpu":
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" --xla_force_host_platform_device_count={args.nproc}").strip()
        os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["KERAS_BACKEND"] = "jax"
    import keras
    import numpy as np

    import keras_fp8  # noqa: F401  (the FP8 policies)

    devices = keras.distribution.list_devices()
    if args.nproc:
        devices = devices[: args.nproc]
    distribution = keras.distribution.DataParallel(devices=devices)
    world = len(devices)
    steps = args.warmup + args.steps
    data = batches(args, steps, 0, 1)
    rows = world * args.batch
    x = np.concatenate([np.resize(b[0], (rows, args.seq)) for b in data]).astype("int32")
    y = np.concatenate([np.resize(b[1], (rows, args.seq)) for b in data]).astype("int32")
    for mode in args.modes:
        with distribution.scope():
            model = keras_decoder(args, mode)
            stamps, losses = [], []

            class Timer(keras.callbacks.Callback):
                def on_train_batch_end(self, batch, logs=None):
                    losses.append(float(logs["loss"]))  # waits for the step
                    stamps.append(time.perf_counter())

            start = time.perf_counter()
            model.fit(x, y, batch_size=rows, epochs=1, shuffle=False, verbose=0, callbacks=[Timer()])
        step_s = [b - a for a, b in zip([start] + stamps[:-1], stamps)][args.warmup:]
        median = statistics.median(step_s)
        report({"engine": "keras-jax-data-parallel", "mode": mode, "devices": world,
                "device": devices[0].split(":")[0], "ms_per_step": median * 1e3,
                "tokens_per_s": rows * args.seq / median, "all_gather_bytes_per_step": 0, "losses": losses})
        keras.mixed_precision.set_global_policy("float32")


def main(argv=None):
    args = parse_args(argv)
    (run_torch if args.engine == "torch" else run_jax)(args)


if __name__ == "__main__":
    main()
