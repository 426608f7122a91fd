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
  pull(..., base=(manifest, params))      delta sync: the same, but each piece comes as what changed since the
      version the reader holds (param_server DELTA, built once per version by the server), applied in place on
      a host copy of the held slice; the result's crc must be the new version's, else that piece is pulled in
      full (so does a reader that skipped a version, or whose server restarted since).

One server and one process is the S=1 case of the same code. The manifest (JSON):
  {"version", "servers": ["host:port", ...], "config": {HF config}, "sampling": {...},
   "tensors": {name: {"dtype", "shape", "pieces": [{"index": [[start, stop], ...], "crc", "server": k}]}}}

Run: python -m pytest -q tests/test_shards.py ; python bench_sharded.py (see RESULTS.md).
"""
import concurrent.futures
import json
import random
import zlib

import jax
import numpy as np
from jax.experimental import multihost_utils

import param_server


def flat_leaves(tree):
  """Pytree of dicts -> {"a/b/c": leaf}: the names tensors travel under (same as param_server.flatten)."""
  return {"/".join(str(getattr(k, "key", k)) for k in path): leaf
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


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


def pull(manifest, shardings, clients, base=None, stats=None):
  """The manifest's weights placed with `shardings` (a pytree of Shardings, same structure as the published
  tree). clients: dict "host:port" -> Client, filled on demand. Returns (pytree of jax.Array, bytes pulled).

  Delta sync: base=(manifest, params) the reader holds now (what an earlier pull returned with the same
  shardings). Each piece then comes as a delta against it (param_server DELTA: the server builds it once for the
  whole fleet), applied in place on a host copy of the held slice; the RESULT's crc must equal the new version's,
  so a wrong or corrupted base or a lost delta never goes unnoticed: such a piece, like one the server has no
  base for (the reader skipped a version, or the server restarted), is pulled in full. The returned bytes are
  what crossed the wire. stats (a dict) gets bytes, full_bytes (what a full pull moves), changed_bytes over
  covered_bytes (the pieces that came as deltas), pieces by encoding, and fallbacks (crc mismatches refetched).
  """
  sh = flat_leaves(shardings)
  if set(sh) != set(manifest["tensors"]):
    raise ValueError(f"manifest v{manifest['version']} tensors {sorted(manifest['tensors'])[:4]}... do not match "
                     f"the reader's {sorted(sh)[:4]}...")
  if base is not None and base[0]["version"] >= manifest["version"]:
    raise ValueError(f"pull: base v{base[0]['version']} is not older than manifest v{manifest['version']}")
  held = flat_leaves(base[1]) if base is not None else {}
  conns = [clients[a] if a in clients else clients.setdefault(a, connect(a)) for a in manifest["servers"]]
  st = dict(bytes=0, full_bytes=0, changed_bytes=0, covered_bytes=0, pieces={}, fallbacks=0)
  out = {}
  with concurrent.futures.ThreadPoolExecutor(len(conns)) as pool:
    for name, t in manifest["tensors"].items():
      shape, dt = tuple(t["shape"]), param_server._np_dtype(t["dtype"])
      wanted = {}  # distinct global slice -> the local devices that hold it
      for d, idx in sh[name].addressable_devices_indices_map(shape).items():
        wanted.setdefault(tuple(map(tuple, _index(idx, shape))), []).append(d)
      old = _held_slices(base, name, t, held, wanted)  # slice -> the base's host copy, where a delta can apply
      bufs = {w: old[w] if w in old else np.empty([b - a for a, b in w], dt) for w in wanted}
      base_crc = {json.dumps(p["index"]): p["crc"] for p in base[0]["tensors"][name]["pieces"]} if old else {}
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
          req = dict(name=name, index=p["index"], crc=p["crc"], sub=sub)
          if w in old and json.dumps(p["index"]) in base_crc:
            req["base_crc"] = base_crc[json.dumps(p["index"])]
          jobs.setdefault(p["server"], []).append((req, (w, dest)))
          covered += int(np.prod([h - l for l, h in zip(lo, hi)]))
        if covered != bufs[w].size:
          raise ValueError(f"manifest v{manifest['version']}: pieces of {name!r} cover {covered} of the "
                           f"{bufs[w].size} elements of slice {w}")
      again = {}  # server -> jobs whose delta did not rebuild the new bytes: pulled in full below
      for k, full, got in pool.map(lambda k: (k, *_get(conns[k], manifest["version"], base, jobs[k])), list(jobs)):
        for (_, (w, dest)), a in full:
          bufs[w][dest] = a
          st["bytes"] += a.nbytes
        for (req, (w, dest)), r in got:
          st["bytes"] += len(r["data"])
          st["pieces"][r["enc"]] = st["pieces"].get(r["enc"], 0) + 1
          if r["changed"] >= 0:
            st["changed_bytes"] += r["changed"] * dt.itemsize
            st["covered_bytes"] += bufs[w][dest].nbytes
          if not _apply(r, bufs[w], dest):
            st["fallbacks"] += 1
            again.setdefault(k, []).append(({kk: v for kk, v in req.items() if kk != "base_crc"}, (w, dest)))
      for k, full, _ in pool.map(lambda k: (k, *_get(conns[k], manifest["version"], None, again[k])), list(again)):
        for (_, (w, dest)), a in full:
          bufs[w][dest] = a
          st["bytes"] += a.nbytes
      out[name] = jax.make_array_from_single_device_arrays(
          shape, sh[name], [jax.device_put(bufs[w], d) for w, ds in wanted.items() for d in ds])
      st["full_bytes"] += sum(b.nbytes for b in bufs.values())
  if stats is not None:
    stats.update(st)
  return param_server.unflatten(out), st["bytes"]


def _held_slices(base, name, t, held, wanted):
  """{slice: writable host copy of the base's bytes for it} for the wanted slices a delta can apply to: the base
  holds the tensor with the same dtype and shape, and one of its local shards is exactly that slice."""
  if base is None or name not in held or name not in base[0]["tensors"]:
    return {}
  bt, x = base[0]["tensors"][name], held[name]
  if (bt["dtype"], bt["shape"]) != (t["dtype"], t["shape"]) or tuple(x.shape) != tuple(t["shape"]):
    return {}
  shards = {tuple(map(tuple, _index(s.index, x.shape))): s for s in x.addressable_shards}
  # A copy: a device array may alias host memory (CPU), and the pull must not change the weights in use.
  return {w: np.array(shards[w].data, copy=True) for w in wanted if w in shards}


def _get(conn, version, base, jobs):
  """One server's part of a pull: ([(job, array)] pulled in full, [(job, delta reply)])."""
  plain = [j for j in jobs if "base_crc" not in j[0]]
  delta = [j for j in jobs if "base_crc" in j[0]]
  return (list(zip(plain, conn.fetch(version, [r for r, _ in plain]))) if plain else [],
          list(zip(delta, conn.delta(version, base[0]["version"], [r for r, _ in delta]))) if delta else [])


def _apply(r, buf, dest):
  """Rebuilds buf[dest] from a delta reply in place (on a contiguous copy if the region is not contiguous);
  True if the result's crc is the new version's."""
  cur = np.ascontiguousarray(buf[dest])
  try:
    param_server.delta_apply(r["enc"], r["data"], cur, cur.dtype.itemsize)
  except ValueError:
    return False
  if not np.may_share_memory(cur, buf):
    buf[dest] = cur
  return zlib.crc32(cur.reshape(-1).view(np.uint8)) == r["crc"]
