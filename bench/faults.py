"""Fault bench for param_server.py: queue durability at every crash point and under disk faults, and legitimate
latency beside hostile load. Prints RESULTS.md's server/queue fault table (fault -> what happens, measured).

Queue faults: a real server process whose queue-log file operations go through a FaultDisk (param_server.DISK):
  kill@P#n     the process SIGKILLs itself at the n-th pass through crash point P (append, appended, synced,
               compact_tmp, compact_renamed: see param_server._Disk), i.e. a kill -9 exactly there;
  enospc@write#n  the n-th write is short (half written) and then fails with ENOSPC (the disk filled up);
  eio@fsync#n, eio@truncate#n, eio@replace#n   that call fails with EIO.
  One workload (puts, a lease, acks, a FAIL, more puts) runs until the server dies or finishes; refused
  requests are retried once "space is freed"; then the server is killed -9 and restarted clean, and the queue is
  checked: lost = acknowledged puts not acked yet but missing, resurrected = acknowledged acks whose item came
  back, phantom = items never put, and a put that was in flight when the server died must be reported
  accepted on retry exactly when it is absent (never "duplicate" for an item that is not there).
Hostile load: a real `python param_server.py` process (defaults, token file, run dir) with a trainer client
  (publish: stage + commit) and a worker client (fetch: manifest + param_server.pull_slices; put/get/ack);
  each op is timed alone and beside each load; the server's RSS is sampled every 50 ms (peak reported) and its
  CPU use measured during and after the load.

Run:
  python -m bench.faults                      # everything, prints both tables (markdown)
  python -m bench.faults --quick              # the CI-sized version (tests/test_faults.py calls the functions)
  python -m bench.faults --serve --run_dir=D --port_file=F --faults=SPEC   # one fault-injecting server
"""
import argparse
import errno
import json
import os
import signal
import socket
import tempfile
import threading
import time

import numpy as np

from bench import util as benchutil
import param_server as ps

TOKEN = "bench-faults-token"
OPS = ("publish", "fetch", "put", "get", "ack", "join")  # join: a new client connects, authenticates, asks once
CRASH_POINTS = ("append", "appended", "synced", "compact_tmp", "compact_renamed")


def parse_faults(spec):
  """"action@op#n[-m],..." -> [(action, op, n, m)]."""
  rules = []
  for part in filter(None, spec.split(",")):
    action, rest = part.split("@")
    op, nums = rest.split("#")
    lo, _, hi = nums.partition("-")
    rules.append((action, op, int(lo), int(hi or lo)))
  return rules


class FaultDisk(ps._Disk):
  """_Disk whose n-th call of an operation fails or kills the process, from a spec "action@op#n[-m],...".
  Counts are per op name (write counts compaction writes too)."""

  def __init__(self, spec):
    self.rules, self.counts = parse_faults(spec), {}

  def _fire(self, op, before=None):
    """If a rule matches this call of op: before() (if given), then kill -9 the process or raise ENOSPC / EIO."""
    n = self.counts[op] = self.counts.get(op, 0) + 1
    action = next((action for action, rop, lo, hi in self.rules if rop == op and lo <= n <= hi), None)
    if not action:
      return
    if before:
      before()
    if action == "kill":
      os.kill(os.getpid(), signal.SIGKILL)
    code = {"enospc": errno.ENOSPC, "eio": errno.EIO}[action]
    raise OSError(code, f"{os.strerror(code)} (injected at {op})")

  def write(self, fd, data):
    # A short write first, as a filling disk does.
    self._fire("write", before=lambda: os.write(fd, memoryview(data)[:len(data) // 2]))
    super().write(fd, data)

  def fsync(self, fd):
    self._fire("fsync")
    super().fsync(fd)

  def truncate(self, fd, size):
    self._fire("truncate")
    super().truncate(fd, size)

  def replace(self, src, dst):
    self._fire("replace")
    super().replace(src, dst)

  def point(self, name):
    self._fire(name)


def serve_main(args):
  ps.DISK = FaultDisk(args.faults)
  # compact_min_mb=0 with tiny items: every change is followed by a compaction, so each crash point is reached
  # while items are leased.
  cfg = ps.ServerConfig(token=TOKEN, run_dir=args.run_dir, compact_min_mb=0.0, header_timeout_s=2.0,
                        max_failures=args.max_failures)
  ps.serve(cfg, port_file=args.port_file)


def _start_fault_server(run_dir, faults=""):
  return benchutil.start_server(run_dir + ".port", "--serve", f"--run_dir={run_dir}", f"--faults={faults}",
                                script=("-m", "bench.faults"), log=run_dir + ".log")


def _item(i):
  return {"id": i, "x": np.arange(4, dtype=np.int8)}


WORKLOAD = [("put", ["i0"]), ("put", ["i1", "i2"]), ("put", ["i3"]), ("get", 3), ("ack", ["i0"]), ("put", ["i4"]),
            ("fail", ["i2"]), ("ack", ["i1", "i3"]), ("put", ["i5"]), ("ack", ["i4"]), ("put", ["i6"])]


def queue_scenario(faults, workdir):
  """Runs WORKLOAD against a server with `faults`, retries what was refused, kill -9, restart, checks."""
  run_dir = tempfile.mkdtemp(dir=workdir)
  p, port = _start_fault_server(run_dir, faults)
  put_try, put_ok, ack_ok, refused, in_flight, storage_errors = set(), set(), set(), [], None, 0
  c = ps.Client(port=port, token=TOKEN, timeout_s=5.0, retries=0)

  def run(op, arg):
    if op == "put":
      put_try.update(arg)
      r = c.put("q", [_item(i) for i in arg])
      assert not r["duplicates"], (faults, op, arg, r)  # every put in WORKLOAD is new
      put_ok.update(arg)
    elif op == "get":
      c.get("q", arg, lease_s=600.0)
    elif op == "ack":
      ack_ok.update(set(arg) - set(c.ack("q", arg)["unknown"]))  # an ack of an id never stored acks nothing
    elif op == "fail":
      c.fail("q", arg, "bench")

  try:
    for op, arg in WORKLOAD:
      try:
        run(op, arg)
      except ps.StorageError:
        storage_errors += 1
        refused.append((op, arg))
      except (ConnectionError, OSError):
        in_flight = (op, arg)  # the server died (kill point reached) during this request
        break
    if in_flight is None:
      for op, arg in refused:  # "space freed": what was refused must now go through, never as a duplicate
        run(op, arg)
  finally:
    c.close()
    p.send_signal(signal.SIGKILL)
    p.wait()
  # An ack in flight when the server died may or may not have landed (its reply never came): either is fine.
  maybe_acked = set(in_flight[1]) if in_flight and in_flight[0] == "ack" else set()
  p, port = _start_fault_server(run_dir)
  try:
    c = ps.Client(port=port, token=TOKEN, timeout_s=5.0, retries=5)
    present = {x["id"] for x in c.get("q", 1000)}
    consistent = True
    if in_flight and in_flight[0] == "put":  # retried after the restart: reported as it really is
      r = c.put("q", [_item(i) for i in in_flight[1]])
      consistent = set(r["duplicates"]) == set(in_flight[1]) & present
    c.close()
  finally:
    p.send_signal(signal.SIGTERM)
    p.wait(timeout=10)
  return dict(faults=faults, died_in=in_flight and in_flight[0], storage_errors=storage_errors,
              lost=sorted((put_ok - ack_ok - maybe_acked) - present), resurrected=sorted(present & ack_ok),
              phantom=sorted(present - put_try), retry_consistent=consistent)


def queue_faults(workdir, quick=False):
  specs = [f"kill@{pt}#{n}" for pt in CRASH_POINTS
           for n in ((2,) if quick else (1, 2, 4, 7, 10) if pt.startswith(("app", "sync")) else (1, 2))]
  specs += ["enospc@write#2", "enospc@write#3-6", "enospc@write#4,eio@truncate#1", "eio@fsync#3",
            "eio@replace#2", "enospc@write#3,kill@compact_renamed#2"]
  return [queue_scenario(s, workdir) for s in specs]


def _rss_mib(pid):
  with open(f"/proc/{pid}/status") as f:
    for line in f:
      if line.startswith("VmRSS:"):
        return int(line.split()[1]) / 1024
  return 0.0


def _cpu_s(pid):
  with open(f"/proc/{pid}/stat") as f:
    parts = f.read().rsplit(")", 1)[1].split()
  return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


def _frame(mtype, header_bytes, plen=0):
  return ps.PREFIX.pack(ps.MAGIC, ps.PROTOCOL_VERSION, mtype, len(header_bytes), plen) + header_bytes


class Load:
  """A hostile load: `conns` sockets held open (with an optional per-socket opener) plus `flood` threads that
  each loop connect -> send -> read until closed. stop() closes everything."""

  def __init__(self, port, conns=0, opener=b"", trickle=False, flood=None, flood_threads=4):
    self.port, self.socks, self.stop_ev, self.threads, self.sent = port, [], threading.Event(), [], 0
    for _ in range(conns):
      try:
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        if opener:
          s.sendall(opener)
        self.socks.append(s)
      except OSError:
        pass
    if trickle:
      self.threads.append(threading.Thread(target=self._trickle, daemon=True))
    for _ in range(flood_threads if flood else 0):
      self.threads.append(threading.Thread(target=self._flood, args=(flood,), daemon=True))
    for t in self.threads:
      t.start()

  def _trickle(self):  # slowloris: one more byte per connection every 0.5 s
    while not self.stop_ev.wait(0.5):
      for s in list(self.socks):
        try:
          s.send(b"\x00")
        except OSError:
          pass

  def _flood(self, data):
    while not self.stop_ev.is_set():
      try:
        with socket.create_connection(("127.0.0.1", self.port), timeout=2) as s:
          s.sendall(data)
          self.sent += 1
          while s.recv(65536):
            pass
      except OSError:
        pass

  def stop(self):
    self.stop_ev.set()
    for t in self.threads:
      t.join()
    for s in self.socks:
      s.close()


def hostile_load(n_conns=1000, reps=20, size_mb=4.0, workdir=None, max_clients=None, server_flags=()):
  """Returns rows {load, op -> (p50 ms, max ms), rss_peak_mib, cpu_pct, cpu_after_pct}; rows[0]["inputs"] is
  bad_inputs(). max_clients: the server's --max_clients (default: its own); one load holds 1.5 x n_conns to go
  past it. server_flags: more param_server.py flags (the defaults otherwise)."""
  workdir = workdir or tempfile.mkdtemp()
  token_file = os.path.join(workdir, "token")
  p, port = benchutil.start_server(os.path.join(workdir, "port"), "--port=0", f"--token_file={token_file}",
                                   f"--run_dir={os.path.join(workdir, 'run')}",
                                   *([f"--max_clients={max_clients}"] if max_clients else []), *server_flags,
                                   log=os.path.join(workdir, "server.log"))
  token = ps.read_token(token_file)
  trainer = ps.Client(port=port, token=token, timeout_s=10.0)
  worker = ps.Client(port=port, token=token, timeout_s=10.0)
  elems = int(size_mb * (1 << 20)) // 4
  w, version, clients = np.ones(elems, np.float32), [0], {f"127.0.0.1:{port}": worker}

  def publish(v):  # train.publish_shards for one trainer process, without jax: one piece, then the manifest
    trainer.stage(v, v, "w", [[0, elems]], w)
    (piece,) = trainer.staged(v, v)["pieces"]
    trainer.staged(keep=trainer.commit(dict(version=v, servers=list(clients), tensors={"w": dict(
        dtype="float32", shape=[elems], pieces=[dict(index=piece["index"], crc=piece["crc"], server=0)])})))

  def fetch(newer_than):  # what a worker does (rollout.pull_weights without the device copies)
    m = worker.manifest(newer_than=newer_than)
    return m["version"], {name: bufs for name, bufs, _ in ps.pull_slices(m, {"w": [((0, elems),)]}, clients)}

  publish(0)

  def join():  # a worker (re)joining: new connection, AUTH, first request
    fresh = ps.Client(port=port, token=token, timeout_s=10.0)
    fresh.latest_version()
    fresh.close()

  def legit_round(times):
    def timed(op, fn, *args, **kw):
      t = time.perf_counter()
      out = fn(*args, **kw)
      times[op].append(time.perf_counter() - t)
      return out

    version[0] += 1
    timed("publish", publish, version[0])
    got = timed("fetch", fetch, version[0] - 1)
    assert got[0] == version[0] and got[1]["w"][((0, elems),)].sum() == elems
    rid = f"r{version[0]}"
    timed("put", worker.put, "rollouts", [{"id": rid, "tokens": np.arange(1024, dtype=np.int32)}])
    assert [x["id"] for x in timed("get", trainer.get, "rollouts", 1)] == [rid]
    timed("ack", trainer.ack, "rollouts", [rid])
    timed("join", join)

  def measure(name, make_load):
    peak, done = [_rss_mib(p.pid)], threading.Event()

    def sample():
      while not done.wait(0.05):
        peak.append(_rss_mib(p.pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    c0, t0 = _cpu_s(p.pid), time.monotonic()
    load = make_load() if make_load else None
    times = {k: [] for k in OPS}
    for _ in range(reps):
      legit_round(times)
    cpu = (_cpu_s(p.pid) - c0) / (time.monotonic() - t0)
    if load:
      load.stop()
    done.set()
    sampler.join()
    time.sleep(2.0)  # let the closed connections' threads finish (~1 s for 1000), then: nothing may spin (NaN did)
    c1 = _cpu_s(p.pid)
    time.sleep(1.0)
    after = _cpu_s(p.pid) - c1
    return {"load": name, "rss_peak_mib": max(peak), "cpu_pct": 100 * cpu, "cpu_after_pct": 100 * after,
            **{k: (1e3 * float(np.median(v)), 1e3 * max(v)) for k, v in times.items()}}

  n = n_conns
  big = json.dumps({"a": [{}] * 20000}).encode()  # ~80 KB of many small objects: refused by the pre-auth cap
  big_ok = json.dumps({"a": [{}] * 15000}).encode()  # ~60 KB: under the cap, parsed, then refused (no token)
  deep = b"[" * 60000
  loads = [
      ("none (baseline)", None),
      (f"{n} idle connections", lambda: Load(port, conns=n)),
      (f"{n * 3 // 2} idle connections (over --max_clients={max_clients or ps.ServerConfig.max_clients}: "
       "oldest anonymous evicted)", lambda: Load(port, conns=n * 3 // 2)),
      (f"{n} slowloris (1 byte / 0.5 s)", lambda: Load(port, conns=n, opener=b"RL", trickle=True)),
      (f"{n} STAGE announcing 2^34 B, no token", lambda: Load(port, conns=n, opener=_frame(
          ps.STAGE, b'{"version":1}', plen=1 << 34))),
      ("header announcing 16 MiB, flood", lambda: Load(port, flood=ps.PREFIX.pack(
          ps.MAGIC, ps.PROTOCOL_VERSION, ps.STAGE, 16 << 20, 0) + b"{")),
      ("60 KB header of {} objects, flood", lambda: Load(port, flood=_frame(ps.STAGE, big_ok))),
      ("80 KB header (over the pre-auth cap), flood", lambda: Load(port, flood=_frame(ps.STAGE, big))),
      ("60 KB-deep JSON nesting, flood", lambda: Load(port, flood=_frame(ps.STATS, deep))),
      ("MANIFEST / GET with wait_s NaN, flood", lambda: Load(port, flood=_frame(ps.MANIFEST, b'{"wait_s":NaN}')
                                                              + _frame(ps.GET, b'{"queue":"q","wait_s":NaN}'))),
      (f"all of the above at once ({n} held)", lambda: _all(port, n, big, deep)),
  ]
  try:
    rows = [measure(name, mk) for name, mk in loads]
    rows[0]["rss_after_mib"] = _rss_mib(p.pid)
    rows[0]["inputs"] = bad_inputs(port, token)
  finally:
    trainer.close()
    worker.close()
    p.send_signal(signal.SIGTERM)
    p.wait(timeout=20)
  return rows


def bad_inputs(port, token):
  """Sends each hostile or malformed request once on a fresh connection; returns rows {input, reply,
  closed, ms} (reply: the ERROR code, or "ok"; closed: whether the server closed the connection after it)."""
  auth = _frame(ps.AUTH, json.dumps({"token": token}).encode())
  shape = {"version": 99, "nonce": 0, "name": "x", "index": [[0, 1 << 32]] * 2, "dtype": "float32",
           "shape": [1 << 32, 1 << 32], "nbytes": 0, "crc": 0}
  cases = [
      ("MANIFEST with wait_s NaN", _frame(ps.MANIFEST, b'{"wait_s":NaN}')),
      ('MANIFEST with wait_s "nan" (a string)', _frame(ps.MANIFEST, b'{"wait_s":"nan"}')),
      ("GET with lease_s 1e999 (overflows to inf)", auth + _frame(ps.GET, b'{"queue":"q","max_items":1,'
                                                                          b'"lease_s":1e999}')),
      ("STAGE without token announcing 2^34 B", _frame(ps.STAGE, b'{"version":1}', plen=1 << 34)),
      ("PUT with a wrong token and a 1 MiB payload", _frame(ps.PUT, b'{"queue":"q","items":[],"token":"x"}',
                                                            plen=1 << 20)),
      ("GET without token", _frame(ps.GET, b'{"queue":"q","max_items":1}')),
      ("header announcing 16 MiB", ps.PREFIX.pack(ps.MAGIC, ps.PROTOCOL_VERSION, ps.STATS, 16 << 20, 0)),
      ("80 KB header before AUTH", _frame(ps.STATS, json.dumps({"a": "x" * 80000}).encode())),
      ("JSON nested 5000 deep", _frame(ps.STATS, b"[" * 5000 + b"]" * 5000)),
      ("5000-digit int", _frame(ps.MANIFEST, b'{"newer_than":' + b"9" * 5000 + b"}")),
      ("shape [2^32, 2^32] with nbytes 0 (authenticated)", auth + _frame(ps.STAGE, json.dumps(shape).encode())),
      ("unknown message type 200", _frame(200, b"{}")),
      ("wrong magic", b"GET / HTTP/1.1\r\n\r\n" + bytes(20)),
      ("prefix, then silence (slowloris)", _frame(ps.STATS, b"{}")[:10]),
  ]
  rows = []
  for name, data in cases:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s, s.makefile("rb") as f:
      t0 = time.monotonic()
      s.sendall(data)
      if data.startswith(auth):
        _, _, _, hl, pl = ps.PREFIX.unpack(f.read(ps.PREFIX.size))
        f.read(hl + pl)  # the AUTH reply
      pre, reply, closed = f.read(ps.PREFIX.size), "-", True
      ms = 1e3 * (time.monotonic() - t0)
      if len(pre) == ps.PREFIX.size:
        _, _, mt, hl, pl = ps.PREFIX.unpack(pre)
        h = json.loads(f.read(hl))
        f.read(pl)
        reply = h.get("code", "?") if mt == ps.ERROR else "ok"
        s.settimeout(0.5)  # the reply is in; does the server close the connection?
        try:
          closed = f.read(1) == b""
        except (socket.timeout, OSError):
          closed = False
    rows.append({"input": name, "reply": reply, "closed": closed, "ms": ms})
  return rows


def inputs_table(rows):
  lines = ["| hostile / malformed request | server reply | connection | time to reply (ms) |", "|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['input']} | {r['reply']} | {'closed' if r['closed'] else 'kept'} | {r['ms']:.0f} |")
  return "\n".join(lines)


class _Multi(list):
  def stop(self):
    for x in self:
      x.stop()


def _all(port, n, big, deep):
  k = n // 3
  return _Multi([Load(port, conns=k), Load(port, conns=k, opener=b"RL", trickle=True),
                 Load(port, conns=n - 2 * k, opener=_frame(ps.STAGE, b'{"version":1}', plen=1 << 34)),
                 Load(port, flood=_frame(ps.STAGE, big), flood_threads=1),
                 Load(port, flood=_frame(ps.STATS, deep), flood_threads=1),
                 Load(port, flood=_frame(ps.MANIFEST, b'{"wait_s":NaN}'), flood_threads=1)])


def describe(r):
  what = {"kill": "kill -9 at", "enospc": "ENOSPC (short write) at", "eio": "EIO at"}
  return "; ".join(f"{what[action]} {op} #{lo}" + (f"-{hi}" if hi != lo else "")
                   for action, op, lo, hi in parse_faults(r["faults"]))


def queue_table(results):
  lines = ["| queue fault (server process) | died in | refused (StorageError) | lost | acked came back | "
           "phantom | retried put reported truly |", "|---|---|---|---|---|---|---|"]
  for r in results:
    died = r["died_in"] or ("not reached" if "kill@" in r["faults"] else "-")
    lines.append(f"| {describe(r)} | {died} | {r['storage_errors']} | {len(r['lost'])} | "
                 f"{len(r['resurrected'])} | {len(r['phantom'])} | {'yes' if r['retry_consistent'] else 'NO'} |")
  return "\n".join(lines)


def hostile_table(rows):
  lines = ["| load beside a trainer + a worker | " + " | ".join(f"{o} p50/max ms" for o in OPS)
           + " | server RSS peak MiB | server CPU % during / after |",
           "|---|" + "---|" * len(OPS) + "---|---|"]
  for r in rows:
    lines.append(f"| {r['load']} | " + " | ".join(f"{r[o][0]:.1f} / {r[o][1]:.1f}" for o in OPS)
                 + f" | {r['rss_peak_mib']:.0f} | {r['cpu_pct']:.0f} / {r['cpu_after_pct']:.0f} |")
  return "\n".join(lines)


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--serve", action="store_true", help="run one fault-injecting server (internal)")
  ap.add_argument("--run_dir", help="--serve: queue directory")
  ap.add_argument("--port_file", help="--serve: where the bound port is written")
  ap.add_argument("--faults", default="", help="--serve: fault spec, e.g. kill@compact_tmp#2,enospc@write#3")
  ap.add_argument("--max_failures", type=int, default=3, help="--serve: FAIL reports before quarantine (3)")
  ap.add_argument("--quick", action="store_true", help="CI-sized: fewer crash occurrences, 200 connections")
  ap.add_argument("--conns", type=int, default=1000, help="hostile connections held open (default 1000)")
  ap.add_argument("--reps", type=int, default=20, help="legitimate rounds timed per load (default 20)")
  ap.add_argument("--size_mb", type=float, default=4.0, help="weights published/fetched per round (MiB, default 4)")
  args = ap.parse_args()
  if args.serve:
    return serve_main(args)
  with tempfile.TemporaryDirectory() as d:
    t = time.time()
    q = queue_faults(d, quick=args.quick)
    print(queue_table(q))
    print(f"({len(q)} scenarios in {time.time() - t:.0f} s)\n", flush=True)
    rows = hostile_load(200 if args.quick else args.conns, 5 if args.quick else args.reps, args.size_mb,
                        workdir=d)
    print(hostile_table(rows), end="\n\n")
    print(inputs_table(rows[0]["inputs"]))
    print(f"(server RSS after the baseline: {rows[0]['rss_after_mib']:.0f} MiB)")


if __name__ == "__main__":
  main()
