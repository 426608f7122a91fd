"""Bad flags and bad inputs fail before any work starts, with a message naming the flag, file, line or field
(issue 15). `python -m pytest -q tests/test_validation.py -rA` prints the fault table rows of RESULTS.md."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import data
import model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (entry point, bad flags, text the error must contain). One interpreter per entry point parses them all.
BAD_FLAGS = [
    ("train", ["--checkpoint_every=0"], "--checkpoint_every must be >= 1"),
    ("train", ["--push_every=0"], "--push_every must be >= 1"),
    ("train", ["--grad_accum=-1"], "--grad_accum must be >= 0"),
    ("train", ["--group_size=1", "--dynamic_sampling"], "--dynamic_sampling needs --group_size >= 2"),
    ("train", ["--prefetch_steps=0"], "--prefetch_steps must be >= 1"),
    ("train", ["--max_staleness=-1"], "--max_staleness must be >= 0"),
    ("train", ["--max_new_tokens=-1"], "--max_new_tokens must be >= 0"),
    ("train", ["--temperature=nan"], "--temperature must be finite and > 0"),
    ("train", ["--lr=inf"], "--lr must be finite and > 0"),
    ("train", ["--top_p=0"], "--top_p must be in (0, 1]"),
    ("train", ["--pass_band=0.6,0.4"], "--pass_band must be 'low,high'"),
    ("train", ["--curate_prompts=64"], "--curate_prompts needs a --pass_band"),
    ("train", ["--sft_slip=1"], "--sft_slip must be in [0, 1)"),
    ("train", ["--task_args=difficulty=0"], "arithmetic: difficulty must be an int >= 1, got 0"),
    ("train", ["--task_args=colour=red"], "unexpected keyword argument 'colour'"),
    ("train", ["--task=countdown", "--task_args=ops=+x"], "countdown: bad ops '+x'"),
    ("train", ["--task=math"], "task must be one of ('arithmetic', 'countdown')"),
    ("rollout", ["--max_new_tokens=-1"], "--max_new_tokens must be >= 0"),
    ("rollout", ["--slots=0"], "--slots must be >= 1"),
    ("rollout", ["--chunk_steps=0"], "--chunk_steps must be >= 1"),
    ("rollout", ["--max_staleness=-1"], "--max_staleness must be >= 0"),
    ("rollout", ["--lease_s=nan"], "--lease_s must be finite and > 0"),
    ("rollout", ["--verifier_timeout_s=0"], "--verifier_timeout_s must be finite and > 0"),
    ("rollout", ["--k=0"], "--k must be >= 1"),
    ("rollout", ["--eval_task_args=difficulty=2,ops=/"], "arithmetic: bad ops '/'"),
    ("rollout", ["--eval_task_args=difficulty"], "'difficulty' is not name=value"),
]

_PROBE = r"""
import json, sys
from absl import flags
import {mod}
{mod}.define_flags()
out = []
for argv in json.loads(sys.argv[1]):
  try:
    flags.FLAGS(["{mod}.py"] + argv)
    out.append("accepted")
  except flags.Error as e:
    out.append(str(e))
  flags.FLAGS.unparse_flags()
print(json.dumps(out))
"""


@pytest.mark.parametrize("entry", ["train", "rollout"])
def test_bad_flags_refused_at_parse(entry):
  cases = [c for c in BAD_FLAGS if c[0] == entry]
  argvs = [c[1] for c in cases] + [[]]  # and the defaults parse
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  r = subprocess.run([sys.executable, "-c", _PROBE.format(mod=entry), json.dumps(argvs)], cwd=ROOT, env=env,
                     capture_output=True, text=True, timeout=120)
  assert r.returncode == 0, r.stderr[-3000:]
  got = json.loads(r.stdout.strip().splitlines()[-1])
  assert got[-1] == "accepted", got[-1]
  for (_, argv, want), msg in zip(cases, got):
    assert want in msg, (argv, msg)
    print(f"| `{entry}.py {' '.join(argv)}` | refused at start: {msg} |")


@pytest.mark.parametrize("line, match", [
    (b'{"id": 1, "prompt": "\xff\xfe", "answer": "1"}', r"bad\.jsonl:2: not valid UTF-8"),
    (b"[" * 100_000 + b"]" * 100_000, r"bad\.jsonl:2: .*nest"),
    (b'{"id": 1, "prompt": "p", "answer": ' + b"7" * 5000 + b"}", r"bad\.jsonl:2: .*digits"),
    (b'{"id": 1, "prompt": "p", "answer": NaN}', r"bad\.jsonl:2: non-finite number NaN"),
    (b'{"id": 1, "prompt": "p", "answer": 1e999}', r"bad\.jsonl:2: field 'answer' must be finite"),
])
def test_bad_jsonl_lines_name_file_and_line(tmp_path, line, match):
  path = tmp_path / "bad.jsonl"
  path.write_bytes(b'{"id": 0, "prompt": "ok", "answer": "1"}\n' + line + b"\n")
  with pytest.raises(ValueError, match=match) as e:
    data.load_jsonl(str(path))
  print(f"| jsonl line `{line[:40]!r}...` | ValueError: {str(e.value)[:120].replace(str(tmp_path) + '/', '')} |")


def _tiny_checkpoint(path):
  hf = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=16, hidden_size=8,
            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=16,
            max_position_embeddings=32, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
  import jax
  cfg = model.Config.from_hf_dict(hf)
  model.save_hf_checkpoint(str(path), cfg, model.init_params(cfg, jax.random.PRNGKey(0)))
  return [f for f in os.listdir(path) if f.endswith(".safetensors")][0]


def test_bad_checkpoints_named(tmp_path):
  import safetensors.numpy
  ck = tmp_path / "ck"
  name = _tiny_checkpoint(ck)
  f = ck / name
  tensors = safetensors.numpy.load_file(str(f))
  key = sorted(tensors)[0]
  tensors[key] = tensors[key].copy()
  tensors[key].flat[0] = np.nan
  safetensors.numpy.save_file(tensors, str(f))
  with pytest.raises(ValueError, match=f"{name}.*{key}.*non-finite") as e:
    model.load_hf_checkpoint(str(ck))
  print(f"| checkpoint with a NaN weight | ValueError: {str(e.value)[:140].replace(str(tmp_path) + '/', '')} |")
  raw = f.read_bytes()
  f.write_bytes(raw[: len(raw) // 2])  # truncated mid-file
  with pytest.raises(ValueError, match=f"{name}") as e:
    model.load_hf_checkpoint(str(ck))
  print(f"| truncated safetensors file | ValueError: {str(e.value)[:140].replace(str(tmp_path) + '/', '')} |")
