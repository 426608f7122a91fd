"""bench_curation.py: the paper's curation, measured: training reward and held-out pass@k versus RL step for
runs with and without it (or any set of runs: the run dirs are the arguments).

  bash launch.sh local --seed=0 --run_dir=runs/cur_off -- --export_every=400
  bash launch.sh local --seed=0 --run_dir=runs/cur_on  -- --export_every=400 --curate_prompts=2048 --pass_band=0,1
  python bench_curation.py runs/cur_off runs/cur_on [--out=curation.png]

Each run's policy exports (train.py --export_every: <run>/exports/step_N) are evaluated with the demo's eval
settings (read from `launch.sh local --print_settings`, so they are exactly the demo's: same held-out problems,
same sampling seeds), once: the result is cached as <export>/eval.json. Step 0 is the run's eval_before.json and
the last step its eval_after.json. Prints one table (step, reward over the preceding window, pass@1, pass@8 with
standard errors, per run) and draws the curves (matplotlib, Agg) to --out. CPU: ~10 s per export evaluated.
"""
import json
import os
import subprocess
import sys

from tools import plot

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def demo_eval_flags():
  """The demo's eval flags, as launch.sh would pass them (one source of truth)."""
  out = subprocess.run(["bash", "launch.sh", "local", "--print_settings"], cwd=ROOT, capture_output=True,
                       text=True, check=True).stdout
  line = next(l for l in out.splitlines() if l.startswith("eval: "))
  return line[len("eval: "):].split() + ["--max_new_tokens=8", "--template=plain"]


def evals_of(run, flags):
  """[(step, eval dict)] for step 0 (before), each export, and the final policy (after)."""
  pts = []
  if os.path.exists(p := os.path.join(run, "eval_before.json")):
    pts.append((0, json.load(open(p))))
  exp_dir = os.path.join(run, "exports")
  for name in sorted(os.listdir(exp_dir)) if os.path.isdir(exp_dir) else []:
    if not name.startswith("step_") or name.endswith(".tmp"):
      continue
    ck, out = os.path.join(exp_dir, name), os.path.join(exp_dir, name, "eval.json")
    if not os.path.exists(out):
      tok = os.path.join(run, "tokenizer-arithmetic.model")
      subprocess.run([sys.executable, "rollout.py", "--mode=eval", f"--checkpoint={ck}", f"--tokenizer={tok}",
                      *flags, f"--out={out}"], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    pts.append((int(name[5:]), json.load(open(out))))
  recs = plot.final_records(plot.read_jsonl(os.path.join(run, "metrics.jsonl")))
  if recs and os.path.exists(p := os.path.join(run, "eval_after.json")) and recs[-1]["step"] not in dict(pts):
    pts.append((recs[-1]["step"], json.load(open(p))))
  return pts, recs


def mean_reward(recs, lo, hi):
  r = [x["reward"] for x in recs if lo < x["step"] <= hi]
  return sum(r) / len(r) if r else float("nan")


def main(argv):
  runs = [a for a in argv[1:] if not a.startswith("--")]
  out = next((a.split("=", 1)[1] for a in argv[1:] if a.startswith("--out=")), "curation.png")
  if not runs:
    print(__doc__.strip().splitlines()[4], file=sys.stderr)
    return 2
  flags = demo_eval_flags()
  data = {run: evals_of(run, flags) for run in runs}
  print(f"{'run':<24} {'step':>5} {'reward':>7} {'pass@1':>14} {'pass@8':>14}   (reward: mean over the steps since "
        "the previous row; pass@k +- one standard error over held-out problems)")
  for run, (pts, recs) in data.items():
    prev = 0
    # The curation record (step 0) trains nothing, so final_records leaves it out: read it from the file.
    cur = [r for r in plot.read_jsonl(os.path.join(run, "metrics.jsonl")) if "curation_kept" in r]
    for step, e in pts:
      print(f"{os.path.basename(os.path.normpath(run)):<24} {step:>5} {mean_reward(recs, prev, step):>7.3f} "
            f"{100 * e['pass@1']:>6.1f} +-{100 * e.get('pass@1_se', 0):>4.1f}% "
            f"{100 * e['pass@8']:>6.1f} +-{100 * e.get('pass@8_se', 0):>4.1f}%")
      prev = step
    for r in cur:
      print(f"{'':<24} curation: kept {r['curation_kept']} of {r['curation_prompts']} prompts in "
            f"{r['curation_s']:.0f} s (base pass rate mean {r['curation_mean_rate']:.2f}, never solved "
            f"{r['curation_never']:.2f}, always {r['curation_always']:.2f})")
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, (a0, a1) = plt.subplots(1, 2, figsize=(11, 4), dpi=70)
  for run, (pts, recs) in data.items():
    name = os.path.basename(os.path.normpath(run))
    steps, rew = [r["step"] for r in recs], [r["reward"] for r in recs]
    w = 50  # a running mean: one step's reward is 16 groups, noisy
    a0.plot(steps[w - 1:], [sum(rew[i - w + 1:i + 1]) / w for i in range(w - 1, len(rew))], lw=1, label=name)
    for k, ls in (("pass@1", "--"), ("pass@8", "-")):
      a1.errorbar([s for s, _ in pts], [100 * e[k] for _, e in pts], yerr=[100 * e.get(k + "_se", 0) for _, e in pts],
                  ls=ls, marker="o", ms=3, capsize=2, label=f"{name} {k}")
  for ax, title in ((a0, "training reward (running mean of 50 steps)"), (a1, "held-out pass@k (%)")):
    ax.set(title=title, xlabel="RL step")
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(out)
  print(f"curves: {out}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
