"""LinearConfig: the settings of one FP8 linear, validated once.

Made once per layer (``FP8Linear`` builds one from its arguments, a Keras
layer on the torch backend one per recipe) and passed whole to
``fp8_linear``, to its autograd Functions and, as a small struct, to the
C++ eager entry. Nothing downstream validates a setting again.

Example:

>>> config = LinearConfig(fp8_format="e4m3", scaling="current", margin=1.0)
>>> config.grad_dtype
torch.float8_e4m3fn
"""

from __future__ import annotations

import dataclasses

import torch

from . import reference as ref
from . import settings as settings_lib

SCALINGS = ("delayed", "current", "block")
WEIGHT_LAYOUTS = ("out_in", "in_out")


def _check_bool(name, value):
    if not isinstance(value, bool):
        raise ValueError(f"{name}: expected a bool, got {value!r}")


@dataclasses.dataclass(frozen=True)
class LinearConfig:
    """How an FP8 linear quantizes, scales and multiplies.

    Args:
        fp8_format: ``"hybrid"`` (E4M3 forward, E5M2 output gradient) or
            ``"e4m3"`` (E4M3 both ways).
        scaling: ``"delayed"`` (scales from the amax histories),
            ``"current"`` (each tensor's own amax; a training call stores the
            scale it used, and the state's scale is the fallback for a tensor
            of zeros) or ``"block"`` (a scale per 1 x 128 tile of x and of the
            output gradient, per 128 x 128 block of the weight, each from its
            own values; the state is left as it is).
        margin: Scale margin, a number from 0 to 8 (docs/numerics.md).
        amax_compute_algo: ``"max"`` over the history or ``"most_recent"``.
        fold_window: How many of the newest gradient-history entries the
            gradient channel's fold reduces with ``"max"`` (None: all; only
            read where the state carries a gradient channel).
        power_of_two: Block scaling only: round each tile's scale up to a
            power of two.
        fast_accum_forward, fast_accum_dgrad, fast_accum_wgrad: Whether the
            forward GEMM, the input-gradient GEMM and the weight-gradient
            GEMM use cuBLASLt's fast FP8 accumulation (per-tensor scaling on
            the kernels; the reference accumulates in float32 either way).
        weight_layout: ``"out_in"`` (``(N, K)``, as ``nn.Linear``) or
            ``"in_out"`` (``(K, N)``, a Keras kernel; no transposed copy).
        min_gemm_size: ``M*N*K`` below which a call runs the compute-dtype
            linear and leaves the state alone (None: ``torch_ops.
            get_settings()``'s, resolved for the call's device).
        share_quantized_inputs: Whether a call may take the FP8 copy of x
            that an earlier linear made of the same tensor, with the same
            settings, instead of quantizing x again (``torch_ops.sharing``;
            docs/numerics.md, "One quantize per tensor"). False: this call
            quantizes x itself and leaves nothing to share.
        fuse_producers: Whether a call that quantizes x itself links a fused
            producer that made x (``torch_ops.producers``: a norm or gated
            activation), which then quantizes its next output for this
            linear in the same pass (delayed scaling with sharing only;
            docs/numerics.md, "Fused producers"). The same bits either way.
        requantize_weight_in_backward: Whether the backward quantizes the
            weight again (with the scale the forward used: the same bytes)
            instead of keeping its FP8 copy from the forward: one byte per
            weight element less held until the backward, one more weight
            quantize per backward. Calls with it run the ops route (not the
            C++ entry). The same bits either way.

    Raises:
        ValueError: naming the first field that is not one of its accepted
            values, what was expected and what was given.
    """

    fp8_format: str = "hybrid"
    scaling: str = "delayed"
    margin: float = 0.0
    amax_compute_algo: str = "max"
    fold_window: int | None = None
    power_of_two: bool = False
    fast_accum_forward: bool = True
    fast_accum_dgrad: bool = False
    fast_accum_wgrad: bool = False
    weight_layout: str = "out_in"
    min_gemm_size: int | None = None
    share_quantized_inputs: bool = True
    fuse_producers: bool = True
    requantize_weight_in_backward: bool = False

    def __post_init__(self):
        if self.fp8_format not in ref.FP8_FORMATS:
            raise ValueError(f"fp8_format: expected one of {tuple(ref.FP8_FORMATS)}, got {self.fp8_format!r}")
        if self.scaling not in SCALINGS:
            raise ValueError(f"scaling: expected one of {SCALINGS}, got {self.scaling!r}")
        object.__setattr__(self, "margin", ref.check_margin(self.margin))
        if self.amax_compute_algo not in ref.AMAX_COMPUTE_ALGOS:
            raise ValueError(f"amax_compute_algo: expected one of {ref.AMAX_COMPUTE_ALGOS}, "
                             f"got {self.amax_compute_algo!r}")
        window = self.fold_window
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"fold_window: expected None or an integer >= 1, got {window!r}")
        _check_bool("power_of_two", self.power_of_two)
        if self.power_of_two and self.scaling != "block":
            raise ValueError(f"power_of_two: applies to scaling='block' only, got scaling={self.scaling!r}")
        for name in ("fast_accum_forward", "fast_accum_dgrad", "fast_accum_wgrad"):
            _check_bool(name, getattr(self, name))
        if self.weight_layout not in WEIGHT_LAYOUTS:
            raise ValueError(f"weight_layout: expected one of {WEIGHT_LAYOUTS}, got {self.weight_layout!r}")
        settings_lib.check_min_gemm_size(self.min_gemm_size)
        _check_bool("share_quantized_inputs", self.share_quantized_inputs)
        _check_bool("fuse_producers", self.fuse_producers)
        _check_bool("requantize_weight_in_backward", self.requantize_weight_in_backward)

    @property
    def forward_dtype(self) -> torch.dtype:
        """The FP8 dtype of x and the weight."""
        return ref.FP8_FORMATS[self.fp8_format][0]

    @property
    def grad_dtype(self) -> torch.dtype:
        """The FP8 dtype of the output gradient."""
        return ref.FP8_FORMATS[self.fp8_format][1]

    @property
    def in_out(self) -> bool:
        """Whether the weight is stored ``(K, N)``."""
        return self.weight_layout == "in_out"

    def replace(self, **changes) -> "LinearConfig":
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)


DEFAULT_CONFIG = LinearConfig()
