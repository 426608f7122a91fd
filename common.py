"""What the entry points share: atomic file writes, the flags train.py and rollout.py both define, and the malloc
settings that let XLA on the host CPU reuse a step's buffers.

  write_atomic(path, data, fsync=False)   temp file + rename: a reader, or a restart after a crash, sees the old
                                          file or the whole new one, never a torn one
  define_shared_flags(max_new_tokens, task_args_error)   called by train.py's and rollout.py's define_flags():
                                          importing a module defines no flag; docs/FLAGS.md lists them
  tune_malloc()                           first thing in a process's main, before its first JAX computation
  policy_lag(now, tag, forks)             staleness in policy updates along the trainer's lineage (restarts)
"""
import contextlib
import ctypes
import ctypes.util
import os
import signal

from absl import flags


def fsync_dir(path):
  fd = os.open(path or ".", os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def write_atomic(path, data, fsync=False, mode=0o666, tmp=None):
  """Writes data (str as UTF-8, bytes, or an iterable of either) to tmp (default path.tmp), renamed onto path; a
  failure before the rename removes tmp (not to hold disk space) and raises. fsync=True: fsync the file before the
  rename, its directory after (else a power loss can undo it). mode: before the umask (0o666 is open()'s)."""
  tmp = tmp or f"{path}.tmp"
  chunks = [data] if isinstance(data, (str, bytes, bytearray, memoryview)) else data
  try:
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode), "wb") as f:
      for c in chunks:
        f.write(c.encode() if isinstance(c, str) else c)
      if fsync:
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    with contextlib.suppress(OSError):
      os.remove(tmp)
    raise
  if fsync:
    fsync_dir(os.path.dirname(path))


def define_shared_flags(max_new_tokens, task_args_error):
  """max_new_tokens: the entry point's default; task_args_error: data.task_args_error (data imports common). The caller adopts these as its key flags (train's flags.json)."""
  flags.DEFINE_string("server", "127.0.0.1:5555", "Parameter server host:port. Default 127.0.0.1:5555.")
  flags.DEFINE_string("token_file", None, "File holding the server's shared secret (the trainer's push and the "
                      "worker's lease/put need it). Default none.")
  flags.DEFINE_string("tokenizer", None, "Tokenizer: sentencepiece .model or a dir with tokenizer.json. Required.")
  flags.DEFINE_integer("seed", 0, "Seed: the trainer's data order and init; the worker's sampling (folded with the "
                       "prompt id). Default 0.")
  flags.DEFINE_enum("template", "auto", ["auto", "hf", "chatml", "plain"], "Prompt template (data.prompt_encoder): "
                    "hf (the checkpoint's own chat template from --tokenizer's dir, encoded as transformers' "
                    "apply_chat_template), chatml, plain (text + bos), or auto (hf when the checkpoint ships a "
                    "template, else plain). Default auto.")
  flags.DEFINE_string("attn_impl", "auto", "Attention path: auto (Pallas on TPU), ref or pallas. Default auto.")
  flags.DEFINE_integer("server_retries", 30, "Reconnect attempts (exponential backoff, max 2 s apart) before giving up "
                       "on the server. Default 30.")
  flags.DEFINE_integer("max_staleness", 4, "Max policy-version lag (versions) of a rollout: the trainer trains none "
                       "older, a worker regenerates older groups. Default 4.")
  # Sampling: the trainer's travel with the weights (it scores what workers sampled); rollout.py's are eval's.
  flags.DEFINE_integer("max_new_tokens", max_new_tokens, "Completion budget in tokens (trainer: sent to the workers, "
                       "also DAPO overlong shaping; rollout.py: eval). 0 = what the context leaves after the longest "
                       f"prompt, capped at 1024 (data.completion_budget). Default {max_new_tokens}.")
  flags.DEFINE_float("temperature", 1.0, "Sampling temperature (trainer: sent to the workers, the loss scores "
                     "log-probs at it; rollout.py: eval, 0 = greedy). Default 1.0.")
  flags.DEFINE_integer("top_k", 0, "Top-k truncation (0 = off; trainer: sent to the workers). Default 0.")
  flags.DEFINE_float("top_p", 1.0, "Top-p (nucleus) mass (1 = off; trainer: sent to the workers, with truncation set "
                     "a tis_cap override). Default 1.0.")
  # The held-out set: rollout.py --mode=eval, and train.py --eval_every (through the workers, during training).
  flags.DEFINE_string("eval_task", "arithmetic", "Built-in task of the held-out set (ignored with --eval_jsonl). "
                      "Default arithmetic.")
  flags.DEFINE_string("eval_task_args", "", "The built-in eval task's own options, name=value,... e.g. "
                      "difficulty=2,ops=+ (as train.py --task_args). Default empty: the task's defaults.")
  flags.DEFINE_string("eval_jsonl", None, "Held-out jsonl prompts instead of a built-in task. Default none.")
  flags.DEFINE_integer("eval_n", 200, "Number of held-out problems. Default 200.")
  flags.DEFINE_integer("k", 8, "Samples per held-out problem; reports pass@1 and pass@k. Default 8.")
  register_task_validator("eval_task", "eval_task_args", "eval_jsonl", task_args_error)
  # Bad values fail at flag parsing; temperature's rule differs per entry point (eval allows greedy).
  for name, ok, rule in (
      ("max_new_tokens", lambda v: v >= 0, ">= 0 (0 = auto)"), ("top_k", lambda v: v >= 0, ">= 0 (0 = off)"),
      ("max_staleness", lambda v: v >= 0, ">= 0 (a negative bound makes every rollout stale)"),
      ("server_retries", lambda v: v >= 0, ">= 0"), ("top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
      ("eval_n", lambda v: v >= 1, ">= 1"), ("k", lambda v: v >= 1, ">= 1")):
    flags.register_validator(name, ok, message=f"--{name} must be {rule}")


def register_task_validator(task, task_args, jsonl, task_args_error):
  """--<task_args> must suit --<task> (task_args_error(task, text) -> message or None), unless --<jsonl> replaces
  the built-in task: refused at flag parsing."""
  def check(f):
    if not f[jsonl] and (err := task_args_error(f[task], f[task_args])):
      raise flags.ValidationError(err)
    return True
  flags.register_multi_flags_validator([task, task_args, jsonl], check, message="")


# glibc mallopt parameter numbers (<malloc.h>).
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8


def tune_malloc():
  """Keep freed host buffers for the next step. XLA's CPU runtime allocates each execution's temporaries from its
  own threads; glibc gives them arenas whose large blocks are mmap'd and returned when freed, so every step
  page-faults its working set in again (measured: 95k minor faults, ~15% of a training step's CPU on 2 cores).
  One arena, no mmap'd blocks and a 2 GB trim threshold make a step reuse the last one's memory (~0 faults once
  settled; RESULTS.md "Decode and train step"; `python -m bench.train_step --host_malloc=default` is the A/B).
  Cost: the process keeps its peak resident set. Call before the first JAX computation (glibc fixes the arena
  limit when a thread first allocates). Not in the pytest process: with one arena the Pallas TPU interpreter on 8
  fake devices deadlocks in XLA's CPU runtime (tests/test_kernels.py; 3 of 3 runs). True where it took effect."""
  try:
    mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
  except (OSError, AttributeError):
    return False
  mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
  return all(mallopt(p, v) == 1 for p, v in ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1)))


class StopFlag:
  """SIGTERM / SIGINT set `requested`, which a trainer or worker loop polls between steps (a TPU preemption
  notice arrives as SIGTERM): the loop finishes its step, checkpoints or drains, and exits cleanly."""

  def __init__(self):
    self.requested = False
    signal.signal(signal.SIGTERM, self._set)
    signal.signal(signal.SIGINT, self._set)

  def _set(self, *_):
    self.requested = True


def policy_lag(now, tag, forks):
  """Policy updates between version `tag` (a rollout's) and `now` along this trainer's lineage. forks: [lo, hi] per
  restart, which published the restored weights of version lo again as version hi (past the server's newest); a
  tag in (lo, hi) is from an incarnation that died after its checkpoint: tag - lo updates off our lineage."""
  lag = now - tag
  for lo, hi in forks:
    if lo < tag < hi:
      return tag - lo + policy_lag(now, lo, forks)
    if tag <= lo and hi <= now:
      lag -= hi - lo  # versions lo+1 .. hi are no updates of ours
  return lag
