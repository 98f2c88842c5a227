"""FP8 state on many processes: the amax reduction group, DDP.

The rule (docs/numerics.md, "Many devices"): processes that quantize the
same logical tensor use one scale. The amax of a layer's input and of its
output gradient is the max over the amax reduction group (default: every
process of the default process group, i.e. the data-parallel world, as
TransformerEngine's ``amax_reduction_group``), reduced on the device with
``torch.distributed.all_reduce(op=MAX)`` before the scale is chosen, so
that every process records the same amax, quantizes with the same scale and
keeps the same state, equal to one process's over the concatenated batch.
No host synchronization, no host-side branch: CUDA-graph safe on NCCL.

Training calls only: an evaluation call (``training=False``) changes no
state, reduces nothing and may run on one process alone. A training call's
reduction is a collective: every process of the group must make the same
calls, each FP8 or not alike (an empty input, or ``M*N*K`` below
``min_gemm_size``, runs the compute-dtype linear and reduces nothing). While a
reduction group with more than one process is in effect, a training call
of the FP8 linear takes its Python path (``torch_ops/linear.py``) on every
device, whose quantize calls this module's ``quantize_global``; the eager
C++ entry has no reduction in it.

For ``DistributedDataParallel``: FP8 state is identical on every process by
the rule above, so DDP's buffer broadcast (``broadcast_buffers=True``)
copies equal values and ``broadcast_buffers=False`` cannot drift: an
``FP8Linear`` model needs nothing more. A Keras model on the torch backend
has one more thing DDP must not touch: each FP8 layer's gradient channel
``grad_amax_pending``, a parameter whose "gradient" is the output
gradient's amax (already the group's max); DDP would average it, and an
average of equal values over more than two processes can round.
``prepare_ddp(model)`` takes those parameters out of DDP's reach.

Example:

>>> torch.distributed.init_process_group("nccl")     # torchrun ...
>>> model = torch_ops.convert_to_fp8(model)           # amaxes: max over the world
>>> model = torch.nn.parallel.DistributedDataParallel(model)
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from . import extension
from . import ops
from . import reference as ref

WORLD = "world"
# A parameter attribute: its gradient is an amax (a gradient channel).
_CHANNEL_MARK = "_torch_ops_amax_channel"

_group_setting = WORLD


def check_amax_reduction_group(group):
    """Returns ``group`` if it is a valid amax reduction group setting:
    ``"world"``, None, a ``torch.distributed.ProcessGroup`` or a 1-D
    ``DeviceMesh`` (its group); raises a ValueError naming ``group`` otherwise."""
    if group is None or (isinstance(group, str) and group == WORLD):
        return group
    if dist.is_available() and isinstance(group, dist.ProcessGroup):
        return group
    mesh_type = _device_mesh_type()
    if mesh_type is not None and isinstance(group, mesh_type):
        if group.ndim != 1:
            raise ValueError(f"group: expected a 1-D DeviceMesh, got one of shape {tuple(group.shape)} "
                             "(pass mesh[dim_name] for one dimension, or \"world\")")
        return group.get_group()
    raise ValueError(f"group: expected \"world\", None, a torch.distributed.ProcessGroup or a 1-D DeviceMesh, "
                     f"got {group!r}")


def _device_mesh_type():
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # torch without distributed support
        return None
    return DeviceMesh


def set_amax_reduction_group(group=WORLD):
    """Sets the group over which input and output-gradient amaxes are MAX-reduced.

    Args:
        group: ``"world"`` (default): the default process group whenever
            ``torch.distributed`` is initialized (nothing is reduced in a
            single process); a ``ProcessGroup`` (or 1-D ``DeviceMesh``): that
            group, e.g. the data-parallel one of a larger mesh; None: no
            reduction (each process keeps its own state, which DDP's buffer
            broadcast then overwrites with rank 0's).

    Returns:
        The previous setting (pass it back to restore).

    Example:

    >>> previous = torch_ops.distributed.set_amax_reduction_group(mesh["dp"])
    >>> torch_ops.distributed.set_amax_reduction_group(previous)
    """
    global _group_setting
    group = check_amax_reduction_group(group)
    previous, _group_setting = _group_setting, group
    return previous


def get_amax_reduction_group():
    """The current setting: ``"world"``, None or a ``ProcessGroup``."""
    return _group_setting


@contextlib.contextmanager
def amax_reduction_group(group):
    """``set_amax_reduction_group(group)`` for the duration of a ``with`` block."""
    previous = set_amax_reduction_group(group)
    try:
        yield
    finally:
        set_amax_reduction_group(previous)


def reduction_group():
    """The process group amaxes are reduced over now, or None (no
    reduction: the setting is None, ``torch.distributed`` is not
    initialized, or the group has one process)."""
    group = _group_setting
    if group is None or not dist.is_available() or not dist.is_initialized():
        return None
    if isinstance(group, str):  # WORLD
        group = dist.group.WORLD
    return group if dist.get_world_size(group) > 1 else None


# --------------------------------------------------------------------------- the reduction
def reduce_amax(amax: torch.Tensor, groups) -> torch.Tensor:
    """The max of a 0-d float32 ``amax`` over every process of ``groups`` (a
    ``ProcessGroup`` or a sequence of them, reduced one after the other),
    on the device; NaN anywhere gives inf (non-finite, never recorded, as
    the NaN a single process would see; a collective's MAX need not
    propagate NaN)."""
    a = torch.where(torch.isnan(amax), float("inf"), amax.to(torch.float32))
    for group in (groups if isinstance(groups, (list, tuple)) else (groups,)):
        dist.all_reduce(a, op=dist.ReduceOp.MAX, group=group)
    return a


def local_amax(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``max(|x|)`` of a 2-D tensor in float32 (0-d): the quantize kernel in
    its amax-only mode where the kernels serve x's device (``scale`` is any
    float32 scalar there, unused), the reference elsewhere."""
    if x.numel() and extension.kernels_for(x) is not None:
        return ops.quantize(x, scale.reshape(()), ref.E4M3, False, False, False)[2]
    return ref.amax(x)


def scale_for(scaling, amax, history, scale, fp8_dtype, margin, algo, record):
    """The scale to quantize with, given the tensor's (global) ``amax``;
    with ``record``, the state update of a training call, in place: the
    rules of ``reference.quantize_delayed`` / ``quantize_current`` with the
    amax supplied instead of computed."""
    if scaling == "delayed":
        scale_used = ref.delayed_scale_used(amax, history, scale, fp8_dtype, margin)
        if record:
            scale.copy_(scale_used.reshape(scale.shape))
            ops.record_amax(history, scale, amax, fp8_dtype, margin, algo, False)
        return scale_used
    scale_used = ref.compute_scale(amax, scale, fp8_dtype, margin)
    if record:
        scale.copy_(scale_used.reshape(scale.shape))
    return scale_used


def quantize_global(scaling, x, history, scale, fp8_dtype, margin, algo, transpose, record, write_q, group):
    """The FP8 linear's quantize with the amax MAX-reduced over ``group`` first:
    ``(q, q_t, scale_used, amax)`` in the GEMM-ready layouts, ``amax`` the
    group's."""
    a = reduce_amax(local_amax(x, scale), group)
    scale_used = scale_for(scaling, a, history, scale, fp8_dtype, margin, algo, record)
    q, qt, _ = ops.quantize(x, scale_used, fp8_dtype, transpose, True, write_q)
    return q, qt, scale_used, a


# --------------------------------------------------------------------------- DDP
def mark_amax_channel(tensor: torch.Tensor) -> torch.Tensor:
    """Marks a parameter whose gradient is an amax, not a gradient (a Keras
    FP8 layer's ``grad_amax_pending``), for ``prepare_ddp``. Returns it."""
    setattr(tensor, _CHANNEL_MARK, True)
    return tensor


def is_amax_channel(tensor) -> bool:
    """Whether ``mark_amax_channel`` marked ``tensor``."""
    return bool(getattr(tensor, _CHANNEL_MARK, False))


def amax_channel_names(module: torch.nn.Module) -> list[str]:
    """The names DDP may give the amax channels of ``module``: their
    qualified names, and ``f"{module_name}.{name}"`` for every module that
    holds one (DDP's reducer names a parameter after each module holding it;
    a Keras model holds its variables at several levels)."""
    names = [name for name, p in module.named_parameters() if is_amax_channel(p)]
    for module_name, m in module.named_modules():
        for name, p in m.named_parameters(recurse=False):
            if is_amax_channel(p) and f"{module_name}.{name}" not in names:
                names.append(f"{module_name}.{name}")
    return names


def prepare_ddp(module: torch.nn.Module) -> list[str]:
    """Tells ``DistributedDataParallel`` to leave ``module``'s amax channels alone.

    Call it before wrapping ``module`` in DDP. The parameters that carry an
    amax as their gradient (the Keras FP8 layers' ``grad_amax_pending``,
    already MAX-reduced over the amax reduction group in the backward) are
    then not averaged by DDP, whose average of equal values over more than
    two processes can round; nor synced by DDP at construction (every
    process starts them at zero). A model without amax channels (torch_ops
    ``FP8Linear`` layers record the gradient amax in the backward) is left
    as it is.

    Uses ``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``
    (PyTorch has no public way to name parameters DDP must skip); names
    already on the module's ignore list stay on it.

    Args:
        module: The model to be wrapped.

    Returns:
        The names excluded.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module: expected a torch.nn.Module, got {type(module).__name__}")
    from torch.nn.parallel import DistributedDataParallel

    names = amax_channel_names(module)
    ignored = list(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
    if names:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            module, ignored + [n for n in names if n not in ignored])
    return names
