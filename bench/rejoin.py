"""Benchmark: how long a restarted inference worker takes to rejoin, with and without JAX's persistent
compilation cache (launch.sh sets JAX_COMPILATION_CACHE_DIR for every role it starts, locally and on pod hosts).

Starts a parameter server in-process, pushes a demo-sized policy (the SFT base's shape) with its config and
sampling settings as the trainer does, queues prompt groups, then starts `rollout.py` as a fresh process and times
start -> first scored rollout group back on the server (import, weight pull, compile prefill/decode, generate,
score). Interleaved rounds of: no cache; the cache dir as a restarted worker finds it (filled by an earlier run).
Prints every sample, then median and min-max of both sides.

  python bench_rejoin.py --reps=3
"""
import os
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np
from absl import app, flags

from bench import util as benchutil
import data
import model
import param_server as ps
import train

flags.DEFINE_integer("reps", 3, "Interleaved rounds (count, default 3).")
flags.DEFINE_string("model_config", "d_model=128,n_layers=2,n_heads=4,n_kv_heads=2,ffw_dim=512",
                    "Policy shape (train.py's SFT base shape by default).")
FLAGS = flags.FLAGS
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def setup(tmp):
  tok_path = data.build_task_tokenizer(tmp, "arithmetic", seed=0)
  tok = data.load_tokenizer(tok_path)
  kw = dict(kv.split("=") for kv in FLAGS.model_config.split(","))
  hf = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=tok.vocab_size,
            hidden_size=int(kw["d_model"]), num_hidden_layers=int(kw["n_layers"]),
            num_attention_heads=int(kw["n_heads"]), num_key_value_heads=int(kw["n_kv_heads"]),
            intermediate_size=int(kw["ffw_dim"]), max_position_embeddings=128, rope_theta=10000.0,
            rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id)
  cfg = model.Config.from_hf_dict(hf)
  # What the trainer publishes: the weights, with the model config and sampling settings as manifest header fields.
  meta = dict(config=cfg.to_hf_dict(), sampling=dict(temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=8))
  return tok_path, tok, model.init_params(cfg, jax.random.PRNGKey(0)), meta


def one_rejoin(client, port, token_file, tok_path, tok, problems, cache_dir, tag):
  items = [data.PromptItem(f"{tag}-{p.id}", p, np.asarray(tok.encode(p.prompt, add_bos=True), np.int32), 4).to_wire()
           for p in problems]
  client.put("prompts", items)
  env = benchutil.child_env()
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  if cache_dir:
    env.update(JAX_COMPILATION_CACHE_DIR=cache_dir, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  t0 = time.time()
  proc = subprocess.Popen([sys.executable, "rollout.py", f"--server=127.0.0.1:{port}", f"--token_file={token_file}",
                           f"--tokenizer={tok_path}", "--slots=8", "--chunk_steps=4", "--verifier_workers=0"],
                          cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  try:
    got = []
    while not got:
      got = client.get("rollouts", 1, wait_s=1.0, lease_s=600)
      assert proc.poll() is None, "worker died"
    secs = time.time() - t0
  finally:
    proc.kill()
    proc.wait()
  client.ack("rollouts", [g["id"] for g in got])
  # drop what is left of this round so the next worker starts from the same queue state
  for q in ("prompts", "rollouts"):
    ids = [x["id"] for x in client.get(q, 1000, wait_s=0.0, lease_s=600) if x["id"].startswith(tag)]
    if ids:
      client.ack(q, ids)
  return secs


def main(argv):
  del argv
  with tempfile.TemporaryDirectory() as tmp:
    tok_path, tok, params, meta = setup(tmp)
    token_file = os.path.join(tmp, "token")
    open(token_file, "w").write("t\n")
    srv = ps.Server(ps.ServerConfig(port=0, token="t")).start()
    client = ps.Client("127.0.0.1", srv.port, token="t")
    train.publish_shards([client], 0, params, meta)
    problems = data.make_task_problems("arithmetic", 8, difficulty=2, seed=0, split="train", ops="+")
    cache = os.path.join(tmp, "jax_cache")
    one_rejoin(client, srv.port, token_file, tok_path, tok, problems, cache, "fill")  # the worker before the restart
    res = {"no cache": [], "warm cache": []}
    for r in range(FLAGS.reps):
      for name, c in (("no cache", None), ("warm cache", cache)):
        s = one_rejoin(client, srv.port, token_file, tok_path, tok, problems, c, f"r{r}{name[0]}")
        res[name].append(s)
        print(f"round {r} {name:<10} {s:6.1f} s to the first rollout", flush=True)
    srv.stop()
  for name, v in res.items():
    print(f"{name:<10} median {statistics.median(v):5.1f} s  (min {min(v):.1f}, max {max(v):.1f}, n={len(v)})")
  print(f"cache files: a restarted worker skips compiling; ratio no-cache / warm = "
        f"{statistics.median(res['no cache']) / statistics.median(res['warm cache']):.2f}")


if __name__ == "__main__":
  app.run(main)
