"""Issue 16: PPO epochs over minibatches with a recomputed proximal policy and fixed V_old (value clipping), the
constant Dr. GRPO normaliser and the one dynamic-sampling criterion, all through train.py's step functions."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import data
import losses
import model
import train
from tests.test_train import CFG, groups


def _setup(lcfg, lr=1e-2, buckets=(16,), value_clip=0.0, seed=0, opt=None):
  m = model.make_mesh(1, 1, 1)
  jax.set_mesh(m)
  policy = model.shard_params(model.init_params(CFG, jax.random.PRNGKey(0)), CFG, m)
  # A non-zero value head (run_rl starts at 0), so V_old differs from the values of any later weights.
  value = (dict(w=0.05 * jax.random.normal(jax.random.PRNGKey(1), (CFG.d_model,)), b=jnp.zeros(()))
           if lcfg.advantage == "gae" else None)
  params = dict(policy=policy, value=value)
  opt = opt or train.make_optimizer(lr, 1, 10, 0.0, 1.0)
  opt_state = jax.tree.map(jnp.copy, opt.init(params))
  fn = lambda p, r, b: train.rl_loss(p, r, b, cfg=CFG, lcfg=lcfg, temperature=1.0,  # noqa: E731
                                     compute_dtype=jnp.float32, attn_impl="ref", value_coef=0.5,
                                     value_clip=value_clip)
  prox = lambda p, b: train.proximal(p, b, cfg=CFG, temperature=1.0, compute_dtype=jnp.float32,  # noqa: E731
                                     attn_impl="ref")
  batch, _, _ = train.rl_batch(groups(seed=seed), lcfg, 0, buckets, 8)
  return params, opt_state, opt, fn, prox, train.to_global(batch, NamedSharding(m, P(("data", "fsdp"))))


def test_one_epoch_one_minibatch_is_the_plain_update():
  lcfg = dataclasses.replace(losses.ALGORITHMS["grpo"], kl_coef=0.0)
  params, opt_state, opt, fn, prox, gb = _setup(lcfg, opt=optax.sgd(1e-2))  # SGD: see test_train's accumulation
  step = jax.jit(train.make_train_step(opt, fn, 1, lcfg.agg, epochs=1, minibatches=1, prox_fn=prox))
  new, _, m = step(params, opt_state, None, gb)
  (loss, _), g = jax.value_and_grad(fn, has_aux=True)(params, None, gb)
  upd, _ = opt.update(g, opt_state, params)
  want = optax.apply_updates(params, upd)
  for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)  # jit vs eager: ulp-level
  np.testing.assert_allclose(float(m["loss"]), float(loss), rtol=1e-6)


def test_two_epochs_clip_with_a_fixed_proximal_policy():
  lcfg = dataclasses.replace(losses.ALGORITHMS["grpo"], kl_coef=0.0, tis_cap=2.0)
  # seed 4: both groups have mixed rewards, so each minibatch (one group) has a non-zero gradient. (With seed 0 the
  # first group's rewards are all 0: the first update is a no-op, and a test that the second minibatch's ratio is
  # not 1 only passed while the proximal and the update's forward differed in the last bit.)
  params, opt_state, opt, fn, prox, gb = _setup(lcfg, lr=0.3, seed=4)
  # The proximal log-probs are a fresh forward of the step's starting weights, bit for bit.
  lp_prox = jax.jit(prox)(params, gb)["prox_logp"]
  # (both jitted, as the trainer runs them: eager op-by-op execution fuses differently and may move the last bit)
  lp_fresh = jax.jit(lambda p, b: train.policy_logp(p, b, cfg=CFG, temperature=1.0, compute_dtype=jnp.float32,
                                                    attn_impl="ref")[0])(params, gb)
  np.testing.assert_array_equal(np.asarray(lp_prox), np.asarray(lp_fresh))
  one = jax.jit(train.make_train_step(opt, fn, 1, lcfg.agg, epochs=1, minibatches=2, prox_fn=prox))
  _, _, m1 = one(params, opt_state, None, gb)
  assert float(m1["ratio_min"]) != 1.0 or float(m1["ratio_max"]) != 1.0  # 2nd minibatch: weights have moved
  two = jax.jit(train.make_train_step(opt, fn, 1, lcfg.agg, epochs=2, minibatches=1, prox_fn=prox))
  _, _, m = two(params, opt_state, None, gb)
  # Epoch 1 starts at the proximal policy: ratio exactly 1, nothing clipped; epoch 2 after a large step clips.
  assert float(m["ratio_max_last"]) != 1.0 and float(m["ratio_min_last"]) != 1.0
  assert float(m["clip_frac_last"]) > 0
  np.testing.assert_allclose(float(m["clip_frac"]), float(m["clip_frac_last"]) / 2, rtol=1e-6)


def test_value_clip_with_one_update_is_the_plain_update():
  # 1 x 1: V_old = stop_gradient(V), the clip cannot act, so --value_clip changes nothing (and costs no forward).
  lcfg = dataclasses.replace(losses.ALGORITHMS["ppo"], kl_coef=0.0)
  params, opt_state, opt, fn0, prox, gb = _setup(lcfg)
  fn1 = _setup(lcfg, value_clip=0.2)[3]
  steps = [train.make_train_step(opt, f, 1, lcfg.agg, prox_fn=prox) for f in (fn0, fn1)]
  # Both steps in one jit: one compile instead of two, so the test stays short.
  (p0, _, m0), (p1, _, m1) = jax.jit(lambda *a: [s(*a) for s in steps])(params, opt_state, None, gb)
  assert float(m1["value_clip_frac"]) == 0 and "value_clip_frac" not in m0
  assert float(m1["loss"]) == float(m0["loss"]) and float(m1["value_loss"]) == float(m0["value_loss"])
  for a, b in zip(jax.tree.leaves(p0), jax.tree.leaves(p1)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_two_epochs_value_clip_against_fixed_old_values():
  lcfg = dataclasses.replace(losses.ALGORITHMS["ppo"], kl_coef=0.0)
  params, opt_state, opt, fn0, prox, gb = _setup(lcfg)
  fn = _setup(lcfg, value_clip=0.05)[3]
  v_old = jax.jit(prox)(params, gb)["old_values"]  # a fresh forward at the step's starting weights

  def seen(p, r, b):  # each update's V_old against v_old, and its value loss without the clip (same forward)
    loss, m = fn(p, r, b)
    return loss, dict(m, old_values_err=jnp.abs(b["old_values"] - v_old).max(),
                      value_loss_0=fn0(p, r, b)[1]["value_loss"])
  new, _, m = jax.jit(train.make_train_step(opt, seen, 1, lcfg.agg, epochs=2, prox_fn=prox))(params, opt_state, None, gb)
  # The mean over both updates is 0 only if each is: the second update's V_old is the pre-step one, not
  # recomputed at its weights (which moved the values by more than the clip).
  assert float(m["old_values_err"]) < 1e-6
  assert float(jnp.abs(jax.jit(prox)(new, gb)["old_values"] - v_old).max()) > 0.05
  # Epoch 1 starts at V_old (nothing clipped); in epoch 2 the clipped branch is the larger on some tokens, which
  # raises the value loss above the unclipped one.
  assert float(m["value_clip_frac_last"]) > 0
  np.testing.assert_allclose(float(m["value_clip_frac"]), float(m["value_clip_frac_last"]) / 2, rtol=1e-6)
  assert float(m["value_loss"]) > float(m["value_loss_0"]) + 1e-6


def test_dr_grpo_normaliser_is_the_generation_budget_not_the_bucket():
  lcfg = train.loss_config(losses.ALGORITHMS["dr_grpo"], [], max_new_tokens=8)
  assert lcfg.max_tokens == 8
  loss = {}
  for cfg_, name in ((lcfg, "budget"), (losses.ALGORITHMS["dr_grpo"], "bucket")):
    for T in (16, 32):
      params, _, _, fn, _, gb = _setup(cfg_, buckets=(T,))
      loss[name, T] = float(fn(params, None, gb)[0])
  np.testing.assert_allclose(loss["budget", 16], loss["budget", 32], rtol=1e-6)
  assert abs(loss["bucket", 16] - loss["bucket", 32]) > 1e-4  # the old behaviour: scale changed with the bucket


def test_one_dynamic_sampling_criterion():
  for r, want in (([1, 1, 1], False), ([0, 1e-9], False), ([0, 1, 0], True), ([], False), ([0.5, 0.4], True)):
    assert data.group_has_signal(r) is want
  import train
  src = open(train.__file__).read()
  assert "data.group_has_signal(r.rewards)" in src and "np.std(" not in src


def test_the_behaviour_policy_stays_in_the_loss_with_several_updates_per_batch():
  """With --ppo_epochs / --minibatches > 1 the clip is on pi / pi_prox, and mu (the worker's log-probs) must still
  weigh the data: the same batch from another behaviour policy gives another update (it did not, when mu entered
  only through an opt-in tis_cap)."""
  for name in ("grpo", "rloo"):
    lcfg = dataclasses.replace(losses.ALGORITHMS[name], kl_coef=0.0)
    params, opt_state, opt, fn, prox, gb = _setup(lcfg, seed=4)
    step = jax.jit(train.make_train_step(opt, fn, 1, lcfg.agg, epochs=2, minibatches=1, prox_fn=prox))
    a, _, ma = step(params, opt_state, None, gb)
    shifted = dict(gb, behaviour_logp=gb["behaviour_logp"] - 0.7 * gb["loss_mask"])  # mu 2x less likely
    b, _, mb = step(params, opt_state, None, shifted)
    diff = max(float(jnp.abs(x - y).max()) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    assert diff > 1e-6, name
    assert float(mb["is_weight_mean"]) > float(ma["is_weight_mean"])


def test_token_means_under_grad_accum_normalise_by_the_whole_batch():
  """Micro-batches of unequal token counts: the accumulated gradient is the whole batch's token mean (the mean of
  per-micro-batch token means weighs the short one's tokens more), for every token-mean preset."""
  for name in ("dapo", "cispo", "reinforce_pp"):
    lcfg = losses.ALGORITHMS[name]
    m = model.make_mesh(1, 1, 1)
    jax.set_mesh(m)
    params = dict(policy=model.shard_params(model.init_params(CFG, jax.random.PRNGKey(0)), CFG, m), value=None)
    g = groups(seed=4)
    g = [dataclasses.replace(x, completions=[c[:1] if i == 0 else c for i, c in enumerate(x.completions)],
                             logprobs=[lp[:1] if i == 0 else lp for i, lp in enumerate(x.logprobs)]) for x in g]
    batch, _, _ = train.rl_batch(g, lcfg, 0, (16,), 8)
    gb = train.to_global(batch, NamedSharding(m, P(("data", "fsdp"))))
    half = np.asarray(batch["loss_mask"]).reshape(2, -1, 16).sum((1, 2))
    assert half[0] != half[1], half  # the micro-batches hold different token counts
    fn = lambda p, r, b: train.rl_loss(p, r, b, cfg=CFG, lcfg=lcfg, temperature=1.0,  # noqa: E731
                                    compute_dtype=jnp.float32, attn_impl="ref", value_coef=0.5)
    sgd = optax.sgd(1.0)  # the update is minus the gradient
    whole = jax.jit(train.make_train_step(sgd, fn, 1, lcfg.agg))(params, sgd.init(params), None, gb)[0]
    accum = jax.jit(train.make_train_step(sgd, fn, 2, lcfg.agg))(params, sgd.init(params), None, gb)[0]
    for x, y in zip(jax.tree.leaves(accum), jax.tree.leaves(whole)):
      np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-7)
