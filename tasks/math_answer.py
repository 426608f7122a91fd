"""math (jsonl problems): the final answer, extracted from the completion, compared with the reference answer by
Hugging Face math-verify. SFT reference: "\\boxed{answer}"."""
import re
import threading
from typing import Optional

GSM8K_FINAL = re.compile(r"####\s*(.+?)\s*$", re.DOTALL)
# Claims, not values (math-verify compares only their last side): relations, arrows, connectives ("41 \lor 42")
CLAIM = re.compile(r"[=<>≤≥≠≈→⇒∨∧]+|\\(?:[lg]eq?|[lg]t|neq?|approx|equiv|sim|to|implies|iff|[a-zA-Z]*arrow|lor|land"
                   r"|vee|wedge|neg)(?![a-zA-Z])")
ASSIGNED = re.compile(r"^\s*\\?[a-zA-Z]+(?:_\{?\w+\}?)?\s*=")  # the "x =" of "x = 42", "\theta_1 = 42", "AB = 42"


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
  N. The prediction must parse whole and state no more relations, arrows or connectives (CLAIM) than the reference,
  past a leading "x =": for 42, "x = 42" scores 1, "2 = 42", "41 \\lor 42", "41 \\to 42", "x \\le 42" 0; for "x = 3",
  "3" and "x=3" 1. Timeouts: SIGALRM, so only in the main thread (the VerifierPool's processes). Errors score False."""
  import math_verify  # slow to import: only where math is verified
  m = GSM8K_FINAL.search(ref)
  ref = m.group(1).replace(",", "") if m else ref
  claims = lambda x: len(CLAIM.findall(ASSIGNED.sub("", x, count=1)))  # noqa: E731
  if not (pred or "").strip() or claims(pred) > claims(ref):
    return False
  t = timeout_s if threading.current_thread() is threading.main_thread() else None
  try:
    gold = math_verify.parse(ref if "\\boxed" in ref or "$" in ref else f"${ref}$", parsing_timeout=t)
    got = math_verify.parse("$" + re.sub(r"(?<!\\)\$", "", pred) + "$", parsing_timeout=t,  # one formula, and no
                            extraction_config=[math_verify.LatexExtractionConfig()])  # last number of what fails
    return bool(gold and got and math_verify.verify(gold, got, timeout_seconds=t))
  except Exception:  # noqa: BLE001 - a verifier never crashes its caller on one answer
    return False


def verify(problem, completion, limits, strict_math) -> float:
  """strict_math: only a \\boxed{} answer counts (else also "answer is X", "#### X" or the last number)."""
  return float(math_verify_equal(extract_answer(completion, strict=strict_math), problem.answer))


def reference(problem):
  return f"\\boxed{{{problem.answer}}}"
