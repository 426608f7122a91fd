"""Benchmark: workers or verifiers joining and leaving a running job (`launch.sh add-worker` / `remove-worker`,
`add-verifier` / `remove-verifier`), per event.

Starts a real `bash launch.sh local` (server, trainer, --workers workers under the launcher's supervisor) in a fresh
run dir with a demo-shaped policy (random weights; or --base=DIR, e.g. runs/local/base after `launch.sh local`), waits
until every initial worker's rollouts arrive, then --reps times a join and a leave with a cold compilation cache and
one with the filled cache, interleaved, each time adding one worker and removing that same worker:
  join_s      `launch.sh add-worker` called -> the new worker's first rollout accepted by the server: its record in
              the server's rollouts queue log, which the server fsyncs before it answers the put (polled every
              20 ms). Cold: the run's cache dir (launch.sh sets JAX_COMPILATION_CACHE_DIR=RUN_DIR/jax_cache) is
              emptied just before the add (the running roles keep the programs they have); warm: as the earlier
              workers left it. It includes up to 1 s of the supervisor's tick, which takes the request. Its parts,
              from the worker's log: process up (its first line: imports, tokenizer, verifier pool), weights pulled
              and engine built, and the first group's own decode (its gen_s; with the decode compile when cold);
              and the first rollout's own stats: the fractions of its time decoding and waiting for prompts (the
              trainer issues them paced: the workers already there hold theirs) or for weights (rollout.Window).
  leave_s     `launch.sh remove-worker NAME` called, once the worker has worked --settle_s -> its process gone.
              Its parts: SIGTERM seen by the worker (the supervisor's tick, then the decode chunk under way; its
              log), the last partial rollout stored by the server (a release record in the prompts queue log; none
              if nothing was in flight), drained (its "stopped after" line), then the exit; and the command's own
              return (the supervisor answers on its tick after the exit).
  tokens      kept: what the worker logged as handed back ("handed back N partial rollouts (K generated tokens
              kept ..."); stored: the tokens of its partial rollouts in the server's release records (kept - stored
              were refused as no longer its prompts: lost); continued: of those, what the next workers resumed (the
              resumed_tokens of each id's accepted rollout); lost = (kept - stored) + (stored - continued) over the
              ids that came back as rollouts; pending: stored tokens of ids not yet back when the run was stopped.
--role=verifier: the run starts with one verifier (the workers then send every group to the queue "to_score"), and
each round adds one verifier and removes it: join_s is `add-verifier` called -> its log's first "groups scored" line
(written after the batch's put and ack; process up: its "serving" line), leave_s `remove-verifier` called -> its
process gone (it finishes the batch in hand: nothing is handed back; its "stopped after" line). A verifier compiles
nothing, so there is no cold/warm split; the exactly-once check says nothing was lost.
With rollout.py's default --drain_s=10 the groups in flight may finish before the worker leaves (then nothing is
handed back and leave_s includes their decode); --drain_s=0 (this bench's default) measures the hand-back itself.
The run is then stopped in order (`launch.sh stop`; --steps only bounds it) and tools/plot.py's exactly-once check
is printed. Prints every event, then median and min-max per cache condition.

  python -m bench.elastic --reps=3
  python -m bench.elastic --reps=2 --drain_s=10 --base=runs/local/base
  python -m bench.elastic --role=verifier --reps=5
"""
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import tempfile
import time

from absl import app, flags

from bench import util as benchutil
import param_server as ps
from tools import plot

ROOT = benchutil.ROOT
FLAGS = flags.FLAGS


class QueueLog:
  """Follows one of the server's queue logs (param_server._Queue's framed records) as it grows: new() returns the
  (op, header) of each whole record appended since the last call (op 1 put, 2 ack, 3 fail, 4 release). A log
  replaced by compaction (past 64 MB) is read again from its start."""

  def __init__(self, path):
    self.path, self.off, self.ino = path, 0, None

  def new(self):
    try:
      f = open(self.path, "rb")
    except FileNotFoundError:
      return []
    with f:
      st = os.fstat(f.fileno())
      if st.st_ino != self.ino or st.st_size < self.off:
        self.ino, self.off = st.st_ino, 0
      f.seek(self.off)
      data = f.read()
    rec, n, out, off = ps._Queue._REC, ps._Queue._REC.size + 4, [], 0
    while off + n <= len(data):
      magic, op, hl, pl, _ = rec.unpack_from(data, off)
      if magic != ps._Queue._LOG_MAGIC:
        raise ValueError(f"{self.path}: no record at offset {self.off + off}")
      if off + n + hl + pl > len(data):
        break  # still being appended
      out.append((op, json.loads(data[off + n:off + n + hl])))
      off += n + hl + pl
    self.off += off
    return out


def tokens_of(meta, field):
  """Token count of a stored item's array field (a list of arrays: one per sample)."""
  specs = meta.get("arrays", {}).get(field, [])
  return sum(s["nbytes"] // ps.DTYPES[s["dtype"]] for s in (specs if isinstance(specs, list) else [specs]))


class Watch:
  """What the server stored, each record stamped with the time it was first seen: the first rollout of each worker,
  each rollout id's resumed_tokens, and every release (a partial rollout handed back) in order."""

  def __init__(self, run):
    self.rollouts = QueueLog(os.path.join(run, "server", "queue-rollouts.log"))
    self.prompts = QueueLog(os.path.join(run, "server", "queue-prompts.log"))
    self.first, self.resumed, self.releases = {}, {}, []

  def poll(self):
    t = time.time()
    for op, h in self.rollouts.new():
      if op == 1:
        js = h["meta"]["json"]
        self.first.setdefault(js.get("worker"), (t, js))
        self.resumed.setdefault(h["id"], int(js.get("resumed_tokens", 0)))
    self.releases += [(t, h["id"], tokens_of(h["meta"], "partial_tokens")) for op, h in self.prompts.new() if op == 4]


def log_times(path, name):
  """{event: time} from a worker's or verifier's log (absl's local-time prefix, e.g. I1207 02:54:13.632939): the
  first line of each event (a regular expression per event). The bench prints a missing one as -1 s (not logged)."""
  marks = ({"started": f"verifier {name}: serving", "ready": rf"verifier {name}: \d+ groups scored",
            "stopped": f"verifier {name} stopped after"} if name.startswith("verifier") else
           {"started": f"worker {name} waiting for weights", "ready": f"worker {name}: v",
            "sigterm": f"worker {name}: SIGTERM, draining", "stopped": f"worker {name} stopped after"})
  year, out = time.localtime().tm_year, {}
  for line in open(path, errors="replace"):
    m = re.match(r"[IWEF](\d\d)(\d\d) (\d\d):(\d\d):(\d\d)\.(\d+)", line)
    for k, text in marks.items():
      if m and k not in out and re.search(text, line):
        mo, d, hh, mm, ss, us = map(int, m.groups())
        out[k] = time.mktime((year, mo, d, hh, mm, ss, 0, 0, -1)) + us / 1e6
  return out


def alive(pid):
  try:
    return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
  except OSError:
    return False


def launcher(verb, run, *args, **kw):
  return subprocess.run(["bash", "launch.sh", verb, f"--run_dir={run}", *args], cwd=ROOT, capture_output=True,
                        text=True, timeout=kw.get("timeout", 120))


def prepare(run):
  """The run dir's tokenizer (as launch.sh builds it) and base policy, so launch.sh skips its SFT."""
  import data
  import model
  tok = data.load_tokenizer(data.build_task_tokenizer(run, "arithmetic", seed=0))
  if FLAGS.base:
    shutil.copytree(FLAGS.base, os.path.join(run, "base"))
    return
  kw = dict(kv.split("=") for kv in FLAGS.model_config.split(","))
  cfg = model.Config.from_hf_dict(dict(
      model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=tok.vocab_size,
      hidden_size=int(kw["d_model"]), num_hidden_layers=int(kw["n_layers"]), num_attention_heads=int(kw["n_heads"]),
      num_key_value_heads=int(kw["n_kv_heads"]), intermediate_size=int(kw["ffw_dim"]), max_position_embeddings=128,
      rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=tok.bos_id,
      eos_token_id=tok.eos_id))
  model.save_hf_checkpoint(os.path.join(run, "base"), cfg, benchutil.random_params(cfg, 0))


def wait(cond, what, watch, launch, timeout):
  t0 = time.time()
  while not cond():
    watch.poll()
    if launch.poll() is not None:
      raise RuntimeError(f"launch.sh exited (rc={launch.returncode}) while waiting for {what}")
    if time.time() - t0 > timeout:
      raise RuntimeError(f"no {what} within {timeout:.0f} s")
    time.sleep(0.02)


def join(run, watch, launch, cold):
  cache = os.path.join(run, "jax_cache")
  if cold:  # its entries, not the dir: the running roles keep writing there
    for f in os.listdir(cache) if os.path.isdir(cache) else ():
      p = os.path.join(cache, f)
      shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)
  t0 = time.time()
  r = launcher(f"add-{FLAGS.role}", run)
  if r.returncode != 0 or not re.search(rf"started ({FLAGS.role}\d+)", r.stdout):
    raise RuntimeError(f"add-{FLAGS.role} failed (rc={r.returncode}): {r.stdout}{r.stderr}")
  name = re.search(rf"started ({FLAGS.role}\d+)", r.stdout).group(1)
  pid = int(open(os.path.join(run, "pids", f"{name}.pid")).read())
  if FLAGS.role == "verifier":
    path = os.path.join(run, "logs", f"{name}.log")
    wait(lambda: "ready" in log_times(path, name), f"a scored batch from {name}", watch, launch, FLAGS.timeout_s)
    lt = log_times(path, name)
    return dict(name=name, pid=pid, join_s=lt["ready"] - t0, started_s=lt.get("started", t0 - 1) - t0)
  wait(lambda: name in watch.first, f"rollout from {name}", watch, launch, FLAGS.timeout_s)
  lt = log_times(os.path.join(run, "logs", f"{name}.log"), name)
  t, js = watch.first[name]
  return dict(name=name, pid=pid, join_s=t - t0, started_s=lt.get("started", t0 - 1) - t0,
              ready_s=lt.get("ready", t0 - 1) - t0, first_gen_s=float(js.get("gen_s", 0.0)),
              **{k: float(js.get(f"worker_{k}_frac", 0.0)) for k in ("busy", "wait_prompts", "wait_weights")})


def leave(run, watch, launch, ev):
  t_end = time.time() + FLAGS.settle_s
  wait(lambda: time.time() >= t_end, "the settle time", watch, launch, FLAGS.settle_s + 5)
  n_rel = len(watch.releases)
  t0 = time.time()
  cli = subprocess.Popen(["bash", "launch.sh", f"remove-{FLAGS.role}", f"--run_dir={run}", ev["name"]], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  t_exit = t_cli = None
  while t_exit is None or t_cli is None:
    watch.poll()
    t_exit = t_exit or (None if alive(ev["pid"]) else time.time())
    t_cli = t_cli or (None if cli.poll() is None else time.time())
    if time.time() - t0 > 120:
      raise RuntimeError(f"{ev['name']} still there 120 s after remove-{FLAGS.role}")
    time.sleep(0.02)
  out, err = cli.communicate()
  if cli.returncode != 0 or "exited" not in out:
    raise RuntimeError(f"remove-{FLAGS.role} failed (rc={cli.returncode}): {out}{err}")
  watch.poll()
  rel = watch.releases[n_rel:] if FLAGS.role == "worker" else []  # (a verifier hands back nothing)
  log = open(os.path.join(run, "logs", f"{ev['name']}.log")).read()
  lt = log_times(os.path.join(run, "logs", f"{ev['name']}.log"), ev["name"])
  m = re.findall(r"handed back (\d+) partial rollouts \((\d+) generated tokens kept; (\d+) no longer ours", log)
  ev.update(leave_s=t_exit - t0, cli_s=t_cli - t0, sigterm_s=lt.get("sigterm", t0 - 1) - t0,
            stopped_s=lt.get("stopped", t0 - 1) - t0, handback_s=rel[-1][0] - t0 if rel else None, answer=out.strip(),
            handed_back=int(m[-1][0]) if m else 0, kept=int(m[-1][1]) if m else 0, refused=int(m[-1][2]) if m else 0,
            released={i: n for _, i, n in rel}, drained="stopped after" in log)
  return ev


def tokens(ev, watch):
  """lost / continued / pending of one leave, once the run is over (see the module docstring)."""
  back = {i: n for i, n in ev["released"].items() if i in watch.resumed}
  stored = sum(ev["released"].values())
  continued = sum(min(n, watch.resumed[i]) for i, n in back.items())
  return dict(stored=stored, continued=continued, pending=stored - sum(back.values()),
              lost=(ev["kept"] - stored) + (sum(back.values()) - continued))


def fmt(v, unit=" s"):
  if not v:
    return "-"
  return f"median {statistics.median(v):.2f}{unit} (min {min(v):.2f}, max {max(v):.2f}, n={len(v)})"


def define_flags():  # here, not at import: tests import the log reader above
  flags.DEFINE_enum("role", "worker", ["worker", "verifier"], "Which role joins and leaves (the run starts with one "
                    "verifier when it is verifier). Default worker.")
  flags.DEFINE_integer("reps", 2, "Rounds of (cold join + leave, warm join + leave) (count). Default 2.")
  flags.DEFINE_integer("workers", 1, "Workers the run starts with (count; the paced prompts go to more workers "
                       "the more there are, and a joiner with none in flight has nothing to hand back). Default 1.")
  flags.DEFINE_integer("steps", 1000, "The run's --steps (steps): an upper bound, the run is stopped after the "
                       "events. Default 1000.")
  flags.DEFINE_integer("max_new_tokens", 64, "Completion budget (tokens; a random policy's completions mostly run "
                       "to it, so groups are in flight when a worker leaves). Default 64.")
  flags.DEFINE_float("drain_s", 0.0, "The workers' --drain_s (seconds): 0 hands the groups in flight back at once; "
                     "rollout.py's default is 10. Default 0.")
  flags.DEFINE_float("settle_s", 3.0, "Time a joined worker works before it is removed (seconds). Default 3.")
  flags.DEFINE_string("base", None, "HF checkpoint dir to use as the run's base (the demo's: runs/local/base). "
                      "Default none: a random policy of --model_config's shape.")
  flags.DEFINE_string("model_config", "d_model=128,n_layers=2,n_heads=4,n_kv_heads=2,ffw_dim=512",
                      "Shape of the random base. Default train.py's SFT base shape.")
  flags.DEFINE_string("train_args", "--nodynamic_sampling --checkpoint_every=20",
                      "train.py flags after the demo's (after `--`; a random policy's groups have zero reward "
                      "variance, so dynamic sampling would drop them all). Default '--nodynamic_sampling "
                      "--checkpoint_every=20'.")
  flags.DEFINE_string("run_dir", None, "Run dir, kept. Default none: a temporary one, removed at the end.")
  flags.DEFINE_float("timeout_s", 600.0, "Time the run's start or one join may take before the bench gives up "
                     "(seconds). Default 600.")

def main(argv):
  del argv
  run = FLAGS.run_dir or tempfile.mkdtemp(prefix="elastic-")
  os.makedirs(run, exist_ok=True)
  prepare(run)
  env = benchutil.child_env()
  env.pop("JAX_COMPILATION_CACHE_DIR", None)  # launch.sh's own: RUN_DIR/jax_cache
  cmd = ["bash", "launch.sh", "local", f"--run_dir={run}", f"--steps={FLAGS.steps}", "--skip_eval", "--no_chaos",
         f"--workers={FLAGS.workers}", f"--max_new_tokens={FLAGS.max_new_tokens}",
         f"--verifiers={int(FLAGS.role == 'verifier')}", f"--worker_args=--drain_s={FLAGS.drain_s}", "--",
         *FLAGS.train_args.split()]
  print(f"run: {' '.join(cmd)}\nload average at start: {open('/proc/loadavg').read().split()[:3]}", flush=True)
  log = open(os.path.join(run, "launch.log"), "w")
  launch = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
  watch, events = Watch(run), []
  try:
    wait(lambda: all(f"worker{i}" in watch.first for i in range(FLAGS.workers)), "rollout from every initial worker",
         watch, launch, FLAGS.timeout_s)
    if FLAGS.role == "verifier":  # the workers send to "to_score" once the first verifier has asked for work
      v0 = os.path.join(run, "logs", "verifier0.log")
      wait(lambda: os.path.exists(v0) and "ready" in log_times(v0, "verifier0"), "a scored batch from verifier0",
           watch, launch, FLAGS.timeout_s)
    for r in range(FLAGS.reps):
      for cold in ((True, False) if FLAGS.role == "worker" else (None,)):
        ev = join(run, watch, launch, cold)
        ev = leave(run, watch, launch, dict(ev, cache={True: "cold", False: "warm", None: "-"}[cold], round=r))
        events.append(ev)
        if FLAGS.role == "verifier":
          print(f"round {r}: {ev['name']} join {ev['join_s']:.2f} s (process up {ev['started_s']:.2f} s); leave "
                f"{ev['leave_s']:.2f} s (stopped after its batch {ev['stopped_s']:.2f}, command returned "
                f"{ev['cli_s']:.2f}: {ev['answer']!r})", flush=True)
          continue
        hb = "-" if ev["handback_s"] is None else f"{ev['handback_s']:.2f} s"
        print(f"round {r} {ev['cache']}: {ev['name']} join {ev['join_s']:.2f} s (process up {ev['started_s']:.2f}, "
              f"weights and engine {ev['ready_s']:.2f}, its first group's decode {ev['first_gen_s']:.2f} s; since "
              f"ready: busy {ev['busy']:.0%}, waiting for prompts {ev['wait_prompts']:.0%}, for weights "
              f"{ev['wait_weights']:.0%}); leave "
              f"{ev['leave_s']:.2f} s (SIGTERM seen {ev['sigterm_s']:.2f}, last hand-back stored {hb}, drained "
              f"{ev['stopped_s']:.2f}, command returned {ev['cli_s']:.2f}: {ev['answer']!r}); handed back "
              f"{ev['handed_back']} groups, {ev['kept']} tokens", flush=True)
  finally:
    launcher("stop", run, timeout=300)
    try:
      launch.wait(timeout=120)
    except subprocess.TimeoutExpired:
      os.killpg(launch.pid, signal.SIGKILL)
    watch.poll()
  print(f"load average at end: {open('/proc/loadavg').read().split()[:3]}")
  for ev in events if FLAGS.role == "worker" else ():
    ev.update(tokens(ev, watch))
    print(f"round {ev['round']} {ev['cache']}: tokens kept {ev['kept']}, stored {ev['stored']}, continued "
          f"{ev['continued']}, lost {ev['lost']}, pending at the stop {ev['pending']}; refused hand-backs "
          f"{ev['refused']}; drained and stopped cleanly: {ev['drained']}")
  for cache in ("cold", "warm", "-"):
    evs = [e for e in events if e["cache"] == cache]
    if not evs:
      continue
    print(f"{cache} cache: join_s {fmt([e['join_s'] for e in evs])}; of which up to its process's first log line "
          f"{fmt([e['started_s'] for e in evs])}" + (f", to weights and engine {fmt([e['ready_s'] for e in evs])}"
                                                      if FLAGS.role == "worker" else ""))
  col = lambda k: [e[k] for e in events if e[k] is not None]  # noqa: E731
  print(f"leave_s {fmt(col('leave_s'))}; hand-back {fmt(col('handback_s'))}; command {fmt(col('cli_s'))}")
  if FLAGS.role == "worker":
    print(f"tokens lost per leave {fmt(col('lost'), '')}; kept per leave {fmt(col('kept'), '')} "
          f"(drain_s={FLAGS.drain_s}, max_new_tokens={FLAGS.max_new_tokens})")
  chk = plot.exactly_once(plot.read_jsonl(os.path.join(run, "metrics.jsonl")))
  print(f"exactly once: {chk['rollouts']} rollouts in {chk['steps']} steps, twice-trained {chk['twice_trained']}, "
        f"missing steps {len(chk['missing_steps'])}")
  if not FLAGS.run_dir:
    shutil.rmtree(run, ignore_errors=True)


if __name__ == "__main__":
  define_flags()
  app.run(main)
