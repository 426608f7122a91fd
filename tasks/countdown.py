"""countdown: prompt "3 5 7 -> 22:", completion "3*5+7" (then eos). Reward: any expression of non-negative integer
literals, + - * / and parentheses that uses each given number AT MOST once (classic countdown) and equals the
target exactly (Fraction arithmetic, no eval); an optional trailing "=<target>" is allowed."""
import ast
import random
import re
from collections import Counter
from fractions import Fraction

from tasks.arithmetic import ALPHABET, OPS

PREC = {"+": 1, "-": 1, "*": 2, "/": 2}
AST_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}
TOKENIZER_CORPUS = (ALPHABET, [dict(difficulty=d) for d in (2, 3, 4)])  # see tasks.arithmetic


def generate(seed, difficulty=3, ops="+-*", max_number=10):
  """difficulty: how many numbers (>= 2), each in 1..max_number; the target is built from a random expression over
  all of them with `ops` (a non-empty subset of "+-*/"), so it is always reachable."""
  if not isinstance(difficulty, int) or difficulty < 2:
    raise ValueError(f"countdown: difficulty must be an int >= 2, got {difficulty!r}")
  if not ops or set(ops) - set("+-*/"):
    raise ValueError(f"countdown: bad ops {ops!r} (a non-empty subset of '+-*/')")
  rng = random.Random(f"countdown|{difficulty}|{ops}|{max_number}|{seed}")
  while True:
    yield _draw(rng, difficulty, ops, max_number)


def _draw(rng, difficulty, ops, max_number):
  nums = [rng.randint(1, max_number) for _ in range(difficulty)]
  for _ in range(100):
    nodes = [(Fraction(v), str(v), 3) for v in nums]  # (value, expression, precedence)
    while len(nodes) > 1:  # combine two random nodes until one expression over all numbers remains
      i, j = rng.sample(range(len(nodes)), 2)
      node = _combine(nodes[i], nodes[j], rng.choice(ops))
      if node is None:
        break
      nodes = [n for k, n in enumerate(nodes) if k not in (i, j)] + [node]
    if len(nodes) == 1 and nodes[0][0].denominator == 1 and 0 < nodes[0][0] <= 10 * max_number ** 2:
      return f"{' '.join(map(str, nums))} -> {nodes[0][0]}:", nodes[0][1]
  return None


def _combine(x, y, op):
  """Combines two nodes, adding only the parentheses the grammar needs."""
  (va, ea, pa), (vb, eb, pb) = x, y
  if op == "/" and vb == 0:
    return None
  left = f"({ea})" if pa < PREC[op] else ea
  right = f"({eb})" if pb < PREC[op] or (op in "-/" and pb == PREC[op]) else eb
  return OPS[op](va, vb), f"{left}{op}{right}", PREC[op]


def _value(node, pool):
  """Fraction value of an ast node made only of int literals and + - * /, taking its numbers from `pool`."""
  if isinstance(node, ast.Constant) and type(node.value) is int:
    if pool.get(node.value, 0) == 0:
      raise ValueError("number not available")
    pool[node.value] -= 1
    return Fraction(node.value)
  if isinstance(node, ast.BinOp) and type(node.op) in AST_OPS:
    return OPS[AST_OPS[type(node.op)]](_value(node.left, pool), _value(node.right, pool))
  raise ValueError(f"disallowed syntax {type(node).__name__}")


def verify(problem, completion, *_) -> float:
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
    return float(_value(ast.parse(expr, mode="eval").body, Counter(numbers)) == target)
  except (SyntaxError, ValueError, ZeroDivisionError, RecursionError, MemoryError):
    return 0.0
