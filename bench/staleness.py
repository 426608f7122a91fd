"""Staleness as an experiment (the RLAX paper's ablation, on our system): the demo's RL at --max_staleness K for
each K and seed, from the same SFT base per seed, printing training reward and held-out pass@k per step and per
wall second, and the final held-out pass@k with its spread over seeds.

Each arm is `bash launch.sh local --no_chaos --seed=S --steps=N -- --max_staleness=K --eval_every=E` (the workers
get the same bound: a group more than K versions old is regenerated there, and dropped by the trainer). The first
arm of a seed builds the SFT base and its held-out eval; the other arms copy them, so arms differ only in K.

  python -m bench.staleness                                   # K = 0,1,4; seeds 0,1,2; 100 steps (~2 min per arm)
  python -m bench.staleness --staleness=0,4 --seeds=0 --steps=60 --out_dir=/tmp/stale
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess

from bench.util import ROOT


def run_arm(out_dir, seed, k, steps, eval_every):
  run = os.path.join(out_dir, f"seed{seed}_k{k}")
  first = os.path.join(out_dir, f"seed{seed}_first")
  if os.path.isdir(os.path.join(first, "base")) and not os.path.exists(run):  # reuse the seed's base and its eval
    os.makedirs(run)
    shutil.copytree(os.path.join(first, "base"), os.path.join(run, "base"))
    shutil.copy(os.path.join(first, "eval_before.json"), run)
  subprocess.run(["bash", "launch.sh", "local", f"--run_dir={run}", f"--seed={seed}", "--no_chaos", f"--steps={steps}",
                  f"--worker_args=--max_staleness={k}", "--", f"--max_staleness={k}", f"--eval_every={eval_every}"],
                 cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
  if not os.path.exists(first):
    os.symlink(os.path.abspath(run), first)
  recs = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
  steps_ = [r for r in recs if "reward" in r]
  t0 = steps_[0]["time"] - steps_[0].get("wait_s", 0) - steps_[0].get("step_s", 0)
  evals = [(r["step"], r["time"] - t0, r["eval_pass@1"], r["eval_pass@8"]) for r in recs if "eval_pass@8" in r]
  before, after = (json.load(open(os.path.join(run, f"eval_{w}.json"))) for w in ("before", "after"))
  return dict(steps=steps_, evals=evals, before=before, after=after, secs=steps_[-1]["time"] - t0,
              stale=sum(r.get("stale_dropped", 0) for r in steps_), staleness=statistics.mean(
                  r.get("staleness_mean", 0.0) for r in steps_))


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--staleness", default="0,1,4", help="comma-separated --max_staleness values (default 0,1,4)")
  p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default 0,1,2)")
  p.add_argument("--steps", type=int, default=100, help="RL steps per arm (default 100)")
  p.add_argument("--eval_every", type=int, default=25, help="held-out eval during training, steps (default 25)")
  p.add_argument("--out_dir", default="runs/staleness", help="run dirs go here (default runs/staleness)")
  a = p.parse_args()
  ks, seeds = [int(x) for x in a.staleness.split(",")], [int(x) for x in a.seeds.split(",")]
  os.makedirs(a.out_dir, exist_ok=True)
  res = {}
  for seed in seeds:
    for k in ks:
      r = res[seed, k] = run_arm(a.out_dir, seed, k, a.steps, a.eval_every)
      w = r["steps"]
      print(f"seed {seed} K={k}: {len(w)} steps in {r['secs']:.0f} s ({r['secs'] / len(w):.2f} s/step); staleness "
            f"mean {r['staleness']:.2f}; stale groups dropped {r['stale']}; reward first/last 10 steps "
            f"{statistics.mean(x['reward'] for x in w[:10]):.3f} / {statistics.mean(x['reward'] for x in w[-10:]):.3f}; "
            f"held-out pass@8 (step, s, %): {[(s, round(t), round(100 * p8, 1)) for s, t, _, p8 in r['evals']]}",
            flush=True)
  print("\n| --max_staleness | s/step (mean) | held-out pass@1 after | pass@8 before -> after | pass@8 gain "
        "(mean, min..max over seeds) |\n|---|---|---|---|---|")
  for k in ks:
    rs = [res[s, k] for s in seeds]
    gains = [100 * (r["after"]["pass@8"] - r["before"]["pass@8"]) for r in rs]
    print(f"| {k} | {statistics.mean(r['secs'] / len(r['steps']) for r in rs):.2f} | "
          f"{statistics.mean(100 * r['after']['pass@1'] for r in rs):.1f} | "
          f"{statistics.mean(100 * r['before']['pass@8'] for r in rs):.1f} -> "
          f"{statistics.mean(100 * r['after']['pass@8'] for r in rs):.1f} | "
          f"{statistics.mean(gains):+.1f} ({min(gains):+.1f}..{max(gains):+.1f}) |")


if __name__ == "__main__":
  main()
