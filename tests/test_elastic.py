"""Elastic workers through launch.sh itself (issue 42 item 3): on a real `launch.sh local` run, `add-worker` starts a
worker whose rollouts the server accepts; `remove-worker` SIGTERMs it, it drains and hands back, exits, and the
supervisor does not restart it; the run still finishes with every step trained exactly once. Bad input to either
command, and a run dir with no supervisor, are refused naming them. ~1-1.5 min on 2 cores."""
import os
import re
import subprocess
import time

from bench import util as benchutil
from bench.elastic import QueueLog
import data
from test_signals import processes_of
from test_system import ROOT, free_port, steps_done, tiny_base
from tools import plot

STEPS = 16


def elastic(verb, run, *args):
  return subprocess.run(["bash", "launch.sh", verb, f"--run_dir={run}", *args], cwd=ROOT, capture_output=True,
                        text=True, timeout=120)


def test_add_and_remove_a_worker_of_a_running_local_run(tmp_path):
  run = str(tmp_path / "run")
  os.makedirs(run)
  tiny_base(run, data.load_tokenizer(data.build_task_tokenizer(run, "arithmetic", seed=0)))
  # test_signals' short run, one worker to start with; --drain_s=0: what a removed worker has in flight is handed
  # back at once (with the default 10 s this tiny policy's 8-token groups would just finish in the drain).
  cmd = ["bash", "launch.sh", "local", f"--run_dir={run}", f"--steps={STEPS}", f"--port={free_port()}", "--skip_eval",
         "--no_chaos", "--workers=1", "--worker_args=--lease_s=6 --slots=8 --chunk_steps=4 --verifier_workers=0 "
         "--drain_s=0", "--", "--prompts_per_step=2", "--group_size=4", "--checkpoint_every=100",
         "--task_args=difficulty=1,ops=+-", "--get_wait_s=0.5", "--train_size=100", "--prefetch_steps=1",
         "--max_staleness=1"]
  logpath = str(tmp_path / "launch.log")
  log = open(logpath, "w")
  proc = subprocess.Popen(cmd, cwd=ROOT, env=benchutil.child_env(), stdout=log, stderr=subprocess.STDOUT,
                          start_new_session=True)
  try:
    for args, err in ((["--run_dir=" + str(tmp_path / "none")], "no launch.sh local is in its RL phase"),
                      (["0"], "'0' is not a worker count"), (["--workers=2"], "unknown flag --workers=2")):
      r = subprocess.run(["bash", "launch.sh", "add-worker", *args], cwd=ROOT, capture_output=True, text=True)
      assert r.returncode == 2 and err in r.stderr, (args, r.stderr)
    t0 = time.time()
    while steps_done(run) < 1:
      assert proc.poll() is None and time.time() - t0 < 300, open(logpath).read()[-3000:]
      time.sleep(0.3)
    r = elastic("remove-worker", run)  # the last worker stays
    assert r.returncode == 2 and "the last one stays" in r.stderr, r.stderr

    r = elastic("add-worker", run)
    assert r.returncode == 0 and r.stdout.strip() == "started worker1", (r.stdout, r.stderr)
    rollouts, t0 = QueueLog(os.path.join(run, "server", "queue-rollouts.log")), time.time()
    while not any(op == 1 and h["meta"]["json"].get("worker") == "worker1" for op, h in rollouts.new()):
      assert time.time() - t0 < 120 and steps_done(run) < STEPS, "no rollout from worker1 before the run ended"
      time.sleep(0.2)

    r = elastic("remove-worker", run, "worker7")
    assert r.returncode == 2 and "cannot remove worker7: running are worker0 worker1" in r.stderr, r.stderr
    r = elastic("remove-worker", run, "worker1")
    assert r.returncode == 0 and re.fullmatch(r"worker1 exited \(rc=0\) \d+ s after its SIGTERM\n", r.stdout), r
    wlog = open(os.path.join(run, "logs", "worker1.log")).read()
    assert "worker worker1: SIGTERM, draining" in wlog and "worker worker1 stopped after" in wlog, wlog[-2000:]
    # What it had in flight went back (groups with tokens as partial rollouts), before it exited.
    m = re.search(r"handed back (\d+) partial rollouts \((\d+) generated tokens kept", wlog)
    released = [h for op, h in QueueLog(os.path.join(run, "server", "queue-prompts.log")).new() if op == 4]
    assert len(released) >= (int(m.group(1)) if m else 0), (m, len(released))
    assert not os.path.exists(os.path.join(run, "pids", "worker1.pid"))
    time.sleep(3)  # three supervisor ticks: it would have restarted it by now
    assert not [p for p in processes_of(run) if "--worker_id=worker1" in p[1]]
    sup = os.path.join(run, "logs", "supervisor.log")
    assert not os.path.exists(sup) or "worker1" not in open(sup).read()

    assert proc.wait(timeout=300) == 0, open(logpath).read()[-3000:]
    assert open(os.path.join(run, "DONE")).read() == str(STEPS)
    chk = plot.exactly_once(plot.read_jsonl(os.path.join(run, "metrics.jsonl")))
    assert chk["steps"] == STEPS and chk["twice_trained"] == 0 and not chk["missing_steps"], chk
    assert not processes_of(run)
  finally:
    if proc.poll() is None:
      os.killpg(proc.pid, 9)
    for pid, _ in processes_of(run):
      os.kill(pid, 9)
    log.close()
