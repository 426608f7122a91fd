"""bench.fleet end to end at a small size: the real server and trainer with simulated workers and two verifiers (the
verifier role's real step, a simulated verdict), a throughput phase, then workers, verifiers and the trainer
preempted (SIGKILL and SIGTERM, real signals to real processes), and the exactly-once check on what is on disk
(rollouts still waiting to be scored count as queued); the workers pulled every version they tagged rollouts with,
bytes over the socket; then that check is shown to catch a rollout trained twice."""
import json
import subprocess
import sys

import pytest

from bench import fleet
from bench import util as benchutil


def test_fleet_survives_worker_and_trainer_preemptions_exactly_once(tmp_path):
  run, out = tmp_path / "run", tmp_path / "fleet.json"
  cmd = [sys.executable, "-m", "bench.fleet", "--ns=3", "--phase_s=4", "--warmup_s=2", "--chaos_workers=4",
         "--chaos_s=26", "--kill_every_s=0.5", "--trainer_every_s=9", "--prompts_per_step=8", "--group_size=4",
         "--max_new_tokens=8", "--tok_s=400", "--verifiers=2", f"--out_dir={run}", f"--json={out}"]
  p = subprocess.run(cmd, cwd=benchutil.ROOT, env=benchutil.child_env(), capture_output=True, text=True, timeout=400)
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
  res = json.loads(out.read_text())
  row = res["rows"][0]
  assert row["n"] == 3 and row["finished"] > 0 and row["trained"] > 0
  ch = res["chaos"]
  assert ch["worker_preemptions"] >= 12 and ch["verifier_preemptions"] >= 5  # victims drawn among 4 + 2
  assert ch["trainer_preemptions"] == 2  # one SIGKILL, one SIGTERM
  assert [e["event"].split(" (")[0] for e in ch["timeline"]] == ["trainer SIGKILL", "trainer SIGTERM"]
  # After each restart the trainer trained again: after SIGKILL from its last periodic checkpoint (every 10 steps),
  # after SIGTERM from the step it had reached (its final checkpoint: nothing redone).
  kill, term = ch["timeline"]
  assert kill["resumed_at"] is not None and kill["resumed_at"] <= kill["step"] and kill["resumed_at"] % 10 == 0, kill
  assert term["resumed_at"] == term["step"], term
  eo = res["exactly_once"]
  assert eo["steps"] > term["resumed_at"] and eo["trained"] == 8 * eo["steps"]
  pulls = res["pulls"]  # real bytes for every version tagged (a version is tagged only once held)
  assert pulls["bytes"] > 0 and pulls["pulls"] > 0 and pulls["tagged"] > 0, pulls
  assert row["pulls"] > 0 and row["pull_mb_s"] > 0, row

  # The check fails when a rollout is trained twice: the last step claims one of the first step's rollouts.
  lines = (run / "metrics.jsonl").read_text().splitlines()
  recs = [json.loads(x) for x in lines]
  assert any(r.get("pull_bytes", 0) > 0 for r in recs)  # the workers' pull figures reach the trainer's metrics
  first = next(r for r in recs if "rollout_ids" in r)
  last = max((i for i, r in enumerate(recs) if "rollout_ids" in r))
  recs[last]["rollout_ids"][0] = first["rollout_ids"][0]
  (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
  with pytest.raises(AssertionError, match="trained in"):
    fleet.exactly_once(str(run), 8)
