"""Ragged decode attention for TPU (Pallas) and the jnp reference it is tested against.

  decode_attention_reference / ragged_decode_attention(q [B,N,H], k_cache [B,K,H,S], v_cache [B,K,S,H],
      lengths [B] int32) -> [B,N,H]: one query per row against cache entries [0, lengths[b]) (the new token's k/v
      already written), scale H^-1/2. lengths are clipped to [0, S]; callers pass lengths >= 1.

The kernel: grid (B, S / block_s), lengths scalar-prefetched; the K/V index map clamps each row's block index to
its last valid block, so blocks past lengths[b] are neither DMA'd nor computed (traffic ~ sum(lengths), not B*S).
It reads model.py's cache layout as is, [K,H,block_s] key and [K,block_s,H] value tiles (both products plain
matmuls). A partial last block is masked, not padded (padding would copy the cache).
"""
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.flash import NEG_INF, _check_block, _softmax_init, _softmax_step


def decode_attention_reference(q, k_cache, v_cache, lengths):
  B, N, H = q.shape
  K, S = v_cache.shape[1], v_cache.shape[2]
  # (b, k) lead: both products are plain batched matmuls on the buffers as stored (model.py's KV cache note).
  qg = q.reshape(B, K, N // K, H)
  s = jnp.einsum("bkgh,bkhs->bkgs", qg, k_cache, preferred_element_type=jnp.float32) * H ** -0.5
  valid = jnp.arange(S)[None, :] < lengths[:, None]  # [B,S]
  s = jnp.where(valid[:, None, None], s, NEG_INF)
  p = jax.nn.softmax(s, axis=-1)
  o = jnp.einsum("bkgs,bksh->bkgh", p.astype(v_cache.dtype), v_cache, preferred_element_type=jnp.float32)
  return o.reshape(B, N, H).astype(q.dtype)


def _decode_kernel(lengths_ref, q_ref, k_ref, v_ref, o_ref, m_scr, l_scr, acc_scr, *, sm_scale, bs):
  b, j = pl.program_id(0), pl.program_id(1)
  K, G, H = q_ref.shape
  length = lengths_ref[b]
  pl.when(j == 0)(lambda: _softmax_init(m_scr, l_scr, acc_scr))

  @pl.when(j * bs < length)  # blocks wholly past the length: no compute (and, via the index map, no DMA)
  def _compute():
    valid_row = j * bs + lax.broadcasted_iota(jnp.int32, (1, bs), 1) < length  # [1,bs] over scores
    valid_col = j * bs + lax.broadcasted_iota(jnp.int32, (bs, 1), 0) < length  # [bs,1] over V rows
    for h in range(K):  # static loop over the kv heads of this row's tile
      k = k_ref[h]  # [H,bs]
      # Rows past the length may be stale or unspecified (partial last block): zero V, so no 0 * NaN leaks in.
      v = jnp.where(valid_col, v_ref[h], 0)
      s = jnp.dot(q_ref[h], k, preferred_element_type=jnp.float32)  # [G,H] x [H,bs]
      s = jnp.where(valid_row, s * sm_scale, NEG_INF)  # [G,bs]
      pv = lambda p: jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)  # noqa: E731
      m_scr[h], l_scr[h], acc_scr[h] = _softmax_step(s, m_scr[h], l_scr[h], acc_scr[h], pv)

  @pl.when(j == pl.num_programs(1) - 1)
  def _finish():
    l = l_scr[...]
    o_ref[...] = jnp.where(l > 0, acc_scr[...] / jnp.where(l > 0, l, 1.0), 0.0).astype(o_ref.dtype)


def _check_decode_args(q, k_cache, v_cache, lengths):
  if q.ndim != 3 or v_cache.ndim != 4 or k_cache.shape != (*v_cache.shape[:2], v_cache.shape[3], v_cache.shape[2]):
    raise ValueError(f"decode_attention wants q [B,N,H], k_cache [B,K,H,S], v_cache [B,K,S,H]; got {q.shape}, "
                     f"{k_cache.shape}, {v_cache.shape}")
  B, N, H = q.shape
  if v_cache.shape[0] != B or v_cache.shape[3] != H or N % v_cache.shape[1]:
    raise ValueError(f"decode_attention: q {q.shape} and v_cache {v_cache.shape} disagree on B/H, or N % K != 0")
  if lengths.shape != (B,):
    raise ValueError(f"decode_attention: lengths must be [B]={(B,)}, got {lengths.shape}")


def ragged_decode_attention(q, k_cache, v_cache, lengths, *, block_s=256):
  """Pallas decode attention on one device's arrays; same contract as decode_attention_reference."""
  _check_decode_args(q, k_cache, v_cache, lengths)
  _check_block("block_s", block_s, 128)  # the lane dim of the [H, block_s] key tile
  B, N, H = q.shape
  _, K, S, _ = v_cache.shape
  G = N // K
  bs = min(block_s, S)  # a block equal to the full dim is always a legal TPU block
  lengths = jnp.clip(lengths.astype(jnp.int32), 0, S)

  def last(b, j, lengths_ref):  # this row's block j, clamped to its last valid block (no DMA past the length)
    return jnp.maximum(jnp.minimum(j, (lengths_ref[b] - 1) // bs), 0)

  qo_spec = pl.BlockSpec((None, K, G, H), lambda b, j, lengths_ref: (b, 0, 0, 0))
  k_spec = pl.BlockSpec((None, K, H, bs), lambda b, j, lengths_ref: (b, 0, 0, last(b, j, lengths_ref)))
  v_spec = pl.BlockSpec((None, K, bs, H), lambda b, j, lengths_ref: (b, 0, last(b, j, lengths_ref), 0))
  o = pl.pallas_call(
      functools.partial(_decode_kernel, sm_scale=H ** -0.5, bs=bs),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1, grid=(B, pl.cdiv(S, bs)), in_specs=[qo_spec, k_spec, v_spec], out_specs=qo_spec,
          scratch_shapes=[pltpu.VMEM((K, G, 1), jnp.float32), pltpu.VMEM((K, G, 1), jnp.float32),
                          pltpu.VMEM((K, G, H), jnp.float32)]),
      out_shape=jax.ShapeDtypeStruct((B, K, G, H), q.dtype),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
      name="ragged_decode_attention",
  )(lengths, q.reshape(B, K, G, H), k_cache, v_cache)
  return o.reshape(B, N, H)
