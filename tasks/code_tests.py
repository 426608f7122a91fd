"""code (jsonl problems with "tests"): the last ```python fenced block of the completion (or all of it) must pass
the problem's tests in the sandbox (tasks.sandbox). The "answer" field, if any, is a reference program."""
import re

from tasks.sandbox import run_code


def extract_code(completion: str) -> str:
  blocks = re.findall(r"```(?:python|py)?[ \t]*\n(.*?)```", completion, re.DOTALL)
  return blocks[-1] if blocks else completion


def verify(problem, completion, limits, strict_math) -> float:
  return float(run_code(extract_code(completion), problem.tests, limits).passed)


def reference(problem):
  return problem.answer or None
