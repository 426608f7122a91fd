"""Parameter server: versioned weights down to workers, leased queues (prompts, rollouts) in both directions.

Plain TCP, stdlib + numpy (ml_dtypes on the client, for bf16). Every request and every reply is one frame:
  prefix   20 bytes, struct "<4sHHIQ": magic b"RLPS", protocol version 1, message type, header and payload lengths
  header   a UTF-8 JSON object (names, dtypes, shapes, ids, token, ...)
  payload  raw bytes: tensors back to back in header order, little-endian, C order, never pickled
A tensor is {"name", "dtype", "shape", "nbytes", "crc"}; crc = zlib.crc32 (~2 GiB/s here, 4x blake2b), computed by
the receiver in a second thread while the bytes arrive. A reply is OK, or ERROR {"error", "code"}.

Messages. Every one needs the shared token (reads too: the weights are the model), which a client sends once per
connection with AUTH; until then each request is refused and one announcing a payload closes the connection.
  STAGE     a piece of a tensor (a trainer shard: its global slice [[start, stop], ...], version, publish nonce),
            invisible to readers; at most max_versions committed + 2 staged versions are held
  STAGED    the pieces staged for (version, nonce); with keep=[committed versions] drops older unkept ones
  COMMIT    a manifest (check_manifest: each tensor's dtype, shape, pieces with index, crc and server index into
            "servers"), written last by the coordinator once every server holds every piece; max_versions kept
  MANIFEST  the newest manifest newer than newer_than (waits up to wait_s); LATEST: its version (-1: none)
  FETCH     sub-slices of staged pieces, cut by the server (only the needed bytes travel), crc-checked; a piece
            whose crc is not the requested one (replaced or collected) is refused
  DELTA     FETCH for a reader holding version `base`: per piece delta_encode's encoding of what changed (or the
            full bytes) and its crc (pcrc); the RESULT's crc too. Only against the previous version
            staged here; built once per (piece, sub-slice, base) for the whole fleet and cached beside its
            version (gone with it, never more than its own bytes)
  PUT, GET, ACK, REQUEUE, FAIL: the leased queues (see Client); STATS; AUTH
  REGISTER  a trainer's start: returns a new trainer epoch (persisted with run_dir). Every request that carries an
            older "epoch" than the newest registered is refused ("fenced"): one trainer per run, even one started
            by hand beside a supervised one cannot ack, issue, lease or commit, so no step is trained twice

Guarantees:
  - Bounded memory: every length is capped before it is read (headers by untrusted_header_kb until the connection
    authenticated); staged versions as above; each queue by max_queue_items and max_queue_mb (ready + leased). A
    FETCH / DELTA reply is capped at the version's bytes here, and sent from views of the stored pieces, a sub-slice
    copied a CHUNK at a time; a peer address has at most max_peer_requests in service and starts at most
    max_peer_rps per second (more: "busy", retried).
  - Deadlines on every read: idle_timeout_s for a request's first byte, header_timeout_s for prefix + header, then
    payload / min_rate_mb_s, so a trickling client times out. A connection gets a thread only once its first byte
    arrived. When max_clients are connected a newcomer evicts an anonymous connection, else an idle authenticated
    one (its client reconnects); only when every slot does authenticated work is it answered "busy".
  - A malformed frame (magic, version, type, lengths, JSON with NaN / huge ints / deep nesting, truncation,
    timeout) gets an ERROR and a closed connection; a refused request (token, arguments, stale version, disk)
    gets an ERROR and the connection stays usable. The token is checked before any payload byte is read.
  - Queues: put is idempotent by id; get leases for lease_s (an expired lease re-issues the item first) to the
    Client's holder (secret, one per process): ack, FAIL, release and requeue of an item leased since to another
    holder are refused (ack: "stale"); ack is forever; FAIL re-issues an item until max_failures, then quarantines
    it with a notice in "<queue>.failed". With run_dir each queue is an append-only log of framed records (length
    and crc per record and per prefix: a damaged one is skipped and counted, the ones after it kept, and the log
    copied aside before it is rewritten), fsync'ed before a change is applied or answered (a failed write answers
    StorageError and changes nothing), compacted at startup and past 2x its live size. Leases and weights are not
    persisted: after a restart every unacked item is ready again and the trainer re-publishes.

Run: python param_server.py --port=5555 --token_file=runs/token --run_dir=runs/ps   (SIGTERM: gone within a second)
Bench: python -m bench.server --size_mb=1024;  python -m bench.faults
"""
import collections
import concurrent.futures
import contextlib
import dataclasses
import functools
import hmac
import itertools
import json
import logging
import math
import mmap
import os
import queue as queue_lib
import random
import re
import secrets
import select
import shutil
import selectors
import signal
import socket
import struct
import threading
import time
import zlib

import numpy as np

import common
from common import StopFlag  # noqa: F401  (the entry points take it from here)

MAGIC, PROTOCOL_VERSION = b"RLPS", 1
PREFIX = struct.Struct("<4sHHIQ")  # magic, protocol version, message type, header len, payload len
LATEST, PUT, GET, ACK, REQUEUE, STATS = range(3, 9)
STAGE, STAGED, COMMIT, MANIFEST, FETCH, DELTA = range(9, 15)
AUTH, FAIL, REGISTER = 32, 33, 34
OK, ERROR = 64, 65
REQUEST_TYPES = {LATEST: "latest", PUT: "put", GET: "get", ACK: "ack", REQUEUE: "requeue", STATS: "stats",
                 STAGE: "stage", STAGED: "staged", COMMIT: "commit", MANIFEST: "manifest", FETCH: "fetch",
                 DELTA: "delta", AUTH: "auth", FAIL: "fail", REGISTER: "register"}
MAX_JSON_DEPTH = 32   # headers are flat records; deep nesting only costs the parser (and recursion) memory
MAX_NDIM = 32
CHUNK = 8 << 20  # socket I/O granularity: big enough to amortize syscalls, small enough for rate deadlines
DTYPES = {"bool": 1, "int8": 1, "uint8": 1, "int16": 2, "uint16": 2, "float16": 2, "bfloat16": 2,
          "int32": 4, "uint32": 4, "float32": 4, "int64": 8, "uint64": 8, "float64": 8}
_QUEUE_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
log = logging.getLogger("param_server")


class ProtocolError(ValueError):
  """A malformed frame (either direction)."""


class ChecksumError(RuntimeError):
  """Received tensor bytes do not match the sender's crc."""


class QueueFullError(RuntimeError):
  """put() found no room within wait_s; the message says how many were accepted. Retrying is safe."""


class StorageError(RuntimeError):
  """The server could not make a put/ack/fail durable (disk full, I/O error): nothing changed; retry later."""


class FencedError(RuntimeError):
  """A newer trainer registered (Client.register_trainer): this one must stop; nothing it asked was done."""


class _Refused(Exception):
  """A well-formed request the server declines: the reply carries `code` and the connection stays open."""

  def __init__(self, code, msg):
    super().__init__(msg)
    self.code = code


class _Truncated(ConnectionError):
  pass


class _AuthClose(Exception):
  """An unauthenticated request that carries a payload: refused and the connection closed, payload unread."""


class _Idle(TimeoutError):
  """No request started within the idle timeout: the server closes silently (there is nothing to answer)."""


def _int(x):
  return isinstance(x, int) and not isinstance(x, bool)


# ----------------------------------------------------------------------------------------------- framing


def _alloc(n):
  """A writable n-byte buffer; big ones are anonymous mmaps asking for huge pages (cheap first-touch faults)."""
  if n < (1 << 20):
    return bytearray(n)
  mm = mmap.mmap(-1, n)
  with contextlib.suppress(AttributeError, OSError):
    mm.madvise(mmap.MADV_HUGEPAGE)
  return mm


def _recv_into(sock, mv, deadline, what, on_progress=lambda got: None):
  """Fill memoryview mv from sock before `deadline` (time.monotonic()); on_progress(bytes_so_far) per chunk."""
  got, n = 0, len(mv)
  while got < n:
    left = deadline - time.monotonic()
    if left <= 0:
      raise TimeoutError(f"timed out receiving {what}: got {got} of {n} bytes")
    sock.settimeout(left)
    try:
      k = sock.recv_into(mv[got:], min(n - got, CHUNK))
    except socket.timeout:
      raise TimeoutError(f"timed out receiving {what}: got {got} of {n} bytes") from None
    if k == 0:
      raise _Truncated(f"connection closed during {what}: got {got} of {n} bytes")
    got += k
    on_progress(got)


def _chunks(parts):
  """The payload parts as contiguous byte chunks: bytes-likes as they are; a strided np view (a sub-slice cut by
  the server) copied at most CHUNK bytes (or one innermost row) at a time, so no request holds a copy of what it
  asked for, however much that is."""
  for p in parts:
    if not isinstance(p, np.ndarray) or p.flags.c_contiguous:
      yield memoryview(p).cast("B")
    elif p[0].nbytes > CHUNK:
      yield from _chunks(p)  # row by row
    else:
      step = max(1, CHUNK // p[0].nbytes)
      yield from (memoryview(np.ascontiguousarray(p[i:i + step])).cast("B") for i in range(0, len(p), step))


def _send_frame(sock, mtype, header, parts=(), *, deadline):
  """Sends one frame; the payload parts (bytes-like or np views) go out without copying, in CHUNK slices."""
  total = sum(memoryview(p).nbytes for p in parts)
  hb = json.dumps(header, separators=(",", ":"), allow_nan=False).encode()  # the peer refuses NaN anyway
  head = PREFIX.pack(MAGIC, PROTOCOL_VERSION, mtype, len(hb), total) + hb
  mvs = [head + b"".join(_chunks(parts))] if total <= 65536 else itertools.chain([head], _chunks(parts))
  for m in map(memoryview, mvs):  # small: one syscall
    for i in range(0, len(m), CHUNK):
      left = deadline - time.monotonic()
      if left <= 0:
        raise TimeoutError(f"timed out sending a {total}-byte payload")
      sock.settimeout(left)
      sock.sendall(m[i:i + CHUNK])


def _finite(text):
  x = float(text)
  if not math.isfinite(x):
    raise ValueError(f"non-finite number {text!r}")
  return x


def parse_header(hb):
  """A frame header's bytes -> dict. Refuses (ProtocolError) bad UTF-8 or JSON, NaN / Infinity / overflowing floats
  (NaN defeats deadline arithmetic), ints of > 4300 digits, nesting deeper than MAX_JSON_DEPTH, a non-object."""
  try:
    header = json.loads(hb, parse_constant=_finite, parse_float=_finite)  # NaN, Infinity, -Infinity: refused too
  except (UnicodeDecodeError, ValueError, RecursionError) as e:
    raise ProtocolError(f"frame header is not valid JSON: {type(e).__name__}: {str(e)[:200]}") from None
  if not isinstance(header, dict):
    raise ProtocolError(f"frame header must be a JSON object, got {type(header).__name__}")
  stack = [(header, 1)]
  while stack:
    o, d = stack.pop()
    if isinstance(o, (dict, list)):
      if d > MAX_JSON_DEPTH:
        raise ProtocolError(f"frame header nests deeper than {MAX_JSON_DEPTH} levels")
      stack.extend((v, d + 1) for v in (o.values() if isinstance(o, dict) else o))
  return header


def _read_prefix_header(sock, first_deadline, header_timeout_s, max_header, on_start=lambda: None):
  """Reads prefix + JSON header. Returns (mtype, header dict, payload_len) or None on a clean EOF.
  max_header: an int, or a function of the message type. on_start(): called once the first byte arrived."""
  pre = bytearray(PREFIX.size)
  mv = memoryview(pre)
  # The first byte may take long (an idle connection between requests); the rest must follow promptly.
  sock.settimeout(max(first_deadline - time.monotonic(), 1e-3))
  try:
    k = sock.recv_into(mv, PREFIX.size)
  except socket.timeout:
    raise _Idle("no frame started before the deadline") from None
  if k == 0:
    return None
  on_start()
  # One deadline for prefix + header, whatever lengths the prefix announces (a trickling client cannot stretch it).
  deadline = time.monotonic() + header_timeout_s
  _recv_into(sock, mv[k:], deadline, "frame prefix")
  magic, ver, mtype, hlen, plen = PREFIX.unpack(pre)
  if magic != MAGIC:
    raise ProtocolError(f"bad magic {bytes(magic)!r} (expected {MAGIC!r})")
  if ver != PROTOCOL_VERSION:
    raise ProtocolError(f"unsupported protocol version {ver} (this side speaks {PROTOCOL_VERSION})")
  cap = max_header(mtype) if callable(max_header) else max_header
  if hlen > cap:
    raise ProtocolError(f"header length {hlen} exceeds the limit of {cap} bytes")
  hb = bytearray(hlen)
  _recv_into(sock, memoryview(hb), deadline, "frame header")
  return mtype, parse_header(hb), plen


def _recv_with_crcs(sock, buf, sizes, deadline, what):
  """Fills buf from sock and returns the crc32 of each of its tensors (`sizes` bytes back to back), computed in a
  helper thread while big payloads arrive."""
  mv = memoryview(buf).cast("B")
  if len(mv) < (4 << 20):
    _recv_into(sock, mv, deadline, what)
    return [zlib.crc32(mv[e - n:e]) for n, e in zip(sizes, itertools.accumulate(sizes))]
  progress = queue_lib.SimpleQueue()

  def run():
    crcs, start, avail = [], 0, 0
    for end in itertools.accumulate(sizes):
      crc = 0
      while start < end:
        while avail <= start:
          avail = progress.get()
          if avail is None:  # the transfer failed or ended: stop without checksumming the rest
            return crcs
        stop = min(end, avail)
        crc, start = zlib.crc32(mv[start:stop], crc), stop
      crcs.append(crc)
    return crcs

  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    crcs = pool.submit(run)
    try:
      _recv_into(sock, mv, deadline, what, progress.put)
    finally:
      progress.put(None)
  return crcs.result()  # raises what run raised, if anything


def _check_specs(specs, payload_len, what):
  """Validates a tensor table against the payload length; returns the list of byte sizes."""
  if not isinstance(specs, list):
    raise ValueError(f"{what}: tensor table must be a list")
  sizes = []
  for i, s in enumerate(specs):
    if not isinstance(s, dict):
      raise ValueError(f"{what}: tensor #{i} must be an object")
    name, dtype, shape, nbytes = s.get("name", ""), s.get("dtype"), s.get("shape"), s.get("nbytes")
    if dtype not in DTYPES:
      raise ValueError(f"{what}: tensor {name!r} has unsupported dtype {dtype!r} (allowed: {sorted(DTYPES)})")
    if not isinstance(shape, list) or len(shape) > MAX_NDIM or not all(_int(d) and d >= 0 for d in shape):
      raise ValueError(f"{what}: tensor {name!r} has bad shape {shape!r:.200} (want <= {MAX_NDIM} ints >= 0)")
    # math.prod is exact: np.prod in int64 wraps, and [2**32, 2**32] would pass as 0 bytes.
    if not _int(nbytes) or nbytes != math.prod(shape) * DTYPES[dtype]:
      raise ValueError(f"{what}: tensor {name!r} nbytes={nbytes!r} does not match {dtype}{shape}")
    sizes.append(nbytes)
  if sum(sizes) != payload_len:
    raise ValueError(f"{what}: tensors total {sum(sizes)} bytes but the payload is {payload_len} bytes")
  return sizes


def _check_crcs(specs, crcs, what, error=lambda msg: _Refused("checksum", msg)):
  for s, c in zip(specs, crcs):
    if s["crc"] != c:
      raise error(f"{what}: tensor {s['name']!r} crc {c} != declared {s['crc']}")


def _digest(version, specs):
  """crc32 over a reply's tensor table, so the table is covered too, not only the bytes."""
  table = [[s["name"], s["dtype"], s["shape"], s["nbytes"], s["crc"]] for s in specs]
  return zlib.crc32(json.dumps([version, table], separators=(",", ":")).encode())


def _np_dtype(name):
  if name == "bfloat16":
    import ml_dtypes  # client side only: the server never interprets tensor bytes
    return np.dtype(ml_dtypes.bfloat16)
  return np.dtype(name).newbyteorder("<")


def _as_wire_array(value, what):
  """np.ndarray (or anything np.asarray accepts) -> (spec without crc, uint8 view of little-endian C bytes)."""
  a = np.asarray(value)
  if a.dtype.name not in DTYPES:
    raise ValueError(f"{what}: unsupported dtype {a.dtype} (allowed: {sorted(DTYPES)})")
  if a.dtype.byteorder == ">":
    a = a.astype(a.dtype.newbyteorder("<"))
  shape = list(a.shape)  # before ascontiguousarray, which turns 0-d into 1-d
  a = np.ascontiguousarray(a)
  return {"dtype": a.dtype.name, "shape": shape, "nbytes": a.nbytes}, a.reshape(-1).view(np.uint8)


def _views(buf, specs, base=0):
  """Zero-copy arrays over buf for a tensor table (tensors back to back from `base`)."""
  out, off = [], base
  for s in specs:
    dt = _np_dtype(s["dtype"])
    out.append(np.frombuffer(buf, dtype=dt, count=s["nbytes"] // dt.itemsize, offset=off).reshape(s["shape"]))
    off += s["nbytes"]
  return out


# ----------------------------------------------------------------------------------------------- delta codec


_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}  # an element's bits, whatever its dtype


def delta_encode(new, old, itemsize):
  """What a reader holding bytes `old` needs to rebuild bytes `new` (same length, elements of `itemsize` bytes).

  Returns (enc, payload, changed elements), the smallest of:
    "sparse_zlib"  zlib level 1 of the changed elements' position gaps (uint32) and their XOR against the old
                   value, each split into byte planes: the gaps' high bytes are ~all zero, and an RL step on bf16
                   weights flips only the low mantissa bits of an element, so both compress well. Tried while
                   the changed elements' raw (position, value) pairs are no bigger than the slice itself.
    "xor_zlib"     zlib level 1 of new XOR old (unchanged elements are zero bytes): wins when many elements
                   changed (a third to a half of them, for bf16).
    "full"         the new bytes, where a delta would be larger or more than half the elements changed (fp32
                   weights after an Adam step: ~80%; a cached delta of them took a worker 7-10x a full pull).
  On bf16 N(0, 0.02) weights with 1.5% of elements changed, sparse_zlib is 1.1% of the bytes (xor_zlib 3.1%) and
  twice as fast to apply.
  """
  if len(new) != len(old) or itemsize not in _UINT or len(new) % itemsize:
    raise ValueError(f"delta_encode: {len(new)} new vs {len(old)} old bytes, itemsize {itemsize}")
  u = _UINT[itemsize]
  x = np.frombuffer(new, u) ^ np.frombuffer(old, u)
  changed = int(np.count_nonzero(x))
  best = ("full", new)
  if changed * 2 > x.size:
    return best[0], best[1], changed
  if changed * (4 + itemsize) <= len(new) and x.size < 2 ** 32:
    pos = np.flatnonzero(x)
    gaps = np.diff(pos, prepend=0).astype("<u4")
    planes = [gaps.view(np.uint8).reshape(-1, 4).T.reshape(-1),
              x[pos].view(np.uint8).reshape(-1, itemsize).T.reshape(-1)]
    best = min(best, ("sparse_zlib", zlib.compress(np.concatenate(planes), 1)), key=lambda e: len(e[1]))
  # sparse_zlib under 2% of the slice: xor_zlib always measured larger there; skip its cost (the whole slice).
  if changed and not (best[0] == "sparse_zlib" and len(best[1]) * 50 < len(new)):
    best = min(best, ("xor_zlib", zlib.compress(x, 1)), key=lambda e: len(e[1]))
  return best[0], best[1], changed


def _inflate(payload, limit):
  d = zlib.decompressobj()  # bounded: a bad payload cannot expand past `limit` bytes
  try:
    y = d.decompress(payload, limit)
  except zlib.error as e:
    raise ValueError(f"delta_decode: bad zlib payload: {e}") from None
  if d.unconsumed_tail or not d.eof:
    raise ValueError(f"delta_decode: zlib payload expands past {limit} bytes or is truncated")
  return np.frombuffer(y, np.uint8)


def delta_decode(enc, payload, n, itemsize):
  """delta_encode's (enc, payload) for a slice of n elements of `itemsize` bytes, as a patch (kind, a, pos):
  ("set", the new elements, None), ("xor", [n] XOR of every element, None) or ("sparse", XOR of the changed
  elements, their positions). Raises ValueError on a payload that cannot be the delta of such a slice."""
  if enc not in ("full", "sparse_zlib", "xor_zlib") or itemsize not in _UINT:
    raise ValueError(f"delta_decode: unknown encoding {enc!r} or itemsize {itemsize}")
  u = _UINT[itemsize]
  if enc != "sparse_zlib":
    kind, y = ("set", np.frombuffer(payload, np.uint8)) if enc == "full" else ("xor", _inflate(payload, n * itemsize))
    if y.size != n * itemsize:
      raise ValueError(f"delta_decode: {kind} payload of {y.size} bytes for a {n * itemsize}-byte slice")
    return kind, y.view(u), None
  y = _inflate(payload, n * (4 + itemsize))
  k, r = divmod(y.size, 4 + itemsize)
  pos = np.cumsum(_unplane(y[:4 * k], np.dtype("<u4")), dtype=np.int64)
  if r or (k and pos[-1] >= n):
    raise ValueError(f"delta_decode: sparse payload of {y.size} bytes does not fit {n} elements")
  return "sparse", _unplane(y[4 * k:], np.dtype(u)), pos


def _unplane(planes, dt):
  """The [k] array of dtype dt whose byte j of every element is planes[j * k:(j + 1) * k] (delta_encode's layout),
  written a plane at a time: 3-20x faster than numpy's transposing copy of [itemsize, k] (one strided pass)."""
  out = np.empty(planes.size // dt.itemsize, dt)
  for j, plane in enumerate(planes.reshape(dt.itemsize, -1)):
    out.view(np.uint8).reshape(-1, dt.itemsize)[:, j] = plane
  return out


def apply_patch(buf, dest, kind, a, pos):
  """The host reference of a patch (pull_slices): buf[dest] (a numpy array, its region `dest`) takes the new
  elements (set) or is XORed with a (xor, or sparse at the region's C-order positions pos), bit for bit."""
  region = np.ascontiguousarray(buf[dest])
  u = region.reshape(-1).view(_UINT[region.dtype.itemsize])
  if kind == "set":
    u[...] = a
  else:
    u[slice(None) if pos is None else pos] ^= a
  buf[dest] = region
  return buf


# ----------------------------------------------------------------------------------------------- reassembly


def check_manifest(m):
  """Raises ValueError naming what is wrong unless m is a manifest readers can use: an int version, servers (a list
  of "host:port"), tensors {name: {dtype, shape, pieces: [{index within shape, int crc, server index}]}}."""
  servers = m.get("servers") if isinstance(m, dict) else None
  if not (isinstance(servers, list) and all(isinstance(a, str) and ":" in a for a in servers)
          and _int(m.get("version")) and isinstance(m.get("tensors"), dict)):
    raise ValueError(f"manifest: want an int 'version', 'servers' (a list of host:port) and 'tensors' (an object), "
                     f"got {json.dumps(m)[:200]}")
  for name, t in m["tensors"].items():
    shape = t.get("shape") if isinstance(t, dict) else None
    if not (isinstance(shape, list) and all(_int(d) and d >= 0 for d in shape) and isinstance(t.get("pieces"), list)
            and str(t.get("dtype")) in DTYPES):
      raise ValueError(f"manifest v{m['version']}: tensor {name!r} needs a dtype of {sorted(DTYPES)}, a shape of "
                       f"ints >= 0 and a pieces list, got {t!r:.200}")
    for p in t["pieces"]:
      if not (isinstance(p, dict) and _int(p.get("crc")) and _int(p.get("server")) and 0 <= p["server"] < len(servers)
              and isinstance(p.get("index"), list) and len(p["index"]) == len(shape) and all(
                  isinstance(r, list) and len(r) == 2 and _int(r[0]) and _int(r[1]) and 0 <= r[0] <= r[1] <= d
                  for r, d in zip(p["index"], shape))):
        raise ValueError(f"manifest v{m['version']}: a piece of {name!r} needs an index within {shape}, an int crc "
                         f"and a server index below {len(servers)}, got {p!r:.200}")


def pull_slices(manifest, wanted, clients, base=None, held=None, stats=None, token=None):
  """Fetches the version `manifest` describes, one tensor of wanted = {name: [global slice ((start, stop), ...)]}
  at a time (from a random one on), from the servers holding its pieces in parallel: yields (name, bufs {slice:
  host array}, patches {slice: [(dest, kind, a, pos)]}). clients: {"host:port": Client}, filled on demand; token:
  for new ones.
  Delta sync: base = the manifest of an older version the reader holds, held(name, slices) -> the slices it holds;
  those come as patches (delta_decode's, or "set" for a piece sent in full; dest: the region of the slice; a slice
  sent whole comes in bufs) to apply where they live (rollout._apply on the device; apply_patch: the host
  reference). A bad payload (pcrc, encoding) is fetched in full, as is a piece the server has no base for (a
  skipped version, a restarted server). The server deltas against its copy of the version the reader names (by
  base_crc): the result is as right as the reader's base; nothing reassembles it to check. stats gets bytes (wire),
  full_bytes (a full pull's), changed_bytes / covered_bytes (of the delta pieces), pieces by encoding, fallbacks.
  A malformed manifest raises ValueError (check_manifest), like any failed pull."""
  check_manifest(manifest)
  version = manifest["version"]
  if base is not None and base["version"] >= version:
    raise ValueError(f"pull: base v{base['version']} is not older than manifest v{version}")
  conns = [clients[a] if a in clients else clients.setdefault(a, connect(a, token)) for a in manifest["servers"]]
  st = {} if stats is None else stats
  st.update(bytes=0, full_bytes=0, changed_bytes=0, covered_bytes=0, pieces={}, fallbacks=0)
  with concurrent.futures.ThreadPoolExecutor(len(conns)) as pool:
    names = list(wanted)  # from a random tensor on: readers pulling at once ask different pieces, so a server
    k = random.randrange(len(names) or 1)  # builds their deltas on as many threads, not one piece at a time
    for name in names[k:] + names[:k]:
      slices = wanted[name]
      t = manifest["tensors"][name]
      dt = _np_dtype(t["dtype"])
      old = set(held(name, list(slices))) if base is not None else set()
      bufs = {w: np.empty([b - a for a, b in w], dt) for w in slices if w not in old}
      patches = {w: [] for w in slices if w in old}
      base_crc = {json.dumps(p["index"]): p["crc"] for p in base["tensors"][name]["pieces"]} if old else {}
      jobs = {}  # server -> [(fetch request, (slice, destination within its buffer))]
      for w in slices:
        covered = 0
        for p in t["pieces"]:
          both = [(max(a, pa), min(b, pb)) for (a, b), (pa, pb) in zip(w, p["index"])]  # the overlap
          if any(l >= h for l, h in both):
            continue
          sub = [[l - pa, h - pa] for (l, h), (pa, _) in zip(both, p["index"])]
          dest = tuple(slice(l - a, h - a) for (l, h), (a, _) in zip(both, w))
          req = dict(name=name, index=p["index"], crc=p["crc"], sub=sub)
          if w in old and json.dumps(p["index"]) in base_crc:
            req["base_crc"] = base_crc[json.dumps(p["index"])]
          jobs.setdefault(p["server"], []).append((req, (w, dest)))
          covered += math.prod(h - l for l, h in both)
        if covered != math.prod(b - a for a, b in w):
          raise ValueError(f"manifest v{version}: pieces of {name!r} cover {covered} of the "
                           f"{math.prod(b - a for a, b in w)} elements of slice {w}")
      def take(w, dest, kind, a, pos):  # one piece of slice w, received
        shape = [hi - lo for lo, hi in w]
        if kind == "set" and a.size == math.prod(shape):  # all of w in full: kept as received (no copy, no patch:
          bufs[w] = a.view(dt).reshape(shape)  # pieces are disjoint, so it is w's only one)
          patches.pop(w, None)
        elif w in bufs:
          bufs[w][dest] = a.view(dt).reshape(bufs[w][dest].shape)
        else:
          patches[w].append((dest, kind, a, pos))
      while jobs:  # a second pass fetches in full the pieces whose delta payload was bad
        again = {}  # server -> such jobs, without their base_crc
        for k, full, got in pool.map(lambda k: (k, *_get(conns[k], version, base, jobs[k], dt)), list(jobs)):
          for (_, (w, dest)), a in full:
            take(w, dest, "set", a.reshape(-1).view(_UINT[dt.itemsize]), None)
            st["bytes"] += a.nbytes
          for (req, (w, dest)), r, patch in got:
            st["bytes"] += len(r["data"])
            st["pieces"][r["enc"]] = st["pieces"].get(r["enc"], 0) + 1
            if r["changed"] >= 0:
              st["changed_bytes"] += r["changed"] * dt.itemsize
              st["covered_bytes"] += math.prod(d.stop - d.start for d in dest) * dt.itemsize
            if patch:
              take(w, dest, *patch)
            else:
              st["fallbacks"] += 1
              again.setdefault(k, []).append(({kk: v for kk, v in req.items() if kk != "base_crc"}, (w, dest)))
        jobs = again
      st["full_bytes"] += sum(math.prod(b - a for a, b in w) for w in slices) * dt.itemsize
      yield name, bufs, patches


def _get(conn, version, base, jobs, dt):
  """One server's part of a pull, on its own thread: ([(job, array)] fetched in full, [(job, delta reply, patch or
  None if its crc or encoding is bad)]): decoding, a worker's largest cost of a delta, runs on one thread per server."""
  plain = [j for j in jobs if "base_crc" not in j[0]]
  delta = [j for j in jobs if "base_crc" in j[0]]
  got = list(zip(delta, conn.delta(version, base["version"], [r for r, _ in delta]))) if delta else []
  return (list(zip(plain, conn.fetch(version, [r for r, _ in plain]))) if plain else [],
          [(j, r, _decode(r, math.prod(d.stop - d.start for d in j[1][1]), dt.itemsize)) for j, r in got])


def _decode(r, n, itemsize):
  with contextlib.suppress(ValueError):  # (zlib and numpy release the GIL: the threads decode in parallel)
    return delta_decode(r["enc"], r["data"], n, itemsize) if zlib.crc32(r["data"]) == r.get("pcrc") else None


# ----------------------------------------------------------------------------------------------- server


@dataclasses.dataclass(frozen=True)
class ServerConfig:
  host: str = "127.0.0.1"
  port: int = 0                      # 0 = pick a free port (see Server.port)
  token: str | None = None           # shared secret; None refuses every op that needs it
  run_dir: str | None = None         # queue logs; None = in memory only
  max_versions: int = 2              # committed manifests kept (staged versions: this + 2)
  max_queue_items: int = 100_000     # per queue, ready + leased
  max_queue_mb: float = 1024.0       # per queue, ready + leased payload bytes
  max_acked_ids: int = 1_000_000     # per queue, most recent acked ids remembered (and persisted)
  max_queues: int = 16
  max_payload_mb: float = 16384.0    # cap on one staged piece or manifest
  max_put_mb: float = 256.0          # cap on one put request / one get reply
  max_header_kb: float = 1024.0      # cap on a frame's JSON header once the connection authenticated
  untrusted_header_kb: float = 64.0  # cap before that (bounds what unauthenticated clients make us hold)
  max_tensors: int = 100_000         # cap on the pieces of one FETCH / DELTA
  max_clients: int = 1024            # concurrent connections; when full, the least useful one is evicted
  max_peer_requests: int = 64        # requests of one peer address in service at once; more are answered "busy"
  max_peer_rps: float = 2000.0       # requests one peer address may start per second; more are answered "busy"
  idle_timeout_s: float = 300.0      # a connection with no request for this long is closed
  header_timeout_s: float = 10.0     # prefix + header must arrive within this after the first byte
  min_rate_mb_s: float = 1.0         # payloads get header_timeout_s + size / this rate to arrive or drain
  max_wait_s: float = 60.0           # cap on a manifest/get/put server-side wait
  max_lease_s: float = 86400.0
  fsync: bool = True                 # fsync queue logs before replying (durability of put/ack)
  compact_min_mb: float = 64.0       # a queue log is compacted once past max(this, 2x its live size)
  max_failures: int = 3              # FAIL reports after which a queue item is quarantined


def _wait(cond, done, end, stopped, tick=None):
  """Waits on `cond` (the caller holds it) until done(), the deadline `end` (time.monotonic()) or `stopped` is set;
  returns whether done(). tick: the longest single wait (for conditions that change without a notify)."""
  while not done():
    left = end - time.monotonic()
    if left <= 0 or stopped.is_set():
      return False
    cond.wait(left if tick is None else min(left, tick))
  return True


def _seconds(h, key, default, hi, clamp=True):
  """A duration field of a request: a finite int/float (not a str, not a bool), clamped to [0, hi] (waits) or
  refused above hi (clamp=False). NaN would defeat every deadline computed from it."""
  x = h.get(key, default)
  if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
    raise ValueError(f"{key} must be a finite number of seconds, got {x!r:.50}")
  if not clamp and x > hi:
    raise ValueError(f"{key}={x} exceeds the limit of {hi} s")
  return min(max(float(x), 0.0), hi)


def _cut(version, piece, sub):
  """(view, shape) of the sub-slice `sub` ([[start, stop], ...] within the piece, None = all) of a staged piece
  (spec, index, buf): a strided (shape..., itemsize) byte view, never a copy (dtypes are never interpreted)."""
  spec, index, buf = piece
  raw = np.frombuffer(buf, np.uint8)
  if sub is None or sub == [[0, b - a] for a, b in index]:
    return raw, spec["shape"]
  if not (isinstance(sub, list) and len(sub) == len(index) and all(
      isinstance(r, list) and len(r) == 2 and _int(r[0]) and _int(r[1]) and 0 <= r[0] <= r[1] <= b - a
      for r, (a, b) in zip(sub, index))):
    raise ValueError(f"fetch v{version} {spec['name']!r}: sub {sub!r} outside piece {index}")
  return raw.reshape(*spec["shape"], DTYPES[spec["dtype"]])[tuple(slice(a, b) for a, b in sub)], [b - a for a, b in sub]


def _crc(piece, view):
  """crc32 of a view _cut returned: the stored one for the whole piece, else computed a chunk at a time."""
  return piece[0]["crc"] if view.nbytes == len(piece[2]) else functools.reduce(
      lambda crc, m: zlib.crc32(m, crc), _chunks([view]), 0)


def _staged_piece(st, w, what):
  """(piece, key) of the staged piece a FETCH / DELTA request names (w: {name, index, crc}); refused when this
  server does not hold it with that crc (st: the staged version, or None)."""
  key = (w.get("name"), json.dumps(w.get("index")))
  got = st and st["pieces"].get(key)
  if not got or got[0]["crc"] != w.get("crc"):
    raise _Refused("stale_version", f"{what}: piece {w.get('name')!r} {w.get('index')} is not "
                   "held here (garbage-collected or replaced; read the newest manifest)")
  return got, key


class _Once:
  """A value built by the first thread that asks; threads asking meanwhile wait for that build, not their own."""

  def __init__(self):
    self.lock, self.value = threading.Lock(), None

  def get(self, build):
    with self.lock:
      if self.value is None:
        self.value = build()
      return self.value


class _Weights:
  """The weight store: staged pieces per version (invisible until committed), committed manifests, the delta cache.
  Each request handler takes (header, payload) and returns (reply header, payload parts); all state is guarded by
  self.cond, which MANIFEST waits on."""

  def __init__(self, cfg, stopped):
    self.cfg, self.stopped, self.cond = cfg, stopped, threading.Condition()
    self.staged = {}     # version -> {"nonce", "pieces": {(name, index JSON): (spec, index, buf)}, "nbytes",
    #                                  "deltas": {key: _Once}, "delta_bytes"}
    self.keep = set()    # versions the coordinator said are committed (collected last)
    self.manifests = []  # [(version, manifest JSON bytes)], oldest first
    self.delta_builds = 0

  def stage(self, h, payload):
    version, nonce, name, index = h.get("version"), h.get("nonce"), h.get("name"), h.get("index")
    if not _int(version) or version < 0 or not isinstance(nonce, int):
      raise ValueError(f"stage: version must be a non-negative int and nonce an int, got {version!r}, {nonce!r}")
    if not isinstance(name, str) or not 0 < len(name) <= 1024:
      raise ValueError(f"stage v{version}: bad tensor name {name!r}")
    spec = dict(name=name, dtype=h.get("dtype"), shape=h.get("shape"), nbytes=h.get("nbytes"), crc=h.get("crc"))
    _check_specs([spec], payload.n, f"stage v{version}")
    if not (isinstance(index, list) and len(index) == len(spec["shape"]) and all(
        isinstance(r, list) and len(r) == 2 and all(isinstance(x, int) for x in r) and r[1] - r[0] == d
        for r, d in zip(index, spec["shape"]))):
      raise ValueError(f"stage v{version} {name!r}: index {index!r} does not match shape {spec['shape']}")
    buf, crcs = payload.recv([payload.n], f"stage v{version} {name!r}")
    _check_crcs([spec], crcs, f"stage v{version}")
    with self.cond:
      st = self.staged.get(version)
      if st is None or st["nonce"] != nonce:  # a new publish of this version (e.g. by a restarted trainer)
        while len(self.staged) >= self.cfg.max_versions + 2:  # the oldest uncommitted ones go first
          del self.staged[min(self.staged, key=lambda v: (v in self.keep, v))]
        st = self.staged[version] = {"nonce": nonce, "pieces": {}, "nbytes": 0, "deltas": {}, "delta_bytes": 0}
      prev = st["pieces"].get((name, json.dumps(index)))
      st["nbytes"] += payload.n - (len(prev[2]) if prev else 0)
      st["pieces"][(name, json.dumps(index))] = (spec, index, buf)
    return {"version": version}, ()

  def staged_table(self, h, payload):
    """The pieces staged for (version, nonce); with "keep" (sent by the coordinator after each commit) drops the
    staged versions older than the newest kept one that are not kept."""
    version, nonce, keep = h.get("version"), h.get("nonce"), h.get("keep")
    with self.cond:
      if keep is not None:
        if not (isinstance(keep, list) and all(isinstance(v, int) for v in keep)):
          raise ValueError(f"staged: keep must be a list of ints, got {keep!r}")
        self.keep = set(keep)
        for v in [v for v in self.staged if keep and v < max(keep) and v not in self.keep]:
          del self.staged[v]
      st = self.staged.get(version)
      pieces = [] if st is None or st["nonce"] != nonce else [
          dict(name=spec["name"], index=index, dtype=spec["dtype"], crc=spec["crc"])
          for spec, index, _ in st["pieces"].values()]
      return {"pieces": pieces, "versions": sorted(set(self.staged) | self.keep)}, ()  # empty after a restart

  def commit(self, h, payload):
    buf = payload.recv(what="commit manifest")
    try:
      m = parse_header(buf)  # as strict as a header: no NaN, no deep nesting
    except ProtocolError as e:
      raise ValueError(f"payload must be a JSON manifest: {e}") from None
    check_manifest(m)  # every reader would choke on a malformed one
    version = m["version"]
    with self.cond:
      if self.manifests and version <= self.manifests[-1][0]:
        raise _Refused("stale_version", f"commit v{version} refused: latest manifest is v{self.manifests[-1][0]}")
      self.manifests = (self.manifests + [(version, bytes(buf))])[-self.cfg.max_versions:]
      self.cond.notify_all()
      return {"version": version, "kept": [v for v, _ in self.manifests]}, ()

  def manifest(self, h, payload):
    newer_than = h.get("newer_than", -1)
    if not isinstance(newer_than, int):
      raise ValueError(f"newer_than must be an int, got {newer_than!r}")
    end = time.monotonic() + _seconds(h, "wait_s", 0.0, self.cfg.max_wait_s)
    with self.cond:
      if not _wait(self.cond, lambda: self.manifests and self.manifests[-1][0] > newer_than, end, self.stopped):
        return {"version": None}, ()
      version, buf = self.manifests[-1]
    return {"version": version}, [buf]

  def _wanted(self, h, what):
    """(staged version, [(request, piece, key, view, shape)]) for the pieces a FETCH / DELTA names: held here with
    that crc, the view its sub-slice (uncopied). Its output budget: no more bytes in all than the version holds here
    (a reader never needs more; 150 overlapping sub-slices of one piece would be served 150 times)."""
    version, want = h.get("version"), h.get("pieces")
    if not isinstance(want, list) or len(want) > self.cfg.max_tensors:
      raise ValueError(f"{what}: pieces must be a list of at most {self.cfg.max_tensors}")
    with self.cond:
      st = self.staged.get(version)
      found = [(w, *_staged_piece(st, w, f"{what} v{version}")) for w in want]
    out = [(w, piece, key, *_cut(version, piece, w.get("sub"))) for w, piece, key in found]
    if (n := sum(x[3].nbytes for x in out)) > (st["nbytes"] if st else 0):
      raise ValueError(f"{what} v{version}: {n} bytes asked, over the output budget of {st['nbytes']} (the version)")
    return st, out

  def fetch(self, h, payload):
    version, (_, got) = h.get("version"), self._wanted(h, "fetch")
    specs = [dict(name=p[0]["name"], dtype=p[0]["dtype"], shape=shape, nbytes=v.nbytes, crc=_crc(p, v))
             for _, p, _, v, shape in got]
    return {"version": version, "tensors": specs, "digest": _digest(version, specs)}, [x[3] for x in got]

  def delta(self, h, payload):
    version, base = h.get("version"), h.get("base")
    if not (_int(version) and _int(base)) or base >= version:
      raise ValueError(f"delta: base must be an int older than version, got base={base!r} version={version!r}")
    st, got = self._wanted(h, "delta")
    with self.cond:
      # Deltas only against the immediately previous version held here: one base per version bounds the cache.
      older = [v for v in self.staged if v < version]
      bst = self.staged.get(base) if older and max(older) == base else None
      found = []
      for w, piece, key, part, _ in got:
        old = bst and bst["pieces"].get(key)
        if not old or old[0]["crc"] != w.get("base_crc") or old[0]["dtype"] != piece[0]["dtype"]:
          found.append((w, piece, None, None, None, part))  # the reader's base is not one we hold: full bytes
          continue
        # Keyed by the base's crc too: a cached delta is valid for exactly the base bytes it was built from.
        ck = key + (json.dumps(w.get("sub")), base, old[0]["crc"])
        found.append((w, piece, old, st["deltas"].setdefault(ck, _Once()), ck, part))
    pieces, parts = [], []
    for w, got, old, once, ck, part in found:
      crc = _crc(got, part)
      if old is None:
        enc, data, changed, pcrc = "full", part, -1, crc
      else:
        def build(got=got, old=old, w=w, part=part, ck=ck):  # the one place a sub-slice is copied whole
          new, prev = (np.ascontiguousarray(v).reshape(-1) for v in (part, _cut(base, old, w.get("sub"))[0]))
          enc, data, changed = delta_encode(new, prev, DTYPES[got[0]["dtype"]])
          data = None if enc == "full" else data  # "full" is served from the piece itself: no cache memory
          with self.cond:
            self.delta_builds += 1
            # Bounded: a version's cached deltas never exceed its own staged bytes; past that they are rebuilt.
            if data is not None and st["delta_bytes"] + len(data) > st["nbytes"]:
              st["deltas"].pop(ck, None)
            elif data is not None:
              st["delta_bytes"] += len(data)
          return enc, data, changed, None if data is None else zlib.crc32(data)
        enc, data, changed, pcrc = once.get(build)
        data, pcrc = (part, crc) if enc == "full" else (data, pcrc)
      pieces.append(dict(enc=enc, nbytes=memoryview(data).nbytes, crc=crc, changed=changed, pcrc=pcrc))
      parts.append(data)
    return {"version": version, "base": base, "pieces": pieces}, parts

  def stats(self):
    with self.cond:
      return {"latest_version": self.manifests[-1][0] if self.manifests else -1,
              "versions": [v for v, _ in self.manifests],
              "weight_bytes": sum(st["nbytes"] for st in self.staged.values()),
              "delta": {"builds": self.delta_builds,
                        "cached_bytes": sum(st["delta_bytes"] for st in self.staged.values())}}


class _Disk:
  """Every file operation of the queue logs in one place, so that tests can substitute a subclass that fails
  (ENOSPC, EIO, a short write) or kills the process at any named point: a tiny real filesystem needs root.
  point(name) marks the crash points: "append", "appended" (written, not yet fsync'ed), "synced" (durable,
  not yet applied or answered), "compact_tmp" (temp file durable, not renamed), "compact_renamed"."""

  def open_append(self, path):
    return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

  def write(self, fd, data):
    mv = memoryview(data)
    while mv:
      mv = mv[os.write(fd, mv):]

  fsync = staticmethod(os.fsync)
  truncate = staticmethod(os.ftruncate)  # (fd, size)
  replace = staticmethod(os.replace)

  def point(self, name):
    pass


DISK = _Disk()


class _Queue:
  """One leased queue and its log. All state is guarded by self.cond; the log is appended under the same lock.
  A change is fsync'ed to the log *before* it is applied in memory or answered (the reply never claims more than
  the disk holds). A failed append is cut off again (ftruncate to the last good size); if even that fails the log
  is marked broken and the next change first rewrites it from memory (compaction), so nothing is ever appended
  after a torn record (the loader takes a record running past the end of the file for a crash mid-append)."""

  # Log records: struct "<4sBIQI" (magic b"RLQ1", op, header len, payload len, crc32 of header+payload), the crc32
  # of those 21 bytes ("<I"), JSON header, payload. The prefix's own crc makes its lengths trustworthy: a record
  # whose body is damaged is skipped alone, and after a damaged prefix the loader resumes at the next valid one.
  # op 1 PUT {"id", "meta"} + blob; op 2 ACK {"ids"}; op 3 FAIL {"ids", "reason", "quarantined": [ids]};
  # op 4 UPDATE {"id", "meta"} + blob (release: new contents for a live item).
  _REC, _LOG_MAGIC = struct.Struct("<4sBIQI"), b"RLQ1"

  def __init__(self, name, cfg):
    self.name, self.cfg = name, cfg
    self.ready = collections.OrderedDict()   # id -> (meta, blob)
    self.leased = {}                          # id -> (meta, blob, expiry, holder)
    self.acked = collections.OrderedDict()   # id -> None, bounded
    self.failures = {}                        # id -> failures reported (FAIL) for a live item
    self.quarantined = collections.OrderedDict()  # id -> {"reason", "failures"}, bounded like acked
    self.consumers = {}  # holder -> when it last asked (a GET with consumer=True): stats' "consumers"
    self.nbytes, self.cond = 0, threading.Condition()
    self.path = os.path.join(cfg.run_dir, f"queue-{name}.log") if cfg.run_dir else None
    self.log, self.log_bytes, self.broken, self.damaged = None, 0, False, 0
    if self.path:
      self._load()

  def record(self, op, header, blob=b""):
    hb = json.dumps(header, separators=(",", ":")).encode()
    pre = self._REC.pack(self._LOG_MAGIC, op, len(hb), len(blob), zlib.crc32(blob, zlib.crc32(hb)))
    return pre + struct.pack("<I", zlib.crc32(pre)) + hb + bytes(blob)

  def _replay(self, op, hdr, blob):
    """Applies one record of the log being loaded (KeyError, TypeError, ValueError: a malformed one)."""
    if op == 1 and not self.known(hdr["id"]):
      self.ready[hdr["id"]] = (hdr["meta"], blob)
      self.nbytes += len(blob)
    elif op == 4 and hdr["id"] in self.ready:
      self.replace(hdr["id"], hdr["meta"], blob)
    elif op == 2:
      self.ack_ids(hdr["ids"])
    elif op == 3 and "failures" in hdr:  # a quarantine entry as compaction writes it
      self._remember(self.quarantined, hdr["quarantined"][0], {k: hdr[k] for k in ("reason", "failures")})
    elif op == 3:
      self.apply_fail(hdr["ids"], hdr["reason"], hdr["quarantined"], release=False)
    elif op not in (1, 4):
      raise ValueError(f"unknown op {op}")

  def _load(self):
    """Replays the log, skipping and counting (self.damaged) each damaged record; a damaged log is copied aside
    (.damaged-<ns>) before compaction rewrites it, so no unreadable byte is ever lost. A torn last record (a crash
    mid-append: never acknowledged) is dropped without that."""
    good, n = 0, self._REC.size + 4  # good: where the last record with a valid prefix ends
    if os.path.exists(self.path + ".tmp"):  # a compaction that died before its rename: the log is still whole
      os.remove(self.path + ".tmp")
    if os.path.exists(self.path):
      with open(self.path, "rb") as f:
        data = f.read()
      off = 0
      while off + n <= len(data):
        (magic, op, hl, pl, crc), pcrc = self._REC.unpack_from(data, off), data[off + n - 4:off + n]
        if magic != self._LOG_MAGIC or zlib.crc32(data[off:off + n - 4]).to_bytes(4, "little") != pcrc:
          self.damaged += off == good  # one per damaged stretch, however many false starts it holds
          off = data.find(self._LOG_MAGIC, off + 1) % (len(data) + 1)  # not found (-1): the end
          continue
        if off + n + hl + pl > len(data):
          break  # torn
        good, body = off + n + hl + pl, data[off + n:off + n + hl + pl]
        try:
          if zlib.crc32(body) != crc:
            raise ValueError("crc mismatch")
          self._replay(op, json.loads(body[:hl]), body[hl:])
        except (ValueError, KeyError, TypeError, IndexError) as e:
          self.damaged += 1
          log.error("%s: record at offset %d skipped: %s", self.path, off, e)
        off = good
      if self.damaged:
        kept = f"{self.path}.damaged-{time.time_ns()}"
        shutil.copyfile(self.path, kept)  # before anything rewrites it (an OSError here: the server does not start)
        log.error("%s: %d damaged records skipped, the records after them kept; the damaged log is kept as %s",
                  self.path, self.damaged, kept)
      elif good < len(data):
        log.warning("%s: ignoring a torn last record (%d bytes after offset %d)", self.path, len(data) - good, good)
    try:
      self._compact()
    except OSError as e:  # e.g. disk full at startup: keep the old log, cut to its last good record
      log.error("%s: compaction at startup failed (%s); appending to the existing log", self.path, e)
      if os.path.exists(self.path):
        os.truncate(self.path, good)
      self.log, self.log_bytes = DISK.open_append(self.path), good

  def _compact(self):
    """Rewrites the log from memory (ready and leased items, acked ids, failure counts, quarantine):
    temp file + fsync + rename + fsync(dir). Raises OSError with the old log intact if it fails before the
    rename; after the rename the new log is the log (a failure there marks it broken, to be rewritten)."""
    tmp = self.path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
      # Leased items are live too (leases are not persisted): after a restart they are ready again.
      for i, v in itertools.chain(self.leased.items(), self.ready.items()):
        DISK.write(fd, self.record(1, {"id": i, "meta": v[0]}, v[1]))
      acked = list(self.acked)
      for k in range(0, len(acked), 10000):  # bounded records: one damaged one forgets few acks
        DISK.write(fd, self.record(2, {"ids": acked[k:k + 10000]}))
      for i, n in self.failures.items():
        DISK.write(fd, self.record(3, {"ids": [i] * n, "reason": "", "quarantined": []}))
      for i, r in self.quarantined.items():
        DISK.write(fd, self.record(3, {"ids": [], "quarantined": [i], **r}))  # r: {"reason", "failures"}
      DISK.fsync(fd)
      DISK.point("compact_tmp")
    except BaseException:
      os.close(fd)
      os.remove(tmp)
      raise
    os.close(fd)
    DISK.replace(tmp, self.path)
    if self.log is not None:
      os.close(self.log)
    self.log, self.broken = None, True  # until the new log is open and its rename durable
    DISK.point("compact_renamed")
    common.fsync_dir(os.path.dirname(self.path))
    self.log = DISK.open_append(self.path)
    self.log_bytes = os.fstat(self.log).st_size
    self.broken = False

  def write(self, records, what):
    """Appends records durably, or raises _Refused("storage") having left the log and the queue as they were:
    the request changed nothing, and the reply says so (a put refused for lack of disk is never a duplicate)."""
    if not self.path or not records:
      return
    data = b"".join(records)
    try:
      if self.broken:
        self._compact()
      try:
        DISK.point("append")
        DISK.write(self.log, data)
        DISK.point("appended")
        if self.cfg.fsync:
          DISK.fsync(self.log)
      except OSError:
        try:
          DISK.truncate(self.log, self.log_bytes)
          DISK.fsync(self.log)
        except OSError:
          log.error("%s: cannot cut a failed append off; the log will be rewritten before the next change", self.path)
          self.broken = True
        raise
    except OSError as e:
      log.error("queue %r: %s not stored: %s", self.name, what, e)
      raise _Refused("storage", f"{what} on queue {self.name!r} not stored (nothing changed, retry later): "
                                f"{type(e).__name__}: {e}") from None
    self.log_bytes += len(data)
    DISK.point("synced")

  def maybe_compact(self):
    """Compacts when the log has grown past 2x its live size; a failure is logged and the old log kept."""
    live = self.nbytes + 64 * (len(self.ready) + len(self.leased) + len(self.acked) + len(self.quarantined))
    if self.path and self.log_bytes > max(2 * live, int(self.cfg.compact_min_mb * (1 << 20))):
      try:
        self._compact()
      except OSError as e:
        log.error("%s: compaction failed (%s); the old log stays in use", self.path, e)

  def _remember(self, od, i, value):
    od[i] = value
    while len(od) > self.cfg.max_acked_ids:
      od.popitem(last=False)

  def _drop(self, i):
    """Removes a live item (ready or leased); returns whether it was live."""
    for d in (self.ready, self.leased):
      if i in d:
        self.nbytes -= len(d.pop(i)[1])
        self.failures.pop(i, None)
        return True
    return False

  def ack_ids(self, ids):
    for i in ids:
      self._drop(i)
      self._remember(self.acked, i, None)

  def apply_fail(self, ids, reason, quarantined, release=True):
    """One failure per id (ids may repeat); quarantined ids leave the queue for good. release: failed leased
    ids go back to the *tail* of the ready queue (other items go first)."""
    for i in ids:
      if i in self.ready or i in self.leased:
        self.failures[i] = self.failures.get(i, 0) + 1
    for i in quarantined:
      n = self.failures.get(i, 0)
      if self._drop(i):
        self._remember(self.quarantined, i, {"reason": reason, "failures": n})
    if release:
      self.release(ids, head=False)

  def reclaim(self):
    now = time.monotonic()
    self.release([i for i, (_, _, exp, _) in self.leased.items() if exp <= now])

  def release(self, ids, head=True):
    """Leased ids go back to the head of the ready queue (re-issued first), or to its tail (head=False)."""
    for i in ids:
      if i in self.leased:
        meta, blob, *_ = self.leased.pop(i)
        self.ready[i] = (meta, blob)
        if head:
          self.ready.move_to_end(i, last=False)
    if ids:
      self.cond.notify_all()
    return len(ids)

  def replace(self, i, meta, blob):
    """New contents for a live item, which goes to the head of the ready queue (its failure count stays)."""
    old = self.leased.pop(i, None) or self.ready.pop(i)
    self.nbytes += len(blob) - len(old[1])
    self.ready[i] = (meta, blob)
    self.ready.move_to_end(i, last=False)

  def stale(self, i, holder):
    """Whether i is leased to a holder other than `holder` (Client.holder; compared, never shown): the caller's
    lease expired and the item was leased again, so only the new holder may ack, fail, release or requeue it."""
    return i in self.leased and self.leased[i][3] != holder

  def known(self, i):
    return i in self.ready or i in self.leased or i in self.acked or i in self.quarantined


def _ids(h, optional=False):
  ids = h.get("ids")
  if not (optional and ids is None) and (not isinstance(ids, list) or not all(isinstance(i, str) for i in ids)):
    raise ValueError("ids must be a list of str" + (" or absent" if optional else ""))
  return ids


class _Queues:
  """The leased queues by name and the requests on them; handlers as in _Weights (GET also returns an undo, run
  when its reply could not be sent)."""

  def __init__(self, cfg, stopped):
    self.cfg, self.stopped, self.lock, self.all = cfg, stopped, threading.Lock(), {}
    self.max_put = int(cfg.max_put_mb * (1 << 20))
    if cfg.run_dir:
      os.makedirs(cfg.run_dir, exist_ok=True)
      for fn in sorted(os.listdir(cfg.run_dir)):
        m = re.match(r"^queue-(.+)\.log$", fn)
        if m and _QUEUE_NAME.match(m.group(1)):
          self.all[m.group(1)] = _Queue(m.group(1), cfg)

  def queue(self, name, create=True):
    if not isinstance(name, str) or not _QUEUE_NAME.match(name):
      raise ValueError(f"bad queue name {name!r} (want 1-64 chars of [A-Za-z0-9_.-])")
    with self.lock:
      if name not in self.all:
        if not create:
          raise ValueError(f"unknown queue {name!r}")
        if len(self.all) >= self.cfg.max_queues:
          raise ValueError(f"too many queues (limit {self.cfg.max_queues})")
        self.all[name] = _Queue(name, self.cfg)
      return self.all[name]

  def put(self, h, payload):
    """PUT: new items (idempotent by id; waits up to wait_s for room), or with release=True new contents for live
    items (Client.release)."""
    q = self.queue(h.get("queue"))
    metas, release = h.get("items"), h.get("release", False)
    if not isinstance(metas, list):
      raise ValueError("items must be a list")
    if not isinstance(release, bool):
      raise ValueError(f"release must be a bool, got {release!r:.40}")
    items, total, cap_bytes = [], 0, self.cfg.max_queue_mb * (1 << 20)
    for m in metas:
      if not isinstance(m, dict) or not isinstance(m.get("id"), str) or not 0 < len(m["id"]) <= 256:
        raise ValueError(f"every item needs a non-empty str id of <= 256 chars, got {m!r:.100}")
      arrays = m.get("arrays", {})
      if not isinstance(arrays, dict) or not isinstance(m.get("json", {}), dict):
        raise ValueError(f"item {m['id']!r}: 'arrays' and 'json' must be objects")
      specs = [s for v in arrays.values() for s in (v if isinstance(v, list) else [v])]
      n = sum(_check_specs(specs, sum(s.get("nbytes", 0) for s in specs if isinstance(s, dict)), f"item {m['id']!r}"))
      if n > cap_bytes:
        raise ValueError(f"item {m['id']!r} is {n} bytes, more than the whole queue may hold")
      items.append((m["id"], {"json": m.get("json", {}), "arrays": arrays, "nbytes": n}, total, n))
      total += n
    if total != payload.n:
      raise ValueError(f"items declare {total} payload bytes but the frame carries {payload.n}")
    end = time.monotonic() + _seconds(h, "wait_s", 0.0, self.cfg.max_wait_s)
    buf = payload.recv(what="put payload")
    items = [(i, meta, bytes(buf[off:off + n])) for i, meta, off, n in items]
    with q.cond:
      if release:  # live items include ones ready again after their lease expired, not ones leased again
        new = {i: (meta, blob) for i, meta, blob in items
               if (i in q.leased or i in q.ready) and not q.stale(i, h.get("holder"))}
        # Logged (UPDATE) before it replaces the old contents: a restart re-issues the progress.
        q.write([q.record(4, {"id": i, "meta": meta}, blob) for i, (meta, blob) in new.items()], "release")
        for i, item in reversed(new.items()):
          q.replace(i, *item)
        q.cond.notify_all()
        q.maybe_compact()
        return {"accepted": list(new), "unknown": [i for i, _, _ in items if i not in new]}, ()
      new, new_bytes, dups, rejected, seen = {}, 0, [], [], set()  # new: applied once its records are durable

      def room(n):  # acks make room (an expired lease still holds its item's place)
        return (len(q.ready) + len(q.leased) + len(new) < self.cfg.max_queue_items
                and q.nbytes + new_bytes + n <= cap_bytes)

      for i, meta, blob in items:
        if q.known(i) or i in seen:
          dups.append(i)
          continue
        seen.add(i)
        if not _wait(q.cond, lambda: room(len(blob)), end, self.stopped, tick=0.5):  # back-pressure
          rejected.append(i)
          end = 0.0  # the queue is full: do not wait again for each remaining item
          continue
        new[i] = (meta, blob)
        new_bytes += len(blob)
      q.write([q.record(1, {"id": i, "meta": meta}, blob) for i, (meta, blob) in new.items()], "put")
      q.ready.update(new)
      q.nbytes += new_bytes
      if new:
        q.cond.notify_all()
      q.maybe_compact()
      return {"accepted": list(new), "duplicates": dups, "rejected": rejected}, ()

  def get(self, h, payload):
    q = self.queue(h.get("queue"))
    max_items, lease_s = h.get("max_items"), _seconds(h, "lease_s", 300.0, self.cfg.max_lease_s, clamp=False)
    if not isinstance(max_items, int) or max_items < 1:
      raise ValueError(f"max_items must be a positive int, got {max_items!r}")
    if lease_s <= 0:
      raise ValueError(f"lease_s must be > 0, got {lease_s}")
    end, holder = time.monotonic() + _seconds(h, "wait_s", 0.0, self.cfg.max_wait_s), h.get("holder")
    out, nbytes = [], 0

    def any_ready():  # called with q.cond held
      q.reclaim()
      return bool(q.ready)

    with q.cond:
      if h.get("consumer") is True:  # (the expired dropped here too: it holds at most 30 s of distinct holders)
        q.consumers = {k: t for k, t in q.consumers.items() if time.monotonic() - t < 30} | {holder: time.monotonic()}
      _wait(q.cond, any_ready, end, self.stopped, tick=0.5)  # the tick also wakes it to reclaim expired leases
      expiry = time.monotonic() + lease_s
      while q.ready and len(out) < max_items:
        i, (meta, blob) = next(iter(q.ready.items()))
        if out and nbytes + len(blob) > self.max_put:
          break
        del q.ready[i]
        q.leased[i] = (meta, blob, expiry, holder)
        out.append((i, meta, blob))
        nbytes += len(blob)

    def undo():  # the reply never left: hand the items straight back instead of waiting for lease expiry
      with q.cond:
        q.release([i for i, _, _ in out])
    return {"items": [dict(meta, id=i) for i, meta, _ in out]}, [b for _, _, b in out], undo

  def ack(self, h, payload):
    q, ids, holder = self.queue(h.get("queue")), _ids(h), h.get("holder")
    with q.cond:
      unknown = [i for i in ids if not (i in q.ready or i in q.leased or i in q.acked)]
      stale = [i for i in ids if q.stale(i, holder)]
      missing = set(unknown + stale)  # once: a set per id made a long ack quadratic
      done = [i for i in ids if i not in missing]
      q.write([q.record(2, {"ids": done})] if done else [], "ack")
      q.ack_ids(done)
      q.cond.notify_all()  # room for blocked puts
      q.maybe_compact()
    return {"acked": len(done), "unknown": unknown, "stale": stale}, ()

  def fail(self, h, payload):
    """FAIL (see Client.fail); a quarantine notice is {"id", "queue", "reason", "failures"}."""
    q, ids, reason = self.queue(h.get("queue"), create=False), _ids(h), h.get("reason", "")
    if not isinstance(reason, str):
      raise ValueError(f"reason must be a str, got {type(reason).__name__}")
    reason = reason[:2000]
    with q.cond:
      mine = list(dict.fromkeys(i for i in ids if i in q.leased and not q.stale(i, h.get("holder"))))
      quarantine = [i for i in mine if q.failures.get(i, 0) + 1 >= self.cfg.max_failures]
      if quarantine and _QUEUE_NAME.match(q.name + ".failed"):
        # Notices first: a crash between the two writes leaves the item live *and* noticed, which the
        # trainer tolerates (it counts ids once); the other order could lose the notice.
        nq = self.queue(q.name + ".failed")
        with nq.cond:
          new = {i: ({"json": {"queue": q.name, "reason": reason, "failures": q.failures.get(i, 0) + 1},
                      "arrays": {}, "nbytes": 0}, b"") for i in quarantine if not nq.known(i)}
          nq.write([nq.record(1, {"id": i, "meta": m}, b) for i, (m, b) in new.items()], "fail notice")
          nq.ready.update(new)
          nq.cond.notify_all()
      q.write([q.record(3, {"ids": mine, "reason": reason, "quarantined": quarantine})], "fail")
      q.apply_fail(mine, reason, quarantine)
      q.maybe_compact()
    for i in quarantine:
      log.warning("queue %r: item %r quarantined after %d failures: %s", q.name, i, self.cfg.max_failures, reason[:200])
    return {"failed": mine, "quarantined": quarantine}, ()

  def requeue(self, h, payload):
    q, ids = self.queue(h.get("queue")), _ids(h, optional=True)  # None: every lease (a restarted consumer)
    with q.cond:
      mine = list(q.leased) if ids is None else [i for i in ids if i in q.leased and not q.stale(i, h.get("holder"))]
      return {"released": q.release(mine)}, ()

  def stats(self):
    out = {}
    for name, q in list(self.all.items()):
      with q.cond:
        q.reclaim()
        out[name] = {"ready": len(q.ready), "leased": len(q.leased), "acked": len(q.acked), "bytes": q.nbytes,
                     "consumers": sum(time.monotonic() - t < 30 for t in q.consumers.values()),
                     "failing": len(q.failures), "quarantined": len(q.quarantined), "damaged_records": q.damaged}
    return out


class _Conn:
  """A server-side connection's slot state, read by the accept loop to pick whom to evict when full."""
  __slots__ = ("sock", "trusted", "state", "since")

  def __init__(self, sock):
    self.sock, self.trusted, self.state, self.since = sock, False, "idle", time.monotonic()

  def set(self, state):
    self.state, self.since = state, time.monotonic()

  def kick(self):
    with contextlib.suppress(OSError):
      self.sock.shutdown(socket.SHUT_RDWR)


class _Payload:
  """A request's payload, left on the socket until its handler has checked the header; recv() then reads it."""

  def __init__(self, sock, n, deadline):
    self.sock, self.n, self.deadline, self.read = sock, n, deadline, False

  def recv(self, sizes=None, what="payload"):
    """The payload in a fresh buffer; with sizes (its tensors' byte sizes) (buffer, their crc32s)."""
    self.read = True
    if sizes is None:
      buf = bytearray(self.n)
      _recv_into(self.sock, memoryview(buf), self.deadline, what)
      return buf
    buf = _alloc(self.n)
    return buf, _recv_with_crcs(self.sock, buf, sizes, self.deadline, what)


class Server:
  """Owns the sockets: accepts connections, reads frames under deadlines and caps, checks the token, and hands each
  request to the weight store (self.weights) or the queues (self.queues), whose reply it sends.
  Server(cfg).start() serves in background threads; .stop() shuts it down."""

  def __init__(self, cfg: ServerConfig):
    if min(cfg.max_versions, cfg.max_failures, cfg.max_clients) < 1:
      raise ValueError(f"max_versions, max_failures and max_clients must be >= 1, got {cfg.max_versions}, "
                       f"{cfg.max_failures}, {cfg.max_clients}")
    if cfg.token is not None and not cfg.token:
      raise ValueError("token must be a non-empty string or None")
    self.cfg, self._stopped = cfg, threading.Event()
    self._max_header = int(cfg.max_header_kb * 1024)
    self._untrusted_header = min(int(cfg.untrusted_header_kb * 1024), self._max_header)
    self.weights, self.queues = _Weights(cfg, self._stopped), _Queues(cfg, self._stopped)
    w, q, big = self.weights, self.queues, int(cfg.max_payload_mb * (1 << 20))
    # type -> (handler, payload cap). A manifest grows with tensors x trainer shards (MBs for a 32B model on a pod),
    # so COMMIT's payload is capped like a staged piece, not like a header.
    self._handlers = {
        STAGE: (w.stage, big), STAGED: (w.staged_table, 0), COMMIT: (w.commit, big), MANIFEST: (w.manifest, 0),
        FETCH: (w.fetch, 0), DELTA: (w.delta, 0),
        LATEST: (lambda h, p: ({"version": w.stats()["latest_version"]}, ()), 0),
        PUT: (q.put, q.max_put), GET: (q.get, 0), ACK: (q.ack, 0), REQUEUE: (q.requeue, 0), FAIL: (q.fail, 0),
        AUTH: (lambda h, p: ({"authenticated": True}, ()), 0), STATS: (lambda h, p: (self.stats(), ()), 0),
        REGISTER: (self._register, 0)}
    self._epoch_lock = threading.Lock()
    self._epoch_path = os.path.join(cfg.run_dir, "trainer_epoch") if cfg.run_dir else None
    self.epoch = int(open(self._epoch_path).read()) if self._epoch_path and os.path.exists(self._epoch_path) else 0
    self._conns, self._conn_lock = {}, threading.Lock()  # socket -> _Conn
    self._peers, self._rate = collections.Counter(), {}  # peer address -> requests in service; (bucket, time)
    self._threads, self._started = [], time.monotonic()
    # A deep accept queue: when it is full the kernel drops a newcomer's SYN, which costs that client 1 s.
    self._sock = socket.create_server((cfg.host, cfg.port), backlog=max(128, min(cfg.max_clients, 4096)))
    self.port = self._sock.getsockname()[1]

  def start(self):
    t = threading.Thread(target=self._accept_loop, name="ps-accept", daemon=True)
    t.start()
    self._threads.append(t)
    return self

  def stop(self):
    """Stops accepting, closes every connection, wakes every waiter, closes the queue logs."""
    if self._stopped.is_set():
      return
    self._stopped.set()
    self._sock.close()
    with self._conn_lock:
      for c in list(self._conns.values()):
        c.kick()
    for cond in [self.weights.cond] + [q.cond for q in self.queues.all.values()]:
      with cond:
        cond.notify_all()
    end = time.monotonic() + 0.5  # handlers see the kicked sockets or `stopped` at once; none may hold us longer
    for t in self._threads:
      t.join(timeout=max(end - time.monotonic(), 0.0))
    for q in self.queues.all.values():
      with q.cond:
        if q.log is not None:
          os.close(q.log)
          q.log = None

  def stats(self):
    with self._conn_lock:
      clients = len(self._conns)
    return dict(self.weights.stats(), queues=self.queues.stats(), clients=clients,
                uptime_s=time.monotonic() - self._started)

  def _accept_loop(self):
    """Accepts connections and parks them in a selector until their first byte arrives; only then does a
    connection get a thread. Idle connections therefore cost no thread, and a burst of them is accepted in
    microseconds each, so a trainer or worker connecting behind them is not kept waiting in the accept queue."""
    sel = selectors.DefaultSelector()
    self._sock.setblocking(False)
    sel.register(self._sock, selectors.EVENT_READ)
    parked = {}  # socket -> (_Conn, addr): accepted, nothing received yet, no thread
    last_sweep = time.monotonic()
    try:
      while not self._stopped.is_set():
        ready = []
        for key, _ in sel.select(timeout=0.2):
          if key.fileobj is self._sock:
            self._accept_ready(sel, parked)
          elif key.fileobj in parked:
            ready.append(key.fileobj)
        # First bytes (or EOF): from now on a thread serves the connection. Starting a thread costs ~1 ms on a
        # loaded box, so after a burst of connections a client that opens with AUTH goes first, and at most 32
        # start per pass (the rest stay readable for the next pass, after newer accepts).
        ready.sort(key=lambda k: not _opens_with_auth(k))
        for k in ready[:32]:
          sel.unregister(k)
          c, addr = parked.pop(k)
          t = threading.Thread(target=self._serve_conn, args=(c, addr), daemon=True)
          t.start()
          self._threads = [x for x in self._threads if x.is_alive()] + [t]
        now = time.monotonic()
        if now - last_sweep > 1.0:  # parked connections idle past idle_timeout_s, or evicted meanwhile
          last_sweep = now
          with self._conn_lock:
            gone = [k for k, (c, _) in parked.items()
                    if self._conns.get(k) is not c or now - c.since > self.cfg.idle_timeout_s]
            for k in gone:
              if self._conns.get(k) is parked[k][0]:
                del self._conns[k]
          for k in gone:
            sel.unregister(k)
            parked.pop(k)
            k.close()
    except OSError:  # the listening socket was closed by stop()
      pass
    finally:
      for k in parked:
        k.close()
      sel.close()

  def _accept_ready(self, sel, parked):
    while True:
      try:
        conn, addr = self._sock.accept()
      except (BlockingIOError, InterruptedError):
        return
      conn.setblocking(True)
      c = _Conn(conn)
      with self._conn_lock:
        victim = self._victim() if len(self._conns) >= self.cfg.max_clients else None
        busy = len(self._conns) >= self.cfg.max_clients and victim is None
        if victim is not None:
          del self._conns[victim.sock]
        if not busy:
          self._conns[conn] = c
      if victim is not None:
        if victim.sock in parked:  # no thread yet: close it here
          sel.unregister(victim.sock)
          parked.pop(victim.sock)
          victim.sock.close()
        else:
          victim.kick()  # its thread wakes from recv/send with an error and cleans up
      if busy:
        self._reply_error(conn, "busy", f"server busy: {self.cfg.max_clients} authenticated clients connected")
        conn.close()
        continue
      parked[conn] = (c, addr)
      sel.register(conn, selectors.EVENT_READ)

  def _victim(self):
    """The connection to evict when all slots are taken: an unauthenticated one (idle first, the earliest
    accepted; then one still sending its header, then any, the longest in that state first), else an idle
    authenticated one (its client reconnects transparently); None ("busy") when every slot does authenticated
    work. So no number of idle or slow anonymous connections can keep a trainer or worker out."""
    for c in self._conns.values():  # fast path (O(1) in a flood of idle ones): dict order is accept order
      if not c.trusted and c.state == "idle":
        return c
    anon = [c for c in self._conns.values() if not c.trusted]
    if anon:
      return min(anon, key=lambda c: (("idle", "header", "busy").index(c.state), c.since))
    return min((c for c in self._conns.values() if c.state == "idle"), key=lambda c: c.since, default=None)

  def _reply_error(self, conn, code, msg):
    with contextlib.suppress(OSError):
      # Tiny frame: it fits the socket buffer at once unless the peer stopped reading (then give up fast).
      _send_frame(conn, ERROR, {"error": msg, "code": code}, deadline=time.monotonic() + 0.5)

  def _serve_conn(self, c, addr):
    conn = c.sock
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)  # notices peers that vanished (half-open)
    try:
      while not self._stopped.is_set():
        try:
          c.set("idle")
          got = _read_prefix_header(conn, time.monotonic() + self.cfg.idle_timeout_s, self.cfg.header_timeout_s,
                                    lambda _: self._max_header if c.trusted else self._untrusted_header,
                                    on_start=lambda: c.set("header"))
          if got is None:
            return
          c.set("busy")
          self._dispatch(c, *got)
        except _Refused as e:
          self._reply_error(conn, e.code, str(e))
        except _Idle:
          return
        except (ProtocolError, TimeoutError, _Truncated, _AuthClose) as e:
          log.info("closing %s: %s", addr, e)
          code = "timeout" if isinstance(e, TimeoutError) else "auth" if isinstance(e, _AuthClose) else "protocol"
          self._reply_error(conn, code, str(e))
          _linger_close(conn)
          return
    except OSError as e:  # peer reset etc.
      log.info("connection %s: %s", addr, e)
    except Exception as e:  # a bug must cost one connection, never the server
      log.exception("internal error serving %s", addr)
      self._reply_error(conn, "internal", f"internal server error: {type(e).__name__}: {e}")
    finally:
      with self._conn_lock:
        if self._conns.get(conn) is c:
          del self._conns[conn]
      conn.close()

  def _deadline(self, nbytes):
    """When an nbytes payload must have arrived or left."""
    return time.monotonic() + self.cfg.header_timeout_s + nbytes / (self.cfg.min_rate_mb_s * 1e6)

  def _dispatch(self, c, mtype, header, plen):
    """The checks every message type gets before any payload byte is read, in this order: known type, payload
    within its cap, token; then its handler, and the reply."""
    if mtype not in self._handlers:
      raise ProtocolError(f"unknown message type {mtype}")
    name, (handler, cap) = REQUEST_TYPES[mtype], self._handlers[mtype]
    if plen > cap:
      raise ProtocolError(f"{name}: payload length {plen} exceeds the limit of {cap} bytes")
    tok = header.get("token")
    if isinstance(tok, str) and self.cfg.token and hmac.compare_digest(tok.encode(), self.cfg.token.encode()):
      c.trusted = True
    if not c.trusted:  # every op, reads too: the weights are the model
      why = "the server has no token configured" if self.cfg.token is None else "missing or wrong token"
      if plen:  # draining would let anyone hold a slot for as long as the payload it announces takes
        raise _AuthClose(f"{name} refused: {why} (payload not read; connection closed)")
      raise _Refused("auth", f"{name} refused: {why}")
    payload, peer, admitted = _Payload(c.sock, plen, self._deadline(plen)), c.sock.getpeername()[0], False
    try:
      try:
        with self._conn_lock:  # the peer's quotas: requests in service at once (handler to reply sent), and
          # requests started per second, a bucket of one second's worth (only token holders get here: bounded)
          now, rps = time.monotonic(), self.cfg.max_peer_rps
          tokens, at = self._rate.get(peer, (rps, now))
          tokens = min(rps, tokens + (now - at) * rps)
          if self._peers[peer] >= self.cfg.max_peer_requests or tokens < 1:
            raise _Refused("busy", f"{name} refused: {peer} has {self._peers[peer]} requests in service (max "
                           f"{self.cfg.max_peer_requests}) and {tokens:.1f} of its {rps:g}/s left")
          self._peers[peer], self._rate[peer], admitted = self._peers[peer] + 1, (tokens - 1, now), True
        if "epoch" in header:
          self._fence(name, header["epoch"])
        reply = handler(header, payload)
      except (_Refused, ValueError, KeyError, TypeError) as e:
        if isinstance(e, ProtocolError):
          raise
        if not payload.read:  # keep the stream in sync: the request stays refused, not stored
          scratch = memoryview(bytearray(min(plen, CHUNK)))
          for off in range(0, plen, CHUNK):
            _recv_into(c.sock, scratch[:min(CHUNK, plen - off)], payload.deadline, "discarded payload")
        raise e if isinstance(e, _Refused) else _Refused("bad_request", f"{name}: {e}") from None
      parts = reply[1]
      try:
        _send_frame(c.sock, OK, reply[0], parts, deadline=self._deadline(sum(memoryview(p).nbytes for p in parts)))
      except OSError:
        if len(reply) > 2:
          reply[2]()
        raise
    finally:
      if admitted:
        with self._conn_lock:
          self._peers[peer] -= 1

  def _register(self, h, payload):
    with self._epoch_lock:
      self.epoch += 1
      if self._epoch_path:  # durable before it is answered: a restarted server must keep fencing older trainers
        common.write_atomic(self._epoch_path, str(self.epoch), fsync=True)
      log.info("trainer epoch %d registered", self.epoch)
      return {"epoch": self.epoch}, ()

  def _fence(self, name, epoch):
    with self._epoch_lock:
      if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < self.epoch:
        raise _Refused("fenced", f"{name} from trainer epoch {epoch!r} refused: trainer epoch {self.epoch} "
                                 f"registered since (one trainer per run: this one must stop)")
      self.epoch = epoch  # a server without run_dir restarted at 0: the first epoch it hears raises the floor


def _opens_with_auth(conn):
  """Whether the bytes waiting on conn start an AUTH frame (peeked, not consumed)."""
  try:
    pre = conn.recv(PREFIX.size, socket.MSG_PEEK | socket.MSG_DONTWAIT)
  except OSError:
    return False
  return len(pre) >= 8 and pre[:4] == MAGIC and struct.unpack_from("<H", pre, 6)[0] == AUTH


def _linger_close(conn, max_bytes=1 << 20, max_s=0.2):
  """Half-closes, then discards a bounded amount of unread input: closing with unread bytes would make the
  kernel send RST, which destroys the error reply before the peer reads it."""
  with contextlib.suppress(OSError):
    conn.shutdown(socket.SHUT_WR)
    end, left = time.monotonic() + max_s, max_bytes
    while left > 0 and time.monotonic() < end:
      conn.settimeout(max(end - time.monotonic(), 1e-3))
      k = len(conn.recv(min(left, 65536)))
      if k == 0:
        break
      left -= k


def serve(cfg: ServerConfig, port_file=None):
  """Runs a server until SIGTERM / SIGINT, then stops it. port_file: if set, the bound port is written there
  atomically once listening (useful with port=0)."""
  srv = Server(cfg)
  if port_file:
    common.write_atomic(port_file, f"{srv.port}\n")
  done = threading.Event()
  for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, lambda *_: done.set())
  srv.start()
  log.info("param_server listening on %s:%d", cfg.host, srv.port)
  print(f"param_server listening on {cfg.host}:{srv.port}", flush=True)
  while not done.wait(0.1):  # with no timeout, a signal delivered to another thread never woke this one
    pass
  srv.stop()


# ----------------------------------------------------------------------------------------------- client


def read_token(path):
  try:
    with open(path) as f:
      tok = f.read().strip()
  except OSError as e:
    raise ValueError(f"cannot read token file {path}: {e}") from None
  if not tok:
    raise ValueError(f"token file {path} is empty")
  return tok


_HOLDER = secrets.token_hex(16)  # this process's lease identity (a secret: no reply ever shows it)
_ERRORS = {"auth": PermissionError, "bad_request": ValueError, "stale_version": ValueError,
           "protocol": ProtocolError, "checksum": ChecksumError, "timeout": TimeoutError, "storage": StorageError,
           "fenced": FencedError}


class Client:
  """Talks to a Server. Thread-safe (requests are serialized on one connection; use one Client per thread for
  parallel transfers). Every call reconnects with exponential backoff and raises ConnectionError after `retries`
  failed attempts; an ERROR reply raises at once: PermissionError (token), ValueError (bad request, stale version),
  ProtocolError, ChecksumError, StorageError (the server's disk refused: nothing changed). Queue items are dicts
  with a str "id" plus JSON-able fields and np.ndarray / list-of-np.ndarray fields."""

  def __init__(self, host="127.0.0.1", port=5555, token=None, timeout_s=30.0, retries=8, backoff_s=0.05,
               max_backoff_s=2.0, holder=None):
    self.host, self.port, self.token = host, port, token
    self.holder = holder or _HOLDER  # who leases: only it may ack, fail, release or requeue what it leased
    self.epoch = None  # set by register_trainer: then sent with every request, so a newer trainer fences this one
    self.timeout_s, self.retries, self.backoff_s, self.max_backoff_s = timeout_s, retries, backoff_s, max_backoff_s
    self._sock, self._lock = None, threading.Lock()

  def close(self):
    with self._lock:
      self._drop()

  def _drop(self):
    sock, self._sock = self._sock, None
    if sock is not None:
      sock.close()

  def _request(self, mtype, header, parts=(), wait_s=0.0, tensors=False):
    """One request/reply -> (reply header, payload buffer)."""
    if not self.token:  # the connection authenticates (AUTH) before its first request
      raise PermissionError(f"{REQUEST_TYPES[mtype]} needs the shared token (Client(token=...))")
    if mtype in (GET, ACK, REQUEUE, FAIL, PUT):
      header = dict(header, holder=self.holder)
    if self.epoch is not None:
      header = dict(header, epoch=self.epoch)
    last = None
    with self._lock:
      for attempt in range(self.retries + 1):
        if attempt:
          time.sleep(min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1)) * (0.5 + random.random()))
        try:
          if self._sock is not None and select.select([self._sock], [], [], 0)[0]:
            self._drop()  # readable between requests = the server closed it (idle timeout, restart)
          error = False
          if self._sock is None:
            self._sock = socket.create_connection((self.host, self.port), timeout=self.timeout_s)
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # Authenticate the connection first: every request needs it, and it gets a reserved slot, big headers.
            h, buf, error = self._exchange(AUTH, {"token": self.token}, (), 0.0, False)
          if not error:
            h, buf, error = self._exchange(mtype, header, parts, wait_s, tensors)
        except OSError as e:  # ConnectionError, TimeoutError, ...: the server may be restarting; retry
          self._drop()
          last = e
          continue
        if not error:
          return h, buf
        self._drop()  # after a protocol error the server closes its side anyway: start clean
        if h.get("code") != "busy":
          raise _ERRORS.get(h.get("code"), RuntimeError)(h.get("error", "unknown server error"))
        last = ConnectionError(h.get("error"))
    raise ConnectionError(f"param server {self.host}:{self.port} unreachable after {self.retries + 1} "
                          f"attempts ({REQUEST_TYPES[mtype]}): {type(last).__name__}: {last}")

  def _exchange(self, mtype, header, parts, wait_s, tensors):
    nbytes = sum(memoryview(p).nbytes for p in parts)
    with contextlib.suppress(OSError):  # the server may have refused early and closed: its error reply may be readable
      _send_frame(self._sock, mtype, header, parts, deadline=time.monotonic() + self.timeout_s + nbytes / 50e6)
    got = _read_prefix_header(self._sock, time.monotonic() + self.timeout_s + wait_s, self.timeout_s, 1 << 30)
    if got is None:
      raise ConnectionError("server closed the connection")
    mtype, h, plen = got
    if mtype == ERROR:
      return h, None, True
    if mtype != OK:
      raise ProtocolError(f"unexpected reply type {mtype}")
    deadline = time.monotonic() + self.timeout_s + plen / 50e6
    # Not _alloc's fresh mmap: a reply is transient, and a worker's tuned malloc (common.tune_malloc) reuses the
    # last pull's memory instead of faulting pages in (2.6x the bytes received per core-second; RESULTS, bench.link).
    buf = np.empty(plen, np.uint8)
    if tensors:  # a FETCH reply: every tensor's crc and the table's digest are checked
      specs = h["tensors"]
      crcs = _recv_with_crcs(self._sock, buf, _check_specs(specs, plen, "fetch reply"), deadline, "tensors")
      _check_crcs(specs, crcs, f"v{h['version']}", ChecksumError)
      if h["digest"] != _digest(h["version"], specs):
        raise ChecksumError(f"v{h['version']}: tensor table digest mismatch")
    else:
      _recv_into(self._sock, memoryview(buf), deadline, "reply payload")
    return h, buf, False

  # -- weights (one Client per shard server; the manifest lives on the first)

  def register_trainer(self) -> int:
    """A trainer's start: a new epoch, sent with every later request of this client; older trainers are fenced."""
    self.epoch = None
    self.epoch = self._request(REGISTER, {})[0]["epoch"]
    return self.epoch

  def latest_version(self) -> int:
    """The newest committed version, -1 if none."""
    return self._request(LATEST, {})[0]["version"]

  def stage(self, version: int, nonce: int, name: str, index, array):
    """STAGE: one piece of tensor `name`, its global slice `index` ([[start, stop], ...]). Needs the token."""
    spec, raw = _as_wire_array(array, f"stage tensor {name!r}")
    self._request(STAGE, dict(spec, version=int(version), nonce=int(nonce), name=name,
                              index=[[int(a), int(b)] for a, b in index], crc=zlib.crc32(raw)), [raw])

  def staged(self, version=None, nonce=None, keep=None) -> dict:
    """{"pieces": [{name, index, dtype, crc}] staged for (version, nonce), "versions": [held]}; keep: see STAGED."""
    return self._request(STAGED, {"version": version, "nonce": nonce, "keep": keep})[0]

  def commit(self, manifest: dict) -> list:
    """Makes manifest["version"] visible; returns the versions whose manifests the server keeps. Needs the token."""
    return self._request(COMMIT, {}, [json.dumps(manifest, separators=(",", ":")).encode()])[0]["kept"]

  def manifest(self, newer_than: int = -1, wait_s: float = 0.0):
    """The newest committed manifest (dict) if its version > newer_than, else None (at once or after wait_s)."""
    h, buf = self._request(MANIFEST, {"newer_than": int(newer_than), "wait_s": float(wait_s)}, wait_s=wait_s)
    return None if h["version"] is None else json.loads(bytes(buf))

  def fetch(self, version: int, pieces) -> list:
    """Sub-slices of staged pieces: pieces = [{name, index, crc, sub}] (sub: [[start, stop], ...] within the
    piece, None = all of it). Returns one array per piece, crc-checked; raises ValueError if the server no
    longer holds one (the version was garbage-collected: read the newest manifest again)."""
    h, buf = self._request(FETCH, {"version": int(version), "pieces": list(pieces)}, tensors=True)
    return _views(buf, h["tensors"])

  def delta(self, version: int, base: int, pieces) -> list:
    """FETCH for a reader that holds version `base`: pieces = [{name, index, crc, sub, base_crc}] (base_crc: the
    crc the base's manifest gives the piece at the same index). Returns per piece {"enc", "crc", "pcrc",
    "changed", "data"}: the caller checks zlib.crc32(data) == pcrc, then applies delta_decode(enc, data, ...) to
    its copy of that sub-slice of base (crc: the result's, for a reader that can check it cheaply).
    enc "full": data = the new bytes. Raises ValueError like fetch if the server no longer holds `version`."""
    h, buf = self._request(DELTA, {"version": int(version), "base": int(base), "pieces": list(pieces)})
    sizes = [p.get("nbytes") for p in h.get("pieces", [])]
    if len(sizes) != len(pieces) or not all(isinstance(n, int) and n >= 0 for n in sizes) or sum(sizes) != len(buf):
      raise ProtocolError(f"delta reply: piece sizes {sizes[:8]} do not add up to the {len(buf)}-byte payload")
    mv = memoryview(buf)
    return [dict(enc=p["enc"], crc=p["crc"], pcrc=p.get("pcrc"), changed=p["changed"], data=mv[end - n:end])
            for p, n, end in zip(h["pieces"], sizes, itertools.accumulate(sizes))]

  def stats(self) -> dict:
    return self._request(STATS, {})[0]

  # -- queues

  def put(self, queue: str, items, wait_s: float = 0.0):
    """Adds items (dicts with a str "id"); ids already known are dropped. Raises QueueFullError if some did
    not fit within wait_s (retrying the same batch is safe). Returns {"accepted": n, "duplicates": [ids]}."""
    h = self._put(queue, items, wait_s, release=False)
    if h["rejected"]:
      raise QueueFullError(f"queue {queue!r} full: {len(h['accepted'])} accepted, {len(h['duplicates'])} "
                           f"duplicates, {len(h['rejected'])} rejected after waiting {wait_s}s (retry is safe)")
    return {"accepted": len(h["accepted"]), "duplicates": h["duplicates"]}

  def release(self, queue: str, items) -> dict:
    """Hands leased items back with new contents (same ids; e.g. a preempted worker's partial rollouts), in the
    order given: each replaces the stored item and is re-issued first. Ids no longer live (acked, quarantined)
    are not stored but reported unknown: release never adds an item."""
    h = self._put(queue, items, 0.0, release=True)
    return {"released": len(h["accepted"]), "unknown": h["unknown"]}

  def _put(self, queue, items, wait_s, release):
    metas, parts = [], []
    for it in items:
      if not isinstance(it, dict) or not isinstance(it.get("id"), str) or not it["id"]:
        raise ValueError(f"put({queue!r}): every item must be a dict with a non-empty str 'id', got {it!r:.80}")
      js, arrays = {}, {}
      for k, v in it.items():
        if k == "id":
          continue
        what = f"put({queue!r}) item {it['id']!r} field {k!r}"
        many = isinstance(v, (list, tuple)) and v and all(isinstance(x, np.ndarray) for x in v)
        if many or isinstance(v, np.ndarray):
          wired = [_as_wire_array(x, what) for x in (v if many else [v])]
          arrays[k] = [spec for spec, _ in wired] if many else wired[0][0]
          parts.extend(raw for _, raw in wired)
        else:
          try:
            js[k] = json.loads(json.dumps(v, default=np.generic.item, allow_nan=False))  # np scalars; else TypeError
          except (TypeError, ValueError) as e:
            raise ValueError(f"{what} is neither JSON-able nor an np.ndarray: {e}") from None
      metas.append({"id": it["id"], "json": js, "arrays": arrays})
    h = {"queue": queue, "items": metas, "wait_s": float(wait_s), "release": release}
    return self._request(PUT, h, parts, wait_s=wait_s)[0]

  def get(self, queue: str, max_items: int, wait_s: float = 0.0, lease_s: float = 300.0, consumer: bool = False):
    """Leases up to max_items items (waits up to wait_s for the first). Unacked items return after lease_s.
    consumer: this process serves the queue (a verifier): stats() counts it in the queue's "consumers" for 30 s."""
    h, buf = self._request(GET, {"queue": queue, "max_items": int(max_items), "wait_s": float(wait_s),
                                 "lease_s": float(lease_s), "consumer": consumer}, wait_s=wait_s)
    out, off = [], 0  # items and their arrays lie back to back in the payload
    for m in h["items"]:
      item = {"id": m["id"], **m["json"]}
      for k, spec in m["arrays"].items():
        specs = spec if isinstance(spec, list) else [spec]
        arrs = _views(buf, specs, off)
        off += sum(s["nbytes"] for s in specs)
        item[k] = arrs if isinstance(spec, list) else arrs[0]
      out.append(item)
    return out

  def ack(self, queue: str, ids):
    """Removes items forever (they are never delivered again, even after a server restart). Returns {"acked": n,
    "unknown": [ids], "stale": [ids leased again to another holder since this one's lease expired: not acked]}."""
    return self._request(ACK, {"queue": queue, "ids": [str(i) for i in ids]})[0]

  def fail(self, queue: str, ids, reason: str) -> dict:
    """Reports leased items the caller could not process (reason: a short text, e.g. the exception). Each is
    re-issued (to the tail) until it failed max_failures times; then it is quarantined and a notice lands in
    the queue "<queue>.failed". Returns {"failed": [ids still leased by anyone], "quarantined": [ids]}."""
    return self._request(FAIL, {"queue": queue, "ids": [str(i) for i in ids], "reason": str(reason)})[0]

  def requeue(self, queue: str, ids=None) -> int:
    """Releases outstanding leases of `queue` at once: all of them (a restarted consumer calls this at startup)
    or only `ids` (a worker handing back prompts it will not finish). Returns how many were released."""
    h = {"queue": queue} if ids is None else {"queue": queue, "ids": [str(i) for i in ids]}
    return self._request(REQUEUE, h)[0]["released"]


def connect(addr, token=None, retries=8):
  """A Client for "host:port"."""
  host, port = addr.rsplit(":", 1)
  return Client(host, int(port), token=token, retries=retries)


def flatten(tree, prefix=""):
  """Nested dict of arrays -> {"a/b/c": leaf}: the flat names weights travel under (leaves as they are: a sharded
  jax.Array is never gathered here)."""
  out = {}
  for k, v in tree.items():
    if not isinstance(k, str) or "/" in k:
      raise ValueError(f"flatten: key {k!r} under {prefix!r} must be a str without '/'")
    if isinstance(v, dict):
      out.update(flatten(v, prefix + k + "/"))
    else:
      out[prefix + k] = v
  return out


def unflatten(flat):
  """Inverse of flatten."""
  tree = {}
  for name, v in flat.items():
    *path, leaf = name.split("/")
    node = tree
    for p in path:
      node = node.setdefault(p, {})
    node[leaf] = v
  return tree


def slice_index(idx, shape):
  """A device's tuple of slices -> [[start, stop], ...] over the global shape: how pieces name their slice."""
  return [[s.start or 0, d if s.stop is None else s.stop] for s, d in zip(idx, shape)]


# ----------------------------------------------------------------------------------------------- main


def _main():
  from absl import app, flags  # flags are defined only when run as a script, never on import

  flags.DEFINE_string("host", "127.0.0.1", "Interface to bind (default 127.0.0.1); route:ADDR binds the local "
                      "address that reaches ADDR (a pod host: its address on the slice's internal network).")
  flags.DEFINE_integer("port", 5555, "TCP port (default 5555; 0 picks a free one, see --port_file).")
  flags.DEFINE_string("port_file", None, "If set, the bound port is written here (default: none).")
  flags.DEFINE_string("token_file", None, "File with the shared secret; created with a random token if "
                      "missing (default: none, so stage/commit/put/get/ack/requeue are refused).")
  flags.DEFINE_string("run_dir", None, "Directory for the queue logs (default: none, in memory only).")
  # ServerConfig fields with a flag of their own: help, "{}" being ServerConfig's default.
  d, define = ServerConfig(), {int: flags.DEFINE_integer, float: flags.DEFINE_float, bool: flags.DEFINE_bool}
  for name, text in [("max_versions", "Committed weight versions kept (count, default {})."),
                     ("max_queue_items", "Per-queue cap on ready+leased items (count, default {})."),
                     ("max_queue_mb", "Per-queue cap on item bytes (MiB, default {})."),
                     ("max_acked_ids", "Acked ids remembered per queue (count, default {})."),
                     ("max_payload_mb", "Cap on one staged piece or manifest (MiB, default {})."),
                     ("max_put_mb", "Cap on one put / get reply (MiB, default {})."),
                     ("max_header_kb", "Cap on a frame header (KiB, default {})."),
                     ("max_clients", "Concurrent connections (count, default {})."),
                     ("max_peer_requests", "One peer address's requests in service at once (count, default {})."),
                     ("max_peer_rps", "Requests one peer address may start per second (1/s, default {})."),
                     ("idle_timeout_s", "Idle connection timeout (s, default {})."),
                     ("header_timeout_s", "Time for a frame's prefix+header to arrive (s, default {})."),
                     ("min_rate_mb_s", "Slowest accepted payload rate (MB/s, default {})."),
                     ("max_wait_s", "Cap on server-side waits (s, default {})."),
                     ("fsync", "fsync queue logs before replying (default {})."),
                     ("untrusted_header_kb", "Cap on a frame header before the connection authenticated (KiB, "
                      "default {})."),
                     ("max_failures", "FAIL reports after which a queue item is quarantined (count, default {}).")]:
    default = getattr(d, name)
    define[type(default)](name, default, text.format(default))
  FLAGS = flags.FLAGS

  def main(argv):
    del argv
    logging.basicConfig(level=logging.INFO)
    token = None
    if FLAGS.token_file:
      if not os.path.exists(FLAGS.token_file):
        os.makedirs(os.path.dirname(os.path.abspath(FLAGS.token_file)), exist_ok=True)
        common.write_atomic(FLAGS.token_file, secrets.token_hex(32) + "\n", mode=0o600)
      token = read_token(FLAGS.token_file)
    # Every flag named like a ServerConfig field sets that field; the rest keep their defaults.
    if FLAGS.host.startswith("route:"):  # what the trainer advertises too (train.own_server_addresses)
      with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((FLAGS.host[6:], 9))  # UDP: picks the route, sends nothing
        FLAGS.host = s.getsockname()[0]
    cfg = ServerConfig(token=token, **{f.name: FLAGS[f.name].value for f in dataclasses.fields(ServerConfig)
                                       if f.name in FLAGS})
    serve(cfg, port_file=FLAGS.port_file)
    logging.shutdown()
    os._exit(0)  # the queue logs are closed: a handler thread still mid-reply must not hold the exit up

  app.run(main)


if __name__ == "__main__":
  _main()
