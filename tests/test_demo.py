"""The demo's pieces that are not the RL loop: launch.sh pins what its numbers rely on, the pass-rate band
(offline curation and online issuing), and plot.py's curves + exactly-once check."""
import json
import os
import subprocess

import pytest

import data
import train
from tools import plot

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def settings(env):
  out = subprocess.run(["bash", "launch.sh", "local", "--print_settings", "--seed=2"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  return out.stdout


def test_demo_settings_do_not_depend_on_the_callers_environment():
  base = {k: v for k, v in os.environ.items()
          if not k.startswith(("XLA_", "JAX_", "OMP_", "MKL_", "OPENBLAS_", "TF_NUM", "PYTHONHASHSEED"))}
  hostile = dict(base, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu,tpu",
                 OMP_NUM_THREADS="7", JAX_ENABLE_X64="1", JAX_DEFAULT_MATMUL_PRECISION="bfloat16")
  clean, dirty = settings(base), settings(hostile)
  assert clean == dirty
  assert "jax devices: 1 cpu" in clean and "seed=2" in clean and "XLA_FLAGS=--xla_force_host_platform_device_count=1" in clean


def test_pass_band_parsing_and_online_filter():
  assert train.parse_band("0,1") == (0.0, 1.0) and train.parse_band("0.1,0.9") == (0.1, 0.9)
  for bad in ("", "0.5", "a,b", "0.6,0.4", "-0.1,1", "0,1.5"):  # refused at flag parsing (test_validation)
    assert train.parse_band(bad) is None, bad
  t = data.PassRateTracker()
  t.update("solved", [1.0] * 8)
  t.update("mixed", [1.0, 0.0] * 4)
  t.update("few", [1.0] * 2)  # under min_samples: not judged yet
  band = (0.0, 1.0)
  assert not train.in_band(t, "solved", band, 8) and train.in_band(t, "mixed", band, 8)
  assert train.in_band(t, "few", band, 8) and train.in_band(t, "unseen", band, 8)
  assert train.in_band(t, "solved", None, 8)  # no band: everything is issued


def test_stream_peek_is_what_will_be_issued_and_does_not_advance():
  s = data.PromptStream(data.make_task_problems("arithmetic", 5, difficulty=1, seed=0, ops="+"), seed=3)
  s.take(3)
  ahead = s.peek(4)  # crosses the epoch boundary
  assert [p.id for p in s.take(4)] == [p.id for p in ahead]


def test_plot_draws_png_and_counts_twice_trained_rollouts(tmp_path, capsys):
  recs = [dict(step=s, reward=s / 10, kl=0.0, entropy=1.0, completion_len=3.0, staleness_mean=0.0,
               staleness_max=0, rollout_ids=[f"s{2 * s}", f"s{2 * s + 1}"]) for s in range(1, 11)]
  recs.insert(0, dict(step=0, curation_prompts=4, curation_kept=2))
  recs.append(dict(recs[5], rollout_ids=["s10", "s11"]))  # step 5 redone after a restart: last record wins
  with open(tmp_path / "metrics.jsonl", "w") as f:
    f.write("".join(json.dumps(r) + "\n" for r in recs) + '{"step": 11, "rew')  # cut by a SIGKILL mid-line
  with open(tmp_path / "events.jsonl", "w") as f:
    f.write(json.dumps(dict(time=0, step=4, role="worker0", event="down (SIGKILL)", pid=1)) + "\n")
  chk = plot.exactly_once(plot.read_jsonl(str(tmp_path / "metrics.jsonl")))
  assert chk == dict(steps=10, missing_steps=[], redone_steps=1, rollouts=20, twice_trained=0)
  recs.append(dict(recs[3], step=11, rollout_ids=["s2"]))  # a rollout trained in two steps is counted
  assert plot.exactly_once(recs)["twice_trained"] == 1
  out = plot.plot(str(tmp_path))
  assert open(out, "rb").read(8) == b"\x89PNG\r\n\x1a\n" and os.path.getsize(out) < 200_000
  capsys.readouterr()
  assert plot.main(["plot.py", str(tmp_path)]) == 0  # the whole report reads metrics.jsonl once:
  assert capsys.readouterr().err.count("skipped unreadable line") == 1  # the cut line is reported once


def test_balance_says_how_many_workers_keep_the_trainer_busy():
  # Each step trains 2 groups of 1000 tokens in 1 s of compute + 0.25 s of push; 1 more group per step is dropped
  # (zero variance), so workers generate 3000 tokens per step. A worker decodes 500 tok/s at 50% busy: a
  # capacity of 1000 tok/s, 1250 tokens per 1.25 s trainer step, so 3000 / 1250 = 2.4 workers keep it busy.
  recs = [dict(step=s, rollout_ids=["a", "b"], zero_var_dropped=1, tokens_per_s=2000.0, step_s=1.0, push_s=0.25,
               wait_s=3.75, trainer_wait_frac=0.75, worker_busy_frac=0.5, worker_tok_s=500.0,
               worker_wait_prompts_frac=0.1, workers=2) for s in range(1, 6)]
  b = plot.balance(recs)
  assert b["workers_to_match"] == pytest.approx(2.4) and b["trainer_wait_frac"] == 0.75 and b["steps"] == 5
  assert plot.balance([dict(r, worker_tok_s=0.0) for r in recs]) is None  # no worker figures: no line
