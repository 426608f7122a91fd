"""The verifier role (issue 42 item 2): the verdict cache, the server's count of a queue's consumers, and
`launch.sh local --verifiers=2` end to end: rollouts scored by the verifiers, kill -9 of one (and a SIGSTOPped one
whose leases expire) loses nothing, removing them all hands scoring back to the workers (what was waiting in
"to_score" included), adding one takes it back, and every step is trained exactly once. ~2-3 min on 2 cores."""
import json
import os
import signal
import subprocess
import time

import numpy as np

import data
import param_server as ps
import rollout
import train
from test_system import ROOT, finish_run, kill9_and_wait_restart, kill_roles, signal_roles, start_run, steps_done
from test_system import wait_until

STEPS = 48


def test_verdict_cache_runs_each_distinct_completion_once_and_keeps_only_clean_verdicts():
  # Verdicts per data.verify, the arithmetic task's exact-integer rule (tasks/arithmetic.py): "2" solves 1+1.
  p, q = data.Problem("a", "1+1=", "2", task="arithmetic"), data.Problem("b", "1+2=", "3", task="arithmetic")
  with data.VerifierPool(1, timeout_s=30, cache_size=4) as pool:
    assert pool.score([p, p, q, q, p], ["2", "2", "2", "3", " 2"]) == [1.0, 1.0, 0.0, 1.0, 1.0]
    assert (pool.ran, pool.reused) == (4, 1)  # the repeated ("1+1=", "2") ran once
    assert pool.score([q, p], ["3", "2"]) == [1.0, 1.0] and (pool.ran, pool.reused) == (4, 3)
    # A different problem with the same completion is its own verdict (countdown's verify reads the prompt).
    assert pool.score([data.Problem("a2", "2+0=", "2", task="arithmetic")], ["2"]) == [1.0] and pool.ran == 5
    assert len(pool.cache) == 4  # bounded: the least recently used went
    # A verifier error scores 0 and is not cached: the next call runs it again.
    bad = data.Problem("c", "x", "1", task="no_such_task")
    assert pool.score([bad], ["1"]) == [0.0] and pool.errors == 1
    assert pool.score([bad], ["1"]) == [0.0] and pool.errors == 2 and pool.ran == 7


def test_server_counts_a_queues_consumers_for_30_seconds():
  srv = ps.Server(ps.ServerConfig(token="t")).start()
  try:
    c = ps.Client("127.0.0.1", srv.port, token="t")
    c.get("to_score", 1)  # a worker draining what the verifiers left is not one
    assert c.stats()["queues"]["to_score"]["consumers"] == 0
    c.get("to_score", 1, consumer=True)
    ps.Client("127.0.0.1", srv.port, token="t", holder="other").get("to_score", 1, wait_s=0.2, consumer=True)
    assert c.stats()["queues"]["to_score"]["consumers"] == 2
    with srv.queues.all["to_score"].cond:  # as if they last asked 31 s ago
      srv.queues.all["to_score"].consumers = {k: t - 31 for k, t in srv.queues.all["to_score"].consumers.items()}
    assert c.stats()["queues"]["to_score"]["consumers"] == 0
  finally:
    srv.stop()


def test_a_rollout_that_cannot_be_scored_fails_alone_and_its_quarantine_reaches_the_trainer(monkeypatch):
  monkeypatch.setattr(rollout, "FLAGS", type("F", (), {"max_failures_in_a_row": 8}))  # (rollout's flags unparsed here)
  srv = ps.Server(ps.ServerConfig(token="t", max_failures=2)).start()
  try:
    c = ps.Client("127.0.0.1", srv.port, token="t")
    p = data.Problem("p1", "1+1=", "2", task="arithmetic")
    good = data.Rollout("s1", 0, "w", p, np.array([2, 5], np.int32), [np.array([7], np.int32)] * 2,
                        [np.array([-0.5], np.float32)] * 2, None)
    c.put("to_score", [good.to_wire(), {"id": "s2", "version": 0, "completions": "not a list"}])
    tok = type("Tok", (), {"decode": staticmethod(lambda ids: "2" if ids == [7] else "")})
    for _ in range(2):  # the batch fails, then each alone: s1 goes on, s2 is FAILed (re-issued once, then held)
      rollout.score_items(c, tok, data.VerifierPool(0), c.get("to_score", 10, lease_s=60), [])
    out = c.get("rollouts", 10)
    assert [x["id"] for x in out] == ["s1"] and list(data.Rollout.from_wire(out[0]).rewards) == [1.0, 1.0]
    assert out[0]["scored_by_verifier"] == 0.0 and out[0]["verdicts_reused_frac"] == 0.5
    assert c.get("to_score", 10) == [] and c.stats()["queues"]["to_score"]["quarantined"] == 1
    col = train.Collector(c, None, None, None, group_size=2, prefetch_steps=1, lease_s=60, wait_s=0.0,
                          max_staleness=0, dynamic_sampling=False, band=None)
    col.note_quarantined()  # the trainer counts the prompt consumed, naming the field that broke it
    assert [q["id"] for q in col.quarantined] == ["s2"] and "'completions'" in col.quarantined[0]["reason"]
    assert len(col.ledger) == 1
  finally:
    srv.stop()


def scored_by(run):
  """[(step, mean scored_by_verifier)] of the step records so far."""
  if not os.path.exists(os.path.join(run, "metrics.jsonl")):
    return []
  with open(os.path.join(run, "metrics.jsonl")) as f:
    recs = [json.loads(l) for l in f if l.endswith("\n") and '"rollout_ids"' in l]
  return [(r["step"], r["scored_by_verifier"]) for r in recs if "scored_by_verifier" in r]


def launch(verb, run, *args):
  return subprocess.run(["bash", "launch.sh", verb, f"--run_dir={run}", *args], cwd=ROOT, capture_output=True,
                        text=True, timeout=120)


def test_verifier_role_survives_kill9_leaves_and_rejoins_exactly_once(tmp_path):
  run, proc, log = start_run(tmp_path, STEPS, launch_flags=["--verifiers=2"], worker_args="--score_lease_s=6")
  try:
    def step_scored(want, after):  # a step past `after` whose groups were all (1.0) / none (0.0) scored remotely
      return lambda: any(s > after and v == want for s, v in scored_by(run))

    wait_until(step_scored(1.0, 0), 300, "a step scored by the verifiers", proc)
    # verifier1 stopped holding leases (they expire after --score_lease_s=6 and go to verifier0, and its late
    # puts are duplicates), then verifier0 killed: the run goes on only if the restarted verifier0 scores them.
    signal_roles(run, ["verifier1"], signal.SIGSTOP)
    time.sleep(2)
    kill9_and_wait_restart(run, "verifier0", proc)
    s = steps_done(run)
    wait_until(lambda: steps_done(run) >= s + 3, 300, "3 steps after the kill -9", proc)
    signal_roles(run, ["verifier1"], signal.SIGCONT)
    r = launch("remove-verifier", run, "2")  # both leave: the workers score their own again
    assert r.returncode == 0 and r.stdout.count("exited") == 2, (r.stdout, r.stderr)
    wait_until(step_scored(0.0, steps_done(run)), 300, "a step scored by the workers after the verifiers left", proc)
    r = launch("add-verifier", run)
    assert r.returncode == 0 and r.stdout.strip() == "started verifier2", (r.stdout, r.stderr)
    wait_until(step_scored(1.0, steps_done(run)), 300, "a step scored by the added verifier", proc)
  except BaseException:
    os.killpg(proc.pid, signal.SIGKILL)
    kill_roles(run)
    raise
  finish_run(tmp_path, run, proc, log, STEPS, ("verifier0",))
  logs = open(os.path.join(run, "logs", "verifier2.log")).read()
  assert "serving the queue to_score" in logs, logs[-2000:]
