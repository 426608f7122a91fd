"""Bitwise on-policy alignment (issue 16 item 4): the worker's behaviour log-probs (rollout.Engine: prefill + KV-cache
decode, rollout.sampling_logprobs) equal the trainer's recomputation (train.rl_batch + forward over the padded
[B,T] batch + losses.token_logprobs_and_entropy) EXACTLY, for the same weights, tokens and mesh, in fp32 and bf16.

Why it holds (see kernels.rowsum): every projection is a dot whose per-row result does not depend on the number of
rows (measured on XLA CPU), elementwise ops are per element, max is exact, and every sum over a row (softmax in
attention, RMSNorm, log-softmax over the vocab) is a batch-invariant pairwise tree that also ignores trailing zeros
(masked keys / a longer cache), and the worker's log-softmax is the trainer's formula.
"""
import jax.numpy as jnp
import numpy as np
import pytest

import bench_alignment as ba
import model
import rollout

CFG = ba.tiny_config()
N_PROMPTS, G, M = 4, 2, 8


@pytest.fixture(scope="module")
def params():
  return ba.random_params(CFG, 0, init_std=0.1)


@pytest.fixture(scope="module")
def items():
  return ba.make_items(N_PROMPTS, CFG.vocab_size, seed=0)


def _max_mismatch(params, items, dtype, mesh, T=1.0):
  sc = rollout.SamplingConfig(T, 0, 1.0, M, ())
  mesh = mesh and model.make_mesh(*mesh)
  groups = ba.worker_rollouts(CFG, params, items, group_size=G, sc=sc, dtype=dtype, mesh=mesh)
  lt, li, mask, m = ba.trainer_logprobs(CFG, params, groups, dtype=dtype, mesh=mesh, temperature=T, max_new_tokens=M)
  s = ba.mismatch_stats(lt, li, mask)
  assert s["n_tokens"] == N_PROMPTS * G * M
  return s, m


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mesh", [None, (1, 1, 2)], ids=["1dev", "1x1x2"])
def test_worker_and_trainer_logprobs_bitwise_equal(params, items, dtype, mesh):
  s, m = _max_mismatch(params, items, jnp.dtype(dtype), mesh)
  assert s["max"] == 0.0 and s["k3"] == 0.0, s
  assert m["mismatch_max"] == 0.0, m  # train.rl_loss's own per-step metric sees it too


def test_ynn_flag_is_set():
  # model.py asks XLA CPU to keep only individual dots on YNNPACK; without it the fp32/bf16 rows above differ.
  import os
  assert "xla_cpu_experimental_ynn_fusion_type=individual_dot" in os.environ["XLA_FLAGS"]


def test_bitwise_equal_at_temperature(params, items):
  s, _ = _max_mismatch(params, items, jnp.float32, None, T=0.7)
  assert s["max"] == 0.0, s
