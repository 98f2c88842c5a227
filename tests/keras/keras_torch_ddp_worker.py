"""A Keras FP8 model on the torch backend, trained by two processes under DDP.

    KERAS_BACKEND=torch python tests/keras_torch_ddp_worker.py OUT_DIR

The pattern of Keras's "distributed training with PyTorch" guide: the Keras
model wrapped in `torch.nn.parallel.DistributedDataParallel`, a custom
loop, here with a Keras optimizer (which overwrites `grad_amax_pending`
with its "gradient", docs/guide.md section 9), after
`torch_ops.distributed.prepare_ddp(model)`. Two processes (gloo, loopback)
each take half of the batch, the second half ten times larger. After each
step every process saves its FP8 state, and process 0 saves the state of one
model stepping on the whole batch in one process from the same weights
(copied in before each step). `test_keras_torch_ddp.py` compares them.

The "empty_batch" run trains an `FP8EinsumDense` and an `FP8Dense` whose
process 1 gets an empty batch at step 1: its layers still take part in
every amax reduction (contributing zero), so gloo pairs the same
collectives on both processes; the one-process reference steps on the rows
kept.
"""

import datetime
import os
import sys

os.environ["KERAS_BACKEND"] = "torch"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from tests.support.ports import free_port  # noqa: E402

WORLD = 2
STEPS = 3
ROWS = 8  # per process


def build(recipe):
    import keras

    import keras_fp8
    from keras_fp8.layers import FP8Dense

    keras.utils.set_random_seed(0)
    recipe = keras_fp8.DelayedScaling(history_len=2) if recipe == "delayed" else keras_fp8.CurrentScaling()
    model = keras.Sequential([
        keras.Input((16,)),
        FP8Dense(33, activation="gelu", recipe=recipe, min_gemm_size=0, dtype="fp8_hybrid"),
        FP8Dense(8, recipe=recipe, min_gemm_size=0, dtype="fp8_hybrid"),
    ])
    optimizer = keras.optimizers.SGD(0.01)
    optimizer.build(model.trainable_variables)
    return model, optimizer


def build_empty_batch_run():
    """An `FP8EinsumDense` (its bias over the GEMM's columns) and an
    `FP8Dense` on `(rows, 4, 16)` inputs."""
    import keras

    import keras_fp8
    from keras_fp8.layers import FP8Dense
    from keras_fp8.layers import FP8EinsumDense

    keras.utils.set_random_seed(0)
    recipe = keras_fp8.DelayedScaling(history_len=2)
    model = keras.Sequential([
        keras.Input((4, 16)),
        FP8EinsumDense("abc,cde->abde", (4, 2, 12), bias_axes="de", activation="gelu", recipe=recipe,
                       min_gemm_size=0, dtype="fp8_hybrid"),
        keras.layers.Reshape((4, 24)),
        FP8Dense(8, recipe=recipe, min_gemm_size=0, dtype="fp8_hybrid"),
    ])
    optimizer = keras.optimizers.SGD(0.01)
    optimizer.build(model.trainable_variables)
    return model, optimizer


# The run with an empty batch: which process's batch is empty at which step.
EMPTY_RANK, EMPTY_STEP = 1, 1


def batch(step, features=(16,)):
    rng = np.random.default_rng(100 + step)
    x = rng.standard_normal((WORLD * ROWS,) + features).astype("float32")
    x[ROWS:] *= 10.0
    target = rng.standard_normal((WORLD * ROWS,) + features[:-1] + (8,)).astype("float32")
    return torch.from_numpy(x), torch.from_numpy(target)


def train_step(model, call, optimizer, x, target):
    y = call(x, training=True)
    # Each example's loss weighted by 1 / the global batch: every process's
    # output gradient is the single-process run's, row for row.
    loss = ((y.float() - target) ** 2).sum() / (WORLD * ROWS)
    model.zero_grad()
    loss.backward()
    grads = [v.value.grad for v in model.trainable_variables]
    with torch.no_grad():
        optimizer.apply(grads, model.trainable_variables)


def fp8_layers(model):
    from keras_fp8.layers.fp8_state import FP8StateMixin

    return [layer for layer in model.layers if isinstance(layer, FP8StateMixin)]


def fp8_state(model):
    layers = fp8_layers(model)
    return {f"{i}/{v.name}": v.value.detach().clone() for i, layer in enumerate(layers)
            for v in layer.fp8_state_variables}


def run(rank, recipe):
    import torch_ops

    make = build_empty_batch_run if recipe == "empty_batch" else lambda: build(recipe)
    features = (4, 16) if recipe == "empty_batch" else (16,)
    model, optimizer = make()
    ignored = torch_ops.distributed.prepare_ddp(model)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    reference, reference_optimizer = make() if rank == 0 else (None, None)
    record = {"states": [], "reference": [], "ignored": ignored}
    for step in range(STEPS):
        x, target = batch(step, features)
        # The processes whose local batch is empty at this step.
        empty = {EMPTY_RANK} if recipe == "empty_batch" and step == EMPTY_STEP else set()
        if reference is not None:
            kept = torch.cat([torch.arange(r * ROWS, (r + 1) * ROWS) for r in range(WORLD) if r not in empty])
            with torch.no_grad():
                for s, t in zip(fp8_layers(model), fp8_layers(reference)):
                    t._kernel.assign(s._kernel.value)
                    t.bias.assign(s.bias.value)
            with torch_ops.distributed.amax_reduction_group(None):
                train_step(reference, reference, reference_optimizer, x[kept], target[kept])
            record["reference"].append(fp8_state(reference))
        rows = slice(rank * ROWS, rank * ROWS if rank in empty else (rank + 1) * ROWS)
        train_step(model, ddp, optimizer, x[rows], target[rows])
        record["states"].append(fp8_state(model))
    if rank == 0:  # evaluation on one process alone: no collective to wait for
        record["evaluated_alone"] = tuple(model(batch(0, features)[0][:ROWS], training=False).shape)
    return record


def main(rank, port, out_dir):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    results = {recipe: run(rank, recipe) for recipe in ("delayed", "current", "empty_batch")}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()
    os._exit(0)  # past the interpreter's shutdown, which has aborted gloo runs once all was done


if __name__ == "__main__":
    torch.multiprocessing.spawn(main, args=(free_port(), sys.argv[1]), nprocs=WORLD)
