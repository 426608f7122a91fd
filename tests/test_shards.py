"""The pod-scale data path: multi-process (gloo) publish without gathering, reshard-on-pull, atomic manifest
commit when a trainer process dies mid-publish, and orbax checkpoints restored onto other process counts."""
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import safetensors.numpy
import pytest

import model
import param_server as ps
import train
import rollout
import param_server
from multiproc_helper import tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HELPER = os.path.join(ROOT, "tests", "multiproc_helper.py")


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _run(mode, n, args, devices=1, timeout=240):
  """n helper processes (one gloo trainer); returns [(returncode, output)]."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
  port = _free_port()
  procs = [subprocess.Popen([sys.executable, HELPER, mode, str(n), str(i), str(port), *map(str, args[i])],
                            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i in range(n)]
  out = {}
  for i in reversed(range(n)):  # the last ones first: in the kill test that is the victim
    try:  # once a peer died the survivors may wait at a barrier forever: give them 10 s more
      out[i] = (procs[i].wait(timeout=timeout if all(rc == 0 for rc, _ in out.values()) else 10),
                procs[i].stdout.read())
    except subprocess.TimeoutExpired:
      procs[i].kill()
      procs[i].wait()
      out[i] = (None, procs[i].stdout.read())
  return [out[i] for i in range(n)]


@pytest.fixture()
def servers():
  ss = [ps.Server(ps.ServerConfig(token="t", max_versions=2)).start() for _ in range(4)]
  yield ss
  for s in ss:
    s.stop()


def _expected(version):
  """The weights the helper publishes for `version`, computed here on one device."""
  return tiny(version, model.make_mesh(1, 1, 1))[1]


def _pull_and_check(addr, version, want):
  c = ps.Client(*addr.split(":")[:1], int(addr.split(":")[1]), token="t")
  m = c.manifest()
  assert m["version"] == version
  cfg = model.Config.from_hf_dict(m["config"])
  total = sum(x.nbytes for x in jax.tree.leaves(want))
  for mesh in (model.make_mesh(1, 1, 2, devices=jax.devices()[:2]), model.make_mesh(1, 1, 1, devices=jax.devices()[3:4])):
    got, pulled = rollout.pull_weights(m, model.param_shardings(cfg, mesh), {}, token="t")
    assert pulled == total  # each distinct slice its devices hold, once (TP=2 devices hold disjoint halves)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
      assert b.sharding.mesh == mesh
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # bit-exact
  return m


def test_4_process_publish_reshards_bit_exact_on_pull(servers):
  n = 4
  addrs = ",".join(f"127.0.0.1:{s.port}" for s in servers[:n])
  out = _run("publish", n, [(addrs, 0)] * n, devices=2)
  assert all(rc == 0 for rc, _ in out), "\n".join(o[-2000:] for _, o in out)
  sent = [int(o.split("SENT ")[1].split()[0]) for _, o in out]
  want = _expected(0)
  assert sum(sent) == sum(x.nbytes for x in jax.tree.leaves(want))  # every shard's bytes leave exactly once
  m = _pull_and_check(addrs.split(",")[0], 0, want)
  assert {p["server"] for t in m["tensors"].values() for p in t["pieces"]} == set(range(n))  # each its own


def test_trainer_killed_mid_publish_leaves_previous_version_visible(servers):
  """Also the 2-process case of the bit-exact reshard-on-pull test (v0 and v1 below)."""
  addrs = ",".join(f"127.0.0.1:{s.port}" for s in servers[:2])
  assert all(rc == 0 for rc, _ in _run("publish", 2, [(addrs, 0)] * 2, devices=2))
  _pull_and_check(addrs.split(",")[0], 0, _expected(0))
  # Process 1 is SIGKILLed after staging 3 pieces of v1; process 0 staged all of its own and waits at the
  # barrier until the test gives up on it: no manifest for v1 is ever committed.
  out = _run("publish", 2, [(addrs, 1), (addrs, 1, 3)], devices=2)
  assert out[1][0] == -9 and out[0][0] != 0, out
  assert ps.Client("127.0.0.1", servers[1].port, token="t").staged()["versions"] == [0, 1]  # v1 partially staged...
  _pull_and_check(addrs.split(",")[0], 0, _expected(0))  # ...but readers still see exactly v0
  # The restarted trainer republishes v1; it becomes visible and the servers garbage-collect old versions.
  assert all(rc == 0 for rc, _ in _run("publish", 2, [(addrs, 1)] * 2, devices=2))
  _pull_and_check(addrs.split(",")[0], 1, _expected(1))
  assert all(ps.Client("127.0.0.1", s.port, token="t").staged()["versions"] == [0, 1] for s in servers[:2])


def test_sharded_pull_of_a_collected_version_is_a_clear_error(servers):
  c = ps.Client("127.0.0.1", servers[0].port, token="t")
  mesh = model.make_mesh(1, 2, 1)
  cfg, p = tiny(0, mesh)
  for v in range(4):
    train.publish_shards([c], v, p, dict(config=cfg.to_hf_dict(), sampling={}))
  old = c.manifest()
  old["version"] = 0  # kept manifests are v2, v3: v0's pieces are gone
  with pytest.raises(ValueError, match="not held here"):
    rollout.pull_weights(old, model.param_shardings(cfg, mesh), {}, token="t")
  assert c.staged()["versions"] == [2, 3]


def _losses(out):
  return {int(l.split()[1]): float(l.split()[2]) for _, o in out for l in o.splitlines() if l.startswith("LOSS")}


def test_checkpoint_by_4_processes_resumes_on_2_and_1_with_the_same_losses(tmp_path):
  d = str(tmp_path / "ckpt")
  out = _run("ckpt", 4, [(d, 0, 6, 3)] * 4)  # 4 processes, fsdp=4: steps 1..6, checkpoint at 3
  assert all(rc == 0 for rc, _ in out), "\n".join(o[-2000:] for _, o in out)
  full = _losses(out[:1])
  for n in (2, 1):
    res = _run("ckpt", n, [(d, 3, 6, 0)] * n)
    assert all(rc == 0 for rc, _ in res), "\n".join(o[-2000:] for _, o in res)
    resumed = _losses(res[:1])
    assert sorted(resumed) == [4, 5, 6]
    for s in resumed:  # fsdp 4 vs 2 vs 1 only changes the reduction order
      np.testing.assert_allclose(resumed[s], full[s], rtol=2e-5)


def test_a_step_damaged_for_one_process_only_is_set_aside_by_all(tmp_path):
  """Issue 39: a checkpoint file that only process 1 reads is truncated. Both processes must agree to set the step
  aside and resume from the step before. Without the file sizes recorded at commit, process 1 raised inside
  orbax's restore while process 0 waited in orbax's collectives until it was killed."""
  d = str(tmp_path / "ckpt")
  for start, stop in ((0, 3), (3, 6)):  # steps 3 and 6 saved by 2 processes
    out = _run("ckpt", 2, [(d, start, stop, stop)] * 2)
    assert all(rc == 0 for rc, _ in out), "\n".join(o[-2000:] for _, o in out)
  files = [os.path.join(r, f) for r, _, fs in os.walk(os.path.join(d, "6")) for f in fs if "process_1" in r]
  victim = max(files, key=os.path.getsize)
  with open(victim, "r+b") as fh:
    fh.truncate(os.path.getsize(victim) // 2)
  out = _run("ckpt", 2, [(d, 3, 4, 0)] * 2, timeout=120)  # the helper asserts that step 3 is what restored
  assert all(rc == 0 for rc, _ in out), "\n".join(o[-2000:] for _, o in out)
  assert sorted(x.split(".")[0] for x in os.listdir(d) if x[0].isdigit()) == ["3", "6"]
  assert any(x.startswith("6.damaged-") for x in os.listdir(d)), os.listdir(d)


def test_kill_during_async_checkpoint_leaves_the_previous_one_valid(tmp_path):
  d = str(tmp_path / "ckpt")
  script = f"""
import os, signal, sys
sys.path.insert(0, {ROOT!r})
import jax, jax.numpy as jnp, train
c = train.Checkpointer({d!r}, keep=3)
big = dict(w=jnp.ones((4096, 4096)), b=jnp.zeros((8,)))  # 64 MiB: the write is still in flight below
c.save(1, big, dict(m=big["b"]), dict(step=1)); c.wait()
c.save(2, jax.tree.map(lambda x: x + 1, big), dict(m=big["b"] + 1), dict(step=2))
os.kill(os.getpid(), signal.SIGKILL)
"""
  p = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, JAX_PLATFORMS="cpu"), cwd=ROOT)
  assert p.returncode == -9
  import jax.numpy as jnp
  import train
  like = dict(w=jnp.zeros((4096, 4096)), b=jnp.ones((8,)))
  params, opt, st = train.Checkpointer(d, keep=3).restore(like, dict(m=like["b"]))
  assert st == dict(step=1) and float(params["w"][7, 7]) == 1.0 and float(opt["m"][0]) == 0.0


def test_hf_export_gathers_bounded_pieces_and_round_trips(tmp_path):
  """train.export_hf (the trainer's collective export) writes what loads back bit for bit; the writer asks for one
  layer's slice at a time, cut into pieces of at most chunk_bytes (whole HF rows), never a layer-stacked tensor."""
  mesh = model.make_mesh(1, 2, 1)
  cfg, p = tiny(3, mesh)
  with jax.set_mesh(mesh):  # as the trainer runs it (an earlier test may have left another mesh set)
    train.export_hf(str(tmp_path / "out"), cfg, p)
  _, back = model.load_hf_checkpoint(str(tmp_path / "out"))
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), p, back)
  flat, pieces = param_server.flatten(p), []

  def get_piece(key, layer, axis, rows):
    x = np.asarray(flat["/".join(key)])
    x = x if layer is None else x[layer]
    unit = x.nbytes if axis is None else x.nbytes // x.shape[axis]  # one whole HF row (group), the smallest cut
    pieces.append((key, layer, unit * (1 if axis is None else rows.stop - rows.start), unit))
    return x if axis is None else x[(slice(None),) * axis + (rows,)]
  model.save_hf_checkpoint_streamed(str(tmp_path / "small"), cfg, get_piece, "float32", chunk_bytes=512)
  assert all(layer is not None for key, layer, _, _ in pieces if key[0] == "layers")
  assert all(n <= max(512, unit) for _, _, n, unit in pieces)
  assert len(pieces) > 2 * len(flat)  # cut finer than a layer: w_up's 8 KiB per layer comes in 512-byte pieces
  a = safetensors.numpy.load_file(str(tmp_path / "out" / "model.safetensors"))
  b = safetensors.numpy.load_file(str(tmp_path / "small" / "model.safetensors"))
  assert sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)


def test_sharded_messages_reject_bad_input_and_keep_serving(servers):
  c = ps.Client("127.0.0.1", servers[0].port, token="t")
  a = np.arange(12, dtype=np.float32).reshape(3, 4)
  anon = ps.Client("127.0.0.1", servers[0].port)
  with pytest.raises(PermissionError):
    anon.stage(0, 1, "w", [[0, 3], [0, 4]], a)
  with pytest.raises(ValueError, match="does not match shape"):
    c.stage(0, 1, "w", [[0, 2], [0, 4]], a)
  c.stage(0, 1, "w", [[0, 3], [4, 8]], a)
  piece = dict(name="w", index=[[0, 3], [4, 8]], crc=c.staged(0, 1)["pieces"][0]["crc"])
  with pytest.raises(PermissionError):  # reads need the token too
    anon.staged(0, 1)
  assert c.staged()["versions"] == [0]
  (got,) = c.fetch(0, [dict(piece, sub=[[1, 3], [2, 4]])])
  np.testing.assert_array_equal(got, a[1:3, 2:4])
  with pytest.raises(ValueError, match="outside piece"):
    c.fetch(0, [dict(piece, sub=[[0, 4], [0, 4]])])
  with pytest.raises(ValueError, match="not held here"):
    c.fetch(0, [dict(piece, crc=piece["crc"] + 1, sub=None)])
  with pytest.raises(ValueError, match="JSON manifest"):
    c._request(ps.COMMIT, {}, [b"not json"])
  assert c.manifest() is None and c.latest_version() == -1  # nothing was committed


def test_no_leaf_is_ever_whole_on_one_device_from_load_to_export(tmp_path):
  """2 processes x 2 devices (fsdp 4): the HF checkpoint is read straight into its shardings, the optimizer state
  and the reference follow them through a train step, the export gathers one layer's slice at a time (never a
  whole leaf), and the export loads onto a worker's tensor-parallel mesh for eval."""
  from multiproc_helper import CFG_HF
  cfg = model.Config.from_hf_dict(CFG_HF)
  model.save_hf_checkpoint(str(tmp_path / "base"), cfg, model.init_params(cfg, jax.random.PRNGKey(0)))
  res = _run("placement", 2, [(tmp_path / "base", tmp_path / "out")] * 2, devices=2)
  for rc, out in res:
    assert rc == 0, out[-3000:]
    for what in ("load", "optimizer", "reference", "train", "eval"):
      assert f"PLACED {what}" in out, (what, out[-2000:])
    gathered, biggest = map(int, next(l for l in out.splitlines() if l.startswith("GATHERED")).split()[1:])
    assert gathered <= 2048 < biggest, (gathered, biggest)  # pieces of chunk_bytes, never a whole leaf
