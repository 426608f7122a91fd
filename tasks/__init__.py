"""The tasks, one module each, picked by name: train.py --task, rollout.py --eval_task, a jsonl line's "task".

A task is a `Task`:
  verify(problem, completion, limits, strict_math) -> 1.0 / 0.0: the reward. It runs in data.VerifierPool's
      processes; limits (the code sandbox's SandboxLimits) and strict_math (math's extraction rule) are the
      pool's settings, which a task may ignore.
  reference(problem) -> the SFT warm-start target (the caller appends eos), or None where there is none; default:
      the problem's answer.
  generate(seed, **task_args) -> an endless iterator of (prompt, answer) draws (None: a failed draw), from a random
      stream the task seeds with `seed` (a string: the run's seed and the split) and its task_args, its own
      options (--task_args=difficulty=2,ops=+). None: the task's problems come from jsonl files only.
data.make_task_problems keeps distinct draws of the requested split: a problem is held out iff sha256(prompt)
(or of the task's split_key(prompt): arithmetic's is the unordered operand pair) falls in a fixed 20% bucket, so
held-out problems, and their commuted twins, never appear in training, whatever seeds or sizes are used.

A new task: a module here and its TASKS entry (and, for the built-in tokenizer, a TOKENIZER_CORPUS entry).
"""
import dataclasses
from typing import Callable, Optional

from tasks import arithmetic, code_tests, countdown, math_answer


@dataclasses.dataclass(frozen=True)
class Task:
  verify: Callable
  reference: Callable = lambda problem: problem.answer
  generate: Optional[Callable] = None
  split_key: Optional[Callable] = None  # prompt -> what is hashed to hold it out (default: the prompt itself)


TASKS = {
    "arithmetic": Task(arithmetic.verify, generate=arithmetic.generate, split_key=arithmetic.split_key),
    "countdown": Task(countdown.verify, generate=countdown.generate),
    "math": Task(math_answer.verify, math_answer.reference),
    "code": Task(code_tests.verify, code_tests.reference),
}
# What data.build_task_tokenizer learns for a generated task: (alphabet, [task_args, ...]).
TOKENIZER_CORPUS = {"arithmetic": arithmetic.TOKENIZER_CORPUS, "countdown": countdown.TOKENIZER_CORPUS}
