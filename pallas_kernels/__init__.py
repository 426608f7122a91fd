"""Attention for model.py: the jnp references and the Pallas TPU kernels, picked by `impl`, sharded over a mesh.

  attention(q [B,T,N,H], k [B,S,K,H], v [B,S,K,H], segment_ids [B,T] | None, causal=True) -> [B,T,N,H]  (flash.py)
  decode_attention(q [B,N,H], k_cache [B,K,H,S], v_cache [B,K,S,H], lengths [B]) -> [B,N,H]           (decode.py)

impl: "ref" (jnp), "pallas" (TPU kernel; on CPU only under force_tpu_interpret_mode), "auto" (pallas on TPU, ref
elsewhere). Sharding: attention is independent per (batch row, kv head), so on a ("data", "fsdp", "tensor") mesh
(`mesh=`, else the context mesh of jax.set_mesh) each shard runs the kernel on its local block via jax.shard_map,
with no communication: batch over BATCH_AXES, heads over HEAD_AXIS (only if both N and K divide by it), each by
fit_axes, the fallback rule model.logical_spec shares.

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
  mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
  if mesh.empty or set(mesh.axis_names) & set(getattr(mesh, "manual_axes", ())):
    return None  # no mesh, or already inside a shard_map over it (the arrays are local blocks)
  return mesh


def fit_axes(dim, axes, sizes):
  """The mesh fallback rule: the longest prefix of `axes` in the mesh (sizes: name -> size) whose product divides
  dim; the dim is replicated over the rest (batch 2 on data=2 x fsdp=4 -> ["data"])."""
  cand = [a for a in axes if a in sizes]
  while cand and dim % math.prod(sizes[a] for a in cand):
    cand.pop()
  return cand


def _mesh_axes(mesh, B, *heads):
  """(batch axes, head axis or None) to split over; heads are replicated unless every head count divides."""
  sizes = dict(mesh.shape)
  head = HEAD_AXIS if all(fit_axes(h, (HEAD_AXIS,), sizes) for h in heads) else None
  return (tuple(fit_axes(B, BATCH_AXES, sizes)) or None), head


def _use_pallas(impl):
  if impl not in ("auto", "ref", "pallas"):
    raise ValueError(f"attention impl must be 'auto', 'ref' or 'pallas', got {impl!r}")
  return impl == "pallas" or (impl == "auto" and jax.default_backend() == "tpu")


def _sharded(fn, mesh, args, B, heads, specs):
  """fn(*args) on whole arrays without a mesh, else per shard: specs(batch axes, head axis) -> (in, out) specs.
  Explicit-axis meshes need the inputs laid out as in_specs first (a no-op when they already are)."""
  mesh = _resolve_mesh(mesh)
  if mesh is None:
    return fn(*args)
  in_specs, out_specs = specs(*_mesh_axes(mesh, B, *heads))
  in_specs = in_specs[:len(args)]
  if any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
    args = [jax.sharding.reshard(x, jax.sharding.NamedSharding(mesh, s)) for x, s in zip(args, in_specs)]
  return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*args)


def attention(q, k, v, segment_ids=None, *, causal=True, impl="auto", mesh=None, block_q=128, block_k=128):
  """Causal/GQA/packed attention (contract: flash.py)."""
  if not _use_pallas(impl):
    return attention_reference(q, k, v, segment_ids, causal=causal)
  _check_attention_args(q, k, v, segment_ids, causal)  # before shard_map, so errors name the global shapes
  fn = functools.partial(flash_attention, causal=causal, block_q=block_q, block_k=block_k)
  args = (q, k, v) if segment_ids is None else (q, k, v, segment_ids)
  return _sharded(fn, mesh, args, q.shape[0], (q.shape[2], k.shape[2]),
                  lambda b, h: ((P(b, None, h, None),) * 3 + (P(b, None),), P(b, None, h, None)))


def decode_attention(q, k_cache, v_cache, lengths, *, impl="auto", mesh=None, block_s=256):
  """One-token attention over a ragged KV cache (contract: decode.py); sharded like `attention`."""
  if not _use_pallas(impl):
    return decode_attention_reference(q, k_cache, v_cache, lengths)
  _check_decode_args(q, k_cache, v_cache, lengths)
  fn = functools.partial(ragged_decode_attention, block_s=block_s)
  return _sharded(fn, mesh, (q, k_cache, v_cache, lengths), q.shape[0], (q.shape[1], k_cache.shape[1]),
                  lambda b, h: ((P(b, h, None), P(b, h, None, None), P(b, h, None, None), P(b)), P(b, h, None)))
