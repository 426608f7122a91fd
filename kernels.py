"""Attention kernels: pure-jnp references (this file's contract) and, on TPU, Pallas kernels.

Shapes (legend as in model.py): B batch, T query len, S key len, N q heads, K kv heads, H head dim.

  attention(q [B,T,N,H], k [B,S,K,H], v [B,S,K,H], segment_ids [B,T] | None, causal=True, impl="auto")
      -> [B,T,N,H] in q.dtype.  Softmax in fp32. GQA: q head n uses kv head n // (N // K).
      Causal by index within the sequence (T == S when causal or segment_ids are used); with segment_ids a
      query attends only to keys of the same segment id (packed sequences; id 0 is padding by convention, but
      padding still only attends to padding, so rows never are all -inf).
  decode_attention(q [B,N,H], k_cache [B,S,K,H], v_cache [B,S,K,H], lengths [B] int32, impl="auto") -> [B,N,H]
      One query per sequence against cache entries [0, lengths[b]) (the new token's k/v already written).

impl: "ref" (jnp), "pallas" (TPU kernel; on CPU only under force_tpu_interpret_mode), "auto" (pallas on TPU,
ref elsewhere).
"""
import jax
import jax.numpy as jnp

NEG_INF = -1e30  # finite: a fully-masked row gives a uniform softmax instead of NaN


def attention_reference(q, k, v, segment_ids=None, *, causal=True, sm_scale=None):
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  assert N % K == 0, (N, K)
  sm_scale = H ** -0.5 if sm_scale is None else sm_scale
  # Group q heads by their kv head instead of repeating K/V: [B,T,K,G,H].
  qg = q.reshape(B, T, K, N // K, H)
  s = jnp.einsum("btkgh,bskh->bkgts", qg, k, preferred_element_type=jnp.float32) * sm_scale
  mask = jnp.ones((B, T, S), bool)
  if causal:
    mask &= (jnp.arange(T)[:, None] >= jnp.arange(S)[None, :])[None]
  if segment_ids is not None:
    mask &= segment_ids[:, :, None] == segment_ids[:, None, :]
  s = jnp.where(mask[:, None, None], s, NEG_INF)
  p = jax.nn.softmax(s, axis=-1)
  o = jnp.einsum("bkgts,bskh->btkgh", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
  return o.reshape(B, T, N, H).astype(q.dtype)


def decode_attention_reference(q, k_cache, v_cache, lengths, *, sm_scale=None):
  B, N, H = q.shape
  S, K = k_cache.shape[1], k_cache.shape[2]
  sm_scale = H ** -0.5 if sm_scale is None else sm_scale
  qg = q.reshape(B, K, N // K, H)
  s = jnp.einsum("bkgh,bskh->bkgs", qg, k_cache, preferred_element_type=jnp.float32) * sm_scale
  valid = jnp.arange(S)[None, :] < lengths[:, None]  # [B,S]
  s = jnp.where(valid[:, None, None], s, NEG_INF)
  p = jax.nn.softmax(s, axis=-1)
  o = jnp.einsum("bkgs,bskh->bkgh", p.astype(v_cache.dtype), v_cache, preferred_element_type=jnp.float32)
  return o.reshape(B, N, H).astype(q.dtype)


def _use_pallas(impl):
  if impl not in ("auto", "ref", "pallas"):
    raise ValueError(f"attention impl must be 'auto', 'ref' or 'pallas', got {impl!r}")
  return impl == "pallas" or (impl == "auto" and jax.default_backend() == "tpu")


def attention(q, k, v, segment_ids=None, *, causal=True, sm_scale=None, impl="auto"):
  if _use_pallas(impl):
    raise NotImplementedError("Pallas flash attention lands with issue 3")
  return attention_reference(q, k, v, segment_ids, causal=causal, sm_scale=sm_scale)


def decode_attention(q, k_cache, v_cache, lengths, *, sm_scale=None, impl="auto"):
  if _use_pallas(impl):
    raise NotImplementedError("Pallas decode attention lands with issue 3")
  return decode_attention_reference(q, k_cache, v_cache, lengths, sm_scale=sm_scale)
