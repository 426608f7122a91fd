"""arithmetic: prompt "12+345=", completion "357" (then eos); answers may be negative ("3-15=" -> "-12").
Reward: the canonical integer equal to the answer, surrounding whitespace tolerated."""
import operator
import random
import re

PROMPT = re.compile(r"(\d+)([-+*/])(\d+)=")  # a prompt's operands and operator
OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}
# Every character arithmetic and countdown write: the built-in tokenizer learns each as a piece of its own.
ALPHABET = "0123456789+-*/()=:> "
# What data.build_task_tokenizer learns: ALPHABET, then generated problems with each of these task_args.
TOKENIZER_CORPUS = (ALPHABET, [dict(difficulty=d, ops="+-*") for d in (2, 3, 4)])


def generate(seed, difficulty=3, ops="+-", region="all"):
  """difficulty: max digits per operand (each draws its digit count uniformly in 1..difficulty first, so short
  operands are not swamped by long ones); ops: a non-empty subset of "+-*"; region: "all", "lo" (both operands
  below 10**difficulty / 2) or "hi" (the rest), for a held-out shift (the demo: RL on "lo", eval on "hi")."""
  if not isinstance(difficulty, int) or difficulty < 1:
    raise ValueError(f"arithmetic: difficulty must be an int >= 1, got {difficulty!r}")
  if not ops or set(ops) - set("+-*"):
    raise ValueError(f"arithmetic: bad ops {ops!r} (a non-empty subset of '+-*')")
  if region not in ("all", "lo", "hi"):
    raise ValueError(f"arithmetic: region must be all, lo or hi, got {region!r}")
  rng, half = random.Random(f"arithmetic|{difficulty}|{ops}|10|{seed}"), 10 ** difficulty // 2  # "10": historical
  while True:
    a, b, op = _operand(rng, difficulty), _operand(rng, difficulty), rng.choice(ops)
    if region == "all" or (max(a, b) < half) == (region == "lo"):
      yield f"{a}{op}{b}=", str(OPS[op](a, b))


def _operand(rng, digits):
  nd = rng.randint(1, digits)
  return rng.randint(0 if nd == 1 else 10 ** (nd - 1), 10 ** nd - 1)


def units_carry(prompt):
  """Whether a sum's units digits carry into the tens (17+25=: 7+5 >= 10): where the demo's teacher slips."""
  a, op, b = PROMPT.fullmatch(prompt).groups()
  return op == "+" and int(a[-1]) + int(b[-1]) >= 10


def split_key(prompt):
  """What data.make_task_problems hashes to hold a problem out: the operator and the operand pair, unordered, so
  that a+b and b+a, and a-b and b-a (the same digits, the other sign), fall on the same side of the split."""
  a, op, b = PROMPT.fullmatch(prompt).groups()
  return f"{op}{min(int(a), int(b))},{max(int(a), int(b))}"


def verify(problem, completion, *_) -> float:
  s = completion.strip()
  return float(re.fullmatch(r"-?\d+", s) is not None and str(int(s)) == s and int(s) == int(problem.answer))
