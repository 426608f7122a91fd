"""docs/FLAGS.md (every flag of train.py, rollout.py and param_server.py, with default and help) is exactly what
`python -m tools.flags_page` generates from the code, and every help states its default."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_flags_page_is_up_to_date():
  r = subprocess.run([sys.executable, "-m", "tools.flags_page", "--check"], cwd=ROOT, capture_output=True, text=True,
                     timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  with open(os.path.join(ROOT, "docs", "FLAGS.md")) as f:
    rows = [line for line in f if line.startswith("| `--")]
  assert len(rows) > 90
  # A per-role default (e.g. --max_new_tokens: 8 for train.py, 16 for rollout.py) is in the default column.
  assert not [r for r in rows if "efault" not in r and "Required" not in r and "(train.py)" not in r]
