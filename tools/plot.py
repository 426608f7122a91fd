"""plot.py: draws one RL run's curves to a PNG and checks, from its metrics, that no rollout was trained twice.

  python -m tools.plot RUN_DIR [--out=PATH]      (default PATH: RUN_DIR/curves.png; launch.sh local calls it at the end)

Reads RUN_DIR/metrics.jsonl (one line per trainer step; a step that was redone after a trainer restart appears
again, and its last line is the one whose update survived), RUN_DIR/events.jsonl (launch.sh's chaos: when a role
went down and came back) and RUN_DIR/eval_before.json / eval_after.json (held-out pass@k). Panels: reward, pass@1
and pass@k before/after, KL, entropy, completion length, staleness; the preemption events are vertical lines on
every panel. matplotlib with the Agg backend: no display needed.
"""
import json
import os
import sys

import numpy as np


def read_jsonl(path):
  if not os.path.exists(path):
    return []
  out = []
  with open(path) as f:
    for i, line in enumerate(f, 1):
      line = line.strip()
      if not line:
        continue
      try:
        out.append(json.loads(line))
      except json.JSONDecodeError as e:  # a line cut by a SIGKILL mid-write: skip it, say where
        print(f"plot.py: {path}:{i}: skipped unreadable line ({e})", file=sys.stderr)
  return out


def final_records(records):
  """The surviving record of each step (the last one written), in step order."""
  by_step = {}
  for r in records:
    if "rollout_ids" in r:  # a training step (the curation record at step 0 trains nothing)
      by_step[int(r["step"])] = r
  return [by_step[s] for s in sorted(by_step)]


def exactly_once(records):
  """Checks the trained rollouts: each step 1..S once, no rollout id in two surviving steps.
  Returns a dict (steps, missing_steps, redone_steps, rollouts, twice_trained)."""
  final = final_records(records)
  steps = [int(r["step"]) for r in final]
  ids = [i for r in final for i in r.get("rollout_ids", [])]
  return dict(steps=len(steps), missing_steps=sorted(set(range(1, max(steps, default=0) + 1)) - set(steps)),
              redone_steps=sum("rollout_ids" in r for r in records) - len(final), rollouts=len(ids),
              twice_trained=len(ids) - len(set(ids)))


def balance(records):
  """Trainer vs workers from the step records: medians over steps of the trainer's wait fraction and the
  workers' busy fraction, tokens/s and waits, and the worker count that would keep the trainer busy: tokens
  the workers generate per step (trained and dropped groups) / (one worker's decode capacity x the trainer's
  step + push seconds), where a worker's capacity is its tokens/s over its busy fraction. None without worker
  figures."""
  recs = [r for r in final_records(records) if "worker_busy_frac" in r and r.get("worker_tok_s")]
  if not recs:
    return None
  med = lambda k: sorted(float(r.get(k, 0.0)) for r in recs)[len(recs) // 2]  # noqa: E731
  capacity = med("worker_tok_s") / max(med("worker_busy_frac"), 1e-9)
  # Tokens the workers generate per trained step: the trained ones plus the groups dropped (zero variance, stale).
  gen = [len(r["rollout_ids"]) + r.get("zero_var_dropped", 0) + r.get("stale_dropped", 0) for r in recs]
  step_tokens = med("tokens_per_s") * med("step_s") * sum(gen) / max(sum(len(r["rollout_ids"]) for r in recs), 1)
  # Generation thrown away per trained token, by reason (runs before the counts were logged have none).
  dropped = {k: sum(r.get("dropped_tokens", {}).get(k, 0) for r in recs) for k in ("stale", "zero_var", "worker_stale")}
  trained = max(sum(r.get("trained_tokens", 0) for r in recs), 1)
  hist = np.zeros(max((len(r.get("staleness_tokens", [])) for r in recs), default=0))
  for r in recs:
    hist[:len(r.get("staleness_tokens", []))] += r.get("staleness_tokens", [])
  return dict(steps=len(recs), trainer_wait_frac=med("trainer_wait_frac"), worker_busy_frac=med("worker_busy_frac"),
              worker_tok_s=med("worker_tok_s"), worker_wait_prompts_frac=med("worker_wait_prompts_frac"),
              workers=med("workers"), step_s=med("step_s"), fastest_step_s=min(float(r["step_s"]) for r in recs),
              discarded_per_trained={k: v / trained for k, v in dropped.items()},
              staleness_frac=[h / trained for h in hist],
              workers_to_match=step_tokens / max(capacity * (med("step_s") + med("push_s")), 1e-9))


def plot(run_dir, out=None, records=None, events=None):
  """records / events: metrics.jsonl / events.jsonl already read (main reads each once, so a cut line is reported
  once); None reads them here."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  recs = final_records(read_jsonl(os.path.join(run_dir, "metrics.jsonl")) if records is None else records)
  if not recs:
    raise ValueError(f"plot.py: no step records in {os.path.join(run_dir, 'metrics.jsonl')}")
  events = read_jsonl(os.path.join(run_dir, "events.jsonl")) if events is None else events
  evals = {w: json.load(open(p)) for w in ("before", "after")
           if os.path.exists(p := os.path.join(run_dir, f"eval_{w}.json"))}
  steps = [r["step"] for r in recs]
  panels = [("reward (mean verifier score)", ["reward"]), ("KL to reference", ["kl"]), ("entropy", ["entropy"]),
            ("completion length (tokens)", ["completion_len"]), ("staleness (policy versions)",
                                                                   ["staleness_mean", "staleness_max"])]
  fig, axes = plt.subplots(2, 3, figsize=(13, 6.5), dpi=70)
  axes = axes.ravel()
  for ax, (title, keys) in zip(axes, panels):
    for k in keys:
      ys = [r.get(k) for r in recs]
      if any(y is not None for y in ys):
        ax.plot(steps, [float("nan") if y is None else y for y in ys], lw=0.8, label=k)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("RL step", fontsize=8)
  axes[4].legend(fontsize=7)
  ax = axes[5]  # held-out pass@k: before at step 0, after at the last step
  for k in sorted({k for e in evals.values() for k in e if k.startswith("pass@") and not k.endswith("_se")}):
    pts = [(0 if w == "before" else steps[-1], evals[w][k], evals[w].get(k + "_se", 0)) for w in ("before", "after")
           if w in evals]
    ax.errorbar([p[0] for p in pts], [100 * p[1] for p in pts], yerr=[100 * p[2] for p in pts], marker="o",
                capsize=3, label=f"held-out {k}")
  ax.set_title("held-out pass@k before / after (%)", fontsize=10)
  ax.set_xlabel("RL step", fontsize=8)
  if evals:
    ax.legend(fontsize=7)
  colors = {"down": "red", "back": "green"}
  for e in events:  # preemption: red = went down, green = came back
    for a in axes:
      a.axvline(e["step"], color=colors.get(e["event"].split()[0], "gray"), lw=0.7, ls="--")
  downs = [f"{e['role']} {e['event'].split(' (')[1].rstrip(')')} @ step {e['step']}" for e in events
           if e["event"].startswith("down")]
  fig.suptitle(os.path.basename(os.path.normpath(run_dir)) + ("   preemptions: " + ", ".join(downs) if downs else "")
               + "   (dashed: red down, green back)", fontsize=9)
  fig.tight_layout()
  out = out or os.path.join(run_dir, "curves.png")
  fig.savefig(out)
  plt.close(fig)
  return out


def main(argv):
  if len(argv) < 2 or argv[1].startswith("-"):
    print(__doc__.strip().splitlines()[2], file=sys.stderr)
    return 2
  run_dir = argv[1]
  out = next((a.split("=", 1)[1] for a in argv[2:] if a.startswith("--out=")), None)
  records = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
  chk = exactly_once(records)
  print(f"trained rollouts: {chk['rollouts']} in {chk['steps']} steps; twice-trained: {chk['twice_trained']}; "
        f"missing steps: {len(chk['missing_steps'])}; step records rewritten after a restart: {chk['redone_steps']}")
  b = balance(records)
  if b:  # which side to grow: docs/GUIDE.md "Sizing workers against the trainer"
    print(f"balance (median of {b['steps']} steps): trainer waits for rollouts {100 * b['trainer_wait_frac']:.0f}% of "
          f"a step; workers ({b['workers']:.0f} sending per step) decode {100 * b['worker_busy_frac']:.0f}% of the "
          f"time at {b['worker_tok_s']:.0f} tok/s, wait for prompts {100 * b['worker_wait_prompts_frac']:.0f}%; "
          f"workers that would keep the trainer busy: {b['workers_to_match']:.1f}; step {b['step_s']:.3f} s in "
          f"the loop vs {b['fastest_step_s']:.3f} s fastest ({b['step_s'] / max(b['fastest_step_s'], 1e-9):.2f}x)")
    d = b["discarded_per_trained"]
    print(f"generation discarded per trained token: {sum(d.values()):.2f} (stale {d['stale']:.2f}, zero-variance "
          f"{d['zero_var']:.2f}, regenerated by workers as stale {d['worker_stale']:.2f}); trained tokens by "
          f"staleness 0, 1, ...: {', '.join(f'{100 * h:.0f}%' for h in b['staleness_frac'])}")
  events = read_jsonl(os.path.join(run_dir, "events.jsonl"))
  for e in events:
    print(f"  preemption: step {e['step']}: {e['role']} {e['event']} (pid {e['pid']})")
  print(f"curves: {plot(run_dir, out, records, events)}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
