"""bench/sharded.py: the pod-scale data path measured on one box: a 4-process gloo trainer (2 fake CPU devices
each, fsdp over 8) publishing a >= 100M-parameter model to 1, 2 and 4 shard servers (param_server.py processes),
an orbax checkpoint of params + Adam state, and a TP=2 worker pulling the newest version (reshard on pull).

Prints, per trainer process: peak RSS growth during publish and during checkpoint beside the full-model and
full-state sizes and that process's own shard; bytes sent per version; time per version with S = 1, 2, 4
servers; then the worker's bytes pulled, time, and a bit-exact check; then a PROJECTION for QwQ-32B built from
the measured throughputs and the byte counts (assumptions printed), beside the anchors' reported figures.

  python -m bench.sharded                          (~125M params; the machine may be shared: see the note)
  python -m bench.sharded --d_model=256 --n_layers=2 --vocab=4096   (quick)

--delta: delta weight sync instead (issue 18). One trainer process takes --steps Adam steps (lr --lr, default 1e-6)
on random tokens (next-token loss on the 125M-param default model: honest "a few RL-sized steps", not RL), publishes
each version as bf16 (--dtype) to a param_server.py process, and three workers (in this process, one after the
other, with rollout.py's common.tune_malloc()) pull it: one in full, one as a delta against the version it holds
(the first asker: it also waits for the server to build the delta), one more delta (served from the server's
cache, like the rest of a fleet). Prints per version: fraction of bytes changed, bytes moved, and pull time delta
vs full, all bit-checked.

  python -m bench.sharded --delta --steps=4 --lr=1e-6          (125M params, ~3 min on 2 cores)
  python -m bench.sharded --delta --steps=4 --dtype=float32    (the same with fp32 workers, train.py's default)
"""
import argparse
import contextlib
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from bench import util as benchutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))


def rss_mb(field="VmRSS"):
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1]) / 1024


def reset_peak():
  """Resets VmHWM (peak RSS) to the current RSS; returns that RSS (MiB)."""
  with open("/proc/self/clear_refs", "w") as f:  # "5" resets VmHWM
    f.write("5")
  return rss_mb()


def cfg_hf(a):
  return dict(model_type="qwen2", vocab_size=a.vocab, hidden_size=a.d_model, num_hidden_layers=a.n_layers,
              num_attention_heads=a.d_model // 64, num_key_value_heads=a.d_model // 64, intermediate_size=4 * a.d_model,
              max_position_embeddings=512, rope_theta=1e4, rms_norm_eps=1e-6, tie_word_embeddings=False)


def trainer(a, n, i, port, servers, ckpt_dir):
  """One trainer process: publish a.versions versions per S, then one checkpoint; prints a JSON line."""
  import jax
  import jax.numpy as jnp
  import model
  import param_server
  import train
  from multiproc_helper import init, tiny
  init(n, i, port)
  mesh = model.make_mesh(1, jax.device_count(), 1)
  jax.set_mesh(mesh)
  cfg, params = tiny(0, mesh, cfg_hf(a))
  jax.block_until_ready(params)
  full = sum(x.nbytes for x in jax.tree.leaves(params))
  own = sum(s.data.nbytes for x in jax.tree.leaves(params) for s in x.addressable_shards)
  clients = [param_server.connect(s, token="t") for s in servers]
  rec = dict(process=i, full_model_mb=full / 2**20, own_shards_mb=own / 2**20, times={})
  meta = dict(config=cfg.to_hf_dict(), sampling={})
  base = reset_peak()
  version, _ = train.publish_shards(clients, 0, params, meta)  # warm-up
  rec["first_publish_rss_growth_mb"] = rss_mb("VmHWM") - base  # incl. one-time allocations (gloo, threads)
  for S in (1, 2, 4):
    ts = []
    for _ in range(a.versions):
      base = reset_peak()
      t = time.perf_counter()
      version, sent = train.publish_shards(clients[:S], version + 1, params, meta)
      ts.append(time.perf_counter() - t)
      rec["publish_rss_growth_mb"] = max(rec.get("publish_rss_growth_mb", 0), rss_mb("VmHWM") - base)
    rec["times"][S] = statistics.median(ts)
    rec["sent_mb"] = sent / 2**20
  opt = train.make_optimizer(1e-3, 1, 10, 0.0, 1.0)
  opt_state = jax.tree.map(jnp.copy, opt.init(params))
  jax.block_until_ready(opt_state)
  rec["full_state_mb"] = 3 * rec["full_model_mb"]
  c = train.Checkpointer(ckpt_dir, keep=1)
  base = reset_peak()
  t = time.perf_counter()
  c.save(1, params, opt_state, dict(step=1))
  rec["ckpt_blocking_s"] = time.perf_counter() - t  # training could go on from here
  c.wait()
  rec["ckpt_total_s"] = time.perf_counter() - t
  rec["ckpt_rss_growth_mb"] = rss_mb("VmHWM") - base
  c.close()
  print("RESULT " + json.dumps(rec), flush=True)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--d_model", type=int, default=768)
  ap.add_argument("--n_layers", type=int, default=8)
  ap.add_argument("--vocab", type=int, default=32000)
  ap.add_argument("--versions", type=int, default=3, help="versions timed per server count (median)")
  ap.add_argument("--trainer", nargs=5, default=None, help=argparse.SUPPRESS)
  ap.add_argument("--delta", action="store_true", help="measure delta weight sync instead (see the docstring)")
  ap.add_argument("--steps", type=int, default=4, help="--delta: trainer steps, one published version each")
  ap.add_argument("--lr", type=float, default=1e-6, help="--delta: Adam learning rate")
  ap.add_argument("--seq", type=int, default=128, help="--delta: tokens per sequence (batch of 2)")
  ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                  help="--delta: the published (worker) weight dtype (default bfloat16; train.py's default is float32)")
  ap.add_argument("--apply", action="store_true", help="time one sparse delta applied on the device (docstring)")
  ap.add_argument("--changed", type=float, default=0.023, help="--apply: fraction of elements changed (default 0.023)")
  ap.add_argument("--pieces", type=int, default=16, help="--apply: row blocks the delta also comes in (default 16)")
  a = ap.parse_args()
  if a.delta:
    return delta_bench(a)
  if a.apply:
    return apply_bench(a)
  if a.trainer:
    n, i, port, servers, ckpt = a.trainer
    return trainer(a, int(n), int(i), int(port), servers.split(","), ckpt)
  from test_shards import _free_port
  with start_servers(4, "bench_sharded_") as (tmp, addrs):
    port, n = _free_port(), 4
    tenv = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    args = [f"--d_model={a.d_model}", f"--n_layers={a.n_layers}", f"--vocab={a.vocab}", f"--versions={a.versions}"]
    procs = [subprocess.Popen([sys.executable, "-m", "bench.sharded", *args, "--trainer", str(n), str(i), str(port), ",".join(addrs),
                               os.path.join(tmp, "ckpt")], env=tenv, cwd=ROOT, stdout=subprocess.PIPE, text=True)
             for i in range(n)]
    recs = []
    for p in procs:
      out = p.communicate()[0]
      assert p.returncode == 0, out[-3000:]
      recs.append(json.loads(next(l for l in out.splitlines() if l.startswith("RESULT "))[7:]))
    r0 = recs[0]
    print("NOTE: measured on a 2-core box shared with other jobs: timings are noisy and pessimistic.")
    print(f"model: {r0['full_model_mb']:.0f} MiB fp32 ({r0['full_model_mb'] * 2**20 / 4 / 1e6:.0f}M params); full "
          f"state (params + Adam moments): {r0['full_state_mb']:.0f} MiB; 4 trainer processes x 2 devices, fsdp=8")
    print(f"{'proc':>4} {'own shards MiB':>14} {'sent/version MiB':>16} {'1st publish RSS+':>16} {'publish RSS+ MiB':>16} "
          f"{'ckpt RSS+ MiB':>13} {'ckpt block s':>12} {'ckpt total s':>12}")
    for r in recs:
      print(f"{r['process']:>4} {r['own_shards_mb']:>14.1f} {r['sent_mb']:>16.1f} "
            f"{r['first_publish_rss_growth_mb']:>16.1f} {r['publish_rss_growth_mb']:>16.1f} "
            f"{r['ckpt_rss_growth_mb']:>13.1f} {r['ckpt_blocking_s']:>12.2f} {r['ckpt_total_s']:>12.2f}")
    print(f"sum sent per version: {sum(r['sent_mb'] for r in recs):.1f} MiB = model {r0['full_model_mb']:.1f} MiB")
    times = {S: max(r["times"][str(S)] for r in recs) for S in (1, 2, 4)}
    for S, t in times.items():
      print(f"time per version with {S} shard server(s): {t:.2f} s ({r0['full_model_mb'] / t:.0f} MiB/s aggregate)")
    worker = subprocess.run([sys.executable, "-c", WORKER, addrs[0], json.dumps(cfg_hf(a))], env=tenv, cwd=ROOT,
                            capture_output=True, text=True)
    assert worker.returncode == 0, worker.stderr[-3000:]
    w = json.loads(worker.stdout.strip().splitlines()[-1])
    print(f"TP=2 worker pull of v{w['version']}: {w['pulled_mb']:.1f} MiB pulled (its 2 devices hold "
          f"{w['held_mb']:.1f} MiB, distinct slices) in {w['seconds']:.2f} s from 4 servers; bit-identical: "
          f"{w['bit_identical']}")
    project(r0["full_model_mb"] * 2**20 / times[4] / 4, w["pulled_mb"] * 2**20 / w["seconds"] / 4,
            w["pulled_mb"] * 2**20 / w["seconds"])


WORKER = """
import json, sys, time
sys.path.insert(0, "tests")
import jax, numpy as np, model, param_server as ps, rollout
from multiproc_helper import values
c = ps.Client(*sys.argv[1].split(":")[:1], int(sys.argv[1].split(":")[1]), token="t")
m = c.manifest()
cfg = model.Config.from_hf_dict(json.loads(sys.argv[2]))
mesh = model.make_mesh(1, 1, 2)
sh = model.param_shardings(cfg, mesh)
t = time.perf_counter()
got, pulled = rollout.pull_weights(m, sh, {}, token="t")
jax.block_until_ready(got)
dt = time.perf_counter() - t
ok = all(np.array_equal(np.asarray(s.data), values(x.shape, s.index, 0))
         for x in jax.tree.leaves(got) for s in x.addressable_shards)
held = sum(x.nbytes for x in jax.tree.leaves(got))
print(json.dumps(dict(version=m["version"], pulled_mb=pulled / 2**20, held_mb=held / 2**20, seconds=dt, bit_identical=ok)))
"""


@contextlib.contextmanager
def start_servers(n, prefix):
  """n param_server.py processes (token "t") in a fresh temp dir; yields (that dir, ["127.0.0.1:port", ...]),
  then stops them and removes the dir."""
  tmp, srv, addrs = tempfile.mkdtemp(prefix=prefix), [], []
  try:
    with open(os.path.join(tmp, "token"), "w") as f:
      f.write("t\n")
    for k in range(n):
      p, port = benchutil.start_server(os.path.join(tmp, f"port{k}"), "--port=0", f"--token_file={tmp}/token",
                                       env=dict(os.environ, JAX_PLATFORMS="cpu"), stderr=subprocess.DEVNULL)
      srv.append(p)
      addrs.append(f"127.0.0.1:{port}")
    yield tmp, addrs
  finally:
    for p in srv:
      p.terminate()
      p.wait()
    shutil.rmtree(tmp, ignore_errors=True)


def delta_bench(a):
  import common
  common.tune_malloc()  # as a worker runs (rollout.py): XLA's fresh buffers reuse the heap instead of faulting
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  import model
  import train
  import rollout
  import param_server
  with start_servers(1, "bench_delta_") as (_, addrs):
    cfg = model.Config.from_hf_dict(cfg_hf(a))
    params = model.init_params(cfg, jax.random.PRNGKey(0))
    n_params = sum(x.size for x in jax.tree.leaves(params))
    opt = optax.adam(a.lr)
    opt_state = opt.init(params)

    @jax.jit
    def step(params, opt_state, tokens):
      def loss(p):
        logits = model.forward(p, cfg, tokens[:, :-1])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1))
      g = jax.grad(loss)(params)
      upd, opt_state = opt.update(g, opt_state, params)
      return optax.apply_updates(params, upd), opt_state

    cast = jax.jit(lambda p: jax.tree.map(lambda x: x.astype(a.dtype), p))
    trainer = [param_server.connect(addrs[0], token="t")]
    meta = dict(config=cfg.to_hf_dict(), sampling={})
    held = {"full": None, "delta": None, "delta2": None}  # worker -> (manifest, params) it holds
    clients = {w: {} for w in held}
    reader = param_server.connect(addrs[0], token="t")
    rows = []
    print(f"model: {n_params / 1e6:.0f}M params, published as {a.dtype} "
          f"({jnp.dtype(a.dtype).itemsize * n_params / 2**20:.0f} MiB); Adam lr {a.lr:g} on random tokens (batch 2 x {a.seq}); 1 param_server.py process, loopback; 2-core CPU box")
    for v in range(a.steps + 1):
      if v:
        t = time.perf_counter()
        tokens = jax.random.randint(jax.random.PRNGKey(v), (2, a.seq + 1), 0, cfg.vocab_size)
        params, opt_state = step(params, opt_state, tokens)
        jax.block_until_ready(params)
        train_s = time.perf_counter() - t
      pub = cast(params)
      t = time.perf_counter()
      train.publish_shards(trainer, v, pub, meta)
      publish_s = time.perf_counter() - t
      m = reader.manifest(newer_than=v - 1)
      sh = jax.tree.map(lambda x: x.sharding, pub)
      want = {k: np.asarray(x).view(np.uint8) for k, x in param_server.flatten(pub).items()}
      row = dict(version=v)
      for w in held:
        st = {}
        t = time.perf_counter()
        got, nbytes = rollout.pull_weights(m, sh, clients[w], base=None if w == "full" else held[w], stats=st,
                                              token="t")
        jax.block_until_ready(got)
        row[w] = dict(s=time.perf_counter() - t, **st)
        if not all(np.array_equal(np.asarray(x).view(np.uint8), want[k]) for k, x in param_server.flatten(got).items()):
          raise AssertionError(f"worker {w}: v{v} is not bit-identical to the published weights")
        held[w] = (m, got)
      rows.append(row)
      f, d, d2 = row["full"], row["delta"], row["delta2"]
      if v == 0:
        print(f"v0 (initial, full for everyone): {f['bytes'] / 2**20:.1f} MiB in {f['s']:.2f} s; publish "
              f"{publish_s:.2f} s")
        continue
      print(f"v{v}: train step {train_s:.1f} s, publish {publish_s:.2f} s; changed "
            f"{100 * d['changed_bytes'] / max(d['covered_bytes'], 1):.2f}% of bytes; full pull {f['bytes'] / 2**20:.1f}"
            f" MiB {f['s']:.2f} s; delta pull {d['bytes'] / 2**20:.2f} MiB ({100 * d['bytes'] / d['full_bytes']:.2f}%)"
            f" {d['s']:.2f} s incl. server build, {d2['s']:.2f} s cached; encodings {d['pieces']}; bit-identical")
    print("\n| version | changed bytes | delta bytes / full | full pull | delta pull (1st, builds) | "
          "delta pull (cached) | full / cached delta time |\n|---|---|---|---|---|---|---|")
    for r in rows[1:]:
      f, d, d2 = r["full"], r["delta"], r["delta2"]
      print(f"| v{r['version'] - 1}->v{r['version']} | {100 * d['changed_bytes'] / max(d['covered_bytes'], 1):.2f}% | "
            f"{100 * d['bytes'] / d['full_bytes']:.2f}% ({d['bytes'] / 2**20:.1f} of {d['full_bytes'] / 2**20:.0f} MiB)"
            f" | {f['s']:.2f} s | {d['s']:.2f} s | {d2['s']:.2f} s | {f['s'] / d2['s']:.2f}x |")
    print("\nanchors (verl, reported): 1-3% changed bytes per step for dense models; Qwen3-235B delta sync 11-15 s "
          "vs 246-266 s full NCCL broadcast")


def apply_bench(a):
  """--apply: one sparse delta (--changed of the elements, their low bits flipped) applied on the device to a
  [vocab, d_model] tensor, per dtype, best of 5 in ms: rollout._apply (into a new buffer: the version in use
  stays), for fp32 rollout._patch_again (donated: in place), the same donated patch bitcasting the whole tensor to
  uint (the formulation before session 27), and numpy's in-place XOR on host memory (param_server.apply_patch's
  core); then the same delta in --pieces row blocks (a trainer's fsdp pieces under one worker slice) through
  rollout._apply and, as before session 27, each piece's patch into a new buffer."""
  import common
  common.tune_malloc()  # as a worker runs
  import jax
  import numpy as np
  import param_server as ps
  import rollout

  def whole_fn(x, d, pos, dest, kind):  # bitcasting all of x
    u = jax.lax.bitcast_convert_type(x, d.dtype).reshape(-1)
    u = u.at[pos].set(u.at[pos].get(mode="fill", fill_value=0) ^ d, mode="drop")
    return jax.lax.bitcast_convert_type(u.reshape(x.shape), x.dtype)

  whole = jax.jit(whole_fn, static_argnums=(3, 4), donate_argnums=(0,))
  whole_copy = jax.jit(whole_fn, static_argnums=(3, 4))

  def each(y, qs):  # every piece's patch into a new buffer (pull_weights before session 27)
    for q in qs:
      y = whole_copy(y, *q)
    return y

  rng, shape = np.random.default_rng(0), (a.vocab, a.d_model)
  for dt in ("float32", "bfloat16"):
    x = rng.normal(0, 0.02, shape).astype(jax.numpy.dtype(dt))
    old = x.view(f"uint{8 * x.itemsize}").reshape(-1)
    new = old.copy()
    m = rng.random(old.size) < a.changed
    new[m] ^= rng.integers(1, 4, int(m.sum()), dtype=old.dtype)
    kind, d, pos = ps.delta_decode(*ps.delta_encode(new.tobytes(), old.tobytes(), x.itemsize)[:2], old.size, x.itemsize)
    assert kind == "sparse", kind
    p = rollout.placed(((slice(0, shape[0]), slice(0, shape[1])), kind, d, pos), shape)
    ms = {}
    cases = [("rollout._apply (new buffer)", lambda y, *q: rollout._apply(y, [q]), False),
             ("whole-tensor bitcast (in place)", whole, True)]
    if dt == "float32":  # (bf16 goes through _apply's uint16 view: _patch_again alone is not its path)
      cases.insert(1, ("_patch_again (in place)", rollout._patch_again, True))
    for name, f, donate in cases:
      xs = [jax.device_put(x) for _ in range(6)] if donate else [jax.device_put(x)] * 6
      ts = []
      for xi in xs:  # the first compiles
        t = time.perf_counter()
        y = jax.block_until_ready(f(xi, *p))
        ts.append(time.perf_counter() - t)
      assert np.array_equal(np.asarray(y).view(new.dtype).reshape(-1), new), name  # bit for bit
      ms[name] = 1e3 * min(ts[1:])
    ts = []
    for _ in range(5):
      h = old.copy()
      t = time.perf_counter()
      h[pos] ^= d
      ts.append(time.perf_counter() - t)
    ms["numpy XOR (host, in place)"] = 1e3 * min(ts)
    print(f"{dt} {list(shape)}, {100 * m.mean():.2f}% changed: " + ", ".join(f"{k} {v:.1f} ms" for k, v in ms.items()))
    # The same delta in --pieces row blocks (a trainer's fsdp pieces under one worker slice: one patch each), as
    # pull_weights applies them (the first into a new buffer, the rest in place) and each into a new buffer.
    rows = shape[0] // a.pieces
    ps_ = []
    for i in range(a.pieces):
      lo, hi = i * rows * shape[1], (i + 1) * rows * shape[1]
      kind, d, pos = ps.delta_decode(*ps.delta_encode(new[lo:hi].tobytes(), old[lo:hi].tobytes(), x.itemsize)[:2],
                                     hi - lo, x.itemsize)
      ps_.append(rollout.placed(((slice(i * rows, (i + 1) * rows), slice(0, shape[1])), kind, d, pos), shape))
    want = new.reshape(shape)[:rows * a.pieces]
    for name, f in (("rollout._apply (one copy, the rest in place)", rollout._apply),
                    ("each into a new buffer, bitcasting all of it", each)):
      ts = []
      for _ in range(4):  # the first compiles
        y = jax.device_put(x)
        t = time.perf_counter()
        y = jax.block_until_ready(f(y, ps_))
        ts.append(time.perf_counter() - t)
      assert np.array_equal(np.asarray(y).view(new.dtype)[:rows * a.pieces], want), name
      print(f"  the same in {a.pieces} pieces, {name}: {1e3 * min(ts[1:]):.1f} ms")


def project(publish_conn_bps, serve_bps, pull_bps):
  """QwQ-32B on a v5p-512 trainer (128 hosts) with 128 workers: a PROJECTION from measured rates."""
  model_b = 32.8e9 * 2  # bf16 weights
  hosts, workers, nic = 128, 128, 100e9 / 8  # ASSUMED: 100 Gbit/s per host NIC, one 4-chip worker host each
  publish_s = model_b / hosts / publish_conn_bps
  per_server_out = model_b / hosts * workers
  serve_s = per_server_out / min(nic, serve_bps)
  worker_in_s = model_b / min(nic, pull_bps / 4 * hosts)
  print("PROJECTION (not a measurement) for QwQ-32B, bf16 (65.6 GB), trainer v5p-512 = 128 hosts, 128 workers each")
  print(f"  holding the whole model (TP over its chips); ASSUMED 100 Gbit/s NIC per host, and one server process "
        f"serving as fast as one here; measured here: {publish_conn_bps / 1e9:.2f} GB/s per staging connection, "
        f"{serve_bps / 1e9:.2f} GB/s per serving shard server, {pull_bps / 1e9:.2f} GB/s per pulling worker")
  print(f"  publish: each host stages {model_b / hosts / 1e9:.2f} GB on its own server: {publish_s:.1f} s")
  print(f"  serve: each shard server sends {per_server_out / 1e9:.1f} GB (its slice x {workers} workers): "
        f">= {serve_s:.1f} s")
  print(f"  each worker receives {model_b / 1e9:.1f} GB from {hosts} servers in parallel: >= {worker_in_s:.1f} s")
  print(f"  => about {publish_s + max(serve_s, worker_in_s):.0f} s per version end to end (full weights, no deltas)")
  print("  anchors (reported, Qwen3-235B): verl delta sync 11-15 s; NCCL broadcast 246-266 s")


if __name__ == "__main__":
  main()
