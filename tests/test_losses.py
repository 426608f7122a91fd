"""Tests for losses.py: hand-computed cases, masking, gradients (finite differences in fp64, closed forms),
clip bounds, presets. Run: python -m pytest -q tests/test_losses.py"""
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import losses

sg = jax.lax.stop_gradient
# Jitted once per (config, shapes): eager op-by-op dispatch is far slower on the shared 2-core box.
PL = jax.jit(losses.policy_loss, static_argnums=0)


def naive_logp_entropy(logits, targets, temperature=1.0):
  ls = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
  logp = jnp.take_along_axis(ls, targets[..., None], axis=-1)[..., 0]
  return logp, -jnp.sum(jnp.exp(ls) * ls, axis=-1)


def rand_logits(seed, shape, scale=3.0):
  return jax.random.normal(jax.random.PRNGKey(seed), shape) * scale


# ---------------------------------------------------------------------------------------------------------------
# Log-probs and entropy.


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_and_entropy_match_naive(temperature):
  logits = rand_logits(0, (2, 5, 11))
  targets = jax.random.randint(jax.random.PRNGKey(1), (2, 5), 0, 11)
  logp, ent = jax.jit(losses.token_logprobs_and_entropy, static_argnums=2)(logits, targets, temperature)
  ref_lp, ref_ent = naive_logp_entropy(logits, targets, temperature)
  assert logp.dtype == jnp.float32 and ent.dtype == jnp.float32
  np.testing.assert_allclose(logp, ref_lp, atol=1e-5)
  np.testing.assert_allclose(ent, ref_ent, atol=1e-5)
  np.testing.assert_allclose(losses.token_logprobs(logits, targets, temperature), ref_lp, atol=1e-5)
  # bf16 logits still give fp32 log-probs of the (bf16-rounded) logits.
  lp16 = losses.token_logprobs(logits.astype(jnp.bfloat16), targets, temperature)
  assert lp16.dtype == jnp.float32
  np.testing.assert_allclose(lp16, naive_logp_entropy(logits.astype(jnp.bfloat16), targets, temperature)[0],
                             atol=1e-5)


def test_logprob_entropy_gradients_match_naive_autodiff():
  logits = rand_logits(2, (2, 4, 9))
  targets = jax.random.randint(jax.random.PRNGKey(3), (2, 4), 0, 9)
  c1, c2 = jax.random.normal(jax.random.PRNGKey(4), (2, 2, 4))

  def f(fn, temp):
    def g(l):
      lp, ent = fn(l, targets, temp)
      return jnp.sum(c1 * lp) + jnp.sum(c2 * ent)
    return g

  @jax.jit  # one compile for all the gradients (compiles dominate on the shared CPU box)
  def grads(l):
    return (jax.grad(f(losses.token_logprobs_and_entropy, 0.6))(l), jax.grad(f(naive_logp_entropy, 0.6))(l),
            jax.grad(lambda l: jnp.sum(c1 * losses.token_logprobs(l, targets)))(l),
            jax.grad(lambda l: jnp.sum(c1 * naive_logp_entropy(l, targets)[0]))(l))
  got, want, got_lp, want_lp = grads(logits)
  np.testing.assert_allclose(got, want, atol=1e-5)
  np.testing.assert_allclose(got_lp, want_lp, atol=1e-5)
  # The gradient comes back in the logits dtype (no fp32 [B,T,V] cotangent for bf16 logits).
  g16 = jax.jit(jax.grad(f(losses.token_logprobs_and_entropy, 1.0)))(logits.astype(jnp.bfloat16))
  assert g16.dtype == jnp.bfloat16


def test_logprobs_with_minus_inf_logits_are_finite():
  # Vocab masking with -inf (e.g. padded vocab rows): values and gradients stay finite.
  logits = rand_logits(5, (1, 3, 6)).at[..., 4:].set(-jnp.inf)
  targets = jnp.array([[0, 1, 2]])
  logp, ent = losses.token_logprobs_and_entropy(logits, targets)
  ref_lp, _ = naive_logp_entropy(logits[..., :4], targets)
  _, ref_ent = naive_logp_entropy(logits[..., :4], targets)
  np.testing.assert_allclose(logp, ref_lp, atol=1e-5)
  np.testing.assert_allclose(ent, ref_ent, atol=1e-5)
  g = jax.jit(jax.grad(lambda l: sum(map(jnp.sum, losses.token_logprobs_and_entropy(l, targets)))))(logits)
  assert bool(jnp.all(jnp.isfinite(g))) and bool(jnp.all(g[..., 4:] == 0))


def test_chunked_matches_full_values_and_grads():
  B, T, D, V = 2, 7, 5, 13  # T not a multiple of the chunk: exercises padding
  hidden = rand_logits(6, (B, T, D), 1.0)
  w = rand_logits(7, (D, V), 1.0)
  targets = jax.random.randint(jax.random.PRNGKey(8), (B, T), 0, V)

  def full(h, w):
    return losses.token_logprobs_and_entropy(jnp.einsum("btd,dv->btv", h, w), targets, 0.8)

  chunked = lambda h, w: losses.chunked_token_logprobs(h, w, targets, 3, 0.8)
  chunked_fn = lambda h, w: losses.chunked_token_logprobs(h, lambda x: jnp.einsum("bcd,dv->bcv", x, w), targets, 3,
                                                           0.8)
  obj = lambda fn: (lambda h, w: jnp.sum(fn(h, w)[0] * jnp.arange(T)) + jnp.sum(fn(h, w)[1]))

  @jax.jit
  def run(h, w):
    return ([fn(h, w) for fn in (chunked, chunked_fn, full)],
            [jax.grad(obj(fn), argnums=(0, 1))(h, w) for fn in (chunked, full)])

  vals, (ga, gb) = run(hidden, w)
  for v in vals[:2]:
    for a, b in zip(v, vals[2]):
      np.testing.assert_allclose(a, b, atol=1e-5)
  for a, b in zip(ga, gb):
    np.testing.assert_allclose(a, b, atol=1e-4)


def test_logprob_memory_below_naive_autodiff():
  # XLA CPU temp bytes for grad(sum logp) of bf16 logits: ours needs at most one fp32 [B,T,V] buffer,
  # naive log_softmax autodiff two (it keeps the fp32 softmax). See RESULTS.md for the figures.
  B, T, V = 2, 16, 2048
  logits = jnp.zeros((B, T, V), jnp.bfloat16)
  targets = jnp.zeros((B, T), jnp.int32)
  full = B * T * V * 4

  def temp(f):
    return jax.jit(jax.grad(f)).lower(logits).compile().memory_analysis().temp_size_in_bytes

  ours = temp(lambda l: jnp.sum(losses.token_logprobs(l, targets)))
  naive = temp(lambda l: jnp.sum(naive_logp_entropy(l, targets)[0]))
  assert ours <= 1.1 * full < naive, (ours, naive, full)


# ---------------------------------------------------------------------------------------------------------------
# Advantages.

R = jnp.array([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0], [2.0, 2.0, 2.0, 2.0]])


def test_grpo_and_dr_grpo_by_hand():
  a = losses.compute_advantages("grpo", R)
  # Row 0: mean .5, sample std sqrt(4 * .25 / 3) = 0.57735 -> +-0.866025. Row 1: mean .75, std 0.5.
  s = 0.5 / math.sqrt(1 / 3)
  np.testing.assert_allclose(a[0], [s, -s, -s, s], rtol=1e-5)
  np.testing.assert_allclose(a[1], [0.5, 0.5, 0.5, -1.5], rtol=1e-5)
  np.testing.assert_allclose(a[2], 0.0, atol=1e-6)  # zero-variance group: no signal, no NaN
  np.testing.assert_allclose(losses.compute_advantages("grpo", R, std_normalize=False)[1], [.25, .25, .25, -.75])
  np.testing.assert_allclose(losses.compute_advantages("dr_grpo", R)[0], [.5, -.5, -.5, .5])


def test_rloo_reinforce_by_hand():
  a = losses.compute_advantages("rloo", R)
  np.testing.assert_allclose(a[0], [1 - 1 / 3, 0 - 2 / 3, 0 - 2 / 3, 1 - 1 / 3], rtol=1e-6)
  np.testing.assert_allclose(a[1], [1 / 3, 1 / 3, 1 / 3, -1.0], rtol=1e-6)
  np.testing.assert_allclose(losses.compute_advantages("reinforce", R), R)


def test_reinforce_pp_by_hand():
  r = jnp.array([[1.0, 0.0], [3.0, 1.0]])
  # No baseline: global whitening of [1, 0, 3, 1]: mean 1.25, population std sqrt(1.1875).
  a = losses.compute_advantages("reinforce_pp", r, group_baseline=False, eps=0.0)
  np.testing.assert_allclose(a, (r - 1.25) / math.sqrt(1.1875), rtol=1e-5)
  # Group baseline: [.5, -.5, 1, -1]; mean 0, std sqrt(.625).
  a = losses.compute_advantages("reinforce_pp", r, group_baseline=True, eps=0.0)
  np.testing.assert_allclose(a, jnp.array([[.5, -.5], [1, -1]]) / math.sqrt(.625), rtol=1e-5)
  # Token-weighted (lengths 1,1,2,0): values [.5,-.5,1,-1] weights [1,1,2,0] -> mean .5, var (0+1+2*.25)/4.
  a = losses.compute_advantages("reinforce_pp", r, lengths=jnp.array([[1, 1], [2, 0]]), eps=0.0)
  np.testing.assert_allclose(a, (jnp.array([[.5, -.5], [1, -1]]) - .5) / math.sqrt(1.5 / 4), rtol=1e-5)


def test_advantage_errors():
  with pytest.raises(ValueError, match="gae"):
    losses.compute_advantages("gae", R)
  with pytest.raises(ValueError, match="G >= 2"):
    losses.compute_advantages("grpo", R[:, :1])
  with pytest.raises(ValueError, match=r"\[P,G\]"):
    losses.compute_advantages("grpo", R.reshape(-1))


def test_config_advantages_uses_cfg_options():
  cfg = dataclasses.replace(losses.ALGORITHMS["grpo"], std_normalize=False)
  np.testing.assert_allclose(losses.config_advantages(cfg, R), losses.compute_advantages("dr_grpo", R))


def test_gae_by_hand():
  r = jnp.array([[0.0, 0.0, 1.0]])
  v = jnp.array([[0.5, 0.6, 0.7]])
  m = jnp.ones((1, 3))
  a, ret = losses.gae(r, v, m, gamma=1.0, lam=1.0)  # Monte Carlo: A_t = 1 - V_t
  np.testing.assert_allclose(a, [[0.5, 0.4, 0.3]], rtol=1e-6)
  np.testing.assert_allclose(ret, [[1.0, 1.0, 1.0]], rtol=1e-6)
  a, _ = losses.gae(r, v, m, gamma=0.5, lam=1.0)  # sum_k gamma^k r_{t+k} - V_t
  np.testing.assert_allclose(a, [[0.25 - 0.5, 0.5 - 0.6, 0.3]], rtol=1e-6)
  a, _ = losses.gae(r, v, m, gamma=0.5, lam=0.0)  # one-step TD error
  np.testing.assert_allclose(a, [[0.5 * 0.6 - 0.5, 0.5 * 0.7 - 0.6, 0.3]], rtol=1e-6)
  # Bootstrap value V_T = 2 for a sequence cut off at T.
  a, _ = losses.gae(r, jnp.concatenate([v, jnp.array([[2.0]])], 1), m, gamma=1.0, lam=1.0)
  np.testing.assert_allclose(a, [[2.5, 2.4, 2.3]], rtol=1e-6)
  # A masked token is skipped (value there is ignored) and right padding ends the episode.
  r4 = jnp.array([[0.0, 9.0, 1.0, 5.0]])
  v4 = jnp.array([[0.5, 100.0, 0.7, 100.0]])
  m4 = jnp.array([[1, 0, 1, 0]])
  a4, _ = losses.gae(r4, v4, m4, gamma=0.5, lam=0.5)
  a2, _ = losses.gae(jnp.array([[0.0, 1.0]]), jnp.array([[0.5, 0.7]]), jnp.ones((1, 2)), gamma=0.5, lam=0.5)
  np.testing.assert_allclose(a4[:, [0, 2]], a2, rtol=1e-6)
  np.testing.assert_allclose(a4[:, [1, 3]], 0.0)


def test_value_loss_by_hand():
  v, ret, old = jnp.array([[1.0, 2.0]]), jnp.array([[0.0, 0.0]]), jnp.array([[0.5, 0.5]])
  m = jnp.ones((1, 2))
  np.testing.assert_allclose(losses.value_loss(v, ret, m), (0.5 + 2.0) / 2)
  # clip 0.2: V_clip = [.7, .7] -> max(err, (.7)^2): [1, 4] -> mean(0.5 * [1, 4]).
  np.testing.assert_allclose(losses.value_loss(v, ret, m, old_values=old, clip=0.2), (0.5 + 2.0) / 2)
  v2 = jnp.array([[0.0, 0.1]])  # clipped values are farther: V_clip = [.3, .3]
  np.testing.assert_allclose(losses.value_loss(v2, ret, m, old_values=old, clip=0.2), 0.5 * 0.09, rtol=1e-6)
  # clip_frac: valid tokens where the clipped branch is the larger ([0, 2]: token 0 only), 0 without a clip.
  v3 = jnp.array([[0.0, 2.0]])
  _, frac = losses.value_loss(v3, ret, m, old_values=old, clip=0.2, with_clip_frac=True)
  np.testing.assert_allclose(frac, 0.5)
  np.testing.assert_allclose(losses.value_loss(v3, ret, jnp.array([[0, 1]]), old_values=old, clip=0.2,
                                               with_clip_frac=True)[1], 0.0)
  assert float(losses.value_loss(v3, ret, m, with_clip_frac=True)[1]) == 0


# ---------------------------------------------------------------------------------------------------------------
# KL, shaping, aggregation.


def test_kl_estimators_by_hand():
  logp, ref = jnp.array([-1.0, -2.0]), jnp.array([-1.5, -1.0])
  d = ref - logp  # [-.5, 1]
  np.testing.assert_allclose(losses.kl_penalty(logp, ref, "k1"), -d)
  np.testing.assert_allclose(losses.kl_penalty(logp, ref, "k2"), 0.5 * d * d)
  np.testing.assert_allclose(losses.kl_penalty(logp, ref, "k3"), jnp.exp(d) - 1 - d, rtol=1e-6)
  with pytest.raises(ValueError, match="k4"):
    losses.kl_penalty(logp, ref, "k4")


def test_overlong_shaping_by_hand():
  pen = losses.overlong_shaping(jnp.array([10, 16, 17, 18, 20, 21]), max_len=20, buffer=4)
  np.testing.assert_allclose(pen, [0, 0, -0.25, -0.5, -1.0, -1.0])
  with pytest.raises(ValueError, match="buffer"):
    losses.overlong_shaping(jnp.array([1]), max_len=20, buffer=0)


def test_aggregate_by_hand():
  x = jnp.array([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [7.0, 7.0, 7.0]])
  m = jnp.array([[1, 1, 1], [1, 0, 0], [0, 0, 0]])  # last row is all padding: no effect
  np.testing.assert_allclose(losses.aggregate(x, m, "token_mean"), 10 / 4)
  np.testing.assert_allclose(losses.aggregate(x, m, "seq_mean_token_mean"), (2 + 4) / 2)
  np.testing.assert_allclose(losses.aggregate(x, m, "seq_mean_token_sum"), (6 + 4) / 2 / 3)
  np.testing.assert_allclose(losses.aggregate(x, m, "seq_mean_token_sum", max_tokens=10), (6 + 4) / 2 / 10)
  np.testing.assert_allclose(losses.aggregate(x, jnp.zeros_like(m), "token_mean"), 0.0)
  with pytest.raises(ValueError, match="mode"):
    losses.aggregate(x, m, "sum")


# ---------------------------------------------------------------------------------------------------------------
# Policy losses: hand cases.


def cfg_of(**kw):
  return losses.LossConfig(**kw)


def test_ppo_by_hand():
  cfg = cfg_of(policy_loss="ppo", eps_low=0.2, eps_high=0.28, agg="token_mean")
  old = jnp.zeros((1, 4))
  ratio = jnp.array([[1.1, 1.5, 0.5, 0.5]])
  adv = jnp.array([[1.0, 1.0, 1.0, -1.0]])
  loss, m = PL(cfg, jnp.log(ratio), old, adv, jnp.ones((1, 4)), prox_logp=old)  # pi_prox = mu: no weight
  # min(rA, clip(r)A): 1.1, 1.28 (clipped high), 0.5 (A>0, r low: unclipped), -0.8 (clipped low).
  np.testing.assert_allclose(loss, -(1.1 + 1.28 + 0.5 - 0.8) / 4, rtol=1e-6)
  np.testing.assert_allclose([m["clip_frac_high"], m["clip_frac_low"], m["clip_frac"]], [.25, .25, .5])
  np.testing.assert_allclose([m["ratio_min"], m["ratio_max"], m["ratio_mean"]], [0.5, 1.5, 0.9], rtol=1e-6)
  # Dual clip c = 3 bounds the negative-advantage objective below by cA.
  cfg = cfg_of(policy_loss="ppo", dual_clip_c=3.0)
  loss, m = PL(cfg, jnp.log(jnp.array([[5.0, 2.0]])), jnp.zeros((1, 2)), jnp.array([[-1.0, -1.0]]),
                jnp.ones((1, 2)), prox_logp=jnp.zeros((1, 2)))
  np.testing.assert_allclose(loss, -(-3.0 - 2.0) / 2, rtol=1e-6)
  np.testing.assert_allclose(m["dual_clip_frac"], 0.5)


def test_policy_loss_accepts_per_sequence_advantages():
  cfg = cfg_of(policy_loss="reinforce")
  logp = jnp.array([[-1.0, -2.0], [-3.0, -4.0]])
  l1, _ = PL(cfg, logp, logp, jnp.array([1.0, 2.0]), jnp.ones((2, 2)))
  l2, _ = PL(cfg, logp, logp, jnp.array([[1.0, 1.0], [2.0, 2.0]]), jnp.ones((2, 2)))
  np.testing.assert_allclose(l1, l2)
  np.testing.assert_allclose(l1, -(1 * -3 + 2 * -7) / 4)


def test_gspo_by_hand():
  cfg = cfg_of(policy_loss="gspo", eps_low=0.1, eps_high=0.1, agg="seq_mean_token_mean")
  # Seq 0: token ratios e^.1, e^-.05 -> s = e^.025 (inside); seq 1: ratios e^.4, e^.2 -> s = e^.3 (clipped, A>0).
  logp = jnp.array([[0.1, -0.05], [0.4, 0.2]]) - 1.0
  old = jnp.full((2, 2), -1.0)
  loss, m = PL(cfg, logp, old, jnp.array([2.0, 1.0]), jnp.ones((2, 2)), prox_logp=old)
  np.testing.assert_allclose(loss, -(math.exp(0.025) * 2 + 1.1 * 1) / 2, rtol=1e-6)
  np.testing.assert_allclose(m["clip_frac_high"], 0.5)
  np.testing.assert_allclose(m["ratio_max"], math.exp(0.3), rtol=1e-6)


def test_cispo_and_reinforce_by_hand():
  logp = jnp.log(jnp.array([[0.5, 0.25]]))
  old = jnp.log(jnp.array([[0.25, 0.25]]))  # ratios 2, 1
  adv = jnp.array([[1.0, -1.0]])
  cfg = cfg_of(policy_loss="cispo", cispo_eps_high=0.5)  # weights clip(2) = 1.5, 1
  loss, m = PL(cfg, logp, old, adv, jnp.ones((1, 2)), prox_logp=old)
  np.testing.assert_allclose(loss, -(1.5 * math.log(0.5) - 1 * math.log(0.25)) / 2, rtol=1e-6)
  np.testing.assert_allclose(m["clip_frac_high"], 0.5)
  loss, _ = PL(cfg_of(policy_loss="reinforce"), logp, old, adv, jnp.ones((1, 2)), prox_logp=old)
  np.testing.assert_allclose(loss, -(math.log(0.5) - math.log(0.25)) / 2, rtol=1e-6)


def test_kl_and_entropy_terms_by_hand():
  logp = jnp.array([[-1.0, -2.0]])
  ref = jnp.array([[-1.5, -1.0]])
  ent = jnp.array([[0.3, 0.5]])
  cfg = cfg_of(policy_loss="reinforce", kl_coef=0.1, kl_estimator="k2", entropy_coef=0.01)
  loss, m = PL(cfg, logp, logp, jnp.zeros(1), jnp.ones((1, 2)), ref_logp=ref, entropy=ent)
  kl = (0.5 * 0.25 + 0.5 * 1.0) / 2
  np.testing.assert_allclose(m["kl"], kl, rtol=1e-6)
  np.testing.assert_allclose(loss, 0.1 * kl - 0.01 * 0.4, rtol=1e-6)
  np.testing.assert_allclose(m["entropy"], 0.4, rtol=1e-6)


def test_kl_in_reward_subtracts_kl_to_go():
  # REINFORCE, token_mean: d loss / d logp_t = -(A - beta * sum_{s>=t} k1_s) / N (the KL term has no gradient).
  logp = jnp.array([[-1.0, -2.0, -0.5, 0.0]])
  ref = jnp.array([[-1.5, -1.0, -0.5, 0.0]])
  m = jnp.array([[1, 1, 1, 0]])
  cfg = cfg_of(policy_loss="reinforce", kl_coef=0.5, kl_estimator="k1", kl_mode="reward")
  g = jax.grad(lambda lp: PL(cfg, lp, sg(lp), jnp.array([1.0]), m, ref_logp=ref)[0])(logp)
  k1 = jnp.array([0.5, -1.0, 0.0])
  to_go = jnp.array([k1.sum(), k1[1:].sum(), k1[2:].sum()])
  np.testing.assert_allclose(g[0, :3], -(1.0 - 0.5 * to_go) / 3, rtol=1e-6)
  assert float(g[0, 3]) == 0.0


def test_truncated_is_and_ratio_masking_by_hand():
  logp = jnp.zeros((2, 2))
  mu = jnp.log(jnp.array([[0.5, 2.0], [1.0, 0.25]]))  # behaviour
  prox = jnp.zeros((2, 2))  # pi_prox / mu = [[2, .5], [1, 4]]
  adv = jnp.ones(2)
  mask = jnp.ones((2, 2))
  cfg = cfg_of(policy_loss="reinforce", tis_cap=3.0, tis_level="token")
  g = jax.grad(lambda lp: PL(cfg, lp, mu, adv, mask, prox_logp=sg(lp) * 0 + prox)[0])(logp)
  np.testing.assert_allclose(g, -jnp.array([[2.0, 0.5], [1.0, 3.0]]) / 4, rtol=1e-6)  # min(ratio, 3)
  _, m = PL(cfg, logp, mu, adv, mask, prox_logp=prox)
  np.testing.assert_allclose([m["is_weight_mean"], m["is_weight_max"]], [6.5 / 4, 3.0], rtol=1e-6)
  # Sequence level: products 1 and 4 -> weights 1 and min(4, 3) = 3 for every token of the sequence.
  cfg = cfg_of(policy_loss="reinforce", tis_cap=3.0, tis_level="sequence")
  g = jax.grad(lambda lp: PL(cfg, lp, mu, adv, mask, prox_logp=prox)[0])(logp)
  np.testing.assert_allclose(g, -jnp.array([[1.0, 1.0], [3.0, 3.0]]) / 4, rtol=1e-6)
  # Without prox_logp (one update per batch) pi_prox is the current policy: here the same zeros.
  np.testing.assert_allclose(jax.grad(lambda lp: PL(cfg, lp, mu, adv, mask)[0])(logp), g, rtol=1e-6)
  # Masking: rho outside [1/3, 3] is dropped (the 4); the other three tokens are averaged (weights off).
  cfg = cfg_of(policy_loss="reinforce", mask_ratio_cap=3.0, tis_cap=None)
  g = jax.grad(lambda lp: PL(cfg, lp, mu, adv, mask, prox_logp=prox)[0])(logp)
  np.testing.assert_allclose(g, -jnp.array([[1.0, 1.0], [1.0, 0.0]]) / 3, rtol=1e-6)
  _, m = PL(cfg, logp, mu, adv, mask, prox_logp=prox)
  np.testing.assert_allclose([m["masked_frac"], m["behav_abs_logratio_max"]], [0.25, math.log(4)], rtol=1e-6)


def test_decoupled_ppo_ratio_uses_prox():
  cfg = cfg_of(policy_loss="ppo", eps_low=0.2, eps_high=0.2)
  logp, prox, mu = jnp.log(jnp.array([[1.5]])), jnp.zeros((1, 1)), jnp.log(jnp.array([[0.1]]))
  _, m = PL(cfg, logp, mu, jnp.ones(1), jnp.ones((1, 1)), prox_logp=prox)
  np.testing.assert_allclose(m["ratio_mean"], 1.5, rtol=1e-6)  # pi / pi_prox, not pi / mu = 15
  np.testing.assert_allclose(m["behav_ratio_mean"], 10.0, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# Masking, gradients, clip bounds.

VARIANTS = {
    "ppo_dual": dict(policy_loss="ppo", eps_low=0.2, eps_high=0.28, dual_clip_c=3.0),
    "gspo": dict(policy_loss="gspo", eps_low=0.1, eps_high=0.1, agg="seq_mean_token_mean", tis_level="sequence"),
    "cispo": dict(policy_loss="cispo", cispo_eps_low=0.5, cispo_eps_high=0.2),
    "reinforce_sum": dict(policy_loss="reinforce", agg="seq_mean_token_sum", max_tokens=8),
    "ppo_k1_ent": dict(policy_loss="ppo", kl_coef=0.1, kl_estimator="k1", entropy_coef=0.01,
                       agg="seq_mean_token_mean"),
    "ppo_k2_reward": dict(policy_loss="ppo", kl_coef=0.1, kl_estimator="k2", kl_mode="reward"),
    "cispo_k3_tis": dict(policy_loss="cispo", kl_coef=0.1, kl_estimator="k3", tis_cap=1.5),
    "ppo_seq_tis_mask": dict(policy_loss="ppo", tis_cap=2.0, tis_level="sequence", mask_ratio_cap=1.4),
}


def make_batch(seed, B=3, T=4, dtype=jnp.float32):
  k = jax.random.split(jax.random.PRNGKey(seed), 6)
  old = -jnp.abs(jax.random.normal(k[0], (B, T), dtype)) - 0.5
  logp = old + 0.3 * jax.random.normal(k[1], (B, T), dtype)
  prox = old + 0.3 * jax.random.normal(k[2], (B, T), dtype)
  ref = old + 0.3 * jax.random.normal(k[3], (B, T), dtype)
  ent = jnp.abs(jax.random.normal(k[4], (B, T), dtype))
  adv = jax.random.normal(k[5], (B,), dtype)
  mask = jnp.array([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])[:B, :T]
  return logp, old, prox, ref, ent, adv, mask


def call(cfg, logp, old, prox, ref, ent, adv, mask):
  return PL(cfg, logp, old, adv, mask, ref_logp=ref, entropy=ent, prox_logp=prox)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_padding_has_no_effect_and_no_gradient(name):
  cfg = cfg_of(**VARIANTS[name])
  logp, old, prox, ref, ent, adv, mask = make_batch(0)
  pad = mask == 0
  garbage = lambda x, v: jnp.where(pad, v, x)

  @jax.jit
  def run(logp, old, prox, ref, ent):
    loss = call(cfg, logp, old, prox, ref, ent, adv, mask)[0]
    bad = (garbage(logp, 50.0), garbage(old, -jnp.inf), garbage(prox, jnp.nan), garbage(ref, jnp.inf),
           garbage(ent, jnp.nan))
    loss2 = call(cfg, *bad, adv, mask)[0]
    grads = jax.grad(lambda lp, e: call(cfg, lp, bad[1], prox, ref, e, adv, mask)[0], argnums=(0, 1))(bad[0], ent)
    return loss, loss2, grads

  loss, loss2, (g_logp, g_ent) = run(logp, old, prox, ref, ent)
  np.testing.assert_allclose(loss2, loss, rtol=1e-6)
  assert bool(jnp.all(jnp.isfinite(g_logp))) and bool(jnp.all(g_logp[pad] == 0)) and bool(jnp.all(g_ent[pad] == 0))
  assert bool(jnp.any(g_logp[~pad] != 0))


# CISPO's loss -sg(w) A log pi is a surrogate whose value is not the integral of its gradient (the stop-gradient
# weight moves with log pi), so finite differences do not apply; its gradient is checked in closed form below.
@pytest.mark.parametrize("name", [n for n in VARIANTS if not n.startswith("cispo")])
def test_gradient_matches_finite_differences_fp64(name):
  cfg = cfg_of(**VARIANTS[name])
  with jax.enable_x64(True):
    logp, old, prox, ref, ent, adv, mask = make_batch(1, dtype=jnp.float64)
    f = lambda lp, e: call(cfg, lp, old, prox, ref, e, adv, mask)[0]
    h = 1e-6
    eye = h * jnp.eye(logp.size, dtype=jnp.float64).reshape(-1, *logp.shape)  # one perturbation per entry

    @jax.jit
    def run(lp, e):
      central = lambda df: (jax.vmap(lambda d: df(d) - df(-d))(eye) / (2 * h)).reshape(lp.shape)
      return (jax.grad(f, argnums=(0, 1))(lp, e), central(lambda d: f(lp + d, e)), central(lambda d: f(lp, e + d)))

    (g_lp, g_ent), fd_lp, fd_ent = run(logp, ent)
    assert g_lp.dtype == jnp.float64
    np.testing.assert_allclose(g_lp, fd_lp, atol=1e-7)
    np.testing.assert_allclose(g_ent, fd_ent, atol=1e-7)
    assert np.abs(fd_lp).max() > 1e-3  # the check is not vacuous


def test_gradients_closed_form():
  logp, old, _, _, _, adv, mask = make_batch(2)
  r = jnp.exp(logp - old)
  A = jnp.broadcast_to(adv[:, None], logp.shape)
  m = mask.astype(jnp.float32)
  n = m.sum()
  # PPO with a clip range wide enough to never engage: -r A / N.
  g = jax.grad(lambda lp: PL(cfg_of(eps_low=0.99, eps_high=100.0), lp, old, adv, mask, prox_logp=old)[0])(logp)
  np.testing.assert_allclose(g, -r * A * m / n, rtol=1e-5, atol=1e-7)
  # CISPO + k3 KL in the loss + token TIS against prox: -w clip(r) A / N + beta (1 - e^(ref - logp)) / N
  # (without KL/TIS this is -clip(r) A / N, for every token).
  logp, old, prox, ref, _, adv, mask = make_batch(4)
  cfg = cfg_of(policy_loss="cispo", cispo_eps_low=0.1, cispo_eps_high=0.1, kl_coef=0.1, tis_cap=1.2)
  g = jax.grad(lambda lp: PL(cfg, lp, old, adv, mask, ref_logp=ref, prox_logp=prox)[0])(logp)
  r = jnp.exp(logp - prox)
  w = jnp.minimum(jnp.exp(prox - old), 1.2)
  A = jnp.broadcast_to(adv[:, None], logp.shape)
  want = (-w * jnp.clip(r, 0.9, 1.1) * A + 0.1 * (1 - jnp.exp(ref - logp))) * m / n
  np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-7)
  # GSPO unclipped, seq_mean_token_mean: -s_b A_b / (n_b * B_valid).
  cfg = cfg_of(policy_loss="gspo", eps_low=0.99, eps_high=100.0, agg="seq_mean_token_mean")
  g = jax.grad(lambda lp: PL(cfg, lp, old, adv, mask, prox_logp=old)[0])(logp)
  nb = m.sum(1, keepdims=True)
  s = jnp.exp(jnp.sum((logp - old) * m, 1, keepdims=True) / nb)
  np.testing.assert_allclose(g, -s * A * m / (nb * logp.shape[0]), rtol=1e-5, atol=1e-7)


def grad_at_ratio(cfg, ratio, adv):
  old = jnp.full((1, 1), -1.0, jnp.float64)
  logp = old + jnp.log(ratio)
  return float(jax.grad(lambda lp: PL(cfg, lp, old, jnp.array([adv]), jnp.ones((1, 1)), prox_logp=old)[0])(logp)[0, 0])


def test_ppo_clip_engages_exactly_at_bounds():
  cfg = cfg_of(policy_loss="ppo", eps_low=0.2, eps_high=0.28, dual_clip_c=3.0)
  d = 1e-7
  with jax.enable_x64(True):
    for bound, adv in ((1.28, 1.0), (0.8, -1.0)):
      beyond = bound + d if adv > 0 else bound - d
      inside = bound - d if adv > 0 else bound + d
      assert grad_at_ratio(cfg, beyond, adv) == 0.0
      np.testing.assert_allclose(grad_at_ratio(cfg, inside, adv), -inside * adv, rtol=1e-6)
      # The other sign of the advantage is never clipped on this side.
      assert grad_at_ratio(cfg, beyond, -adv) != 0.0
    assert grad_at_ratio(cfg, 3.0 + d, -1.0) == 0.0  # dual clip
    np.testing.assert_allclose(grad_at_ratio(cfg, 3.0 - d, -1.0), 3.0 - d, rtol=1e-6)


def test_gspo_and_cispo_clip_at_bounds():
  d = 1e-7
  with jax.enable_x64(True):
    gspo = cfg_of(policy_loss="gspo", eps_low=3e-4, eps_high=4e-4, agg="seq_mean_token_mean")
    assert grad_at_ratio(gspo, 1 + 4e-4 + d, 1.0) == 0.0
    assert grad_at_ratio(gspo, 1 + 4e-4 - d, 1.0) != 0.0
    assert grad_at_ratio(gspo, 1 - 3e-4 - d, -1.0) == 0.0
    assert grad_at_ratio(gspo, 1 - 3e-4 + d, -1.0) != 0.0
    # CISPO never cuts the gradient: the weight saturates at the bound.
    cispo = cfg_of(policy_loss="cispo", cispo_eps_low=0.5, cispo_eps_high=0.2)
    np.testing.assert_allclose(grad_at_ratio(cispo, 1.2 + d, 1.0), -1.2, rtol=1e-12)
    np.testing.assert_allclose(grad_at_ratio(cispo, 1.2 - d, 1.0), -(1.2 - d), rtol=1e-12)
    np.testing.assert_allclose(grad_at_ratio(cispo, 0.5 - d, 1.0), -0.5, rtol=1e-12)
    np.testing.assert_allclose(grad_at_ratio(cispo, 5.0, 1.0), -1.2, rtol=1e-12)


def test_clip_fraction_metrics_engage_at_bounds():
  cfg = cfg_of(policy_loss="ppo", eps_low=0.2, eps_high=0.28)
  ratio = jnp.array([[1.28 - 1e-4, 1.28 + 1e-4, 0.8 + 1e-4, 0.8 - 1e-4]])
  _, m = PL(cfg, jnp.log(ratio), jnp.zeros((1, 4)), jnp.array([[1.0, 1.0, -1.0, -1.0]]), jnp.ones((1, 4)),
            prox_logp=jnp.zeros((1, 4)))
  np.testing.assert_allclose([m["clip_frac_high"], m["clip_frac_low"]], [0.25, 0.25])


# ---------------------------------------------------------------------------------------------------------------
# Presets and config.


def test_all_algorithms_present_and_selectable_by_name():
  names = {"ppo", "grpo", "dr_grpo", "dapo", "gspo", "cispo", "rloo", "reinforce_pp", "star"}
  assert names <= set(losses.ALGORITHMS)
  assert {c.policy_loss for c in losses.ALGORITHMS.values()} == set(losses.POLICY_LOSSES)
  # train.py's selection: preset by name, then field overrides.
  cfg = dataclasses.replace(losses.ALGORITHMS["dapo"], kl_coef=0.01, tis_cap=2.0)
  assert (cfg.eps_low, cfg.eps_high, cfg.agg, cfg.kl_coef) == (0.2, 0.28, "token_mean", 0.01)
  with pytest.raises(ValueError, match="LossConfig.agg"):
    dataclasses.replace(losses.ALGORITHMS["grpo"], agg="mean")


def test_a_new_family_is_a_function_and_its_name(monkeypatch):
  # The README's recipe: a function of per-token arrays, its name in POLICY_LOSSES, a LossConfig naming it.
  double = lambda cfg, logp, log_ratio, adv, w, keep: (-w * adv * logp * 2.0, {})  # noqa: E731
  monkeypatch.setitem(losses.POLICY_LOSSES, "double_reinforce", double)
  logp, old, prox, ref, ent, adv, mask = make_batch(5)
  l2, m2 = losses.policy_loss(cfg_of(policy_loss="double_reinforce"), logp, old, adv, mask)
  l1, m1 = losses.policy_loss(cfg_of(policy_loss="reinforce"), logp, old, adv, mask)
  np.testing.assert_allclose(l2, 2 * l1, rtol=1e-6)
  assert list(m2) == list(m1) and float(m2["clip_frac"]) == 0.0


@pytest.mark.parametrize("name", sorted(losses.ALGORITHMS))
def test_every_algorithm_runs_jitted_with_finite_loss_and_grads(name):
  cfg = losses.ALGORITHMS[name]
  logp, old, prox, ref, ent, _, mask = make_batch(3)
  rewards = jnp.array([[1.0, 0.0, 1.0]])
  if cfg.advantage == "gae":
    values = jnp.full(logp.shape, 0.5)
    tok_r = jnp.zeros(logp.shape).at[:, -1].set(rewards[0])
    adv, _ = losses.gae(tok_r, values, mask)
  else:
    adv = losses.config_advantages(cfg, rewards, lengths=mask.sum(1)[None]).reshape(-1)

  @jax.jit
  def step(lp, e):
    return jax.value_and_grad(lambda lp, e: PL(cfg, lp, old, adv, mask, ref_logp=ref, entropy=e),
                              argnums=(0, 1), has_aux=True)(lp, e)

  (loss, metrics), grads = step(logp, ent)
  assert bool(jnp.isfinite(loss)) and all(bool(jnp.all(jnp.isfinite(g))) for g in grads)
  assert bool(jnp.any(grads[0] != 0))
  for k, v in metrics.items():
    assert v.shape == () and bool(jnp.isfinite(v)), (k, v)


def test_loss_config_rejects_bad_values():
  for field, value in (("policy_loss", "sac"), ("eps_low", 1.0), ("dual_clip_c", 0.5), ("tis_cap", 0.0),
                       ("mask_ratio_cap", 1.0), ("kl_mode", "both"), ("max_tokens", 0), ("tis_level", "batch")):
    with pytest.raises(ValueError, match=f"LossConfig.{field}"):
      losses.LossConfig(**{field: value})


def test_policy_loss_input_errors():
  cfg = losses.ALGORITHMS["grpo"]
  x = jnp.zeros((2, 3))
  with pytest.raises(ValueError, match="ref_logp"):
    losses.policy_loss(cfg, x, x, jnp.zeros(2), x)
  with pytest.raises(ValueError, match="advantages"):
    losses.policy_loss(cfg, x, x, jnp.zeros(3), x, ref_logp=x)
  with pytest.raises(ValueError, match="old_logp"):
    losses.policy_loss(cfg, x, x[:1], jnp.zeros(2), x, ref_logp=x)
  with pytest.raises(ValueError, match="temperature"):
    losses.token_logprobs(jnp.zeros((1, 2, 3)), jnp.zeros((1, 2), jnp.int32), 0.0)


# ---------------------------------------------------------------------------------------------------------------
# Off-policy correction by construction: every preset, data from a behaviour policy mu != pi_prox (stale data
# trained with several updates per batch), against gradients computed by hand from the papers' formulas.

def hand_grad(cfg, logp, prox, mu, ref, adv, mask):
  """d loss / d logp by hand (numpy), for the presets' pieces: decoupled PPO with the capped behaviour weight."""
  m = mask.astype(bool)
  B, T = logp.shape
  A = np.broadcast_to(adv[:, None], (B, T)).astype(np.float64)
  if cfg.kl_coef and cfg.kl_mode == "reward":  # k1 KL-to-go from the fixed pi_prox, off the advantages
    k1 = np.where(m, prox - ref, 0)
    A = A - cfg.kl_coef * np.flip(np.cumsum(np.flip(k1, -1), -1), -1)
  w = np.minimum(np.exp(prox - mu), cfg.tis_cap)  # the behaviour weight pi_prox / mu, capped
  if cfg.tis_level == "sequence":
    w = np.broadcast_to(np.minimum(np.exp(np.where(m, prox - mu, 0).sum(-1)), cfg.tis_cap)[:, None], (B, T))
  r = np.exp(logp - prox)
  lo, hi = 1 - cfg.eps_low, 1 + cfg.eps_high
  if cfg.policy_loss == "ppo":
    g = np.where(((r > hi) & (A > 0)) | ((r < lo) & (A < 0)), 0.0, -w * r * A)
  elif cfg.policy_loss == "gspo":
    s = np.exp(np.where(m, logp - prox, 0).sum(-1, keepdims=True) / m.sum(-1, keepdims=True))
    g = np.where(((s > hi) & (A > 0)) | ((s < lo) & (A < 0)), 0.0, -w * s * A)
  elif cfg.policy_loss == "cispo":
    g = -w * np.clip(r, 0.0, 1 + cfg.cispo_eps_high) * A
  else:  # reinforce
    g = -w * A
  if cfg.kl_coef and cfg.kl_mode == "loss":  # d/dlogp k3(logp, ref) = 1 - exp(ref - logp)
    g = g + cfg.kl_coef * (1 - np.exp(ref - logp))
  n_seq = (m.sum(-1) > 0).sum()
  scale = {"token_mean": np.full((B, 1), 1 / m.sum()),
           "seq_mean_token_mean": 1 / (m.sum(-1, keepdims=True) * n_seq),
           "seq_mean_token_sum": np.full((B, 1), 1 / (n_seq * (cfg.max_tokens or T)))}[cfg.agg]
  return np.where(m, g * scale, 0.0)


@pytest.mark.parametrize("name", sorted(losses.ALGORITHMS))
def test_every_preset_weighs_stale_data_by_pi_prox_over_mu_by_hand(name):
  cfg = losses.ALGORITHMS[name]
  assert cfg.tis_cap is not None  # on in every preset
  with jax.enable_x64(True):
    prox = jnp.array([[-1.0, -0.7, -2.0], [-0.4, -1.2, -0.9]], jnp.float64)
    logp = prox + jnp.array([[0.05, -0.1, 0.15], [0.1, -0.05, 0.0]])  # pi_theta after a first update
    mu = prox - jnp.log(jnp.array([[0.5, 1.5, 3.0], [1.2, 0.8, 0.6]]))  # pi_prox / mu: 0.5, 1.5, 3 (capped at 2)...
    if name == "gspo":  # its clip range is 3e-4: a ratio inside it in sequence 0, outside in sequence 1
      logp = prox + jnp.array([[1e-4, -1e-4, 2e-4], [0.1, -0.05, 0.0]])
    ref = prox - 0.3
    adv = jnp.array([1.0, -0.5])
    mask = jnp.array([[1, 1, 1], [1, 1, 0]])
    g = jax.grad(lambda lp: PL(cfg, lp, mu, adv, mask, ref_logp=ref, prox_logp=prox)[0])(logp)
    want = hand_grad(cfg, *(np.asarray(x, np.float64) for x in (logp, prox, mu, ref, adv, mask)))
    np.testing.assert_allclose(np.asarray(g), want, rtol=1e-9, atol=1e-12)
    assert np.abs(want).max() > 1e-3
    # mu matters: the same data from another behaviour policy gives another gradient.
    g2 = jax.grad(lambda lp: PL(cfg, lp, mu - 0.5, adv, mask, ref_logp=ref, prox_logp=prox)[0])(logp)
    assert np.abs(np.asarray(g2) - np.asarray(g)).max() > 1e-4
