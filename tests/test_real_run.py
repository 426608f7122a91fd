"""A real user's run (issue 13): a tiny random HF Qwen2 checkpoint + tokenizer.json with ChatML specials and a
GSM8K-shaped jsonl of ~200-token prompts (one too long to fit) made here, run as a user runs them:
`launch.sh local --init_checkpoint --train_jsonl --eval_jsonl`, no length flags (the checkpoint ships a chat
template: used by default). The completion budget and the micro-batches adapt to the checkpoint's 512 positions and a
16 MiB memory budget (the old defaults, 1024 new tokens and one micro-batch, would not fit). The trainer must
skip the long prompt at load (file:line), reach its steps (no worker crash loop), log the new metrics, save
flags.json, and export a final/ that transformers loads with its tokenizer; pass@k is evaluated before and after.
Every on-policy step's mismatch_max in metrics.jsonl is <= 1e-5 (fp32).
~1-2 min on 2 cores."""
import json
import os
import re
import subprocess

import jax

from bench import util as benchutil
import model
from test_system import ROOT, free_port

STEPS = 3
MEMORY_GB = 0.016  # 16 MiB: one micro-batch of 4 x 512 tokens needs ~20 MiB here, so --grad_accum=0 must split


def make_checkpoint(d):
  from tokenizers import Tokenizer, models, pre_tokenizers
  specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
  words = [f"w{i}" for i in range(200)] + list("0123456789") + ["####", "user", "assistant", "system", "?", "\\boxed{", "}"]
  vocab = {t: i for i, t in enumerate(["<unk>"] + specials + words)}
  tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok.add_special_tokens(specials)
  os.makedirs(d)
  tok.save(os.path.join(d, "tokenizer.json"))
  with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
    json.dump(dict(eos_token="<|im_end|>", pad_token="<|endoftext|>", tokenizer_class="PreTrainedTokenizerFast",
                   chat_template="{% for m in messages %}{{'<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n'}}"
                                 "{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\n'}}{% endif %}"), f)
  hf = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=len(vocab), hidden_size=32,
            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
            max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
            eos_token_id=vocab["<|im_end|>"])
  cfg = model.Config.from_hf_dict(hf)
  model.save_hf_checkpoint(d, cfg, model.init_params(cfg, jax.random.PRNGKey(0)))


def test_real_checkpoint_gsm8k_jsonl_run(tmp_path):
  ckpt, run = str(tmp_path / "ckpt"), str(tmp_path / "run")
  make_checkpoint(ckpt)
  train = str(tmp_path / "train.jsonl")
  with open(train, "w") as f:
    for i in range(8):  # ~200-token GSM8K questions; line 4 is longer than the checkpoint's 512 positions
      n = 700 if i == 3 else 190 + i
      q = " ".join(f"w{(i * 7 + j) % 200}" for j in range(n)) + " ?"
      f.write(json.dumps(dict(question=q, answer=f"w1 w2\n#### {i}")) + "\n")
  evalf = str(tmp_path / "eval.jsonl")
  with open(evalf, "w") as f:
    for i in range(3):
      f.write(json.dumps(dict(question=" ".join(f"w{j}" for j in range(180 + i)) + " ?", answer=f"#### {i}")) + "\n")
  # The user's command: the checkpoint, the data, the chat template; only the budget and size flags are test-sized.
  cmd = ["bash", "launch.sh", "local", f"--run_dir={run}", f"--init_checkpoint={ckpt}", f"--train_jsonl={train}",
         f"--eval_jsonl={evalf}", f"--steps={STEPS}", "--workers=1",
         f"--port={free_port()}", "--worker_args=--slots=4 --verifier_workers=1",
         "--", "--prompts_per_step=2", "--group_size=2", "--lr=1e-4", f"--memory_gb={MEMORY_GB}",
         "--eval_every=1", "--temperature=0.9"]
  p = subprocess.run(cmd, cwd=ROOT, env=benchutil.child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                     text=True, timeout=600)
  assert p.returncode == 0, p.stdout[-3000:]
  trainer_log = open(os.path.join(run, "logs", "trainer0.log")).read()
  sup = os.path.join(run, "logs", "supervisor.log")
  assert not os.path.exists(sup) or "worker0 exited" not in open(sup).read()  # the worker never died
  assert "pass@1" in p.stdout and os.path.exists(os.path.join(run, "eval_after.json")), p.stdout[-2000:]
  # The before/after evals sample as the rollouts do: at the trainer's --temperature, not the eval's default 1.0.
  evs = [json.load(open(os.path.join(run, f"eval_{w}.json"))) for w in ("before", "after")]
  assert [e["temperature"] for e in evs] == [0.9] * 2
  for e in evs:  # each problem's count of correct samples (breakdowns by kind, bench.controls) sums to pass@1
    assert len(e["correct"]) == e["n_problems"] and all(0 <= k <= e["n_samples"] for _, k in e["correct"])
    assert abs(sum(k for _, k in e["correct"]) / (e["n_problems"] * e["n_samples"]) - e["pass@1"]) < 1e-9
  assert f"{train}:4" in trainer_log and "skipped 1 of 8" in trainer_log
  # Defaults that fit: the 1024-token default completion budget would not fit the 512 positions, and one
  # micro-batch would not fit the memory budget; both adapt with no flag.
  assert re.search(r"--max_new_tokens=0: 3\d\d \(context 512\)", trainer_log), trainer_log[-2000:]
  chose = int(re.search(r"--grad_accum=0: chose (\d+)", trainer_log).group(1))
  assert chose >= 2 and re.search(r"--grad_accum=0: 1 micro-batches .* peak [\d.]+ MiB", trainer_log)
  recs_all = [json.loads(l) for l in open(os.path.join(run, "metrics.jsonl"))]
  recs = [r for r in recs_all if "eval_pass@1" not in r]
  assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
  for k in ("time", "lr", "reward_std", "truncated_frac"):
    assert all(k in r for r in recs), k
  # On-policy steps (every rollout made with the weights trained on): the worker's and the trainer's fp32 log-probs
  # agree per token to 1e-5 (SPEC "Numerical alignment").
  on_policy = [r for r in recs if r["staleness_max"] == 0]
  assert on_policy, [(r["step"], r["staleness_max"]) for r in recs]
  assert all(r["mismatch_max"] <= 1e-5 for r in on_policy), [(r["step"], r["mismatch_max"]) for r in on_policy]
  assert json.load(open(os.path.join(run, "flags.json")))["train_jsonl"] == train
  # Held-out pass@k during training (--eval_every, through the workers), and the same numbers in TensorBoard.
  evals = [r for r in recs_all if "eval_pass@1" in r]
  assert evals and all(r["eval_problems"] == 3 and 0 <= r["eval_pass@8"] <= 1 for r in evals), recs_all
  from tensorboardX.proto import event_pb2
  (events,) = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(run, "tensorboard")) for f in fs if "tfevents" in f]
  tags = set()
  with open(events, "rb") as f:  # TFRecord: u64 length, u32 crc, payload, u32 crc
    while header := f.read(12):
      payload = f.read(int.from_bytes(header[:8], "little"))
      f.read(4)
      tags |= {v.tag for v in event_pb2.Event.FromString(payload).summary.value}
  assert {"reward", "loss", "eval_pass_at_1", "eval_pass_at_8"} <= tags, tags
  from transformers import AutoModelForCausalLM, AutoTokenizer
  final = os.path.join(run, "final")
  tok = AutoTokenizer.from_pretrained(final)
  assert tok.eos_token == "<|im_end|>" and len(tok) > 200
  assert AutoModelForCausalLM.from_pretrained(final).config.vocab_size == len(tok)
  assert json.load(open(os.path.join(final, "generation_config.json")))["temperature"] == 0.9
