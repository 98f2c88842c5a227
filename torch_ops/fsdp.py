"""FP8 all-gather for FSDP2 (``torch.distributed.fsdp.fully_shard``).

Without it, FSDP2 all-gathers each ``FP8Linear`` weight in its own dtype (2
or 4 bytes per element) and the layer quantizes the gathered weight. With
``enable_fp8_all_gather(model)`` (before ``fully_shard``), each weight
becomes an ``FP8AllGatherWeight``: FSDP2's all-gather extension hooks
quantize the local shard with the weight's global scale before the
all-gather, which then moves 1 byte per element, and hand the layer an
``FP8GatheredWeight`` (the gathered E4M3 bytes and their scale) that feeds
the GEMM directly.

The scale is the one the layer would have used on the whole weight: the
amax is the max over the shards (an all-reduce over FSDP's shard mesh), the
delayed or current rule of the layer's recipe applies to it, and a training
forward's gather records it in the layer's ``kernel_amax_history`` /
``kernel_scale`` (the layer's forward then records nothing for the weight).
So the FP8 state and the quantized weight are bit for bit those of FSDP2
without FP8 all-gather, and those of one process. A gather inside a backward
(FSDP2 re-gathers what it resharded after the forward; a recomputed forward)
records nothing and quantizes with the state's scale, as a recomputed
forward does without FSDP. With a ``MixedPrecisionPolicy(param_dtype=...)``
the shard is cast to that dtype before it is quantized, as FSDP2 casts it
before its own all-gather.

Example:

>>> model = torch_ops.convert_to_fp8(model)
>>> torch_ops.fsdp.enable_fp8_all_gather(model)
>>> for block in model.blocks:
...     fully_shard(block)
>>> fully_shard(model)
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from . import distributed
from . import ops
from . import reference as ref
from .gathered import FP8GatheredWeight
from .gathered import in_backward
from .gathered import wrapper_subclass
from .module import FP8Linear

E4M3 = ref.E4M3

# Ops FSDP2 (and module moves) apply to the sharded weight that must return
# the subclass, so that the shard keeps its all-gather hooks.
_aten = torch.ops.aten
_KEEP_SUBCLASS = {
    _aten.detach.default, _aten.alias.default, _aten.split.Tensor, _aten.split_with_sizes.default,
    _aten.slice.Tensor, _aten.narrow.default, _aten.new_zeros.default, _aten.new_empty.default,
    _aten.new_empty_strided.default, _aten.empty_like.default, _aten.zeros_like.default, _aten.copy_.default,
    _aten.view.default, _aten._unsafe_view.default, _aten.as_strided.default, _aten._to_copy.default,
    _aten.clone.default, _aten._pin_memory.default,
}


class FP8AllGatherWeight(torch.Tensor):
    """An ``FP8Linear`` weight whose FSDP2 all-gather moves FP8 bytes.

    Behaves as the high-precision tensor it wraps (``_tensor``: what the
    optimizer updates and checkpoints hold); FSDP2 calls its
    ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` hooks.
    """

    @staticmethod
    def __new__(cls, tensor: torch.Tensor):
        return wrapper_subclass(cls, tensor)

    def __init__(self, tensor: torch.Tensor):
        self._tensor = tensor

    def __repr__(self):
        return f"FP8AllGatherWeight({self._tensor!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is _aten.detach.default:
            return cls(args[0]._tensor.detach())
        args, kwargs = pytree.tree_map_only(cls, lambda t: t._tensor, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _KEEP_SUBCLASS:
            return out
        return pytree.tree_map_only(torch.Tensor, cls, out)

    def __tensor_flatten__(self):
        return ["_tensor"], None

    @staticmethod
    def __tensor_unflatten__(inner_tensors, meta, outer_size, outer_stride):
        return FP8AllGatherWeight(inner_tensors["_tensor"])

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """The shard in E4M3 (padded to FSDP2's padded shard, as bytes) and
        the scale it was quantized with."""
        if not isinstance(module, FP8Linear):
            raise TypeError(f"FP8AllGatherWeight: expected to be the weight of an FP8Linear, got one of "
                            f"{type(module).__name__}")
        shard = self._tensor
        param_dtype = getattr(mp_policy, "param_dtype", None)
        if param_dtype is not None:
            shard = shard.to(param_dtype)
        state = module.fp8_state()
        record = module.training and not in_backward()
        shard2d = shard.reshape(-1, outer_size[-1])
        a = distributed.reduce_amax(distributed.local_amax(shard2d, state.kernel_scale), mesh.get_group())
        scale_used = distributed.scale_for(module.scaling, a, state.kernel_amax_history, state.kernel_scale, E4M3,
                                           module.margin, module.amax_compute_algo, record)
        if shard2d.numel():
            q = ops.quantize(shard2d, scale_used, E4M3, False, False, True)[0]
        else:  # an empty shard (more processes than rows)
            q = shard2d.new_empty(shard2d.shape, dtype=E4M3)
        padded_rows = -(-outer_size[0] // mesh.size())
        if q.shape[0] != padded_rows:  # an uneven last shard: zero rows up to FSDP2's padded shard
            q = torch.cat([q, q.new_zeros((padded_rows - q.shape[0], q.shape[1]))])
        return (q.view(torch.uint8),), (scale_used,)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        """The gathered bytes as an ``FP8GatheredWeight`` (FSDP2 narrows it to
        the weight's shape), or ``out`` given the new scale."""
        (data,) = all_gather_outputs
        (scale,) = metadata
        if out is not None:
            out._scale = scale
            return None
        return FP8GatheredWeight(data.view(E4M3), scale, param_dtype), (data,)


def enable_fp8_all_gather(module: torch.nn.Module) -> list[str]:
    """Makes FSDP2 all-gather the weights of ``module``'s ``FP8Linear`` layers in FP8.

    Call it after ``convert_to_fp8`` and before ``fully_shard`` (and before
    building the optimizer: each weight Parameter is replaced by one over
    the same values).

    Args:
        module: A model, or one ``FP8Linear``.

    Returns:
        The qualified names of the weights converted.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module: expected a torch.nn.Module, got {type(module).__name__}")
    names = []
    for name, m in module.named_modules():
        if isinstance(m, FP8Linear) and not isinstance(m.weight, FP8AllGatherWeight):
            w = m.weight
            if isinstance(w, _dtensor_type()):
                raise ValueError(f"{name or 'module'}: enable_fp8_all_gather must run before fully_shard")
            m.weight = torch.nn.Parameter(FP8AllGatherWeight(w.detach()), requires_grad=w.requires_grad)
            m.register_state_dict_post_hook(_plain_weight_in_state_dict)
            names.append(f"{name}.weight" if name else "weight")
    return names


def _plain_weight_in_state_dict(module, state_dict, prefix, local_metadata):
    """``state_dict`` holds the weight's values as a plain tensor (or a
    DTensor over one), not the subclass: checkpoints load anywhere,
    ``torch.load(weights_only=True)`` included. Loading copies into the
    subclass's values."""
    key = prefix + "weight"
    value = state_dict.get(key)
    if isinstance(value, FP8AllGatherWeight):
        state_dict[key] = value._tensor
    elif isinstance(value, _dtensor_type()) and isinstance(value._local_tensor, FP8AllGatherWeight):
        state_dict[key] = type(value).from_local(value._local_tensor._tensor, value.device_mesh, value.placements,
                                                 run_check=False, shape=value.shape, stride=value.stride())


def _dtensor_type():
    from torch.distributed.tensor import DTensor

    return DTensor
