"""Flash attention for TPU (Pallas) and the jnp reference it is tested against. G = N // K (legend: model.py).

  attention_reference / flash_attention(q [B,T,N,H], k [B,S,K,H], v [B,S,K,H], segment_ids [B,T] | None,
      causal=True) -> [B,T,N,H] in q.dtype. Softmax in fp32, scale H^-1/2. GQA: q head n uses kv head n // G.
      Causal by index (T == S when causal or segment_ids are used); with segment_ids a query attends only to keys
      of its own segment (packed sequences; padding attends to padding, so no row is all -inf).

The kernel: FlashAttention-2 online softmax (fp32 running max / sum / accumulator in VMEM; the log-sum-exp saved
for a custom_vjp over a dK/dV and a dQ kernel). The G query heads of a kv head form one [G*block_q, H] tile, so
each K/V tile is read once per group (no repeated K/V) and dK/dV sum the group in the kernel. Tiles above the
causal diagonal are neither computed nor DMA'd (clamped index maps). T, S are zero-padded to the block; padded
keys are masked by causality, else by a segment id no query has.
"""
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

NEG_INF = -1e30  # finite: a fully-masked row gives a uniform softmax instead of NaN
PAD_SEGMENT = jnp.iinfo(jnp.int32).min  # segment id of padded keys/queries: matches no real id


def attention_reference(q, k, v, segment_ids=None, *, causal=True):
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  assert N % K == 0, (N, K)
  if not causal or T != S:
    return _attention_block(q, k, v, segment_ids, segment_ids, 0 if causal else None, H ** -0.5)
  # Causal: query block [a, b) needs only keys [0, b), so the keys above the diagonal are skipped (as the kernel
  # skips tiles). They were exp(-inf) = 0 anyway: the same result up to summation order.
  seg = (lambda a, b: None) if segment_ids is None else (lambda a, b: segment_ids[:, a:b])
  return jnp.concatenate([_attention_block(q[:, a:b], k[:, :b], v[:, :b], seg(a, b), seg(0, b), a, H ** -0.5)
                          for a, b in causal_blocks(T)], axis=1)


def causal_blocks(T):
  """The causal reference's query blocks [(a, b), ...] at T == S; block (a, b) attends to keys [0, b). Its score
  matmuls and softmax cover (nb + 1) / (2 nb) of the T x T square: 3/4 at T=128 (nb=2), 5/8 at T >= 256 (nb=4)."""
  nb = max(1, min(4, T // 64))  # >= 64 queries a block (smaller cost more than they skip), <= 4 (faster on CPU)
  edges = [T * i // nb for i in range(nb + 1)]
  return list(zip(edges, edges[1:]))


def _attention_block(q, k, v, q_seg, k_seg, q_start, sm_scale):
  """Queries q [B,Tq,N,H] at positions q_start.. (None: not causal) against k/v [B,S,K,H] at 0..S-1."""
  B, Tq, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  # Grouped by kv head with the batch dims (b, k) leading, [B,K,G,T,H] x [B,K,S,H]: the same products as on
  # [B,T,K,G,H] (bitwise), but XLA CPU ran that layout's batched matmuls and their transposes 1.4x slower.
  qg = q.reshape(B, Tq, K, N // K, H).transpose(0, 2, 3, 1, 4)
  kt, vt = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
  s = jnp.einsum("bkgth,bksh->bkgts", qg, kt, preferred_element_type=jnp.float32) * sm_scale
  mask = jnp.ones((B, Tq, S), bool)
  if q_start is not None:
    mask &= (jnp.arange(q_start, q_start + Tq)[:, None] >= jnp.arange(S)[None, :])[None]
  if q_seg is not None:
    mask &= q_seg[:, :, None] == k_seg[:, None, :]
  s = jnp.where(mask[:, None, None], s, NEG_INF)
  p = jax.nn.softmax(s, axis=-1)
  o = jnp.einsum("bkgts,bksh->bkgth", p.astype(v.dtype), vt, preferred_element_type=jnp.float32)
  return o.transpose(0, 3, 1, 2, 4).reshape(B, Tq, N, H).astype(q.dtype)


# Kernels. Layout: q/o/do [B,K,G,T,H], k/v [B,K,S,H], lse/di [B,K,G,T,1], q segment ids [B,T,1] (a column,
# broadcast along keys), kv segment ids [B,1,S] (a row).

def _round_up(x, m):
  return (x + m - 1) // m * m


def _dot(a, b, dim):  # fp32 a . b^T (dim 1: [M,C] x [N,C]) or a^T . b (dim 0: [C,M] x [C,N]), no transpose copy
  return lax.dot_general(a, b, (((dim,), (dim,)), ((), ())), preferred_element_type=jnp.float32)


def _block_mask(qi, kj, bq, bk, causal, qseg_ref, kvseg_ref):
  """[bq,bk] bool mask of query block qi against key block kj, or None when nothing is masked."""
  iota = lambda d: lax.broadcasted_iota(jnp.int32, (bq, bk), d)  # noqa: E731
  mask = qi * bq + iota(0) >= kj * bk + iota(1) if causal else None
  if qseg_ref is not None:
    same = qseg_ref[...] == kvseg_ref[...]  # [bq,1] == [1,bk]
    mask = same if mask is None else mask & same
  return mask


def _run_if_visible(qi, kj, bq, bk, causal, fn):
  """fn() unless query block qi sees no key of block kj (only above the causal diagonal)."""
  if causal:
    pl.when(kj * bk <= qi * bq + bq - 1)(fn)
  else:
    fn()


def _zero(*refs):
  for ref in refs:
    ref[...] = jnp.zeros(ref.shape, jnp.float32)


def _softmax_init(m_scr, l_scr, acc_scr):
  m_scr[...] = jnp.full(m_scr.shape, NEG_INF, jnp.float32)
  _zero(l_scr, acc_scr)


def _softmax_step(s, m_prev, l_prev, acc_prev, pv):
  """Online softmax over one key block (s: fp32 scores [..., bk]; pv(p) -> p @ V), rescaling what was accumulated
  under the old running max. Returns the new (running max, sum, accumulator)."""
  m_new = jnp.maximum(m_prev, s.max(axis=-1, keepdims=True))
  alpha = jnp.exp(m_prev - m_new)
  p = jnp.exp(s - m_new)
  return m_new, alpha * l_prev + p.sum(axis=-1, keepdims=True), alpha * acc_prev + pv(p)


def _fwd_kernel(*refs, causal, has_seg, sm_scale, bq, bk):
  (qseg_ref, kvseg_ref), refs = (refs[:2], refs[2:]) if has_seg else ((None, None), refs)
  q_ref, k_ref, v_ref, o_ref, lse_ref, m_scr, l_scr, acc_scr = refs
  qi, kj = pl.program_id(2), pl.program_id(3)
  G, _, H = q_ref.shape
  pl.when(kj == 0)(lambda: _softmax_init(m_scr, l_scr, acc_scr))

  def _compute():  # the G heads of the group are G*bq matmul rows against one K tile
    s = _dot(q_ref[...].reshape(G * bq, H), k_ref[...], 1).reshape(G, bq, bk) * sm_scale
    mask = _block_mask(qi, kj, bq, bk, causal, qseg_ref, kvseg_ref)
    if mask is not None:
      s = jnp.where(mask[None], s, NEG_INF)
    pv = lambda p: jnp.dot(p.reshape(G * bq, bk).astype(v_ref.dtype), v_ref[...],  # noqa: E731
                           preferred_element_type=jnp.float32).reshape(G, bq, H)
    m_scr[...], l_scr[...], acc_scr[...] = _softmax_step(s, m_scr[...], l_scr[...], acc_scr[...], pv)

  _run_if_visible(qi, kj, bq, bk, causal, _compute)

  @pl.when(kj == pl.num_programs(3) - 1)
  def _finish():
    l = l_scr[...]  # >= 1: the row max contributes exp(0)
    o_ref[...] = (acc_scr[...] / l).astype(o_ref.dtype)
    lse_ref[...] = m_scr[...] + jnp.log(l)


def _bwd_block(qi, kj, causal, sm_scale, bq, bk, qseg_ref, kvseg_ref, q_ref, k_ref, v_ref, do_ref, lse_ref,
               di_ref):
  """Shared by both backward kernels: q, dO rows [G*bq,H], recomputed probabilities P and dS [G*bq,bk]."""
  G, _, H = q_ref.shape
  q = q_ref[...].reshape(G * bq, H)
  do = do_ref[...].reshape(G * bq, H)
  s = _dot(q, k_ref[...], 1).reshape(G, bq, bk) * sm_scale
  p = jnp.exp(s - lse_ref[...])  # exact probabilities again, from the saved fp32 log-sum-exp
  mask = _block_mask(qi, kj, bq, bk, causal, qseg_ref, kvseg_ref)
  if mask is not None:
    p = jnp.where(mask[None], p, 0.0)
  p = p.reshape(G * bq, bk)
  dp = _dot(do, v_ref[...], 1)
  ds = p * (dp - di_ref[...].reshape(G * bq, 1))  # softmax backward: P * (dP - rowsum(dO * O))
  return q, do, p, ds


def _bwd_kernel(*refs, dq, causal, has_seg, sm_scale, bq, bk):
  """dK and dV on a grid (B, K, kv block, q block), or (dq) dQ on (B, K, q block, kv block): the last grid axis
  is the one reduced over, into fp32 scratch."""
  (qseg_ref, kvseg_ref), refs = (refs[:2], refs[2:]) if has_seg else ((None, None), refs)
  n_out = 1 if dq else 2
  in_refs, out_refs, scr = refs[:6], refs[6:6 + n_out], refs[6 + n_out:]
  qi, kj = (pl.program_id(2), pl.program_id(3)) if dq else (pl.program_id(3), pl.program_id(2))
  pl.when(pl.program_id(3) == 0)(lambda: _zero(*scr))

  def _compute():
    q, do, p, ds = _bwd_block(qi, kj, causal, sm_scale, bq, bk, qseg_ref, kvseg_ref, *in_refs)
    if dq:
      k_ref, (dq_scr,) = in_refs[1], scr
      dq_scr[...] += (jnp.dot(ds.astype(k_ref.dtype), k_ref[...], preferred_element_type=jnp.float32)
                      * sm_scale).reshape(dq_scr.shape)
    else:  # contracting over all G*bq rows sums the G query heads that share this kv head
      dk_scr, dv_scr = scr
      dv_scr[...] += _dot(p.astype(do.dtype), do, 0)
      dk_scr[...] += _dot(ds.astype(q.dtype), q, 0) * sm_scale

  _run_if_visible(qi, kj, bq, bk, causal, _compute)

  @pl.when(pl.program_id(3) == pl.num_programs(3) - 1)
  def _finish():
    for ref, acc in zip(out_refs, scr):
      ref[...] = acc[...].astype(ref.dtype)


def _specs(G, H, bq, bk, causal, q_major, has_seg):
  """BlockSpecs of (q-like, lse-like, kv-like, [q seg, kv seg] or []) on a grid (B, K, q block, kv block) if q_major
  (forward, dQ), else (B, K, kv block, q block) (dK/dV); causally useless blocks map to the nearest useful one."""
  def qk_idx(o, i):
    qi, kj = (o, i) if q_major else (i, o)
    if causal and q_major:
      kj = jnp.minimum(kj, (qi * bq + bq - 1) // bk)  # last kv block this q block sees
    if causal and not q_major:
      qi = jnp.maximum(qi, (kj * bk) // bq)  # first q block that sees this kv block
    return qi, kj

  q_map = lambda b, h, o, i: (b, h, 0, qk_idx(o, i)[0], 0)  # noqa: E731
  kv_map = lambda b, h, o, i: (b, h, qk_idx(o, i)[1], 0)  # noqa: E731
  seg_specs = [pl.BlockSpec((None, bq, 1), lambda b, h, o, i: (b, qk_idx(o, i)[0], 0)),
               pl.BlockSpec((None, 1, bk), lambda b, h, o, i: (b, 0, qk_idx(o, i)[1]))] if has_seg else []
  return (pl.BlockSpec((None, None, G, bq, H), q_map), pl.BlockSpec((None, None, G, bq, 1), q_map),
          pl.BlockSpec((None, None, bk, H), kv_map), seg_specs)


def _call(kernel, params, grid, in_specs, out_specs, out_shape, scratch, name, *args):
  return pl.pallas_call(
      functools.partial(kernel, **params), grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      scratch_shapes=[pltpu.VMEM(s, jnp.float32) for s in scratch], name=name,
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
  )(*args)


def _flash_fwd(q, k, v, seg, causal, sm_scale, bq, bk):
  """The output and the residuals the backward needs (the fp32 log-sum-exp included)."""
  B, K, G, T, H = q.shape
  params = dict(causal=causal, has_seg=seg is not None, sm_scale=sm_scale, bq=bq, bk=bk)
  q_spec, lse_spec, kv_spec, seg_specs = _specs(G, H, bq, bk, causal, True, seg is not None)
  o, lse = _call(_fwd_kernel, params, (B, K, T // bq, k.shape[2] // bk), seg_specs + [q_spec, kv_spec, kv_spec],
                 [q_spec, lse_spec], [jax.ShapeDtypeStruct(q.shape, q.dtype),
                                      jax.ShapeDtypeStruct((B, K, G, T, 1), jnp.float32)],
                 [(G, bq, 1), (G, bq, 1), (G, bq, H)], "flash_attention_fwd", *(seg or ()), q, k, v)
  return o, (q, k, v, seg, o, lse)


def _flash_bwd(causal, sm_scale, bq, bk, res, do):
  q, k, v, seg, o, lse = res
  B, K, G, T, H = q.shape
  S = k.shape[2]
  # di = rowsum(dO * O): the softmax-Jacobian correction, one fp32 scalar per query row.
  di = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1, keepdims=True)
  params = dict(causal=causal, has_seg=seg is not None, sm_scale=sm_scale, bq=bq, bk=bk)
  args = (*(seg or ()), q, k, v, do, lse, di)
  q_spec, lse_spec, kv_spec, seg_specs = _specs(G, H, bq, bk, causal, False, seg is not None)
  dk, dv = _call(_bwd_kernel, dict(params, dq=False), (B, K, S // bk, T // bq),
                 seg_specs + [q_spec, kv_spec, kv_spec, q_spec, lse_spec, lse_spec], [kv_spec, kv_spec],
                 [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
                 [(bk, H), (bk, H)], "flash_attention_dkv", *args)
  q_spec, lse_spec, kv_spec, seg_specs = _specs(G, H, bq, bk, causal, True, seg is not None)
  dq = _call(_bwd_kernel, dict(params, dq=True), (B, K, T // bq, S // bk),
             seg_specs + [q_spec, kv_spec, kv_spec, q_spec, lse_spec, lse_spec], q_spec,
             jax.ShapeDtypeStruct(q.shape, q.dtype), [(G, bq, H)], "flash_attention_dq", *args)
  return dq, dk, dv, None  # segment ids are integers: no cotangent


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _flash(q, k, v, seg, causal, sm_scale, bq, bk):
  return _flash_fwd(q, k, v, seg, causal, sm_scale, bq, bk)[0]


_flash.defvjp(_flash_fwd, _flash_bwd)


def _check_block(name, block, multiple=8):
  if not isinstance(block, int) or block <= 0 or block % multiple:
    raise ValueError(f"{name} must be a positive multiple of {multiple} (TPU tiling), got {block!r}")


def _check_attention_args(q, k, v, segment_ids, causal):
  if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape:
    raise ValueError(f"attention wants q [B,T,N,H], k and v [B,S,K,H]; got {q.shape}, {k.shape}, {v.shape}")
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  if k.shape[0] != B or k.shape[3] != H or N % K:
    raise ValueError(f"attention: q {q.shape} and k {k.shape} disagree on B/H, or N={N} not a multiple of K={K}")
  if (causal or segment_ids is not None) and T != S:
    raise ValueError(f"attention: causal or segment_ids need T == S, got T={T}, S={S}")
  if segment_ids is not None and segment_ids.shape != (B, T):
    raise ValueError(f"attention: segment_ids must be [B,T]={(B, T)}, got {segment_ids.shape}")


def flash_attention(q, k, v, segment_ids=None, *, causal=True, block_q=128, block_k=128):
  """Pallas flash attention on one device's arrays; same contract as attention_reference. Differentiable."""
  _check_attention_args(q, k, v, segment_ids, causal)
  _check_block("block_q", block_q), _check_block("block_k", block_k)
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  G = N // K
  # Short sequences: one block aligned to the sublane tile (8 rows of 32-bit, 16 of bf16); long ones are padded.
  align = max(8, 32 // q.dtype.itemsize)
  bq, bk = min(block_q, _round_up(T, align)), min(block_k, _round_up(S, align))
  Tp, Sp = _round_up(T, bq), _round_up(S, bk)

  seg = None
  if segment_ids is not None or (not causal and Sp != S):
    # Without causality nothing hides padded keys, so they get a segment id no real query has.
    q_ids = jnp.zeros((B, T), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    kv_ids = q_ids if segment_ids is not None else jnp.zeros((B, S), jnp.int32)
    pad = lambda ids, n: jnp.pad(ids, ((0, 0), (0, n)), constant_values=PAD_SEGMENT)  # noqa: E731
    seg = (pad(q_ids, Tp - T)[:, :, None], pad(kv_ids, Sp - S)[:, None, :])
    # TPU blocks: the last two dims a multiple of (8, 128) or the whole array dim; the kv ids are a [1, bk] row.
    if bk % 128 and bk != Sp:
      raise ValueError(f"block_k={block_k}: with segment ids (packed sequences, or padded keys without causality) "
                       f"TPU needs block_k a multiple of 128, or at least the key length {S}")

  # [B,T,N,H] -> [B,K,G,T,H]: heads of one group adjacent, sequence second-minor (TPU sublanes).
  qt = jnp.pad(q.reshape(B, T, K, G, H), ((0, 0), (0, Tp - T), (0, 0), (0, 0), (0, 0))).transpose(0, 2, 3, 1, 4)
  kt, vt = (jnp.pad(x, ((0, 0), (0, Sp - S), (0, 0), (0, 0))).transpose(0, 2, 1, 3) for x in (k, v))
  o = _flash(qt, kt, vt, seg, causal, H ** -0.5, bq, bk)
  return o.transpose(0, 3, 1, 2, 4)[:, :T].reshape(B, T, N, H)
