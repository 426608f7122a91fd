"""One process of a multi-process (gloo) trainer for tests/test_shards.py and bench/bench_sharded.py.

  python tests/multiproc_helper.py publish N I PORT SERVERS VERSION [die_after]   (devices: XLA_FLAGS)
      stage + commit the model (seed = VERSION) through shards.publish; with die_after=k this process SIGKILLs
      itself after staging k pieces (a trainer killed mid-publish). Prints "SENT <bytes>".
  python tests/multiproc_helper.py ckpt N I PORT DIR FROM TO SAVE_AT
      train a tiny model from step FROM (restoring DIR's newest checkpoint when FROM > 0) to TO on
      deterministic batches, checkpointing at SAVE_AT; prints "LOSS <step> <loss>" per step.
"""
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

CFG_HF = dict(model_type="qwen2", vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64, rope_theta=1e4,
              rms_norm_eps=1e-6, tie_word_embeddings=False)


def init(n, i, port):
  if n > 1:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=n, process_id=i)


def values(shape, idx, seed):
  """Deterministic weights for the slice idx of a tensor: a hash of the global element index, so each
  process builds only its own shards (no compile, no full host copy) and any mesh gets the same values."""
  import numpy as np
  lin, stride = np.zeros((), np.int64), 1
  for k in reversed(range(len(shape))):
    s = idx[k]
    r = np.arange(s.start or 0, shape[k] if s.stop is None else s.stop, dtype=np.int64)
    lin = lin + (r * stride).reshape((-1,) + (1,) * (len(shape) - 1 - k))
    stride *= shape[k]
  return (((lin * 2654435761 + seed * 97) % 65521).astype(np.float32) / 65521 - 0.5) * 0.05


def tiny(seed, mesh, cfg_hf=CFG_HF):
  """(cfg, params placed on mesh with model.param_shardings) from values()."""
  import model
  cfg = model.Config.from_hf_dict(cfg_hf)
  shapes = jax.eval_shape(lambda k: model.init_params(cfg, k), jax.random.PRNGKey(0))
  return cfg, jax.tree.map(lambda x, sh: jax.make_array_from_callback(
      x.shape, sh, lambda idx, x=x: values(x.shape, idx, seed)), shapes, model.param_shardings(cfg, mesh))


def publish(n, i, port, servers, version, die_after=None):
  import model
  import param_server
  import train
  init(n, i, port)
  mesh = model.make_mesh(1, jax.device_count(), 1)
  cfg, params = tiny(version, mesh)
  clients = [param_server.connect(a, token="t") for a in servers.split(",")]
  if die_after is not None:  # SIGKILL after staging die_after pieces
    staged, real = [0], param_server.Client.stage

    def stage(self, *a):
      if staged[0] == die_after:
        os.kill(os.getpid(), signal.SIGKILL)
      staged[0] += 1
      return real(self, *a)
    param_server.Client.stage = stage
  _, sent = train.publish_shards(clients, version, params, dict(config=cfg.to_hf_dict(), sampling={}))
  print("SENT", sent, flush=True)


def ckpt(n, i, port, d, start, stop, save_at):
  import jax.numpy as jnp
  import numpy as np
  import optax
  from jax.sharding import NamedSharding, PartitionSpec as P
  import losses
  import model
  import train
  init(n, i, port)
  mesh = model.make_mesh(1, jax.device_count(), 1)
  jax.set_mesh(mesh)
  cfg, params = tiny(0, mesh)
  opt = train.make_optimizer(1e-2, 1, 20, 0.0, 1.0)
  opt_state = jax.tree.map(jnp.copy, opt.init(params))
  c = train.Checkpointer(d, keep=2)
  if start:
    params, opt_state, st = c.restore(params, opt_state)
    assert st["step"] == start, st

  def loss_fn(p, b):
    logp = losses.token_logprobs(model.forward(p, cfg, b["tokens"], b["positions"], b["segment_ids"],
                                               attn_impl="ref"), b["targets"])
    return -logp.mean()

  @jax.jit
  def step(p, o, b):
    loss, g = jax.value_and_grad(loss_fn)(p, b)
    u, o = opt.update(g, o, p)
    return optax.apply_updates(p, u), o, loss

  bsh = NamedSharding(mesh, P(("data", "fsdp")))
  for s in range(start, stop):
    rng = np.random.default_rng(s)
    tok = rng.integers(0, cfg.vocab_size, (8, 17)).astype(np.int32)
    b = dict(tokens=tok[:, :-1], targets=tok[:, 1:], positions=np.tile(np.arange(16, dtype=np.int32), (8, 1)),
             segment_ids=np.ones((8, 16), np.int32))
    params, opt_state, loss = step(params, opt_state, train.to_global(b, bsh))
    print("LOSS", s + 1, repr(float(loss)), flush=True)
    if s + 1 == save_at:
      c.save(s + 1, params, opt_state, dict(step=s + 1))
  c.wait()
  c.close()


def placement(n, i, port, ckpt_dir, out):
  """Issue 36: no leaf of the policy, the reference or the optimizer state is ever whole on one device, from the
  load through a train step to the HF export; then the export is loaded onto a tensor-parallel worker mesh (eval).
  Prints "PLACED <what> <n leaves>" per stage and "GATHERED <max bytes> <largest leaf bytes>" for the export."""
  import dataclasses
  import jax.numpy as jnp
  from jax.experimental import multihost_utils
  from jax.sharding import NamedSharding, PartitionSpec as P
  import losses
  import model
  import train
  from test_train import groups
  init(n, i, port)
  mesh = model.make_mesh(1, jax.device_count(), 1)
  jax.set_mesh(mesh)

  def check(what, tree, devices=None):
    leaves = jax.tree.leaves(tree)
    for x in leaves:  # on every device of the mesh (small vectors replicated), weight matrices split
      assert len(x.sharding.device_set) == (devices or jax.device_count()), (what, x.shape, x.sharding)
      assert x.size < 1024 or not x.sharding.is_fully_replicated, (what, x.shape, x.sharding)
    print("PLACED", what, len(leaves), flush=True)
  cfg, policy = model.load_hf_checkpoint(ckpt_dir, dtype=jnp.float32, mesh=mesh)
  check("load", policy)
  lcfg = dataclasses.replace(losses.ALGORITHMS["grpo"], kl_coef=0.04)
  opt = train.make_optimizer(1e-2, 1, 10, 0.0, 1.0)
  params = dict(policy=policy, value=None)
  opt_state = jax.tree.map(jnp.copy, opt.init(params))
  ref = jax.tree.map(lambda x: jnp.array(x, jnp.float32, copy=True), policy)
  check("optimizer", [x for x in jax.tree.leaves(opt_state) if x.ndim >= 1])
  check("reference", ref)
  fn = lambda p, r, b: train.rl_loss(p, r, b, cfg=cfg, lcfg=lcfg, temperature=1.0,  # noqa: E731
                                     compute_dtype=jnp.float32, attn_impl="ref", value_coef=0.5)
  step = jax.jit(train.make_train_step(opt, fn, 1, lcfg.agg), donate_argnums=(0, 1),
                 out_shardings=(*jax.tree.map(lambda x: x.sharding, (params, opt_state)), None))
  batch, _, _ = train.rl_batch(groups(n_prompts=2, G=2), lcfg, 0, (16,), 8)
  params, opt_state, m = step(params, opt_state, ref, train.to_global(batch, NamedSharding(mesh, P(("data", "fsdp")))))
  assert bool(jnp.isfinite(m["loss"]))
  check("train", (params["policy"], [x for x in jax.tree.leaves(opt_state) if x.ndim >= 1]))
  gathered, real = [], multihost_utils.process_allgather
  multihost_utils.process_allgather = lambda x, **kw: gathered.append(x.nbytes) or real(x, **kw)
  train.export_hf(out, cfg, params["policy"], chunk_bytes=2048)
  biggest = max(x.nbytes for x in jax.tree.leaves(params["policy"]))
  print("GATHERED", max(gathered), biggest, flush=True)
  multihost_utils.sync_global_devices("exported")
  tp = model.make_mesh(1, 1, len(jax.local_devices()), devices=jax.local_devices())  # a worker's own devices
  _, ev = model.load_hf_checkpoint(out, mesh=tp)
  check("eval", ev, devices=len(jax.local_devices()))


if __name__ == "__main__":
  mode, n, i, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
  if mode == "publish":
    publish(n, i, port, sys.argv[5], int(sys.argv[6]), int(sys.argv[7]) if len(sys.argv) > 7 else None)
  elif mode == "placement":
    placement(n, i, port, sys.argv[5], sys.argv[6])
  else:
    ckpt(n, i, port, sys.argv[5], int(sys.argv[6]), int(sys.argv[7]), int(sys.argv[8]))
