"""rollout.py: the generation engine's log-probs equal the trainer's recomputation, sampling, pass@k."""
import json
import math
import os
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import data
import losses
import model
import param_server
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
  return rollout.generate_groups(eng, params, items, G)


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
  lp = jax.nn.log_softmax(rollout.sampling_logits(logits, rollout.SamplingConfig(top_k=2)))
  np.testing.assert_allclose(np.exp(lp[0]), [0.625, 0.375, 0, 0], atol=1e-6)
  lp = jax.nn.log_softmax(rollout.sampling_logits(logits, rollout.SamplingConfig(top_p=0.9)))  # 0.5+0.3 < 0.9 <= +0.15
  np.testing.assert_allclose(np.exp(lp[0]), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0], atol=1e-6)
  keys = jax.random.split(jax.random.PRNGKey(0), 2000)
  tok, _ = rollout.sample(jnp.repeat(logits, 2000, 0), keys, rollout.SamplingConfig(top_k=2))
  assert set(np.unique(tok).tolist()) == {0, 1}
  assert abs(float((tok == 0).mean()) - 0.625) < 0.04


def test_inverse_cdf_sample_draws_the_distribution_and_never_a_cut_token():
  # V=300 spans three 128-token blocks (the last one padded); top-k cuts all but 50 tokens.
  n, V = 20000, 300
  logits = jax.random.normal(jax.random.PRNGKey(3), (1, V)) * 2
  sc = rollout.SamplingConfig(top_k=50)
  p = np.exp(np.asarray(jax.nn.log_softmax(rollout.sampling_logits(logits, sc))[0], np.float64))
  keys = jax.random.split(jax.random.PRNGKey(4), n)
  tok, lp = jax.jit(lambda l, k: rollout.sample(l, k, sc))(jnp.repeat(logits, n, 0), keys)
  tok = np.asarray(tok)
  assert (p[tok] > 0).all()  # a cut token is never drawn
  np.testing.assert_allclose(np.asarray(lp), np.log(p[tok]), rtol=1e-5)  # the drawn token's own log-prob
  tv = 0.5 * np.abs(np.bincount(tok, minlength=V) / n - p).sum()
  assert tv < 0.04, tv  # expected ~0.02 at n=20000 over 50 tokens; a wrong block offset gives ~1
  # All the mass on the first token or on the last real one (the padding after it has probability 0).
  for hot in (0, 129):
    one = jnp.full((8, 130), -jnp.inf).at[:, hot].set(0.0)
    np.testing.assert_array_equal(rollout.inverse_cdf_sample(one, keys[:8]), hot)


def test_greedy_matches_argmax_of_forward(params):
  items = _items(2)
  res = _run(params, rollout.SamplingConfig(0.0, 0, 1.0, 6, ()), items, G=1)
  for pid, toks in items:
    seq = list(toks)
    for _ in range(6):
      seq.append(int(jnp.argmax(model.forward(params, CFG, jnp.asarray([seq]))[0, -1])))
    np.testing.assert_array_equal(res[pid][0][0], seq[len(toks):])


def test_engine_decodes_from_one_per_layer_copy_per_weight_version(params):
  # On CPU the engine unstacks each weight version once (model.unstack_layers) and reuses it; prefill + decode from
  # the per-layer weights give the stacked weights' logits exactly (the same ops; only the slicing moved).
  eng = rollout.Engine(CFG, rollout.SamplingConfig(0.0, 0, 1.0, 4, ()), slots=2, max_prompt_len=8)
  w = eng._weights(params)
  assert isinstance(w["layers"], list) and len(w["layers"]) == CFG.n_layers and eng._weights(params) is w
  np.testing.assert_array_equal(w["layers"][1]["wq"], params["layers"]["wq"][1])
  newer = jax.tree.map(lambda x: x * 1.0, params)
  assert eng._weights(newer) is not w and eng._weights(newer) is eng._weights(newer)
  tokens, lengths = jnp.asarray([[5, 6, 7, 0], [8, 9, 0, 0]], jnp.int32), jnp.asarray([3, 2], jnp.int32)

  def run(p):
    last, cache = model.prefill(p, CFG, tokens, lengths, model.init_cache(CFG, 2, 8))
    step, cache = model.decode_step(p, CFG, jnp.argmax(last, -1).astype(jnp.int32), cache)
    return last, step, cache["k"]
  for a, b in zip(jax.tree.leaves(jax.jit(run)(params)), jax.tree.leaves(jax.jit(run)(w))):
    np.testing.assert_array_equal(a, b)


def test_greedy_is_argmax_with_ties_and_neg_inf():
  x = jax.random.normal(jax.random.PRNGKey(3), (16, 1000))
  x = x.at[1, 7].set(9.0).at[1, 900].set(9.0)  # a tie: the first index wins, as in jnp.argmax
  x = x.at[2].set(-jnp.inf).at[2, 999].set(0.0)  # top-k/top-p cut rows
  np.testing.assert_array_equal(rollout.greedy(x), jnp.argmax(x, -1))
  assert int(rollout.greedy(x)[1]) == 7 and int(rollout.greedy(jnp.full((1, 5), jnp.nan))[0]) == 4


def test_pass_at_k_unbiased_estimator():
  assert data.pass_at_k(8, 0, 8) == 0.0 and data.pass_at_k(8, 1, 8) == 1.0
  assert data.pass_at_k(8, 2, 1) == pytest.approx(0.25)
  assert data.pass_at_k(10, 3, 4) == pytest.approx(1 - math.comb(7, 4) / math.comb(10, 4))
  with pytest.raises(ValueError, match="n >= k"):
    data.pass_at_k(4, 1, 8)


def test_bad_sampling_config_is_rejected():
  with pytest.raises(ValueError):
    rollout.SamplingConfig(top_p=0.0)
  with pytest.raises(ValueError):
    rollout.SamplingConfig(temperature=-1.0)


def test_eval_cli_draws_the_requested_operators(tmp_path):
  """rollout.py --mode=eval --eval_task_args=...,ops=+ evaluates on addition problems only; a bad operator is a clear
  error."""
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
           f"--tokenizer={tok_path}", "--eval_task=arithmetic", "--eval_n=10", "--k=1", "--max_new_tokens=4",
           f"--out={out}", f"--eval_task_args=difficulty=2{',ops=' + ops if ops else ''}"]
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


def test_sender_runs_jobs_in_order_off_thread_and_hands_back_its_error():
  done, main = [], threading.get_ident()

  def fn(job):
    assert threading.get_ident() != main  # off the decode loop's thread
    if job == 3:
      raise RuntimeError("verifier pool died")
    done.append(job)

  s = rollout.Sender(fn, maxsize=2)
  for j in range(3):
    s.submit(j)
  s.close()
  assert done == [0, 1, 2]
  s = rollout.Sender(fn, maxsize=2)
  s.submit(3)
  with pytest.raises(RuntimeError, match="verifier pool died"):
    for j in range(4, 50):  # after the error the queue still drains: submit raises, it never blocks for good
      s.submit(j)
  assert 4 not in done


class _Manifests:
  """A server whose newest version is `newest`; manifest() long-polls like param_server.Client.manifest."""

  def __init__(self, newest):
    self.newest = newest

  def manifest(self, newer_than, wait_s):
    if self.newest > newer_than:
      return {"version": self.newest}
    time.sleep(min(wait_s, 0.01))
    return None


def test_puller_downloads_in_background_and_holds_at_most_two_versions():
  server, pulled = _Manifests(newest=1), []

  def pull(m):
    pulled.append(m["version"])
    return None if m["version"] == 1 and pulled.count(1) == 1 else f"w{m['version']}"  # first try: gone

  p = rollout.Puller(server, pull, version=0, poll_s=0.01)
  deadline = time.time() + 10
  while (r := p.take()) is None and time.time() < deadline:
    time.sleep(0.01)
  assert r == ({"version": 1}, "w1") and pulled == [1, 1]  # a failed pull is retried
  server.newest = 2
  while p.ready is None and time.time() < deadline:
    time.sleep(0.01)
  server.newest = 3
  time.sleep(0.2)
  # v2 is complete but not taken: v3 must not download yet (v1 in use + v2 ready = the two versions held).
  assert pulled == [1, 1, 2]
  assert p.take() == ({"version": 2}, "w2")
  t = time.time()
  p.wait(10.0)  # a worker too far behind waits here: woken by v3's arrival, not by polling
  assert time.time() - t < 5 and p.take() == ({"version": 3}, "w3") and pulled == [1, 1, 2, 3]
  t = time.time()
  p.wait(0.3)  # nothing newer: the whole timeout
  assert time.time() - t >= 0.29 and p.take() is None
  p.close()
  assert not p.thread.is_alive()


def test_window_rates_are_per_second_over_the_span():
  w = rollout.Window(span_s=30.0)
  w.add(decode_s=0.0, tokens=0.0)
  time.sleep(0.2)
  w.add(decode_s=0.1, tokens=40.0)
  r = w.rates()
  assert 0.3 < r["decode_s"] <= 0.5 and 130 < r["tokens"] <= 200


def test_batched_insert_equals_one_prompt_at_a_time(params):
  """Engine.insert prefills several prompts as one batch, padded to a power of two prompts and slots (the padding
  slots' writes dropped): groups of different sizes and prompt lengths decode exactly as when each prompt is
  inserted alone, and the slots the batch does not name stay untouched."""
  sc = rollout.SamplingConfig(1.0, 0, 1.0, 6, ())
  groups = [([0, 1, 2], [5, 6, 7, 8, 9, 10, 11, 12, 13], rollout.sample_ids("a", 3)),  # 9 tokens: bucket 12
            ([4, 6], [7, 8], rollout.sample_ids("b", 2))]  # 5 slots in all, padded to 8

  def run(batches):
    eng = rollout.Engine(CFG, sc, slots=8, max_prompt_len=12, chunk_steps=3)
    eng.reset(jnp.float32)
    for b in batches:
      eng.insert(params, b)
    while eng.run_chunk(params).any():
      pass
    return eng.rows(list(range(8)))

  (tok, lp, n, _), (tok1, lp1, n1, _) = run([groups]), run([[g] for g in groups])
  used = [0, 1, 2, 4, 6]
  np.testing.assert_array_equal(tok[used], tok1[used])
  np.testing.assert_array_equal(n[used], n1[used])
  # The prefill's batch shape moves the last bit of the first token's log-prob (RESULTS.md "Numerical alignment").
  np.testing.assert_allclose(lp[used], lp1[used], rtol=0, atol=1e-6)
  np.testing.assert_array_equal(n[[3, 5, 7]], 0)  # never started: nothing generated


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_continued_sample_equals_one_uninterrupted_run(params, temperature):
  """Partial rollouts (issue 17 item 4): worker A decodes one chunk of a group and is preempted; worker B (other
  slots, newer version tag, same weights and keys) prefills prompt + each partial completion and decodes on.
  The tokens equal one uninterrupted run's (greedy and sampled: same per-step keys), log-probs within the fp32
  alignment tolerance, and each token keeps the version that produced it. A sample that was done stays done."""
  sc = rollout.SamplingConfig(temperature, 0, 1.0, 9, ())
  prompt, keys = [5, 6, 7, 8, 9], rollout.sample_ids("a", 3)

  def engine():
    eng = rollout.Engine(CFG, sc, slots=8, max_prompt_len=12, chunk_steps=3)
    eng.reset(jnp.float32)
    return eng

  whole = engine()
  whole.insert(params, [([0, 1, 2], prompt, keys)], version=4)
  whole.run_chunk(params, version=4)
  while whole.run_chunk(params, version=7).any():  # a weight swap between chunks (same weights here)
    pass
  tok, lp, n, ver = whole.rows([0, 1, 2])
  assert (n == 9).all()
  # Token 3 was sampled from the logits of the last decode step before the swap: still version 4.
  np.testing.assert_array_equal(ver, [[4] * 4 + [7] * 5] * 3)

  a = engine()  # worker A: one chunk (3 tokens), then preempted
  a.insert(params, [([0, 1, 2], prompt, keys)], version=4)
  a.run_chunk(params, version=4)
  ptok, plp, pn, pver = a.rows([0, 1, 2])
  assert (pn == 3).all()
  part = [ptok[i, :3] for i in range(3)]
  done = [False, False, True]  # sample 2 pretends it had finished: B must not touch it
  part[2], plp2, pver2 = tok[2], lp[2], ver[2]

  b = engine()  # worker B: slots 6, 1, 3; per-sample prefill of prompt + partial (just the prompt if done)
  slots = [6, 1, 3]
  b.insert(params, [([sl], prompt + ([] if d else list(p)), keys[i:i + 1])
                    for i, (sl, p, d) in enumerate(zip(slots, part, done))], version=9)
  b.resume(slots, part, [plp[0, :3], plp[1, :3], plp2], [pver[0, :3], pver[1, :3], pver2], done)
  while b.run_chunk(params, version=9).any():
    pass
  tok2, lp2, n2, ver2 = b.rows(slots)
  assert (n2 == 9).all()
  np.testing.assert_array_equal(tok2, tok)
  np.testing.assert_allclose(lp2, lp, rtol=0, atol=1e-5)
  np.testing.assert_array_equal(lp2[:2, :3], plp[:2, :3])  # the behaviour log-probs carried over, bit for bit
  np.testing.assert_array_equal(ver2[:2], [[4] * 3 + [9] * 6] * 2)  # B's tokens carry B's version
  np.testing.assert_array_equal(ver2[2], ver[2])


def test_hand_back_sends_partials_and_falls_back_to_a_plain_requeue():
  """rollout.hand_back on SIGTERM: a group with tokens goes back as a partial rollout (done = stop token or budget),
  one never started as a plain requeue; if the server cannot store the partials (disk full), the prompts still
  go back at once, without them."""
  import param_server as ps

  class Eng:
    M, sc = 4, rollout.SamplingConfig(1.0, 0, 1.0, 4, (EOS,))

    def rows(self, slots):
      toks = np.array([[5, 6, 0, 0], [7, EOS, 0, 0], [1, 2, 3, 4]], np.int32)[:len(slots)]
      n = np.array([2, 2, 4])[:len(slots)] if slots[0] == 0 else np.zeros(len(slots), int)
      return toks, -np.ones(toks.shape, np.float32), n, np.full(toks.shape, 3, np.int32)

  class Client:
    def __init__(self, fail):
      self.fail, self.released, self.requeued = fail, [], []

    def release(self, q, items):
      if self.fail:
        raise ps.StorageError("disk full")
      self.released += items
      return {"released": len(items), "unknown": []}

    def requeue(self, q, ids):
      self.requeued += ids

  item = lambda gid, G: data.PromptItem(gid, data.Problem(gid, "1+1=", "2"), np.array([2, 5]), G)  # noqa: E731
  groups = {"a": dict(item=item("a", 3), slots=[0, 1, 2]), "b": dict(item=item("b", 2), slots=[5, 6])}
  c = Client(fail=False)
  rollout.hand_back(c, Eng(), groups)
  assert c.requeued == ["b"] and [it["id"] for it in c.released] == ["a"]
  it = c.released[0]
  assert it["partial_done"] == [False, True, True]  # running; stopped at EOS; at the budget
  assert [t.tolist() for t in it["partial_tokens"]] == [[5, 6], [7, EOS], [1, 2, 3, 4]]
  assert [v.tolist() for v in it["partial_versions"]] == [[3, 3], [3, 3], [3, 3, 3, 3]]
  toks, lps, vers, done = rollout.partial_of(it, 3, Eng.M, 40)  # what the next worker reads back
  assert done == [False, True, True] and [len(t) for t in toks] == [2, 2, 4]
  for bad, what in ((dict(it, partial_done=[False, True]), "partial_done must be a list of group_size=3"),
                    (dict(it, partial_logprobs=[np.zeros(2), np.zeros(2), np.ones(4)]), r"partial_logprobs\[2\]"),
                    (dict(it, partial_tokens=[np.array([5, 99]), *it["partial_tokens"][1:]]), r"partial_tokens\[0\]")):
    with pytest.raises(ValueError, match=what):
      rollout.partial_of(bad, 3, Eng.M, 40)
  c = Client(fail=True)
  rollout.hand_back(c, Eng(), groups)
  assert sorted(c.requeued) == ["a", "b"] and not c.released


def test_a_prompt_longer_than_max_prompt_len_is_refused_though_continuations_may_be_longer(params):
  """The prefill buckets reach max_prompt_len + max_new_tokens (a continued sample prefills prompt + partial),
  but a fresh prompt past max_prompt_len would leave too little cache for its completion: refused by name."""
  sc = rollout.SamplingConfig(1.0, 0, 1.0, 6, ())
  eng = rollout.Engine(CFG, sc, slots=4, max_prompt_len=12, chunk_steps=3)
  assert eng.buckets == (12, 16, 18) and eng.bucket(11) == 12 and eng.bucket(17) == 18  # fresh prompts: <= 12
  eng.reset(jnp.float32)
  with pytest.raises(ValueError, match="'long' of 13 tokens exceeds max_prompt_len=12"):
    rollout.generate_groups(eng, params, [("long", list(range(3, 16)))], 2)


def test_the_leaser_keeps_prompts_leased_ahead_and_gives_back_the_rest():
  """rollout.Leaser against a real server: it holds want() prompts leased (no more), take() serves them from
  memory in issue order, and close() returns the ones never taken, still leased to this process (requeue works)."""
  server = param_server.Server(param_server.ServerConfig(token="t")).start()
  try:
    c = param_server.Client(port=server.port, token="t")
    c.put("prompts", [dict(id=f"p{i}") for i in range(10)])
    want = [3]
    leaser = rollout.Leaser(param_server.Client(port=server.port, token="t"), lambda: want[0], lease_s=30.0)
    deadline = time.time() + 10
    while c.stats()["queues"]["prompts"]["leased"] < 3 and time.time() < deadline:
      time.sleep(0.02)
    time.sleep(0.2)  # and no more than want()
    assert c.stats()["queues"]["prompts"]["leased"] == 3
    want[0] = 0  # (what a draining worker asks for): no refill
    assert [it["id"] for it in leaser.take(2, wait_s=1.0)] == ["p0", "p1"]
    time.sleep(0.2)
    left = leaser.close()
    assert left == ["p2"] and c.stats()["queues"]["prompts"]["leased"] == 3
    c.requeue("prompts", left)
    q = c.stats()["queues"]["prompts"]
    assert q["leased"] == 2 and q["ready"] == 8  # p0, p1 taken (in flight), p2 back in the queue
  finally:
    server.stop()
