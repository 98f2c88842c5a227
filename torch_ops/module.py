"""FP8Linear: an ``nn.Linear`` whose matmuls run through ``fp8_linear``.

For plain PyTorch models: the layer keeps its FP8 scaling state as float32
buffers (so ``state_dict`` checkpoints hold it and ``.to(device)`` moves it),
and ``convert_to_fp8`` swaps the ``nn.Linear`` layers of a model for it in
place, keeping their parameters.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import settings as settings_lib
from .config import LinearConfig
from .linear import COMPUTE_DTYPE
from .linear import STATE_NAMES
from .linear import FP8LinearState
from .linear import check_history_len
from .linear import linear_call


class FP8Linear(torch.nn.Linear):
    """``nn.Linear`` with FP8 GEMMs and delayed, current or block scaling.

    Forward and backward are ``torch_ops.fp8_linear`` (the compiled kernels on
    an FP8 GPU, the exact emulation elsewhere). The six state tensors of
    ``FP8LinearState`` are buffers of this module, kept in float32 whatever
    dtype the module is cast to, and moved with its weight. In ``train()``
    mode a call records the amaxes and publishes the next scales; in
    ``eval()`` mode it uses the current scales and records nothing.

    Args:
        in_features, out_features, bias, device, dtype: As in ``nn.Linear``.
        history_len: Length of each amax history (default 1024).
        fp8_format: ``"hybrid"`` (E4M3 forward, E5M2 gradient) or ``"e4m3"``.
        scaling: ``"delayed"``, ``"current"`` or ``"block"`` (1 x 128 tiles
            of x and the output gradient, 128 x 128 weight blocks, no state).
        margin: Scale margin (powers of two).
        amax_compute_algo: ``"max"`` or ``"most_recent"``.
        min_gemm_size: ``M*N*K`` below which a call runs exactly what
            ``nn.Linear`` runs and leaves the FP8 state alone (None:
            ``torch_ops.get_settings()``'s).
        power_of_two: Block scaling only: power-of-two tile scales.

    The FP8 arguments are kept as one ``LinearConfig``, ``layer.config``
    (validated once, here); each is also an attribute of the layer, and
    setting one replaces the config.

    Example:

    >>> layer = torch_ops.FP8Linear(64, 32)
    >>> y = layer(torch.randn(8, 64))
    >>> sorted(k for k in layer.state_dict() if "scale" in k)
    ['grad_scale', 'input_scale', 'kernel_scale']
    """

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None, *, history_len=1024,
                 fp8_format="hybrid", scaling="delayed", margin=0.0, amax_compute_algo="max", min_gemm_size=None,
                 power_of_two=False):
        config = LinearConfig(fp8_format=fp8_format, scaling=scaling, margin=margin,
                              amax_compute_algo=amax_compute_algo, power_of_two=power_of_two,
                              min_gemm_size=min_gemm_size)
        check_history_len(history_len)
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self._set_fresh_state(history_len, self.weight.device)
        self._compute_dtype_key = None
        self.config = config

    def _set_fresh_state(self, history_len, device):
        # Scales 1, empty histories: the state buffers and the object over them.
        state = FP8LinearState.create(history_len, device=device)
        for name, t in zip(STATE_NAMES, state.tensors()):
            self.register_buffer(name, t)
        self._state = state

    def _option(name, doc):  # noqa: N805 - builds the properties below
        def get(self):
            return getattr(self.config, name)

        def set_(self, value):
            self.config = self.config.replace(**{name: value})

        return property(get, set_, doc=doc)

    fp8_format = _option("fp8_format", "The ``LinearConfig`` field of that name (setting it replaces ``config``).")
    scaling = _option("scaling", "The ``LinearConfig`` field of that name (setting it replaces ``config``).")
    margin = _option("margin", "The ``LinearConfig`` field of that name (setting it replaces ``config``).")
    amax_compute_algo = _option("amax_compute_algo",
                                "The ``LinearConfig`` field of that name (setting it replaces ``config``).")
    min_gemm_size = _option("min_gemm_size",
                            "The ``LinearConfig`` field of that name (setting it replaces ``config``).")
    power_of_two = _option("power_of_two", "The ``LinearConfig`` field of that name (setting it replaces ``config``).")
    del _option

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, **kwargs) -> "FP8Linear":
        """An ``FP8Linear`` sharing ``linear``'s weight and bias Parameters
        (an optimizer holding them keeps working). ``kwargs``: the FP8
        arguments of the constructor."""
        if not isinstance(linear, torch.nn.Linear):
            raise TypeError(f"linear: expected a torch.nn.Linear, got {type(linear).__name__}")
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, linear.bias is not None, **kwargs)
        new.weight = linear.weight
        new.bias = linear.bias
        new._set_fresh_state(new.input_amax_history.shape[0], linear.weight.device)
        new.train(linear.training)
        return new

    def fp8_state(self) -> FP8LinearState:
        """The ``FP8LinearState`` over the state buffers as they are now
        (``load_state_dict`` copies into them; assigning a buffer replaces it)."""
        b = self._buffers
        if torch.compiler.is_compiling():  # no attribute writes in a traced graph
            return FP8LinearState(*(b[name] for name in STATE_NAMES))
        st = self._state
        if any(getattr(st, name) is not b[name] for name in STATE_NAMES):
            st = self._state = FP8LinearState(*(b[name] for name in STATE_NAMES))
        return st

    def _apply(self, fn, recurse=True):
        self._compute_dtype_key = None  # a cast or move changes what a call runs
        # The state stays float32 (a cast of the module must not round the
        # histories and scales) and follows the weight's device.
        saved = {name: self._buffers[name] for name in STATE_NAMES}
        for name in STATE_NAMES:
            self._buffers[name] = None
        try:
            super()._apply(fn, recurse)
        finally:
            device = self.weight.device
            history = saved["input_amax_history"]
            if history.is_meta and device.type != "meta":  # to_empty() from meta
                self._set_fresh_state(history.shape[0], device)
            else:
                for name, t in saved.items():
                    self._buffers[name] = t.to(device)  # the same tensor where it is already there
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b, config = self.weight, self.bias, self.config
        # A call like the last one that ran the compute dtype (the same
        # weight, bias, config and settings; a non-empty x of the same shape,
        # dtype and device) runs it again without deciding anew: the host
        # path of a small layer stays as short as nn.Linear's.
        key = self._compute_dtype_key
        if (key is not None and type(x) is torch.Tensor and key[0] is w and key[1] is b and x.shape == key[2]
                and x.dtype is key[3] and x.device == key[4] and key[5] is settings_lib.get_settings()
                and key[6] is config):
            return F.linear(x, w, b)
        y, route = linear_call(x, w, b, self.fp8_state(), config, self.training)
        if (route is COMPUTE_DTYPE and type(x) is torch.Tensor and x.numel() and w.dtype is x.dtype
                and (b is None or b.dtype is x.dtype) and not torch.compiler.is_compiling()):
            self._compute_dtype_key = (w, b, x.shape, x.dtype, x.device, settings_lib.get_settings(), config)
        return y

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, fp8_format={self.fp8_format!r}, scaling={self.scaling!r}, "
                f"history_len={self.input_amax_history.shape[0]}")


def convert_to_fp8(module: torch.nn.Module, *, filter_fn=None, **kwargs) -> torch.nn.Module:
    """Replaces the ``nn.Linear`` layers of ``module`` by ``FP8Linear`` in place.

    Each new layer shares its predecessor's weight and bias Parameters, so
    outputs are unchanged up to FP8 rounding and an optimizer built before
    the conversion keeps working.

    Args:
        module: The model (or a single ``nn.Linear``, which is returned
            converted).
        filter_fn: Optional ``fn(fully_qualified_name, linear) -> bool``;
            layers for which it returns False stay as they are (e.g. keep
            the output projection in bf16).
        **kwargs: The FP8 arguments of ``FP8Linear``.

    Returns:
        ``module`` (converted in place), or the new ``FP8Linear`` when
        ``module`` itself is an ``nn.Linear``.

    Example:

    >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    >>> model = torch_ops.convert_to_fp8(model, filter_fn=lambda name, m: m.out_features != 10)
    >>> [type(m).__name__ for m in model]
    ['FP8Linear', 'ReLU', 'Linear']
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module: expected a torch.nn.Module, got {type(module).__name__}")

    def wanted(name, m):
        return type(m) is torch.nn.Linear and (filter_fn is None or filter_fn(name, m))

    if wanted("", module):
        return FP8Linear.from_linear(module, **kwargs)
    converted = {}  # a layer used in two places stays one layer, with one state
    for name, parent in list(module.named_modules()):
        for child_name, child in list(parent.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if id(child) in converted or wanted(full, child):
                if id(child) not in converted:
                    converted[id(child)] = FP8Linear.from_linear(child, **kwargs)
                setattr(parent, child_name, converted[id(child)])
    return module
