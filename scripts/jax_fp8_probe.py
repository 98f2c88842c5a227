"""Probe: JAX FP8 dot_general at tiny/unaligned shapes, bf16 vs f32 products."""
import jax
import jax.numpy as jnp
import numpy as np

rng = np.random.default_rng(0)
dn = (((1,), (0,)), ((), ()))
for (M, K, N) in [(4, 16, 8), (4, 8, 16), (16, 4, 8), (32, 32, 32), (17, 33, 9), (64, 64, 64), (4096, 16, 8)]:
    for ta, tb in [(jnp.float8_e4m3fn, jnp.float8_e4m3fn), (jnp.float8_e5m2, jnp.float8_e4m3fn)]:
        a = jnp.asarray(rng.standard_normal((M, K)), jnp.float32).astype(ta)
        b = jnp.asarray(rng.standard_normal((K, N)), jnp.float32).astype(tb)
        ref = np.asarray(a.astype(jnp.float32)) @ np.asarray(b.astype(jnp.float32))
        row = []
        for pet in (jnp.bfloat16, jnp.float32):
            f = jax.jit(lambda a, b, pet=pet: jax.lax.dot_general(a, b, dn, preferred_element_type=pet))
            out = np.asarray(f(a, b).astype(jnp.float32))
            row.append(f"{jnp.dtype(pet).name}: nan {int(np.isnan(out).sum())} maxerr {float(np.nanmax(np.abs(out - ref))):.3g}")
        hlo = jax.jit(lambda a, b: jax.lax.dot_general(a, b, dn, preferred_element_type=jnp.bfloat16)).lower(a, b).compile().as_text()
        kind = "cublaslt-f8" if "f8e" in hlo and "cublas$lt" in hlo else ("cublas" if "cublas" in hlo else "other")
        print(f"{M}x{K}x{N} {jnp.dtype(ta).name}x{jnp.dtype(tb).name} [{kind}] " + " | ".join(row), flush=True)
