"""Benchmark: the fleet simulator (issue 42 item 4). The real parameter server (`param_server.py`, queue logs on
disk), the real trainer (`train.py --mode=rl`: ledger, pacing, checkpoints, a small random model on CPU, sized by
--d_model and --layers, which publishes every version to that server) and N simulated inference workers: processes
that speak the real protocol (pull every weight version, lease prompts, put rollouts, ack, hand back on SIGTERM)
and emit rollouts at a configured speed, with no model. What it answers on one box: how rollout throughput grows
with N, what bounds it (the fleet, the trainer's staleness window, the trainer's step, or the server, weight
serving included), and whether exactly-once survives hundreds of preemptions.

A simulated worker leases --slots // group_size prompts at a time, "generates" them for latency_s + tokens /
tok_s (tokens: the batch's completion tokens, each completion uniform in [M/2, M]; tok_s: the batch's aggregate
decode rate), rewards each completion 1 with probability 1/2 (so dynamic sampling keeps almost every group), puts
the rollouts in one request, acks the prompts, and tags each batch with the newest version it holds. A background
thread does what the real worker's Puller does: long-polls for a newer manifest and pulls every tensor whole with
param_server.pull_slices, as a delta against the version held (the first in full). Real: the bytes on the socket
and the server's work (cutting, delta builds, framing, crc). Not simulated: applying them (the patches are
dropped; bench.sharded measures the apply). --pull=false: the old behaviour, the newest manifest read once per
batch and no bytes pulled. On SIGTERM it hands its leased prompts back at once; kill -9 leaves them leased until
--lease_s.

Phase 1, throughput vs N: one trainer runs throughout (its first 3 steps, compiles, run with --chaos_workers
workers); the fleet goes through --ns, --phase_s per size (after --warmup_s). Per phase: groups the workers
finished per second (the server's prompt acks: rollout throughput), groups and tokens trained per second
(between the phase's first and last step records), the fleet's ideal (N x one worker's rate), the trainer's
wait fraction, the prompts in flight against the pacing window (min(prefetch_steps, max_staleness) x
prompts_per_step / keep rate), the CPU (cores) used by the server, the trainer and the simulated workers, read
from /proc, and the weight sync, from the workers' pull logs (RUN/ready/WID.pulls, a JSON line per pull): the
versions and pulls in the phase, the server's weight egress (bytes pulled / s; delta / full: the bytes against a
full pull's), the median pull (manifest arrived to version held), the median fleet sync (a version's first
worker's manifest arrival to its last worker holding it), and the server's CPU per MB pulled (all its work,
the rollout path included: compare --pull=false for the weights' share).
Phase 2, preemption: --chaos_workers workers for --chaos_s; every --kill_every_s a random worker gets SIGKILL or
SIGTERM (alternating) and a fresh one starts; every --trainer_every_s the trainer gets SIGTERM or SIGKILL
(alternating) and is restarted with the same command (it resumes from its last checkpoint), as launch.sh's
supervisor does. It prints the timeline (event, time, step reached).
Then everything stops and the exactly-once check runs on what is on disk: each step 1..S in the surviving
lineage once, no rollout trained twice, consumed = trained + skipped = the checkpoint's count, every consumed
rollout acked on the server, no issued prompt lost (consumed, or its rollout or itself still queued); and every
version a worker tagged rollouts with was one it had pulled (pull_check).

--verifiers=V adds the verifier role: V processes that run its real step (rollout.score_items: lease from
"to_score", score, put to "rollouts", ack; an item that fails alone is FAILed) with a simulated verdict (--score_ms
per completion, 1 with probability 1/2); the workers then put their groups there unscored, and the preemption
phase picks its victims among workers and verifiers alike.

Every simulated peer connects from 127.0.0.1, so the server runs with its per-peer quotas raised
(--max_peer_requests, --max_peer_rps): on a pod each worker host is its own peer.

  python -m bench.fleet                                    # N = 1..128, then 240 s of preemption (~12 min)
  python -m bench.fleet --ns=1,4,16,64,128 --chaos_s=0 --d_model=128 --layers=2  # 1.2 MB (fp32) per version
  python -m bench.fleet --ns=1,4,16,64,128 --chaos_s=0 --d_model=128 --layers=2 --pull=false  # the same, no pulls
  python -m bench.fleet --prompts_per_step=64 --chaos_s=0  # a window of 2 x 64 prompts: it binds at 32 workers
  python -m bench.fleet --ns=1,4,16 --phase_s=10 --chaos_s=60 --chaos_workers=8   # a quick look
"""
import glob
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import zlib

import numpy as np
from absl import app, flags

from bench import util as benchutil
import data
import param_server as ps

ROOT = benchutil.ROOT
TOKEN = "fleet-bench-token"

flags.DEFINE_bool("sim_worker", False, "Run one simulated worker (the bench starts these itself). Default False.")
flags.DEFINE_bool("sim_verifier", False, "Run one simulated verifier (the bench starts these itself). Default False.")
flags.DEFINE_integer("verifiers", 0, "Verifier processes; 0: the workers score their own groups (count, default 0).")
flags.DEFINE_float("score_ms", 2.0, "A simulated verifier's time per completion (milliseconds, default 2).")
flags.DEFINE_string("server", None, "host:port of the server (simulated worker). Default none.")
flags.DEFINE_string("wid", "sim", "Simulated worker's id (simulated worker). Default sim.")
flags.DEFINE_string("ready_dir", None, "Directory a simulated worker touches a file in once connected. Default none.")
flags.DEFINE_integer("slots", 32, "Sequences a simulated worker decodes at once: it leases slots // group_size "
                     "prompts per batch (count, default 32).")
flags.DEFINE_float("tok_s", 300.0, "One simulated worker's aggregate decode rate (tokens/s, default 300).")
flags.DEFINE_float("latency_s", 0.5, "Fixed time per batch on top of tokens / tok_s (seconds, default 0.5).")
flags.DEFINE_bool("pull", True, "Simulated workers pull every weight version (delta against the one held); false: "
                  "they only read the newest manifest (default true).")
flags.DEFINE_integer("d_model", 32, "The trainer's random policy's width (MLP 2x; units, default 32).")
flags.DEFINE_integer("layers", 1, "The trainer's random policy's layers (count, default 1).")
flags.DEFINE_float("lease_s", 10.0, "Prompt lease of a simulated worker (seconds, default 10).")
flags.DEFINE_list("ns", ["1", "2", "4", "8", "16", "32", "64", "128"], "Fleet sizes of phase 1 (counts, default "
                  "1,2,4,8,16,32,64,128).")
flags.DEFINE_float("phase_s", 20.0, "Measured seconds per fleet size (seconds, default 20).")
flags.DEFINE_float("warmup_s", 10.0, "Seconds after a fleet size is reached before measuring (default 10).")
flags.DEFINE_integer("chaos_workers", 32, "Fleet size during the preemption phase (count, default 32).")
flags.DEFINE_float("chaos_s", 240.0, "Length of the preemption phase (seconds, default 240; 0 skips it).")
flags.DEFINE_float("kill_every_s", 0.5, "Seconds between preemptions of a worker or a verifier (default 0.5).")
flags.DEFINE_float("trainer_every_s", 60.0, "Seconds between trainer preemptions (default 60).")
flags.DEFINE_integer("prompts_per_step", 256, "Trainer's prompts per step (count, default 256).")
flags.DEFINE_integer("group_size", 8, "Completions per prompt (count, default 8).")
flags.DEFINE_integer("max_new_tokens", 32, "Longest completion, M (tokens, default 32).")
flags.DEFINE_integer("max_staleness", 2, "Trainer's staleness bound (versions, default 2).")
flags.DEFINE_integer("seed", 0, "Seed of the preemption schedule and the workers' samples (default 0).")
flags.DEFINE_string("json", None, "Also write the results here (path, default none).")
flags.DEFINE_string("out_dir", None, "Keep the run here (default: a temporary directory, removed).")
FLAGS = flags.FLAGS


# --- A simulated worker ---------------------------------------------------------------------------------------------

def pull_loop(c, held, log):
  """The real worker's Puller and Weights.pull (rollout.py) with no model: long-polls for a newer manifest, pulls
  every tensor whole as a delta against the version held (the first in full), then holds it. The bytes cross the
  socket and the server's work (cutting, delta builds and their cache, framing, crc) is real; the patches are
  dropped, not applied (bench.sharded measures applying them). held: {"m": the manifest held, "stats": the newest
  pull's figures, "error"}; log: an O_APPEND fd, a JSON line per pull (one write: whole lines), read by the bench."""
  clients = {}  # pull_slices's connections to the manifest's servers (its own: not the generation loop's)
  try:
    while True:
      m = c.manifest(newer_than=held["m"]["version"] if held["m"] else -1, wait_s=2.0)
      if m is None:
        continue
      t, st = time.time(), {}
      whole = {n: [tuple((0, d) for d in x["shape"])] for n, x in m["tensors"].items()}
      try:
        for _ in ps.pull_slices(m, whole, clients, base=held["m"], held=lambda n, s: s, stats=st, token=TOKEN):
          pass
      except (ValueError, ConnectionError):  # collected meanwhile (a newer one exists): the next, as rollout.py
        continue
      rec = dict(time=time.time(), version=m["version"], bytes=st["bytes"], full_bytes=st["full_bytes"],
                 pull_s=time.time() - t)
      held.update(m=m, stats=dict(pull_bytes=st["bytes"], pull_s=rec["pull_s"],
                                  delta_frac=st["bytes"] / max(st["full_bytes"], 1)))
      os.write(log, (json.dumps(rec) + "\n").encode())
  except BaseException as e:  # noqa: BLE001  (raised by the generation loop)
    held["error"] = e


def sim_worker():
  """Leases, 'generates' (sleeps), puts and acks until SIGTERM, then hands its leased prompts back. With --pull a
  background thread pulls every version (pull_loop) and rollouts are tagged with the newest version held."""
  stop = ps.StopFlag()
  host, port = FLAGS.server.rsplit(":", 1)
  c = ps.Client(host, int(port), token=TOKEN, retries=20)
  rng = np.random.default_rng([FLAGS.seed, zlib.crc32(FLAGS.wid.encode())])
  held = dict(m=None, stats={}, error=None)
  if FLAGS.pull:
    log = os.open(os.path.join(FLAGS.ready_dir, FLAGS.wid + ".pulls"), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    threading.Thread(target=pull_loop, args=(ps.Client(host, int(port), token=TOKEN, retries=20), held, log),
                     daemon=True).start()
  while held["m"] is None and not stop.requested:  # a real worker starts generating once it holds weights
    if FLAGS.pull:
      time.sleep(0.05)
    else:
      held["m"] = c.manifest(newer_than=-1, wait_s=2.0)
  if held["m"] is None:
    return
  vocab, M = held["m"]["config"]["vocab_size"], held["m"]["sampling"]["max_new_tokens"]
  if FLAGS.ready_dir:
    open(os.path.join(FLAGS.ready_dir, FLAGS.wid), "w").close()
  t_start, busy, waiting, version = time.time(), 0.0, 0.0, None
  while not stop.requested:
    t = time.time()
    raws = c.get("prompts", max(1, FLAGS.slots // FLAGS.group_size), wait_s=1.0, lease_s=FLAGS.lease_s)
    waiting += time.time() - t
    if not raws:
      continue
    if held["error"] is not None:
      raise held["error"]
    if not FLAGS.pull:  # only the newest manifest (the old behaviour): tags without pulling
      held["m"] = c.manifest(newer_than=held["m"]["version"]) or held["m"]
    if FLAGS.pull and held["m"]["version"] != version:  # logged for pull_check: each version tagged was held
      os.write(log, (json.dumps(dict(tagged=held["m"]["version"])) + "\n").encode())
    version = held["m"]["version"]  # generation starts on the newest version held (the real worker's swap)
    items = [data.PromptItem.from_wire(r) for r in raws]
    lens = [rng.integers(M // 2, M + 1, size=it.group_size) for it in items]
    gen_s = FLAGS.latency_s + sum(int(n.sum()) for n in lens) / FLAGS.tok_s
    t = time.time()
    while time.time() - t < gen_s and not stop.requested:
      time.sleep(max(0.0, min(0.1, gen_s - (time.time() - t))))
    if stop.requested:  # SIGTERM mid-batch: these prompts go back now (not after their lease expires)
      c.requeue("prompts", [it.id for it in items])
      break
    busy += time.time() - t
    span = time.time() - t_start
    stats = dict(held["stats"], worker_busy_frac=busy / span, worker_wait_prompts_frac=waiting / span,
                 worker_tok_s=sum(int(n.sum()) for n in lens) / gen_s)
    rs = [data.Rollout(it.id, version, FLAGS.wid, it.problem, it.prompt_tokens,
                       [rng.integers(0, vocab, size=k).astype(np.int32) for k in n],
                       [-rng.uniform(0.0, 3.0, size=k).astype(np.float32) for k in n],
                       None if FLAGS.verifiers else (rng.random(len(n)) < 0.5).astype(np.float32), gen_s, stats)
          for it, n in zip(items, lens)]
    c.put("to_score" if FLAGS.verifiers else "rollouts", [r.to_wire() for r in rs])
    c.ack("prompts", [it.id for it in items])


def sim_verifier():
  """The verifier role's step (rollout.score_items) until SIGTERM, with a simulated verdict."""
  import rollout  # (jax: only in the verifiers)
  stop = ps.StopFlag()
  host, port = FLAGS.server.rsplit(":", 1)
  c = ps.Client(host, int(port), token=TOKEN, retries=20)
  rng = np.random.default_rng([FLAGS.seed, zlib.crc32(FLAGS.wid.encode())])

  class Pool:  # what rollout.scored uses of a data.VerifierPool
    reused = 0

    def score(self, problems, completions):
      time.sleep(FLAGS.score_ms * 1e-3 * len(completions))
      return list((rng.random(len(completions)) < 0.5).astype(float))

  pool, tok, failed = Pool(), type("Tok", (), {"decode": staticmethod(lambda ids: "")}), []
  if FLAGS.ready_dir:
    open(os.path.join(FLAGS.ready_dir, FLAGS.wid), "w").close()
  while not stop.requested:
    items = c.get("to_score", max(1, FLAGS.slots // FLAGS.group_size), wait_s=1.0, lease_s=FLAGS.lease_s,
                  consumer=True)
    rollout.score_items(c, tok, pool, items, failed, remote=True)


# --- The bench ------------------------------------------------------------------------------------------------------

def cpu_s(pid):
  """utime + stime of a live process in seconds (0 if it is gone)."""
  try:
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
  except OSError:
    return 0.0
  return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


class Fleet:
  """The processes of one simulated run: server, trainer, workers; their logs and pids under `run`."""

  def __init__(self, run, seed):
    self.run, self.rng, self.workers, self.n_started, self.events = run, random.Random(seed), {}, 0, []
    self.verifiers = {}
    self.gone = []  # stopped workers, reaped at the end; events: (time, what) per trainer preemption
    os.makedirs(os.path.join(run, "logs"), exist_ok=True)
    os.makedirs(os.path.join(run, "ready"), exist_ok=True)
    with open(os.path.join(run, "token"), "w") as f:
      f.write(TOKEN)
    tok = data.load_tokenizer(data.build_task_tokenizer(run, "arithmetic", seed=0))
    benchutil.tiny_base(run, tok, FLAGS.d_model, FLAGS.layers)
    self.server, self.port = benchutil.start_server(
        os.path.join(run, "port"), f"--token_file={run}/token", f"--run_dir={run}/server",
        "--max_peer_requests=4096", "--max_peer_rps=100000", log=os.path.join(run, "logs", "server.log"))
    self.client = ps.Client("127.0.0.1", self.port, token=TOKEN)
    self.trainer_cmd = [sys.executable, "train.py", "--mode=rl", f"--run_dir={run}", f"--server=127.0.0.1:{self.port}",
                        f"--token_file={run}/token", f"--init_checkpoint={run}/base",
                        f"--tokenizer={run}/tokenizer-arithmetic.model", "--steps=1000000", "--checkpoint_every=10",
                        f"--prompts_per_step={FLAGS.prompts_per_step}", f"--group_size={FLAGS.group_size}",
                        f"--max_new_tokens={FLAGS.max_new_tokens}", f"--max_staleness={FLAGS.max_staleness}",
                        "--get_wait_s=0.5", "--rollout_lease_s=120", "--train_size=2000", "--curate_prompts=0",
                        "--pass_band="]
    self.env = dict(benchutil.child_env(), JAX_COMPILATION_CACHE_DIR=os.path.join(run, "jax_cache"),
                    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    self.start_trainer()
    for _ in range(FLAGS.verifiers):
      self.add_worker("verifier")

  def start_trainer(self):
    self.trainer = subprocess.Popen(self.trainer_cmd, cwd=ROOT, env=self.env, stdin=subprocess.DEVNULL,
                                    stdout=open(os.path.join(self.run, "logs", "trainer.log"), "ab"),
                                    stderr=subprocess.STDOUT)

  def add_worker(self, role="worker"):
    wid = f"{'sim' if role == 'worker' else 'ver'}{self.n_started}"
    self.n_started += 1
    (self.workers if role == "worker" else self.verifiers)[wid] = subprocess.Popen(
        [sys.executable, "-m", "bench.fleet", f"--sim_{role}", f"--server=127.0.0.1:{self.port}", f"--wid={wid}",
         f"--ready_dir={self.run}/ready", f"--slots={FLAGS.slots}", f"--group_size={FLAGS.group_size}",
         f"--tok_s={FLAGS.tok_s}", f"--seed={FLAGS.seed}", f"--latency_s={FLAGS.latency_s}",
         f"--lease_s={FLAGS.lease_s}", f"--pull={FLAGS.pull}", f"--verifiers={FLAGS.verifiers}",
         f"--score_ms={FLAGS.score_ms}"],
        cwd=ROOT, env=self.env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=open(os.path.join(self.run, "logs", "workers.log"), "ab"))
    return wid

  def resize(self, n, timeout_s=300.0):
    """Starts workers until n run and waits until each has connected, or SIGTERMs the newest beyond n."""
    for wid in sorted(self.workers, key=lambda w: int(w[3:]))[n:]:
      self.workers[wid].send_signal(signal.SIGTERM)
      self.gone.append(self.workers.pop(wid))
    new = [self.add_worker() for _ in range(n - len(self.workers))]
    t0 = time.time()
    while not all(os.path.exists(os.path.join(self.run, "ready", w)) for w in new):
      if time.time() - t0 > timeout_s:
        raise RuntimeError(f"{len(new)} simulated workers did not connect within {timeout_s} s (logs/workers.log)")
      self.check()
      time.sleep(0.2)

  def check(self):
    dead = {w: p.returncode for w, p in {**self.workers, **self.verifiers}.items() if p.poll() is not None}
    if self.trainer.poll() not in (None, -9, 0):
      raise RuntimeError(f"the trainer exited with {self.trainer.returncode} (see {self.run}/logs/trainer.log)")
    if dead:
      raise RuntimeError(f"simulated workers failed: {dead} (see {self.run}/logs/workers.log)")

  def preempt_worker(self, sig):
    """A random worker or verifier; returns its role."""
    wid = self.rng.choice(sorted({**self.workers, **self.verifiers}))
    role = "worker" if wid in self.workers else "verifier"
    p = (self.workers if role == "worker" else self.verifiers).pop(wid)
    p.send_signal(sig)
    self.gone.append(p)
    self.add_worker(role)  # a replacement joins (a preempted TPU VM comes back as a fresh worker)
    return role

  def preempt_trainer(self, sig):
    self.trainer.send_signal(sig)
    t = time.time()
    self.trainer.wait()  # SIGTERM: its final checkpoint first (launch.sh's supervisor waits likewise)
    # Stamped at the exit: after a SIGTERM the step under way still finishes and writes its record.
    self.events.append((time.time(), f"trainer SIG{signal.Signals(sig).name[3:]} (exit after {time.time() - t:.1f} s)"))
    self.start_trainer()

  def records(self):
    path = os.path.join(self.run, "metrics.jsonl")
    if not os.path.exists(path):
      return []
    out = []
    for line in open(path):
      try:
        out.append(json.loads(line))
      except ValueError:  # a line being written
        pass
    return [r for r in out if "rollout_ids" in r]

  def cpu(self):
    workers = sum(cpu_s(p.pid) for p in {**self.workers, **self.verifiers}.values() if p.poll() is None)
    return dict(server=cpu_s(self.server.pid), trainer=cpu_s(self.trainer.pid), workers=workers)

  def stop(self):
    self.trainer.send_signal(signal.SIGTERM)
    self.trainer.wait()
    for p in [*self.workers.values(), *self.verifiers.values()]:  # (workers first: they drain into to_score)
      p.send_signal(signal.SIGTERM)
    for p in [*self.workers.values(), *self.verifiers.values(), *self.gone]:
      p.wait()
    self.server.send_signal(signal.SIGTERM)
    self.server.wait()


def worker_rate():
  """One simulated worker's groups per second at full occupancy (mean completion 3M/4 tokens)."""
  per = max(1, FLAGS.slots // FLAGS.group_size)
  return per / (FLAGS.latency_s + per * FLAGS.group_size * 0.75 * FLAGS.max_new_tokens / FLAGS.tok_s)


def pull_records(run):
  """The simulated workers' pull logs (pull_loop's lines, and {"tagged": version} from the generation loop), each
  line with its worker's id."""
  out = []
  for path in glob.glob(os.path.join(run, "ready", "*.pulls")):
    for line in open(path):
      try:
        out.append(dict(json.loads(line), wid=os.path.basename(path)[:-len(".pulls")]))
      except ValueError:  # a line being written
        pass
  return out


def pull_check(run):
  """Totals of every pull of the run; an AssertionError names the versions a worker tagged rollouts with that it
  had not pulled (like exactly_once, it fails the bench)."""
  recs = pull_records(run)
  pulled = {(r["wid"], r["version"]) for r in recs if "version" in r}
  bad = sorted({f"{r['wid']}:v{r['tagged']}" for r in recs if "tagged" in r and (r["wid"], r["tagged"]) not in pulled})
  assert not bad, f"rollouts tagged with versions their worker never pulled: {bad[:10]}"
  return dict(pulls=len(pulled), bytes=sum(r.get("bytes", 0) for r in recs),
              full_bytes=sum(r.get("full_bytes", 0) for r in recs), tagged=len([r for r in recs if "tagged" in r]))


def measure_phase(fleet, n):
  """Throughput at n workers over --phase_s: one result row."""
  fleet.resize(n)
  time.sleep(FLAGS.warmup_s)
  fleet.check()
  c0, q0, t0 = fleet.cpu(), fleet.client.stats()["queues"], time.time()
  time.sleep(FLAGS.phase_s)
  c1, q1, t1 = fleet.cpu(), fleet.client.stats()["queues"], time.time()
  fleet.check()
  dt = t1 - t0
  recs = [r for r in fleet.records() if t0 <= r["time"] <= t1]
  pulls = [p for p in pull_records(fleet.run) if "version" in p and t0 <= p["time"] <= t1]
  # A version's fleet sync: from its first worker's manifest arrival to its last worker holding it.
  by_v = {}
  for p in pulls:
    by_v.setdefault(p["version"], []).append(p)
  sync = [max(p["time"] for p in ps_) - min(p["time"] - p["pull_s"] for p in ps_) for ps_ in by_v.values()]
  waits = sorted(r["trainer_wait_frac"] for r in recs) or [float("nan")]
  # Trained rates between the phase's first and last step records (a step is 256 groups: at small N none or one
  # lands in a phase, then nan); the fleet's rate is the server's count of prompts acked (groups finished).
  span = recs[-1]["time"] - recs[0]["time"] if len(recs) > 1 else float("nan")
  rate = lambda f: sum(f(r) for r in recs[1:]) / span  # noqa: E731
  return dict(n=n, ideal=n * worker_rate(), finished=(q1["prompts"]["acked"] - q0["prompts"]["acked"]) / dt,
              trained=rate(lambda r: len(r["rollout_ids"])), trained_tok=rate(lambda r: r["trained_tokens"]),
              steps=len(recs), stale=rate(lambda r: r["stale_dropped"]), zero_var=rate(lambda r: r["zero_var_dropped"]),
              step_s=float(np.median([r["step_s"] + r["push_s"] for r in recs])) if recs else float("nan"),
              wait=waits[len(waits) // 2], in_flight=q1["prompts"]["ready"] + q1["prompts"]["leased"],
              window=recs[-1]["issued_ahead"] if recs else 0,
              cpu={k: (c1[k] - c0[k]) / dt for k in c0}, versions=len(by_v), pulls=len(pulls),
              pull_mb_s=sum(p["bytes"] for p in pulls) / dt / 1e6,
              delta_frac=sum(p["bytes"] for p in pulls) / max(sum(p["full_bytes"] for p in pulls), 1),
              pull_s=float(np.median([p["pull_s"] for p in pulls])) if pulls else float("nan"),
              sync_s=float(np.median(sync)) if sync else float("nan"))


def print_rows(rows):
  print("| workers | ideal groups/s | finished groups/s | trained groups/s | dropped groups/s: stale, zero-var | "
        "trained tokens/s | trainer wait | step+push s | prompts in flight / window | "
        "CPU cores: server, trainer, workers | server CPU ms / group | versions, pulls | weights out MB/s (delta "
        "/ full) | pull s, median | fleet sync s, median | server CPU ms / MB pulled |")
  print("|---:|---:|---:|---:|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|")
  for r in rows:
    print(f"| {r['n']} | {r['ideal']:.1f} | {r['finished']:.1f} | {r['trained']:.1f} | {r['stale']:.1f}, "
          f"{r['zero_var']:.1f} | {r['trained_tok']:.0f} | {100 * r['wait']:.0f}% | {r['step_s']:.2f} | "
          f"{r['in_flight']} / {r['window']} | {r['cpu']['server']:.3f}, {r['cpu']['trainer']:.3f}, "
          f"{r['cpu']['workers']:.3f} | {1e3 * r['cpu']['server'] / max(r['finished'], 1e-9):.2f} | "
          f"{r['versions']}, {r['pulls']} | {r['pull_mb_s']:.1f} ({r['delta_frac']:.2f}) | {r['pull_s']:.2f} | "
          f"{r['sync_s']:.2f} | {1e3 * r['cpu']['server'] / r['pull_mb_s'] if r['pull_mb_s'] else float('nan'):.1f} |", flush=True)


def chaos(fleet, seconds):
  """Preempts workers and the trainer on a schedule for `seconds`; returns the counts."""
  fleet.resize(FLAGS.chaos_workers)
  t0 = time.time()
  next_w, next_t, kinds = t0 + FLAGS.kill_every_s, t0 + FLAGS.trainer_every_s, [signal.SIGKILL, signal.SIGTERM]
  n_w, n_v, n_t = 0, 0, 0
  while time.time() - t0 < seconds:
    now = time.time()
    if now >= next_t:
      fleet.preempt_trainer(kinds[n_t % 2])
      n_t, next_t = n_t + 1, time.time() + FLAGS.trainer_every_s
    elif now >= next_w:
      n_v += fleet.preempt_worker(kinds[n_w % 2]) == "verifier"
      n_w, next_w = n_w + 1, now + FLAGS.kill_every_s
    fleet.check()
    time.sleep(0.05)
  t = time.time()  # the run goes on after the last preemption: one trainer step after it before the check
  last = max((t for t, _ in fleet.events), default=0)
  while not any(r["time"] > last for r in fleet.records()):
    if time.time() - t > 600:
      raise RuntimeError(f"no trainer step within 600 s of its last restart (see {fleet.run}/logs/trainer.log)")
    fleet.check()
    time.sleep(0.2)
  return n_w - n_v, n_v, n_t


def read_state(ckpt_dir):
  """The run state (JSON item) of the newest committed checkpoint in ckpt_dir, or None: no arrays read."""
  import train  # (jax: not in the simulated workers)
  c = train.Checkpointer(ckpt_dir, keep=1 << 30)
  try:
    step = c.mngr.latest_step()
    return None if step is None else c.mngr.restore(step, args=c.ocp.args.Composite(
        state=c.ocp.args.JsonRestore()))["state"]
  finally:
    c.close()


def exactly_once(run, per_step):
  """The ledger of a stopped run (trainer stopped by SIGTERM: its final checkpoint is the last step): metrics
  lineage vs the final checkpoint vs what the server persisted. Returns counts; an AssertionError names what
  broke. Used by tests/test_system.py too."""
  lineage, skipped, redone = {}, {}, 0
  state = read_state(os.path.join(run, "ckpt"))
  for line in open(os.path.join(run, "metrics.jsonl")):
    rec = json.loads(line)
    if "rollout_ids" in rec:  # a step (not the curation record)
      # A restarted trainer resumes from its checkpoint: its step s replaces the dead incarnation's s, s+1, ...
      undone = [k for k in lineage if k >= rec["step"]]
      redone += len(undone)
      for k in undone:
        del lineage[k], skipped[k]
      lineage[rec["step"]], skipped[rec["step"]] = rec["rollout_ids"], rec["skipped_ids"]
  for k in [k for k in lineage if k > state["step"]]:  # trained by an incarnation killed before checkpointing
    del lineage[k], skipped[k]
    redone += 1
  steps = max(lineage, default=0)
  assert sorted(lineage) == list(range(1, steps + 1)), \
      f"steps missing from the lineage: {sorted(set(range(1, steps + 1)) - set(lineage))[:10]}"
  trained = [rid for s in sorted(lineage) for rid in lineage[s]]
  assert len(trained) == len(set(trained)) == steps * per_step, \
      f"{len(trained)} rollouts trained in {steps} steps of {per_step}, {len(set(trained))} distinct"
  consumed = trained + [rid for s in sorted(skipped) for rid in skipped[s]]
  assert state["step"] == steps, f"final checkpoint at step {state['step']}, lineage at {steps}"
  # Exactly once: consumed = trained + skipped (stale / zero-variance), disjoint, nothing consumed untrained.
  # The checkpoint keeps a bounded record (count + the newest generations); the metrics log has every id.
  assert len(consumed) == len(set(consumed)) == state["consumed"]["count"], \
      f"consumed {len(consumed)} ({len(set(consumed))} distinct), checkpoint says {state['consumed']['count']}"
  assert set(state["consumed"]["gens"][-1]) <= set(consumed)
  token = open(os.path.join(run, "token")).read().strip()
  srv = ps.Server(ps.ServerConfig(run_dir=os.path.join(run, "server"), token=token)).start()  # all leases return
  try:
    c = ps.Client("127.0.0.1", srv.port, token=token)
    queued_rollouts = {r["id"] for r in c.get("rollouts", 100_000)}
    queued_prompts = {p["id"] for p in c.get("prompts", 100_000)}
    to_score = {r["id"] for r in c.get("to_score", 100_000)}  # the verifier role's queue (rollout.score_items)
    assert not queued_rollouts & set(consumed), "an acked rollout was delivered again"
    assert c.ack("rollouts", consumed)["unknown"] == [], "a consumed rollout was not acked on the server"
    # No prompt lost: each issued id (s<seq>, re-issued as s<seq>r, s<seq>rr, ...) was consumed, or its rollout
    # (scored or not) or the prompt itself is still queued.
    seen = {i.rstrip("r") for i in set(consumed) | queued_rollouts | queued_prompts | to_score}
    lost = [f"s{q}" for q in range(state["seq"]) if f"s{q}" not in seen]
    assert not lost, f"{len(lost)} prompts lost, e.g. {lost[:5]}"
  finally:
    srv.stop()
  return dict(steps=steps, redone_steps=redone, trained=len(trained), skipped=len(consumed) - len(trained),
              prompts_issued=state["seq"], queued_prompts=len(queued_prompts), queued_rollouts=len(queued_rollouts))


def timeline(fleet, t0):
  """The trainer's preemptions in the run's records: when it exited, the step it had reached, the step it resumed
  from, and the groups dropped as stale in the first step after (generated on the dead incarnation's versions)."""
  recs, out, prev = fleet.records(), [], 0.0
  for t, what in fleet.events:
    # The step this incarnation reached: its newest record (not the max: a rerun), or where it resumed from if it
    # was preempted again before finishing a step (a slow restart).
    mine = [r["step"] for r in recs if prev < r["time"] < t]
    before = mine[-1] if mine else (out[-1]["resumed_at"] or 0) if out else 0
    after = next((r for r in recs if r["time"] > t), None)
    out.append(dict(t=round(t - t0, 1), event=what, step=before, resumed_at=after and after["step"] - 1,
                    stale_after=after and after["stale_dropped"], wait_after_s=after and round(after["wait_s"], 1)))
    prev = t
  return out


def main(argv):
  del argv
  if FLAGS.sim_worker:
    return sim_worker()
  if FLAGS.sim_verifier:
    return sim_verifier()
  tmp = None if FLAGS.out_dir else tempfile.TemporaryDirectory()
  run = FLAGS.out_dir or tmp.name
  fleet = Fleet(run, FLAGS.seed)
  out = {}
  try:
    print(f"one simulated worker: {worker_rate():.2f} groups/s at full occupancy ({FLAGS.slots // FLAGS.group_size} "
          f"groups of {FLAGS.group_size} x <= {FLAGS.max_new_tokens} tokens per batch, {FLAGS.tok_s:g} tok/s, "
          f"{FLAGS.latency_s:g} s latency); trainer: {FLAGS.prompts_per_step} groups per step, staleness <= "
          f"{FLAGS.max_staleness}; box: {os.cpu_count()} cores", flush=True)
    fleet.resize(FLAGS.chaos_workers)
    t = time.time()
    while len(fleet.records()) < 3:  # the trainer's first steps (compiles: length buckets) are not throughput
      if time.time() - t > 600:
        raise RuntimeError(f"no 3 trainer steps within 600 s (see {fleet.run}/logs/trainer.log)")
      fleet.check()
      time.sleep(0.5)
    rows = out["rows"] = []
    for n in map(int, FLAGS.ns):
      rows.append(measure_phase(fleet, n))
      print_rows(rows[-1:])
    print_rows(rows)
    if FLAGS.chaos_s > 0:
      t0, q0 = time.time(), fleet.client.stats()["queues"]["prompts"]["acked"]
      s0 = max((r["step"] for r in fleet.records()), default=0)
      n_w, n_v, n_t = chaos(fleet, FLAGS.chaos_s)
      dt, q1 = time.time() - t0, fleet.client.stats()["queues"]["prompts"]["acked"]
      out["chaos"] = dict(worker_preemptions=n_w, verifier_preemptions=n_v, trainer_preemptions=n_t, seconds=dt,
                          finished=(q1 - q0) / dt,
                          steps=max((r["step"] for r in fleet.records()), default=0) - s0, timeline=timeline(fleet, t0))
      print(f"preemption: {n_w} worker and {n_v} verifier preemptions (SIGKILL / SIGTERM alternately, each "
            f"replaced by a fresh one) and {n_t} trainer preemptions in {dt:.0f} s at {FLAGS.chaos_workers} workers; groups finished "
            f"{out['chaos']['finished']:.1f}/s")
      for e in out["chaos"]["timeline"]:
        print(f"  t={e['t']:6.1f} s  {e['event']}: at step {e['step']}, resumed from step {e['resumed_at']}; "
              f"first step after: {e['stale_after']} groups dropped as stale, {e['wait_after_s']} s waiting")
    fleet.stop()
    out["exactly_once"] = exactly_once(run, FLAGS.prompts_per_step)
    print("exactly once:", json.dumps(out["exactly_once"]), flush=True)
    out["pulls"] = pull_check(run)
    print("weight pulls:", json.dumps(out["pulls"]), flush=True)
    if FLAGS.json:
      with open(FLAGS.json, "w") as f:
        json.dump(out, f)
  finally:
    for p in [fleet.trainer, fleet.server, *fleet.workers.values(), *fleet.verifiers.values(), *fleet.gone]:
      p.kill() if p.poll() is None else None
    if tmp:
      tmp.cleanup()


if __name__ == "__main__":
  app.run(main)
