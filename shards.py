"""shards.py: the pod-scale weight path. Publish without gathering, commit by manifest, reshard on pull.

The JAX side of param_server.py's sharded mode (param_server.py itself stays stdlib + numpy):

  publish(clients, version, tree, meta)   every trainer process stages the shards it holds with replica_id 0
      (so each shard's bytes leave the trainer exactly once), one shard at a time (np.asarray of that shard
      only), on its own shard server clients[process_index % S], tagged with its global slice. After a barrier
      process 0 asks every server what it staged, checks that every slice of every tensor is there, and commits
      the manifest on clients[0] LAST. Readers only see committed manifests: a trainer process killed mid-publish
      leaves the previous version visible (its staged pieces are garbage-collected by the servers).
  pull(manifest, shardings, clients)      a reader with its own mesh (e.g. tensor parallel over its local
      devices) works out which global slice each of its devices needs, fetches exactly the intersecting parts
      of the staged pieces from every server in parallel (one thread and one Client per server; the server cuts
      the slice, so only the needed bytes travel), verifies crcs, fills one host buffer per distinct slice and
      builds the jax.Array with make_array_from_single_device_arrays. Bytes pulled = bytes its devices hold
      (replicated slices once); no full host copy of a tensor it holds only part of.

One server and one process is the S=1 case of the same code. The manifest (JSON):
  {"version", "servers": ["host:port", ...], "config": {HF config}, "sampling": {...},
   "tensors": {name: {"dtype", "shape", "pieces": [{"index": [[start, stop], ...], "crc", "server": k}]}}}

Run: python -m pytest -q tests/test_shards.py ; python bench/bench_sharded.py (see README).
"""
import concurrent.futures
import json
import random

import jax
import numpy as np
from jax.experimental import multihost_utils

import param_server


def flat_leaves(tree):
  """Pytree of dicts -> {"a/b/c": leaf}: the names tensors travel under (same as param_server.flatten)."""
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    out["/".join(str(getattr(k, "key", k)) for k in path)] = leaf
  return out


def _index(idx, shape):
  """A device's tuple of slices -> [[start, stop], ...] over the global shape."""
  return [[s.start or 0, d if s.stop is None else s.stop] for s, d in zip(idx, shape)]


def connect(addr, token=None, retries=8):
  host, port = addr.rsplit(":", 1)
  return param_server.Client(host, int(port), token=token, retries=retries)


def own_server_addresses(manifest_server, port):
  """A pod: every trainer process has a shard server on its own host at `port`, except process 0, whose host
  runs the main server (manifest_server). Returns all of them in process order, as host:port (this host's
  address is the one that reaches the manifest server): process i stages on entry i. Collective."""
  import socket
  host, mport = manifest_server.rsplit(":", 1)
  with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    s.connect((host, int(mport)))
    me = f"{s.getsockname()[0]}:{port}".encode()
  buf = np.zeros(64, np.uint8)
  buf[:len(me)] = np.frombuffer(me, np.uint8)
  allb = multihost_utils.process_allgather(buf) if jax.process_count() > 1 else buf[None]
  return [manifest_server] + [bytes(b).rstrip(b"\0").decode() for b in np.asarray(allb)][1:]


def _agree(version):
  """Process 0's (version, nonce) on every process: all stage under the same tag."""
  v = np.asarray([version, random.getrandbits(31)], np.int64)
  if jax.process_count() > 1:
    v = multihost_utils.broadcast_one_to_all(v)
  return int(v[0]), int(v[1])


def publish(clients, version, tree, meta):
  """Stages this process's replica-0 shards of `tree` on its server; process 0 commits the manifest last.
  Collective: every trainer process calls it. Returns (version, bytes this process sent)."""
  version, nonce = _agree(version)
  flat = flat_leaves(tree)
  own, sent = clients[jax.process_index() % len(clients)], 0
  for name, x in flat.items():
    for s in x.addressable_shards:
      if s.replica_id == 0:
        host = np.asarray(s.data)  # this shard only, device -> host
        own.stage(version, nonce, name, _index(s.index, x.shape), host)
        sent += host.nbytes
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(f"publish v{version}")  # every process has staged
  if jax.process_index() == 0:
    _commit(clients, version, nonce, flat, meta)
  return version, sent


def _commit(clients, version, nonce, flat, meta):
  """Builds the manifest from what the servers really hold, checks it covers every slice, commits it, GCs."""
  with concurrent.futures.ThreadPoolExecutor(len(clients)) as pool:
    tables = list(pool.map(lambda c: c.staged(version, nonce)["pieces"], clients))
  tensors = {n: dict(dtype=str(x.dtype), shape=list(x.shape), pieces=[]) for n, x in flat.items()}
  for k, table in enumerate(tables):
    for p in table:
      tensors[p["name"]]["pieces"].append(dict(index=p["index"], crc=p["crc"], server=k))
  for n, x in flat.items():
    need = {json.dumps(_index(i, x.shape)) for i in x.sharding.devices_indices_map(x.shape).values()}
    have = [json.dumps(p["index"]) for p in tensors[n]["pieces"]]
    if need != set(have) or len(have) != len(need):
      raise RuntimeError(f"publish v{version}: tensor {n!r} staged slices {sorted(have)} != expected {sorted(need)}")
  kept = clients[0].commit(dict(meta, version=version, servers=[f"{c.host}:{c.port}" for c in clients],
                                tensors=tensors))
  for c in clients:
    c.staged(keep=kept)


def pull(manifest, shardings, clients):
  """The manifest's weights placed with `shardings` (a pytree of Shardings, same structure as the published
  tree). clients: dict "host:port" -> Client, filled on demand. Returns (pytree of jax.Array, bytes pulled)."""
  sh = flat_leaves(shardings)
  if set(sh) != set(manifest["tensors"]):
    raise ValueError(f"manifest v{manifest['version']} tensors {sorted(manifest['tensors'])[:4]}... do not match "
                     f"the reader's {sorted(sh)[:4]}...")
  conns = [clients[a] if a in clients else clients.setdefault(a, connect(a)) for a in manifest["servers"]]
  out, pulled = {}, 0
  with concurrent.futures.ThreadPoolExecutor(len(conns)) as pool:
    for name, t in manifest["tensors"].items():
      shape, dt = tuple(t["shape"]), param_server._np_dtype(t["dtype"])
      wanted = {}  # distinct global slice -> the local devices that hold it
      for d, idx in sh[name].addressable_devices_indices_map(shape).items():
        wanted.setdefault(tuple(map(tuple, _index(idx, shape))), []).append(d)
      bufs = {w: np.empty([b - a for a, b in w], dt) for w in wanted}
      jobs = {}  # server -> [(fetch request, (slice, destination within its buffer))]
      for w in wanted:
        covered = 0
        for p in t["pieces"]:
          lo = [max(a, pa) for (a, _), (pa, _) in zip(w, p["index"])]
          hi = [min(b, pb) for (_, b), (_, pb) in zip(w, p["index"])]
          if any(l >= h for l, h in zip(lo, hi)):
            continue
          sub = [[l - pa, h - pa] for l, h, (pa, _) in zip(lo, hi, p["index"])]
          dest = tuple(slice(l - a, h - a) for l, h, (a, _) in zip(lo, hi, w))
          jobs.setdefault(p["server"], []).append((dict(name=name, index=p["index"], crc=p["crc"], sub=sub),
                                                   (w, dest)))
          covered += int(np.prod([h - l for l, h in zip(lo, hi)]))
        if covered != bufs[w].size:
          raise ValueError(f"manifest v{manifest['version']}: pieces of {name!r} cover {covered} of the "
                           f"{bufs[w].size} elements of slice {w}")
      fetched = pool.map(lambda k: (k, conns[k].fetch(manifest["version"], [r for r, _ in jobs[k]])), list(jobs))
      for k, arrays in fetched:
        for (_, (w, dest)), a in zip(jobs[k], arrays):
          bufs[w][dest] = a
      out[name] = jax.make_array_from_single_device_arrays(
          shape, sh[name], [jax.device_put(bufs[w], d) for w, ds in wanted.items() for d in ds])
      pulled += sum(b.nbytes for b in bufs.values())
  return param_server.unflatten(out), pulled
