"""What several benches share: timing, random weights, the tiny system-test policy, the model-shape flags, a child JAX process's environment,
and starting a server process. Benches run from the repo root as `python -m bench.NAME`."""
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Model-shape flags of bench.decode and bench.train_step: name -> (help, unit).
SHAPE_FLAGS = dict(d_model=("model width D", "units"), n_layers=("layers L", "count"),
                   n_heads=("query heads N", "count"), n_kv_heads=("kv heads K", "count"),
                   ffw_dim=("MLP width F", "units"), vocab=("vocab V", "tokens"))
QUICK_SHAPE = dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffw_dim=128, vocab=256)  # --quick, for tests


def add_shape_flags(p, defaults, suffix=""):
  for name, (what, unit) in SHAPE_FLAGS.items():
    p.add_argument(f"--{name}", type=int, default=defaults[name], help=f"{what} ({unit}){suffix}")


# JAX, numpy and model are imported where used: the server benches import this module and never start JAX.

def best_time(fn, args, reps):
  """(best, median) seconds of fn(*args) over reps calls, each synced; one untimed warm-up call first."""
  import jax
  jax.block_until_ready(fn(*args))
  ts = []
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    ts.append(time.perf_counter() - t)
  return min(ts), statistics.median(ts)


def matmul_flops_per_s(m, k, n, reps, seed, dtype="float32"):
  """Best FLOP/s of a jitted [m,k] x [k,n] matmul of `dtype` (2*m*k*n FLOPs)."""
  import jax
  import jax.numpy as jnp
  kx, ky = jax.random.split(jax.random.PRNGKey(seed))
  x, y = (jax.random.normal(k_, shape).astype(dtype) for k_, shape in ((kx, (m, k)), (ky, (k, n))))
  best, _ = best_time(jax.jit(jnp.matmul), (x, y), reps)
  return 2 * m * k * n / best


def random_params(cfg, seed):
  """model.init_params drawn with numpy (no jax.random compile); biases N(0, 0.02) too (the QKV-bias path)."""
  import numpy as np
  import model
  rng = np.random.default_rng(seed)
  return model.init_params(cfg, None, normal=lambda shape: rng.standard_normal(shape, np.float32), zero_bias=False)


def tiny_base(run, tok, d_model=32, layers=1):
  """RUN/base: a random Qwen2 policy over `tok`'s vocabulary (default 1 layer, d=32; MLP 2d), the system tests' and
  bench.fleet's (their figures do not depend on the weights, only on a cheap step; bench.fleet --d_model sizes the
  weights its workers pull)."""
  import jax
  import model
  hf = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=tok.vocab_size, hidden_size=d_model,
            num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1, intermediate_size=2 * d_model,
            max_position_embeddings=128, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
            bos_token_id=tok.bos_id, eos_token_id=tok.eos_id)
  cfg = model.Config.from_hf_dict(hf)
  model.save_hf_checkpoint(os.path.join(run, "base"), cfg, model.init_params(cfg, jax.random.PRNGKey(0)))


def child_env():
  """For a child JAX process: CPU, unbuffered output, one device (the parent's XLA_FLAGS are not inherited)."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
  env.pop("XLA_FLAGS", None)
  return env


def start_server(port_file, *flags, script=("param_server.py",), log=None, **popen):
  """Starts `python *SCRIPT --port_file=PORT_FILE *FLAGS` in ROOT (output appended to `log` if given; more Popen
  arguments in popen) and waits until it has written its port there; returns (process, port). Kills it and
  raises RuntimeError if it exits first or has not written the port within 30 s."""
  if os.path.exists(port_file):
    os.remove(port_file)
  if log:
    popen["stdout"] = popen["stderr"] = open(log, "ab")
  p = subprocess.Popen([sys.executable, *script, f"--port_file={port_file}", *flags], cwd=ROOT,
                       **popen)
  t0 = time.monotonic()
  while not os.path.exists(port_file):
    if p.poll() is not None or time.monotonic() - t0 > 30:
      p.kill()
      raise RuntimeError(f"{script} did not start" + (f" (see {log})" if log else ""))
    time.sleep(0.02)
  return p, int(open(port_file).read())
