"""Tests for param_server.py: protocol, weights, leased queues, robustness, persistence across kill -9."""
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import zlib

import ml_dtypes
import numpy as np
import pytest

import param_server as ps

TOKEN = "s3cret"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_server(**kw):
  cfg = dict(token=TOKEN, header_timeout_s=0.5, idle_timeout_s=3.0, min_rate_mb_s=20.0, max_wait_s=5.0)
  cfg.update(kw)
  return ps.Server(ps.ServerConfig(**cfg)).start()


@pytest.fixture
def server():
  s = make_server()
  yield s
  s.stop()


def client(srv, token=TOKEN, **kw):
  return ps.Client(port=srv.port, token=token, timeout_s=5.0, **kw)


def frame(mtype, header, payload=b"", magic=ps.MAGIC, version=ps.PROTOCOL_VERSION, hlen=None, plen=None):
  hb = json.dumps(header).encode()
  return ps.PREFIX.pack(magic, version, mtype, len(hb) if hlen is None else hlen,
                        len(payload) if plen is None else plen) + hb + payload


def raw_exchange(srv, data, shut_wr=False, timeout=5.0):
  """Sends raw bytes; returns (error reply header or None, whether the server closed the connection)."""
  s = socket.create_connection(("127.0.0.1", srv.port), timeout=timeout)
  s.sendall(data)
  if shut_wr:
    s.shutdown(socket.SHUT_WR)
  buf = b""
  try:
    while True:
      k = s.recv(65536)
      if not k:
        break
      buf += k
  except socket.timeout:
    s.close()
    return None, False
  s.close()
  if len(buf) < ps.PREFIX.size:
    return None, True
  magic, ver, mtype, hl, pl = ps.PREFIX.unpack_from(buf)
  assert magic == ps.MAGIC and mtype == ps.ERROR, (magic, mtype)
  return json.loads(buf[ps.PREFIX.size:ps.PREFIX.size + hl]), True


def weights(v, n=4, size=1 << 18):
  """n float32 tensors whose every element equals the version: a mixed read would show two values."""
  return {f"layers/{i}/w": np.full(size, v, np.float32) for i in range(n)}


def publish(c, version, tensors):
  """Stages each tensor whole and commits the manifest, then collects older staged versions: train.publish_shards
  for a one-process trainer without jax."""
  for name, a in tensors.items():
    c.stage(version, version, name, [[0, d] for d in np.shape(a)], a)
  crc = {p["name"]: p["crc"] for p in c.staged(version, version)["pieces"]}
  c.staged(keep=c.commit(dict(version=version, servers=[f"127.0.0.1:{c.port}"], tensors={
      name: dict(dtype=np.asarray(a).dtype.name, shape=list(np.shape(a)),
                 pieces=[dict(index=[[0, d] for d in np.shape(a)], crc=crc[name], server=0)])
      for name, a in tensors.items()})))


def read(c, m=None):
  """(version, {name: array}) of the newest manifest (or of m), every tensor fetched whole."""
  m = m or c.manifest()
  want = [dict(name=n, index=t["pieces"][0]["index"], crc=t["pieces"][0]["crc"], sub=None)
          for n, t in m["tensors"].items()]
  return m["version"], dict(zip(m["tensors"], c.fetch(m["version"], want)))


def stage_header(n, crc=0, **kw):
  """A raw STAGE request's header for one n-byte uint8 piece."""
  return {**dict(version=0, nonce=0, name="x", index=[[0, n]], dtype="uint8", shape=[n], nbytes=n, crc=crc), **kw}


def later(delay_s, fn):
  """Runs fn in a thread after delay_s; join() the result so the test never outlives it."""
  t = threading.Timer(delay_s, fn)
  t.start()
  return t


def assert_served(srv):
  c = client(srv)
  assert c.stats()["latest_version"] >= -1
  c.close()


# ----------------------------------------------------------------------------------------------- weights


def test_round_trip_dtypes_bf16_and_versions(server):
  c = client(server)
  assert c.manifest() is None and c.latest_version() == -1
  w = {"a/bf16": (np.arange(12, dtype=np.float32) / 7).reshape(3, 4).astype(ml_dtypes.bfloat16),
       "b/f32": np.random.rand(5, 2).astype(np.float32), "c/i32": np.arange(7, dtype=np.int32),
       "d/empty": np.zeros((0, 3), np.float16), "e/scalar": np.array(3.5), "f/bool": np.array([True, False]),
       "g/bigendian": np.arange(4, dtype=">i8"), "h/strided": np.arange(20.0)[::2]}
  publish(c, 0, w)
  v, got = read(c)
  assert v == 0 and list(got) == list(w)
  for k in w:
    assert got[k].shape == w[k].shape and np.array_equal(got[k], w[k]), k
  assert got["a/bf16"].dtype == ml_dtypes.bfloat16
  assert c.manifest(newer_than=0) is None
  for v in (1, 2, 3):
    publish(c, v, weights(v, n=1, size=8))
  assert c.latest_version() == 3 and c.stats()["versions"] == [2, 3]  # max_versions=2
  assert c.staged()["versions"] == [2, 3]  # older staged versions were collected
  with pytest.raises(ValueError, match="latest manifest is v3"):
    c.commit(dict(version=3, servers=[], tensors={}))
  assert read(c)[1]["layers/0/w"][0] == 3


def test_manifest_returns_at_once_or_waits(server):
  c = client(server)
  t0 = time.monotonic()
  assert c.manifest(newer_than=5) is None
  assert time.monotonic() - t0 < 0.5
  t0 = time.monotonic()
  assert c.manifest(wait_s=0.3) is None
  assert 0.25 < time.monotonic() - t0 < 2.0
  t = later(0.3, lambda: publish(client(server), 7, weights(7, n=1, size=16)))
  t0 = time.monotonic()
  m = c.manifest(newer_than=-1, wait_s=4.0)
  assert m["version"] == 7 and 0.2 < time.monotonic() - t0 < 3.0
  t.join()


def test_stage_needs_token(server):
  with pytest.raises(PermissionError):
    client(server, token=None).stage(0, 0, "x", [[0, 4]], np.ones(4))  # refused client-side already
  bad = client(server, token="wrong")
  for op in (lambda: bad.stage(0, 0, "x", [[0, 4]], np.ones(4)), lambda: bad.put("q", [{"id": "a"}]),
             lambda: bad.get("q", 1), lambda: bad.ack("q", ["a"]), lambda: bad.requeue("q"), bad.latest_version):
    with pytest.raises(PermissionError, match="wrong token"):
      op()  # a wrong token is refused when the connection authenticates, before any request
  # A raw stage frame with no token is refused before a payload byte is read, and the connection is closed
  # (draining would let anyone hold a slot for as long as the payload it announces takes).
  h, closed = raw_exchange(server, frame(ps.STAGE, stage_header(4, zlib.crc32(b"abcd")), b"", plen=4))
  assert closed and h["code"] == "auth" and "payload not read" in h["error"], h
  # Reads need the token too (issue 39: anonymous FETCH / MANIFEST / STATS served the weights to anyone): each op
  # without it is refused and the connection kept; after AUTH on the same connection it is served.
  s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
  reads = [(ps.LATEST, {}), (ps.STATS, {}), (ps.MANIFEST, {}), (ps.STAGED, {}), (ps.FETCH, {"version": 0, "pieces": []}),
           (ps.DELTA, {"version": 1, "base": 0, "pieces": []}), (ps.GET, {"queue": "q", "max_items": 1})]
  s.sendall(b"".join(frame(t, h) for t, h in reads) + frame(ps.AUTH, {"token": TOKEN}) + frame(ps.LATEST, {}))
  f = s.makefile("rb")
  for want_type in [ps.ERROR] * len(reads) + [ps.OK, ps.OK]:
    _, _, mtype, hl, pl = ps.PREFIX.unpack(f.read(ps.PREFIX.size))
    h = json.loads(f.read(hl))
    f.read(pl)
    assert mtype == want_type and (mtype == ps.OK or h["code"] == "auth"), h
  s.close()
  assert client(server).latest_version() == -1
  nokey = make_server(token=None)
  with pytest.raises(PermissionError, match="no token configured"):
    client(nokey).stage(0, 0, "x", [[0, 4]], np.ones(4))
  nokey.stop()


def test_server_rejects_bad_crc_and_client_verifies(server):
  h, closed = raw_exchange(server, frame(ps.STAGE, stage_header(4, crc=123, token=TOKEN), b"abcd"), shut_wr=True)
  assert h["code"] == "checksum"
  c = client(server)
  assert c.staged()["versions"] == []
  publish(c, 0, weights(0, n=2, size=1 << 20))
  _, _, buf = next(iter(server.weights.staged[0]["pieces"].values()))
  buf[12345] ^= 0xFF  # corrupt the stored bytes of layers/0/w behind the server's back
  with pytest.raises(ps.ChecksumError, match="layers/0/w"):
    read(c)


def test_concurrent_readers_during_publishes_never_see_mixed_versions(server):
  publisher, stop, errors, last = client(server), threading.Event(), [], [-1] * 6
  publish(publisher, 0, weights(0))

  def reader(k):
    c = client(server)
    try:
      while not stop.is_set():
        m = c.manifest(newer_than=last[k], wait_s=0.5)
        if m is None:
          continue
        try:
          v, w = read(c, m)
        except ValueError as e:  # collected meanwhile: read the newest manifest again
          assert "not held here" in str(e)
          continue
        assert v > last[k]
        for name, a in w.items():
          assert a.min() == a.max() == v, (name, v, a.min(), a.max())
        last[k] = v
    except Exception as e:  # surfaced below
      errors.append(e)

  threads = [threading.Thread(target=reader, args=(k,)) for k in range(6)]
  for t in threads:
    t.start()
  for v in range(1, 13):
    publish(publisher, v, weights(v))
  t0 = time.monotonic()
  while min(last) < 12 and not errors and time.monotonic() - t0 < 10:
    time.sleep(0.05)
  stop.set()
  for t in threads:
    t.join()
  assert not errors, errors
  assert last == [12] * 6  # every reader reached the last version


# ----------------------------------------------------------------------------------------------- robustness


@pytest.mark.parametrize("name,data,code", [
    ("random bytes", bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8)), "protocol"),
    ("wrong magic", frame(ps.STATS, {}, magic=b"HTTP"), "protocol"),
    ("wrong version", frame(ps.STATS, {}, version=99), "protocol"),
    ("unknown type", frame(42, {}), "protocol"),
    ("bad json", ps.PREFIX.pack(ps.MAGIC, 1, ps.STATS, 5, 0) + b"{nope", "protocol"),
    ("header too long", frame(ps.STATS, {}, hlen=1 << 31), "protocol"),
    ("payload too long", frame(ps.STAGE, {"token": TOKEN}, plen=1 << 62), "protocol"),
    ("payload on a read", frame(ps.STATS, {}, plen=10), "protocol"),
    ("truncated frame", frame(ps.STATS, {"x": 1})[:-3], "protocol"),
    ("truncated payload", frame(ps.PUT, {"token": TOKEN, "queue": "q", "items": [
        {"id": "a", "json": {}, "arrays": {"t": {"dtype": "int8", "shape": [8], "nbytes": 8}}}]},
        b"1234", plen=8), "protocol"),
])
def test_bad_frames_get_error_and_close(server, name, data, code):
  h, closed = raw_exchange(server, data, shut_wr=True)
  assert closed and h is not None and h["code"] == code, (name, h)
  assert_served(server)


def test_bad_request_fields_are_errors_not_crashes(server):
  c = client(server)
  with pytest.raises(ValueError, match="bad queue name"):
    c.get("no spaces!", 1)
  with pytest.raises(ValueError, match="max_items"):
    c.get("q", 0)
  with pytest.raises(ValueError, match="field 'obj'"):
    c.put("q", [{"id": "a", "obj": object()}])
  with pytest.raises(ValueError, match="'id'"):
    c.put("q", [{"tokens": np.arange(3)}])
  h, _ = raw_exchange(server, frame(ps.STAGE, stage_header(1, dtype="complex128", nbytes=16, token=TOKEN), bytes(16)),
                      shut_wr=True)
  assert h["code"] == "bad_request" and "complex128" in h["error"]
  assert c.stats()["latest_version"] == -1


def test_half_open_and_idle_clients_time_out_while_others_are_served():
  srv = make_server(idle_timeout_s=1.0)
  try:
    half = socket.create_connection(("127.0.0.1", srv.port))
    half.sendall(frame(ps.STATS, {})[:7])  # a partial prefix, then silence
    idle = socket.create_connection(("127.0.0.1", srv.port))  # says nothing at all
    t0 = time.monotonic()
    c = client(srv)
    for _ in range(5):
      assert c.latest_version() == -1  # others are served meanwhile
    half.settimeout(5)
    assert half.recv(65536)[:4] == ps.MAGIC  # an error frame ("timed out"), then EOF
    assert 0.3 < time.monotonic() - t0 < 3.0
    while half.recv(65536):
      pass
    idle.settimeout(5)
    assert idle.recv(65536) == b"" and 0.8 < time.monotonic() - t0 < 4.0  # nothing to answer: closed
    deadline = time.monotonic() + 3
    while c.stats()["clients"] != 1 and time.monotonic() < deadline:
      time.sleep(0.05)
    assert c.stats()["clients"] == 1  # both dead connections were freed
    time.sleep(1.2)  # now c's own connection idles out; its next call reconnects transparently
    assert c.latest_version() == -1
  finally:
    srv.stop()


def test_slowloris_upload_times_out_while_another_client_reads():
  srv = make_server(min_rate_mb_s=1.0)  # deadline for 1 MB: 0.5 s + 1 s
  try:
    c = client(srv)
    publish(c, 0, weights(0, n=1, size=16))
    n = 1 << 20
    slow = socket.create_connection(("127.0.0.1", srv.port))
    slow.sendall(frame(ps.STAGE, stage_header(n, version=1, token=TOKEN), b"", plen=n))
    t0, closed = time.monotonic(), False
    slow.settimeout(0.1)
    while time.monotonic() - t0 < 5:
      try:
        slow.sendall(b"x" * 100)  # progress every 0.1 s, far below the minimum rate
      except OSError:
        closed = True
        break
      try:
        slow.recv(65536)  # returns only once the server answered (a "timed out" error frame) or closed
        closed = True
        break
      except socket.timeout:
        pass
      assert read(c)[0] == 0  # another client is served while the slow upload goes on
    elapsed = time.monotonic() - t0
    assert closed and 1.0 < elapsed < 4.0, elapsed
    assert c.latest_version() == 0
    publish(c, 1, weights(1, n=1, size=16))
    assert c.latest_version() == 1
  finally:
    srv.stop()


def test_slow_reader_times_out_and_is_freed():
  # 64 MiB must leave within 0.5 s + 0.67 s; a long idle timeout shows it is the send deadline that fires.
  srv = make_server(min_rate_mb_s=100.0, idle_timeout_s=60.0)
  try:
    c = client(srv)
    publish(c, 0, {"w": np.ones(16 << 20, np.float32)})
    piece = c.manifest()["tensors"]["w"]["pieces"][0]
    lazy = socket.socket()
    lazy.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)  # before connect: no window autotuning
    lazy.connect(("127.0.0.1", srv.port))
    lazy.sendall(frame(ps.FETCH, {"version": 0, "token": TOKEN,
                                  "pieces": [dict(name="w", index=piece["index"], crc=piece["crc"])]}))
    # ...and never reads the reply
    t0 = time.monotonic()
    # First see the server hold it (its accept thread registers the connection a moment later: counting too soon
    # saw 1 client, skipped the wait, and then found 2), then see it freed.
    while c.stats()["clients"] < 2 and time.monotonic() - t0 < 5:
      time.sleep(0.01)
    assert c.stats()["clients"] == 2
    while c.stats()["clients"] > 1 and time.monotonic() - t0 < 15:
      assert c.latest_version() == 0  # served meanwhile
      time.sleep(0.05)
    assert c.stats()["clients"] == 1 and time.monotonic() - t0 < 10
    lazy.close()
    assert read(c)[1]["w"].sum() == 16 << 20
  finally:
    srv.stop()


def test_full_server_evicts_anonymous_then_idle_and_is_busy_only_when_every_slot_works():
  srv = make_server(max_clients=3, idle_timeout_s=60.0)
  try:
    anon = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(20)]  # idle, no token
    anon[-1].sendall(frame(ps.STATS, {})[:7])  # and one stuck mid-prefix
    t0 = time.monotonic()
    a, b = client(srv), client(srv)
    assert a.latest_version() == b.latest_version() == -1 and time.monotonic() - t0 < 1.0
    assert a.stats()["clients"] <= 3
    # Two authenticated clients blocked in a manifest long poll: the third evicts the last anonymous slot, then a fourth
    # evicts the third (idle, authenticated: its client reconnects transparently on its next call).
    waits = [threading.Thread(target=x.manifest, kwargs=dict(wait_s=3.0)) for x in (a, b)]
    for t in waits:
      t.start()
    time.sleep(0.5)
    c = client(srv)
    assert c.latest_version() == -1
    d = client(srv, retries=1, backoff_s=0.01)
    assert d.latest_version() == -1
    # Now every slot does authenticated work (two polls waiting, d waiting too): a newcomer gets "busy".
    waits.append(threading.Thread(target=d.manifest, kwargs=dict(wait_s=3.0)))
    waits[-1].start()
    time.sleep(0.5)
    with pytest.raises(ConnectionError, match="busy"):
      client(srv, retries=1, backoff_s=0.01).stats()
    for t in waits:
      t.join()
    assert c.latest_version() == -1  # c had been evicted while idle: reconnected
    for x in anon:
      x.close()
  finally:
    srv.stop()


def test_client_gives_up_with_connection_error():
  s = socket.socket()
  s.bind(("127.0.0.1", 0))
  port = s.getsockname()[1]
  s.close()  # nothing listens there
  c = ps.Client(port=port, token=TOKEN, retries=3, backoff_s=0.01, timeout_s=1.0)
  t0 = time.monotonic()
  with pytest.raises(ConnectionError, match="unreachable after 4 attempts"):
    c.latest_version()
  assert time.monotonic() - t0 < 2.0


# ----------------------------------------------------------------------------------------------- queues


def rollout(i, version=0):
  return {"id": f"r{i}", "prompt_id": f"p{i // 2}", "policy_version": version, "reward": [1.0, 0.0],
          "tokens": [np.arange(i + 3, dtype=np.int32), np.arange(2, dtype=np.int32)],
          "logprobs": np.full((2, 4), -0.5, np.float32)}


def test_put_get_ack_idempotent(server):
  c = client(server)
  assert c.get("rollouts", 5) == []
  assert c.put("rollouts", [rollout(i) for i in range(4)]) == {"accepted": 4, "duplicates": []}
  assert c.put("rollouts", [rollout(1), rollout(4)]) == {"accepted": 1, "duplicates": ["r1"]}  # ready dup
  got = c.get("rollouts", 2)
  assert [g["id"] for g in got] == ["r0", "r1"]
  g = got[1]
  assert g["prompt_id"] == "p0" and g["reward"] == [1.0, 0.0] and g["policy_version"] == 0
  assert np.array_equal(g["tokens"][0], np.arange(4)) and g["tokens"][0].dtype == np.int32
  assert g["logprobs"].shape == (2, 4) and np.all(g["logprobs"] == -0.5)
  assert c.put("rollouts", [rollout(0)])["duplicates"] == ["r0"]  # leased dup
  assert c.ack("rollouts", ["r0", "nope"]) == {"acked": 1, "unknown": ["nope"], "stale": []}
  assert c.put("rollouts", [rollout(0)])["duplicates"] == ["r0"]  # acked dup: never again
  st = c.stats()["queues"]["rollouts"]
  assert (st["ready"], st["leased"], st["acked"]) == (3, 1, 1)
  assert [g["id"] for g in c.get("rollouts", 10)] == ["r2", "r3", "r4"]


def test_lease_expiry_reissues_and_requeue(server):
  c = client(server)
  c.put("prompts", [{"id": f"p{i}", "text": f"{i}+1="} for i in range(3)])
  first = c.get("prompts", 2, lease_s=0.3)  # a worker leases two prompts and dies
  assert [x["id"] for x in first] == ["p0", "p1"]
  assert [x["id"] for x in c.get("prompts", 5)] == ["p2"]
  assert c.get("prompts", 5) == []
  time.sleep(0.4)
  again = c.get("prompts", 5, lease_s=60)
  assert sorted(x["id"] for x in again) == ["p0", "p1"] and again[0]["text"] in ("0+1=", "1+1=")
  assert c.requeue("prompts") == 3  # p0, p1 (60 s leases) and p2: all released at once
  assert sorted(x["id"] for x in c.get("prompts", 5, wait_s=0.0)) == ["p0", "p1", "p2"]
  # A draining worker hands back only its own leases; unknown or unleased ids are ignored.
  assert c.requeue("prompts", ["p1", "nope"]) == 1
  assert [x["id"] for x in c.get("prompts", 5)] == ["p1"]
  with pytest.raises(ValueError, match="ids"):
    c._request(ps.REQUEUE, {"queue": "prompts", "ids": "p1"})


def test_release_hands_items_back_with_new_contents_and_survives_a_restart(tmp_path):
  """A preempted worker hands its leased prompts back with their partial rollouts (Client.release): the stored
  item is replaced, re-issued first, and the replacement is what a restarted server serves."""
  srv = make_server(run_dir=str(tmp_path))
  c = client(srv)
  c.put("prompts", [{"id": f"p{i}", "prompt_tokens": np.arange(3, dtype=np.int32)} for i in range(4)])
  assert [x["id"] for x in c.get("prompts", 2, lease_s=60)] == ["p0", "p1"]
  c.ack("prompts", ["p1"])
  part = [np.array([7, 8], np.int32), np.array([9], np.int32)]
  got = c.release("prompts", [dict(id="p0", prompt_tokens=np.arange(3, dtype=np.int32), partial_tokens=part,
                                   partial_done=[False, True]),
                              dict(id="p1", prompt_tokens=np.arange(3, dtype=np.int32)),   # acked: not stored
                              dict(id="zz", prompt_tokens=np.arange(3, dtype=np.int32))])  # never put: not added
  assert got == {"released": 1, "unknown": ["p1", "zz"]}
  st = c.stats()["queues"]["prompts"]
  assert (st["ready"], st["leased"]) == (3, 0)

  def check(items):
    assert [x["id"] for x in items] == ["p0", "p2", "p3"]  # the released item first
    np.testing.assert_array_equal(items[0]["partial_tokens"][0], [7, 8])
    np.testing.assert_array_equal(items[0]["partial_tokens"][1], [9])
    assert items[0]["partial_done"] == [False, True] and "partial_tokens" not in items[1]

  check(c.get("prompts", 5, lease_s=60))
  srv.stop()
  srv = make_server(run_dir=str(tmp_path), port=srv.port)  # the UPDATE record was logged before it applied
  check(client(srv).get("prompts", 5, lease_s=60))
  with pytest.raises(ValueError, match="release must be a bool"):
    client(srv)._request(ps.PUT, {"queue": "prompts", "items": [], "release": "yes"})
  srv.stop()


def test_get_waits_for_items(server):
  c = client(server)
  t = later(0.3, lambda: client(server).put("q", [{"id": "late"}]))
  t0 = time.monotonic()
  assert [x["id"] for x in c.get("q", 1, wait_s=3.0)] == ["late"]
  assert 0.2 < time.monotonic() - t0 < 2.0
  t.join()


def test_back_pressure():
  srv = make_server(max_queue_items=3)
  try:
    c = client(srv)
    with pytest.raises(ps.QueueFullError, match="3 accepted.*2 rejected"):
      c.put("rollouts", [rollout(i) for i in range(5)])
    assert c.stats()["queues"]["rollouts"]["ready"] == 3
    # A blocked put gets through as soon as the consumer acks (room appears within wait_s).
    t = later(0.3, lambda: client(srv).ack("rollouts", [x["id"] for x in client(srv).get("rollouts", 2)]))
    t0 = time.monotonic()
    r = c.put("rollouts", [rollout(i) for i in range(5)], wait_s=3.0)  # retry of the same batch is safe
    assert r == {"accepted": 2, "duplicates": ["r0", "r1", "r2"]} and 0.2 < time.monotonic() - t0 < 2.5
    t.join()
  finally:
    srv.stop()


# ----------------------------------------------------------------------------------------------- persistence


def test_restart_in_process_keeps_queues(tmp_path):
  srv = make_server(run_dir=str(tmp_path))
  c = client(srv)
  publish(c, 4, weights(4, n=2, size=1000))
  c.put("rollouts", [rollout(i) for i in range(4)])
  c.get("rollouts", 3)
  c.ack("rollouts", ["r0"])
  srv.stop()
  with open(tmp_path / "queue-rollouts.log", "ab") as f:
    f.write(b"\x01garbage-from-a-torn-write")  # a crash mid-append must not break loading
  srv = make_server(run_dir=str(tmp_path), port=srv.port)
  try:
    assert c.latest_version() == -1  # weights live in memory only: the trainer re-publishes after a restart
    got = c.get("rollouts", 10)
    assert [x["id"] for x in got] == ["r1", "r2", "r3"]  # leases expired by the restart, acked r0 gone
    assert np.array_equal(got[0]["tokens"][0], np.arange(4))
    assert c.put("rollouts", [rollout(0)])["duplicates"] == ["r0"]
  finally:
    srv.stop()


def start_proc(tmp_path, port=0):
  port_file = tmp_path / "port"
  if port_file.exists():
    port_file.unlink()
  p = subprocess.Popen([sys.executable, os.path.join(ROOT, "param_server.py"), f"--port={port}",
                        f"--port_file={port_file}", f"--token_file={tmp_path / 'token'}",
                        f"--run_dir={tmp_path / 'run'}", "--header_timeout_s=2"],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  t0 = time.monotonic()
  while not port_file.exists():
    assert p.poll() is None and time.monotonic() - t0 < 30, "server process did not start"
    time.sleep(0.05)
  return p, int(port_file.read_text())


def test_exactly_once_across_kill_9(tmp_path):
  p, port = start_proc(tmp_path)
  try:
    token = ps.read_token(tmp_path / "token")  # created by the server on first start
    c = ps.Client(port=port, token=token, timeout_s=5.0, retries=40, backoff_s=0.05, max_backoff_s=0.3)
    c.put("rollouts", [rollout(i) for i in range(6)])
    leased = c.get("rollouts", 4)  # the trainer leases r0..r3, commits r0 and r1, then everything dies
    c.ack("rollouts", [x["id"] for x in leased[:2]])
    p.send_signal(signal.SIGKILL)
    p.wait()
    restarted = []

    def restart():
      time.sleep(0.5)
      restarted.append(start_proc(tmp_path, port)[0])

    restarter = threading.Thread(target=restart)
    restarter.start()
    c.requeue("rollouts")  # the restarted trainer's first call: blocks until the server is back
    got = c.get("rollouts", 10)
    assert sorted(x["id"] for x in got) == ["r2", "r3", "r4", "r5"]  # unacked redelivered, acked never
    c.ack("rollouts", [x["id"] for x in got])
    assert c.get("rollouts", 10) == [] and c.put("rollouts", [rollout(0)])["accepted"] == 0
    restarter.join()  # start_proc polls for the port file: the client may be served before it returns
    restarted[0].send_signal(signal.SIGTERM)
    assert restarted[0].wait(timeout=10) == 0
  finally:
    p.kill()


def test_flatten_unflatten_roundtrip_and_bad_keys():
  tree = {"embed": np.ones((2, 3), np.float32), "layers": {"wq": np.zeros((1, 2)), "norm": {"w": np.arange(3)}}}
  flat = ps.flatten(tree)
  assert sorted(flat) == ["embed", "layers/norm/w", "layers/wq"]
  back = ps.unflatten(flat)
  np.testing.assert_array_equal(back["layers"]["norm"]["w"], np.arange(3))
  assert back.keys() == tree.keys() and back["layers"].keys() == tree["layers"].keys()
  with pytest.raises(ValueError, match="without '/'"):
    ps.flatten({"a/b": np.zeros(1)})


# ----------------------------------------------------------------------------------------------- hostile input


@pytest.mark.parametrize("name,header", [
    ("NaN wait", b'{"wait_s":NaN}'), ("Infinity", b'{"wait_s":Infinity}'), ("overflowing float", b'{"wait_s":1e999}'),
    ("5000-digit int", b'{"newer_than":' + b"9" * 5000 + b"}"), ("deep nesting", b"[" * 5000 + b"]" * 5000),
    ("40 levels", b'{"a":' + b"[" * 40 + b"]" * 40 + b"}"),
])
def test_non_finite_huge_and_deep_headers_are_refused_for_every_type(server, name, header):
  for mtype in (ps.MANIFEST, ps.STATS, ps.GET):
    h, closed = raw_exchange(server, ps.PREFIX.pack(ps.MAGIC, 1, mtype, len(header), 0) + header, shut_wr=True)
    assert closed and h["code"] == "protocol", (name, h)
  assert_served(server)


def test_nan_or_string_durations_never_spin_the_server(server):
  c = client(server)
  for field in ("wait_s", "lease_s"):
    for bad in ("nan", "1", True, None):
      with pytest.raises(ValueError, match=field):
        c._request(ps.GET, {"queue": "q", "max_items": 1, field: bad})
  with pytest.raises(ValueError, match="wait_s"):
    c._request(ps.MANIFEST, {"newer_than": -1, "wait_s": "nan"})
  with pytest.raises(ValueError, match="lease_s"):
    c.get("q", 1, lease_s=1e9)  # above max_lease_s: refused, not clamped
  with pytest.raises(ValueError, match="field 'score'"):
    c.put("q", [{"id": "a", "score": float("nan")}])  # refused client-side, naming the field
  with pytest.raises(ValueError):
    c.manifest(wait_s=float("nan"))
  assert c.latest_version() == -1


def test_absurd_shapes_are_refused_before_they_poison_fetches(server):
  c = client(server)
  for shape, nbytes in (([1 << 32, 1 << 32], 0), ([1 << 62, 4], 0), ([1] * 33, 4), ([True, 4], 4), ([-1], 0)):
    h, _ = raw_exchange(server, frame(ps.STAGE, stage_header(0, dtype="float32", shape=shape, nbytes=nbytes,
                                                             token=TOKEN), bytes(nbytes)), shut_wr=True)
    assert h["code"] == "bad_request" and "shape" in h["error"] or "nbytes" in h["error"], (shape, h)
  assert c.staged()["versions"] == []
  publish(c, 0, weights(0))
  assert read(c)[0] == 0


def test_header_caps_before_and_after_authentication():
  srv = make_server(untrusted_header_kb=4.0, max_header_kb=64.0)
  try:
    big = {"version": 0, "pad": "x" * 8000}  # 8 KB: over the anonymous cap, under the authenticated one
    h, closed = raw_exchange(srv, frame(ps.STATS, big), shut_wr=True)
    assert closed and h["code"] == "protocol" and "4096" in h["error"], h
    for second, want in ((big, ps.OK), ({"pad": "x" * 70000}, ps.ERROR)):  # authenticated: up to 64 KiB
      s = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
      s.sendall(frame(ps.AUTH, {"token": TOKEN}) + frame(ps.STATS, second))
      f = s.makefile("rb")
      for mt in (ps.OK, want):
        _, _, mtype, hl, pl = ps.PREFIX.unpack(f.read(ps.PREFIX.size))
        h = json.loads(f.read(hl))
        f.read(pl)
        assert mtype == mt, h
      s.close()
    assert h["code"] == "protocol" and str(64 * 1024) in h["error"], h
  finally:
    srv.stop()


def test_unauthenticated_huge_announce_is_closed_at_once():
  srv = make_server(header_timeout_s=5.0, min_rate_mb_s=1.0)  # draining 2^34 B at 1 MB/s: 4.7 hours
  try:
    t0 = time.monotonic()
    h, closed = raw_exchange(srv, frame(ps.STAGE, {"version": 1}, plen=1 << 34))
    assert closed and h["code"] == "auth" and time.monotonic() - t0 < 1.0, h
    h, closed = raw_exchange(srv, frame(ps.PUT, {"queue": "q", "items": [], "token": "wrong"}, plen=1 << 20))
    assert closed and h["code"] == "auth", h
  finally:
    srv.stop()


# ----------------------------------------------------------------------------------------------- failed items


def test_failed_item_is_retried_then_quarantined_and_the_producer_told(tmp_path):
  srv = make_server(run_dir=str(tmp_path), max_failures=3)
  c = client(srv)
  c.put("prompts", [{"id": "bad", "n": 1}, {"id": "good", "n": 2}])
  order = []
  for k in range(3):
    got = c.get("prompts", 1)
    order.append(got[0]["id"])
    if got[0]["id"] == "good":
      c.ack("prompts", ["good"])
      got = c.get("prompts", 1)
    r = c.fail("prompts", ["bad"], f"ValueError: prompt too long (try {k})")
    assert r["quarantined"] == (["bad"] if k == 2 else []), r
  assert order[0] == "bad"
  assert c.get("prompts", 10) == []  # quarantined: never issued again
  assert c.fail("prompts", ["bad", "nope"], "again")["failed"] == []  # not leased: nothing to count
  assert c.put("prompts", [{"id": "bad"}])["duplicates"] == ["bad"]
  st = c.stats()["queues"]["prompts"]
  assert st["quarantined"] == 1 and st["ready"] == st["leased"] == 0
  notice = c.get("prompts.failed", 10)
  assert [(x["id"], x["queue"], x["failures"]) for x in notice] == [("bad", "prompts", 3)]
  assert "try 2" in notice[0]["reason"]
  srv.stop()
  srv = make_server(run_dir=str(tmp_path), max_failures=3)  # persisted: still quarantined, notice still there
  c = client(srv)
  assert c.stats()["queues"]["prompts"]["quarantined"] == 1 and c.get("prompts", 10) == []
  assert [x["id"] for x in c.get("prompts.failed", 10)] == ["bad"]
  c.put("prompts", [{"id": "flaky"}])
  c.get("prompts", 1)
  c.fail("prompts", ["flaky"], "once")
  srv.stop()
  srv = make_server(run_dir=str(tmp_path), max_failures=3)  # failure counts survive a restart too
  c = client(srv)
  for k in range(2):
    assert c.get("prompts", 1)[0]["id"] == "flaky"
    r = c.fail("prompts", ["flaky"], "again")
  assert r["quarantined"] == ["flaky"]
  srv.stop()


def test_storage_error_is_reported_as_such_and_nothing_changes(tmp_path, monkeypatch):
  import errno

  class FullDisk(ps._Disk):
    full = False

    def write(self, fd, data):
      if self.full:
        os.write(fd, bytes(data[:3]))  # a short write, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")
      super().write(fd, data)

  disk = FullDisk()
  monkeypatch.setattr(ps, "DISK", disk)
  srv = make_server(run_dir=str(tmp_path))
  c = client(srv)
  c.put("q", [{"id": "a"}])
  disk.full = True
  with pytest.raises(ps.StorageError, match="not stored"):
    c.put("q", [{"id": "b"}])
  with pytest.raises(ps.StorageError):
    c.ack("q", ["a"])
  assert c.stats()["queues"]["q"]["ready"] == 1  # b not stored, a not acked
  disk.full = False
  assert c.put("q", [{"id": "b"}]) == {"accepted": 1, "duplicates": []}  # never "duplicate"
  assert c.ack("q", ["a"])["acked"] == 1
  srv.stop()
  srv = make_server(run_dir=str(tmp_path))  # the torn bytes were cut off: the record after them survived
  assert [x["id"] for x in client(srv).get("q", 10)] == ["b"]
  srv.stop()


def test_a_newer_trainer_fences_the_older_one_also_across_a_server_restart(tmp_path):
  """One trainer per run, enforced by the server: after a second trainer registers, every request of the first
  (issue prompts, lease or ack rollouts, commit a manifest) is refused with FencedError and changes nothing; a
  worker (no epoch) is unaffected; the epoch survives a server restart (run_dir)."""
  cfg = ps.ServerConfig(token="t", run_dir=str(tmp_path / "srv"))
  srv = ps.Server(cfg).start()
  try:
    old, new, worker = (ps.Client(port=srv.port, token="t", timeout_s=5.0) for _ in range(3))
    assert old.register_trainer() == 1
    old.put("prompts", [dict(id="p0", x=1)])
    worker.put("rollouts", [dict(id="r0", x=1)])
    assert new.register_trainer() == 2
    for call in (lambda: old.put("prompts", [dict(id="p1", x=1)]), lambda: old.get("rollouts", 1),
                 lambda: old.ack("rollouts", ["r0"]), lambda: old.requeue("rollouts"),
                 lambda: old.commit(dict(version=0, servers=[], tensors={}))):
      with pytest.raises(ps.FencedError, match="trainer epoch 2 registered since"):
        call()
    assert [it["id"] for it in worker.get("prompts", 10)] == ["p0"]  # p1 was never stored
    assert [it["id"] for it in new.get("rollouts", 10)] == ["r0"]  # the fenced get leased nothing
    new.ack("rollouts", ["r0"])
  finally:
    srv.stop()
  srv = ps.Server(cfg).start()
  try:
    old.port = new.port = srv.port
    with pytest.raises(ps.FencedError):
      old.put("prompts", [dict(id="p2", x=1)])
    new.put("prompts", [dict(id="p3", x=1)])
  finally:
    srv.stop()
