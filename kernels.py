"""Attention kernels: pure-jnp references (this file's contract) and Pallas TPU kernels.

Shapes (legend as in model.py): B batch, T query len, S key len, N q heads, K kv heads, H head dim; G = N // K.

  attention(q [B,T,N,H], k [B,S,K,H], v [B,S,K,H], segment_ids [B,T] | None, causal=True, impl="auto")
      -> [B,T,N,H] in q.dtype.  Softmax in fp32. GQA: q head n uses kv head n // (N // K).
      Causal by index within the sequence (T == S when causal or segment_ids are used); with segment_ids a
      query attends only to keys of the same segment id (packed sequences; id 0 is padding by convention, but
      padding still only attends to padding, so rows never are all -inf).
  decode_attention(q [B,N,H], k_cache [B,K,H,S], v_cache [B,K,S,H], lengths [B] int32, impl="auto") -> [B,N,H]
      One query per sequence against cache entries [0, lengths[b]) (the new token's k/v already written).
      lengths are clipped to [0, S]; callers pass lengths >= 1 (a length-0 row is all padding: the reference
      averages the whole row, the kernel returns zeros; neither is meaningful).

impl: "ref" (jnp), "pallas" (TPU kernel; on CPU only under force_tpu_interpret_mode), "auto" (pallas on TPU,
ref elsewhere). Both public functions also take `mesh=None` and block sizes; see "Sharding" below.

  rowsum / softmax / log_softmax / logsumexp over the last axis, and einsum (fp32 result): what model.py, losses.py
      and rollout.py reduce rows and multiply with. In exact mode (enable_exact_mode, --exact_logprobs) they are
      batch-invariant, see "Exact mode".

Design
  * flash_attention: one custom_vjp over three Pallas kernels (forward; dK/dV; dQ), FlashAttention-2 style
    online softmax with fp32 running max / sum / accumulator in VMEM scratch and the log-sum-exp saved for the
    backward pass. Inputs may be bf16: matmuls take the input dtype and accumulate in fp32 (as the reference).
  * GQA without repeating K/V: q is laid out [B,K,G,T,H] and one grid step loads the G query heads that share a
    kv head as a [G*block_q, H] tile against one [block_k, H] K/V tile, so each K/V tile is read once per group
    and dK/dV sum over the group inside the kernel.
  * Causal: blocks entirely above the diagonal skip compute, and their K/V (or Q) index map is clamped to the
    last useful block so the pipeline does not DMA them either.
  * Shapes that are not multiples of the block: the wrapper pads T and S (zeros) and masks padded keys
    (causality already hides them; otherwise via a synthetic segment id), then slices the result.
  * decode_attention: grid (B, S / block_s) with the lengths scalar-prefetched into SMEM. The K/V index map
    clamps the block index to the last valid block of each row, so blocks past lengths[b] are never fetched
    (re-using a block index skips the DMA) and their compute is skipped: HBM traffic is proportional to
    sum(lengths), not B*S (ragged batch). The kernel reads model.py's cache layout as is (keys [B,K,H,S],
    values [B,K,S,H]): a block is a [K, H, block_s] key tile and a [K, block_s, H] value tile, the kernel loops
    over the K heads in VMEM, and both products are plain matmuls (q [G,H] x k [H,bs], p [G,bs] x v [bs,H]).
    block_s is a multiple of 128 (the key tile's lane dim) unless it covers the whole cache.
    A partial last block (S % block_s != 0) is handled by masking, not by padding (which would copy the cache).
  * Sharding: on a mesh with axes ("data", "fsdp", "tensor"), batch is split over ("data", "fsdp") and heads
    over "tensor"; attention is independent per (batch row, kv head), so each shard runs the kernel on its
    local block via jax.shard_map with no communication. The mesh is `mesh=` if given, else the context mesh
    (jax.set_mesh, as model.py uses); with neither the kernel sees whole arrays (single device). Dims that do
    not divide follow the fallback rule model.py shares (fit_axes): batch drops mesh axes from the end until
    it divides, heads are replicated over "tensor" unless both N and K divide by it.

Run
  python kernels.py                      # micro-benchmark on the current backend (see RESULTS.md)
  python -m pytest -q tests/test_kernels.py   # interpret-mode tests on CPU (8 fake devices via conftest)
"""
import functools
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P

NEG_INF = -1e30  # finite: a fully-masked row gives a uniform softmax instead of NaN
PAD_SEGMENT = jnp.iinfo(jnp.int32).min  # segment id of padded keys/queries: matches no real id
BATCH_AXES = ("data", "fsdp")  # mesh axes the batch dim is split over
HEAD_AXIS = "tensor"  # mesh axis the head dims are split over


# ----------------------------------------------------------------------------------------------------------
# Exact mode: bitwise-equal worker and trainer log-probs on XLA CPU (issue 16; README "Exact on-policy log-probs").
# The worker scores a token in a [B,1] decode step, the trainer in a [B,T] forward: the same row, in arrays of
# other shapes. Three things made that row come out differently in the last bit (measured, jaxlib 0.10.2):
#  1. XLA CPU hands large elementwise/reduce fusions to YNNPACK, whose exp and summation order differ from XLA's
#     own, above a size threshold that one side crosses and the other not. EXACT_XLA_FLAG keeps only single dots
#     on YNNPACK. Its bf16 products (fp32 accumulation) give each row the same bits whatever the number of rows,
#     from 2 rows up, on a CPU with AVX512-BF16 (exact_mode_measured_cpu); its fp32 products do not below 64 rows
#     (measured with jnp.dot on that box: [M,384] x [384,F] rows differ for M = 2..48 against M = 256,
#     F = 128..2048), and the decode step has B rows, its attention G. So in exact mode an fp32 product is six
#     bf16 ones (`einsum`, below). XLA's own dot emitter (YNNPACK off altogether) is not row-invariant either.
#     The flag is experimental: off by default, and it must be in XLA_FLAGS before the backend starts
#     (enable_exact_mode, called first thing by the entry points).
#  2. XLA's reduce emitter picks its accumulation order from the whole array's shape. In exact mode every sum over
#     a row (attention softmax, RMSNorm, log-softmax over the vocab) is `rowsum`, a pairwise tree of elementwise
#     adds over halves of the last axis: a row's result depends only on that row, and zeros at its end (masked
#     keys, a cache longer than the sequence) do not change it.
#  3. Two forms of the same product: the lm head on [B,D] rows (prefill's last tokens, a decode step) came out
#     differently from the same rows of [B,T,D]; model.logits_from_hidden computes them as [B,1,D] (one row as two:
#     a 1-row product takes the matrix-vector path). And the drawn token's log-prob is the trainer's expression
#     (rollout.sample), since XLA may fuse the temperature's product into the [B,V] subtraction.
# Off, rowsum/softmax/log_softmax/einsum are exactly jnp.sum/jax.nn.softmax/jax.nn.log_softmax/jnp.einsum (the bits
# every figure in RESULTS.md was measured with). Pallas (TPU) kernels are not covered: the guarantee is XLA CPU with
# attn_impl=ref, the same tensor-parallel split on worker and trainer (another split reassociates sums), a worker
# of >= 2 slots.

EXACT_XLA_FLAG = "--xla_cpu_experimental_ynn_fusion_type=individual_dot"


def exact_mode():
  return EXACT_XLA_FLAG in os.environ.get("XLA_FLAGS", "").split()


def exact_mode_measured_cpu():
  """Whether this CPU is of the kind exact mode's bitwise equality was measured on: one with AVX512-BF16 (YNNPACK's
  bf16 products there are row-invariant). On others YNNPACK picks other kernels; not measured (no such box here)."""
  try:
    with open("/proc/cpuinfo") as f:
      return "avx512_bf16" in f.read().split()
  except OSError:
    return False


def enable_exact_mode():
  """Turns exact mode on for this process. XLA reads XLA_FLAGS once, when the backend starts: call this before
  the first computation (train.py and rollout.py do it first thing in main when --exact_logprobs is set)."""
  if not exact_mode():
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + EXACT_XLA_FLAG).strip()


def rowsum(x):
  """Sum over the last axis, [..., n] -> [...]; in exact mode bitwise independent of the leading shape and of
  trailing zeros (a tree over 2^m entries whose second half is zero is the tree over the first half)."""
  if not exact_mode():
    return jnp.sum(x, axis=-1)
  n = x.shape[-1]
  p = 1 << max(n - 1, 0).bit_length()
  x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, p - n)]) if p != n else x
  while x.shape[-1] > 1:
    x = x[..., :x.shape[-1] // 2] + x[..., x.shape[-1] // 2:]
  return x[..., 0]


def einsum(eq, x, y):
  """jnp.einsum with an fp32 result (preferred_element_type). In exact mode, fp32 operands are each split into three
  bf16 parts (x = x0 + x1 + x2, 24 bits in all) and the product is the fixed-order fp32 sum of the six bf16 products
  with i + j <= 2 (what XLA calls BF16_BF16_F32_X6, about fp32's accuracy): bf16 products are row-invariant where
  fp32 ones are not (see "Exact mode"), so the sum is too. Six products instead of one: exact mode's fp32 price."""
  if not (exact_mode() and x.dtype == jnp.float32 and y.dtype == jnp.float32):
    return jnp.einsum(eq, x, y, preferred_element_type=jnp.float32)
  xs, ys = _split_bf16(x), _split_bf16(y)
  out = None
  for i, j in ((2, 0), (1, 1), (0, 2), (1, 0), (0, 1), (0, 0)):  # smallest terms first
    t = jnp.einsum(eq, xs[i], ys[j], preferred_element_type=jnp.float32)
    out = t if out is None else out + t
  return out


def _split_bf16(x):
  hi = x.astype(jnp.bfloat16)
  r = x - hi.astype(jnp.float32)
  mid = r.astype(jnp.bfloat16)
  return hi, mid, (r - mid.astype(jnp.float32)).astype(jnp.bfloat16)


def logsumexp(x):
  """m + log(rowsum(exp(x - m))) over the last axis: the trainer's formula (losses._logp_entropy_fwd)."""
  m = jnp.max(x, axis=-1)
  return m + jnp.log(rowsum(jnp.exp(x - m[..., None])))


def softmax(x):
  """Softmax over the last axis (jax.nn.softmax unless in exact mode)."""
  if not exact_mode():
    return jax.nn.softmax(x, axis=-1)
  e = jnp.exp(x - lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True)))
  return e / rowsum(e)[..., None]


def log_softmax(x):
  """Log-softmax over the last axis (jax.nn.log_softmax unless in exact mode, then x - logsumexp(x))."""
  return x - logsumexp(x)[..., None] if exact_mode() else jax.nn.log_softmax(x, axis=-1)


# ----------------------------------------------------------------------------------------------------------
# References (pure jnp). These define the semantics; the kernels are tested against them.

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
  s = einsum("bkgth,bksh->bkgts", qg, kt) * sm_scale
  mask = jnp.ones((B, Tq, S), bool)
  if q_start is not None:
    mask &= (jnp.arange(q_start, q_start + Tq)[:, None] >= jnp.arange(S)[None, :])[None]
  if q_seg is not None:
    mask &= q_seg[:, :, None] == k_seg[:, None, :]
  s = jnp.where(mask[:, None, None], s, NEG_INF)
  p = softmax(s)
  o = einsum("bkgts,bksh->bkgth", p.astype(v.dtype), vt)
  return o.transpose(0, 3, 1, 2, 4).reshape(B, Tq, N, H).astype(q.dtype)


def decode_attention_reference(q, k_cache, v_cache, lengths, *, sm_scale=None):
  B, N, H = q.shape
  K, S = v_cache.shape[1], v_cache.shape[2]
  sm_scale = H ** -0.5 if sm_scale is None else sm_scale
  # Keys [B,K,H,S], values [B,K,S,H]: (b, k) are the batch dims of both products and each is a plain matmul on
  # the buffers as stored ([B,S,K,H] needed a transposed copy of the whole cache per layer and step; keys [S,H]
  # made XLA CPU's q x k^T 2-3x slower; RESULTS.md, bench_decode).
  qg = q.reshape(B, K, N // K, H)
  s = einsum("bkgh,bkhs->bkgs", qg, k_cache) * sm_scale
  valid = jnp.arange(S)[None, :] < lengths[:, None]  # [B,S]
  s = jnp.where(valid[:, None, None], s, NEG_INF)
  p = softmax(s)
  o = einsum("bkgs,bksh->bkgh", p.astype(v_cache.dtype), v_cache)
  return o.reshape(B, N, H).astype(q.dtype)


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


# ----------------------------------------------------------------------------------------------------------
# Ragged decode attention.

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
      # Rows past the length may be stale or (partial last block) unspecified memory: zero V so that
      # 0 * garbage cannot leak a NaN into the sum.
      v = jnp.where(valid_col, v_ref[h], 0)
      s = jnp.dot(q_ref[h], k, preferred_element_type=jnp.float32)  # [G,H] x [H,bs]
      s = jnp.where(valid_row, s * sm_scale, NEG_INF)  # [G,bs]; stale columns past the length never selected
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


def ragged_decode_attention(q, k_cache, v_cache, lengths, *, sm_scale=None, block_s=256):
  """Pallas decode attention on one device's arrays; same contract as decode_attention_reference."""
  _check_decode_args(q, k_cache, v_cache, lengths)
  _check_block("block_s", block_s, 128)  # the lane dim of the [H, block_s] key tile
  B, N, H = q.shape
  _, K, S, _ = v_cache.shape
  sm_scale = H ** -0.5 if sm_scale is None else float(sm_scale)
  G = N // K
  bs = min(block_s, S)  # a block equal to the full dim is always a legal TPU block
  lengths = jnp.clip(lengths.astype(jnp.int32), 0, S)

  def last(b, j, lengths_ref):  # this row's block j, clamped to its last valid block (no DMA past the length)
    return jnp.maximum(jnp.minimum(j, (lengths_ref[b] - 1) // bs), 0)

  qo_spec = pl.BlockSpec((None, K, G, H), lambda b, j, lengths_ref: (b, 0, 0, 0))
  k_spec = pl.BlockSpec((None, K, H, bs), lambda b, j, lengths_ref: (b, 0, 0, last(b, j, lengths_ref)))
  v_spec = pl.BlockSpec((None, K, bs, H), lambda b, j, lengths_ref: (b, 0, last(b, j, lengths_ref), 0))
  o = pl.pallas_call(
      functools.partial(_decode_kernel, sm_scale=sm_scale, bs=bs),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1, grid=(B, pl.cdiv(S, bs)), in_specs=[qo_spec, k_spec, v_spec],
          out_specs=qo_spec,
          scratch_shapes=[pltpu.VMEM((K, G, 1), jnp.float32), pltpu.VMEM((K, G, 1), jnp.float32),
                          pltpu.VMEM((K, G, H), jnp.float32)]),
      out_shape=jax.ShapeDtypeStruct((B, K, G, H), q.dtype),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
      name="ragged_decode_attention",
  )(lengths, q.reshape(B, K, G, H), k_cache, v_cache)
  return o.reshape(B, N, H)


# ----------------------------------------------------------------------------------------------------------
# shard_map wrappers and the public entry points.

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


# ----------------------------------------------------------------------------------------------------------
# Micro-benchmark: python kernels.py

def _time(fn, *args, iters=5):
  """Median wall time of a jitted call, after one compile + warm-up call."""
  fn = jax.jit(fn)
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(iters):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t)
  return sorted(times)[len(times) // 2]


def _measured_roofline(dtype):
  """Peak FLOP/s from a square matmul and bandwidth from an elementwise pass, measured now on this backend."""
  on_tpu = jax.default_backend() == "tpu"
  n = 8192 if on_tpu else 1024
  a = jnp.ones((n, n), dtype)
  flops = 2 * n ** 3 / _time(lambda a: a @ a, a)
  x = jnp.ones((256 if on_tpu else 16) * 2 ** 20, dtype)
  bw = 2 * x.nbytes / _time(lambda x: x + 1, x)  # read + write
  return flops, bw


def _report(name, seconds, flops, nbytes, peak_flops, peak_bw):
  print(f"  {name:<52s} {seconds * 1e3:9.3f} ms {flops / seconds / 1e9:9.3f} GFLOP/s ({flops / seconds / peak_flops:6.1%})"
        f" {nbytes / seconds / 1e9:8.3f} GB/s ({nbytes / seconds / peak_bw:6.1%})")


def _bench_cases(impl, dtype, B, T, N, K, H, S_cache, peak_flops, peak_bw, label):
  kq, kk, kl = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(kq, (B, T, N, H), dtype)
  k = jax.random.normal(kk, (B, T, K, H), dtype)
  item = jnp.dtype(dtype).itemsize
  # Useful FLOPs: causal attention is half of the 4*B*T*S*N*H of the full score matrix; backward = 2x forward.
  fwd_flops = 4 * B * T * T * N * H * 0.5
  qkvo_bytes = (2 * q.size + 2 * k.size) * item
  fwd = lambda q, k: attention(q, k, k, causal=True, impl=impl)
  _report(f"{label} attention fwd  B={B} T=S={T} N={N} K={K} H={H}", _time(fwd, q, k), fwd_flops, qkvo_bytes,
          peak_flops, peak_bw)
  grad = jax.grad(lambda q, k: jnp.sum(fwd(q, k).astype(jnp.float32)), argnums=(0, 1))
  _report(f"{label} attention fwd+bwd", _time(grad, q, k), 3 * fwd_flops, 3 * qkvo_bytes, peak_flops, peak_bw)
  # Ragged decode: lengths uniform in [1, S]; traffic counted for the valid cache rows only.
  cache = jax.random.normal(kk, (B, K, S_cache, H), dtype)
  lengths = jax.random.randint(kl, (B,), 1, S_cache + 1)
  total = int(lengths.sum())
  dec = lambda q, c, lengths: decode_attention(q, c, c, lengths, impl=impl)
  _report(f"{label} decode B={B} S={S_cache} sum(len)={total}", _time(dec, q[:, 0], cache, lengths),
          4 * total * N * H, (2 * total * K * H + 2 * B * N * H) * item, peak_flops, peak_bw)


def _benchmark():
  backend = jax.default_backend()
  on_tpu = backend == "tpu"
  dtype = jnp.bfloat16 if on_tpu else jnp.float32
  peak_flops, peak_bw = _measured_roofline(dtype)
  print(f"backend={backend} device={jax.devices()[0].device_kind} dtype={jnp.dtype(dtype).name}")
  print(f"measured roofline: matmul {peak_flops / 1e9:.1f} GFLOP/s, elementwise copy {peak_bw / 1e9:.2f} GB/s")
  print("  (per call; % = fraction of the measured roofline; FLOPs are useful causal FLOPs, bytes the minimum "
        "HBM traffic)")
  if on_tpu:
    _bench_cases("pallas", dtype, 8, 2048, 16, 4, 128, 4096, peak_flops, peak_bw, "pallas")
    _bench_cases("ref", dtype, 8, 2048, 16, 4, 128, 4096, peak_flops, peak_bw, "ref   ")
  else:
    _bench_cases("ref", dtype, 2, 512, 8, 2, 64, 2048, peak_flops, peak_bw, "ref")
    print(f"Pallas TPU kernels do not run natively on {backend}; below they run in TPU interpret mode (a "
          "simulator), tiny shapes, NOT a performance figure:")
    with pltpu.force_tpu_interpret_mode():
      _bench_cases("pallas", dtype, 1, 64, 2, 1, 32, 64, peak_flops, peak_bw, "interpret")


if __name__ == "__main__":
  _benchmark()
  sys.exit(0)
