"""Each trainer process's peak memory on the load, train-step and HF-export paths, next to the model's size: 4 gloo
processes x 1 CPU device (fsdp=4, the multi-host code path), a 100M+ parameter Qwen2-shaped model. On CPU a device's
arrays live in host memory, so a process's peak resident set is what would land on its chip: a path that gathered
the whole model (or a whole layer-stacked tensor) on one device would show the model's size, or more, here. The
other side of the comparison, in the same processes: the whole model loaded onto one device.

Run: python -m bench.placement [--d_model=768 --n_layers=12 --ffw=2048 --vocab=32768]   (~3-5 min on 2 cores)
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rss_mib(field="VmRSS"):
  with open("/proc/self/status") as f:
    return next(int(line.split()[1]) / 1024 for line in f if line.startswith(field + ":"))


def stage(rec, name, fn):
  """Runs fn; rec[name] = the peak of its private (anonymous) resident MiB above where it started, sampled every
  2 ms: on CPU a device's arrays are anonymous memory, while safetensors' mmap'd file pages (page cache, shared and
  reclaimable) are not, and VmHWM would count them."""
  import threading
  start, peak, done = rss_mib("RssAnon"), [0.0], threading.Event()

  def sample():
    while not done.wait(0.002):
      peak[0] = max(peak[0], rss_mib("RssAnon"))
  t = threading.Thread(target=sample, daemon=True)
  t.start()
  try:
    return fn()
  finally:
    done.set()
    t.join()
    rec[name] = max(peak[0], rss_mib("RssAnon")) - start


def config(a):
  return dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=a.vocab, hidden_size=a.d_model,
              num_hidden_layers=a.n_layers, num_attention_heads=a.d_model // 64, num_key_value_heads=4,
              intermediate_size=a.ffw, max_position_embeddings=512, rope_theta=1e4, rms_norm_eps=1e-6,
              tie_word_embeddings=True)


def trainer(n, i, port, ckpt, out):
  import dataclasses
  import jax
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=n, process_id=i)
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P
  import data
  import losses
  import model
  import train
  mesh = model.make_mesh(1, jax.device_count(), 1)
  jax.set_mesh(mesh)
  rec = dict(process=i)
  cfg, policy = stage(rec, "load", lambda: jax.block_until_ready(model.load_hf_checkpoint(ckpt, jnp.float32, mesh)))
  rec["own_mib"] = sum(s.data.nbytes for x in jax.tree.leaves(policy) for s in x.addressable_shards) / 2**20
  lcfg = dataclasses.replace(losses.ALGORITHMS["grpo"], kl_coef=0.0)
  opt = train.make_optimizer(1e-5, 1, 10, 0.0, 1.0)
  params = dict(policy=policy, value=None)
  opt_state = jax.tree.map(jnp.copy, opt.init(params))
  fn = lambda p, r, b: train.rl_loss(p, r, b, cfg=cfg, lcfg=lcfg, temperature=1.0,  # noqa: E731
                                     compute_dtype=jnp.float32, attn_impl="ref", value_coef=0.5)
  step = jax.jit(train.make_train_step(opt, fn, 1, lcfg.agg), donate_argnums=(0, 1),
                 out_shardings=(*jax.tree.map(lambda x: x.sharding, (params, opt_state)), None))
  rng = np.random.default_rng(0)
  groups = [data.Rollout(f"s{g}", 0, "w", data.Problem(f"p{g}", "1+1=", "2"), rng.integers(4, 100, 16, np.int32),
                         [rng.integers(4, 100, 48, np.int32) for _ in range(2)],
                         [-rng.random(48).astype(np.float32) for _ in range(2)], np.array([1.0, 0.0], np.float32))
            for g in range(2)]
  batch, _, _ = train.rl_batch(groups, lcfg, 0, (64,), 48)
  gb = train.to_global(batch, NamedSharding(mesh, P(("data", "fsdp"))))
  step = step.lower(params, opt_state, None, gb).compile()  # compiled first: its memory is not the step's
  params, opt_state, _ = stage(rec, "train", lambda: jax.block_until_ready(step(params, opt_state, None, gb)))
  stage(rec, "export", lambda: train.export_hf(out, cfg, params["policy"]))
  # The other side, in the same process: the whole model onto this process's one device, as the trainer used to
  # load before sharding (and as a per-leaf all-gather export holds it, one leaf at a time).
  stage(rec, "whole_load", lambda: jax.block_until_ready(model.load_hf_checkpoint(ckpt, jnp.float32)))
  print("RESULT " + json.dumps(rec), flush=True)


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--d_model", type=int, default=768, help="model width (default 768)")
  p.add_argument("--n_layers", type=int, default=12, help="layers (default 12)")
  p.add_argument("--ffw", type=int, default=2048, help="MLP width (default 2048)")
  p.add_argument("--vocab", type=int, default=32768, help="vocabulary (default 32768)")
  p.add_argument("--procs", type=int, default=4, help="trainer processes, 1 CPU device each (default 4)")
  p.add_argument("--trainer", nargs=5, help=argparse.SUPPRESS)
  a = p.parse_args()
  if a.trainer:
    n, i, port, ckpt, out = a.trainer
    return trainer(int(n), int(i), int(port), ckpt, out)
  import jax
  import model
  import socket
  from bench.util import child_env
  cfg = model.Config.from_hf_dict(config(a))
  with tempfile.TemporaryDirectory() as tmp:
    params = model.init_params(cfg, jax.random.PRNGKey(0))
    n_params = sum(x.size for x in jax.tree.leaves(params))
    model.save_hf_checkpoint(os.path.join(tmp, "base"), cfg, params)
    del params
    with socket.socket() as s:
      s.bind(("127.0.0.1", 0))
      port = s.getsockname()[1]
    env = dict(child_env(), XLA_FLAGS="--xla_force_host_platform_device_count=1")
    procs = [subprocess.Popen([sys.executable, "-m", "bench.placement", "--trainer", str(a.procs), str(i), str(port),
                               os.path.join(tmp, "base"), os.path.join(tmp, "out")], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(a.procs)]
    recs = []
    for pr in procs:
      out = pr.communicate()[0]
      if pr.returncode:
        raise SystemExit(out[-3000:])
      recs.append(json.loads(next(l for l in out.splitlines() if l.startswith("RESULT "))[7:]))
  model_mib = n_params * 4 / 2**20
  print(f"model: {n_params / 1e6:.1f}M params = {model_mib:.0f} MiB fp32; {a.procs} processes, fsdp {a.procs}. Per "
        f"process, MiB: its own shards, and the peak private memory each path added above where it started")
  print(f"{'proc':>4} {'own shards':>10} {'load':>8} {'train step':>10} {'export':>8} {'whole load':>10}")
  for r in recs:
    print(f"{r['process']:>4} {r['own_mib']:>10.0f} {r['load']:>8.0f} {r['train']:>10.0f} {r['export']:>8.0f} "
          f"{r['whole_load']:>10.0f}")


if __name__ == "__main__":
  main()
