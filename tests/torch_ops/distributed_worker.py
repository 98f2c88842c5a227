"""Two processes (gloo, loopback) training FP8Linear models under DDP and FSDP2.

    python tests/torch_ops/distributed_worker.py OUT_DIR

Every scenario trains the same two-layer model for a few steps on a batch
split across the processes, the second process's half ten times larger (so
that a local amax is not the global one). After each step every process
saves its FP8 state, and process 0 saves the state of one process
(``amax_reduction_group(None)``) stepping the same model on the
concatenated batch, from the same weights (copied in before each step, so
that what is compared is the FP8 state rule, not the order in which
gradients were summed). After a DDP run, process 0 alone evaluates the
model (an evaluation call reduces nothing). `test_distributed.py` compares
them.
"""

import datetime
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch_ops  # noqa: E402
from torch_ops import distributed as fp8_dist  # noqa: E402
from torch_ops import fsdp as fp8_fsdp  # noqa: E402
from torch_ops import gathered as fp8_gathered  # noqa: E402
from tests.support.ports import free_port  # noqa: E402

WORLD = 2
STEPS = 3
ROWS = 8  # per process
IN, HIDDEN, OUT = 16, 33, 8  # 33 rows: an uneven FSDP2 shard; K = 33: a padded GEMM layout
# (name, engine, options)
SCENARIOS = (
    ("ddp_broadcast", "ddp", dict(broadcast_buffers=True)),
    ("ddp_no_broadcast", "ddp", dict(broadcast_buffers=False)),
    ("ddp_current", "ddp", dict(broadcast_buffers=True, scaling="current")),
    ("ddp_compiled", "ddp", dict(broadcast_buffers=False, compiled=True)),
    # Process 1's batch is empty at step 1: it still takes part in every amax
    # reduction (contributing zero), so the collectives stay paired.
    ("ddp_empty_batch", "ddp", dict(broadcast_buffers=False, empty_rank=1, empty_step=1)),
    ("fsdp", "fsdp", dict()),
    ("fsdp_fp8_all_gather", "fsdp", dict(fp8_all_gather=True)),
    ("fsdp_fp8_all_gather_current", "fsdp", dict(fp8_all_gather=True, scaling="current")),
)


def make_model(scaling):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.GELU(), torch.nn.Linear(HIDDEN, OUT))
    return torch_ops.convert_to_fp8(model, history_len=2, scaling=scaling, min_gemm_size=0)


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(WORLD * ROWS, IN, generator=g)
    x[ROWS:] *= 10.0  # the second process's rows
    target = torch.randn(WORLD * ROWS, OUT, generator=g)
    return x, target


def loss_fn(y, target):
    # Every example's loss weighted by 1 / the global batch: each process's
    # output gradient is the single-process run's, row for row.
    return ((y - target) ** 2).sum() / (WORLD * ROWS)


def states(model):
    return {f"{i}.{name}": t.detach().clone() for i, m in enumerate(model) if isinstance(m, torch_ops.FP8Linear)
            for name, t in m.named_buffers()}


def full_weights(model):
    out = {}
    for name, p in model.named_parameters():
        p = p.detach()
        out[name] = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = out[name].clone()
    return out


class Counts:
    """How many FSDP2 all-gathers went through the FP8 hooks (and their
    bytes), and how many FP8 linears took a gathered FP8 weight."""

    def __init__(self):
        self.reset()
        pre, operands = fp8_fsdp.FP8AllGatherWeight.fsdp_pre_all_gather, fp8_gathered.fp8_operands

        def counted_pre_all_gather(weight, mesh, outer_size, outer_stride, module, mp_policy):
            inputs, meta = pre(weight, mesh, outer_size, outer_stride, module, mp_policy)
            self.pre_all_gather += 1
            self.bytes += sum(t.numel() * t.element_size() for t in inputs)
            return inputs, meta

        def counted_operands(weight, in_out, need_dx):
            out = operands(weight, in_out, need_dx)
            self.gathered_operands += out is not None
            return out

        fp8_fsdp.FP8AllGatherWeight.fsdp_pre_all_gather = counted_pre_all_gather
        fp8_gathered.fp8_operands = counted_operands

    def reset(self):
        self.pre_all_gather = self.bytes = self.gathered_operands = 0


def run(rank, name, engine, options):
    scaling = options.get("scaling", "delayed")
    model = make_model(scaling)
    if engine == "ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(model, broadcast_buffers=options["broadcast_buffers"])
        if options.get("compiled"):  # torch.compile traces the reduction (Dynamo only: no C++ compiler needed)
            wrapped = torch.compile(wrapped, backend="eager")
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        if options.get("fp8_all_gather"):
            fp8_fsdp.enable_fp8_all_gather(model)
        mesh = init_device_mesh("cpu", (WORLD,))
        for m in model:
            if isinstance(m, torch_ops.FP8Linear):
                fully_shard(m, mesh=mesh)
        wrapped = fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.05)
    reference = make_model(scaling) if rank == 0 else None
    record = {"states": [], "reference": [], "weights": []}
    for step in range(STEPS):
        x, target = batch(step)
        # The ranks whose local batch is empty at this step.
        empty = {options["empty_rank"]} if options.get("empty_step") == step else set()
        weights = full_weights(model)  # (a collective under FSDP2: every process)
        if reference is not None:  # one process, the whole batch, the same weights
            with torch.no_grad():
                for pname, p in reference.named_parameters():
                    p.copy_(weights[pname])
            kept = torch.cat([torch.arange(r * ROWS, (r + 1) * ROWS) for r in range(WORLD) if r not in empty])
            with fp8_dist.amax_reduction_group(None):
                loss_fn(reference(x[kept]), target[kept]).backward()
            record["reference"].append(states(reference))
        rows = slice(rank * ROWS, rank * ROWS if rank in empty else (rank + 1) * ROWS)
        optimizer.zero_grad()
        loss_fn(wrapped(x[rows]), target[rows]).backward()
        optimizer.step()
        record["states"].append(states(model))
        record["weights"].append(full_weights(model))
    if engine == "fsdp":  # the sharded checkpoint holds plain local tensors
        record["plain_state_dict"] = all(type(getattr(v, "_local_tensor", v)) is torch.Tensor
                                         for v in model.state_dict().values())
    if engine == "ddp" and rank == 0:  # evaluation on one process alone: no collective to wait for
        model.eval()
        with torch.no_grad():
            record["evaluated_alone"] = tuple(model(batch(0)[0][:ROWS]).shape)
        model.train()
    record["counts"] = {k: getattr(COUNTS, k) for k in ("pre_all_gather", "bytes", "gathered_operands")}
    return record


COUNTS = Counts()


def main(rank, port, out_dir):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    results = {}
    for name, engine, options in SCENARIOS:
        COUNTS.reset()
        results[name] = run(rank, name, engine, options)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()
    os._exit(0)  # past the interpreter's shutdown, which has aborted gloo runs once all was done


if __name__ == "__main__":
    torch.multiprocessing.spawn(main, args=(free_port(), sys.argv[1]), nprocs=WORLD)
