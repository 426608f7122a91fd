"""math (jsonl problems): the final answer, extracted from the completion, compared with the reference answer by
Hugging Face math-verify. SFT reference: "\\boxed{answer}"."""
import re
import threading
from typing import Optional

GSM8K_FINAL = re.compile(r"####\s*(.+?)\s*$", re.DOTALL)


def _braced(text, start):
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
      got = _braced(text, rest)
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
  """math-verify (pinned in requirements.txt) parses both sides to sympy (LaTeX or plain) and compares them
  (fractions vs decimals, \\sqrt, \\pi, intervals, sets, units, \\text{(B)}). A GSM8K "#### N" reference counts as
  N. Its timeouts use SIGALRM, so they apply in the main thread (the VerifierPool's processes); elsewhere they are
  off (math_verify's own rule). Any parser error scores False."""
  import math_verify  # slow to import: only where math is verified
  if pred is None or not pred.strip():
    return False
  m = GSM8K_FINAL.search(ref)
  ref = m.group(1).replace(",", "") if m else ref
  t = timeout_s if threading.current_thread() is threading.main_thread() else None
  wrap = lambda x: x if "\\boxed" in x or "$" in x else f"${x}$"  # noqa: E731
  try:
    gold = math_verify.parse(wrap(ref), parsing_timeout=t)
    got = math_verify.parse(wrap(pred), parsing_timeout=t)
    return bool(gold and got and math_verify.verify(gold, got, timeout_seconds=t))
  except Exception:  # noqa: BLE001 - a verifier never crashes its caller on one answer
    return False


def verify(problem, completion, limits, strict_math) -> float:
  """strict_math: only a \\boxed{} answer counts (else also "answer is X", "#### X" or the last number)."""
  return float(math_verify_equal(extract_answer(completion, strict=strict_math), problem.answer))


def reference(problem):
  return f"\\boxed{{{problem.answer}}}"
