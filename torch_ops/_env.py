"""Settings read from the environment (once, at import).

A value that is set but not understood gives a warning that names the
variable and what it accepts, then the default: never a silent default,
never a crash at import.
"""

import os
import warnings


def choice(name, choices, default):
    """The value of environment variable `name` if it is one of `choices`.

    Args:
      name: the variable's name.
      choices: the accepted values (strings).
      default: returned when the variable is unset or empty, or (with a
        warning) when its value is not one of `choices`.

    Returns:
      The value, or `default`.

    Example:

    >>> backend = choice("TORCH_OPS_GEMM_BACKEND", ("cublaslt", "scaled_mm"), "cublaslt")
    """
    value = os.environ.get(name, "")
    if value == "":
        return default
    if value in choices:
        return value
    warnings.warn(f"{name}={value!r} is not one of {', '.join(map(repr, choices))}; using {default!r}",
                  stacklevel=2)
    return default


def integer(name, default, minimum=0):
    """The value of environment variable `name` as an integer >= `minimum`.

    Args:
      name: the variable's name.
      default: returned when the variable is unset or empty, or (with a
        warning) when its value is not an integer >= `minimum`.
      minimum: the smallest accepted value.

    Returns:
      The integer, or `default`.

    Example:

    >>> size = integer("TORCH_OPS_FP8_MIN_GEMM_SIZE", 8192 * 2048 * 2048)
    """
    value = os.environ.get(name, "").strip()
    if value == "":
        return default
    try:
        number = int(value)
    except ValueError:
        number = None
    if number is None or number < minimum:
        warnings.warn(f"{name}={value!r} is not an integer >= {minimum}; using {default}", stacklevel=2)
        return default
    return number
