"""FP8EinsumDense: `keras.layers.EinsumDense` with FP8 matmuls."""

import math
import string

import keras
from keras import ops
from keras.saving import register_keras_serializable

from keras_fp8 import compat
from keras_fp8.layers.fp8_state import FP8StateMixin


class MatmulPlan:
    """How an einsum `x, kernel -> y` becomes one `(M, K) @ (K, N)` matmul.

    Supported: every output axis comes from exactly one operand and every
    axis shared by `x` and the kernel is contracted (the equations that
    dense projections use: `"abc,cd->abd"`, `"abc,cde->abde"`,
    `"abcd,cde->abe"`, `"...b,bc->...c"`).
    """

    def __init__(self, equation, x_ndim):
        inputs, _, output = equation.partition("->")
        x_axes, _, kernel_axes = inputs.partition(",")
        if "..." in x_axes or "..." in output:
            spare = [c for c in string.ascii_letters if c not in equation]
            n_ellipsis = x_ndim - (len(x_axes) - 3)
            fill = "".join(spare[:n_ellipsis])
            x_axes = x_axes.replace("...", fill)
            output = output.replace("...", fill)
        if "..." in kernel_axes:
            raise ValueError(
                f"FP8EinsumDense does not support an ellipsis in the kernel "
                f"part of the equation. Received: equation={equation!r}"
            )
        free_x = [a for a in x_axes if a in output and a not in kernel_axes]
        contracted = [a for a in x_axes if a in kernel_axes and a not in output]
        free_kernel = [
            a for a in kernel_axes if a in output and a not in x_axes
        ]
        if sorted(free_x + contracted) != sorted(x_axes) or sorted(
            contracted + free_kernel
        ) != sorted(kernel_axes) or sorted(free_x + free_kernel) != sorted(
            output
        ):
            raise ValueError(
                "FP8EinsumDense needs an equation that is a single matmul: "
                "each axis shared by the input and the kernel must be "
                "contracted, and every other axis must appear in the output "
                f"exactly once. Received: equation={equation!r}"
            )
        self.output_axes = output
        self.kernel_axes = kernel_axes
        self.free_kernel = free_kernel
        self.x_perm = [x_axes.index(a) for a in free_x + contracted]
        self.kernel_perm = [kernel_axes.index(a) for a in contracted + free_kernel]
        self.n_free_x = len(free_x)
        self.n_contracted = len(contracted)
        order = free_x + free_kernel
        self.output_perm = [order.index(a) for a in output]
        # The transposes call() makes (None: the identity, skipped).
        self._x_t = self._unless_identity(self.x_perm)
        self._kernel_t = self._unless_identity(self.kernel_perm)
        self._output_t = self._unless_identity(self.output_perm)

    def bias_columns(self, bias_shape, kernel_shape):
        """How the layer's bias becomes the GEMM's `(N,)` bias, if it can.

        Keras's bias spans the last `len(bias_shape)` axes of the output,
        with size 1 on the axes it does not cover. It maps onto the GEMM's
        N columns where it is constant along every input axis of the output
        (size 1 there) and covers every output axis of the kernel (no
        broadcast along N): then it is a reshape (and transpose) of one
        value per column, added in the GEMM's epilogue.

        Args:
            bias_shape: The bias variable's shape.
            kernel_shape: The kernel variable's shape.

        Returns:
            `(kept_shape, perm)`: reshape the bias to `kept_shape` (its axes
            that are output axes of the kernel), transpose by `perm` (None:
            the identity) and flatten to `(N,)`; or None where the bias
            cannot map onto N.
        """
        letters = self.output_axes[len(self.output_axes) - len(bias_shape):]
        sizes = dict(zip(letters, bias_shape))
        for letter, size in sizes.items():
            if letter not in self.free_kernel and size != 1:
                return None  # varies along M
        kept = [c for c in letters if c in self.free_kernel]
        for c in self.free_kernel:
            if kernel_shape[self.kernel_axes.index(c)] != 1 and sizes.get(c, 1) == 1:
                return None  # broadcast along part of N
        order = sorted(range(len(kept)), key=lambda i: self.free_kernel.index(kept[i]))
        perm = self._unless_identity(order)
        return tuple(sizes[c] for c in kept), None if perm is None else tuple(perm)

    @staticmethod
    def _transpose(t, perm):
        # `perm` is None for the identity (decided once in __init__): the
        # usual projection equations need no transpose at all, and each Keras
        # op costs host time in eager mode.
        return t if perm is None else ops.transpose(t, perm)

    @staticmethod
    def _unless_identity(perm):
        return None if perm == sorted(perm) else perm

    def call(self, matmul, x, kernel):
        """Runs `matmul(x2d, kernel2d)` and reshapes back to the output."""
        in_shape = tuple(ops.shape(x))
        kernel_t = self._transpose(kernel, self._kernel_t)
        kernel_shape = tuple(kernel_t.shape)
        contracted = tuple(in_shape[i] for i in self.x_perm[self.n_free_x :])
        if len(in_shape) != len(self.x_perm) or contracted != kernel_shape[: self.n_contracted]:
            raise ValueError(
                f"inputs: expected {len(self.x_perm)} axes whose contracted "
                f"sizes match the kernel's {kernel_shape[: self.n_contracted]}, "
                f"got shape {in_shape}"
            )
        x_t = self._transpose(x, self._x_t)
        x_shape = tuple(ops.shape(x_t))
        k = math.prod(kernel_shape[: self.n_contracted])
        n = math.prod(kernel_shape[self.n_contracted :])
        y = matmul(ops.reshape(x_t, (-1, k)), ops.reshape(kernel_t, (k, n)))
        y = ops.reshape(
            y,
            x_shape[: self.n_free_x] + kernel_shape[self.n_contracted :],
        )
        return self._transpose(y, self._output_t)


@register_keras_serializable(package="keras_fp8")
class FP8EinsumDense(FP8StateMixin, keras.layers.EinsumDense):
    """An einsum projection whose contraction runs as one FP8 matmul.

    Takes exactly the arguments of `keras.layers.EinsumDense`, plus `recipe`.
    Under an FP8 dtype policy or inside an enabled `keras_fp8.autocast`
    scope, the input and the kernel are quantized to FP8 and contracted by
    one FP8 matmul (the operands are transposed/reshaped to `(M, K)` and
    `(K, N)`); the output gradient is quantized once for both backward
    matmuls. The bias is added in float32 before the one rounding to the
    compute dtype, as in `FP8Dense` (docs/numerics.md, "GEMMs"). Otherwise
    the layer computes exactly what `EinsumDense` does. The FP8 state
    variables are those of `FP8Dense`.

    Equations whose contraction is not a single matmul (an axis shared by the
    input, the kernel and the output, i.e. a batched matmul) are rejected in
    `build` with a ValueError.

    Args:
        equation, output_shape, activation, bias_axes, kernel_initializer,
        bias_initializer, kernel_regularizer, bias_regularizer,
        activity_regularizer, kernel_constraint, bias_constraint, lora_rank,
        lora_alpha: As in `keras.layers.EinsumDense`.
        recipe: Optional `keras_fp8.DelayedScaling` / `CurrentScaling`.
        min_gemm_size: As in `FP8Dense`.
        **kwargs: Base layer keyword arguments, such as `name` and `dtype`.

    Example:

    >>> import keras_fp8
    >>> layer = keras_fp8.layers.FP8EinsumDense(
    ...     "abc,cde->abde", output_shape=(None, 4, 8), dtype="fp8_hybrid")
    >>> layer(np.random.rand(2, 5, 16).astype("float32")).shape
    (2, 5, 4, 8)
    """

    def __init__(
        self, equation, output_shape, *, recipe=None, min_gemm_size=None,
        **kwargs,
    ):
        super().__init__(equation, output_shape, **kwargs)
        self.init_fp8(recipe, min_gemm_size)

    def build(self, input_shape):
        self._plan = MatmulPlan(self.equation, len(input_shape))
        super().build(input_shape)
        self._plan_bias()
        self.build_fp8_state()

    def build_fp8_state(self):
        if "_plan" not in vars(self):  # a built EinsumDense that keras_fp8.convert made FP8
            shape = compat.build_input_shape(self)
            self._plan = MatmulPlan(self.equation, None if shape is None else len(shape))
            self._plan_bias()
        super().build_fp8_state()

    def _plan_bias(self):
        """Decides, once the kernel and bias exist, how the bias enters the
        FP8 GEMM (`_bias_columns`, `MatmulPlan.bias_columns`; None: no bias,
        or one that cannot map onto N)."""
        columns = None
        if self.bias is not None:
            columns = self._plan.bias_columns(tuple(self.bias.shape), tuple(self._kernel.shape))
        # The instance dict: Keras's attribute tracking is not needed.
        self.__dict__["_bias_columns"] = columns

    def _gemm_dims(self, input_shape):
        plan = self._plan
        if len(input_shape) != len(plan.x_perm):
            return None
        kernel_shape = [self._kernel.shape[i] for i in plan.kernel_perm]
        free = [input_shape[i] for i in plan.x_perm[: plan.n_free_x]]
        m = None if any(d is None for d in free) else math.prod(free)
        k = math.prod(kernel_shape[: plan.n_contracted])
        return m, k, math.prod(kernel_shape[plan.n_contracted :])

    def call(self, inputs, training=None):
        config = self._fp8_call_config(inputs, bool(training))
        if config is None:
            return super().call(inputs, training=training)
        y = self._fp8_einsum(inputs, config, bool(training))
        if self.activation is not None:
            y = self.activation(y)
        return y

    def _gemm_bias(self):
        """The bias as the GEMM's `(N,)` bias (`MatmulPlan.bias_columns`):
        the variable itself where it is one already."""
        kept_shape, perm = self._bias_columns
        if perm is None and len(kept_shape) == 1 and tuple(self.bias.shape) == kept_shape:
            return self.bias
        bias = ops.reshape(self._raw_value(self.bias), kept_shape)
        if perm is not None:
            bias = ops.transpose(bias, perm)
        return ops.reshape(bias, (-1,))

    def _fp8_einsum(self, inputs, config, training):
        """The einsum and its bias with one rounding to the compute dtype
        (docs/numerics.md, "GEMMs"), as `FP8Dense`.

        A bias that maps onto the GEMM's N columns is added in the GEMM's
        epilogue. Any other (one that varies along an input axis of the
        output, or is broadcast along an output axis of the kernel) is added
        to the GEMM's float32 output, which is then rounded once: the GEMM
        runs on the input widened to float32 (the same values, so the same
        quantization) and writes float32.
        """
        kernel = self._raw_value(self._kernel)
        # x2d is inputs transposed by the plan, then reshaped: the layout
        # layers reading the same inputs must share to share x2d's copy
        # (the widened x2d below is keyed by its dtype as well).
        source = (inputs, tuple(self._plan.x_perm))
        if self.bias is None or self._bias_columns is not None:
            bias = None if self.bias is None else self._gemm_bias()

            def matmul(x2d, kernel2d):
                return self._fp8_matmul(x2d, kernel2d, config, training, bias=bias, source=source)

            return self._plan.call(matmul, inputs, kernel)
        dtype = keras.backend.standardize_dtype(inputs.dtype)

        def matmul_float32(x2d, kernel2d):
            return self._fp8_matmul(ops.cast(x2d, "float32"), kernel2d, config, training, source=source)

        y = self._plan.call(matmul_float32, inputs, kernel)
        # The bias in the compute dtype, added in float32 (as the epilogue
        # adds it), so that its gradient rounds once to the compute dtype.
        bias = ops.cast(ops.cast(self._raw_value(self.bias), dtype), "float32")
        return ops.cast(ops.add(y, bias), dtype)
