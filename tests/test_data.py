"""Tests for data.py and tasks/: tokenizer, jsonl datasets, prompt stream, built-in tasks, verifiers, the verifier
pool, pass rates, batching (the code sandbox: tests/test_sandbox.py). Run: python -m pytest -q tests/test_data.py"""
import json
import re
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

from bench import util as benchutil
import data
import tasks
from data import Problem
from tasks import sandbox


# ----------------------------------------------------------------------------------------------- tokenizer

@pytest.fixture(scope="module")
def task_tok_dir(tmp_path_factory):
  return tmp_path_factory.mktemp("tok")


@pytest.mark.parametrize("task", ["arithmetic", "countdown"])
def test_task_tokenizer_digits_roundtrip_specials(task_tok_dir, task):
  path = data.build_task_tokenizer(task_tok_dir, task)
  tok = data.load_tokenizer(path)
  assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 2, 3)
  assert tok.vocab_size <= 64
  # Every digit is its own piece, whatever the digits' neighbours.
  assert [tok.decode([i]) for i in tok.encode("9081726354")] == list("9081726354")
  for p in data.make_task_problems(task, 50, difficulty=3, seed=5, split="eval"):
    for text in (p.prompt, p.answer, p.prompt + p.answer):
      ids = tok.encode(text)
      assert 1 not in ids, f"unk in {text!r}"
      assert tok.decode(ids) == text
  ids = tok.encode("12+345=", add_bos=True)
  assert ids[0] == tok.bos_id
  # decode stops at eos and drops pad/bos.
  assert tok.decode(ids + tok.encode("357") + [tok.eos_id] + tok.encode("99") + [tok.pad_id] * 3) == "12+345=357"


@pytest.mark.parametrize("ops", ["-", "+", "*"])
def test_held_out_arithmetic_has_no_commuted_twin_in_training(ops):
  """Issue 40: a held-out a-b (or a+b, a*b) and its twin b-a (the same digits in the other order) never appear among
  the training problems, for the demo's sizes (launch.sh: difficulty=2, eval_n=500 at eval seed 1234,
  train_size=7900) and any training seed. Hashing the prompt alone put 414 of 500 twins of the old demo's held-out
  sums in training."""
  ev = data.make_task_problems("arithmetic", 500, seed=1234, split="eval", difficulty=2, ops=ops)
  for seed in (0, 1, 2):
    tr = {p.prompt for p in data.make_task_problems("arithmetic", 7000, seed=seed, difficulty=2, ops=ops)}
    for p in ev:
      a, op, b = p.prompt[:-1].partition(ops)
      assert p.prompt not in tr and f"{b}{op}{a}=" not in tr, p.prompt


def test_demo_held_out_set_is_a_shift_rl_never_samples(tmp_path):
  """Issue 40 item 2, with the demo's own settings (launch.sh --print_settings): RL samples sums whose operands are
  both below 50, the held-out set only sums with an operand of 50 or more, and none of its problems, nor their
  commuted twins, is among the SFT teacher's problems (every range) or RL's. The regions are read off the prompts
  here, not from the task's code."""
  out = subprocess.run(["bash", "launch.sh", "local", "--print_settings", f"--run_dir={tmp_path}"], cwd=benchutil.ROOT,
                       capture_output=True, text=True, env=benchutil.child_env(), check=True).stdout
  lines = out.splitlines()
  flag = lambda head, name: re.search(rf"--{name}=(\S+)", next(l for l in lines if l.startswith(head))).group(1)  # noqa: E731
  args = lambda head, name: {k: int(v) if k == "difficulty" else v  # noqa: E731
                             for k, v in (kv.split("=") for kv in flag(head, name).split(","))}
  rl_args, sft_args, ev_args = args("rl:", "task_args"), args("sft:", "task_args"), args("eval:", "eval_task_args")
  ev = data.make_task_problems("arithmetic", int(flag("eval:", "eval_n")), seed=1234, split="eval", **ev_args)
  pair = lambda p: tuple(sorted(map(int, p.prompt[:-1].split("+"))))  # noqa: E731
  assert all(max(pair(p)) >= 50 for p in ev) and min(max(pair(p)) for p in ev) == 50
  for seed in (0, 1, 2):
    rl = data.make_task_problems("arithmetic", int(flag("rl:", "train_size")), seed=seed, **rl_args)
    sft = data.make_task_problems("arithmetic", int(flag("sft:", "train_size")), seed=seed, **sft_args)
    assert all(max(pair(p)) < 50 for p in rl) and max(max(pair(p)) for p in rl) == 49
    assert sum(max(pair(p)) >= 50 for p in sft) > 5000  # the base learns to add in the held-out range
    assert not {pair(p) for p in ev} & {pair(p) for p in rl + sft}


def test_task_tokenizer_deterministic_and_reused(tmp_path):
  a = data.build_task_tokenizer(tmp_path / "a", "arithmetic", seed=0)
  b = data.build_task_tokenizer(tmp_path / "b", "arithmetic", seed=0)
  assert open(a, "rb").read() == open(b, "rb").read()
  mtime = os.path.getmtime(a)
  time.sleep(0.01)
  assert data.build_task_tokenizer(tmp_path / "a", "arithmetic", seed=0) == a
  assert os.path.getmtime(a) == mtime  # reused, not retrained
  with pytest.raises(ValueError, match="task"):
    data.build_task_tokenizer(tmp_path, "poetry")


def test_sentencepiece_checkpoint_dir(tmp_path):
  (tmp_path / "ckpt").mkdir()
  shutil.copy(data.build_task_tokenizer(tmp_path, "arithmetic"), tmp_path / "ckpt" / "tokenizer.model")
  tok = data.load_tokenizer(tmp_path / "ckpt")  # a checkpoint dir with tokenizer.model
  assert tok.decode(tok.encode("12+345=357")) == "12+345=357"
  with pytest.raises(ValueError, match="neither"):
    data.load_tokenizer(tmp_path)


def _write_hf_checkpoint(folder):
  import tokenizers
  from tokenizers import models, pre_tokenizers, decoders
  vocab = {"<|endoftext|>": 0, "<|im_end|>": 1, "<|im_start|>": 2}
  for ch in "abcdefghijklmnopqrstuvwxyz0123456789 +=\n":
    vocab.setdefault(ch, len(vocab))
  tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
  tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
  tok.decoder = decoders.Fuse()
  tok.add_special_tokens(["<|endoftext|>", "<|im_end|>", "<|im_start|>"])
  folder.mkdir()
  tok.save(str(folder / "tokenizer.json"))
  (folder / "tokenizer_config.json").write_text(json.dumps(
      {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None}))
  (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 0]}))


def test_hf_tokenizer_json(tmp_path, monkeypatch):
  _write_hf_checkpoint(tmp_path / "ckpt")
  tok = data.load_tokenizer(tmp_path / "ckpt")
  assert (tok.bos_id, tok.eos_id, tok.pad_id) == (None, 1, 0)
  assert tok.stop_ids == {0, 1}
  ids = tok.encode("abc 12+3", add_bos=True)  # no bos token: add_bos adds nothing
  assert len(ids) == 8 and tok.decode(ids) == "abc 12+3"
  assert tok.decode(ids + [1] + tok.encode("zz")) == "abc 12+3"
  monkeypatch.setitem(sys.modules, "tokenizers", None)  # the optional dependency missing
  with pytest.raises(ImportError, match="pip install tokenizers"):
    data.load_tokenizer(tmp_path / "ckpt")


def test_broken_tokenizer_config_and_chat_template_name_the_file(tmp_path):
  d = tmp_path / "ckpt"
  _write_hf_checkpoint(d)
  cfg = d / "tokenizer_config.json"
  cfg.write_text('{"eos_token": "<|im_end|>",')  # truncated
  for load in (data.load_tokenizer, data.load_chat_template, data.has_chat_template):
    with pytest.raises(ValueError, match=f"{cfg}: not valid JSON"):
      load(d)
  cfg.write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": "{% if messages %}{{ x }"}))
  with pytest.raises(ValueError, match=f"{cfg}: TemplateSyntaxError"):
    data.load_chat_template(d)
  cfg.write_text(json.dumps({"eos_token": "<|im_end|>"}))
  jinja = d / "chat_template.jinja"
  jinja.write_text("{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system turns') }}"
                   "{% endif %}{{ m.content }}{% endfor %}")
  chat = data.load_chat_template(d)
  assert data.render_prompt(Problem("ok", "hi", "1"), "hf", chat) == "hi"
  p = Problem("sys", "hi", "1", messages=(("system", "S"), ("user", "hi")), source="set.jsonl:7")
  with pytest.raises(ValueError, match=f"problem 'sys' \\(set.jsonl:7\\): TemplateError: {jinja}: no system turns"):
    data.render_prompt(p, "hf", chat)
  jinja.write_text("{{ messages | no_such_filter }}")
  with pytest.raises(ValueError, match=f"{jinja}: TemplateAssertionError"):
    data.load_chat_template(d)


def test_reference_completion_and_list_tests():
  for task in ("arithmetic", "countdown"):
    for p in data.make_task_problems(task, 20, difficulty=3):
      assert data.verify(p, data.reference_completion(p)) == 1.0
  m = Problem("m", "?", "\\frac{1}{2}", "math")
  assert data.reference_completion(m) == "\\boxed{\\frac{1}{2}}" and data.verify(m, data.reference_completion(m)) == 1.0
  c = Problem("c", "?", "", "code", [["1\n", "1"], "assert True"])  # as decoded from JSON
  assert c.tests == (("1\n", "1"), "assert True") and hash(c)
  with pytest.raises(ValueError, match="no reference"):
    data.reference_completion(c)


def test_a_new_task_is_one_tasks_entry(monkeypatch, tmp_path):
  # A toy task defined only by its TASKS entry (and its tokenizer corpus): generation with its own args, the eval
  # split, jsonl, verify, SFT reference and the built-in tokenizer all pick it up by name.
  def generate(seed, digits=2):
    rng = __import__("random").Random(seed)
    while True:
      v = rng.randint(0, 10 ** digits)
      yield f"{v}x2=", str(2 * v)

  double = tasks.Task(lambda p, c, *_: float(c.strip() == p.answer), lambda p: p.answer, generate)
  monkeypatch.setitem(tasks.TASKS, "double", double)
  monkeypatch.setitem(tasks.TOKENIZER_CORPUS, "double", ("0123456789x=", [dict(digits=3)]))
  tr, ev = (data.make_task_problems("double", 20, digits=3, split=s) for s in ("train", "eval"))
  assert not {p.prompt for p in tr} & {p.prompt for p in ev} and all(p.task == "double" for p in tr + ev)
  assert all(data.verify(p, data.reference_completion(p)) == 1.0 and data.verify(p, "1") == 0.0 for p in tr[:5])
  jsonl = tmp_path / "d.jsonl"
  jsonl.write_text(json.dumps({"id": 1, "prompt": "4x2=", "answer": "8", "task": "double"}) + "\n")
  assert data.verify(data.load_jsonl(jsonl)[0], " 8\n") == 1.0
  tok = data.load_tokenizer(data.build_task_tokenizer(tmp_path, "double"))
  assert tok.decode(tok.encode(tr[0].prompt + tr[0].answer)) == tr[0].prompt + tr[0].answer
  with pytest.raises(ValueError, match="'arithmetic', 'countdown', 'double'"):
    data.make_task_problems("math", 3)
  with pytest.raises(ValueError, match="difficulty"):  # an arg the task does not take
    data.make_task_problems("double", 3, difficulty=3)
  assert data.parse_task_args("digits=3,op=+") == {"digits": 3, "op": "+"} and data.parse_task_args("") == {}
  assert data.task_args_error("double", "digits=1") is None and "digits" in data.task_args_error("double", "digits")
  assert "difficulty" in data.task_args_error("arithmetic", "difficulty=0")


def test_render_prompt():
  p = Problem("1", "12+3=", "15", "arithmetic")
  assert data.render_prompt(p) == "12+3="
  assert data.render_prompt(p, "chatml") == "<|im_start|>user\n12+3=<|im_end|>\n<|im_start|>assistant\n"
  assert data.render_prompt(Problem("1", "12+3=", "15", messages=(("system", "Be brief."), ("user", "12+3="))), "chatml").startswith(
      "<|im_start|>system\nBe brief.<|im_end|>\n")
  with pytest.raises(ValueError, match="template"):
    data.render_prompt(p, "alpaca")


# ------------------------------------------------------------------------------------------------ datasets

def test_jsonl_roundtrip(tmp_path):
  path = tmp_path / "p.jsonl"
  path.write_text('{"id": "a", "prompt": "1+1?", "answer": 2}\n\n'
                  '{"id": 7, "prompt": "echo", "answer": "", "tests": [{"input": "x\\n", "output": "x"}, {"input": "", "output": ""}]}\n')
  ps = data.load_jsonl(path)
  assert ps == [Problem("a", "1+1?", "2", "math", None), Problem("7", "echo", "", "code", (("x\n", "x"), ("", "")))]
  data.write_jsonl(tmp_path / "q.jsonl", ps, pass_rates={"a": 0.25})
  assert data.load_jsonl(tmp_path / "q.jsonl") == ps
  assert json.loads((tmp_path / "q.jsonl").read_text().splitlines()[0])["pass_rate"] == 0.25


@pytest.mark.parametrize("line, match", [
    ('{"id": "b", "prompt": "x", "answer": "1"', "invalid JSON"),
    ('["not", "an", "object"]', "JSON object"),
    ('{"id": "b", "prompt": "x"}', "missing field 'answer'"),
    ('{"id": "b", "prompt": 5, "answer": "1"}', "'prompt' must be a string"),
    ('{"id": null, "prompt": "x", "answer": "1"}', "'id'"),
    ('{"id": "b", "prompt": "x", "answer": [1]}', "'answer'"),
    ('{"id": "b", "prompt": "x", "answer": "1", "task": "poetry"}', "'task'"),
    ('{"id": "b", "prompt": "x", "answer": "1", "tests": [{"input": 1}]}', r"tests\[0\]"),
    ('{"id": "b", "prompt": "x", "answer": "1", "task": "code"}', "needs a non-empty 'tests'"),
    ('{"id": "b", "prompt": "x", "answer": "1", "tests": ["assert f(1) == 1", {"input": "", "output": ""}]}', "mixes"),
    ('{"id": "a", "prompt": "x", "answer": "1"}', "duplicate id 'a' .first seen on line 1"),
])
def test_jsonl_errors_name_file_and_line(tmp_path, line, match):
  path = tmp_path / "bad.jsonl"
  path.write_text('{"id": "a", "prompt": "p", "answer": "1"}\n' + line + "\n")
  with pytest.raises(ValueError, match=match) as e:
    data.load_jsonl(path)
  assert f"{path}:2:" in str(e.value)


def test_prompt_stream_epochs_and_exact_resume():
  ps = [Problem(str(i), f"p{i}", "0") for i in range(7)]
  s = data.PromptStream(ps, seed=1)
  first = s.take(14)
  assert sorted(p.id for p in first[:7]) == sorted(p.id for p in ps)  # each epoch is a permutation
  assert sorted(p.id for p in first[7:]) == sorted(p.id for p in ps)
  assert [p.id for p in first[:7]] != [p.id for p in first[7:]]
  s.take(3)
  state = json.loads(json.dumps(s.state_dict()))  # survives a JSON checkpoint
  expected = s.take(20)
  r = data.PromptStream(ps, seed=1)
  r.load_state_dict(state)
  assert r.take(20) == expected
  assert data.PromptStream(ps, seed=1).take(14) == first  # deterministic by seed
  assert data.PromptStream(ps, seed=2).take(7) != first[:7]
  with pytest.raises(ValueError, match="fingerprint"):
    data.PromptStream(ps[::-1], seed=1).load_state_dict(state)
  with pytest.raises(ValueError, match="'n'"):
    data.PromptStream(ps[:5], seed=1).load_state_dict(state)
  with pytest.raises(ValueError, match="'cursor'"):
    data.PromptStream(ps, seed=1).load_state_dict({**state, "cursor": 8})


# ------------------------------------------------------------------------------------------ built-in tasks

def test_arithmetic_problems_correct_deterministic_disjoint():
  tr = data.make_task_problems("arithmetic", 400, difficulty=3, seed=0, ops="+-*")
  ev = data.make_task_problems("arithmetic", 200, difficulty=3, seed=1, split="eval", ops="+-*")
  assert tr == data.make_task_problems("arithmetic", 400, difficulty=3, seed=0, ops="+-*")
  assert not {p.prompt for p in tr} & {p.prompt for p in ev}  # held-out never in training, even across seeds
  assert len({p.id for p in tr}) == 400
  ops_seen, max_digits = set(), 0
  for p in tr + ev:
    a, op, b = __import__("re").fullmatch(r"(\d+)([+*-])(\d+)=", p.prompt).groups()
    assert int(p.answer) == {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
    assert data.verify(p, p.answer + "\n") == 1.0 and p.task == "arithmetic"
    ops_seen.add(op)
    max_digits = max(max_digits, len(a), len(b))
  assert ops_seen == set("+-*") and max_digits == 3
  with pytest.raises(ValueError, match="distinct"):
    data.make_task_problems("arithmetic", 300, difficulty=1, ops="+")  # only 100 exist
  with pytest.raises(ValueError, match="difficulty"):
    data.make_task_problems("arithmetic", 3, difficulty=0)


def test_countdown_problems_solvable_and_disjoint():
  tr = data.make_task_problems("countdown", 200, difficulty=4, seed=0, max_number=12)
  ev = data.make_task_problems("countdown", 50, difficulty=4, seed=0, split="eval", max_number=12)
  assert not {p.prompt for p in tr} & {p.prompt for p in ev}
  for p in tr + ev:
    nums, target = p.prompt.split(" -> ")
    assert len(nums.split()) == 4 and all(1 <= int(x) <= 12 for x in nums.split()) and int(target[:-1]) > 0
    assert data.verify(p, p.answer) == 1.0, p


def test_arithmetic_verifier():
  p = Problem("x", "3-15=", "-12", "arithmetic")
  assert [data.verify(p, c) for c in ("-12", " -12\n", "-012", "12", "-12 ", "-1 2", "-12.0", "- 12", "")] == \
      [1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]


def test_countdown_verifier():
  p = Problem("x", "6 4 3 -> 8:", "6/3*4", "countdown")
  cases = {"6/3*4": 1, "4*6/3": 1, "(4/3)*6": 1, " 6/3*4=8 ": 1, "6/3*4=9": 0, "4+4": 0, "6+3": 0, "8": 0,
           "6-(3-4)+1": 0, "-(-8)": 0, "2**3": 0, "__import__('os').system('x')": 0, "6/(3-3)": 0,
           "((((6/3))))*4": 1, "(" * 500 + "8" + ")" * 500: 0, "6/3*4+0": 0}
  for c, want in cases.items():
    assert data.verify(p, c) == want, c
  assert data.verify(Problem("y", "2 2 5 -> 9:", "2+2+5", "countdown"), "5+2+2") == 1.0
  assert data.verify(Problem("y", "2 2 5 -> 7:", "2+5", "countdown"), "2+5") == 1.0  # subsets are allowed


def test_math_verifier():
  ex = tasks.math_answer.extract_answer
  assert ex("so \\boxed{3} hmm, no: \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
  assert ex("\\boxed{\\frac{a}{\\sqrt{b}}} done") == "\\frac{a}{\\sqrt{b}}"
  assert ex("We get 12 apples.\nThe answer is 1,234.") == "1,234."
  assert ex("so 3 then 4\n x = -7.5") == "-7.5" and ex("no numbers") is None
  p = Problem("m", "?", "\\boxed{\\frac{1}{2}}", "math")
  assert data.verify(p, "First \\boxed{2}. Wait, actually \\boxed{0.5}") == 1.0  # the last box wins
  assert data.verify(p, "First \\boxed{0.5}. Wait, actually \\boxed{2}") == 0.0
  assert data.verify(Problem("m", "?", "1234", "math"), "Total: 1,234", strict_math=False) == 1.0
  assert data.verify(Problem("m", "?", "1234", "math"), "Total: 1,234") == 0.0  # strict: only \boxed{} counts


@pytest.mark.parametrize("pred, ref, want", [
    # relations, implications, disjunctions/conjunctions state a claim, not an answer (math-verify compared their
    # last side only): 0 unless the reference is such an expression
    ("2 = 42", "42", 0), ("41 \\lor 42", "42", 0), ("41 \\to 42", "42", 0), ("41 \\vee 42", "42", 0),
    ("41 \\land 42", "42", 0), ("41 \\wedge 42", "42", 0), ("41 \\implies 42", "42", 0),
    ("41 \\Rightarrow 42", "42", 0), ("41 \\iff 42", "42", 0), ("41 \\approx 42", "41", 0), ("x \\le 42", "42", 0),
    ("42 \\geq 1", "42", 0), ("41 \\neq 42", "42", 0), ("41 < 42", "42", 0), ("x = 2 = 42", "42", 0),
    ("x = 41 \\lor x = 42", "42", 0), ("x = 41 \\lor x = 42", "x = 42", 0), ("x = 41 \\not= 42", "42", 0),
    ("41 \\mid 42", "42", 0), ("41 \\\\ 42", "42", 0), ("41 | 42", "42", 0), ("41 \\cup 42", "42", 0),
    ("41 \\sim 42", "42", 0), ("41 \\therefore 42", "42", 0), ("$41$ or $42$", "42", 0), ("41 or 42", "42", 0),
    ("41 \\to 42", "#### 42", 0), ("2=42", "#### 42", 0),
    # honest answers still score 1: a value, or one stated as "x = value" (math-verify's assignment form)
    ("42", "42", 1), ("\\frac{1}{2}", "0.5", 1), ("0.5", "\\frac12", 1), ("x = 42", "42", 1), ("x_1 = 42", "42", 1),
    ("\\theta = 42", "42", 1), ("y = 2x + 1", "2x+1", 1), ("\\$42", "42", 1), ("42", "#### 42", 1),
    ("x=3", "x = 3", 1), ("3", "x = 3", 1), ("y = 3", "x = 3", 0), ("x > 3", "x > 3", 1), ("3 < x", "x > 3", 1),
    ("x \\le 3", "x \\leq 3", 1), ("x \\in [0, 1]", "[0,1]", 1), ("41, 42", "42, 41", 1), ("41 or 42", "41, 42", 1)])
def test_math_verifier_rejects_claims(pred, ref, want):
  assert data.verify(Problem("m", "?", ref, "math"), f"So \\boxed{{{pred}}}") == want


# --------------------------------------------------------------------------------------------- verifier pool

def _procs_with_cwd_under(folder):
  found = []
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      if os.readlink(f"/proc/{pid}/cwd").startswith(folder):
        found.append(pid)
    except OSError:
      pass
  return found


def test_verifier_pool_scores_and_survives_timeouts():
  probs = data.make_task_problems("arithmetic", 3, difficulty=2, seed=0)
  slow = Problem("slow", "?", "", "code", (("", "never"),))
  with data.VerifierPool(max_workers=2, timeout_s=2.0, limits=sandbox.SandboxLimits(wall_s=60, cpu_s=60)) as pool:
    t = time.monotonic()
    scores = pool.score(probs + [slow] + probs, [p.answer for p in probs] + ["while True: pass"] + ["0", "1", "2"])
    elapsed = time.monotonic() - t
    assert scores[:3] == [1.0, 1.0, 1.0] and scores[3] == 0.0
    assert scores[4:] == [float(p.answer == c) for p, c in zip(probs, ["0", "1", "2"])]
    assert pool.timeouts == 1 and elapsed < 20, elapsed
    # The killed worker's sandboxed child died with it (PR_SET_PDEATHSIG) and its temp dirs are gone.
    time.sleep(0.5)
    assert not _procs_with_cwd_under(pool._tmp)
    left = sorted(os.listdir(pool._tmp))
    assert len(left) == 2 and "w2" in left, left
    assert pool.score(probs, [p.answer for p in probs]) == [1.0, 1.0, 1.0]  # the replaced worker works
    with pytest.raises(ValueError, match="completions"):
      pool.score(probs, [])
  bad = Problem("bad", "?", "1", "poetry")  # a verifier error scores 0 and is counted, never raised
  pool = data.VerifierPool(max_workers=1)
  assert pool.score([bad], ["1"]) == [0.0] and pool.errors == 1 and "poetry" in pool.last_error
  pool.close()
  assert data.VerifierPool(max_workers=0).score(probs, [p.answer for p in probs]) == [1.0, 1.0, 1.0]


def test_verifier_pool_temp_dir_removed_without_close(tmp_path):
  # A worker that exits without close() (rollout.py's) leaves no temp dir behind, scored or not.
  code = ("import sys, data\n"
          "pool = data.VerifierPool(max_workers=1)\n"
          "print(pool._tmp, flush=True)\n"
          "pool.score(data.make_task_problems('arithmetic', 1), ['0'])  # its worker's own dir made\n"
          "print(data.VerifierPool(max_workers=1)._tmp)  # garbage: collected at once\n")
  env = dict(os.environ, TMPDIR=str(tmp_path), JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr
  dirs = out.stdout.split()
  assert len(dirs) == 2 and all(d.startswith(str(tmp_path)) for d in dirs), out.stdout
  assert not os.listdir(tmp_path)


# ----------------------------------------------------------------------------------------------- pass rates

def test_filter_by_pass_rate_and_curated_jsonl(tmp_path):
  probs = data.make_task_problems("arithmetic", 6, difficulty=2, seed=0)
  rates = dict(zip((p.id for p in probs), [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]))
  assert data.filter_by_pass_rate(probs, rates) == probs[1:4]
  assert data.filter_by_pass_rate(probs, rates, 0.3, 0.8) == probs[2:4]
  data.write_jsonl(tmp_path / "c.jsonl", probs[1:4], rates)
  assert data.load_jsonl(tmp_path / "c.jsonl") == probs[1:4]
  with pytest.raises(ValueError, match="no pass rate"):
    data.filter_by_pass_rate(probs, {})


def test_pass_rate_tracker():
  t = data.PassRateTracker(ema=0.5)
  t.update("a", [1, 0, 0, 0])
  t.update("a", [1, 1, 1, 1])
  t.update("b", [0, 0])
  assert t.rate("a") == 5 / 8 and t.ema_rate("a") == 0.5 * 0.25 + 0.5 * 1.0 and t.rate("zz") is None
  r = data.PassRateTracker()
  r.load_state_dict(json.loads(json.dumps(t.state_dict())))
  assert r.stats == t.stats and r.ema == 0.5


# ------------------------------------------------------------------------------------------------- batching

def test_make_batch_alignment():
  b = data.make_batch([[2, 10, 11], [2, 12]], [[20, 21, 3], [22]], buckets=(8, 4), pad_id=0,
                      completion_extras={"logp": [[-1.0, -2.0, -3.0], [-4.0]]})
  assert b["tokens"].shape == (2, 8) and b["tokens"].dtype == np.int32
  np.testing.assert_array_equal(b["tokens"][0], [2, 10, 11, 20, 21, 3, 0, 0])
  np.testing.assert_array_equal(b["targets"][0], [10, 11, 20, 21, 3, 0, 0, 0])
  np.testing.assert_array_equal(b["loss_mask"][0], [0, 0, 1, 1, 1, 0, 0, 0])
  np.testing.assert_array_equal(b["logp"][0], [0, 0, -1, -2, -3, 0, 0, 0])
  np.testing.assert_array_equal(b["tokens"][1], [2, 12, 22, 0, 0, 0, 0, 0])
  np.testing.assert_array_equal(b["loss_mask"][1], [0, 1, 0, 0, 0, 0, 0, 0])
  np.testing.assert_array_equal(b["positions"][1], [0, 1, 2, 0, 0, 0, 0, 0])
  np.testing.assert_array_equal(b["segment_ids"][1], [1, 1, 1, 0, 0, 0, 0, 0])
  # Every masked target is the completion token it should be.
  m = b["loss_mask"] > 0
  assert b["targets"][0][m[0]].tolist() == [20, 21, 3]
  assert data.make_batch([[1, 2]], [[3, 4]], buckets=(8, 4))["tokens"].shape == (1, 4)  # the smallest that fits
  with pytest.raises(ValueError, match="largest bucket"):
    data.make_batch([[1] * 9], [[2]], buckets=(4, 8))
  with pytest.raises(ValueError, match="empty prompt"):
    data.make_batch([[]], [[2]], buckets=(8,))
  with pytest.raises(ValueError, match="completion tokens"):
    data.make_batch([[1]], [[2, 3]], buckets=(8,), completion_extras={"logp": [[0.0]]})
