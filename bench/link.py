"""Weight sync across a real, rate-limited link, and the pod-scale model it checks (issue 41 item 4).

Two network namespaces made by this bench (as root: `ip netns`, a veth pair, `tc tbf` on both ends at --mbit),
a param_server.py and the publisher in one, --workers pulling processes in the other, so every weight byte crosses
the shaped link; the namespaces are removed at the end, whatever happens, and every child has a deadline.
Traffic only between the two namespaces (and each one's loopback).

1. Inputs measured here. Over the server namespace's loopback (no shaping): the serving rate of one shard server
   to --workers concurrent full pulls, 8 each (aggregate wall rate, and bytes per second of the server's own CPU
   time, read from /proc: what one core of it serves; and each puller's, bytes received per core-second, crc
   checks included), and the loopback delta sync (commit to the last worker's apply). In this process, on the
   same synthetic weights: the server's delta build (param_server.delta_encode + the payload crc, bytes of the
   version per core-second) and a worker's decode (crc check + delta_decode, payload bytes per core-second), each
   on 1 thread and on 2 threads (distinct tensors: how they scale over cores).
2. The link: a version of --model_mb (bf16) published, pulled in full by every worker at once, then the next
   version, differing in --changed of its elements, pulled as a delta. Measured beside the model's prediction:
   full = max(W M / link, W M / serve), delta = W M d / link + the loopback delta sync (d: delta bytes / full).
3. The projection (labelled so, not a measurement): QwQ-32B in bf16 on a v5p-512 trainer, hosts from launch.sh's
   TPU table, one shard server per host, 128 workers each holding the whole model, 25 GB/s per v5p host (the issue's
   figure from the Cloud TPU docs: 200 Gbit/s), the rates from 1., the delta fraction from RESULTS.md "Delta weight
   sync" (bench.sharded --delta: 125M params, bf16, lr 1e-6). Full sync: every worker's bytes through one server
   process per host, each worker receiving the whole model. Delta sync, its steps summed (no overlap assumed):
   each server builds its shard's delta, serves it to every worker, each worker decodes the whole model's payload
   (the patches' device scatter is left out: an HBM-local pass, milliseconds at the docs' 2,765 GB/s per v5p chip,
   not measured here). Each is printed with --cores cores per role and with 1 (throughput assumed linear in cores:
   1. measures it on 2), with the cores each goal needs beside a v5p host's 208 vCPUs (the docs), and the
   bottleneck named.

  sudo python -m bench.link                                     # 64 MiB model, 2 workers, 400 Mbit/s (~15 s)
  sudo python -m bench.link --model_mb=8 --workers=2 --mbit=200    (the test's size)
"""
import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

from bench.util import ROOT

TOKEN = "link-bench"
# delta bytes / full bytes of bench.sharded --delta, v0->v1 .. v3->v4 (RESULTS.md "Delta weight sync"): mean 1.60%
MEASURED_DELTA_FRAC = (0.0225 + 0.0161 + 0.0135 + 0.0120) / 4
V5P_HOST_BYTES_S = 25e9  # 200 Gbit/s per v5p host (issue 41, from the Cloud TPU docs)
V5P_VCPUS = 208  # per v5p host, a 4-chip VM (cloud.google.com/tpu/docs/v5p; tests/tpu_types.json)

PUBLISH = """
import json, sys, time
import numpy as np, ml_dtypes, param_server as ps
addr, mb, changed, go = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
c = ps.connect(addr, token=%r)
rng = np.random.default_rng(0)
n = int(mb * 2**20 / 2 / 8)
ws = [rng.standard_normal(n, np.float32).astype(ml_dtypes.bfloat16) for _ in range(8)]  # 8 tensors
def publish(v):
  tensors = {}
  for i, w in enumerate(ws):
    c.stage(v, v, f"w{i}", [[0, n]], w)
  pieces = {p["name"]: p for p in c.staged(v, v)["pieces"]}
  c.commit(dict(version=v, servers=[addr], tensors={f"w{i}": dict(dtype="bfloat16", shape=[n], pieces=[dict(
      index=[[0, n]], crc=pieces[f"w{i}"]["crc"], server=0)]) for i in range(8)}))
publish(0)
print("V0", flush=True)
while not __import__("os").path.exists(go):  # the pullers hold v0: now the next version
  time.sleep(0.05)
for w in ws:
  idx = rng.choice(n, int(changed * n), replace=False)
  w[idx] = (w[idx].astype(np.float32) * np.float32(1.01)).astype(ml_dtypes.bfloat16)
t = time.time()
publish(1)
print("V1", t, flush=True)
""" % TOKEN

PULL = """
import json, sys, time
import common, ml_dtypes, numpy as np, param_server as ps  # (imported before the clock starts)
common.tune_malloc()  # as rollout.py's worker does
addr, out, reps = sys.argv[1], sys.argv[2], int(sys.argv[3])
c, clients = ps.connect(addr, token=%r), {}
m0 = c.manifest(wait_s=60)
want = {k: [tuple((0, d) for d in t["shape"])] for k, t in m0["tensors"].items()}
t0, c0 = time.time(), time.process_time(); st = {}
for _ in range(reps):  # (repeated: enough bytes for the server's CPU time, read in clock ticks)
  held = {name: bufs for name, bufs, _ in ps.pull_slices(m0, want, clients, stats=st, token=%r)}
r = dict(full_start=t0, full_end=time.time(), full_bytes=reps * st["bytes"], full_cpu=time.process_time() - c0)
open(out + ".held", "w").close()
m1 = c.manifest(newer_than=0, wait_s=120)
t1 = time.time(); st = {}
for name, _, patches in ps.pull_slices(m1, want, clients, base=m0, held=lambda n, s: s, stats=st, token=%r):
  for w, ps_ in patches.items():  # applied on the host here (the worker applies them on its devices)
    for p in ps_:
      ps.apply_patch(held[name][w], *p)
r.update(delta_start=t1, delta_end=time.time(), delta_bytes=st["bytes"], delta_full_bytes=st["full_bytes"])
json.dump(r, open(out, "w"))
""" % (TOKEN, TOKEN, TOKEN)


def sh(*cmd, ns=None):
  return subprocess.run((["ip", "netns", "exec", ns] if ns else []) + list(cmd), check=True, capture_output=True,
                        text=True, timeout=30).stdout


@contextlib.contextmanager
def link(mbit):
  """Namespaces <tag>a (10.77.0.1) and <tag>b (10.77.0.2) joined by a veth pair shaped to mbit each way."""
  tag = f"rlxl{os.getpid() % 100000}"
  a, b = tag + "a", tag + "b"
  try:
    for ns in (a, b):
      sh("ip", "netns", "add", ns)
      sh("ip", "link", "set", "lo", "up", ns=ns)
    sh("ip", "link", "add", a, "netns", a, "type", "veth", "peer", "name", b, "netns", b)
    for ns, ip in ((a, "10.77.0.1"), (b, "10.77.0.2")):
      sh("ip", "addr", "add", f"{ip}/24", "dev", ns, ns=ns)
      sh("ip", "link", "set", ns, "up", ns=ns)
      if mbit:  # token bucket: rate mbit, a burst of ~4 ms of it
        sh("tc", "qdisc", "add", "dev", ns, "root", "tbf", "rate", f"{mbit}mbit", "burst",
           str(max(32768, int(mbit * 1e6 / 8 * 0.004))), "latency", "100ms", ns=ns)
    yield a, b
  finally:
    for ns in (a, b):
      subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def run_sync(ns_srv, ns_wrk, srv_ip, model_mb, changed, workers, tmp, reps=1):
  """Server + publisher in ns_srv, `workers` pullers in ns_wrk, each pulling v0 in full `reps` times, then v1 as a
  delta: (their JSON records, the publisher's v1 time, the server's CPU seconds during the full pulls)."""
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  port_file, token_file, go = (os.path.join(tmp, f) for f in ("port", "token", "go"))
  for f in (port_file, go):
    if os.path.exists(f):
      os.remove(f)
  open(token_file, "w").write(TOKEN + "\n")
  ex = lambda ns, *cmd, **kw: subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, *cmd], cwd=ROOT, env=env,  # noqa: E731
                                               **kw)
  server = ex(ns_srv, "param_server.py", f"--host={srv_ip}", "--port=0", f"--port_file={port_file}",
              f"--token_file={token_file}", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  procs = [server]
  try:
    t0 = time.monotonic()
    while not os.path.exists(port_file):
      assert server.poll() is None and time.monotonic() - t0 < 30, "param_server.py did not start"
      time.sleep(0.05)
    addr = f"{srv_ip}:{int(open(port_file).read())}"
    pub = ex(ns_srv, "-c", PUBLISH, addr, str(model_mb), str(changed), go, stdout=subprocess.PIPE, text=True)
    procs.append(pub)
    assert pub.stdout.readline().startswith("V0")
    cpu0 = cpu_s(server.pid)
    outs = [os.path.join(tmp, f"pull{i}.json") for i in range(workers)]
    for o in outs:
      for f in (o, o + ".held"):
        if os.path.exists(f):
          os.remove(f)
    procs += [ex(ns_wrk, "-c", PULL, addr, o, str(reps)) for o in outs]
    end = time.monotonic() + 600
    while not all(os.path.exists(o + ".held") for o in outs):
      assert time.monotonic() < end and all(p.poll() in (None, 0) for p in procs[2:]), "a puller failed"
      time.sleep(0.05)
    serve_cpu = cpu_s(server.pid) - cpu0  # the full pulls' (the manifest requests are negligible)
    open(go, "w").close()
    t_commit = float(pub.stdout.readline().split()[1])
    for p in procs[2:]:
      assert p.wait(timeout=600) == 0, "a puller failed"
    return [json.load(open(o)) for o in outs], t_commit, serve_cpu
  finally:
    for p in procs:
      p.kill()
      p.wait()


def cpu_s(pid):
  """User + system CPU seconds of process pid so far (/proc/PID/stat fields 14-15, in clock ticks)."""
  f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
  return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def codec_rates(mb, changed, threads):
  """(build, decode): the server's delta build (delta_encode + the payload's crc) in version bytes per second and
  a worker's decode (crc check + delta_decode) in payload bytes per second, on `threads` threads each working on its
  own tensor of mb/8 MiB (the bench's weights, `changed` of them scaled by 1.01 as PUBLISH does); best of 3."""
  import concurrent.futures
  import zlib
  import ml_dtypes
  import numpy as np
  import param_server as ps
  rng = np.random.default_rng(1)
  n = int(mb * 2**20 / 2 / 8)
  olds = [rng.standard_normal(n, np.float32).astype(ml_dtypes.bfloat16) for _ in range(threads)]
  news = [w.copy() for w in olds]
  for w in news:
    idx = rng.choice(n, int(changed * n), replace=False)
    w[idx] = (w[idx].astype(np.float32) * np.float32(1.01)).astype(ml_dtypes.bfloat16)

  def build(i):
    enc, data, _ = ps.delta_encode(news[i].view(np.uint8), olds[i].view(np.uint8), 2)
    zlib.crc32(data)
    return enc, data

  encs = [build(i) for i in range(threads)]

  def decode(i):
    zlib.crc32(encs[i][1])
    ps.delta_decode(*encs[i], n, 2)

  def best(f):
    ts = []
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
      for _ in range(3):
        t = time.perf_counter()
        list(pool.map(f, range(threads)))
        ts.append(time.perf_counter() - t)
    return min(ts)

  tb, td = best(build), best(decode)
  return threads * n * 2 / tb, sum(len(e[1]) for e in encs) / td


def v5p_hosts(cores):
  """Trainer hosts of v5p-<cores> from launch.sh's TPU table (cores per chip, chips per host)."""
  row = next(line for line in open(os.path.join(ROOT, "launch.sh")) if re.match(r"v5p\s+v5p-N\s", line))
  per_chip, per_host = int(row.split()[3]), int(row.split()[4])
  return cores // per_chip // per_host


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model_mb", type=float, default=64, help="model size in MiB, bf16 (default 64)")
  p.add_argument("--workers", type=int, default=2, help="pulling worker processes (default 2)")
  p.add_argument("--mbit", type=float, default=400, help="link rate each way, Mbit/s (default 400)")
  p.add_argument("--changed", type=float, default=0.02, help="fraction of elements the next version changes "
                 "(default 0.02, in bench.sharded --delta's measured 1.7-3.4%%)")
  p.add_argument("--cores", type=int, default=16, help="the projection's cores per role on a v5p host (208 "
                 "vCPUs, shared with the trainer or the inference engine), count (default 16)")
  a = p.parse_args()
  if os.geteuid() != 0:
    sys.exit("bench.link: needs root (ip netns, tc)")
  M = a.model_mb * 2**20
  with tempfile.TemporaryDirectory() as tmp, link(a.mbit) as (ns_a, ns_b):
    # 1. Inputs, over ns_a's loopback (no shaping), then the codec in this process
    recs, t1, serve_cpu = run_sync(ns_a, ns_a, "127.0.0.1", a.model_mb, a.changed, a.workers, tmp, reps=8)
    served = sum(r["full_bytes"] for r in recs)
    serve = served / (max(r["full_end"] for r in recs) - min(r["full_start"] for r in recs))
    serve_core, receive_core = served / serve_cpu, served / sum(r["full_cpu"] for r in recs)
    d = statistics.mean(r["delta_bytes"] / r["delta_full_bytes"] for r in recs)
    delta_lo = max(r["delta_end"] for r in recs) - t1  # staging, commit, the server's delta build, every apply
    (build, decode), (build2, decode2) = (codec_rates(a.model_mb, a.changed, k) for k in (1, 2))
    print(f"measured, loopback: one server serves {a.workers} concurrent full pulls at {serve / 1e6:.0f} MB/s "
          f"aggregate, {serve_core / 1e6:.0f} MB per second of its CPU time (a worker receives "
          f"{receive_core / 1e6:.0f} MB per second of its CPU time); {100 * a.changed:.1f}% of elements "
          f"changed -> delta bytes {100 * d:.2f}% of full; delta sync (commit to the last apply) {delta_lo:.2f} s")
    print(f"measured, codec: the server's delta build {build / 1e6:.0f} MB/s of the version on 1 thread, "
          f"{build2 / 1e6:.0f} on 2; a worker's decode {decode / 1e6:.0f} MB/s of payload on 1 thread, "
          f"{decode2 / 1e6:.0f} on 2")
    # 2. The link
    link_bps = a.mbit * 1e6 / 8
    recs, t1, _ = run_sync(ns_a, ns_b, "10.77.0.1", a.model_mb, a.changed, a.workers, tmp)
    full = max(r["full_end"] for r in recs) - min(r["full_start"] for r in recs)
    delta = max(r["delta_end"] for r in recs) - t1
    W = a.workers
    pf, pd = max(W * M / link_bps, W * M / serve), W * M * d / link_bps + delta_lo
    print(f"link {a.mbit:g} Mbit/s, {W} workers, {a.model_mb:g} MiB bf16: full sync measured {full:.2f} s, model "
          f"{pf:.2f} s ({'link' if W * M / link_bps >= W * M / serve else 'server'}-bound); delta sync measured "
          f"{delta:.2f} s (commit to the last worker's apply), model {pd:.2f} s")
  project(serve_core, receive_core, build, decode, decode2, a.cores)


def project(serve_core, receive_core, build, decode, decode2, cores):
  """3. The projection: printed, with every input and its source."""
  hosts, W, model_b, host_bps = v5p_hosts(512), 128, 32.8e9 * 2, V5P_HOST_BYTES_S
  per_server, d = model_b / hosts, MEASURED_DELTA_FRAC
  floor = per_server * W / host_bps  # every worker's bytes over the serving hosts' aggregate link
  print(f"PROJECTION (not a measurement), QwQ-32B bf16 ({model_b / 1e9:.1f} GB), trainer v5p-512 = {hosts} hosts "
        f"(launch.sh's table), one shard server each ({per_server / 1e9:.2f} GB), {W} workers each holding the whole "
        f"model. Inputs: {host_bps / 1e9:.0f} GB/s per host (Cloud TPU docs, via issue 41), {V5P_VCPUS} vCPUs per "
        f"v5p host (Cloud TPU docs); per core, measured above on this box: serving {serve_core / 1e9:.2f} GB/s, "
        f"receiving {receive_core / 1e9:.2f} GB/s, "
        f"delta build {build / 1e9:.2f} GB/s, decode {decode / 1e9:.3f} GB/s of payload ({decode2 / decode:.2f}x "
        f"on 2 threads); delta bytes {100 * d:.2f}% of full (RESULTS.md, bench.sharded --delta). Assumed: c cores "
        f"per role, throughput linear in c (measured to 2 here): a server's connection threads send and build "
        f"(readers start at random tensors, so they ask different pieces), a worker receives and decodes on one "
        f"thread per server, so on at most {hosts}. Summed steps, no overlap; the device scatter of the patches is "
        f"left out (HBM-local: milliseconds at the docs' 2,765 GB/s per v5p chip; not measured here)")

  def full_terms(c):  # a full sync's lower bounds: the serving hosts' links or CPU, each worker's own receive
    return {"the serving hosts' links": floor, "the server CPU": per_server * W / (serve_core * c),
            "the workers' receive": model_b / min(host_bps, receive_core * min(c, hosts))}

  def full(c):
    return max(full_terms(c).values())

  def delta(c):
    return dict(build=per_server / (build * c), wire=per_server * W * d / min(host_bps, serve_core * c),
                decode=model_b * d / (decode * min(c, hosts)))

  def need(ok):
    return next((c for c in range(1, V5P_VCPUS + 1) if ok(c)), None)

  steps = delta(cores)
  fn, dn = need(lambda c: full(c) <= 2 * floor), need(lambda c: sum(delta(c).values()) <= 2)
  terms = full_terms(cores)
  print(f"  full sync: network floor {floor:.1f} s; {full(cores):.1f} s with {cores} cores (bottleneck: "
        f"{max(terms, key=terms.get)}), {full(1):.1f} s with 1; within 2x the floor from {fn} cores")
  print(f"  delta sync: build {steps['build']:.2f} s + wire {steps['wire']:.2f} s + decode {steps['decode']:.2f} s "
        f"= {sum(steps.values()):.2f} s with {cores} cores (bottleneck: {max(steps, key=steps.get)}), "
        f"{sum(delta(1).values()):.1f} s with 1; goal <= 2 s from {dn} cores")


if __name__ == "__main__":
  main()
