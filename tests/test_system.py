"""The running system end to end: launch.sh local under kill -9 of a worker, the trainer and the server, and
SIGTERM (a TPU preemption notice) of a worker and of the trainer mid-collection.

A short RL run (tiny random base policy, built-in arithmetic) must still reach its final step; in the surviving
lineage every rollout is trained (or skipped as stale / zero-variance) exactly once and the final checkpoint's
consumed set is exactly those; every consumed rollout is acked, and no issued prompt is lost (it is consumed, or
its rollout or the prompt itself is still queued on the server).
"""
import json
import os
import signal
import socket
import subprocess
import time


from bench import fleet
from bench import util as benchutil
import data
from tools import plot

ROOT = benchutil.ROOT
STEPS = 48  # the last kill (server) lands at step >= 34 with the workers paused: the run still has steps to go


def free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


tiny_base = benchutil.tiny_base  # (test_elastic, test_signals, test_launch import it from here)
read_state = fleet.read_state  # (test_train.py imports it from here)


def steps_done(run):
  path = os.path.join(run, "metrics.jsonl")
  if not os.path.exists(path):
    return 0
  with open(path) as f:
    # Only whole lines: the last one may be mid-write.
    return max([json.loads(l)["step"] for l in f if l.endswith("\n") and l.strip()] + [0])


def wait_until(cond, timeout, what, proc):
  t0 = time.time()
  while not cond():
    if proc.poll() is not None:
      raise AssertionError(f"launch.sh exited (rc={proc.returncode}) while waiting for {what}")
    if time.time() - t0 > timeout:
      raise AssertionError(f"timed out after {timeout}s waiting for {what}")
    time.sleep(0.5)


def pid_of(run, role):
  with open(os.path.join(run, "pids", f"{role}.pid")) as f:
    return int(f.read())


def signal_roles(run, roles, sig):
  for role in roles:
    os.kill(pid_of(run, role), sig)


def kill_roles(run):
  """SIGKILL every role of a launch.sh local run by its pidfile (roles run in their own sessions: killing
  launch.sh's process group does not reach them)."""
  pids = os.path.join(run, "pids")
  for name in os.listdir(pids) if os.path.isdir(pids) else []:
    try:
      os.kill(int(open(os.path.join(pids, name)).read()), signal.SIGKILL)
    except (OSError, ValueError):
      pass


def kill9_and_wait_restart(run, role, proc, sig=signal.SIGKILL):
  """SIGKILL (or `sig`) a role and wait until the supervisor has started its replacement (a new, live pid)."""
  old = pid_of(run, role)
  os.kill(old, sig)

  def replaced():
    try:
      pid = pid_of(run, role)
      os.kill(pid, 0)
      return pid != old
    except (OSError, ValueError):
      return False
  wait_until(replaced, 60, f"the {role} restart", proc)


def start_run(tmp_path, steps, launch_flags=(), train_flags=(), worker_args=""):
  """launch.sh local on a tiny random base policy, in its own session (on failure the whole tree is killed)."""
  run = str(tmp_path / "run")
  os.makedirs(run)
  tok = data.load_tokenizer(data.build_task_tokenizer(run, "arithmetic", seed=0))
  tiny_base(run, tok)
  cmd = ["bash", "launch.sh", "local", f"--run_dir={run}", f"--steps={steps}", f"--port={free_port()}",
         "--skip_eval", "--no_chaos", *launch_flags,  # this test kills roles itself, at chosen points
         f"--worker_args=--lease_s=6 --slots=8 --chunk_steps=4 --verifier_workers=0 {worker_args}",
         "--", "--prompts_per_step=2", "--group_size=4", "--checkpoint_every=2", "--task_args=difficulty=1,ops=+-",
         "--get_wait_s=0.5", "--rollout_lease_s=60", "--train_size=100", "--prefetch_steps=1",
         "--curate_prompts=0", "--pass_band=",  # the demo's curation: a random policy solves no prompt, none is kept
         *train_flags]
  log = open(os.path.join(str(tmp_path), "launch.log"), "w")
  proc = subprocess.Popen(cmd, cwd=ROOT, env=benchutil.child_env(), stdout=log, stderr=subprocess.STDOUT,
                          start_new_session=True)
  return run, proc, log


def finish_run(tmp_path, run, proc, log, steps, victims):
  """Waits for the run's end (killing everything if it hangs) and checks it: rc 0, DONE at `steps`, each victim
  restarted by the supervisor, exactly-once accounting."""
  try:
    rc = proc.wait(timeout=600)
  finally:
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)
      kill_roles(run)
    log.close()
  out = open(os.path.join(str(tmp_path), "launch.log")).read()
  assert rc == 0, out[-3000:]
  assert open(os.path.join(run, "DONE")).read() == str(steps)
  text = open(os.path.join(run, "logs", "supervisor.log")).read()
  for role in victims:
    assert f"{role} exited" in text, text
  check_exactly_once(run, steps)


def test_kill9_worker_trainer_server_run_completes_exactly_once(tmp_path):
  run, proc, log = start_run(tmp_path, STEPS)
  try:
    workers = ("worker0", "worker1")
    # Each kill happens while the run cannot finish without the victim coming back: the other processes that
    # could carry it are paused (SIGSTOP), and the trainer's backlog is bounded by --prefetch_steps.
    wait_until(lambda: steps_done(run) >= 2, 400, "step 2", proc)
    signal_roles(run, ["worker1"], signal.SIGSTOP)
    kill9_and_wait_restart(run, "worker0", proc)
    signal_roles(run, ["worker1"], signal.SIGCONT)
    wait_until(lambda: steps_done(run) >= 10, 300, "step 10", proc)
    signal_roles(run, workers, signal.SIGSTOP)
    kill9_and_wait_restart(run, "trainer0", proc)
    signal_roles(run, workers, signal.SIGCONT)
    # The restarted trainer resumes from its last checkpoint and must get past where it was killed.
    wait_until(lambda: steps_done(run) >= 20, 300, "step 20 after the trainer restart", proc)
    # SIGTERM: a worker drains (hands back its prompts), the trainer stops mid-collection (workers paused, so it
    # is waiting for its batch) and must hand the partial batch back instead of checkpointing it as consumed.
    kill9_and_wait_restart(run, "worker0", proc, signal.SIGTERM)
    wait_until(lambda: steps_done(run) >= 26, 300, "step 26 after the worker SIGTERM", proc)
    signal_roles(run, workers, signal.SIGSTOP)
    time.sleep(1.0)
    kill9_and_wait_restart(run, "trainer0", proc, signal.SIGTERM)
    signal_roles(run, workers, signal.SIGCONT)
    wait_until(lambda: steps_done(run) >= 34, 300, "step 34 after the trainer SIGTERM", proc)
    signal_roles(run, workers, signal.SIGSTOP)
    kill9_and_wait_restart(run, "server", proc)
    signal_roles(run, workers, signal.SIGCONT)
  except BaseException:
    os.killpg(proc.pid, signal.SIGKILL)
    kill_roles(run)
    raise
  finish_run(tmp_path, run, proc, log, STEPS, ("worker0", "trainer0", "server"))
  text = open(os.path.join(run, "logs", "supervisor.log")).read()
  assert "trainer0 exited (rc=0)" in text, text  # the SIGTERMed trainer checkpointed and stopped cleanly


def test_two_trainer_processes_tp_workers_survive_kill9_of_a_shard_server_and_a_trainer(tmp_path):
  """The pod layout on one box: 2 gloo trainer processes (each stages its own shards on its own shard server),
  workers with 2 devices pulling tensor-parallel slices. kill -9 of shard server 1 (its pieces of the current
  version are gone: the trainer must notice and re-publish) and of trainer process 1 (the supervisor restarts
  both trainer processes; they resume from the 2-process checkpoint)."""
  steps = 14
  run, proc, log = start_run(tmp_path, steps, ["--trainer_procs=2", "--worker_devices=2"])
  try:
    workers = ("worker0", "worker1")
    wait_until(lambda: steps_done(run) >= 3, 500, "step 3", proc)
    signal_roles(run, workers, signal.SIGSTOP)
    kill9_and_wait_restart(run, "shard1", proc)
    signal_roles(run, workers, signal.SIGCONT)
    wait_until(lambda: steps_done(run) >= 7, 300, "step 7 after the shard server restart", proc)
    signal_roles(run, workers, signal.SIGSTOP)
    kill9_and_wait_restart(run, "trainer1", proc)
    signal_roles(run, workers, signal.SIGCONT)
  except BaseException:
    os.killpg(proc.pid, signal.SIGKILL)
    kill_roles(run)
    raise
  finish_run(tmp_path, run, proc, log, steps, ("shard1", "trainer1"))


def test_demo_chaos_preempts_a_worker_and_the_trainer_and_the_run_completes_exactly_once(tmp_path):
  """The demo's own preemption (launch.sh --chaos, on by default for the demo): worker0 SIGKILLed at 30% of the
  steps, the trainer SIGTERMed at 60%, both restarted by the supervisor; events.jsonl and the printed lines say
  when; plot.py's exactly-once check (what the demo prints) agrees with the ledger check."""
  steps = 20
  run, proc, log = start_run(tmp_path, steps, ["--chaos"])
  finish_run(tmp_path, run, proc, log, steps, ("worker0", "trainer0"))
  events = plot.read_jsonl(os.path.join(run, "events.jsonl"))
  assert [(e["role"], e["event"].split()[0]) for e in events] == [
      ("worker0", "down"), ("worker0", "back"), ("trainer0", "down"), ("trainer0", "back")], events
  assert events[0]["step"] >= 6 and events[2]["step"] >= 12 and events[0]["pid"] != events[1]["pid"]
  out = open(os.path.join(str(tmp_path), "launch.log")).read()
  assert "worker0 down (SIGKILL)" in out and "trainer0 down (SIGTERM)" in out, out[-3000:]
  assert "trainer0 exited (rc=0)" in open(os.path.join(run, "logs", "supervisor.log")).read()
  chk = plot.exactly_once(plot.read_jsonl(os.path.join(run, "metrics.jsonl")))
  assert chk["steps"] == steps and chk["twice_trained"] == 0 and chk["missing_steps"] == [], chk
  assert "twice-trained: 0" in out and os.path.getsize(os.path.join(run, "curves.png")) > 0, out[-2000:]
  # Load balance per step (issue 17): the trainer's wait fraction and the workers' figures, and the summary.
  recs = plot.final_records(plot.read_jsonl(os.path.join(run, "metrics.jsonl")))
  assert all(0 <= r["trainer_wait_frac"] <= 1 and 0 < r["worker_busy_frac"] <= 1 and r["worker_tok_s"] > 0
             and r["workers"] >= 1 and r["resumed_tokens"] >= 0 for r in recs), recs[-1]
  assert "balance (median of" in out and "generation discarded per trained token" in out, out[-2000:]
  # Generation accounting: every trained token is in the staleness histogram, within the bound (--max_staleness 4).
  assert all(sum(r["staleness_tokens"]) == r["trained_tokens"] > 0 and len(r["staleness_tokens"]) <= 5
             and set(r["dropped_tokens"]) == {"stale", "zero_var", "worker_stale"} for r in recs), recs[-1]


def check_exactly_once(run, steps):
  """The run's ledger: metrics lineage vs the final checkpoint vs what the server persisted (bench.fleet's check:
  each step once, nothing trained twice, consumed = trained + skipped, every consumed rollout acked, no prompt
  lost)."""
  assert fleet.exactly_once(run, 2)["steps"] == steps


def test_trainer_killed_and_sigtermed_during_curation_restarts_and_finishes(tmp_path):
  """Offline curation (--curate_prompts) survives its trainer: kill -9 and then SIGTERM while it rates the base
  policy (the workers paused, so it cannot have finished); each new incarnation rates under its own ids (the server
  drops re-puts of acked ids, so reusing them hung the restarted trainer forever) and the run finishes."""
  steps = 4
  run, proc, log = start_run(tmp_path, steps, train_flags=["--curate_prompts=60", "--pass_band=0,1"])
  workers = ("worker0", "worker1")

  def curating(n):
    path = os.path.join(run, "logs", "trainer0.log")
    return lambda: os.path.exists(path) and open(path, errors="replace").read().count("curation: base pass") >= n
  try:
    wait_until(lambda: all(os.path.exists(os.path.join(run, "pids", f"{w}.pid")) for w in workers), 200, "workers",
               proc)
    signal_roles(run, workers, signal.SIGSTOP)
    wait_until(curating(1), 300, "curation", proc)
    kill9_and_wait_restart(run, "trainer0", proc)
    wait_until(curating(2), 300, "curation after the kill -9", proc)
    kill9_and_wait_restart(run, "trainer0", proc, signal.SIGTERM)
    wait_until(curating(3), 300, "curation after the SIGTERM", proc)
    signal_roles(run, workers, signal.SIGCONT)
  except BaseException:
    os.killpg(proc.pid, signal.SIGKILL)
    kill_roles(run)
    raise
  finish_run(tmp_path, run, proc, log, steps, ("trainer0",))
  recs = [json.loads(l) for l in open(os.path.join(run, "metrics.jsonl"))]
  assert [r["curation_prompts"] for r in recs if "curation_prompts" in r] == [60]
