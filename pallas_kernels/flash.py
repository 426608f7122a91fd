"""Flash attention for TPU (Pallas) and the jnp reference it is tested against.

Shapes (legend as in model.py): B batch, T query len, S key len, N q heads, K kv heads, H head dim; G = N // K.

  attention_reference / flash_attention(q [B,T,N,H], k [B,S,K,H], v [B,S,K,H], segment_ids [B,T] | None,
      causal=True) -> [B,T,N,H] in q.dtype. Softmax in fp32. GQA: q head n uses kv head n // G. Causal by index
      within the sequence (T == S when causal or segment_ids are used); with segment_ids a query attends only to
      keys of the same segment (packed sequences; padding attends to padding, so no row is all -inf).

Design
  * One custom_vjp over three Pallas kernels (forward; dK/dV; dQ), FlashAttention-2 style online softmax with
    fp32 running max / sum / accumulator in VMEM scratch and the log-sum-exp saved for the backward. Inputs may
    be bf16: matmuls take the input dtype and accumulate in fp32 (as the reference).
  * GQA without repeating K/V: q is laid out [B,K,G,T,H] and one grid step loads the G query heads that share a
    kv head as a [G*block_q, H] tile against one [block_k, H] K/V tile: each K/V tile is read once per group and
    dK/dV sum over the group inside the kernel.
  * Causal: blocks wholly above the diagonal skip compute, and their index map is clamped to the last useful
    block so the pipeline does not DMA them either.
  * T and S that are not multiples of the block are padded (zeros); padded keys are masked (causality hides
    them, otherwise a synthetic segment id), and the result is sliced.

Run: python -m pytest -q tests/test_kernels.py   (interpret mode on CPU)
"""
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

NEG_INF = -1e30  # finite: a fully-masked row gives a uniform softmax instead of NaN
PAD_SEGMENT = jnp.iinfo(jnp.int32).min  # segment id of padded keys/queries: matches no real id


# ----------------------------------------------------------------------------------------------------------
# Reference (pure jnp): defines the semantics; the kernel is tested against it.

def attention_reference(q, k, v, segment_ids=None, *, causal=True, sm_scale=None):
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  assert N % K == 0, (N, K)
  sm_scale = H ** -0.5 if sm_scale is None else sm_scale
  if not causal or T != S:
    return _attention_block(q, k, v, segment_ids, segment_ids, 0 if causal else None, sm_scale)
  # Causal: query block [a, b) needs only keys [0, b), so the queries go in blocks that skip the keys above the
  # diagonal (the Pallas kernel skips whole tiles the same way). The keys a block drops were masked to exp(-inf) = 0
  # anyway, so the forward is the same up to summation order (tests/test_kernels.py). RESULTS.md (bench_train) has
  # what it saves in the training step.
  seg = (lambda a, b: None) if segment_ids is None else (lambda a, b: segment_ids[:, a:b])
  return jnp.concatenate([_attention_block(q[:, a:b], k[:, :b], v[:, :b], seg(a, b), seg(0, b), a, sm_scale)
                          for a, b in causal_blocks(T)], axis=1)


CAUSAL_BLOCK_MIN = 64  # queries per block of the causal reference, at least (smaller blocks cost more than they skip)
CAUSAL_BLOCKS_MAX = 4  # query blocks of the causal reference, at most (fewer, larger matmuls; measured best on CPU)


def causal_blocks(T):
  """The causal reference's query blocks [(a, b), ...] at T == S; block (a, b) attends to keys [0, b). Its score
  matmuls and softmax cover (nb + 1) / (2 nb) of the T x T square: 3/4 at T=128 (nb=2), 5/8 at T >= 256 (nb=4)."""
  nb = max(1, min(CAUSAL_BLOCKS_MAX, T // CAUSAL_BLOCK_MIN))
  edges = [T * i // nb for i in range(nb + 1)]
  return list(zip(edges, edges[1:]))


def _attention_block(q, k, v, q_seg, k_seg, q_start, sm_scale):
  """Queries q [B,Tq,N,H] at sequence positions q_start.. against keys k/v [B,S,K,H] at positions 0..S-1.
  q_start None: not causal. q_seg [B,Tq] / k_seg [B,S]: segment ids (both or neither)."""
  B, Tq, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  # Group q heads by their kv head instead of repeating K/V, and put the batch dims (b, k) first: [B,K,G,T,H] and
  # [B,K,S,H]. The same products as einsums on [B,T,K,G,H] (bitwise), but XLA's CPU backend ran that layout's
  # batched matmuls and their transposes 1.4x slower (RESULTS.md, bench_train).
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


# ----------------------------------------------------------------------------------------------------------
# Flash attention kernels. Internal layout: q/o/do [B,K,G,T,H], k/v [B,K,S,H], lse/di [B,K,G,T,1],
# q segment ids [B,T,1] (a column, broadcasts along keys), kv segment ids [B,1,S] (a row).

def _round_up(x, m):
  return (x + m - 1) // m * m


def _dot_t(a, b):
  """a [M,C] . b [N,C]^T -> [M,N] in fp32, without materialising the transpose."""
  return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _dot_tn(a, b):
  """a [C,M]^T . b [C,N] -> [M,N] in fp32 (the dK/dV contractions over query rows)."""
  return lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _block_mask(qi, kj, bq, bk, causal, qseg_ref, kvseg_ref):
  """[bq,bk] bool mask of query block qi against key block kj, or None when nothing is masked."""
  mask = None
  if causal:
    row = qi * bq + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
    col = kj * bk + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
    mask = row >= col
  if qseg_ref is not None:
    same = qseg_ref[...] == kvseg_ref[...]  # [bq,1] == [1,bk]
    mask = same if mask is None else mask & same
  return mask


def _block_visible(qi, kj, bq, bk, causal):
  """Whether query block qi sees any key of block kj (False only above the causal diagonal)."""
  return (kj * bk <= qi * bq + bq - 1) if causal else True


def _run_if(cond, fn):
  if cond is True:
    fn()
  else:
    pl.when(cond)(fn)


def _split_refs(refs, has_seg):
  return (refs[:2], refs[2:]) if has_seg else ((None, None), refs)


def _zero(*refs):
  for ref in refs:
    ref[...] = jnp.zeros(ref.shape, jnp.float32)


def _softmax_init(m_scr, l_scr, acc_scr):
  m_scr[...] = jnp.full(m_scr.shape, NEG_INF, jnp.float32)
  _zero(l_scr, acc_scr)


def _softmax_step(s, m_prev, l_prev, acc_prev, pv):
  """Online softmax over one key block: rescales what was accumulated under the old running max. s: fp32 scores
  [..., bk]; pv(p) -> p @ V. Returns the new (running max, sum, accumulator)."""
  m_new = jnp.maximum(m_prev, s.max(axis=-1, keepdims=True))
  alpha = jnp.exp(m_prev - m_new)
  p = jnp.exp(s - m_new)
  return m_new, alpha * l_prev + p.sum(axis=-1, keepdims=True), alpha * acc_prev + pv(p)


def _fwd_kernel(*refs, causal, has_seg, sm_scale, bq, bk):
  (qseg_ref, kvseg_ref), (q_ref, k_ref, v_ref, o_ref, lse_ref, m_scr, l_scr, acc_scr) = _split_refs(refs, has_seg)
  qi, kj = pl.program_id(2), pl.program_id(3)
  G, _, H = q_ref.shape
  pl.when(kj == 0)(lambda: _softmax_init(m_scr, l_scr, acc_scr))

  def _compute():
    # The G heads of the group become G*bq matmul rows against one K tile.
    s = _dot_t(q_ref[...].reshape(G * bq, H), k_ref[...]).reshape(G, bq, bk) * sm_scale
    mask = _block_mask(qi, kj, bq, bk, causal, qseg_ref, kvseg_ref)
    if mask is not None:
      s = jnp.where(mask[None], s, NEG_INF)
    pv = lambda p: jnp.dot(p.reshape(G * bq, bk).astype(v_ref.dtype), v_ref[...],  # noqa: E731
                           preferred_element_type=jnp.float32).reshape(G, bq, H)
    m_scr[...], l_scr[...], acc_scr[...] = _softmax_step(s, m_scr[...], l_scr[...], acc_scr[...], pv)

  _run_if(_block_visible(qi, kj, bq, bk, causal), _compute)

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
  s = _dot_t(q, k_ref[...]).reshape(G, bq, bk) * sm_scale
  p = jnp.exp(s - lse_ref[...])  # exact probabilities again, from the saved fp32 log-sum-exp
  mask = _block_mask(qi, kj, bq, bk, causal, qseg_ref, kvseg_ref)
  if mask is not None:
    p = jnp.where(mask[None], p, 0.0)
  p = p.reshape(G * bq, bk)
  dp = _dot_t(do, v_ref[...])
  ds = p * (dp - di_ref[...].reshape(G * bq, 1))  # softmax backward: P * (dP - rowsum(dO * O))
  return q, do, p, ds


def _dkv_kernel(*refs, causal, has_seg, sm_scale, bq, bk):
  (qseg_ref, kvseg_ref), refs = _split_refs(refs, has_seg)
  in_refs, (dk_ref, dv_ref, dk_scr, dv_scr) = refs[:6], refs[6:]
  kj, qi = pl.program_id(2), pl.program_id(3)  # kv block outer, q blocks reduced over
  pl.when(qi == 0)(lambda: _zero(dk_scr, dv_scr))

  def _compute():
    q, do, p, ds = _bwd_block(qi, kj, causal, sm_scale, bq, bk, qseg_ref, kvseg_ref, *in_refs)
    # Contracting over all G*bq rows sums the G query heads that share this kv head.
    dv_scr[...] += _dot_tn(p.astype(do.dtype), do)
    dk_scr[...] += _dot_tn(ds.astype(q.dtype), q) * sm_scale

  _run_if(_block_visible(qi, kj, bq, bk, causal), _compute)

  @pl.when(qi == pl.num_programs(3) - 1)
  def _finish():
    dk_ref[...] = dk_scr[...].astype(dk_ref.dtype)
    dv_ref[...] = dv_scr[...].astype(dv_ref.dtype)


def _dq_kernel(*refs, causal, has_seg, sm_scale, bq, bk):
  (qseg_ref, kvseg_ref), refs = _split_refs(refs, has_seg)
  in_refs, (dq_ref, dq_scr) = refs[:6], refs[6:]
  k_ref = in_refs[1]
  qi, kj = pl.program_id(2), pl.program_id(3)
  pl.when(kj == 0)(lambda: _zero(dq_scr))

  def _compute():
    _, _, _, ds = _bwd_block(qi, kj, causal, sm_scale, bq, bk, qseg_ref, kvseg_ref, *in_refs)
    dq = jnp.dot(ds.astype(k_ref.dtype), k_ref[...], preferred_element_type=jnp.float32) * sm_scale
    dq_scr[...] += dq.reshape(dq_scr.shape)

  _run_if(_block_visible(qi, kj, bq, bk, causal), _compute)

  @pl.when(kj == pl.num_programs(3) - 1)
  def _finish():
    dq_ref[...] = dq_scr[...].astype(dq_ref.dtype)


def _specs(G, H, bq, bk, causal, q_major, has_seg):
  """BlockSpecs for (q-like [B,K,G,T,H], lse-like [B,K,G,T,1], kv-like [B,K,S,H], [q seg, kv seg] or [] when
  not has_seg) on a grid (B, K, outer, inner): (.., q block, kv block) when q_major (forward, dQ), else (.., kv
  block, q block) (dK/dV). Causal: a block the diagonal makes useless maps to the nearest useful one (no DMA)."""
  def qk_idx(o, i):
    qi, kj = (o, i) if q_major else (i, o)
    if causal and q_major:
      kj = jnp.minimum(kj, (qi * bq + bq - 1) // bk)  # last kv block this q block sees
    if causal and not q_major:
      qi = jnp.maximum(qi, (kj * bk) // bq)  # first q block that sees this kv block
    return qi, kj

  q_map = lambda b, h, o, i: (b, h, 0, qk_idx(o, i)[0], 0)  # noqa: E731
  kv_map = lambda b, h, o, i: (b, h, qk_idx(o, i)[1], 0)  # noqa: E731
  q_spec = pl.BlockSpec((None, None, G, bq, H), q_map)
  lse_spec = pl.BlockSpec((None, None, G, bq, 1), q_map)
  kv_spec = pl.BlockSpec((None, None, bk, H), kv_map)
  seg_specs = [pl.BlockSpec((None, bq, 1), lambda b, h, o, i: (b, qk_idx(o, i)[0], 0)),
               pl.BlockSpec((None, 1, bk), lambda b, h, o, i: (b, 0, qk_idx(o, i)[1]))] if has_seg else []
  return q_spec, lse_spec, kv_spec, seg_specs


_SEMANTICS = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"))


def _flash_fwd(q, k, v, seg, causal, sm_scale, bq, bk):
  """The output and the residuals the backward needs (the fp32 log-sum-exp included)."""
  B, K, G, T, H = q.shape
  has_seg = seg is not None
  q_spec, lse_spec, kv_spec, seg_specs = _specs(G, H, bq, bk, causal, True, has_seg)
  o, lse = pl.pallas_call(
      functools.partial(_fwd_kernel, causal=causal, has_seg=has_seg, sm_scale=sm_scale, bq=bq, bk=bk),
      grid=(B, K, T // bq, k.shape[2] // bk),
      in_specs=seg_specs + [q_spec, kv_spec, kv_spec],
      out_specs=[q_spec, lse_spec],
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((B, K, G, T, 1), jnp.float32)],
      scratch_shapes=[pltpu.VMEM((G, bq, 1), jnp.float32), pltpu.VMEM((G, bq, 1), jnp.float32),
                      pltpu.VMEM((G, bq, H), jnp.float32)],
      compiler_params=_SEMANTICS,
      name="flash_attention_fwd",
  )(*(seg or ()), q, k, v)
  return o, (q, k, v, seg, o, lse)


def _flash_bwd(causal, sm_scale, bq, bk, res, do):
  q, k, v, seg, o, lse = res
  B, K, G, T, H = q.shape
  S = k.shape[2]
  has_seg = seg is not None
  # di = rowsum(dO * O): the softmax-Jacobian correction, one fp32 scalar per query row.
  di = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1, keepdims=True)
  params = dict(causal=causal, has_seg=has_seg, sm_scale=sm_scale, bq=bq, bk=bk)
  args = (*(seg or ()), q, k, v, do, lse, di)

  q_spec, lse_spec, kv_spec, seg_specs = _specs(G, H, bq, bk, causal, False, has_seg)
  dk, dv = pl.pallas_call(
      functools.partial(_dkv_kernel, **params),
      grid=(B, K, S // bk, T // bq),
      in_specs=seg_specs + [q_spec, kv_spec, kv_spec, q_spec, lse_spec, lse_spec],
      out_specs=[kv_spec, kv_spec],
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      scratch_shapes=[pltpu.VMEM((bk, H), jnp.float32), pltpu.VMEM((bk, H), jnp.float32)],
      compiler_params=_SEMANTICS,
      name="flash_attention_dkv",
  )(*args)

  q_spec, lse_spec, kv_spec, seg_specs = _specs(G, H, bq, bk, causal, True, has_seg)
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, **params),
      grid=(B, K, T // bq, S // bk),
      in_specs=seg_specs + [q_spec, kv_spec, kv_spec, q_spec, lse_spec, lse_spec],
      out_specs=q_spec,
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      scratch_shapes=[pltpu.VMEM((G, bq, H), jnp.float32)],
      compiler_params=_SEMANTICS,
      name="flash_attention_dq",
  )(*args)
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


def flash_attention(q, k, v, segment_ids=None, *, causal=True, sm_scale=None, block_q=128, block_k=128):
  """Pallas flash attention on one device's arrays; same contract as attention_reference. Differentiable."""
  _check_attention_args(q, k, v, segment_ids, causal)
  _check_block("block_q", block_q)
  _check_block("block_k", block_k)
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  sm_scale = H ** -0.5 if sm_scale is None else float(sm_scale)
  G = N // K
  # Short sequences use one block aligned to the sublane tile (8 rows of 32-bit, 16 of bf16); longer ones are
  # padded up to a multiple of the block.
  align = max(8, 32 // q.dtype.itemsize)
  bq, bk = min(block_q, _round_up(T, align)), min(block_k, _round_up(S, align))
  Tp, Sp = _round_up(T, bq), _round_up(S, bk)

  seg = None
  if segment_ids is not None or (not causal and Sp != S):
    # Without causality nothing hides padded keys, so they get a segment id no real query has.
    q_ids = jnp.zeros((B, T), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    kv_ids = q_ids if segment_ids is not None else jnp.zeros((B, S), jnp.int32)
    q_ids = jnp.pad(q_ids, ((0, 0), (0, Tp - T)), constant_values=PAD_SEGMENT)
    kv_ids = jnp.pad(kv_ids, ((0, 0), (0, Sp - S)), constant_values=PAD_SEGMENT)
    seg = (q_ids[:, :, None], kv_ids[:, None, :])

  # [B,T,N,H] -> [B,K,G,T,H]: heads of one group adjacent, sequence second-minor (TPU sublanes).
  qt = jnp.pad(q.reshape(B, T, K, G, H), ((0, 0), (0, Tp - T), (0, 0), (0, 0), (0, 0))).transpose(0, 2, 3, 1, 4)
  kt, vt = (jnp.pad(x, ((0, 0), (0, Sp - S), (0, 0), (0, 0))).transpose(0, 2, 1, 3) for x in (k, v))
  o = _flash(qt, kt, vt, seg, causal, sm_scale, bq, bk)
  return o.transpose(0, 3, 1, 2, 4)[:, :T].reshape(B, T, N, H)
