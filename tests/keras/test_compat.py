"""keras_fp8.compat's own helpers (the Keras internals it wraps are tested
through the layers)."""

import keras
import pytest

from keras_fp8 import compat


@pytest.mark.parametrize("version, expected", [("3.15.1", (3, 15)), ("3.16rc0", (3, 16)), ("3.1\u00b2", (3, 1)),
                                               ("3.dev", (3, 0))])
def test_keras_version_reads_ascii_digits(monkeypatch, version, expected):
    monkeypatch.setattr(keras, "__version__", version)
    assert compat.keras_version() == expected


# ---------------------------------------------------------------- patch 9: the sparse cross-entropy on rows
torch_only = pytest.mark.skipif(keras.backend.backend() != "torch",
                                reason="patch 9 changes the torch backend's loss only")


def _torch_loss_functions():
    from keras.src.backend.torch import nn as torch_nn

    patched = torch_nn.sparse_categorical_crossentropy
    return patched, patched._keras_original


def _loss_and_logits_grad(loss_fn, target, logits, classes_at_1=False, **kwargs):
    import torch

    logits = torch.tensor(logits, requires_grad=True)
    output = logits.movedim(-1, 1).contiguous() if classes_at_1 else logits
    loss = loss_fn(torch.tensor(target), output, axis=1 if classes_at_1 else -1, **kwargs)
    weights = torch.linspace(0.5, 1.5, loss.numel(), dtype=loss.dtype).reshape(loss.shape)
    (loss * weights).sum().backward()
    return loss.detach().numpy(), logits.grad.numpy()


@torch_only
@pytest.mark.parametrize("from_logits", [True, False])
@pytest.mark.parametrize("shape", [(3, 5, 11), (2, 3, 4, 7), (4, 1, 6)])
def test_sparse_crossentropy_on_rows_equals_keras(from_logits, shape):
    import numpy as np

    patched, original = _torch_loss_functions()
    rng = np.random.default_rng(sum(shape) + from_logits)
    logits = rng.normal(0, 3, shape).astype("float32")
    if not from_logits:  # probabilities, not normalized (Keras normalizes them)
        logits = rng.uniform(0.01, 1.0, shape).astype("float32")
    target = rng.integers(0, shape[-1], shape[:-1])
    # Keras's own function on the logits as given, and on a contiguous copy
    # with the classes at axis 1 (the layout its `cross_entropy` wants; on
    # 4-D probabilities, Keras's own backward pass fails: "grad_input must be
    # contiguous").
    keras_fails = len(shape) == 4 and not from_logits
    for target_form in (target, target[..., None]):  # Keras squeezes a trailing 1
        got = _loss_and_logits_grad(patched, target_form, logits, from_logits=from_logits)
        wants = [_loss_and_logits_grad(original, target, logits, classes_at_1=True, from_logits=from_logits)]
        if not keras_fails:
            wants.append(_loss_and_logits_grad(original, target_form, logits, from_logits=from_logits))
        for want in wants:
            assert got[0].shape == want[0].shape == shape[:-1]
            np.testing.assert_allclose(got[0], want[0], rtol=1e-6, atol=1e-6)
            np.testing.assert_allclose(got[1], want[1], rtol=1e-6, atol=1e-7)


@torch_only
def test_sparse_crossentropy_takes_rows_for_3d_logits(monkeypatch):
    # The row path: `cross_entropy` sees (rows, classes), never the class
    # axis moved to position 1 (the "spatial" log-softmax).
    import numpy as np
    from keras.src.backend.torch import nn as torch_nn

    seen = []
    keras_cross_entropy = torch_nn.tnn.cross_entropy

    def cross_entropy(output, target, **kwargs):
        seen.append(tuple(output.shape))
        return keras_cross_entropy(output, target, **kwargs)

    monkeypatch.setattr(torch_nn.tnn, "cross_entropy", cross_entropy)
    rng = np.random.default_rng(0)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    loss(rng.integers(0, 9, (2, 3)), rng.normal(size=(2, 3, 9)).astype("float32"))
    keras.losses.sparse_categorical_crossentropy(rng.integers(0, 9, (4,)), rng.normal(size=(4, 9)).astype("float32"),
                                                 from_logits=True)
    assert seen == [(6, 9), (4, 9)]


@torch_only
@pytest.mark.parametrize("ignore_class", [None, 0])
@pytest.mark.parametrize("from_logits", [True, False])
def test_sparse_crossentropy_loss_with_weights_and_ignore_class(monkeypatch, ignore_class, from_logits):
    # Keras's loss object (ignore_class, sample weights, reduction) on top
    # of the patched backend function gives what it gives on Keras's own.
    import numpy as np
    import torch
    from keras.src.backend.torch import nn as torch_nn

    patched, original = _torch_loss_functions()
    rng = np.random.default_rng(7)
    shape = (3, 4, 10)
    logits = rng.normal(0, 2, shape).astype("float32") if from_logits else rng.uniform(0.05, 1, shape).astype("float32")
    target = rng.integers(0, 10, shape[:-1])
    target[0, :2] = 0  # ignored where ignore_class=0
    sample_weight = rng.uniform(0.1, 2.0, shape[:-1]).astype("float32")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=from_logits, ignore_class=ignore_class)

    def run(function):
        monkeypatch.setattr(torch_nn, "sparse_categorical_crossentropy", function)
        x = torch.tensor(logits, requires_grad=True)
        value = loss(torch.tensor(target), x, sample_weight=torch.tensor(sample_weight))
        value.backward()
        return value.detach().numpy(), x.grad.numpy()

    want, got = run(original), run(patched)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-6, atol=1e-8)


@torch_only
def test_sparse_crossentropy_rows_keep_kerass_errors_and_empty_batches():
    import numpy as np

    patched, _ = _torch_loss_functions()
    with pytest.raises(ValueError, match="must have the same shape"):
        patched(np.zeros((2, 4), "int64"), np.ones((2, 3, 5), "float32"), from_logits=True)
    empty = patched(np.zeros((0, 3), "int64"), np.ones((0, 3, 5), "float32"), from_logits=True)
    assert tuple(empty.shape) == (0, 3)
    # A class axis other than the last: Keras's own path.
    moved = patched(np.zeros((2, 3), "int64"), np.ones((2, 5, 3), "float32"), from_logits=True, axis=1)
    assert tuple(moved.shape) == (2, 3)
