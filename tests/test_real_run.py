"""A real user's run (issue 13): a tiny random HF Qwen2 checkpoint + tokenizer.json with ChatML specials and a
GSM8K-shaped jsonl of ~200-token prompts (one too long to fit) made here; server, trainer and a worker run as
separate processes with no length flags. The trainer must skip the long prompt at load (file:line), reach its
steps (no worker crash loop), log the new metrics, save flags.json, and export a final/ that transformers loads
with its tokenizer. ~1-2 min on 2 cores."""
import json
import os
import subprocess
import sys
import time

import jax

import model
from test_system import ROOT, child_env, free_port

STEPS = 3


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
  env = child_env()
  port = free_port()
  token = str(tmp_path / "token")
  procs = []
  try:
    procs.append(subprocess.Popen([sys.executable, "param_server.py", f"--port={port}", f"--token_file={token}"],
                                  cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    while not os.path.exists(token):
      time.sleep(0.1)
    log = open(tmp_path / "trainer.log", "w")
    trainer = subprocess.Popen(
        [sys.executable, "train.py", f"--run_dir={run}", f"--server=127.0.0.1:{port}", f"--token_file={token}",
         f"--init_checkpoint={ckpt}", f"--tokenizer={ckpt}", f"--train_jsonl={train}", "--template=hf",
         f"--steps={STEPS}", "--prompts_per_step=2", "--group_size=2", "--max_new_tokens=16", "--lr=1e-4"],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    procs.append(trainer)
    wlog = open(tmp_path / "worker.log", "w")
    procs.append(subprocess.Popen(
        [sys.executable, "rollout.py", f"--server=127.0.0.1:{port}", f"--token_file={token}", f"--tokenizer={ckpt}",
         "--slots=4", "--verifier_workers=1"], cwd=ROOT, env=env, stdout=wlog, stderr=subprocess.STDOUT))
    rc = trainer.wait(timeout=400)
    trainer_log = open(tmp_path / "trainer.log").read()
    assert rc == 0, trainer_log[-3000:]
    assert procs[2].poll() is None, open(tmp_path / "worker.log").read()[-3000:]  # the worker never died
  finally:
    for p in procs:
      if p.poll() is None:
        p.terminate()
    for p in procs:
      try:
        p.wait(timeout=30)
      except subprocess.TimeoutExpired:
        p.kill()
  assert f"{train}:4" in trainer_log and "skipped 1 of 8" in trainer_log
  recs = [json.loads(l) for l in open(os.path.join(run, "metrics.jsonl"))]
  assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
  for k in ("time", "lr", "reward_std", "truncated_frac"):
    assert all(k in r for r in recs), k
  assert json.load(open(os.path.join(run, "flags.json")))["train_jsonl"] == train
  from transformers import AutoModelForCausalLM, AutoTokenizer
  final = os.path.join(run, "final")
  tok = AutoTokenizer.from_pretrained(final)
  assert tok.eos_token == "<|im_end|>" and len(tok) > 200
  assert AutoModelForCausalLM.from_pretrained(final).config.vocab_size == len(tok)
  assert os.path.exists(os.path.join(final, "generation_config.json"))
