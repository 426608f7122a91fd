"""rollout.py: the generation engine's log-probs equal the trainer's recomputation, sampling, pass@k."""
import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import data
import losses
import model
import rollout

CFG = model.Config(vocab_size=40, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffw_dim=128,
                   tie_embeddings=True)
EOS = 2


@pytest.fixture(scope="module")
def params():
  return model.init_params(CFG, jax.random.PRNGKey(1))


def _items(n):
  return [(f"p{i}", [int(t) for t in np.random.default_rng(i).integers(3, 40, 2 + i % 5)]) for i in range(n)]


def _run(params, sc, items, G=3, slots=8, chunk=4):
  eng = rollout.Engine(CFG, sc, slots=slots, max_prompt_len=12, chunk_steps=chunk)
  eng.reset(jnp.float32)
  return rollout.generate_groups(eng, params, items, G, seed=0)


def test_behaviour_logprobs_match_full_forward(params):
  # Continuous batching: 7 prompts x 3 samples through 8 slots, so slots are refilled mid-run.
  items = _items(7)
  res = _run(params, rollout.SamplingConfig(1.0, 0, 1.0, 10, (EOS,)), items)
  assert set(res) == {pid for pid, _ in items}
  worst = 0.0
  for pid, toks in items:
    for c, lp in zip(*res[pid]):
      assert 1 <= len(c) <= 10 and len(c) == len(lp)
      assert EOS not in c[:-1].tolist()  # generation stops at the first stop token
      seq = jnp.asarray([toks + c.tolist()])
      ref = losses.token_logprobs(model.forward(params, CFG, seq[:, :-1]), seq[:, 1:])[0, len(toks) - 1:]
      worst = max(worst, float(jnp.abs(ref - lp).max()))
  assert worst <= 1e-5, worst  # fp32 trainer/worker drift bound (SPEC "Numerical alignment")


def test_temperature_logprobs_are_of_the_scaled_distribution(params):
  items = _items(3)
  res = _run(params, rollout.SamplingConfig(0.7, 0, 1.0, 6, (EOS,)), items)
  for pid, toks in items:
    for c, lp in zip(*res[pid]):
      seq = jnp.asarray([toks + c.tolist()])
      ref = losses.token_logprobs(model.forward(params, CFG, seq[:, :-1]), seq[:, 1:], 0.7)[0, len(toks) - 1:]
      np.testing.assert_allclose(lp, ref, atol=1e-5)


def test_same_prompt_id_reproduces_tokens(params):
  sc = rollout.SamplingConfig(1.0, 0, 1.0, 8, (EOS,))
  a = _run(params, sc, _items(4))
  b = _run(params, sc, list(reversed(_items(4))), slots=3)  # other order, other slot count
  for pid in a:
    for x, y in zip(a[pid][0], b[pid][0]):
      np.testing.assert_array_equal(x, y)


def test_top_k_top_p_truncate_and_renormalise():
  logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]))
  lp = rollout.sampling_logprobs(logits, rollout.SamplingConfig(top_k=2))
  np.testing.assert_allclose(np.exp(lp[0]), [0.625, 0.375, 0, 0], atol=1e-6)
  lp = rollout.sampling_logprobs(logits, rollout.SamplingConfig(top_p=0.9))  # 0.5+0.3 < 0.9 <= +0.15
  np.testing.assert_allclose(np.exp(lp[0]), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0], atol=1e-6)
  keys = jax.random.split(jax.random.PRNGKey(0), 2000)
  tok, _ = rollout.sample(jnp.repeat(logits, 2000, 0), keys, rollout.SamplingConfig(top_k=2))
  assert set(np.unique(tok).tolist()) == {0, 1}
  assert abs(float((tok == 0).mean()) - 0.625) < 0.04


def test_greedy_matches_argmax_of_forward(params):
  items = _items(2)
  res = _run(params, rollout.SamplingConfig(0.0, 0, 1.0, 6, ()), items, G=1)
  for pid, toks in items:
    seq = list(toks)
    for _ in range(6):
      seq.append(int(jnp.argmax(model.forward(params, CFG, jnp.asarray([seq]))[0, -1])))
    np.testing.assert_array_equal(res[pid][0][0], seq[len(toks):])


def test_pass_at_k_unbiased_estimator():
  assert rollout.pass_at_k(8, 0, 8) == 0.0 and rollout.pass_at_k(8, 1, 8) == 1.0
  assert rollout.pass_at_k(8, 2, 1) == pytest.approx(0.25)
  assert rollout.pass_at_k(10, 3, 4) == pytest.approx(1 - math.comb(7, 4) / math.comb(10, 4))
  with pytest.raises(ValueError, match="n >= k"):
    rollout.pass_at_k(4, 1, 8)


def test_bad_sampling_config_is_rejected():
  with pytest.raises(ValueError):
    rollout.SamplingConfig(top_p=0.0)
  with pytest.raises(ValueError):
    rollout.SamplingConfig(temperature=-1.0)


def test_eval_cli_draws_the_requested_operators(tmp_path):
  """rollout.py --mode=eval --eval_ops=+ evaluates on addition problems only; a bad operator is a clear error."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  tok_path = data.build_task_tokenizer(str(tmp_path), "arithmetic", seed=0)
  tok = data.load_tokenizer(tok_path)
  cfg = model.Config.from_hf_dict(dict(
      model_type="qwen2", vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
      num_key_value_heads=1, intermediate_size=64, max_position_embeddings=64, tie_word_embeddings=True,
      bos_token_id=tok.bos_id, eos_token_id=tok.eos_id))
  model.save_hf_checkpoint(str(tmp_path / "ckpt"), cfg, model.init_params(cfg, jax.random.PRNGKey(0)))
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)

  def run(ops, out):
    cmd = [sys.executable, os.path.join(root, "rollout.py"), "--mode=eval", f"--checkpoint={tmp_path / 'ckpt'}",
           f"--tokenizer={tok_path}", "--eval_task=arithmetic", "--eval_difficulty=2", "--eval_n=10", "--k=1",
           "--max_new_tokens=4", f"--out={out}", *([f"--eval_ops={ops}"] if ops else [])]
    return subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=300)

  for ops in ("+", None):
    r = run(ops, tmp_path / f"eval{ops}.json")
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.load(open(tmp_path / f"eval{ops}.json"))
    prompts = [p for p, _ in res["examples"]]
    assert res["n_problems"] == 10 and len(prompts) == 5
    if ops == "+":
      assert all("+" in p and "-" not in p for p in prompts), prompts
    else:  # the task's default "+-": with this fixed seed the first five problems include a subtraction
      assert any("-" in p for p in prompts), prompts
  bad = run("/", tmp_path / "bad.json")
  assert bad.returncode != 0 and "bad ops '/'" in bad.stderr, bad.stderr[-2000:]
