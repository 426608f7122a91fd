"""The main job's controls (issue 40): is the demo's held-out gain RL, and what does asynchrony cost or buy?
For each seed, five arms from the same SFT base, each `bash launch.sh local --seed=S` (chaos on, as a user runs it)
plus the arm's flags after "--":

  grpo    the demo as it ships: GRPO, asynchronous (--max_staleness 4, the default)
  sync    the same with --max_staleness=0: the trainer trains only rollouts of its current weights, workers
          regenerate anything older (the synchronous baseline)
  dr_grpo the paper-style comparison of two algorithms: Dr. GRPO instead of GRPO, nothing else changed
  star    rejection-sampling SFT (STaR-style, losses.ALGORITHMS["star"]): the same loop, prompts, dynamic
          sampling and steps, the loss -log pi of the correct samples; its verifier calls are printed beside
          the others (the budget the issue asks to hold equal)
  curate  the paper's curation: the base's pass rates on 2048 prompts, then only prompts with a tracked pass
          rate strictly inside (0, 1) are issued; rates are re-estimated from every trained group, so a prompt
          re-enters the band as the policy changes (its curation calls are counted as verifier calls too)
  verifiers  grpo with the verifier role: launch.sh --verifiers=2 (the workers score nothing themselves)

It prints per arm and seed the held-out pass@1/pass@8 before and after (with standard errors), pass@1 split by
the demo's flaw (sums whose units digits carry, where the teacher slips, and the others), the training reward, verifier calls, wall time, and held-out pass@8 per step and per wall second (--eval_every), then a table
of the mean and range over seeds, and writes curves (per step, per wall second) to <out_dir>/controls.png.
The first arm of a seed builds the SFT base and its held-out eval; the other arms copy them.

  python -m bench.controls                         # 3 seeds x 5 arms, 400 steps (~5 min per arm on 2 cores)
  python -m bench.controls --seeds=0 --arms=grpo,star --steps=100 --out_dir=/tmp/ctl
  python -m bench.controls --report --seeds=0,1,2 --arms=grpo,star --out_dir=/tmp/ctl   (re-read, run nothing)
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess

from bench.util import ROOT
from tasks import arithmetic

ARMS = {"grpo": [], "sync": ["--max_staleness=0"], "dr_grpo": ["--algo=dr_grpo"], "star": ["--algo=star"],
        "curate": ["--curate_prompts=2048", "--pass_band=0,1"], "verifiers": ["--verifiers=2"]}


def run_arm(out_dir, seed, arm, steps, eval_every, report):
  run = os.path.join(out_dir, f"seed{seed}_{arm}")
  if report:  # read what an earlier invocation ran
    return summarize(run)
  first = os.path.join(out_dir, f"seed{seed}_first")
  if os.path.isdir(os.path.join(first, "base")) and not os.path.exists(run):  # reuse the seed's base and its eval
    os.makedirs(run)
    shutil.copytree(os.path.join(first, "base"), os.path.join(run, "base"))
    shutil.copy(os.path.join(first, "eval_before.json"), run)
  stale = [f"--worker_args={f}" for f in ARMS[arm] if f.startswith("--max_staleness")]  # workers get the bound too
  launch = [f for f in ARMS[arm] if f.startswith("--verifiers")]  # launch.sh's own flag, the rest train.py's
  with open(os.path.join(out_dir, f"seed{seed}_{arm}.log"), "w") as log:
    subprocess.run(["bash", "launch.sh", "local", f"--run_dir={run}", f"--seed={seed}", f"--steps={steps}", *stale,
                    *launch, "--", *[f for f in ARMS[arm] if f not in launch], f"--eval_every={eval_every}"], cwd=ROOT,
                   check=True, stdout=log, stderr=subprocess.STDOUT)
  if not os.path.exists(first):
    os.symlink(os.path.abspath(run), first)
  return summarize(run)


def summarize(run):
  recs = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
  steps_ = [r for r in recs if "reward" in r]
  group = json.load(open(os.path.join(run, "flags.json")))["group_size"] if os.path.exists(
      os.path.join(run, "flags.json")) else 8
  t0 = steps_[0]["time"] - steps_[0].get("wait_s", 0) - steps_[0].get("step_s", 0)
  return dict(
      steps=steps_, evals=[(r["step"], r["time"] - t0, r["eval_pass@8"]) for r in recs if "eval_pass@8" in r],
      before=json.load(open(os.path.join(run, "eval_before.json"))),
      after=json.load(open(os.path.join(run, "eval_after.json"))), secs=steps_[-1]["time"] - t0,
      # the trained groups' share scored by the verifier role, and of their verdicts the share the cache answered
      remote=statistics.mean(r.get("scored_by_verifier", 0.0) for r in steps_),
      reused=statistics.mean(r.get("verdicts_reused_frac", 0.0) for r in steps_),
      # every group a worker sent was scored: the trained ones, those dropped as stale or zero-variance, and
      # curation's (one group per rated prompt)
      calls=group * (sum(len(r["rollout_ids"]) + r.get("stale_dropped", 0) + r.get("zero_var_dropped", 0)
                         for r in steps_) + sum(r.get("curation_prompts", 0) for r in recs)))


def by_carry(ev):
  """pass@1 (%) of an eval's carrying sums and of the others: where the demo's teacher slips and where it does not."""
  split = [[k for p, k in ev["correct"] if arithmetic.units_carry(p) == c] for c in (True, False)]
  return [100 * sum(ks) / (len(ks) * ev["n_samples"]) for ks in split]


def plot(res, seeds, arms, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  for i, arm in enumerate(arms):
    for j, seed in enumerate(seeds):
      r = res[seed, arm]
      # the base and the final policy (the same held-out problems and sampling seeds), between them the evals
      # during training (other sampling seeds)
      pts = [(0, 0.0, r["before"]["pass@8"])] + [e for e in r["evals"] if e[0] > 0] + [
          (r["steps"][-1]["step"], r["secs"], r["after"]["pass@8"])]
      kw = dict(color=f"C{i}", alpha=0.8, label=arm if j == 0 else None)
      axes[0].plot([s for s, _, _ in pts], [100 * p for _, _, p in pts], **kw)
      axes[1].plot([t for _, t, _ in pts], [100 * p for _, _, p in pts], **kw)
  for ax, xl in zip(axes, ("RL step", "wall seconds since the first step")):
    ax.set_xlabel(xl)
    ax.set_ylabel("held-out pass@8 (%)")
    ax.grid(alpha=0.3)
  axes[0].legend()
  fig.suptitle(f"bench.controls: one line per seed ({','.join(map(str, seeds))})")
  fig.tight_layout()
  fig.savefig(path, dpi=100)


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated arms of {tuple(ARMS)} (default all)")
  p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default 0,1,2)")
  p.add_argument("--steps", type=int, default=400, help="RL steps per arm (default 400, the demo's)")
  p.add_argument("--eval_every", type=int, default=50, help="held-out eval during training, steps (default 50)")
  p.add_argument("--out_dir", default="runs/controls", help="run dirs and logs go here (default runs/controls)")
  p.add_argument("--report", action="store_true", help="run nothing: the table and curves of the arms an earlier "
                 "invocation finished in --out_dir (several invocations' arms together)")
  a = p.parse_args()
  arms, seeds = a.arms.split(","), [int(x) for x in a.seeds.split(",")]
  if set(arms) - set(ARMS):
    p.error(f"--arms: unknown {sorted(set(arms) - set(ARMS))}; known {tuple(ARMS)}")
  os.makedirs(a.out_dir, exist_ok=True)
  res = {}
  pct = lambda r, k: f"{100 * r[k]:.1f}+-{100 * r[k + '_se']:.1f}"  # noqa: E731
  for seed in seeds:
    for arm in arms:
      r = res[seed, arm] = run_arm(a.out_dir, seed, arm, a.steps, a.eval_every, a.report)
      w = r["steps"]
      print(f"seed {seed} {arm}: {len(w)} steps in {r['secs']:.0f} s; verifier calls {r['calls']}; held-out pass@1 "
            f"{pct(r['before'], 'pass@1')} -> {pct(r['after'], 'pass@1')}, pass@8 {pct(r['before'], 'pass@8')} -> "
            f"{pct(r['after'], 'pass@8')}; pass@1 carrying sums / others {'%.1f / %.1f' % tuple(by_carry(r['before']))} "
            f"-> {'%.1f / %.1f' % tuple(by_carry(r['after']))}; training reward first/last 20 steps "
            f"{statistics.mean(x['reward'] for x in w[:20]):.3f} / {statistics.mean(x['reward'] for x in w[-20:]):.3f};"
            f" scored by the verifier role {100 * r['remote']:.0f}%, verdicts from the cache {100 * r['reused']:.0f}%;"
            f" held-out pass@8 (step, s, %): {[(s, round(t), round(100 * p8, 1)) for s, t, p8 in r['evals']]}",
            flush=True)
  print(f"\n| arm | held-out pass@8 before -> after | gain (mean, min..max over seeds {a.seeds}) | pass@1 after | "
        "pass@1 carrying sums / others, before -> after | verifier calls | verdicts from the cache | "
        "wall s of the RL steps |\n|---|---|---|---|---|---|---|---|")
  for arm in arms:
    rs = [res[s, arm] for s in seeds]
    gains = [100 * (r["after"]["pass@8"] - r["before"]["pass@8"]) for r in rs]
    print(f"| {arm} | {statistics.mean(100 * r['before']['pass@8'] for r in rs):.1f} -> "
          f"{statistics.mean(100 * r['after']['pass@8'] for r in rs):.1f} | {statistics.mean(gains):+.1f} "
          f"({min(gains):+.1f}..{max(gains):+.1f}) | {statistics.mean(100 * r['after']['pass@1'] for r in rs):.1f} | "
          f"{'%.1f / %.1f -> %.1f / %.1f' % tuple(statistics.mean(x) for x in zip(*[by_carry(r['before']) + by_carry(r['after']) for r in rs]))} | "
          f"{statistics.mean(r['calls'] for r in rs):.0f} | {statistics.mean(100 * r['reused'] for r in rs):.0f}% | "
          f"{statistics.mean(r['secs'] for r in rs):.0f} ({min(r['secs'] for r in rs):.0f}..{max(r['secs'] for r in rs):.0f}) |")
  plot(res, seeds, arms, os.path.join(a.out_dir, "controls.png"))
  print(f"curves: {os.path.join(a.out_dir, 'controls.png')}")


if __name__ == "__main__":
  main()
