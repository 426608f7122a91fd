"""glibc malloc settings for a process that runs XLA on the host CPU: keep freed buffers for the next step.

Why: XLA's CPU runtime allocates each execution's temporaries and outputs from its own worker threads. glibc gives
those threads arenas of their own whose large blocks are mmap'd and handed back to the kernel when freed, so every
step touches its working set as fresh pages again. bench_train.py measured 95k minor page faults and 0.18 s of
kernel time per training step (D256 L4, 16x128 tokens, ~370 MB of pages) on the 2-core box, about 15% of its CPU.
tune() makes every thread allocate from the main heap (one arena), never mmap a block, and trim the heap only
when more than 2 GB sit free at its top, so a freed step's buffers are reused as they are: ~0 faults per step
once the heap has settled (a few steps) and the step 12-15% faster (RESULTS.md; `python bench_train.py
--host_malloc=default` is the other side). The same settings also cut the PyTorch reference's faults in that
bench (13-28k per step to ~0), so it runs under them too.

Cost: memory a step freed stays with the process (its peak resident set is kept) instead of returning to the OS,
which is what a trainer or worker that repeats the same step wants. A no-op where libc has no mallopt (macOS, musl).

Call tune() first thing in a process's main, before its first JAX computation: glibc fixes the arena limit when a
thread first needs an arena, so threads started earlier (XLA's pool starts with the backend) keep their own.
  import hostmem; hostmem.tune()      # train.py, rollout.py, bench_train.py and bench_decode.py as scripts

Not in the pytest process: with one arena, tests/test_kernels.py's sharded Pallas attention, which runs the TPU
interpreter on 8 fake CPU devices, hangs inside XLA's CPU runtime (every thread idle, the main one waiting on the
executable's semaphore: 3 of 3 runs, 0 of 3 without; MALLOC_ARENA_MAX=1 alone does it). The sharded training
and decode tests and the multi-process system tests, whose train.py and rollout.py processes call tune(), pass
with it; the interpreter is a test-only path.
"""
import ctypes
import ctypes.util

# mallopt parameter numbers from glibc's <malloc.h>.
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
_TRIM_BYTES = 2**31 - 1  # mallopt takes an int: trim only when ~2 GB are free at the heap's top


def tune():
  """Apply the settings above; returns True where they took effect (glibc), False elsewhere."""
  try:
    mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
  except (OSError, AttributeError):
    return False
  mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
  # mallopt returns 1 on success; all three or the reuse does not happen (a second arena still mmaps its heaps).
  return all(mallopt(p, v) == 1 for p, v in ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _TRIM_BYTES)))
