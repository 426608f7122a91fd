"""Test setup: 8 fake CPU devices so sharding is tested without accelerators.

XLA_FLAGS must be set before jax is imported anywhere, hence at conftest import time.
"""
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import hostmem  # noqa: E402  (the path above first)

hostmem.tune()  # as train.py and rollout.py do, before any JAX computation
