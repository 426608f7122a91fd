"""pallas_kernels: the Pallas TPU kernels vs the jnp references, run on CPU under TPU interpret mode.

Values and gradients: fp32 within 1e-5, bf16 within 2e-2. Interpret mode compiles slowly (seconds per kernel
configuration), so each test checks the forward value and all three gradients from one jitted function.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import NamedSharding, PartitionSpec as P

import pallas_kernels as kernels
from pallas_kernels import flash

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
# Interpret-mode programs are large (every kernel ref access is a callback) and XLA:CPU spends most of the
# test time optimising them; the cheapest backend passes cut compile time by about a third.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _run(fn, *args):
  """jit + run fn(*args) with FAST_COMPILE."""
  return jax.jit(fn).lower(*args).compile(FAST_COMPILE)(*args)


def _qkv(key, B, T, S, N, K, H, dtype):
  kq, kk, kv, kd = jax.random.split(key, 4)
  q = jax.random.normal(kq, (B, T, N, H), jnp.float32).astype(dtype)
  k = jax.random.normal(kk, (B, S, K, H), jnp.float32).astype(dtype)
  v = jax.random.normal(kv, (B, S, K, H), jnp.float32).astype(dtype)
  do = jax.random.normal(kd, (B, T, N, H), jnp.float32).astype(dtype)
  return q, k, v, do


def _value_and_grads(fn, q, k, v, do):
  o, vjp = jax.vjp(fn, q, k, v)
  return (o, *vjp(do))


def _assert_close(got, want, tol, what):
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  # bf16: error relative to the tensor's scale (gradients are O(10)); fp32: elementwise atol + rtol.
  if tol >= 1e-3:
    err = np.abs(got - want).max() / max(1.0, np.abs(want).max())
    assert err <= tol, f"{what}: scaled max error {err:.3g} > {tol}"
  else:
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol, err_msg=what)


def _check_attention(B, T, S, N, K, H, dtype, causal, segment_ids, **blocks):
  q, k, v, do = _qkv(jax.random.key(T * 131 + N), B, T, S, N, K, H, dtype)

  def both(q, k, v, do):
    ker = _value_and_grads(lambda q, k, v: kernels.attention(q, k, v, segment_ids, causal=causal, impl="pallas",
                                                             **blocks), q, k, v, do)
    # The reference runs in fp32 on the same (possibly bf16-rounded) inputs: the truth the kernel should hit.
    f32 = lambda x: x.astype(jnp.float32)
    ref = _value_and_grads(lambda q, k, v: kernels.attention_reference(q, k, v, segment_ids, causal=causal),
                           f32(q), f32(k), f32(v), f32(do))
    return ker, ref

  with pltpu.force_tpu_interpret_mode():
    ker, ref = _run(both, q, k, v, do)
  for name, a, b in zip(("out", "dq", "dk", "dv"), ker, ref):
    assert a.dtype == dtype and a.shape == b.shape, (name, a.dtype, a.shape, b.shape)
    _assert_close(a, b, TOL[dtype], name)


def _packed_ids(B, T, cuts):
  """Segment ids 1, 2, ... split at `cuts`, then trailing padding id 0 from the last cut."""
  pos = jnp.arange(T)
  ids = sum((pos >= c).astype(jnp.int32) for c in cuts[:-1]) + 1
  ids = jnp.where(pos >= cuts[-1], 0, ids)
  return jnp.broadcast_to(ids, (B, T))


def test_flash_causal_segments_gqa2_non_multiple_blocks():
  # T=300 is not a multiple of block_q=64 or block_k=128 (padding path); bq != bk exercises the causal clamps. (With
  # segment ids TPU needs block_k a multiple of 128: the kv ids are a [1, block_k] row.)
  seg = _packed_ids(2, 300, cuts=(97, 217, 262))
  _check_attention(2, 300, 300, 4, 2, 32, jnp.float32, True, seg, block_q=64, block_k=128)


def test_flash_noncausal_gqa8_padded_keys():
  # GQA ratio 8 (one kv head), T != S, S=300 padded to 384 (block_k=128): padded keys masked without causality.
  _check_attention(1, 16, 300, 8, 1, 32, jnp.float32, False, None, block_q=8, block_k=128)


def test_flash_bf16_causal_segments():
  seg = _packed_ids(2, 256, cuts=(80, 256))
  _check_attention(2, 256, 256, 4, 2, 32, jnp.bfloat16, True, seg, block_q=128, block_k=128)


@pytest.mark.parametrize("T", [128, 300])
def test_causal_reference_skips_blocks_above_the_diagonal_exactly(T):
  # attention_reference splits causal queries into blocks that see only the keys up to their own end (nb = 2 at
  # T=128, 4 at T=300, uneven blocks); the unsplit T x T masked square is the definition it must keep.
  q, k, v, do = _qkv(jax.random.key(T), 2, T, T, 4, 2, 16, jnp.float32)
  seg = jnp.asarray(np.repeat([[1] * (T // 3) + [2] * (T - T // 3)], 2, 0), jnp.int32)
  square = lambda q, k, v: flash._attention_block(q, k, v, seg, seg, 0, 16 ** -0.5)  # noqa: E731
  blocked = jax.jit(lambda *a: _value_and_grads(lambda q, k, v: kernels.attention_reference(q, k, v, seg), *a))
  for name, a, b in zip(("out", "dq", "dk", "dv"), blocked(q, k, v, do), _value_and_grads(square, q, k, v, do)):
    _assert_close(a, b, 1e-5, name)


def _check_decode(B, S, N, K, H, dtype, lengths, block_s, mesh=None):
  key = jax.random.key(S + N)
  q, k, v, _ = _qkv(key, B, 1, S, N, K, H, dtype)
  q, k, v = q[:, 0], k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3)  # the cache layout: k [B,K,H,S], v [B,K,S,H]
  lengths = jnp.asarray(lengths, jnp.int32)
  valid = jnp.arange(S)[None, :] < lengths[:, None]
  vk, vv = valid[:, None, None, :], valid[:, None, :, None]
  # Poison every cache entry past a row's length: the kernel must neither read it into the result nor let
  # 0 * NaN through. The reference sees zeros there (its masked weights are exactly 0).
  with pltpu.force_tpu_interpret_mode():
    got = _run(lambda *a: kernels.decode_attention(*a, impl="pallas", mesh=mesh, block_s=block_s),
               q, jnp.where(vk, k, jnp.nan), jnp.where(vv, v, jnp.nan), lengths)
  want = kernels.decode_attention_reference(q.astype(jnp.float32), jnp.where(vk, k, 0).astype(jnp.float32),
                                            jnp.where(vv, v, 0).astype(jnp.float32), lengths)
  assert got.dtype == dtype and got.shape == (B, N, H)
  _assert_close(got, want, TOL[dtype], "decode")


def test_decode_ragged_gqa2_partial_last_block():
  # S=300 with block_s=128: the last block is partial. Lengths: 1, full, mid-block, exactly on a block boundary.
  _check_decode(4, 300, 4, 2, 32, jnp.float32, [1, 300, 141, 256], block_s=128)


def test_decode_bf16_gqa8():
  _check_decode(2, 160, 8, 1, 32, jnp.bfloat16, [3, 160], block_s=128)


def _mesh():
  return jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"))


def test_sharded_attention_matches_unsharded_reference():
  # Explicit-axis mesh passed as mesh=. N=K=2 over tensor=2: each shard runs GQA ratio 1 on one head, and the
  # default 128 blocks shrink to one 32-row block.
  mesh = _mesh()
  B, T, N, K, H = 4, 32, 2, 2, 32
  q, k, v, do = _qkv(jax.random.key(7), B, T, T, N, K, H, jnp.float32)
  seg = jnp.concatenate([_packed_ids(2, T, (9, 30)), _packed_ids(2, T, (20, 32))])
  spec = NamedSharding(mesh, P(("data", "fsdp"), None, "tensor", None))
  qs, ks, vs, dos = (jax.device_put(x, spec) for x in (q, k, v, do))
  fn = lambda q, k, v: kernels.attention(q, k, v, seg, impl="pallas", mesh=mesh)
  with pltpu.force_tpu_interpret_mode():
    ker = _run(lambda *a: _value_and_grads(fn, *a), qs, ks, vs, dos)
  ref = _value_and_grads(lambda q, k, v: kernels.attention_reference(q, k, v, seg), q, k, v, do)
  assert ker[0].sharding.spec == spec.spec  # stayed sharded: batch over data x fsdp, heads over tensor
  for name, a, b in zip(("out", "dq", "dk", "dv"), ker, ref):
    _assert_close(a, b, 1e-5, name)


def test_sharded_decode_context_mesh_with_fallback():
  # No mesh= argument: the context mesh (jax.set_mesh) selects the shard_map path. B=2 does not divide by
  # data x fsdp = 4, so the batch falls back to "data" only; N=K=2 split over tensor -> GQA ratio 1 per shard.
  mesh = _mesh()
  assert kernels._mesh_axes(mesh, 2, 2, 2) == (("data",), "tensor")
  assert kernels._mesh_axes(mesh, 8, 4, 1) == (("data", "fsdp"), None)  # K=1 cannot split: heads replicated
  with jax.set_mesh(mesh):
    assert kernels._resolve_mesh(None) is not None
    _check_decode(2, 24, 2, 2, 32, jnp.float32, [24, 5], block_s=256)
  assert kernels._resolve_mesh(None) is None


def test_bad_inputs_raise_clear_errors():
  q = jnp.zeros((2, 16, 4, 32))
  kv = jnp.zeros((2, 16, 2, 32))
  with pytest.raises(ValueError, match="block_q must be a positive multiple of 8"):
    kernels.attention(q, kv, kv, impl="pallas", block_q=12)
  with pytest.raises(ValueError, match="T == S"):
    kernels.attention(q, kv[:, :8], kv[:, :8], impl="pallas")
  with pytest.raises(ValueError, match="N=4 not a multiple of K=3"):
    kernels.attention(q, jnp.zeros((2, 16, 3, 32)), jnp.zeros((2, 16, 3, 32)), impl="pallas")
  with pytest.raises(ValueError, match="segment_ids must be"):  # checked on global shapes, before shard_map
    kernels.attention(q, kv, kv, jnp.zeros((2, 8), jnp.int32), impl="pallas", mesh=_mesh())
  with pytest.raises(ValueError, match="impl must be"):
    kernels.attention(q, kv, kv, impl="flash")
  k_cache, v_cache = kv.transpose(0, 2, 3, 1), kv.transpose(0, 2, 1, 3)  # [B,K,H,S], [B,K,S,H]
  with pytest.raises(ValueError, match="lengths must be"):
    kernels.decode_attention(q[:, 0], k_cache, v_cache, jnp.ones((3,), jnp.int32), impl="pallas")
  with pytest.raises(ValueError, match=r"k_cache \[B,K,H,S\]"):  # keys in the values' layout
    kernels.decode_attention(q[:, 0], v_cache, v_cache, jnp.ones((2,), jnp.int32), impl="pallas")
  with pytest.raises(ValueError, match="block_s must be a positive multiple of 128"):
    kernels.decode_attention(q[:, 0], k_cache, v_cache, jnp.ones((2,), jnp.int32), impl="pallas", block_s=64)


def test_auto_impl_is_reference_off_tpu():
  assert jax.default_backend() != "tpu"
  assert not kernels._use_pallas("auto") and kernels._use_pallas("pallas") and not kernels._use_pallas("ref")


def test_model_forward_grad_decode_pallas_matches_ref():
  # The whole model (2 layers, GQA 2, packed segments, ragged prefill + one decode step) under a
  # data x fsdp x tensor context mesh: attn_impl="pallas" (interpret mode) vs attn_impl="ref".
  import model as M
  cfg = M.Config(vocab_size=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffw_dim=64)
  mesh = M.make_mesh(2, 2, 2)
  B, T, S = 4, 16, 24
  key = jax.random.key(3)
  tokens = jax.random.randint(key, (B, T), 0, cfg.vocab_size)
  seg = jnp.concatenate([_packed_ids(2, T, (5, 12)), _packed_ids(2, T, (16, 16))])
  lengths = jnp.array([16, 1, 9, 4], jnp.int32)
  cot = jax.random.normal(jax.random.fold_in(key, 1), (B, T, cfg.vocab_size))

  def run(params, impl):
    loss = lambda p: jnp.sum(M.forward(p, cfg, tokens, segment_ids=seg, attn_impl=impl) * cot)
    value, grads = jax.value_and_grad(loss)(params)
    last, cache = M.prefill(params, cfg, tokens, lengths, M.init_cache(cfg, B, S), attn_impl=impl)
    step, cache = M.decode_step(params, cfg, jnp.argmax(last, -1), cache, attn_impl=impl)
    return value, grads, last, step

  with jax.set_mesh(mesh), pltpu.force_tpu_interpret_mode():
    params = M.shard_params(M.init_params(cfg, key), cfg, mesh)
    ref = _run(lambda p: run(p, "ref"), params)
    ker = _run(lambda p: run(p, "pallas"), params)
  names = ("loss", "grads", "prefill logits", "decode logits")
  for name, a, b in zip(names, ker, ref):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
      _assert_close(x, y, 1e-5, name)


# Lowering for TPU, on this CPU box: jax.export(..., platforms=["tpu"]) runs the Pallas TPU (Mosaic) lowering,
# which enforces TPU's block rules (the last two block dims a multiple of 8 and 128, or the whole array dim). The
# lowering asks the device kind for the chip's tiling; on CPU the answer is stubbed with a v5p's (jax's own table,
# tpu_info.registry), so a block-rule violation fails CI here rather than on a pod.
@pytest.mark.parametrize("heads", [(40, 8, 128), (14, 2, 64)], ids=["qwq32b", "qwen2.5-0.5b"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_kernels_lower_for_tpu_at_real_model_shapes(monkeypatch, heads, dtype):
  from jax import export
  from jax._src.pallas.mosaic import tpu_info
  monkeypatch.setitem(tpu_info.registry, "cpu",
                      lambda: tpu_info.get_tpu_info_for_chip(tpu_info.ChipVersion.TPU_V5P, 1))
  N, K, H = heads
  S = lambda *s, dt=dtype: jax.ShapeDtypeStruct(s, dt)  # noqa: E731
  for T, causal in ((512, True), (300, True), (300, False)):  # packed segments; T not a block multiple
    fwd_bwd = jax.value_and_grad(lambda q, k, v, s: kernels.flash.flash_attention(q, k, v, s, causal=causal).astype(
        jnp.float32).sum(), argnums=(0, 1, 2))
    exp = export.export(jax.jit(fwd_bwd), platforms=["tpu"])(S(1, T, N, H), S(1, T, K, H), S(1, T, K, H),
                                                            S(1, T, dt=jnp.int32))
    assert "tpu_custom_call" in exp.mlir_module()
  for Sc in (300, 1024):  # a partial last block (300 = 256 + 44) and whole blocks
    exp = export.export(jax.jit(kernels.decode.ragged_decode_attention), platforms=["tpu"])(
        S(4, N, H), S(4, K, H, Sc), S(4, K, Sc, H), S(4, dt=jnp.int32))
    assert "tpu_custom_call" in exp.mlir_module()
  # The kernel's own check follows the TPU rule: with segment ids the kv ids are a [1, block_k] row, so a block_k
  # that is not a multiple of 128 is refused before lowering (it lowered for CPU interpret mode, failed on TPU).
  with pytest.raises(ValueError, match="multiple of 128"):
    kernels.flash.flash_attention(jnp.zeros((1, 256, N, H), dtype), jnp.zeros((1, 256, K, H), dtype),
                                  jnp.zeros((1, 256, K, H), dtype), jnp.ones((1, 256), jnp.int32), block_k=64)
