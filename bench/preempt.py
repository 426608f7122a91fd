"""Benchmark: generated tokens a preempted worker saves (partial rollouts), measured through real processes.

A parameter server runs in-process; a policy is published as the trainer does (shards.publish, v0), N prompt
groups are queued, and worker A (`rollout.py`, --drain_s=0) starts. A is SIGTERMed once it has leased its second
wave of groups (the first wave is done, so everything is compiled) plus preempt_frac of one wave's decode time
(measured on the uninterrupted reference run below; a preemption lands anywhere in a wave) or preempt_delay_s:
it hands the groups in flight back with their partial rollouts (Client.release).
v1 (the same weights) is published and worker B starts; it continues the handed-back groups first. Every group's
completions are compared with one uninterrupted in-process run (rollout.generate_groups, same weights, prompt ids
and seed): tokens equal, max |log-prob difference| (the continued tokens' logits come from a prefill of prompt +
partial, not from the decode steps: fp32 alignment tolerance), and each group's version tag (the oldest token's).

Prints, per round: tokens A generated in the groups it handed back (= tokens saved, which without partial rollouts
would be generated again), groups continued, tokens equal, max log-prob difference; then the mean and range.

  python bench_preempt.py --reps=3                   # demo-sized policy, 256 new tokens, greedy
  python bench_preempt.py --temperature=1 --reps=3   # sampled (a random policy's samples end early at EOS)
  python bench_preempt.py --preempt_frac=0.9         # late in a wave: more tokens in flight
"""
import os
import signal
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np

from bench import util as benchutil
import data
import model
import param_server as ps
import rollout
import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def scenario(workdir, *, d_model=128, n_layers=2, max_new_tokens=256, temperature=1.0, n_groups=6, group_size=2,
             slots=4, chunk_steps=2, seed=0, preempt_frac=0.5, preempt_delay_s=None, timeout_s=300.0):
  """One preemption (see the module docstring). Returns a dict of what was measured; raises AssertionError if a
  worker dies or the run does not finish within timeout_s."""
  tok_path = data.build_task_tokenizer(workdir, "arithmetic", seed=0)
  tok = data.load_tokenizer(tok_path)
  cfg = model.Config.from_hf_dict(dict(
      model_type="qwen2", vocab_size=tok.vocab_size, hidden_size=d_model, num_hidden_layers=n_layers,
      num_attention_heads=4, num_key_value_heads=2, intermediate_size=4 * d_model,
      max_position_embeddings=64 + max_new_tokens, tie_word_embeddings=True, bos_token_id=tok.bos_id,
      eos_token_id=tok.eos_id))
  params = model.init_params(cfg, jax.random.PRNGKey(seed))
  sampling = dict(temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens, max_prompt_len=32)
  problems = data.make_task_problems("arithmetic", n_groups, difficulty=2, seed=seed, split="train")
  items = [dict(id=f"s{i}", prompt_id=p.id, prompt=p.prompt, answer=p.answer, task=p.task, tests=None,
                group_size=group_size, prompt_tokens=np.asarray(tok.encode(p.prompt, add_bos=True), np.int32))
           for i, p in enumerate(problems)]

  # The reference: every group generated uninterrupted by one engine, same weights, keys (prompt ids) and seed.
  sc = rollout.SamplingConfig(temperature, 0, 1.0, max_new_tokens, tuple(sorted(tok.stop_ids)))
  eng = rollout.Engine(cfg, sc, slots, 32, chunk_steps, seed=seed)
  eng.reset(jax.numpy.float32)
  run_ref = lambda: rollout.generate_groups(  # noqa: E731
      eng, params, [(it["id"], it["prompt_tokens"]) for it in items], group_size)
  ref = run_ref()  # compiles
  t = time.time()
  run_ref()
  wave_s = (time.time() - t) / -(-n_groups // (slots // group_size))  # one wave of slots // G groups
  if preempt_delay_s is None:  # a preemption lands at a random point of a wave: preempt_frac of one
    preempt_delay_s = preempt_frac * wave_s

  token_file = os.path.join(workdir, "token")
  with open(token_file, "w") as f:
    f.write("t\n")
  srv = ps.Server(ps.ServerConfig(port=0, token="t")).start()
  c = ps.Client("127.0.0.1", srv.port, token="t", timeout_s=30.0)
  procs, got = [], {}
  meta = dict(config=cfg.to_hf_dict(), sampling=sampling)

  def worker(name):
    log = open(os.path.join(workdir, f"{name}.log"), "w")
    p = subprocess.Popen([sys.executable, "rollout.py", f"--server=127.0.0.1:{srv.port}",
                          f"--token_file={token_file}", f"--tokenizer={tok_path}", f"--slots={slots}",
                          f"--chunk_steps={chunk_steps}", "--verifier_workers=0", "--drain_s=0", "--lease_s=120",
                          f"--seed={seed}", f"--worker_id={name}"],
                         cwd=ROOT, env=benchutil.child_env(), stdout=log, stderr=subprocess.STDOUT)
    procs.append(p)
    return p

  try:
    train.publish_shards([c], 0, params, meta)
    c.put("prompts", items)
    a = worker("A")
    # Poll the lease of A's second wave tightly (a 0.2 s poll could miss the whole wave of a small model). A
    # SIGTERM any time after that lease still lets the wave decode at least one chunk: the worker checks for
    # the stop only at the top of its loop, before leasing, and the lease is followed by insert and a chunk.
    wave, t0 = slots // group_size, time.time()  # groups A leases at a time
    while c.stats()["queues"]["prompts"]["ready"] > n_groups - 2 * wave:
      assert a.poll() is None, f"worker A exited (rc={a.returncode}) before its second wave, see {workdir}"
      assert time.time() - t0 < timeout_s, f"worker A's second wave: timed out after {timeout_s}s, see {workdir}"
      time.sleep(0.005)
    time.sleep(preempt_delay_s)
    a.send_signal(signal.SIGTERM)  # a TPU preemption notice: A is in the middle of its second wave
    assert a.wait(timeout=120) == 0, f"worker A exited with rc={a.returncode}"
    train.publish_shards([c], 1, params, meta)  # B pulls v1: its own tokens carry v1, A's keep v0
    b, t0 = worker("B"), time.time()
    while len(got) < n_groups:
      assert b.poll() is None, f"all groups: the worker exited (rc={b.returncode}), see {workdir}"
      assert time.time() - t0 < timeout_s, f"all groups: timed out after {timeout_s}s, see {workdir}"
      for r in c.get("rollouts", 100, wait_s=0.2, lease_s=600):
        assert r["id"] not in got, f"rollout {r['id']} delivered twice"
        got[r["id"]] = r
        c.ack("rollouts", [r["id"]])
    b.send_signal(signal.SIGTERM)  # (B may still be starting up when A left nothing to continue: rc -15)
    assert b.wait(timeout=120) in (0, -signal.SIGTERM), f"worker B exited with rc={b.returncode}"
    left = c.stats()["queues"]["prompts"]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
    c.close()
    srv.stop()
  log_a = open(os.path.join(workdir, "A.log")).read()
  equal, total, diff = 0, 0, 0.0
  for gid, r in got.items():
    comps, lps = ref[gid]
    for x, y, lx, ly in zip(r["completions"], comps, r["logprobs"], lps):
      total += len(y)
      equal += int((np.asarray(x) == y).sum()) if len(x) == len(y) else 0
      if len(x) == len(y) and (np.asarray(x) == y).all():
        diff = max(diff, float(np.abs(np.asarray(lx) - ly).max()))
  resumed = {gid: int(r.get("resumed_tokens", 0)) for gid, r in got.items()}
  return dict(groups=len(got), tokens=total, tokens_equal=equal, max_logp_diff=diff,
              tokens_saved=sum(resumed.values()), groups_continued=sum(v > 0 for v in resumed.values()),
              continued_versions=sorted({int(got[g]["version"]) for g, v in resumed.items() if v}),
              fresh_versions=sorted({int(got[g]["version"]) for g, v in resumed.items() if not v}),
              handed_back_logged="handed back" in log_a, prompts_left=left["ready"] + left["leased"],
              wave_s=wave_s, preempt_delay_s=preempt_delay_s)


def main():
  from absl import app, flags
  flags.DEFINE_integer("reps", 3, "Preemptions measured, each a fresh server and pair of workers (count). Default 3.")
  flags.DEFINE_integer("max_new_tokens", 256, "Completion budget in tokens. Default 256.")
  flags.DEFINE_float("temperature", 0.0, "Sampling temperature (0 = greedy: a random policy's greedy completions "
                     "run to the budget, the long generations partial rollouts are for). Default 0.")
  flags.DEFINE_integer("d_model", 128, "Policy width (the demo's SFT base shape). Default 128.")
  flags.DEFINE_integer("n_layers", 2, "Policy depth. Default 2.")
  flags.DEFINE_integer("groups", 6, "Prompt groups queued per round (count). Default 6.")
  flags.DEFINE_integer("group_size", 2, "Samples per prompt. Default 2.")
  flags.DEFINE_integer("slots", 4, "Worker decode slots. Default 4.")
  flags.DEFINE_float("preempt_frac", 0.5, "When worker A is SIGTERMed after it leased its second wave, as a "
                     "fraction of one wave's decode time (measured in-process). Default 0.5.")
  F = flags.FLAGS

  def run(argv):
    del argv
    rows = []
    for r in range(F.reps):
      with tempfile.TemporaryDirectory() as tmp:
        m = scenario(tmp, d_model=F.d_model, n_layers=F.n_layers, max_new_tokens=F.max_new_tokens,
                     temperature=F.temperature, n_groups=F.groups, group_size=F.group_size, slots=F.slots, seed=r,
                     preempt_frac=F.preempt_frac)
      rows.append(m)
      print(f"round {r}: {m['tokens_saved']} tokens saved in {m['groups_continued']} continued groups; "
            f"{m['tokens_equal']}/{m['tokens']} tokens equal to an uninterrupted run, max |dlogp| "
            f"{m['max_logp_diff']:.2e}; versions continued {m['continued_versions']} fresh {m['fresh_versions']}; "
            f"prompts left {m['prompts_left']}; SIGTERM {m['preempt_delay_s']:.3f} s into the wave (wave "
            f"{m['wave_s']:.3f} s)", flush=True)
    saved = [m["tokens_saved"] for m in rows]
    print(f"tokens saved per preemption: mean {np.mean(saved):.1f} (min {min(saved)}, max {max(saved)}, "
          f"n={len(saved)}) of at most {F.slots * F.max_new_tokens} in flight (slots x max_new_tokens), "
          f"{rows[0]['tokens']} generated per round; T={F.temperature}, SIGTERM {F.preempt_frac} of a wave in")
  app.run(run)


if __name__ == "__main__":
  main()
