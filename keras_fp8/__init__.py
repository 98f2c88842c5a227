"""keras-fp8: real FP8 training for Keras 3 (torch and JAX backends).

`import keras_fp8` registers the FP8 dtype policies with Keras, so that

    keras.mixed_precision.set_global_policy("fp8_hybrid")

just works: `FP8Dense`/`FP8EinsumDense` layers compute in FP8 (E4M3 forward,
E5M2 output gradient, delayed scaling) and every other layer runs as under
`mixed_bfloat16`.
"""

from keras_fp8 import autocast as _autocast_module
from keras_fp8 import policy as _policy_module
from keras_fp8 import layers
from keras_fp8 import recipes
from keras_fp8 import scaling
from keras_fp8.autocast import autocast
from keras_fp8.layers import FP8Dense
from keras_fp8.layers import FP8EinsumDense
from keras_fp8.policy import FP8DTypePolicy
from keras_fp8.policy import POLICY_NAMES
from keras_fp8.recipes import CurrentScaling
from keras_fp8.recipes import DelayedScaling

__version__ = "0.1.0"

_policy_module.register()
_autocast_module.register()

__all__ = [
    "CurrentScaling",
    "DelayedScaling",
    "FP8DTypePolicy",
    "FP8Dense",
    "FP8EinsumDense",
    "POLICY_NAMES",
    "autocast",
    "layers",
    "recipes",
    "scaling",
]
