"""Data for RL: tokenizer, prompt datasets, built-in tasks, verifiers (rewards), curation, batching.

Everything here is host-side Python/numpy; nothing imports JAX, so rollout workers, the trainer and the
verifier pool all share it cheaply.

Design choices
- Tokenizer: one plain `Tokenizer` class over either a sentencepiece model (built-in tasks, Llama-style
  `tokenizer.model`) or an HF `tokenizer.json` (via the optional `tokenizers` package, imported lazily).
  The built-in tokenizer is trained in well under a second on generated task text with `split_digits=True`
  (every digit is its own piece, so arithmetic is learnable), identity normalisation and no dummy prefix
  (encode/decode round-trips exactly), ids pad=0 unk=1 bos=2 eos=3.
- Prompt template applied in exactly one place: `render_prompt` ("plain" for built-ins, "chatml" for
  Qwen-style chat checkpoints).
- Tasks: each is one `Task` in the plain dict `TASKS` (verifier, SFT reference, generator with its ops and
  difficulty bounds, tokenizer settings), picked by name. `verify(problem, completion)` -> 1.0/0.0 by the verifier
  of problem.task. Generation is deterministic in a seed; a problem is in the eval split iff sha256(prompt) falls
  in a fixed 20% bucket, so held-out problems never appear in training, whatever seeds or sizes are used.
    arithmetic  prompt "12+345="         completion "357"      (then eos). difficulty = max digits per
                operand (each operand draws its digit count uniformly in 1..difficulty); ops from `ops`
                (default "+-"; "*" allowed). Answers may be negative ("3-15=" -> "-12"). Reward: the
                canonical integer equal to the answer, surrounding whitespace tolerated.
    countdown   prompt "3 5 7 -> 22:"    completion "3*5+7"    (then eos). difficulty = how many numbers
                (>= 2), each in 1..max_number; the target is built from a random expression over all of them
                with `ops` (default "+-*"), so it is always reachable. The verifier accepts any expression of
                non-negative integer literals, + - * / and parentheses that uses each given number AT MOST
                once (classic countdown) and equals the target exactly (Fraction arithmetic, no eval);
                an optional trailing "=<target>" is allowed.
    math        (jsonl) math-verify on `extract_answer(completion, strict)` (`math_verify_equal`); old:
                `math_answer_equal`: last \\boxed{}/\\fbox{}, else the last "answer is/answer:" line, else the
                last number of the last line; integers, decimals, fractions a/b, \\frac{a}{b} (\\dfrac, \\tfrac,
                \\frac12), negatives, thousands separators ("1,234" only with groups of exactly 3 digits),
                "x = 5"; numbers compare exactly as Fractions (0.5 == \\frac{1}{2}, 0.333 != 1/3), anything else
                by whitespace-free string equality. SFT reference "\\boxed{answer}".
    code        (jsonl) `run_code`: the last ```python fenced block (or the whole completion) against the tests.
- Code sandbox (`run_code`): a fresh `python -I -S` child (no env vars, no site-packages, no .pth processing) in
  its own session and temp dir, minimal environment (no proxies). Its spec (code, test inputs or asserts, the
  nonce) arrives on a pipe and fd 0 is replaced by /dev/null before candidate code runs, so the spec cannot be
  re-read; expected outputs of io tests never reach the child: it sends back a sha256 of each test's
  normalised output, tagged with a per-run random nonce, and the PARENT judges. Before any candidate code
  runs, the child sets RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE (caps each file it writes), RLIMIT_NOFILE,
  RLIMIT_CORE=0, unshares its network namespace when the kernel allows (root: CLONE_NEWNET; otherwise
  CLONE_NEWUSER|CLONE_NEWNET), drops root to uid/gid 65534 (pre-importing a fixed stdlib set first, since the
  interpreter may live in an unreadable home dir), sets RLIMIT_NPROC=0 (no fork/threads), deletes the calls no
  audit event covers (os/posix.mkfifo, mknod; _imp.create_dynamic, i.e. no new extension module such as
  _ctypes via ExtensionFileLoader) and installs an audit hook that denies: opening files outside the temp dir
  (reads also allowed under the Python prefixes; symlinks and /proc/self/{fd,cwd} paths are resolved first),
  directory fds (so no dir_fd= escape), listing, renaming, symlinking etc. outside it, more than
  `max_files` write-opens/mkdirs (disk quota: total <= (max_files + 3) * output_bytes), fork/exec/spawn/
  subprocess/system/kill, sockets, ctypes, frame and gc introspection. The parent kills the whole process
  group at the wall-time limit. A program passes only if nonce-tagged lines say all tests ran (and, for io
  tests, their hashes match), so `os._exit(0)` / `sys.exit(0)` cheats fail.
  What it is NOT: a kernel-level boundary. The audit hook is in-process Python; hostile native code
  (a CPython memory-corruption bug) would get past it, leaving rlimits, the uid drop and the net namespace.
  For untrusted code at scale run the verifier in a container / gVisor / nsjail (see docs/GUIDE.md). Assert-style
  tests trust the candidate's objects' `__eq__` (an always-equal object passes them), so prefer input/output
  tests for RL rewards. `tests/test_data.py::test_code_known_tricks_score_zero` tries each known trick.
  Tests: a list whose items are either python source strings (asserts run after the program in its
  namespace) or {"input": stdin, "output": expected stdout} (program re-run per case; lines compared after
  stripping trailing whitespace; SystemExit(0) is a normal end).
- `VerifierPool`: N spawned worker processes; each call has a timeout after which its worker is killed and
  replaced and the call scores 0, so one slow verifier never stalls the caller.
- Curation: offline `estimate_pass_rates` (k samples per prompt from a caller-supplied sampler) +
  `filter_by_pass_rate` (keep low < rate < high) + `write_jsonl`; online `dynamic_sampling_filter` (drop
  zero-variance groups; the trainer refills) and `PassRateTracker` (counts + EMA per prompt id, checkpointable).
- Batching (numpy, right padding): sequence = prompt ++ completion, length L = P + C.
    tokens[b, t]      t < L: the token; else pad_id
    targets[b, t]     tokens[b, t+1] for t < L-1; else pad_id        (next-token targets)
    loss_mask[b, t]   1.0 iff P-1 <= t <= L-2, i.e. targets[b, t] is a completion token
    positions[b, t]   t within its sequence (0 on padding); segment_ids 1.. per sequence, 0 on padding
  so the log-prob of completion token j sits at t = P-1+j. `completion_extras` (e.g. behaviour log-probs,
  one float per completion token) are scattered to the same positions. Row length T is the smallest bucket
  >= max L (few buckets => few recompiles); `pack` fills fixed [R, T] rows first-fit with several sequences
  (segment ids restart positions; kernels.attention masks across segments).

Public API
  Problem(id, prompt, answer, task="math", tests=None)            frozen; tests: tuple of str | (stdin, stdout)
  Task(verify, reference, ...); TASKS: {name: Task};  reference_completion(problem) -> str (SFT target)
  render_prompt(problem, template="plain", system=None) -> str
  load_jsonl(path) -> list[Problem];  write_jsonl(path, problems, pass_rates=None)
  split(problems, held_out, seed=0) -> (train, held_out)          held_out: fraction in (0,1) or count
  PromptStream(problems, seed=0, shuffle=True): next(), take(n), state_dict(), load_state_dict(d)
  make_task_problems(task, n, difficulty=2, seed=0, split="train", ops=None, max_number=10) -> list[Problem]
  Tokenizer: encode(text, add_bos=False), decode(ids), pieces(text), bos_id, eos_id, pad_id, stop_ids, vocab_size
  load_tokenizer(path); train_tokenizer(texts, out_path, vocab_size=256, ...) -> path;
  build_task_tokenizer(out_dir, task="arithmetic", seed=0, vocab_size=64) -> path   (reuses an existing file)
  verify(problem, completion) -> float; extract_answer(text); math_answer_equal(pred, ref) -> bool
  SandboxLimits(wall_s, cpu_s, mem_mb, output_bytes, audit_hook); run_code(code, tests, limits) -> CodeResult
  VerifierPool(max_workers=2, timeout_s=30.0, limits=None): score(problems, completions) -> list[float], close()
  estimate_pass_rates(problems, sample_fn, k, score_fn=None, batch_size=64) -> dict[id, float]
  filter_by_pass_rate(problems, rates, low=0.0, high=1.0); curate(problems, sample_fn, k, out_path, ...)
  PassRateTracker(ema=0.9): update(id, rewards), rate(id), state_dict(), load_state_dict(d), summary()
  dynamic_sampling_filter(groups, key=None, eps=1e-6) -> kept groups
  PromptItem(id, problem, prompt_tokens, group_size, partial=None), Rollout(id, version, worker, problem,
      prompt_tokens, completions, logprobs, rewards, gen_s, stats): the queue records; .to_wire() -> dict,
      .from_wire(d) (ValueError naming the item and field)
  pad_to_bucket(length, buckets=DEFAULT_BUCKETS) -> int
  make_batch(prompt_ids_list, completion_ids_list, buckets=DEFAULT_BUCKETS, pad_id=0, batch_size=None,
             completion_extras=None) -> dict of numpy arrays
  pack(prompt_ids_list, completion_ids_list, seq_len, pad_id=0, num_rows=None, completion_extras=None) -> dict

Run
  python data.py                        # prints sample problems, tokenization and sandbox status
  python -m pytest -q tests/test_data.py
"""
import ast
import dataclasses
import hashlib
import itertools
import json
import logging
import math
import multiprocessing
import multiprocessing.connection
import operator
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, deque
from fractions import Fraction
from typing import Callable, Optional, Sequence

import numpy as np

import common

EVAL_BUCKET = 200  # of 1000 hash buckets: 20% of all possible built-in problems are held out
# Row lengths a batch pads to (powers of two: few compiled shapes); train's (x2 past 4096: buckets_for), Engine's
# prompt buckets (to 2048) and make_batch's default (from 32) are slices of it. 16 first: a built-in arithmetic row
# (bos, prompt, answer, eos) is <= 12 tokens; padding it to 16, not 32, halves the demo's SFT and RL step time.
BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
DEFAULT_BUCKETS = BUCKETS[1:]


# ----------------------------------------------------------------------------------------------- problems

@dataclasses.dataclass(frozen=True)
class Problem:
  id: str
  prompt: str
  answer: str
  task: str = "math"
  tests: Optional[tuple] = None  # code: items are python source str or (stdin, expected_stdout) pairs
  system: Optional[str] = None  # chat jsonl: the system turn, rendered by the chat templates
  source: str = dataclasses.field(default="", compare=False)  # "file:line" for load-time reports

  def __post_init__(self):
    # Tests that travelled through JSON arrive as lists: store tuples so the problem stays hashable.
    if self.tests is not None:
      object.__setattr__(self, "tests", tuple(t if isinstance(t, str) else tuple(t) for t in self.tests))


def render_prompt(problem: Problem, template: str = "plain", system: Optional[str] = None,
                  chat_template: Optional["ChatTemplate"] = None) -> str:
  """"plain": the prompt as is (built-in tasks). "chatml": Qwen/QwQ-style chat turns ending with the assistant
  header, ready for generation. "hf": the checkpoint's own Jinja `chat_template` (see load_chat_template)."""
  system = problem.system if system is None else system
  if template == "plain":
    return problem.prompt
  if template == "chatml":
    sys_turn = f"<|im_start|>system\n{system}<|im_end|>\n" if system else ""
    return f"{sys_turn}<|im_start|>user\n{problem.prompt}<|im_end|>\n<|im_start|>assistant\n"
  if template == "hf":
    if chat_template is None:
      raise ValueError("render_prompt: template 'hf' needs chat_template=load_chat_template(checkpoint_dir)")
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": problem.prompt}]
    return chat_template.render(msgs)
  raise ValueError(f"render_prompt: unknown template {template!r} (expected 'plain', 'chatml' or 'hf')")


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
  """An HF `chat_template` (Jinja) rendered the way transformers' apply_chat_template does: sandboxed
  environment, trim_blocks/lstrip_blocks, `raise_exception`, bos/eos tokens, add_generation_prompt=True.
  `kwargs` go to the template as variables (e.g. enable_thinking=False for Qwen3)."""
  source: str
  bos_token: str = ""
  eos_token: str = ""
  kwargs: tuple = ()  # ((name, value), ...): hashable

  def render(self, messages) -> str:
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.exceptions import TemplateError

    def raise_exception(message):
      raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, separators=None, sort_keys=False: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
    return env.from_string(self.source).render(messages=messages, add_generation_prompt=True,
                                               bos_token=self.bos_token, eos_token=self.eos_token,
                                               **dict(self.kwargs))


def _read_json(folder, name) -> dict:
  """folder/name parsed as JSON, or {} when the file does not exist (optional HF config files)."""
  p = os.path.join(folder, name)
  if not os.path.exists(p):
    return {}
  with open(p, encoding="utf-8") as f:
    return json.load(f)


def _special_token(cfg, field):
  """A special token's text from an HF config: a plain string or an AddedToken dict {"content": ...}."""
  t = cfg.get(field)
  return t.get("content") if isinstance(t, dict) else t


def load_chat_template(path, **kwargs) -> ChatTemplate:
  """`path`: a checkpoint dir (or a file inside it) with tokenizer_config.json holding "chat_template"
  (or a chat_template.jinja file, as newer transformers write)."""
  folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
  cfg_path = os.path.join(folder, "tokenizer_config.json")
  cfg = _read_json(folder, "tokenizer_config.json")
  src = cfg.get("chat_template")
  if isinstance(src, list):  # [{"name": "default", "template": ...}, ...]
    src = next((t["template"] for t in src if t.get("name") == "default"), None)
  jinja = os.path.join(folder, "chat_template.jinja")
  if src is None and os.path.exists(jinja):
    with open(jinja, encoding="utf-8") as f:
      src = f.read()
  if not src:
    raise ValueError(f"load_chat_template: no 'chat_template' in {cfg_path} nor {jinja}; use --template=chatml/plain")
  return ChatTemplate(src, _special_token(cfg, "bos_token") or "", _special_token(cfg, "eos_token") or "",
                      tuple(sorted(kwargs.items())))


def _parse_tests(raw, where):
  if not isinstance(raw, list):
    raise ValueError(f"{where}: field 'tests' must be a list, got {type(raw).__name__}")
  out = []
  for i, t in enumerate(raw):
    if isinstance(t, str):
      out.append(t)
    elif isinstance(t, dict) and isinstance(t.get("input"), str) and isinstance(t.get("output"), str):
      out.append((t["input"], t["output"]))
    else:
      raise ValueError(f"{where}: tests[{i}] must be a string or {{'input': str, 'output': str}}, got {t!r:.80}")
  if len({isinstance(t, str) for t in out}) > 1:
    raise ValueError(f"{where}: field 'tests' mixes assert strings with input/output cases; use one kind")
  return tuple(out)


GSM8K_FINAL = re.compile(r"####\s*(.+?)\s*$", re.DOTALL)
SHAPES = ("auto", "prompt", "messages", "gsm8k", "math")


def detect_shape(d) -> Optional[str]:
  """Which jsonl shape a record has: "prompt" {"prompt","answer"}, "messages" {"messages":[...],"answer"},
  "gsm8k" {"question","answer": "... #### N"}, "math" {"problem","solution": "... \\boxed{X}"}; None if none."""
  return next((shape for key, shape in (("prompt", "prompt"), ("messages", "messages"), ("question", "gsm8k"),
                                        ("problem", "math")) if key in d), None)


def _need_str(d, field, where):
  if field not in d:
    raise ValueError(f"{where}: missing field {field!r}")
  if not isinstance(d[field], str):
    raise ValueError(f"{where}: field {field!r} must be a string, got {type(d[field]).__name__}")
  return d[field]


def _problem_from_dict(d, where, shape="auto", default_id=None) -> Problem:
  if not isinstance(d, dict):
    raise ValueError(f"{where}: expected a JSON object, got {type(d).__name__}")
  if shape == "auto":
    shape = detect_shape(d)
    if shape is None:
      raise ValueError(f"{where}: unknown record shape (fields {sorted(d)[:8]}); expected 'prompt'+'answer', "
                       f"'messages'+'answer', GSM8K 'question'+'answer' or MATH 'problem'+'solution'")
  elif shape not in SHAPES:
    raise ValueError(f"load_jsonl: unknown shape {shape!r} (expected one of {SHAPES})")
  system = None
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
      users = [m["content"] for m in msgs if m["role"] == "user"]
      if not users:
        raise ValueError(f"{where}: field 'messages' has no user turn")
      prompt = users[-1]
      system = next((m["content"] for m in msgs if m["role"] == "system"), None)
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
  if TASKS[task].needs_tests and not tests:
    raise ValueError(f"{where}: task {task!r} needs a non-empty 'tests' list")
  return Problem(str(pid), prompt, str(answer), task, tests, system, where)


def _refuse_constant(name):
  raise ValueError(f"non-finite number {name} is not allowed (numbers must be finite)")


def load_jsonl(path, shape: str = "auto") -> list:
  """Reads one problem per line in any of the shapes detect_shape knows (`shape` forces one; "auto" detects
  per line). "id" is optional outside the "prompt" shape (default: the line number). Blank lines skipped,
  extra fields ignored. Any bad line raises ValueError naming path:line and the field."""
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


def split(problems, held_out, seed: int = 0):
  """Deterministic train/held-out split by a seeded permutation; both parts keep the input order."""
  n = len(problems)
  if isinstance(held_out, float) and 0.0 < held_out < 1.0:
    n_eval = max(1, round(held_out * n))
  elif isinstance(held_out, int) and not isinstance(held_out, bool) and held_out >= 1:
    n_eval = held_out
  else:
    raise ValueError(f"split: held_out must be a fraction in (0,1) or a count >= 1, got {held_out!r}")
  if n_eval >= n:
    raise ValueError(f"split: held_out={held_out!r} leaves no training problems out of {n}")
  eval_idx = set(np.random.default_rng(seed).permutation(n)[:n_eval].tolist())
  return ([p for i, p in enumerate(problems) if i not in eval_idx],
          [p for i, p in enumerate(problems) if i in eval_idx])


class PromptStream:
  """Endless stream over problems: epoch e visits a permutation seeded by (seed, e). state_dict() holds the
  (epoch, cursor) pair, so a restored stream continues with exactly the next problem."""

  def __init__(self, problems, seed: int = 0, shuffle: bool = True):
    if not problems:
      raise ValueError("PromptStream: no problems")
    self.problems, self.seed, self.shuffle = list(problems), seed, shuffle
    self.epoch, self.cursor = 0, 0
    self._order = self._permutation(0)
    self._fingerprint = hashlib.sha256("\n".join(p.id for p in self.problems).encode()).hexdigest()[:16]

  def _permutation(self, epoch):
    n = len(self.problems)
    return np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)

  def next(self) -> Problem:
    if self.cursor == len(self.problems):
      self.epoch, self.cursor = self.epoch + 1, 0
      self._order = self._permutation(self.epoch)
    p = self.problems[int(self._order[self.cursor])]
    self.cursor += 1
    return p

  __next__ = next

  def __iter__(self):
    return self

  def take(self, n: int) -> list:
    return [self.next() for _ in range(n)]

  def peek(self, n: int) -> list:
    """The next n problems, without advancing the stream (what curation estimates before they are issued)."""
    saved = (self.epoch, self.cursor, self._order)
    out = self.take(n)
    self.epoch, self.cursor, self._order = saved
    return out

  def state_dict(self) -> dict:
    return {"seed": self.seed, "shuffle": self.shuffle, "epoch": self.epoch, "cursor": self.cursor,
            "n": len(self.problems), "fingerprint": self._fingerprint}

  def load_state_dict(self, d: dict):
    # A changed dataset would silently resume at the wrong place: refuse it instead.
    for field, mine in (("seed", self.seed), ("shuffle", self.shuffle), ("n", len(self.problems)),
                        ("fingerprint", self._fingerprint)):
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

  def __init__(self, *, sp=None, hf=None, bos_id, eos_id, pad_id, stop_ids=(), path=""):
    assert (sp is None) != (hf is None)
    self.sp, self.hf, self.path = sp, hf, str(path)
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

  def pieces(self, text: str) -> list:
    return self.sp.encode(text, out_type=str) if self.sp is not None else self.hf.encode(text).tokens


def _sp_tokenizer(path):
  import sentencepiece as spm
  sp = spm.SentencePieceProcessor(model_file=str(path))
  bos, eos, pad = sp.bos_id(), sp.eos_id(), sp.pad_id()
  if eos < 0:
    raise ValueError(f"{path}: sentencepiece model has no eos id")
  return Tokenizer(sp=sp, bos_id=bos if bos >= 0 else None, eos_id=eos, pad_id=pad if pad >= 0 else eos, path=path)


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
  return Tokenizer(hf=tok, bos_id=token_id("bos_token"), eos_id=eos, pad_id=eos if pad is None else pad,
                   stop_ids=stop, path=path)


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


def train_tokenizer(texts, out_path, vocab_size: int = 256, model_type: str = "bpe", byte_fallback: bool = True,
                    user_defined_symbols: Sequence[str] = (), split_digits: bool = True) -> str:
  """Trains a sentencepiece model on `texts` (an iterable of str) and writes it to out_path (atomically).
  Deterministic (one thread, no input sampling); vocab_size is an upper bound; byte_fallback needs vocab_size > 260."""
  import io
  import sentencepiece as spm
  buf = io.BytesIO()
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(texts), model_writer=buf, vocab_size=vocab_size, model_type=model_type,
      split_digits=split_digits, byte_fallback=byte_fallback, user_defined_symbols=list(user_defined_symbols),
      pad_id=0, unk_id=1, bos_id=2, eos_id=3, character_coverage=1.0, num_threads=1,
      shuffle_input_sentence=False, add_dummy_prefix=False, normalization_rule_name="identity",
      remove_extra_whitespaces=False, hard_vocab_limit=False, minloglevel=2)
  os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
  common.write_atomic(out_path, buf.getvalue(), tmp=f"{out_path}.tmp{os.getpid()}")
  return str(out_path)


def build_task_tokenizer(out_dir, task: str = "arithmetic", seed: int = 0, vocab_size: int = 64) -> str:
  """The built-in tokenizer: trained on generated prompts and answers (as separate sentences, so no piece
  straddles the prompt/completion boundary) of `task` at several difficulties. Reuses an existing file."""
  path = os.path.join(str(out_dir), f"tokenizer-{task}.model")
  if os.path.exists(path):
    return path
  t = TASKS.get(task)
  if t is None or not t.tokenizer_levels:
    raise ValueError(f"build_task_tokenizer: task must be {_task_names(lambda t: t.tokenizer_levels)}, got {task!r}")
  texts = list(t.alphabet)  # one sentence per character, so each is a piece of its own (no junk merges)
  for d in t.tokenizer_levels:
    for p in make_task_problems(task, 150, difficulty=d, seed=seed, ops=t.tokenizer_ops):
      texts += [p.prompt, p.answer]
  return train_tokenizer(texts, path, vocab_size=vocab_size, byte_fallback=False)


# ---------------------------------------------------------------------------------------------- verifiers

def _last_braced(text, start):
  """Content of the {...} group opening at text[start] (balanced), or None."""
  depth = 0
  for i in range(start, len(text)):
    depth += {"{": 1, "}": -1}.get(text[i], 0)
    if depth == 0:
      return text[start + 1:i]
  return None


def extract_answer(text: str, strict: bool = False) -> Optional[str]:
  """Last \\boxed{}/\\fbox{} content; unless strict: else the text after the last "answer is"/"answer:", else
  a GSM8K "#### N", else the last number of the last non-empty line; else None."""
  idx = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
  if idx >= 0:
    rest = idx + (6 if text.startswith("\\boxed", idx) else 5)
    if rest < len(text) and text[rest] == "{":
      got = _last_braced(text, rest)
      if got is not None:
        return got.strip()
    else:
      m = re.match(r"\s+([^\s$]+)", text[rest:])  # "\boxed 5"
      if m:
        return m.group(1)
  if strict:
    return None
  marks = list(re.finditer(r"answer\s*(?:is|:)\s*(.+)", text, re.IGNORECASE))
  if marks:
    return marks[-1].group(1).strip()
  m = GSM8K_FINAL.search(text)
  if m:
    return m.group(1)
  lines = [ln for ln in text.splitlines() if ln.strip()]
  nums = re.findall(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+", lines[-1]) if lines else []
  return nums[-1] if nums else None


def math_verify_equal(pred: Optional[str], ref: str, timeout_s: int = 5) -> bool:
  """Hugging Face math-verify (pinned in requirements.txt): parses both sides to sympy (LaTeX or plain) and
  compares them (fractions vs decimals, \\sqrt, \\pi, intervals, sets, units, \\text{(B)}). A GSM8K "#### N"
  reference counts as N. Its timeouts use SIGALRM, so they apply in the main thread (the VerifierPool's
  processes); elsewhere they are off (math_verify's own rule). Any parser error scores False."""
  import math_verify
  import threading
  if pred is None or not pred.strip():
    return False
  m = GSM8K_FINAL.search(ref)
  ref = m.group(1).replace(",", "") if m else ref
  t = timeout_s if threading.current_thread() is threading.main_thread() else None
  wrap = lambda x: x if "\\boxed" in x or "$" in x else f"${x}$"
  try:
    gold = math_verify.parse(wrap(ref), parsing_timeout=t)
    got = math_verify.parse(wrap(pred), parsing_timeout=t)
    return bool(gold and got and math_verify.verify(gold, got, timeout_seconds=t))
  except Exception:  # noqa: BLE001 - a verifier never crashes its caller on one answer
    return False


def _normalize(s: str) -> str:
  s = s.strip().strip("$").strip()
  s = re.sub(r"^\\\(|\\\)$", "", s)
  for a, b in (("\\left", ""), ("\\right", ""), ("\\!", ""), ("\\,", ""), ("\\;", ""), ("\\ ", ""),
               ("\\displaystyle", ""), ("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("^\\circ", ""),
               ("^{\\circ}", ""), ("\\%", ""), ("%", "")):
    s = s.replace(a, b)
  s = re.sub(r"\\(?:text|mathrm|textbf|mbox)\{([^{}]*)\}", r"\1", s)
  s = re.sub(r"^[a-zA-Z]\s*=\s*", "", s)  # "x = 5"
  return re.sub(r"\s+", "", s).rstrip(".")


def _to_fraction(s: str) -> Optional[Fraction]:
  if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
    s = s.replace(",", "")
  if re.fullmatch(r"[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?", s):
    return Fraction(s)
  sign, body = (-1, s[1:]) if s.startswith("-") else (1, s)
  m = (re.fullmatch(r"\\frac\{([^{}]+)\}\{([^{}]+)\}", body) or re.fullmatch(r"\\frac(\d)(\d)", body)
       or re.fullmatch(r"\(?([-\d.]+)\)?/\(?([-\d.]+)\)?", body))
  if m:
    num, den = _to_fraction(m.group(1)), _to_fraction(m.group(2))
    if num is not None and den:
      return sign * num / den
  return None


def math_answer_equal(pred: Optional[str], ref: str) -> bool:
  """True iff pred and ref denote the same number (exact Fractions) or the same normalised string."""
  if pred is None:
    return False
  if "\\boxed" in ref or "\\fbox" in ref:
    ref = extract_answer(ref) or ref
  a, b = _normalize(pred), _normalize(ref)
  fa, fb = _to_fraction(a), _to_fraction(b)
  if fa is not None and fb is not None:
    return fa == fb
  return a != "" and a == b


def _extract_code(completion: str) -> str:
  blocks = re.findall(r"```(?:python|py)?[ \t]*\n(.*?)```", completion, re.DOTALL)
  return blocks[-1] if blocks else completion


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
  wall_s: float = 10.0          # whole-process-group kill after this
  cpu_s: int = 5                # RLIMIT_CPU (SIGXCPU)
  mem_mb: int = 512             # RLIMIT_AS
  output_bytes: int = 1 << 20   # RLIMIT_FSIZE and the captured-output cap per test
  max_files: int = 32           # disk quota: write-opens + mkdirs per run, so disk use <= (max_files+3) * output_bytes
  audit_hook: bool = True       # False only to test the OS-level layers on their own


@dataclasses.dataclass(frozen=True)
class CodeResult:
  passed: bool
  reason: str        # "ok", "failed", "timeout", "killed by signal N", "exit N"
  stderr: str        # tail of the child's stderr, for debugging
  sandbox: str       # what the child managed to set up, e.g. "net=unshared uid=65534"


# Runs inside the sandboxed child as `python -I -c _RUNNER`. Everything it needs after user code starts is
# bound to locals first, so user code cannot monkeypatch the checker (it cannot reach frames or gc either).
_RUNNER = r"""
def _main():
  import sys, os, io, json, resource, hashlib
  # The spec arrives on a pipe (unseekable) and fd 0 becomes /dev/null before any candidate code runs: the
  # candidate cannot re-read its spec. Expected outputs are never in it (the parent compares hashes).
  spec = json.loads(sys.stdin.buffer.read().decode("utf-8"))
  null = os.open("/dev/null", os.O_RDONLY)
  os.dup2(null, 0)
  os.close(null)
  nonce, lim, result_fd, work = spec["nonce"], spec["limits"], spec["result_fd"], os.getcwd()
  status = []
  setr = resource.setrlimit
  setr(resource.RLIMIT_CPU, (lim["cpu_s"], lim["cpu_s"] + 1))
  setr(resource.RLIMIT_AS, (lim["mem_mb"] << 20, lim["mem_mb"] << 20))
  setr(resource.RLIMIT_FSIZE, (lim["output_bytes"], lim["output_bytes"]))
  setr(resource.RLIMIT_CORE, (0, 0))
  setr(resource.RLIMIT_NOFILE, (64, 64))
  root = os.geteuid() == 0
  try:
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    flags = 0x40000000 if root else 0x40000000 | 0x10000000  # CLONE_NEWNET (| CLONE_NEWUSER unprivileged)
    status.append("net=unshared" if libc.unshare(flags) == 0 else "net=shared")
  except Exception:
    status.append("net=shared")
  # The usual stdlib is imported now: the interpreter may sit in a home dir nobody cannot read (root drops to
  # 65534 below), and extension modules cannot load once _imp.create_dynamic is gone (below).
  for m in ("math", "cmath", "re", "collections", "itertools", "functools", "heapq", "bisect", "string",
            "random", "fractions", "decimal", "statistics", "typing", "dataclasses", "copy", "operator",
            "array", "datetime", "textwrap", "unicodedata", "enum", "abc", "numbers", "struct", "time", "json",
            "hashlib", "io", "os", "sys"):
    try:
      __import__(m)
    except Exception:
      pass
  if root:
    os.chown(work, 65534, 65534)
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)
  status.append(f"uid={os.getuid()}")
  try:  # die with the verifier process (e.g. a pool worker killed on timeout); set after setuid, which clears it
    libc.prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL
  except Exception:
    pass
  if os.getppid() != spec["ppid"]:
    os._exit(3)  # the parent already died before prctl took effect
  setr(resource.RLIMIT_NPROC, (0, 0))  # no fork, no threads (enforced for non-root uids)
  for m in ("ctypes", "_ctypes", "ctypes._endian"):
    sys.modules.pop(m, None)
  # Calls the audit hook cannot see (no audit event): removed from the module objects themselves.
  import posix, _imp
  for mod, names in ((os, ("mkfifo", "mknod")), (posix, ("mkfifo", "mknod")), (_imp, ("create_dynamic",))):
    for n in names:
      if hasattr(mod, n):
        delattr(mod, n)
  os.write(result_fd, (" ".join(status) + "\n").encode())
  isinstance_, str_, bytes_, int_, isdir = isinstance, str, bytes, int, os.path.isdir
  if lim["audit_hook"]:
    prefixes = tuple(sorted({os.path.realpath(p) + os.sep for p in
                             (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)}))
    work_sep, realpath = work + os.sep, os.path.realpath
    deny_prefix = ("os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system", "os.kill",
                   "os.killpg", "os.chdir", "os.chroot", "subprocess.", "socket.", "ctypes.", "sys._getframe",
                   "sys._current_frames", "gc.", "object.__getattr__", "object.__setattr__", "object.__delattr__",
                   "sys.setprofile", "sys.settrace", "pty.", "winreg.", "mmap.", "signal.", "os.fchdir")
    blocked_imports = ("ctypes", "_ctypes", "_posixsubprocess", "subprocess", "multiprocessing", "_multiprocessing",
                       "socket", "_socket", "ssl", "pty", "gc", "_imp")
    path_events = ("os.listdir", "os.scandir", "os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod",
                   "os.chown", "os.truncate", "os.utime", "os.link", "os.symlink", "shutil.rmtree", "os.chflags")
    creates = [0]  # disk quota: at most max_files write-opens/mkdirs, each capped by RLIMIT_FSIZE
    def inside(p, read):
      if isinstance_(p, int_):
        return True  # inherited fds only (0,1,2 and the result fd)
      if isinstance_(p, bytes_):
        p = p.decode("utf-8", "replace")
      rp = realpath(str_(p)) + "/"
      return rp.startswith(work_sep) or (read and (rp.startswith(prefixes) or rp == "/dev/null/"))
    def count_create():
      creates[0] += 1
      if creates[0] > lim["max_files"]:
        raise PermissionError(f"sandbox: more than {lim['max_files']} files written (disk quota)")
    def hook(event, args):
      if event == "open":
        if isinstance_(args[1], str_):  # open()/io.open_code: a mode string
          read_only = "r" in args[1] and "+" not in args[1]
        else:  # os.open: flags; read-only means O_RDONLY without O_CREAT/O_TRUNC
          # A directory fd would let dir_fd= paths (checked here against the cwd) escape: no directory fds.
          if args[2] & os.O_DIRECTORY or (not isinstance_(args[0], int_) and isdir(args[0])):
            raise PermissionError(f"sandbox: os.open of a directory ({args[0]!r}) is blocked")
          read_only = (args[2] & 3) == 0 and not args[2] & (os.O_CREAT | os.O_TRUNC)
        if not inside(args[0], read=read_only):
          raise PermissionError(f"sandbox: open({args[0]!r}) outside the work dir")
        if not read_only:
          count_create()
      elif event in path_events:
        for a in args[:2]:
          if isinstance_(a, (str_, bytes_)) and not inside(a, read=False):
            raise PermissionError(f"sandbox: {event}({a!r}) outside the work dir")
        if event in ("os.mkdir", "os.symlink", "os.link"):
          count_create()
      elif event == "import":
        if args[0].split(".")[0] in blocked_imports:
          raise ImportError(f"sandbox: import {args[0]} is blocked")
      elif event.startswith(deny_prefix):
        raise PermissionError(f"sandbox: {event} is blocked")
    sys.addaudithook(hook)
  code, tests, io_mode = spec["code"], spec["tests"], spec["io"]
  del spec
  exec_, compile_, TextIOWrapper, BytesIO, BaseException_, SystemExit_ = exec, compile, io.TextIOWrapper, io.BytesIO, BaseException, SystemExit
  cap, write, stdin0, stdout0, sha = lim["output_bytes"], os.write, sys.stdin, sys.stdout, hashlib.sha256
  norm = lambda s: "\n".join(ln.rstrip() for ln in s.rstrip().splitlines())
  ok = True
  try:
    prog = compile_(code, "solution.py", "exec")
    if not io_mode:
      g = {"__name__": "__main__"}
      exec_(prog, g)
      for t in tests:
        exec_(compile_(t, "test.py", "exec"), g)
    else:
      for i, t in enumerate(tests):
        buf = BytesIO()
        sys.stdin = TextIOWrapper(BytesIO(t.encode("utf-8")), encoding="utf-8")
        sys.stdout = out = TextIOWrapper(buf, encoding="utf-8", write_through=True)
        try:
          exec_(prog, {"__name__": "__main__"})
        except SystemExit_ as e:
          if e.code not in (None, 0):
            raise
        out.flush()
        got = buf.getvalue()
        sys.stdin, sys.stdout = stdin0, stdout0
        if len(got) > cap:
          ok = False
          break
        # Only a hash of this test's output goes back; the parent holds the expected output and judges.
        write(result_fd, f"{nonce} out {i} {sha(norm(got.decode('utf-8', 'replace')).encode()).hexdigest()}\n".encode())
  except BaseException_ as e:
    ok = False
    sys.stdin, sys.stdout = stdin0, stdout0
    try:
      sys.stderr.write(f"{type(e).__name__}: {e}\n"[:2000])
    except BaseException_:
      pass
  if ok:
    write(result_fd, f"{nonce} done\n".encode())
_main()
"""


def _norm_output(s: str) -> str:
  return "\n".join(ln.rstrip() for ln in s.rstrip().splitlines())  # the same rule as the child's `norm`


def _judge(lines, nonce, tests) -> bool:
  """The parent's verdict from the child's result lines. Only lines carrying the nonce count (the candidate
  never sees it); io outputs are compared here, against expected outputs the child never received."""
  mine = [ln.split(" ")[1:] for ln in lines if ln.startswith(nonce + " ")]
  if ["done"] not in mine:
    return False
  if all(isinstance(t, str) for t in tests):
    return True
  got = {int(m[1]): m[2] for m in mine if len(m) == 3 and m[0] == "out" and m[1].isdigit()}
  return all(got.get(i) == hashlib.sha256(_norm_output(t[1]).encode()).hexdigest() for i, t in enumerate(tests))


def run_code(code: str, tests, limits: SandboxLimits = SandboxLimits()) -> CodeResult:
  """Runs `code` against `tests` in the sandbox described in the module docstring. Never raises for
  anything the program does; returns within about limits.wall_s."""
  tests = [t if isinstance(t, str) else tuple(t) for t in (tests or ())]
  if not tests:
    raise ValueError("run_code: no tests given")
  io_mode = not all(isinstance(t, str) for t in tests)
  if io_mode and any(isinstance(t, str) for t in tests):
    raise ValueError("run_code: tests mix assert strings with input/output cases; use one kind")
  with tempfile.TemporaryDirectory(prefix="rlax-code-") as root:
    os.chmod(root, 0o711)  # the child may drop to uid 65534 and must still reach work/
    work = os.path.join(root, "work")
    os.mkdir(work, 0o700)
    nonce = secrets.token_hex(16)
    # stdout/stderr go to files so RLIMIT_FSIZE kills a flood at once (a pipe could fill, /dev/null never would).
    with open(os.path.join(root, "result"), "w+b") as res, open(os.path.join(root, "stderr"), "w+b") as err, \
        open(os.path.join(root, "stdout"), "wb") as out:
      spec = {"nonce": nonce, "code": code, "tests": [t[0] if io_mode else t for t in tests], "io": io_mode,
              "result_fd": res.fileno(), "ppid": os.getpid(), "limits": dataclasses.asdict(limits)}
      env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": work, "PYTHONHASHSEED": "0",
             "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
      # -I: no env vars, no user site; -S: no site-packages on sys.path and no .pth processing.
      proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _RUNNER], cwd=work, stdin=subprocess.PIPE,
                              stdout=out, stderr=err, env=env, close_fds=True,
                              pass_fds=(res.fileno(),), start_new_session=True)
      try:
        proc.communicate(json.dumps(spec).encode(), timeout=limits.wall_s)
        rc = proc.returncode
        reason = "ok" if rc == 0 else f"killed by signal {-rc}" if rc < 0 else f"exit {rc}"
      except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the whole session/process group, before reaping
        proc.wait()
        rc, reason = None, "timeout"
      res.seek(0)
      lines = res.read(1 << 20).decode("utf-8", "replace").split("\n")
      err.seek(0)
      stderr = err.read(limits.output_bytes).decode("utf-8", "replace")[-2000:]
    passed = rc == 0 and _judge(lines[1:], nonce, tests)
    if reason == "ok" and not passed:
      reason = "failed"
    return CodeResult(passed, reason, stderr, lines[0] if lines else "")


def _pool_worker(conn, limits, tmp_dir, strict_math=True):
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
    except Exception as e:  # a verifier bug must not take the pool down
      conn.send((idx, 0.0, f"{type(e).__name__}: {e}"))


class VerifierPool:
  """score() hands each (problem, completion) to a free worker (timeouts: see the module docstring).
  max_workers=0 runs verify() inline (no isolation, no timeout). Counters: timeouts, crashes, errors, last_error."""

  def __init__(self, max_workers: int = 2, timeout_s: float = 30.0, limits: SandboxLimits = SandboxLimits(),
               strict_math: bool = True):
    if max_workers < 0 or timeout_s <= 0:
      raise ValueError(f"VerifierPool: need max_workers >= 0 and timeout_s > 0, got {max_workers}, {timeout_s}")
    self.max_workers, self.timeout_s, self.limits, self.strict_math = max_workers, timeout_s, limits, strict_math
    self.startup_timeout_s = 120.0
    self._ctx = multiprocessing.get_context("spawn")  # fork after JAX/threads is unsafe
    self._tmp = tempfile.mkdtemp(prefix="rlax-verifier-") if max_workers else None
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
    if len(problems) != len(completions):
      raise ValueError(f"VerifierPool.score: {len(problems)} problems but {len(completions)} completions")
    if self.max_workers == 0:
      return [verify(p, c, self.limits, self.strict_math) for p, c in zip(problems, completions)]
    if not self._workers:
      self._workers = self._await_ready([self._spawn() for _ in range(self.max_workers)])
    scores, pending, free = [0.0] * len(problems), deque(range(len(problems))), list(self._workers)
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
          if err is not None:
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
    return scores

  def _replace(self, w):
    self._kill(w)
    new = self._await_ready([self._spawn()])[0]
    self._workers[self._workers.index(w)] = new
    return new

  def close(self):
    for w in self._workers:
      self._kill(w)
    self._workers = []
    if self._tmp:
      shutil.rmtree(self._tmp, ignore_errors=True)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


# ------------------------------------------------------------------------------------------------- tasks

@dataclasses.dataclass(frozen=True)
class Task:
  """One task, all in one place: an entry of TASKS, picked by name (--task, --eval_task, a jsonl line's "task").
  No `generate`: jsonl-only (math, code); a generator depends on its arguments alone, so a seed reproduces it."""
  verify: Callable  # (problem, completion, limits, strict_math) -> 1.0/0.0; runs in the verifier pool's processes
  reference: Callable  # problem -> the SFT warm-start target (the caller appends eos), or None where there is none
  needs_tests: bool = False  # jsonl lines must carry a non-empty "tests" list
  generate: Optional[Callable] = None  # (rng, difficulty, ops, max_number) -> (prompt, answer), None: a failed draw
  ops: str = ""  # make_task_problems takes a non-empty subset of these ops,
  default_ops: str = ""  # these when ops=None,
  min_difficulty: int = 1  # and an int difficulty >= this
  tokenizer_levels: tuple = ()  # build_task_tokenizer learns generated problems at these difficulties,
  tokenizer_ops: Optional[str] = None  # with these ops (None: default_ops),
  alphabet: str = ""  # and each of these characters on its own


def _is_eval(prompt: str) -> bool:
  return int(hashlib.sha256(prompt.encode()).hexdigest()[:8], 16) % 1000 < EVAL_BUCKET


def _rand_operand(rng, digits):
  nd = rng.randint(1, digits)  # digit count first, so short operands are not swamped by long ones
  return rng.randint(0 if nd == 1 else 10 ** (nd - 1), 10 ** nd - 1)


_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}
_PREC = {"+": 1, "-": 1, "*": 2, "/": 2}
_AST_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}  # the countdown verifier's allowed operators


def _arithmetic(rng, difficulty, ops, max_number):
  a, b, op = _rand_operand(rng, difficulty), _rand_operand(rng, difficulty), rng.choice(ops)
  return f"{a}{op}{b}=", str(_OPS[op](a, b))


def _verify_arithmetic(problem, completion, *_) -> float:
  s = completion.strip()
  return float(re.fullmatch(r"-?\d+", s) is not None and str(int(s)) == s and int(s) == int(problem.answer))


def _combine(x, y, op):
  """Combines (value, expr, precedence) nodes, adding only the parentheses the grammar needs."""
  (va, ea, pa), (vb, eb, pb) = x, y
  if op == "/" and vb == 0:
    return None
  left = f"({ea})" if pa < _PREC[op] else ea
  right = f"({eb})" if pb < _PREC[op] or (op in "-/" and pb == _PREC[op]) else eb
  return _OPS[op](va, vb), f"{left}{op}{right}", _PREC[op]


def _countdown(rng, difficulty, ops, max_number):
  nums = [rng.randint(1, max_number) for _ in range(difficulty)]
  for _ in range(100):
    nodes = [(Fraction(v), str(v), 3) for v in nums]
    while len(nodes) > 1:  # combine two random nodes until one expression over all numbers remains
      i, j = rng.sample(range(len(nodes)), 2)
      node = _combine(nodes[i], nodes[j], rng.choice(ops))
      if node is None:
        break
      nodes = [n for k, n in enumerate(nodes) if k not in (i, j)] + [node]
    if len(nodes) == 1 and nodes[0][0].denominator == 1 and 0 < nodes[0][0] <= 10 * max_number ** 2:
      return f"{' '.join(map(str, nums))} -> {nodes[0][0]}:", nodes[0][1]
  return None


def _countdown_value(node, pool):
  """Fraction value of an ast node made only of int literals and + - * /; uses numbers from `pool`."""
  if isinstance(node, ast.Constant) and type(node.value) is int:
    if pool.get(node.value, 0) == 0:
      raise ValueError("number not available")
    pool[node.value] -= 1
    return Fraction(node.value)
  if isinstance(node, ast.BinOp) and type(node.op) in _AST_OPS:
    return _OPS[_AST_OPS[type(node.op)]](_countdown_value(node.left, pool), _countdown_value(node.right, pool))
  raise ValueError(f"disallowed syntax {type(node).__name__}")


def _verify_countdown(problem, completion, *_) -> float:
  m = re.fullmatch(r"([\d ]+) -> (\d+):", problem.prompt)
  if not m:
    raise ValueError(f"countdown prompt {problem.prompt!r} is not in the built-in format 'N N N -> TARGET:'")
  numbers, target = [int(x) for x in m.group(1).split()], int(m.group(2))
  expr = completion.strip()
  if "=" in expr:  # "3*5+7=22" is fine when the stated result is the target
    expr, _, stated = expr.partition("=")
    if stated.strip() != str(target):
      return 0.0
  if not expr or len(expr) > 200 or re.search(r"[^\d+\-*/() ]", expr):
    return 0.0
  try:
    return float(_countdown_value(ast.parse(expr, mode="eval").body, Counter(numbers)) == target)
  except (SyntaxError, ValueError, ZeroDivisionError, RecursionError, MemoryError):
    return 0.0


_DIGITS_AND_OPS = "0123456789+-*/()=:> "  # every character arithmetic and countdown write

# The tasks: add yours here (see Task), then train with --task=NAME and evaluate with --eval_task=NAME.
TASKS = {
    "arithmetic": Task(_verify_arithmetic, lambda p: p.answer, generate=_arithmetic, ops="+-*", default_ops="+-",
                       tokenizer_levels=(2, 3, 4), tokenizer_ops="+-*", alphabet=_DIGITS_AND_OPS),
    "countdown": Task(_verify_countdown, lambda p: p.answer, generate=_countdown, ops="+-*/", default_ops="+-*",
                      min_difficulty=2, tokenizer_levels=(2, 3, 4), alphabet=_DIGITS_AND_OPS),
    # math: strict_math counts only a \\boxed{} answer; code: the answer field is a reference program.
    "math": Task(lambda p, c, limits, strict_math: float(math_verify_equal(extract_answer(c, strict=strict_math), p.answer)),
                 lambda p: f"\\boxed{{{p.answer}}}"),
    "code": Task(lambda p, c, limits, strict_math: float(run_code(_extract_code(c), p.tests, limits).passed),
                 lambda p: p.answer or None, needs_tests=True),
}


def _task_names(has) -> str:
  """The tasks for which has(task) holds, as "'a' or 'b'" for error messages."""
  return " or ".join(repr(name) for name, t in TASKS.items() if has(t))


def make_task_problems(task: str, n: int, difficulty: int = 2, seed: int = 0, split: str = "train",
                       ops: Optional[str] = None, max_number: int = 10) -> list:
  """n distinct generated problems of `task` in the given split (deterministic in all arguments)."""
  t = TASKS.get(task)
  if t is None or t.generate is None:
    raise ValueError(f"make_task_problems: task must be {_task_names(lambda t: t.generate)}, got {task!r}")
  ops = t.default_ops if ops is None else ops
  if split not in ("train", "eval"):
    raise ValueError(f"make_task_problems: split must be 'train' or 'eval', got {split!r}")
  if not isinstance(difficulty, int) or difficulty < t.min_difficulty:
    raise ValueError(f"make_task_problems: {task} difficulty must be an int >= {t.min_difficulty}, got {difficulty!r}")
  if not ops or set(ops) - set(t.ops):
    raise ValueError(f"make_task_problems: bad ops {ops!r} for {task}")
  rng = random.Random(f"{task}|{difficulty}|{ops}|{max_number}|{seed}|{split}")
  want_eval, out, seen = split == "eval", [], set()
  for _ in range(50 * n + 1000):
    if len(out) == n:
      break
    made = t.generate(rng, difficulty, ops, max_number)
    if made is None or made[0] in seen or _is_eval(made[0]) != want_eval:
      continue
    seen.add(made[0])
    out.append(Problem(f"{task}-{hashlib.sha256(made[0].encode()).hexdigest()[:12]}", made[0], made[1], task))
  if len(out) < n:
    raise ValueError(f"make_task_problems: only {len(out)} distinct {split} problems found for {task} "
                     f"difficulty={difficulty} ops={ops!r}; ask for fewer or raise the difficulty")
  return out


def reference_completion(problem: Problem) -> str:
  """Supervised target text for warm-starts (the caller appends eos): the reference of problem.task (TASKS)."""
  task = TASKS.get(problem.task)
  text = task.reference(problem) if task else None
  if text is None:
    raise ValueError(f"reference_completion: problem {problem.id!r} (task {problem.task!r}) has no reference answer")
  return text


def verify(problem: Problem, completion: str, limits: SandboxLimits = SandboxLimits(), strict_math: bool = True) -> float:
  """Reward in {0.0, 1.0} for `completion` (the decoded text after the prompt, eos already stripped) by the verifier
  of problem.task (TASKS)."""
  if problem.task not in TASKS:
    raise ValueError(f"verify: problem {problem.id!r} has unknown task {problem.task!r}")
  return TASKS[problem.task].verify(problem, completion, limits, strict_math)


# ---------------------------------------------------------------------------------------------- curation

def estimate_pass_rates(problems, sample_fn: Callable, k: int, score_fn: Optional[Callable] = None,
                        batch_size: int = 64) -> dict:
  """Pass rate of each problem under the current policy: sample_fn(list[Problem], k) -> list[list[str]]
  (k completions each), scored by score_fn(problems, completions) -> list[float] (default: inline verify;
  pass VerifierPool(...).score for isolation). Returns {id: mean score}."""
  score_fn = score_fn or (lambda ps, cs: [verify(p, c) for p, c in zip(ps, cs)])
  rates = {}
  for s in range(0, len(problems), batch_size):
    batch = problems[s:s + batch_size]
    samples = sample_fn(batch, k)
    if len(samples) != len(batch) or any(len(c) != k for c in samples):
      raise ValueError(f"estimate_pass_rates: sample_fn must return {len(batch)} lists of {k} completions, "
                       f"got lengths {[len(c) for c in samples]}")
    flat = score_fn([p for p in batch for _ in range(k)], [c for cs in samples for c in cs])
    for j, p in enumerate(batch):
      rates[p.id] = float(np.mean(flat[j * k:(j + 1) * k]))
  return rates


def filter_by_pass_rate(problems, rates: dict, low: float = 0.0, high: float = 1.0) -> list:
  """Problems with low < rate < high (the defaults drop never-solved and always-solved prompts)."""
  missing = [p.id for p in problems if p.id not in rates]
  if missing:
    raise ValueError(f"filter_by_pass_rate: no pass rate for {len(missing)} problems, e.g. {missing[:3]}")
  return [p for p in problems if low < rates[p.id] < high]


def curate(problems, sample_fn: Callable, k: int, out_path, low: float = 0.0, high: float = 1.0,
           score_fn: Optional[Callable] = None):
  """Offline curation: estimate pass rates, keep the difficulty band, write it (with "pass_rate") to out_path."""
  rates = estimate_pass_rates(problems, sample_fn, k, score_fn)
  kept = filter_by_pass_rate(problems, rates, low, high)
  write_jsonl(out_path, kept, rates)
  return kept, rates


class PassRateTracker:
  """Per-prompt running statistics across the run: sample count, mean reward and an EMA of batch means."""

  def __init__(self, ema: float = 0.9):
    if not 0.0 <= ema < 1.0:
      raise ValueError(f"PassRateTracker: ema must be in [0, 1), got {ema}")
    self.ema = ema
    self.stats = {}  # id -> [count, reward sum, ema]

  def update(self, pid: str, rewards):
    rewards = [float(r) for r in rewards]
    if not rewards:
      return
    mean = sum(rewards) / len(rewards)
    n, s, e = self.stats.get(pid, (0, 0.0, None))
    self.stats[pid] = [n + len(rewards), s + sum(rewards), mean if e is None else self.ema * e + (1 - self.ema) * mean]

  def rate(self, pid: str, default: Optional[float] = None):
    st = self.stats.get(pid)
    return default if st is None else st[1] / st[0]

  def ema_rate(self, pid: str, default: Optional[float] = None):
    st = self.stats.get(pid)
    return default if st is None else st[2]

  def summary(self) -> dict:
    rates = np.array([s / n for n, s, _ in self.stats.values()])
    mean = lambda x: float(np.mean(x)) if rates.size else 0.0
    return {"prompts": len(rates), "mean_rate": mean(rates), "frac_always": mean(rates == 1.0),
            "frac_never": mean(rates == 0.0)}

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
  rewards: np.ndarray  # [G] float32
  gen_s: float = 0.0
  stats: dict = dataclasses.field(default_factory=dict)

  def prompt_item(self, id: str, group_size: int) -> PromptItem:
    """The prompt again, under a new id (a stale rollout's prompt is re-issued)."""
    return PromptItem(id, self.problem, self.prompt_tokens, group_size)

  def to_wire(self) -> dict:
    return dict(id=self.id, version=self.version, worker=self.worker, **_problem_wire(self.problem),
                prompt_tokens=np.asarray(self.prompt_tokens, np.int32), completions=list(self.completions),
                logprobs=list(self.logprobs), rewards=np.asarray(self.rewards, np.float32), gen_s=self.gen_s,
                **self.stats)

  @classmethod
  def from_wire(cls, d: dict) -> "Rollout":
    where = f"rollout {d.get('id')!r}"
    _need(d, "id", (str,), where, "a str")
    _need(d, "version", (int,), where, "an int")
    comps = _need(d, "completions", (list,), where, "a list")
    lps = _need(d, "logprobs", (list,), where, "a list")
    rewards = np.asarray(d.get("rewards", ()), np.float64) if isinstance(d.get("rewards"), (np.ndarray, list)) \
        else None
    if rewards is None or rewards.shape != (len(comps),) or not comps or len(lps) != len(comps) \
            or not np.all(np.isfinite(rewards)):
      raise ValueError(f"{where}: completions, logprobs and rewards must be G >= 1 entries each with finite "
                       f"rewards; got {len(comps)}, {len(lps)}, {None if rewards is None else rewards.shape}")
    comps = [_token_ids(c, f"completions[{i}]", where) for i, c in enumerate(comps)]
    for i, (c, lp) in enumerate(zip(comps, lps)):
      if not isinstance(lp, (np.ndarray, list)) or np.shape(lp) != c.shape:
        raise ValueError(f"{where}: logprobs[{i}] must be {len(c)} log-probs, one per completion token")
    stats = {k: v for k, v in d.items()
             if k not in _ROLLOUT_FIELDS and isinstance(v, (int, float)) and not isinstance(v, bool)}
    return cls(d["id"], d["version"], str(d.get("worker", "")), _problem_from_wire(d, where),
               _token_ids(d.get("prompt_tokens"), "prompt_tokens", where), comps,
               [np.asarray(lp, np.float32) for lp in lps], rewards.astype(np.float32), float(d.get("gen_s", 0.0)),
               stats)


# Wire keys that are Rollout fields or its problem's; any other numeric key is a worker stat.
_ROLLOUT_FIELDS = {f.name for f in dataclasses.fields(Rollout)} | set(_problem_wire(Problem("", "", "")))


def group_has_signal(rewards, eps: float = 1e-6) -> bool:
  """The one dynamic-sampling criterion (DAPO): a group's rewards are not all equal (max - min > eps); a group
  that fails it carries no GRPO advantage. Used by ledger.Collector and dynamic_sampling_filter."""
  r = np.asarray(rewards, np.float64)
  return bool(r.size) and float(r.max() - r.min()) > eps


def dynamic_sampling_filter(groups, key: Optional[Callable] = None, eps: float = 1e-6) -> list:
  """DAPO dynamic sampling: keeps the groups whose rewards (key(group), default the group itself) pass
  group_has_signal. The caller refills the batch."""
  key = key or (lambda g: g)
  return [g for g in groups if group_has_signal(key(g), eps)]


# ---------------------------------------------------------------------------------------------- batching

def pad_to_bucket(length: int, buckets: Sequence[int] = DEFAULT_BUCKETS) -> int:
  for b in sorted(buckets):
    if length <= b:
      return b
  raise ValueError(f"pad_to_bucket: length {length} exceeds the largest bucket {max(buckets)}")


def _empty(R, T, pad_id, extras):
  return {"tokens": np.full((R, T), pad_id, np.int32), "targets": np.full((R, T), pad_id, np.int32),
          "positions": np.zeros((R, T), np.int32), "segment_ids": np.zeros((R, T), np.int32),
          "loss_mask": np.zeros((R, T), np.float32), **{name: np.zeros((R, T), np.float32) for name in extras or {}}}


def _place(out, r, start, seg, prompt, completion, extras, i):
  """Writes sequence i (prompt ++ completion) into row r at [start, start+L) with segment id seg."""
  P, C = len(prompt), len(completion)
  L = P + C
  seq = np.asarray(list(prompt) + list(completion), np.int32)
  out["tokens"][r, start:start + L] = seq
  out["targets"][r, start:start + L - 1] = seq[1:]  # the segment's last token predicts nothing (pad target)
  out["positions"][r, start:start + L] = np.arange(L)
  out["segment_ids"][r, start:start + L] = seg
  out["loss_mask"][r, start + P - 1:start + L - 1] = 1.0
  for name, values in (extras or {}).items():
    if len(values[i]) != C:
      raise ValueError(f"completion_extras[{name!r}][{i}] has {len(values[i])} values for {C} completion tokens")
    out[name][r, start + P - 1:start + L - 1] = values[i]


def _check_pairs(prompts, completions, extras):
  if len(prompts) != len(completions):
    raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
  for i, p in enumerate(prompts):
    if len(p) == 0:
      raise ValueError(f"sequence {i}: empty prompt (at least one token, e.g. bos, must precede the completion)")
  for name, values in (extras or {}).items():
    if len(values) != len(prompts):
      raise ValueError(f"completion_extras[{name!r}] has {len(values)} entries for {len(prompts)} sequences")


def make_batch(prompt_ids_list, completion_ids_list, buckets: Sequence[int] = DEFAULT_BUCKETS, pad_id: int = 0,
               batch_size: Optional[int] = None, completion_extras: Optional[dict] = None) -> dict:
  """One sequence per row, right-padded to the smallest bucket >= the longest; rows beyond the data (up to
  batch_size) are all padding. Returns tokens/targets/positions/segment_ids [B,T] int32, loss_mask [B,T]
  float32, prompt_lens/completion_lens [B] int32 and each completion_extras name as [B,T] float32."""
  _check_pairs(prompt_ids_list, completion_ids_list, completion_extras)
  n = len(prompt_ids_list)
  B = n if batch_size is None else batch_size
  if B < n or B == 0:
    raise ValueError(f"make_batch: batch_size {batch_size} with {n} sequences")
  T = pad_to_bucket(max([len(p) + len(c) for p, c in zip(prompt_ids_list, completion_ids_list)] + [1]), buckets)
  out = _empty(B, T, pad_id, completion_extras)
  for i, (p, c) in enumerate(zip(prompt_ids_list, completion_ids_list)):
    _place(out, i, 0, 1, p, c, completion_extras, i)
  out["prompt_lens"] = np.array([len(p) for p in prompt_ids_list] + [0] * (B - n), np.int32)
  out["completion_lens"] = np.array([len(c) for c in completion_ids_list] + [0] * (B - n), np.int32)
  return out


def pack(prompt_ids_list, completion_ids_list, seq_len: int, pad_id: int = 0, num_rows: Optional[int] = None,
         completion_extras: Optional[dict] = None) -> dict:
  """First-fit packing (in input order) into rows of seq_len; segment ids 1, 2, ... per row. Raises if a
  sequence is longer than seq_len or the data does not fit in num_rows (nothing is dropped silently).
  Adds "row" and "offset" [N] int32: where sequence i landed."""
  _check_pairs(prompt_ids_list, completion_ids_list, completion_extras)
  fill, placed = [], []  # per row: used length, segment count
  for i, (p, c) in enumerate(zip(prompt_ids_list, completion_ids_list)):
    L = len(p) + len(c)
    if L > seq_len:
      raise ValueError(f"pack: sequence {i} has {L} tokens > seq_len {seq_len}")
    r = next((r for r, (used, _) in enumerate(fill) if used + L <= seq_len), len(fill))
    if r == len(fill):
      fill.append([0, 0])
    placed.append((r, fill[r][0], fill[r][1] + 1))
    fill[r] = [fill[r][0] + L, fill[r][1] + 1]
  R = len(fill) if num_rows is None else num_rows
  if len(fill) > R:
    raise ValueError(f"pack: {len(prompt_ids_list)} sequences need {len(fill)} rows of {seq_len}, only {num_rows} allowed")
  out = _empty(R, seq_len, pad_id, completion_extras)
  for i, ((p, c), (r, start, seg)) in enumerate(zip(zip(prompt_ids_list, completion_ids_list), placed)):
    _place(out, r, start, seg, p, c, completion_extras, i)
  out["row"] = np.array([r for r, _, _ in placed], np.int32)
  out["offset"] = np.array([s for _, s, _ in placed], np.int32)
  return out


# Hand-labelled (predicted answer, reference, equal?) pairs of the kinds GSM8K and MATH produce. The prediction
# is scored as the completion "... \boxed{pred}". `python data.py math_agreement` prints both verifiers' agreement.
MATH_PAIRS = (
    ("\\frac{1}{2}", "0.5", 1), ("0.5", "\\frac12", 1), ("\\dfrac{3}{4}", "3/4", 1), ("0.33", "\\frac{1}{3}", 0),
    ("2\\sqrt{2}", "\\sqrt{8}", 1), ("\\sqrt{2}/2", "\\frac{\\sqrt{2}}{2}", 1), ("\\frac{1}{\\sqrt{2}}", "\\frac{\\sqrt2}{2}", 1),
    ("2\\pi", "2 \\pi", 1), ("\\pi/2", "\\frac{\\pi}{2}", 1), ("3.14", "\\pi", 0), ("6.28", "2\\pi", 0),
    ("(1, 3]", "(1,3]", 1), ("(1,3)", "[1,3]", 0), ("[2, \\infty)", "[2,\\infty)", 1), ("(-\\infty, 0)", "(-\\infty,0)", 1),
    ("\\{1, 2, 3\\}", "\\{3,2,1\\}", 1), ("\\{1,2\\}", "\\{1,2,3\\}", 0), ("1, 2, 3", "3, 2, 1", 1),
    ("5 \\text{ cm}", "5", 1), ("12\\text{ dollars}", "12", 1), ("\\$18", "18", 1), ("90^\\circ", "90", 1),
    ("25\\%", "25", 1), ("7 \\text{ cm}", "5", 0),
    ("\\text{(B)}", "\\text{(B)}", 1), ("B", "\\text{(B)}", 1), ("(C)", "\\text{(B)}", 0),
    ("18", "Janet sells 16 - 3 - 4 = 9 eggs... 9 * 2 = 18 dollars.\n#### 18", 1),
    ("72", "She has 48 + 24 = 72 clips.\n#### 72", 1), ("70", "48 + 24 = 72\n#### 72", 0),
    ("1,234", "1234", 1), ("-3", "-3.0", 1), ("3", "-3", 0), ("x = 5", "5", 1), ("y=2x+1", "2x+1", 1),
    ("x^2+2x+1", "(x+1)^2", 1), ("\\frac{x+1}{2}", "\\frac{1+x}{2}", 1), ("2x", "x^2", 0),
    ("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "\\begin{pmatrix}1\\\\2\\end{pmatrix}", 1),
    ("10^{3}", "1000", 1), ("1e3", "1000", 1), ("\\frac{10}{4}", "2.5", 1), ("5/2", "\\frac{5}{2}", 1),
    ("\\sqrt{3}", "1.732", 0), ("\\infty", "\\infty", 1), ("0.1", "\\frac{1}{10}", 1),
)


def math_agreement(pairs=MATH_PAIRS):
  """Fraction of `pairs` on which each verifier agrees with the hand label: old (math_answer_equal, lenient
  extraction) and new (math-verify, strict \\boxed{} extraction). Returns (old, new, disagreements of new)."""
  old, new = [], []
  for pred, ref, label in pairs:
    completion = f"So the answer follows.\n\\boxed{{{pred}}}"
    old.append(math_answer_equal(extract_answer(completion), ref) == bool(label))
    new.append(math_verify_equal(extract_answer(completion, strict=True), ref) == bool(label))
  wrong = [(pred, ref, label) for (pred, ref, label), ok in zip(pairs, new) if not ok]
  return sum(old) / len(pairs), sum(new) / len(pairs), wrong


if __name__ == "__main__":
  if sys.argv[1:] == ["math_agreement"]:
    o, n, wrong = math_agreement()
    print(f"{len(MATH_PAIRS)} hand-labelled pairs: old verifier agrees {o:.1%}, math-verify (strict boxed) {n:.1%}")
    for w in wrong:
      print("  math-verify disagrees:", w)
    sys.exit(0)
  # Prints sample problems and the figures quoted in RESULTS.md (timings depend on the machine's load).
  with tempfile.TemporaryDirectory() as d:
    for task in ("arithmetic", "countdown"):
      t0 = time.perf_counter()
      tok = load_tokenizer(build_task_tokenizer(d, task))
      print(f"{task}: tokenizer built in {time.perf_counter() - t0:.2f}s, vocab {tok.vocab_size}")
      for p in make_task_problems(task, 3, difficulty=3, seed=0):
        print(f"  {p.id}  {p.prompt!r} -> {p.answer!r}  pieces {tok.pieces(p.prompt + p.answer)}  "
              f"verify(answer) = {verify(p, p.answer)}")
  t0 = time.perf_counter()
  results = [run_code("print(input())", [("hi\n", "hi\n")]) for _ in range(5)]
  print(f"sandbox: {results[0].sandbox}  echo test passed={all(r.passed for r in results)}  "
        f"{(time.perf_counter() - t0) / 5 * 1000:.0f} ms per run_code")
  probs = make_task_problems("arithmetic", 2000, difficulty=3, seed=0)
  for task, ps in (("arithmetic", probs), ("countdown", make_task_problems("countdown", 2000, difficulty=4))):
    t0 = time.perf_counter()
    ok = all(verify(p, p.answer) == 1.0 for p in ps)
    print(f"inline verify: {len(ps) / (time.perf_counter() - t0):.0f} {task} verifications/s, all correct={ok}")
  with VerifierPool(max_workers=2) as pool:
    pool.score(probs[:2], ["0", "0"])  # start the workers
    t0 = time.perf_counter()
    scores = pool.score(probs, [p.answer for p in probs])
    print(f"VerifierPool(2): {len(probs) / (time.perf_counter() - t0):.0f} arithmetic verifications/s, "
          f"all correct={sum(scores) == len(probs)}")
