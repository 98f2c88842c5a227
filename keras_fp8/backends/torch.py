"""FP8 matmuls for the torch backend: `torch_ops`, on every device.

An FP8 layer's matmul is `torch_ops.fp8_linear` on the layer's own variables
(their tensors are the op's state, updated in place: no copies, no host
sync), with the layer's `torch_ops.LinearConfig` (`linear_config`, made once
per layer and recipe). On the GPUs the compiled kernels serve, an eager call
is one C++ call; under torch.compile (`jit_compile=True`) and on every other
device the `torch.library` ops run, over the kernels or over torch_ops's
exact reference (which is tested bit for bit against `keras_fp8.numerics`).
Eager and compiled training therefore run the same ops on the same state.
"""

import re

import torch
import torch_ops
from torch_ops import extension as torch_ops_extension

from keras_fp8 import compat
from keras_fp8.backends import torch_producers


def _kernels_for(x):
    """torch_ops's extension where its kernels serve `x`'s device, else None
    (a one-time warning on a CUDA GPU they cannot serve)."""
    return torch_ops_extension.kernels_for(x)


def prepare_device(tensor):
    """Settles (and caches) whether the compiled kernels serve `tensor`'s
    device: the capability check, the build and the one-time warning run
    here, when a layer builds, not inside a call torch.compile traces. Also
    routes keras_hub's producers through the fused ones (compat patch 12)."""
    _kernels_for(tensor)
    torch_producers.install()


def mark_amax_channel(variable):
    """See `keras_fp8.backends`: marks the variable's torch Parameter for
    `torch_ops.distributed.prepare_ddp` (where it exists yet)."""
    value = compat.raw_value(variable)
    if isinstance(value, torch.Tensor):
        torch_ops.distributed.mark_amax_channel(value)


def reduces_amaxes():
    """See `keras_fp8.backends`: whether an amax reduction group of more
    than one process is in effect (`torch_ops.distributed`); torch_ops then
    runs an empty training call through the reductions, contributing zero."""
    return torch_ops.distributed.reduction_group() is not None


def default_min_gemm_size(x):
    """See `keras_fp8.backends`: torch_ops's setting for `x`'s device."""
    return torch_ops.get_settings().resolved_min_gemm_size(_kernels_for(x) is not None)


def linear_config(recipe, min_gemm_size, kernel_layout="in_out"):
    """See `keras_fp8.backends`: the `torch_ops.LinearConfig` of a Keras
    layer's matmul under `recipe` (a Keras kernel is `(K, N)`: "in_out"; a
    tied embedding's projection reads the `(N, K)` embeddings: "out_in";
    the gradient channel's fold reduces the recipe's history length)."""
    return torch_ops.LinearConfig(
        fp8_format=recipe.fp8_format,
        scaling=recipe.name,
        margin=recipe.margin,
        amax_compute_algo=getattr(recipe, "amax_compute_algo", "max"),
        fold_window=getattr(recipe, "history_len", None),
        power_of_two=getattr(recipe, "power_of_two", False),
        weight_layout=kernel_layout,
        min_gemm_size=min_gemm_size,
        share_quantized_inputs=recipe.share_quantized_inputs,
        fuse_producers=getattr(recipe, "fuse_producers", False),
        requantize_weight_in_backward=recipe.requantize_weight_in_backward,
    )


def _variable_reader():
    """How to read the layer's variables in this call, in their own dtype.

    Outside a stateless scope a Keras torch variable's value is its `_value`
    tensor, cast by `.value` only when it autocasts; reading it directly skips
    `.value`'s checks (host time). Inside one (e.g. `stateless_call`), the
    scope holds the values.
    """
    return compat.raw_value if compat.in_stateless_scope() else compat.stored_value


def fp8_matmul(layer, x, kernel, bias, config, training, kernel_layout="in_out", source=None):
    """See `keras_fp8.backends`: `torch_ops.fp8_linear` on the layer's FP8
    state variables (the gradient channel included), whose bias is added in
    x's dtype (fused into the GEMM). `bias` is the layer's bias variable or
    a tensor made from it (`FP8EinsumDense`'s bias as the GEMM's columns).
    The kernel's layout is `config`'s (`linear_config`, made with the
    layer's `kernel_layout`). `source` is not needed: torch_ops finds the
    tensor a view `x` was made from itself (`torch_ops.sharing`)."""
    value = _variable_reader()
    state = torch_ops.FP8LinearState(
        value(layer.input_scale),
        value(layer.input_amax_history),
        value(layer.kernel_scale),
        value(layer.kernel_amax_history),
        value(layer.grad_scale),
        value(layer.grad_amax_history),
        grad_amax_pending=value(layer.grad_amax_pending),
        grad_fold_state=value(layer.grad_fold_state),
    )
    if bias is not None and not isinstance(bias, torch.Tensor):
        bias = value(bias)
    return torch_ops.fp8_linear(x, kernel, bias, state, config, bool(training))


# --------------------------------------------------------------------------- what the backward keeps
def _op_name(node):
    """An autograd node's op: `MulBackward0` -> `Mul`, a custom function's
    `_FP8LinearBackward` -> `_FP8Linear`."""
    return re.sub(r"Backward\d*$", "", node.name()) or node.name()


def _saving_ops(root, opened):
    """`{saved index: op name}` for every tensor the autograd graph behind
    `root` keeps for its backward: each node's saved tensors are read (each
    read calls the unpack hook, which appends the tensor's index to
    `opened`). Nodes that `root` does not reach are freed with their
    outputs: what they saved is not kept."""
    found = {}
    seen = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names = [a for a in dir(node) if a.startswith("_saved_")]
        if hasattr(node, "saved_tensors"):
            names.append("saved_tensors")
        op = _op_name(node)
        for name in names:
            opened.clear()
            try:
                getattr(node, name)
            except RuntimeError:
                continue  # e.g. a tensor saved as None, or already freed
            for index in opened:
                found.setdefault(index, op)
        stack.extend(next_node for next_node, _ in node.next_functions)
    opened.clear()
    return found


def saved_for_backward(loss_fn, trainable_values, other_values):
    """See `keras_fp8.backends`: one forward under
    `torch.autograd.graph.saved_tensors_hooks`, which records every tensor an
    op saves for the backward with the name-scope path of the layer call
    running (`compat.current_scope_path`); a tensor of `inputs` is kept
    where a saved tensor of the graph behind the loss shares its storage
    (the storage stays allocated as long as any of its tensors is held).
    The other values (FP8 state) are copied: torch_ops updates FP8 state in
    place."""
    table = []  # (saved tensor, scope path), by the index its hook returned
    opened = []

    def pack(tensor):
        table.append((tensor, compat.current_scope_path()))
        return len(table) - 1

    def unpack(index):
        opened.append(index)
        return table[index][0]

    others = [v.detach().clone() if isinstance(v, torch.Tensor) else v for v in other_values]
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            loss, inputs = loss_fn(list(trainable_values), others)
        saving = _saving_ops(loss.grad_fn, opened) if loss.grad_fn is not None else {}
        by_storage = {}
        for index, op in saving.items():
            tensor, path = table[index]
            storage = tensor.untyped_storage()
            if storage.nbytes():
                by_storage.setdefault((tensor.device, storage.data_ptr()), set()).add((path, op))
        report = []
        for x in inputs:
            savers = by_storage.get((x.device, x.untyped_storage().data_ptr()), set()) if x.numel() else set()
            report.append((tuple(x.shape), str(x.dtype).replace("torch.", ""), x.numel() * x.element_size(),
                           sorted(savers)))
        return report
    finally:
        # The hooks' closures hold `table`, the graph's nodes hold the hooks:
        # emptied, the graph and its tensors are freed with `loss`.
        table.clear()
