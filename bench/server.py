"""Benchmark: the weight path's throughput (FETCH of staged pieces) next to a raw loopback socket transfer of the
same bytes.

Starts `param_server.py` as its own process (in memory, no run_dir), stages --size_mb of weights (16 tensors,
half bf16 half fp32, one piece each) and commits their manifest, then, interleaved for --reps rounds, times
  raw    a plain TCP sender process: sendall of the same bytes in 8 MiB memoryview slices -> recv_into
         one freshly allocated buffer (the same allocator the client uses), no framing, no checksum
  fetch  Client.fetch() of every piece in one request, sent from the server's staged buffers: framing + JSON
         header + recv_into + crc32 verification of every tensor
with 1 and --clients concurrent receivers (each its own process). Prints GB/s (1e9 bytes/s; with N clients the
aggregate N * size / wall time) as best and median over rounds, and fetch / raw.

  python -m bench.server --size_mb=1024 --clients=4 --reps=2
"""
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import tempfile
import time

import ml_dtypes
import numpy as np
from absl import app, flags

from bench import util as benchutil
import param_server as ps

flags.DEFINE_integer("size_mb", 1024, "Size of the weight set (MiB, default 1024).")
flags.DEFINE_integer("clients", 4, "Concurrent receivers in the second measurement (count, default 4).")
flags.DEFINE_integer("reps", 2, "Interleaved rounds per measurement (count, default 2).")
FLAGS = flags.FLAGS


def make_weights(size):
  """16 tensors totalling `size` bytes, alternating bf16 / fp32, with non-constant contents."""
  per = size // 16
  return {f"layers/{i}/w": (np.arange(per // 4, dtype=np.uint32) * 2654435761).view(np.float32) if i % 2
          else (np.arange(per // 2, dtype=np.uint16) * 40503).view(ml_dtypes.bfloat16) for i in range(16)}


TOKEN = [None]


def raw_sender(listener, size):
  """A raw loopback server: for each connection, wait for one byte, then send `size` bytes."""
  data = np.frombuffer(os.urandom(1 << 20), np.uint8)
  buf = np.tile(data, size // (1 << 20))
  mv = memoryview(buf)
  while True:
    conn, _ = listener.accept()
    if not conn.recv(1):
      return
    for i in range(0, len(mv), ps.CHUNK):
      conn.sendall(mv[i:i + ps.CHUNK])
    conn.close()


def receiver(kind, port, size, barrier, results):
  if kind == "fetch":
    c = ps.Client(port=port, token=TOKEN[0], timeout_s=120.0)
    m = c.manifest()  # and connect before the clock starts, as the raw receiver does
    want = [dict(name=n, index=t["pieces"][0]["index"], crc=t["pieces"][0]["crc"]) for n, t in m["tensors"].items()]
  else:
    sock = socket.create_connection(("127.0.0.1", port))
  barrier.wait()
  t0 = time.perf_counter()
  if kind == "fetch":
    n = sum(a.nbytes for a in c.fetch(m["version"], want))
  else:
    buf = ps._alloc(size)
    mv, n = memoryview(buf), 0
    sock.sendall(b"x")
    while n < size:
      n += sock.recv_into(mv[n:], min(size - n, ps.CHUNK))
  results.put((time.perf_counter() - t0, n))


def measure(kind, port, size, clients):
  ctx = mp.get_context("fork")
  barrier, results = ctx.Barrier(clients + 1), ctx.Queue()
  procs = [ctx.Process(target=receiver, args=(kind, port, size, barrier, results)) for _ in range(clients)]
  for p in procs:
    p.start()
  barrier.wait()
  t0 = time.perf_counter()
  got = [results.get(timeout=600) for _ in procs]
  wall = time.perf_counter() - t0
  for p in procs:
    p.join()
  assert all(n == size for _, n in got), (kind, got, size)
  return clients * size / wall / 1e9


def main(argv):
  del argv
  size = FLAGS.size_mb << 20
  assert size % (16 << 20) == 0, "--size_mb must be a multiple of 16"
  tmp = tempfile.mkdtemp(prefix="bench_ps_")
  token_file = os.path.join(tmp, "token")
  srv, port = benchutil.start_server(os.path.join(tmp, "port"), "--port=0", f"--token_file={token_file}",
                                     "--min_rate_mb_s=10", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  listener = socket.create_server(("127.0.0.1", 0), backlog=64)
  raw = mp.get_context("fork").Process(target=raw_sender, args=(listener, size), daemon=True)
  raw.start()
  try:
    w = make_weights(size)
    TOKEN[0] = ps.read_token(token_file)  # every read needs it too; the forked receivers inherit it
    c = ps.Client(port=port, token=TOKEN[0], timeout_s=120.0)
    t0 = time.perf_counter()
    for name, a in w.items():
      c.stage(0, 0, name, [[0, a.size]], a)
    stage_s = time.perf_counter() - t0
    crc = {p["name"]: p["crc"] for p in c.staged(0, 0)["pieces"]}
    c.commit(dict(version=0, servers=[f"127.0.0.1:{port}"], tensors={n: dict(
        dtype=a.dtype.name, shape=[a.size], pieces=[dict(index=[[0, a.size]], crc=crc[n], server=0)])
        for n, a in w.items()}))
    del w
    print(f"payload {size / 1e9:.3f} GB in 16 tensors (bf16 + fp32); stage (crc32 + send + server verify) "
          f"{size / stage_s / 1e9:.2f} GB/s; cores: {os.cpu_count()}")
    raw_port = listener.getsockname()[1]
    for clients in (1, FLAGS.clients):
      r, p = [], []
      for _ in range(FLAGS.reps):  # interleaved so that load from other processes hits both alike
        r.append(measure("raw", raw_port, size, clients))
        p.append(measure("fetch", port, size, clients))
      print(f"{clients} client(s): raw loopback best {max(r):.2f} median {statistics.median(r):.2f} GB/s | "
            f"fetch best {max(p):.2f} median {statistics.median(p):.2f} GB/s | fetch/raw best "
            f"{max(p) / max(r):.0%} median {statistics.median(p) / statistics.median(r):.0%}", flush=True)
  finally:
    srv.terminate()
    srv.wait()
    raw.kill()


if __name__ == "__main__":
  app.run(main)
