"""Delta weight sync (issue 18): a reader holding version v pulls only what changed (param_server DELTA,
rollout.pull_weights(base=...)), applied as patches on the devices that hold the slices; its weights stay
bit-identical to the published ones through skipped versions, a server restart and a payload damaged in transit."""
import zlib

import ml_dtypes
import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import param_server as ps
import train
import rollout
import param_server

BF16 = np.dtype(ml_dtypes.bfloat16)


def _trainer_mesh():
  return Mesh(np.array(jax.devices()[:4]), ("fsdp",))  # 4 pieces per tensor, split on rows


def _reader_shardings():
  m = Mesh(np.array(jax.devices()[4:6]), ("tp",))  # splits columns: sub-slices of every trainer piece
  return dict(w=NamedSharding(m, P(None, "tp")), e=NamedSharding(m, P(None, "tp")), b=NamedSharding(m, P()))


class Trainer:
  """fp32 master weights, a small update per step (an RL-sized step: most bf16 elements do not move), published
  as bf16 (w, e) and fp32 (b) through shards.publish."""

  def __init__(self, client):
    rng = np.random.default_rng(0)
    self.rng, self.client, self.version = rng, client, -1
    self.master = dict(w=rng.normal(0, 0.02, (64, 32)), e=rng.normal(0, 0.02, (16, 8)), b=rng.normal(0, 1, (32,)))

  def step_and_publish(self, lr=1e-5):
    for k, x in self.master.items():
      x += lr * self.rng.standard_normal(x.shape)
    self.version += 1
    self.published = {k: x.astype(np.float32 if k == "b" else BF16) for k, x in self.master.items()}
    mesh = _trainer_mesh()
    tree = {k: jax.device_put(x, NamedSharding(mesh, P("fsdp") if x.shape[0] % 4 == 0 else P()))
            for k, x in self.published.items()}
    train.publish_shards([self.client], self.version, tree, dict(config={}, sampling={}))


def _same(got, want):
  return all(np.array_equal(np.asarray(got[k]).view(np.uint8), want[k].view(np.uint8)) for k in want)


@pytest.fixture()
def server():
  box = [ps.Server(ps.ServerConfig(token="t", max_versions=2)).start()]
  yield box
  box[0].stop()


def test_delta_pulls_stay_bit_identical_through_a_skipped_version_and_a_server_restart(server):
  port = server[0].port
  trainer = Trainer(ps.Client("127.0.0.1", port, token="t"))
  reader, clients, sh = ps.Client("127.0.0.1", port, token="t"), {}, _reader_shardings()
  trainer.step_and_publish()
  m = reader.manifest()
  params, _ = rollout.pull_weights(m, sh, clients, token="t")  # first pull: full
  held = (m, params)

  def delta_pull():
    nonlocal held
    m = reader.manifest(newer_than=held[0]["version"])
    st = {}
    params, nbytes = rollout.pull_weights(m, sh, clients, base=held, stats=st, token="t")
    assert _same(params, trainer.published) and st["fallbacks"] == 0
    held = (m, params)
    return st

  trainer.step_and_publish()
  st = delta_pull()  # v0 -> v1: deltas, far fewer bytes than a full pull
  # only the fp32 b (4 pieces: its every element moves) goes in full
  assert st["pieces"].get("full", 0) <= 4 and st["bytes"] < st["full_bytes"] / 3, st
  assert 0 < st["changed_bytes"] < st["covered_bytes"]
  builds = reader.stats()["delta"]["builds"]
  other = {}  # a second worker pulling the same delta: served from the cache, nothing rebuilt
  rollout.pull_weights(held[0], sh, other, base=(m, params), token="t")
  assert reader.stats()["delta"]["builds"] == builds
  trainer.step_and_publish()
  trainer.step_and_publish()
  st = delta_pull()  # v1 -> v3, v2 skipped: the base is 2 back, the server answers the full bytes
  assert set(st["pieces"]) == {"full"} and st["bytes"] == st["full_bytes"]
  server[0].stop()  # restart: staged pieces and manifests are memory only, the trainer re-publishes
  server[0] = ps.Server(ps.ServerConfig(token="t", max_versions=2, port=port)).start()
  trainer.step_and_publish()
  st = delta_pull()  # v3 -> v4 on a server that never held v3: full
  assert set(st["pieces"]) == {"full"}
  trainer.step_and_publish()
  st = delta_pull()  # v4 -> v5: deltas again
  assert st["pieces"].get("full", 0) <= 4 and st["bytes"] < st["full_bytes"] / 3, st
  s = reader.stats()["delta"]
  assert 0 < s["cached_bytes"] <= sum(x.nbytes for x in trainer.published.values())


def test_a_delta_payload_damaged_in_transit_is_caught_by_its_crc_and_pulled_in_full(server, monkeypatch):
  trainer = Trainer(ps.Client("127.0.0.1", server[0].port, token="t"))
  reader, sh = ps.Client("127.0.0.1", server[0].port, token="t"), _reader_shardings()
  trainer.step_and_publish()
  m0 = reader.manifest()
  params, _ = rollout.pull_weights(m0, sh, {}, token="t")
  trainer.step_and_publish()
  real, done = ps.Client.delta, []

  def flip_one(self, *a, **kw):  # one bit of the first compressed payload flips on the way
    out = real(self, *a, **kw)
    r = next((r for r in out if r["enc"] != "full"), None)
    if r is not None and not done:
      r["data"] = bytes([r["data"][0] ^ 1]) + bytes(r["data"][1:])
      done.append(r)
    return out
  monkeypatch.setattr(ps.Client, "delta", flip_one)
  st = {}
  got, _ = rollout.pull_weights(reader.manifest(), sh, {}, base=(m0, params), stats=st, token="t")
  assert done and st["fallbacks"] == 1  # exactly that piece, fetched again in full
  assert _same(got, trainer.published)


@pytest.mark.parametrize("dtype", [BF16, np.float16, np.float32])
def test_a_patch_on_the_device_equals_the_host_reference(dtype):
  """rollout._apply (jitted patches on the slice's device) against param_server.apply_patch (numpy) for every kind,
  on a region of the slice (what a trainer piece covers of a worker's column slice), padding positions included,
  alone and followed by a second piece's patch (applied in place). XORs of every bit width: results include NaN
  payloads, infinities and subnormals, which must survive bit for bit (XLA CPU canonicalizes bf16 NaNs it moves)."""
  rng = np.random.default_rng(0)
  x = rng.normal(0, 1, (8, 6)).astype(dtype)
  held = jax.device_put(x, jax.devices()[3])
  u = np.dtype(f"uint{8 * x.itemsize}")
  dest, dest2 = (slice(2, 6), slice(1, 4)), (slice(6, 8), slice(0, 6))
  pos = np.sort(rng.choice(12, 5, replace=False))
  bits = lambda n: rng.integers(1, np.iinfo(u).max, n, dtype=u, endpoint=True)  # noqa: E731
  # The first patched element becomes a NaN with a payload, the second a subnormal (IEEE 754 bit layouts).
  odd = np.array({BF16: [0x7F81, 1], np.float16: [0x7C01, 1], np.float32: [0x7F800001, 1]}[dtype], u)
  region = x[dest].reshape(-1).view(u)
  for kind, a, p in (("set", bits(12), None), ("xor", bits(12), None), ("sparse", bits(5), pos)):
    a[:2] = odd if kind == "set" else odd ^ region[pos[:2] if kind == "sparse" else slice(0, 2)]
    want = ps.apply_patch(x.copy(), dest, kind, a, p)
    got = rollout._apply(held, [rollout.placed((dest, kind, a, p), x.shape)])
    assert got.devices() == {jax.devices()[3]}
    np.testing.assert_array_equal(np.asarray(got).view(u), want.view(u))
    if kind != "set":  # exactly the patched elements moved (every XOR is non-zero)
      assert (np.asarray(got).view(u) != x.view(u)).sum() == len(a)
    a2 = bits(12)
    two = rollout._apply(held, [rollout.placed(q, x.shape) for q in ((dest, kind, a, p), (dest2, "xor", a2, None))])
    np.testing.assert_array_equal(np.asarray(two).view(u), ps.apply_patch(want.copy(), dest2, "xor", a2, None).view(u))
    np.testing.assert_array_equal(np.asarray(held).view(u), x.view(u))  # the version in use stays


def test_delta_encoding_picks_the_smallest_and_round_trips():
  rng = np.random.default_rng(1)
  old = rng.normal(0, 0.02, 4096).astype(BF16)
  noise = rng.integers(0, 1 << 16, 4096, np.uint16).view(BF16)
  sparse, xor = old.copy(), old.view(np.uint16).copy()
  sparse[rng.integers(0, 4096, 80)] += BF16.type(1e-4)  # 2% changed: positions + XORs win
  xor[rng.random(4096) < 0.4] ^= 1  # 40% changed (sparse pairs would outgrow the slice): XOR wins
  most = (old.astype(np.float32) + rng.normal(0, 2e-4, 4096)).astype(BF16)  # low bits, ~3/4 changed: sent in full
  assert (most.view(np.uint16) != old.view(np.uint16)).sum() > 2048
  for want, new in (("sparse_zlib", sparse), ("xor_zlib", xor.view(BF16)), ("full", noise), ("full", most)):
    enc, payload, changed = ps.delta_encode(new.view(np.uint8), old.view(np.uint8), 2)
    assert enc == want and changed == int((new.view(np.uint16) != old.view(np.uint16)).sum()), (want, enc, changed)
    out = ps.apply_patch(old.copy(), (slice(None),), *ps.delta_decode(enc, payload, 4096, 2))
    assert np.array_equal(out.view(np.uint16), new.view(np.uint16))
  old32 = rng.normal(0, 0.02, 4096).astype(np.float32)  # 4-byte elements: the sparse path's other plane count
  new32 = old32.copy()
  new32[rng.integers(0, 4096, 80)] *= np.float32(1.001)
  enc, payload, _ = ps.delta_encode(new32.view(np.uint8), old32.view(np.uint8), 4)
  assert enc == "sparse_zlib"
  assert np.array_equal(ps.apply_patch(old32.copy(), (slice(None),), *ps.delta_decode(enc, payload, 4096, 4)), new32)
  # Known answer, written from delta_encode's docstring (position gaps as 4 byte planes, low byte first, then the
  # XORs' byte planes): positions 3 and 5 (gaps 3, 2), XORs 0x0102 and 0x0304.
  kind, a, pos = ps.delta_decode("sparse_zlib", zlib.compress(bytes([3, 2, 0, 0, 0, 0, 0, 0, 2, 4, 1, 3])), 8, 2)
  assert kind == "sparse" and pos.tolist() == [3, 5] and a.tolist() == [0x0102, 0x0304]
  with pytest.raises(ValueError, match="sparse payload"):  # a position past the slice
    ps.delta_decode("sparse_zlib", zlib.compress(np.array([5000], "<u4").tobytes() + b"\0\0"), 4096, 2)
  with pytest.raises(ValueError, match="xor payload"):
    ps.delta_decode("xor_zlib", zlib.compress(b"\0" * 10), 4096, 2)
  with pytest.raises(ValueError, match="expands past"):  # a zip bomb cannot blow up the reader's memory
    ps.delta_decode("xor_zlib", zlib.compress(b"\0" * 100_000), 4096, 2)


def test_delta_request_checks_its_arguments(server):
  c = ps.Client("127.0.0.1", server[0].port, token="t")
  c.stage(1, 7, "w", [[0, 2]], np.ones(2, np.float32))
  piece = dict(name="w", index=[[0, 2]], crc=c.staged(1, 7)["pieces"][0]["crc"], sub=None, base_crc=0)
  with pytest.raises(ValueError, match="base must be an int older"):
    c.delta(1, 1, [piece])
  with pytest.raises(ValueError, match="not held here"):
    c.delta(2, 1, [piece])
  (r,) = c.delta(1, 0, [piece])  # no base held: the full bytes
  assert r["enc"] == "full" and bytes(r["data"]) == np.ones(2, np.float32).tobytes()
