"""Block-scaled FP8 matmuls for the JAX backend (`recipes.BlockScaling`).

`numerics.block_matmul` is the reference: each 128-long stretch of the
contraction summed in float32 and multiplied by its two scales. XLA has no
block-scaled GEMM for Hopper (its FP8 `dot_general` takes one scale per
operand), so the backend's `XLA` route multiplies block-scaled operands in
one of two ways, in order of preference (docs/design.md, "Block scaling"):

- `pallas_block_matmul`: a Pallas kernel (Triton on the GPU) that keeps a
  128 x 128 float32 accumulator per program, loads one 128-wide FP8 slab of
  each operand per K step, multiplies them with an FP8 `dot` and adds the
  product scaled by the slab's row and column scales: the scales are applied
  per K step inside the kernel, as in DeepSeek's and TransformerEngine's
  block-scaled GEMMs. Pallas's `dot` takes one operand type, so the E4M3 x
  E5M2 products of the hybrid format widen both slabs to bfloat16 (exact)
  and multiply at bfloat16 rate.
- `scan_block_matmul`: a `lax.scan` over the K blocks, one FP8
  `dot_general` (an XLA FP8 GEMM) per block, each partial scaled and added to
  a float32 accumulator in HBM. Correct everywhere; slow (every K step
  writes and reads an `M x N` float32 partial).

The first use of a shape on the GPU tries the Pallas kernel; a compile
failure warns once and the shape runs the scan from then on. A symbolic
size (Keras's shape inference) takes the scan without trying.
"""

import functools
import warnings

import jax
import jax.numpy as jnp

from keras_fp8 import numerics
from keras_fp8 import recipes

BLOCK = numerics.BLOCK
# Output tile of one Pallas program.
TILE_M = 128
TILE_N = 128


def _round_up(v, m):
    return -(-v // m) * m


def _column_scales(b_scales, n, b_tiles):
    """`b`'s scales as one per (K block, column): `(Kb, N)` float32."""
    if b_tiles:
        return b_scales.astype(jnp.float32)
    return jnp.repeat(b_scales.astype(jnp.float32), BLOCK, axis=1)[:, :n]


# Triton launch settings (warps per program, software pipeline stages): 8
# warps hold the 128 x 128 float32 accumulator in 64 registers a thread; 3
# stages overlap the next slabs' loads with this slab's product.
# `pallas_block_matmul` takes others.
NUM_WARPS = 8
NUM_STAGES = 3


def _block_kernel(a_ref, sa_ref, b_ref, sb_ref, o_ref, *, k_blocks, widen):
    # a_ref (TILE_M, Kp) FP8, sa_ref (Kb padded, TILE_M), b_ref (Kp, TILE_N) FP8,
    # sb_ref (Kb padded, TILE_N), o_ref (TILE_M, TILE_N) float32.
    from jax.experimental import pallas as pl

    def step(k, acc):
        a = a_ref[:, pl.ds(k * BLOCK, BLOCK)]
        b = b_ref[pl.ds(k * BLOCK, BLOCK), :]
        if widen:
            # E4M3 x E5M2: Pallas's dot takes one operand type; both FP8
            # formats widen to bfloat16 exactly (a bfloat16 dot on FP8 data).
            a, b = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
        part = jnp.dot(a, b, preferred_element_type=jnp.float32)
        row_scale = sa_ref[k, :]
        col_scale = sb_ref[k, :]
        return acc + part * row_scale[:, None] * col_scale[None, :]

    acc = jax.lax.fori_loop(0, k_blocks, step, jnp.zeros((TILE_M, TILE_N), jnp.float32))
    o_ref[...] = acc


def pallas_block_matmul(a_q, a_scales, b_q, b_scales, out_dtype, bias=None, b_tiles=False, interpret=False,
                        num_warps=None, num_stages=None):
    """`numerics.block_matmul` as one Pallas kernel (see the module docstring).

    Args:
        a_q, a_scales, b_q, b_scales, out_dtype, bias, b_tiles: As for
            `numerics.block_matmul`.
        interpret: Run Pallas's interpreter (CPU tests) instead of compiling.
        num_warps, num_stages: Triton launch settings (default `NUM_WARPS`,
            `NUM_STAGES`).

    Returns:
        The `(M, N)` product in `out_dtype`.
    """
    from jax.experimental import pallas as pl

    m, k = a_q.shape
    n = b_q.shape[1]
    k_blocks = -(-k // BLOCK)
    mp, np_, kp = _round_up(m, TILE_M), _round_up(n, TILE_N), k_blocks * BLOCK
    # Zero rows and columns contribute nothing; padded scales are 1.
    a = jnp.pad(a_q, ((0, mp - m), (0, kp - k)))
    b = jnp.pad(b_q, ((0, kp - k), (0, np_ - n)))
    # Scale rows padded to a power of two (Triton's block shapes).
    kb_p = pl.next_power_of_2(k_blocks)
    sa = jnp.pad(a_scales.astype(jnp.float32).T, ((0, kb_p - k_blocks), (0, mp - m)), constant_values=1.0)
    sb = jnp.pad(_column_scales(b_scales, n, b_tiles), ((0, kb_p - k_blocks), (0, np_ - n)), constant_values=1.0)
    compiler_params = None
    if not interpret:
        from jax.experimental.pallas import triton as pl_triton

        compiler_params = pl_triton.CompilerParams(num_warps=num_warps or NUM_WARPS,
                                                   num_stages=num_stages or NUM_STAGES)
    acc = pl.pallas_call(
        functools.partial(_block_kernel, k_blocks=k_blocks, widen=a_q.dtype != b_q.dtype),
        out_shape=jax.ShapeDtypeStruct((mp, np_), jnp.float32),
        grid=(mp // TILE_M, np_ // TILE_N),
        in_specs=[
            pl.BlockSpec((TILE_M, kp), lambda i, j: (i, 0)),
            pl.BlockSpec((kb_p, TILE_M), lambda i, j: (0, i)),
            pl.BlockSpec((kp, TILE_N), lambda i, j: (0, j)),
            pl.BlockSpec((kb_p, TILE_N), lambda i, j: (0, j)),
        ],
        out_specs=pl.BlockSpec((TILE_M, TILE_N), lambda i, j: (i, j)),
        interpret=interpret,
        compiler_params=compiler_params,
        name="keras_fp8_block_matmul",
    )(a, sa, b, sb)[:m, :n]
    if bias is not None:
        acc = acc + bias.astype(jnp.float32)
    return acc.astype(out_dtype)


def scan_block_matmul(a_q, a_scales, b_q, b_scales, out_dtype, bias=None, b_tiles=False):
    """`numerics.block_matmul` as a scan of FP8 `dot_general`s, one per K block."""
    m, k = a_q.shape
    n = b_q.shape[1]
    k_blocks = -(-k // BLOCK)
    kp = k_blocks * BLOCK
    a = jnp.pad(a_q, ((0, 0), (0, kp - k))).reshape(m, k_blocks, BLOCK).transpose(1, 0, 2)
    b = jnp.pad(b_q, ((0, kp - k), (0, 0))).reshape(k_blocks, BLOCK, n)
    sa = a_scales.astype(jnp.float32).T
    sb = _column_scales(b_scales, n, b_tiles)

    def step(acc, blocks):
        a_block, b_block, row_scale, col_scale = blocks
        part = jax.lax.dot_general(a_block, b_block, (((1,), (0,)), ((), ())),
                                   preferred_element_type=jnp.float32)
        return acc + part * row_scale[:, None] * col_scale[None, :], None

    acc, _ = jax.lax.scan(step, jnp.zeros((m, n), jnp.float32), (a, b, sa, sb))
    if bias is not None:
        acc = acc + bias.astype(jnp.float32)
    return acc.astype(out_dtype)


# Shapes (and dtypes) whose Pallas kernel failed to compile on this device.
_PALLAS_FAILED = set()


def gpu_block_matmul(a_q, a_scales, b_q, b_scales, out_dtype, bias=None, b_tiles=False):
    """The GPU's block-scaled matmul: the Pallas kernel where it compiles,
    else the scan (a one-time warning per shape)."""
    if recipes.gemm_size((*a_q.shape, b_q.shape[1])) is None:
        # A symbolic size (Keras's shape inference traces the batch as a
        # symbol): only the output's shape is wanted, and Triton takes no
        # symbolic grid; the concrete shapes try the kernel when they come.
        return scan_block_matmul(a_q, a_scales, b_q, b_scales, out_dtype, bias, b_tiles)
    key = (a_q.shape, b_q.shape, str(a_q.dtype), str(b_q.dtype), bool(b_tiles))
    if key not in _PALLAS_FAILED:
        try:
            specs = [jax.ShapeDtypeStruct(t.shape, t.dtype) for t in (a_q, a_scales, b_q, b_scales)]
            jax.jit(functools.partial(pallas_block_matmul, out_dtype=out_dtype, b_tiles=b_tiles)).lower(
                *specs).compile()
        except Exception as e:  # noqa: BLE001 - any compiler failure means: use the scan
            _PALLAS_FAILED.add(key)
            warnings.warn(
                f"keras_fp8: the Pallas block-scaled FP8 kernel did not compile for a {a_q.shape} x "
                f"b {b_q.shape} ({type(e).__name__}: {str(e).splitlines()[0][:200]}); a scan of "
                "XLA FP8 dots runs instead (correct, slower).",
                stacklevel=2,
            )
        else:
            return pallas_block_matmul(a_q, a_scales, b_q, b_scales, out_dtype, bias, b_tiles)
    return scan_block_matmul(a_q, a_scales, b_q, b_scales, out_dtype, bias, b_tiles)
