"""Test setup: 8 fake CPU devices so sharding is tested without accelerators.

XLA_FLAGS must be set before jax is imported anywhere, hence at conftest import time.
"""
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# No common.tune_malloc() in this process (train.py and rollout.py call it; the processes the system tests start do):
# with one malloc arena the Pallas TPU interpreter's 8-device run in tests/test_kernels.py deadlocks (hostmem.py).

import jax  # noqa: E402  (after XLA_FLAGS)
import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _no_mesh_leaks():
  """Tests that run the trainer or worker in-process call jax.set_mesh as those scripts do (a global, thread-local
  setting); reset it after each test so a later test's eager model call does not see another test's mesh."""
  yield
  jax.set_mesh(None)
