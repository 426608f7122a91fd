"""Attention for model.py: the jnp references and the Pallas TPU kernels, picked by `impl`, sharded over a mesh.

  attention(q [B,T,N,H], k [B,S,K,H], v [B,S,K,H], segment_ids [B,T] | None, causal=True, impl="auto")
      -> [B,T,N,H]                                       (flash.py has the contract)
  decode_attention(q [B,N,H], k_cache [B,K,H,S], v_cache [B,K,S,H], lengths [B], impl="auto") -> [B,N,H]
                                                         (decode.py has the contract)

impl: "ref" (jnp), "pallas" (TPU kernel; on CPU only under force_tpu_interpret_mode), "auto" (pallas on TPU,
ref elsewhere). One file per kernel, its jnp reference beside it.

Sharding: on a mesh with axes ("data", "fsdp", "tensor"), batch is split over ("data", "fsdp") and heads over
"tensor"; attention is independent per (batch row, kv head), so each shard runs the kernel on its local block
via jax.shard_map with no communication. The mesh is `mesh=` if given, else the context mesh (jax.set_mesh, as
model.py uses); with neither the kernel sees whole arrays. Dims that do not divide follow the fallback rule
model.py shares (fit_axes): batch drops mesh axes from the end until it divides; heads are replicated over
"tensor" unless both N and K divide by it.

Run: python -m pytest -q tests/test_kernels.py; python -m bench.kernels (micro-benchmark, any backend)
"""
import functools
import math

import jax
from jax.sharding import PartitionSpec as P

from pallas_kernels.decode import _check_decode_args, decode_attention_reference, ragged_decode_attention
from pallas_kernels.flash import _check_attention_args, attention_reference, flash_attention

BATCH_AXES = ("data", "fsdp")  # mesh axes the batch dim is split over
HEAD_AXIS = "tensor"  # mesh axis the head dims are split over


def _resolve_mesh(mesh):
  """The mesh to shard over: `mesh`, else the context mesh (jax.set_mesh); None for plain single-device."""
  if mesh is None:
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
      return None
  if set(mesh.axis_names) & set(mesh.manual_axes if hasattr(mesh, "manual_axes") else ()):
    return None  # already inside a shard_map over this mesh: the arrays are local blocks
  return mesh


def fit_axes(dim, axes, sizes):
  """The mesh fallback rule (model.logical_spec's too): the longest prefix of `axes` in the mesh (sizes: name ->
  size) whose product divides dim; the dim is replicated over the rest (batch 2 on data=2 x fsdp=4 -> ["data"])."""
  cand = [a for a in axes if a in sizes]
  while cand and dim % math.prod(sizes[a] for a in cand):
    cand.pop()
  return cand


def _mesh_axes(mesh, B, *heads):
  """(batch axes, head axis) to split over, by fit_axes; heads over "tensor" only if every head count divides by
  it, else they are replicated (each tensor shard then computes all heads)."""
  sizes = dict(mesh.shape)
  head = HEAD_AXIS if all(fit_axes(h, (HEAD_AXIS,), sizes) for h in heads) else None
  return (tuple(fit_axes(B, BATCH_AXES, sizes)) or None), head


def _shard_call(fn, mesh, in_specs, out_specs, *args):
  """Run fn per shard. Explicit-axis meshes (the JAX 0.10 default) need the inputs already laid out as
  in_specs, so reshard them first (a no-op when they already are); Auto meshes let shard_map do it."""
  if any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
    args = [jax.sharding.reshard(x, jax.sharding.NamedSharding(mesh, s)) for x, s in zip(args, in_specs)]
  return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*args)


def attention(q, k, v, segment_ids=None, *, causal=True, sm_scale=None, impl="auto", mesh=None,
              block_q=128, block_k=128):
  """Causal/GQA/packed attention; see the module docstring (contract, impl, sharding over `mesh`)."""
  if not _use_pallas(impl):
    return attention_reference(q, k, v, segment_ids, causal=causal, sm_scale=sm_scale)
  fn = functools.partial(flash_attention, causal=causal, sm_scale=sm_scale, block_q=block_q, block_k=block_k)
  _check_attention_args(q, k, v, segment_ids, causal)  # before shard_map, so errors name the global shapes
  mesh = _resolve_mesh(mesh)
  if mesh is None:
    return fn(q, k, v, segment_ids)
  batch, head = _mesh_axes(mesh, q.shape[0], q.shape[2], k.shape[2])
  qkv_spec = P(batch, None, head, None)
  if segment_ids is None:
    return _shard_call(lambda q, k, v: fn(q, k, v), mesh, (qkv_spec,) * 3, qkv_spec, q, k, v)
  return _shard_call(fn, mesh, (qkv_spec,) * 3 + (P(batch, None),), qkv_spec, q, k, v, segment_ids)


def decode_attention(q, k_cache, v_cache, lengths, *, sm_scale=None, impl="auto", mesh=None, block_s=256):
  """One-token decode attention over a ragged KV cache; see module docstring. Sharded like `attention`."""
  if not _use_pallas(impl):
    return decode_attention_reference(q, k_cache, v_cache, lengths, sm_scale=sm_scale)
  fn = functools.partial(ragged_decode_attention, sm_scale=sm_scale, block_s=block_s)
  _check_decode_args(q, k_cache, v_cache, lengths)
  mesh = _resolve_mesh(mesh)
  if mesh is None:
    return fn(q, k_cache, v_cache, lengths)
  batch, head = _mesh_axes(mesh, q.shape[0], q.shape[1], k_cache.shape[1])
  cache_spec = P(batch, head, None, None)
  return _shard_call(fn, mesh, (P(batch, head, None), cache_spec, cache_spec, P(batch)), P(batch, head, None),
                     q, k_cache, v_cache, lengths)


def _use_pallas(impl):
  if impl not in ("auto", "ref", "pallas"):
    raise ValueError(f"attention impl must be 'auto', 'ref' or 'pallas', got {impl!r}")
  return impl == "pallas" or (impl == "auto" and jax.default_backend() == "tpu")
