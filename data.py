"""Data for RL: problems and prompt templates, jsonl datasets, the tokenizer, rewards (tasks/ behind a verifier
process pool), per-prompt pass rates, the queue records and batching. Host-side Python/numpy only (no JAX), so
workers, the trainer and the verifier processes all import it cheaply.

Design choices
- Tokenizer: one `Tokenizer` over a sentencepiece model (the built-in tasks', or a Llama-style tokenizer.model) or
  an HF tokenizer.json (the optional `tokenizers` package). The built-in tokenizer trains in under a second on
  generated task text with split_digits (every digit its own piece, so arithmetic is learnable), identity
  normalisation and no dummy prefix (encode/decode round-trip exactly); ids pad=0 unk=1 bos=2 eos=3.
- The prompt template is applied in one place, `render_prompt`.
- Tasks live in tasks/, one module each (see tasks/__init__.py); `verify` scores a completion by the task of its
  problem. `VerifierPool` runs it in N spawned processes: a call past its timeout scores 0 and its worker is
  killed and replaced, so one slow verifier never stalls the caller.
- Batching (numpy, right padding): sequence = prompt ++ completion, length L = P + C.
    tokens[b, t]      t < L: the token; else pad_id
    targets[b, t]     tokens[b, t+1] for t < L-1; else pad_id        (next-token targets)
    loss_mask[b, t]   1.0 iff P-1 <= t <= L-2, i.e. targets[b, t] is a completion token
    positions[b, t]   t within its sequence (0 on padding); segment_ids 1 on the sequence, 0 on padding
  so the log-prob of completion token j sits at t = P-1+j; `completion_extras` (e.g. behaviour log-probs, one
  float per completion token) are scattered to the same positions. Row length: the smallest bucket >= max L.
"""
import collections
import dataclasses
import hashlib
import itertools
import json
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import re
import shutil
import signal
import tempfile
import time
from typing import Callable, Optional, Sequence

import numpy as np

import common
from tasks import TASKS, TOKENIZER_CORPUS
from tasks.math_answer import GSM8K_FINAL, extract_answer
from tasks.sandbox import SandboxLimits, SandboxUnavailable, call_test

EVAL_BUCKET = 200  # of 1000 hash buckets: 20% of all possible generated problems are held out
# Row lengths a batch pads to (powers of two: few compiled shapes); train's (x2 past 4096: buckets_for) and Engine's
# prompt buckets (to 2048) are slices of it. 16 first: a built-in arithmetic row (bos, prompt, answer, eos) is
# <= 12 tokens; padding it to 16, not 32, halves the demo's SFT and RL step time.
BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


# ----------------------------------------------------------------------------------------------- problems

@dataclasses.dataclass(frozen=True)
class Problem:
  id: str
  prompt: str
  answer: str
  task: str = "math"
  tests: Optional[tuple] = None  # code: items are python source str or (stdin, expected_stdout) pairs
  messages: Optional[tuple] = None  # chat jsonl: the whole conversation, ((role, content), ...), ends with a user turn
  source: str = dataclasses.field(default="", compare=False)  # "file:line" for load-time reports

  def __post_init__(self):
    # Tests that travelled through JSON arrive as lists: store tuples so the problem stays hashable.
    if self.tests is not None:
      object.__setattr__(self, "tests", tuple(t if isinstance(t, str) else tuple(t) for t in self.tests))


def render_prompt(problem: Problem, template: str = "plain", chat_template: Optional[Callable] = None) -> str:
  """"plain": the prompt as is (a chat line's turns joined by blank lines). "chatml": Qwen/QwQ-style chat turns
  ending with the assistant header. "hf": the checkpoint's own chat template (chat_template=load_chat_template(dir)).
  A chat jsonl line is rendered whole: system, few-shot turns and the last user turn."""
  msgs = [{"role": r, "content": c} for r, c in problem.messages or (("user", problem.prompt),)]
  if template == "plain":
    return "\n\n".join(m["content"] for m in msgs)
  if template == "chatml":
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in msgs) + "<|im_start|>assistant\n"
  if template == "hf":
    if chat_template is None:
      raise ValueError("render_prompt: template 'hf' needs chat_template=load_chat_template(checkpoint_dir)")
    try:
      return chat_template(msgs)
    except Exception as e:  # raise_exception() (it names the template's file) or a template bug: name the problem
      raise ValueError(f"render_prompt: problem {problem.id!r} ({problem.source or '?'}): {type(e).__name__}: {e}") from e
  raise ValueError(f"render_prompt: unknown template {template!r} (expected 'plain', 'chatml' or 'hf')")


def prompt_encoder(tok, template: str, tokenizer_path) -> Callable:
  """problem -> prompt token ids, exactly as transformers' apply_chat_template(..., add_generation_prompt=True,
  tokenize=True): a chat template writes its own special tokens (Llama's <|begin_of_text|>), so its text is
  encoded without adding any; only "plain" text gets the tokenizer's bos. "auto" is "hf" when the checkpoint ships
  a chat template, else "plain"."""
  if template == "auto":
    template = "hf" if has_chat_template(tokenizer_path) else "plain"
  chat = load_chat_template(tokenizer_path) if template == "hf" else None
  return lambda p: tok.encode(render_prompt(p, template, chat), add_bos=template == "plain")


def _chat_template_source(path):
  """(Jinja source or None when it ships none, its file, tokenizer_config.json) of a checkpoint dir (or a file in it):
  tokenizer_config.json's "chat_template", else chat_template.jinja (as newer transformers write)."""
  folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
  cfg, where = _read_json(folder, "tokenizer_config.json"), os.path.join(folder, "tokenizer_config.json")
  src = cfg.get("chat_template")
  if isinstance(src, list):  # [{"name": "default", "template": ...}, ...]
    src = next((t["template"] for t in src if t.get("name") == "default"), None)
  if src is None and os.path.exists(where := os.path.join(folder, "chat_template.jinja")):
    with open(where, encoding="utf-8") as f:
      src = f.read()
  return src or None, where, cfg


def has_chat_template(path) -> bool:
  return _chat_template_source(path)[0] is not None


def load_chat_template(path) -> Callable:
  """render(messages) -> str for a checkpoint's chat template (_chat_template_source), rendered the way
  transformers' apply_chat_template does: sandboxed environment, trim/lstrip_blocks, raise_exception, bos/eos tokens, and
  add_generation_prompt=True."""
  from jinja2.exceptions import TemplateError
  from jinja2.sandbox import ImmutableSandboxedEnvironment
  src, where, cfg = _chat_template_source(path)
  if src is None:
    raise ValueError(f"load_chat_template: no 'chat_template' in {os.path.dirname(where)}/tokenizer_config.json nor "
                     f"chat_template.jinja; use --template=chatml/plain")

  def raise_exception(message):  # render_prompt adds the problem
    raise TemplateError(f"{where}: {message}")

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
  env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, separators=None, sort_keys=False: json.dumps(
      x, indent=indent, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys)
  env.globals.update(raise_exception=raise_exception, strftime_now=time.strftime)
  try:
    template = env.from_string(src)
  except TemplateError as e:  # jinja names a line of the template, not its file
    raise ValueError(f"load_chat_template: {where}: {type(e).__name__}: {e}") from None
  bos, eos = _special_token(cfg, "bos_token"), _special_token(cfg, "eos_token")
  return lambda messages: template.render(messages=messages, add_generation_prompt=True, bos_token=bos or "",
                                          eos_token=eos or "")


def _read_json(folder, name) -> dict:
  """folder/name parsed as JSON, or {} when the file does not exist (optional HF config files)."""
  p = os.path.join(folder, name)
  if not os.path.exists(p):
    return {}
  with open(p, encoding="utf-8") as f:
    try:
      return json.load(f)
    except ValueError as e:  # JSONDecodeError names a line and column, not the file
      raise ValueError(f"{p}: not valid JSON: {e}") from None


def _special_token(cfg, field):
  """A special token's text from an HF config: a plain string or an AddedToken dict {"content": ...}."""
  t = cfg.get(field)
  return t.get("content") if isinstance(t, dict) else t


# ------------------------------------------------------------------------------------------- jsonl datasets

SHAPES = ("auto", "prompt", "messages", "gsm8k", "math")


def _parse_tests(raw, where):
  if not isinstance(raw, list):
    raise ValueError(f"{where}: field 'tests' must be a list, got {type(raw).__name__}")
  out = []
  for i, t in enumerate(raw):
    if isinstance(t, str):
      try:
        call_test(t)
      except ValueError as e:
        raise ValueError(f"{where}: tests[{i}]: {e}") from None
      out.append(t)
    elif isinstance(t, dict) and isinstance(t.get("input"), str) and isinstance(t.get("output"), str):
      out.append((t["input"], t["output"]))
    else:
      raise ValueError(f"{where}: tests[{i}] must be a string or {{'input': str, 'output': str}}, got {t!r:.80}")
  if len({isinstance(t, str) for t in out}) > 1:
    raise ValueError(f"{where}: field 'tests' mixes assert strings with input/output cases; use one kind")
  return tuple(out)


def _need_str(d, field, where):
  if field not in d:
    raise ValueError(f"{where}: missing field {field!r}")
  if not isinstance(d[field], str):
    raise ValueError(f"{where}: field {field!r} must be a string, got {type(d[field]).__name__}")
  return d[field]


def _problem_from_dict(d, where, shape="auto", default_id=None) -> Problem:
  """The shapes: "prompt" {"prompt","answer"}, "messages" {"messages":[...],"answer"}, "gsm8k" {"question",
  "answer": "... #### N"}, "math" {"problem","solution": "... \\boxed{X}"}; "auto" picks by the first key present."""
  if not isinstance(d, dict):
    raise ValueError(f"{where}: expected a JSON object, got {type(d).__name__}")
  if shape == "auto":
    shape = next((s for key, s in (("prompt", "prompt"), ("messages", "messages"), ("question", "gsm8k"),
                                   ("problem", "math")) if key in d), None)
    if shape is None:
      raise ValueError(f"{where}: unknown record shape (fields {sorted(d)[:8]}); expected 'prompt'+'answer', "
                       f"'messages'+'answer', GSM8K 'question'+'answer' or MATH 'problem'+'solution'")
  elif shape not in SHAPES:
    raise ValueError(f"load_jsonl: unknown shape {shape!r} (expected one of {SHAPES})")
  messages = None
  if shape == "gsm8k":
    prompt, ans = _need_str(d, "question", where), _need_str(d, "answer", where)
    m = GSM8K_FINAL.search(ans)
    if not m:
      raise ValueError(f"{where}: field 'answer' has no GSM8K '#### N' final answer: {ans[-60:]!r}")
    answer = m.group(1).replace(",", "")
  elif shape == "math":
    prompt, sol = _need_str(d, "problem", where), _need_str(d, "solution", where)
    answer = d["answer"] if isinstance(d.get("answer"), str) else extract_answer(sol, strict=True)
    if answer is None:
      raise ValueError(f"{where}: field 'solution' has no \\boxed{{}} answer (and no 'answer' field)")
  else:
    if shape == "messages":
      msgs = d.get("messages")
      if not isinstance(msgs, list) or not all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                                and m.get("role") in ("system", "user", "assistant") for m in msgs):
        raise ValueError(f"{where}: field 'messages' must be a list of {{'role': system|user|assistant, 'content': str}}")
      if not msgs or msgs[-1]["role"] != "user":
        raise ValueError(f"{where}: field 'messages' must end with a user turn (the policy writes the next "
                         f"assistant turn), got {[m.get('role') for m in msgs][-3:]}")
      prompt, messages = msgs[-1]["content"], tuple((m["role"], m["content"]) for m in msgs)
    else:
      prompt = _need_str(d, "prompt", where)
    if "answer" not in d:
      raise ValueError(f"{where}: missing field 'answer'")
    answer = d["answer"]
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
      raise ValueError(f"{where}: field 'answer' must be a string or number, got {answer!r:.80}")
    if isinstance(answer, float) and not math.isfinite(answer):
      raise ValueError(f"{where}: field 'answer' must be finite, got {answer!r}")
  pid = d.get("id", default_id)
  if pid is None:
    raise ValueError(f"{where}: missing field 'id'")
  if isinstance(pid, bool) or not isinstance(pid, (str, int)):
    raise ValueError(f"{where}: field 'id' must be a string or int, got {pid!r:.80}")
  tests = _parse_tests(d["tests"], where) if d.get("tests") is not None else None
  task = d.get("task", "code" if tests else "math")
  if not isinstance(task, str) or task not in TASKS:
    raise ValueError(f"{where}: field 'task' must be one of {tuple(TASKS)}, got {task!r:.80}")
  if task == "code" and not tests:
    raise ValueError(f"{where}: task 'code' needs a non-empty 'tests' list")
  return Problem(str(pid), prompt, str(answer), task, tests, messages, where)


def _refuse_constant(name):
  raise ValueError(f"non-finite number {name} is not allowed (numbers must be finite)")


def load_jsonl(path, shape: str = "auto") -> list:
  """One problem per line in any of _problem_from_dict's shapes (`shape` forces one; "auto" detects per line).
  "id" is optional outside the "prompt" shape (default: the line number). Blank lines skipped, extra fields
  ignored. Any bad line raises ValueError naming path:line and the field."""
  problems, seen = [], {}
  with open(path, "rb") as f:
    for lineno, raw in enumerate(f, 1):
      where = f"{path}:{lineno}"
      try:
        line = raw.decode("utf-8")
      except UnicodeDecodeError as e:
        raise ValueError(f"{where}: not valid UTF-8 (byte {e.start}: {raw[e.start:e.start + 4]!r})") from None
      if not line.strip():
        continue
      try:
        d = json.loads(line, parse_constant=_refuse_constant)
      except json.JSONDecodeError as e:
        raise ValueError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
      except RecursionError:
        raise ValueError(f"{where}: JSON nested too deeply") from None
      except ValueError as e:  # e.g. an int literal over Python's 4300-digit limit, or NaN/Infinity
        raise ValueError(f"{where}: {e}") from None
      default_id = None if (isinstance(d, dict) and "prompt" in d and shape in ("auto", "prompt")) else f"L{lineno}"
      p = _problem_from_dict(d, where, shape, default_id)
      if p.id in seen:
        raise ValueError(f"{where}: duplicate id {p.id!r} (first seen on line {seen[p.id]})")
      seen[p.id] = lineno
      problems.append(p)
  return problems


def write_jsonl(path, problems, pass_rates: Optional[dict] = None):
  """Writes problems (atomically: tmp file + rename) in the format load_jsonl reads; adds "pass_rate"."""
  lines = []
  for p in problems:
    d = {"id": p.id, "prompt": p.prompt, "answer": p.answer, "task": p.task}
    if p.tests is not None:
      d["tests"] = [t if isinstance(t, str) else {"input": t[0], "output": t[1]} for t in p.tests]
    if pass_rates is not None and p.id in pass_rates:
      d["pass_rate"] = pass_rates[p.id]
    lines.append(json.dumps(d) + "\n")
  common.write_atomic(path, lines, tmp=f"{path}.tmp{os.getpid()}")  # per-pid temp: concurrent writers


def fit_prompts(problems, encode: Callable, max_new_tokens: int, max_seq_len: int):
  """(kept, skipped, longest kept prompt) by whether prompt tokens + max_new_tokens <= max_seq_len.
  encode(problem) -> token ids (rendered template included). skipped: [(problem, n_tokens)], each logged with
  its file:line, length and the limit, so a prompt that cannot fit is refused at load, never in a worker."""
  kept, skipped, lengths = [], [], []
  limit = max_seq_len - max_new_tokens
  for p in problems:
    n = len(encode(p))
    if n > limit:
      skipped.append((p, n))
      logging.warning("%s: prompt %r has %d tokens > limit %d (max_seq_len %d - max_new_tokens %d): skipped",
                      p.source or "?", p.id, n, limit, max_seq_len, max_new_tokens)
    else:
      kept.append(p)
      lengths.append(n)
  if skipped:
    logging.warning("fit_prompts: skipped %d of %d prompts that cannot fit", len(skipped), len(problems))
  return kept, skipped, max(lengths, default=0)


def eval_problems(jsonl, n, task, task_args) -> list:
  """The held-out set: jsonl's first n lines, or n problems of the built-in task's held-out split (hash-disjoint
  from training's whatever the seeds)."""
  if jsonl:
    return load_jsonl(jsonl)[:n]
  return make_task_problems(task, n, seed=1234, split="eval", **parse_task_args(task_args))


def pass_at_k(n: int, c: int, k: int) -> float:
  """Unbiased pass@k estimator (Chen et al. 2021, "Evaluating LLMs trained on code"): 1 - C(n-c,k)/C(n,k)."""
  if n < k:
    raise ValueError(f"pass@{k} needs n >= k samples, got n={n}")
  return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_at_k_summary(correct) -> dict:
  """correct [problems, n] bools -> pass@1 and pass@n over the problems, each with its standard error (the
  problems are the independent draws)."""
  correct = np.asarray(correct)
  out, n = {}, correct.shape[1]
  for k in sorted({1, n}):
    per = np.asarray([pass_at_k(n, int(c.sum()), k) for c in correct])
    out[f"pass@{k}"] = float(per.mean())
    out[f"pass@{k}_se"] = float(per.std(ddof=1) / np.sqrt(len(per))) if len(per) > 1 else 0.0
  return out


def completion_budget(prompt_lengths, context: int, cap: int = 1024) -> int:
  """--max_new_tokens=0: the tokens the context leaves after the longest prompt that fits in half of it, capped
  (a 1024-position checkpoint with 200-token prompts gets 824; a 32k one gets the cap). Longer prompts are then
  skipped at load by fit_prompts, as with an explicit budget."""
  return min(cap, context - max((n for n in prompt_lengths if n <= context // 2), default=0))


class PromptStream:
  """Endless stream over problems: epoch e visits a permutation seeded by (seed, e). state_dict() holds the
  (epoch, cursor) pair, so a restored stream continues with exactly the next problem."""

  def __init__(self, problems, seed: int = 0):
    if not problems:
      raise ValueError("PromptStream: no problems")
    self.problems, self.seed, self.epoch, self.cursor = list(problems), seed, 0, 0
    self._order = self._permutation(0)
    self._fingerprint = hashlib.sha256("\n".join(p.id for p in self.problems).encode()).hexdigest()[:16]

  def _permutation(self, epoch):
    return np.random.default_rng([self.seed, epoch]).permutation(len(self.problems))

  def next(self) -> Problem:
    if self.cursor == len(self.problems):
      self.epoch, self.cursor = self.epoch + 1, 0
      self._order = self._permutation(self.epoch)
    p = self.problems[int(self._order[self.cursor])]
    self.cursor += 1
    return p

  def take(self, n: int) -> list:
    return [self.next() for _ in range(n)]

  def peek(self, n: int) -> list:
    """The next n problems, without advancing the stream (what curation estimates before they are issued)."""
    saved = (self.epoch, self.cursor, self._order)
    out = self.take(n)
    self.epoch, self.cursor, self._order = saved
    return out

  def state_dict(self) -> dict:
    return {"seed": self.seed, "epoch": self.epoch, "cursor": self.cursor, "n": len(self.problems),
            "fingerprint": self._fingerprint}

  def load_state_dict(self, d: dict):
    # A changed dataset would silently resume at the wrong place: refuse it instead.
    for field, mine in (("seed", self.seed), ("n", len(self.problems)), ("fingerprint", self._fingerprint)):
      if d.get(field) != mine:
        raise ValueError(f"PromptStream.load_state_dict: field {field!r} is {d.get(field)!r}, this stream has {mine!r}")
    for field, hi in (("epoch", None), ("cursor", len(self.problems))):
      v = d.get(field)
      if not isinstance(v, int) or v < 0 or (hi is not None and v > hi):
        raise ValueError(f"PromptStream.load_state_dict: field {field!r} is {v!r}, expected an int in [0, {hi or 'inf'}]")
    self.epoch, self.cursor = int(d["epoch"]), int(d["cursor"])
    self._order = self._permutation(self.epoch)


# ---------------------------------------------------------------------------------------------- tokenizer

class Tokenizer:
  """Plain wrapper over a sentencepiece processor (`sp`) or an HF `tokenizers.Tokenizer` (`hf`).
  bos_id may be None (e.g. Qwen has no bos). decode() stops at the first stop id and drops pad/bos."""

  def __init__(self, *, sp=None, hf=None, bos_id, eos_id, pad_id, stop_ids=()):
    assert (sp is None) != (hf is None)
    self.sp, self.hf = sp, hf
    self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id
    self.stop_ids = frozenset(stop_ids) | {eos_id}
    self.vocab_size = sp.get_piece_size() if sp is not None else hf.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str, add_bos: bool = False) -> list:
    ids = list(self.sp.encode(text)) if self.sp is not None else self.hf.encode(text, add_special_tokens=False).ids
    return [self.bos_id] + ids if add_bos and self.bos_id is not None else ids

  def decode(self, ids) -> str:
    ids = itertools.takewhile(lambda i: i not in self.stop_ids, map(int, ids))
    keep = [i for i in ids if i != self.pad_id and i != self.bos_id]
    return self.sp.decode(keep) if self.sp is not None else self.hf.decode(keep, skip_special_tokens=False)


def _sp_tokenizer(path):
  import sentencepiece as spm
  sp = spm.SentencePieceProcessor(model_file=str(path))
  bos, eos, pad = sp.bos_id(), sp.eos_id(), sp.pad_id()
  if eos < 0:
    raise ValueError(f"{path}: sentencepiece model has no eos id")
  return Tokenizer(sp=sp, bos_id=bos if bos >= 0 else None, eos_id=eos, pad_id=pad if pad >= 0 else eos)


def _hf_tokenizer(path):
  try:
    import tokenizers
  except ImportError:
    raise ImportError(f"{path} is an HF tokenizer.json: `pip install tokenizers` (optional dependency, see README)") from None
  tok = tokenizers.Tokenizer.from_file(str(path))
  folder = os.path.dirname(os.path.abspath(path))
  cfg = {**_read_json(folder, "special_tokens_map.json"), **_read_json(folder, "tokenizer_config.json")}

  def token_id(field):
    t = _special_token(cfg, field)
    if t is None:
      return None
    i = tok.token_to_id(t)
    if i is None:
      raise ValueError(f"{folder}: {field} {t!r} is not in tokenizer.json's vocabulary")
    return i

  gen_eos = _read_json(folder, "generation_config.json").get("eos_token_id")
  stop = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
  eos = token_id("eos_token")
  eos = stop[0] if eos is None and stop else eos
  if eos is None:
    raise ValueError(f"{folder}: no eos_token in tokenizer_config.json/special_tokens_map.json nor eos_token_id in generation_config.json")
  pad = token_id("pad_token")
  return Tokenizer(hf=tok, bos_id=token_id("bos_token"), eos_id=eos, pad_id=eos if pad is None else pad, stop_ids=stop)


def load_tokenizer(path) -> Tokenizer:
  """`path`: a sentencepiece .model, a tokenizer.json, or a checkpoint dir holding tokenizer.json
  (preferred) or tokenizer.model."""
  path = str(path)
  if os.path.isdir(path):
    for name, loader in (("tokenizer.json", _hf_tokenizer), ("tokenizer.model", _sp_tokenizer)):
      if os.path.exists(os.path.join(path, name)):
        return loader(os.path.join(path, name))
    raise ValueError(f"load_tokenizer: {path} has neither tokenizer.json nor tokenizer.model")
  if not os.path.exists(path):
    raise ValueError(f"load_tokenizer: {path} does not exist")
  return _hf_tokenizer(path) if path.endswith(".json") else _sp_tokenizer(path)


def build_task_tokenizer(out_dir, task: str = "arithmetic", seed: int = 0, vocab_size: int = 64) -> str:
  """The built-in tokenizer of a generated task, a sentencepiece BPE model trained (deterministically: one thread,
  no input sampling; vocab_size is an upper bound) on the task's alphabet, one sentence per character (each is a
  piece of its own: no junk merges), then 150 generated prompts and answers per TOKENIZER_CORPUS entry of the task
  (separate sentences: no piece straddles the prompt/completion boundary). Reuses an existing file."""
  path = os.path.join(str(out_dir), f"tokenizer-{task}.model")
  if os.path.exists(path):
    return path
  if task not in TOKENIZER_CORPUS:
    raise ValueError(f"build_task_tokenizer: task must be one of {tuple(TOKENIZER_CORPUS)}, got {task!r}")
  alphabet, corpus_args = TOKENIZER_CORPUS[task]
  texts = list(alphabet)
  for task_args in corpus_args:
    for p in make_task_problems(task, 150, seed=seed, **task_args):
      texts += [p.prompt, p.answer]
  import io
  import sentencepiece as spm
  buf = io.BytesIO()
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(texts), model_writer=buf, vocab_size=vocab_size, model_type="bpe", split_digits=True,
      byte_fallback=False, user_defined_symbols=[], pad_id=0, unk_id=1, bos_id=2, eos_id=3, character_coverage=1.0,
      num_threads=1, shuffle_input_sentence=False, add_dummy_prefix=False, normalization_rule_name="identity",
      remove_extra_whitespaces=False, hard_vocab_limit=False, minloglevel=2)
  os.makedirs(str(out_dir), exist_ok=True)
  common.write_atomic(path, buf.getvalue(), tmp=f"{path}.tmp{os.getpid()}")
  return path


# ------------------------------------------------------------------------------------------ tasks, rewards

def parse_task_args(text: str) -> dict:
  """"difficulty=2,ops=+" -> {"difficulty": 2, "ops": "+"} (integers become ints); "" -> {}."""
  out = {}
  for item in filter(None, text.split(",")):
    key, eq, value = item.partition("=")
    if not eq or not key.strip().isidentifier():
      raise ValueError(f"task args: {item!r} is not name=value (e.g. difficulty=2,ops=+)")
    out[key.strip()] = int(value) if re.fullmatch(r"-?\d+", value) else value
  return out


def make_task_problems(task: str, n: int, *, seed: int = 0, split: str = "train", **task_args) -> list:
  """n distinct generated problems of `task` in `split` ("train" or "eval"; see tasks/), deterministic in all
  arguments; task_args go to the task's generate (e.g. difficulty=2, ops="+")."""
  t = TASKS.get(task)
  if t is None or t.generate is None:
    raise ValueError(f"make_task_problems: task must be one of {tuple(k for k, v in TASKS.items() if v.generate)}, "
                     f"got {task!r}")
  if split not in ("train", "eval"):
    raise ValueError(f"make_task_problems: split must be 'train' or 'eval', got {split!r}")
  try:
    draws = t.generate(f"{seed}|{split}", **task_args)
  except TypeError as e:  # an argument the task does not take
    raise ValueError(f"make_task_problems: {task}: {e}") from None
  out, seen = [], set()
  for made in itertools.islice(draws, 50 * n + 1000):
    if len(out) == n:
      break
    if made is None or made[0] in seen or _is_eval((t.split_key or str)(made[0])) != (split == "eval"):
      continue
    seen.add(made[0])
    out.append(Problem(f"{task}-{hashlib.sha256(made[0].encode()).hexdigest()[:12]}", made[0], made[1], task))
  if len(out) < n:
    raise ValueError(f"make_task_problems: only {len(out)} distinct {split} problems found for {task} {task_args}; "
                     "ask for fewer or widen the task's args")
  return out


def _is_eval(prompt: str) -> bool:
  return int(hashlib.sha256(prompt.encode()).hexdigest()[:8], 16) % 1000 < EVAL_BUCKET


def task_args_error(task: str, text: str) -> Optional[str]:
  """Why --task=task --task_args=text cannot generate problems (None: they can); for the entry points' flag checks."""
  try:
    make_task_problems(task, 1, **parse_task_args(text))
  except ValueError as e:
    return str(e)
  return None


def reference_completion(problem: Problem) -> str:
  """Supervised target text for warm-starts (the caller appends eos): the reference of problem.task."""
  task = TASKS.get(problem.task)
  text = task.reference(problem) if task else None
  if text is None:
    raise ValueError(f"reference_completion: problem {problem.id!r} (task {problem.task!r}) has no reference answer")
  return text


def verify(problem: Problem, completion: str, limits: SandboxLimits = SandboxLimits(), strict_math: bool = True) -> float:
  """Reward in {0.0, 1.0} for `completion` (the decoded text after the prompt, eos already stripped) by the verifier
  of problem.task."""
  if problem.task not in TASKS:
    raise ValueError(f"verify: problem {problem.id!r} has unknown task {problem.task!r}")
  return TASKS[problem.task].verify(problem, completion, limits, strict_math)


def _pool_worker(conn, limits, tmp_dir, strict_math):
  # Runs in a spawned process: scores jobs until the pipe closes. Exceptions score 0 and are reported.
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  tempfile.tempdir = tmp_dir  # sandbox dirs of a killed worker are then removed by the pool
  conn.send(("ready", None, None))  # startup (imports) must not count against the first call's timeout
  while True:
    try:
      idx, problem, completion = conn.recv()
    except (EOFError, OSError):
      return
    try:
      conn.send((idx, verify(problem, completion, limits, strict_math), None))
    except SandboxUnavailable as e:  # the host's setup, not the item: score() raises it, the worker fails the item
      conn.send((idx, 0.0, e))
    except Exception as e:  # a verifier bug must not take the pool down
      conn.send((idx, 0.0, f"{type(e).__name__}: {e}"))


class VerifierPool:
  """score() hands each (problem, completion) to a free worker (timeouts: see the module docstring).
  max_workers=0 runs verify() inline (no isolation, no timeout). Counters: timeouts, crashes, errors, last_error;
  reused (verdicts not run again), ran. The verdict cache: a verdict depends only on the problem's content and
  the completion (a task's verify reads nothing else), so the newest cache_size clean verdicts (not a timeout,
  crash or verifier error: those may pass on a retry) are kept by a 16-byte hash of both (~100 bytes each)."""

  def __init__(self, max_workers: int = 2, timeout_s: float = 30.0, limits: SandboxLimits = SandboxLimits(),
               strict_math: bool = True, cache_size: int = 1 << 16):
    if max_workers < 0 or timeout_s <= 0:
      raise ValueError(f"VerifierPool: need max_workers >= 0 and timeout_s > 0, got {max_workers}, {timeout_s}")
    self.max_workers, self.timeout_s, self.limits, self.strict_math = max_workers, timeout_s, limits, strict_math
    self.cache, self.cache_size, self.reused, self.ran = collections.OrderedDict(), cache_size, 0, 0
    self.startup_timeout_s = 120.0
    self._ctx = multiprocessing.get_context("spawn")  # fork after JAX/threads is unsafe
    # Removed by close(), else at GC or exit (rollout.py's worker never calls close()); inline pools need none.
    self._dir = tempfile.TemporaryDirectory(prefix="rlax-verifier-", ignore_cleanup_errors=True) if max_workers else None
    self._tmp = self._dir and self._dir.name
    self._workers = []  # [process, connection, temp dir]
    self._spawned = self.timeouts = self.crashes = self.errors = 0
    self.last_error = None

  def _spawn(self):
    parent, child = self._ctx.Pipe()
    tmp_dir = os.path.join(self._tmp, f"w{self._spawned}")
    os.mkdir(tmp_dir)
    self._spawned += 1
    proc = self._ctx.Process(target=_pool_worker, args=(child, self.limits, tmp_dir, self.strict_math), daemon=True)
    proc.start()
    child.close()
    return [proc, parent, tmp_dir]

  def _await_ready(self, workers):
    for w in workers:
      try:
        ok = w[1].poll(self.startup_timeout_s) and w[1].recv()[0] == "ready"
      except (EOFError, OSError):
        ok = False
      if not ok:
        raise RuntimeError(f"VerifierPool: a worker failed to start within {self.startup_timeout_s}s "
                           f"(exit code {w[0].exitcode}); see its traceback above")
    return workers

  def _kill(self, w):
    # Its sandbox child (if any) dies with it through PR_SET_PDEATHSIG; its temp dirs go here.
    w[0].kill()
    w[0].join()
    w[1].close()
    shutil.rmtree(w[2], ignore_errors=True)

  def score(self, problems, completions) -> list:
    """Verdicts in order; each distinct (problem, completion) not in the cache runs once (a group's repeated
    answers too)."""
    if len(problems) != len(completions):
      raise ValueError(f"VerifierPool.score: {len(problems)} problems but {len(completions)} completions")
    keys = [hashlib.blake2b(json.dumps([p.task, p.prompt, p.answer, p.tests, p.messages, c]).encode(),
                            digest_size=16).digest() for p, c in zip(problems, completions)]
    new = {k: i for i, k in enumerate(keys) if k not in self.cache}
    got, clean = self._run([problems[i] for i in new.values()], [completions[i] for i in new.values()])
    out = dict(zip(new, got))
    out.update((k, self.cache[k]) for k in keys if k not in out)
    self.cache.update((k, v) for k, v, ok in zip(new, got, clean) if ok)
    for k in keys:
      if k in self.cache:
        self.cache.move_to_end(k)
    while len(self.cache) > self.cache_size:
      self.cache.popitem(last=False)
    self.reused, self.ran = self.reused + len(keys) - len(new), self.ran + len(new)
    return [out[k] for k in keys]

  def _run(self, problems, completions):
    """-> (scores, clean: whether each is the verifier's own verdict, not a timeout, crash or error)."""
    if self.max_workers == 0:
      return [verify(p, c, self.limits, self.strict_math) for p, c in zip(problems, completions)], [True] * len(problems)
    if not problems:
      return [], []
    if not self._workers:
      self._workers = self._await_ready([self._spawn() for _ in range(self.max_workers)])
    scores, pending, free = [0.0] * len(problems), collections.deque(range(len(problems))), list(self._workers)
    clean = [False] * len(problems)
    refused = None
    busy = {}  # connection -> (worker, index, start time)
    while pending or busy:
      while pending and free:
        w, i = free.pop(), pending.popleft()
        w[1].send((i, problems[i], completions[i]))
        busy[w[1]] = (w, i, time.monotonic())
      oldest = min(t for _, _, t in busy.values())
      ready = multiprocessing.connection.wait(list(busy), timeout=max(0.0, oldest + self.timeout_s - time.monotonic()))
      for conn in ready:
        w, i, _ = busy.pop(conn)
        try:
          _, scores[i], err = conn.recv()
          clean[i] = err is None
          if isinstance(err, SandboxUnavailable):
            refused = err
          elif err is not None:
            self.errors, self.last_error = self.errors + 1, err
          free.append(w)
        except (EOFError, OSError):  # the worker died mid-call: score 0, replace it
          self.crashes += 1
          free.append(self._replace(w))
      now = time.monotonic()
      for conn, (w, i, t) in list(busy.items()):
        if now - t >= self.timeout_s:
          del busy[conn]
          self.timeouts += 1
          free.append(self._replace(w))
    if refused is not None:
      raise refused
    return scores, clean

  def _replace(self, w):
    self._kill(w)
    new = self._await_ready([self._spawn()])[0]
    self._workers[self._workers.index(w)] = new
    return new

  def close(self):
    for w in self._workers:
      self._kill(w)
    self._workers = []
    if self._dir:
      self._dir.cleanup()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


# ----------------------------------------------------------------------------------- pass rates

def filter_by_pass_rate(problems, rates: dict, low: float = 0.0, high: float = 1.0) -> list:
  """Problems with low < rate < high (the defaults drop never-solved and always-solved prompts)."""
  missing = [p.id for p in problems if p.id not in rates]
  if missing:
    raise ValueError(f"filter_by_pass_rate: no pass rate for {len(missing)} problems, e.g. {missing[:3]}")
  return [p for p in problems if low < rates[p.id] < high]


class PassRateTracker:
  """Per-prompt running statistics across the run: sample count, mean reward and an EMA of batch means."""

  def __init__(self, ema: float = 0.9):
    self.ema, self.stats = ema, {}  # stats: id -> [count, reward sum, ema]

  def update(self, pid: str, rewards):
    rewards = [float(r) for r in rewards]
    if not rewards:
      return
    mean = sum(rewards) / len(rewards)
    n, s, e = self.stats.get(pid, (0, 0.0, None))
    self.stats[pid] = [n + len(rewards), s + sum(rewards), mean if e is None else self.ema * e + (1 - self.ema) * mean]

  def rate(self, pid: str) -> Optional[float]:
    return None if (st := self.stats.get(pid)) is None else st[1] / st[0]

  def ema_rate(self, pid: str) -> Optional[float]:
    return None if (st := self.stats.get(pid)) is None else st[2]

  def state_dict(self) -> dict:
    return {"ema": self.ema, "stats": {k: list(v) for k, v in self.stats.items()}}

  def load_state_dict(self, d: dict):
    if not isinstance(d, dict) or "stats" not in d or "ema" not in d:
      raise ValueError("PassRateTracker.load_state_dict: expected a dict with 'ema' and 'stats'")
    self.ema = float(d["ema"])
    self.stats = {str(k): [int(v[0]), float(v[1]), float(v[2])] for k, v in d["stats"].items()}


# ----------------------------------------------------------------------------------------- queue records
# The two records on the parameter server's queues, defined once: the trainer writes PromptItems ("prompts")
# and reads Rollouts ("rollouts"), a worker the reverse. On the wire each is one flat dict of JSON fields and
# numpy arrays (param_server's item encoding). from_wire checks every field and raises a ValueError naming the
# item and the field: a malformed item from a buggy or hostile peer is reported and set aside, never a crash.

PARTIAL_FIELDS = ("partial_tokens", "partial_logprobs", "partial_versions", "partial_done")


def _need(d, field, kinds, where, what):
  v = d.get(field)
  if not isinstance(v, kinds) or isinstance(v, bool) and bool not in kinds:
    raise ValueError(f"{where}: field {field!r} must be {what}, got {type(v).__name__} {str(v)[:40]!r}")
  return v


def _token_ids(v, field, where) -> np.ndarray:
  a = np.asarray(v) if isinstance(v, (np.ndarray, list)) else None
  if a is None or a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
    raise ValueError(f"{where}: field {field!r} must be a 1-D array of token ids, got {type(v).__name__}")
  return a.astype(np.int32)


def _problem_wire(p: Problem) -> dict:
  return dict(prompt_id=p.id, prompt=p.prompt, answer=p.answer, task=p.task,
              tests=list(p.tests) if p.tests else None)


def _problem_from_wire(d, where) -> Problem:
  for f in ("prompt_id", "prompt", "answer", "task"):
    _need(d, f, (str,), where, "a str")
  tests = d.get("tests")
  if tests is not None and not isinstance(tests, (list, tuple)):
    raise ValueError(f"{where}: field 'tests' must be a list or null, got {type(tests).__name__}")
  return Problem(id=d["prompt_id"], prompt=d["prompt"], answer=d["answer"], task=d["task"],
                 tests=tuple(tests) if tests else None)


@dataclasses.dataclass(frozen=True)
class PromptItem:
  """One entry of the "prompts" queue: sample group_size completions of `problem` from `prompt_tokens` (the
  rendered prompt, bos included; the trainer tokenizes, so every worker prefills the same ids). `partial`: a
  preempted worker's progress on it (the PARTIAL_FIELDS, checked by the worker that continues it with
  rollout.partial_of), else None."""
  id: str
  problem: Problem
  prompt_tokens: np.ndarray  # [S] int32
  group_size: int
  partial: Optional[dict] = None

  def to_wire(self) -> dict:
    return dict(id=self.id, **_problem_wire(self.problem), group_size=self.group_size,
                prompt_tokens=np.asarray(self.prompt_tokens, np.int32), **(self.partial or {}))

  @classmethod
  def from_wire(cls, d: dict) -> "PromptItem":
    where = f"prompt item {d.get('id')!r}"
    _need(d, "id", (str,), where, "a str")
    if _need(d, "group_size", (int,), where, "an int >= 1") < 1:
      raise ValueError(f"{where}: group_size={d['group_size']} is not an int >= 1")
    return cls(d["id"], _problem_from_wire(d, where), _token_ids(d.get("prompt_tokens"), "prompt_tokens", where),
               d["group_size"], {k: d[k] for k in PARTIAL_FIELDS if k in d} or None)


@dataclasses.dataclass(frozen=True)
class Rollout:
  """One entry of the "rollouts" queue: the G completions a worker sampled for the PromptItem of the same id,
  their behaviour log-probs and verifier rewards. version: the oldest policy version that produced any of its
  tokens. stats: the numbers the worker sends along (pull_bytes, worker_tok_s, resumed_tokens, ...), which the
  trainer logs per step."""
  id: str
  version: int
  worker: str
  problem: Problem
  prompt_tokens: np.ndarray  # [S] int32
  completions: list  # G x [n_g] int32
  logprobs: list  # G x [n_g] float32
  rewards: np.ndarray  # [G] float32; None until a verifier scored it (the "to_score" queue)
  gen_s: float = 0.0
  stats: dict = dataclasses.field(default_factory=dict)

  @property
  def n_tokens(self) -> int:
    """Completion tokens generated for this group."""
    return sum(len(c) for c in self.completions)

  def prompt_item(self, id: str, group_size: int) -> PromptItem:
    """The prompt again, under a new id (a stale rollout's prompt is re-issued)."""
    return PromptItem(id, self.problem, self.prompt_tokens, group_size)

  def to_wire(self) -> dict:
    return dict(id=self.id, version=self.version, worker=self.worker, **_problem_wire(self.problem),
                prompt_tokens=np.asarray(self.prompt_tokens, np.int32), completions=list(self.completions),
                logprobs=list(self.logprobs), gen_s=self.gen_s, **self.stats,
                **({} if self.rewards is None else dict(rewards=np.asarray(self.rewards, np.float32))))

  @classmethod
  def from_wire(cls, d: dict, scored: bool = True) -> "Rollout":
    """scored=False: one from the "to_score" queue, whose rewards a verifier fills in (none are read)."""
    where = f"rollout {d.get('id')!r}"
    _need(d, "id", (str,), where, "a str")
    _need(d, "version", (int,), where, "an int")
    comps = _need(d, "completions", (list,), where, "a list")
    lps = list(_need(d, "logprobs", (list,), where, "a list"))  # a copy: its entries become float32 arrays
    rewards = np.asarray(d.get("rewards", ()), np.float64) if isinstance(d.get("rewards"), (np.ndarray, list)) \
        else None if scored else np.zeros(len(comps))
    if rewards is None or rewards.shape != (len(comps),) or not comps or len(lps) != len(comps) \
            or not np.all(np.isfinite(rewards)):
      raise ValueError(f"{where}: completions, logprobs and rewards must be G >= 1 entries each with finite "
                       f"rewards; got {len(comps)}, {len(lps)}, {None if rewards is None else rewards.shape}")
    comps = [_token_ids(c, f"completions[{i}]", where) for i, c in enumerate(comps)]
    for i, (c, lp) in enumerate(zip(comps, lps)):
      if not isinstance(lp, (np.ndarray, list)) or np.shape(lp) != c.shape:
        raise ValueError(f"{where}: logprobs[{i}] must be {len(c)} log-probs, one per completion token")
      lps[i] = np.asarray(lp, np.float32)  # what the trainer uses, converted once
      # The numerical firewall's first line: a non-finite log-prob (one bad worker chip) would make the loss NaN.
      bad = ~np.isfinite(lps[i])
      if bad.any():
        raise ValueError(f"{where}: logprobs[{i}] has {int(bad.sum())} non-finite values (first at token "
                         f"{int(np.argmax(bad))})")
    stats = {k: v for k, v in d.items()
             if k not in _ROLLOUT_FIELDS and isinstance(v, (int, float)) and not isinstance(v, bool)}
    return cls(d["id"], d["version"], str(d.get("worker", "")), _problem_from_wire(d, where),
               _token_ids(d.get("prompt_tokens"), "prompt_tokens", where), comps,
               lps, rewards.astype(np.float32) if scored else None, float(d.get("gen_s", 0.0)), stats)


# Wire keys that are Rollout fields or its problem's; any other numeric key is a worker stat.
_ROLLOUT_FIELDS = {f.name for f in dataclasses.fields(Rollout)} | set(_problem_wire(Problem("", "", "")))


def group_has_signal(rewards, eps: float = 1e-6) -> bool:
  """The one dynamic-sampling criterion (DAPO): a group's rewards are not all equal (max - min > eps); a group
  that fails it carries no GRPO advantage. Used by train.Collector."""
  r = np.asarray(rewards, np.float64)
  return bool(r.size) and float(r.max() - r.min()) > eps


# ---------------------------------------------------------------------------------------------- batching

def make_batch(prompt_ids_list, completion_ids_list, buckets: Sequence[int], pad_id: int = 0,
               completion_extras: Optional[dict] = None) -> dict:
  """One sequence per row (the layout in the module docstring), right-padded to the smallest bucket >= the
  longest. Returns tokens/targets/positions/segment_ids [B,T] int32, loss_mask [B,T] float32 and each
  completion_extras name as [B,T] float32."""
  extras, B = completion_extras or {}, len(prompt_ids_list)
  if len(completion_ids_list) != B:
    raise ValueError(f"{B} prompts but {len(completion_ids_list)} completions")
  for name, values in extras.items():
    if len(values) != B:
      raise ValueError(f"completion_extras[{name!r}] has {len(values)} entries for {B} sequences")
  longest = max([len(p) + len(c) for p, c in zip(prompt_ids_list, completion_ids_list)] + [1])
  T = next((b for b in sorted(buckets) if longest <= b), None)
  if T is None:
    raise ValueError(f"make_batch: length {longest} exceeds the largest bucket {max(buckets)}")
  out = {"tokens": np.full((B, T), pad_id, np.int32), "targets": np.full((B, T), pad_id, np.int32),
         "positions": np.zeros((B, T), np.int32), "segment_ids": np.zeros((B, T), np.int32),
         "loss_mask": np.zeros((B, T), np.float32), **{name: np.zeros((B, T), np.float32) for name in extras}}
  for i, (prompt, completion) in enumerate(zip(prompt_ids_list, completion_ids_list)):
    P, L = len(prompt), len(prompt) + len(completion)
    if P == 0:
      raise ValueError(f"sequence {i}: empty prompt (at least one token, e.g. bos, must precede the completion)")
    seq = np.asarray(list(prompt) + list(completion), np.int32)
    out["tokens"][i, :L] = seq
    out["targets"][i, :L - 1] = seq[1:]  # the last token predicts nothing (pad target)
    out["positions"][i, :L] = np.arange(L)
    out["segment_ids"][i, :L] = 1
    out["loss_mask"][i, P - 1:L - 1] = 1.0
    for name, values in extras.items():
      if len(values[i]) != len(completion):
        raise ValueError(f"completion_extras[{name!r}][{i}] has {len(values[i])} values for {len(completion)} "
                         "completion tokens")
      out[name][i, P - 1:L - 1] = values[i]
  return out
