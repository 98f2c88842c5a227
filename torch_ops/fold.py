"""Folding a pending output-gradient amax into the gradient's scaling state.

keras_fp8 returns the output gradient's amax through the gradient channel (a
`(3,)` "pending" variable `[amax, token, loss_scale]` that the optimizer
overwrites) instead of writing it from inside the backward pass. The next
training forward folds it in: `fold_pending_grad_amax` does that in one CUDA
launch on an FP8 GPU, and with the pure-torch reference below elsewhere.

Meaning of the state (`keras_fp8/layers/fp8_state.py` has the full story):
- `pending = [amax, token, loss_scale]`: the last backward's amax, the token
  it emitted (> 0), the fp16 loss scale in effect (0: none);
- `fold_state = [folds, last_token, last_loss_scale]`.

A pending value is folded once: only when its token is > 0 and differs from
`last_token`. A changed loss scale first rescales the history and the scale
by `loss_scale / last_loss_scale`. A finite, positive amax is recorded at
`history[0]`; the scale becomes `(window * f32(1/fmt_max)) * f32(2**-margin)`
when the window is finite and positive (delayed scaling only).
"""

from __future__ import annotations

import torch

from . import _build
from . import _ops
from . import emulation as emu

FOLD_COUNT_PERIOD = 2.0**20
_ALGOS = ("max", "most_recent")


@torch.no_grad()
def _fold_reference(pending, fold_state, history, scale, fp8_dtype, margin, algo, window, update_scale):
    amax, token, loss_scale = pending[0], pending[1], pending[2]
    folds, last_token, last_loss_scale = fold_state[0], fold_state[1], fold_state[2]
    one = torch.ones_like(loss_scale)
    rescale = torch.where(
        (loss_scale > 0) & (last_loss_scale > 0),
        loss_scale / torch.clamp_min(last_loss_scale, 1e-30),
        one,
    )
    history.mul_(rescale)
    scale.mul_(rescale)
    new_last_loss_scale = torch.where(loss_scale > 0, loss_scale, last_loss_scale)
    fresh = (token > 0) & (token != last_token)
    record = fresh & torch.isfinite(amax) & (amax > 0)
    history.copy_(torch.where(record, emu._shifted(history, amax), history))
    if update_scale:
        w = history[0] if algo == "most_recent" else history[:window].amax()
        new_scale = emu.compute_scale(w, scale, fp8_dtype, margin)
        scale.copy_(torch.where(fresh, new_scale, scale.reshape(())).reshape(scale.shape))
    new_folds = torch.where(fresh, torch.remainder(folds + 1.0, FOLD_COUNT_PERIOD), folds)
    fold_state.copy_(torch.stack([new_folds, torch.where(fresh, token, last_token), new_last_loss_scale]))
    return new_folds + 1.0, scale.reshape(()).clone(), history.clone()


def _fold_impl(
    pending: torch.Tensor,
    fold_state: torch.Tensor,
    history: torch.Tensor,
    scale: torch.Tensor,
    fp8_dtype: torch.dtype,
    margin: float,
    algo: str,
    window: int,
    update_scale: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if _ops._use_kernel(pending):
        inv_max = emu.f32(1.0 / emu.fp8_max(fp8_dtype))
        return tuple(
            _build.load().fold_grad_amax(
                pending, fold_state, history, scale, inv_max, _ops._mdiv(margin), _ALGOS.index(algo), window,
                update_scale,
            )
        )
    return _fold_reference(pending, fold_state, history, scale, fp8_dtype, margin, algo, window, update_scale)


# The registered op (what torch.compile traces) is _fold_impl itself.
fold_grad_amax_op = torch.library.custom_op(
    "torch_ops::fold_grad_amax", mutates_args=("fold_state", "history", "scale"))(_fold_impl)


@fold_grad_amax_op.register_fake
def _(pending, fold_state, history, scale, fp8_dtype, margin, algo, window, update_scale):
    return pending.new_empty(()), pending.new_empty(()), history.new_empty(history.shape)


def check_channel(pending, fold_state):
    """Raises a ValueError naming `pending` or `fold_state` unless each is a
    float32 tensor of shape (3,)."""
    for name, t in (("pending", pending), ("fold_state", fold_state)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.shape != (3,):
            raise ValueError(f"{name}: expected a float32 tensor of shape (3,), got "
                             f"{getattr(t, 'dtype', type(t))} {tuple(getattr(t, 'shape', ()))}")


def fold_pending_grad_amax(
    pending: torch.Tensor,
    fold_state: torch.Tensor,
    amax_history: torch.Tensor,
    scale: torch.Tensor,
    fp8_dtype: torch.dtype,
    *,
    margin: float = 0.0,
    amax_compute_algo: str = "max",
    window: int | None = None,
    update_scale: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Folds a pending gradient amax into the gradient state, in place.

    Args:
        pending: `(3,)` float32 `[amax, token, loss_scale]` (read only).
        fold_state: `(3,)` float32 `[folds, last_token, last_loss_scale]`,
            updated in place.
        amax_history: `(H,)` float32 gradient amax history (newest first),
            updated in place.
        scale: 0-d (or one-element) float32 gradient scale, updated in place.
        fp8_dtype: The gradient's FP8 dtype (`torch.float8_e5m2` for the
            hybrid format).
        margin: Scale margin (the scale is multiplied by `2**-margin`).
        amax_compute_algo: `"max"` (over the window) or `"most_recent"`.
        window: How many of the newest entries the `"max"` reduces over
            (default: all `H`).
        update_scale: False leaves the scale alone apart from a loss-scale
            rescale (current scaling).

    Returns:
        `(token, scale_snapshot, history_snapshot)`: the 0-d token this
        call's backward should emit (`folds + 1`), and copies of the new
        scale (0-d) and history, which stay valid when the state is folded
        again before this call's backward runs.

    Example:

    >>> pending = torch.tensor([3.0, 1.0, 0.0])
    >>> fold_state = torch.zeros(3)
    >>> history, scale = torch.zeros(16), torch.ones(())
    >>> token, s, h = fold_pending_grad_amax(
    ...     pending, fold_state, history, scale, torch.float8_e5m2)
    >>> float(history[0]), float(token)
    (3.0, 2.0)
    """
    if amax_compute_algo not in _ALGOS:
        raise ValueError(f"amax_compute_algo: expected one of {_ALGOS}, got {amax_compute_algo!r}")
    check_channel(pending, fold_state)
    if amax_history.dim() != 1 or amax_history.dtype != torch.float32 or amax_history.numel() < 1:
        raise ValueError(f"amax_history: expected a non-empty 1-D float32 tensor, got "
                         f"{amax_history.dtype} {tuple(amax_history.shape)}")
    if scale.numel() != 1 or scale.dtype != torch.float32:
        raise ValueError(f"scale: expected one float32 element, got {scale.dtype} {tuple(scale.shape)}")
    window = amax_history.numel() if window is None else int(window)
    if window < 1:
        raise ValueError(f"window: expected >= 1, got {window}")
    emu.fp8_max(fp8_dtype)  # checks fp8_dtype
    pending = pending.detach()
    args = (pending, fold_state, amax_history, scale, fp8_dtype, float(margin), amax_compute_algo, window,
            bool(update_scale))
    if _ops._plain(*args[:4]):
        return _fold_impl(*args)
    return torch.ops.torch_ops.fold_grad_amax(*args)
