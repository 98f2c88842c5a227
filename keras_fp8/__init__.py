"""keras-fp8: real FP8 training for Keras 3 (torch and JAX backends).

`import keras_fp8` registers the FP8 dtype policies with Keras, so that

    keras.mixed_precision.set_global_policy("fp8_hybrid")

just works: every `keras.layers.Dense` / `EinsumDense` built under it (in any
model, keras_hub's included) becomes an FP8 layer (E4M3 forward, E5M2 output
gradient, delayed scaling), as `FP8Dense`/`FP8EinsumDense` are, and every
other layer runs as under `mixed_bfloat16`.
"""

import importlib.util as _importlib_util
import json as _json
import os as _os
import sys as _sys


def _default_backend_if_unusable():
    """Picks torch (else JAX) when Keras's configured backend is not installed.

    Keras falls back to TensorFlow when neither `KERAS_BACKEND` nor
    `keras.json` names a backend; keras-fp8 supports torch and JAX, so a bare
    `import keras_fp8` on a machine without TensorFlow would otherwise fail.
    An explicit, installed choice is never overridden.
    """
    if "keras" in _sys.modules or "KERAS_BACKEND" in _os.environ:
        return
    home = _os.environ.get("KERAS_HOME") or _os.path.join(
        _os.path.expanduser("~"), ".keras"
    )
    configured = "tensorflow"
    try:
        with open(_os.path.join(home, "keras.json")) as f:
            configured = _json.load(f).get("backend", configured)
    except (OSError, ValueError):
        pass
    if configured == "numpy" or _importlib_util.find_spec(configured):
        return
    for candidate in ("torch", "jax"):
        if _importlib_util.find_spec(candidate):
            _os.environ["KERAS_BACKEND"] = candidate
            return


def _check_backend_installed():
    """A clear error when `KERAS_BACKEND` names a supported backend whose
    package is not installed (Keras's own is a ModuleNotFoundError from
    deep inside its import)."""
    if "keras" in _sys.modules:
        return
    backend = _os.environ.get("KERAS_BACKEND")
    if backend in ("torch", "jax") and not _importlib_util.find_spec(backend):
        raise ModuleNotFoundError(
            f"KERAS_BACKEND={backend}, but the {backend} package is not installed. "
            f'Install it with: pip install "keras-fp8[{backend}]"',
            name=backend,
        )


_default_backend_if_unusable()
_check_backend_installed()

import keras as _keras  # noqa: E402

from keras_fp8 import autocast as _autocast_module  # noqa: E402
from keras_fp8 import backends as _backends
from keras_fp8 import callbacks
from keras_fp8 import compat as _compat
from keras_fp8 import compilation as _compilation
from keras_fp8 import layers
from keras_fp8 import monitor
from keras_fp8 import numerics
from keras_fp8 import optimizers
from keras_fp8 import policy as _policy_module
from keras_fp8 import policy_layers as _policy_layers
from keras_fp8 import recipes
from keras_fp8.autocast import autocast
from keras_fp8.backends import xla_flags as _xla_flags
from keras_fp8.compilation import compile_blocks
from keras_fp8.compilation import compile_optimizer
from keras_fp8.convert import convert
from keras_fp8.convert import unconvert
from keras_fp8.inspection import summary
from keras_fp8.layers import FP8Dense
from keras_fp8.layers import FP8EinsumDense
from keras_fp8.policy import FP8DTypePolicy
from keras_fp8.policy import POLICY_NAMES
from keras_fp8.recipes import BlockScaling
from keras_fp8.recipes import CurrentScaling
from keras_fp8.recipes import DelayedScaling

__version__ = "0.1.0"

_compat.check_keras_version()
_xla_flags.configure(_keras.backend.backend())
_policy_module.register()
_autocast_module.register()
optimizers.register()
_policy_layers.register()
_backends.preload()
_compilation.register()

__all__ = [
    "BlockScaling",
    "CurrentScaling",
    "DelayedScaling",
    "FP8DTypePolicy",
    "FP8Dense",
    "FP8EinsumDense",
    "POLICY_NAMES",
    "autocast",
    "callbacks",
    "compile_blocks",
    "compile_optimizer",
    "convert",
    "layers",
    "monitor",
    "numerics",
    "optimizers",
    "recipes",
    "summary",
    "unconvert",
]
