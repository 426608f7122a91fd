"""Attention micro-benchmark on the current backend: the jnp reference, and the Pallas kernels (on TPU natively,
elsewhere in interpret mode at tiny shapes: not a performance figure).

Run from the repo root: python -m bench.kernels
"""
import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from bench.util import best_time
from pallas_kernels import attention, decode_attention


def _time(fn, *args):
  """Median wall time of a jitted call, after one compile + warm-up call."""
  return best_time(jax.jit(fn), args, 5)[1]


def _measured_roofline(dtype):
  """Peak FLOP/s from a square matmul and bandwidth from an elementwise pass, measured now on this backend."""
  on_tpu = jax.default_backend() == "tpu"
  n = 8192 if on_tpu else 1024
  a = jnp.ones((n, n), dtype)
  flops = 2 * n ** 3 / _time(lambda a: a @ a, a)
  x = jnp.ones((256 if on_tpu else 16) * 2 ** 20, dtype)
  bw = 2 * x.nbytes / _time(lambda x: x + 1, x)  # read + write
  return flops, bw


def _report(name, seconds, flops, nbytes, peak_flops, peak_bw):
  print(f"  {name:<52s} {seconds * 1e3:9.3f} ms {flops / seconds / 1e9:9.3f} GFLOP/s ({flops / seconds / peak_flops:6.1%})"
        f" {nbytes / seconds / 1e9:8.3f} GB/s ({nbytes / seconds / peak_bw:6.1%})")


def _bench_cases(impl, dtype, B, T, N, K, H, S_cache, peak_flops, peak_bw, label):
  kq, kk, kl = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(kq, (B, T, N, H), dtype)
  k = jax.random.normal(kk, (B, T, K, H), dtype)
  item = jnp.dtype(dtype).itemsize
  # Useful FLOPs: causal attention is half of the 4*B*T*S*N*H of the full score matrix; backward = 2x forward.
  fwd_flops = 4 * B * T * T * N * H * 0.5
  qkvo_bytes = (2 * q.size + 2 * k.size) * item
  fwd = lambda q, k: attention(q, k, k, causal=True, impl=impl)
  _report(f"{label} attention fwd  B={B} T=S={T} N={N} K={K} H={H}", _time(fwd, q, k), fwd_flops, qkvo_bytes,
          peak_flops, peak_bw)
  grad = jax.grad(lambda q, k: jnp.sum(fwd(q, k).astype(jnp.float32)), argnums=(0, 1))
  _report(f"{label} attention fwd+bwd", _time(grad, q, k), 3 * fwd_flops, 3 * qkvo_bytes, peak_flops, peak_bw)
  # Ragged decode: lengths uniform in [1, S]; traffic counted for the valid cache rows only. The cache layout is
  # model.py's: keys [B,K,H,S], values [B,K,S,H] (here the same numbers, transposed).
  v_cache = jax.random.normal(kk, (B, K, S_cache, H), dtype)
  k_cache = v_cache.swapaxes(2, 3)
  lengths = jax.random.randint(kl, (B,), 1, S_cache + 1)
  total = int(lengths.sum())
  dec = lambda q, kc, vc, lengths: decode_attention(q, kc, vc, lengths, impl=impl)
  _report(f"{label} decode B={B} S={S_cache} sum(len)={total}", _time(dec, q[:, 0], k_cache, v_cache, lengths),
          4 * total * N * H, (2 * total * K * H + 2 * B * N * H) * item, peak_flops, peak_bw)


def _benchmark():
  backend = jax.default_backend()
  on_tpu = backend == "tpu"
  dtype = jnp.bfloat16 if on_tpu else jnp.float32
  peak_flops, peak_bw = _measured_roofline(dtype)
  print(f"backend={backend} device={jax.devices()[0].device_kind} dtype={jnp.dtype(dtype).name}")
  print(f"measured roofline: matmul {peak_flops / 1e9:.1f} GFLOP/s, elementwise copy {peak_bw / 1e9:.2f} GB/s")
  print("  (per call; % = fraction of the measured roofline; FLOPs are useful causal FLOPs, bytes the minimum "
        "HBM traffic)")
  if on_tpu:
    _bench_cases("pallas", dtype, 8, 2048, 16, 4, 128, 4096, peak_flops, peak_bw, "pallas")
    _bench_cases("ref", dtype, 8, 2048, 16, 4, 128, 4096, peak_flops, peak_bw, "ref   ")
  else:
    _bench_cases("ref", dtype, 2, 512, 8, 2, 64, 2048, peak_flops, peak_bw, "ref")
    print(f"Pallas TPU kernels do not run natively on {backend}; below they run in TPU interpret mode (a "
          "simulator), tiny shapes, NOT a performance figure:")
    with pltpu.force_tpu_interpret_mode():
      _bench_cases("pallas", dtype, 1, 64, 2, 1, 32, 64, peak_flops, peak_bw, "interpret")
    print("To measure the kernels' speed, run on one TPU VM (any v4/v5e/v5p/v6e host, the repo copied there and\n"
          "`bash launch.sh host_setup` done):  ~/rl/.venv/bin/python -m bench.kernels\n"
          "It prints the Pallas kernels beside the jnp reference at B=8 T=S=2048 N=16 K=4 H=128 in bf16, each as a\n"
          "fraction of the matmul and bandwidth roofline measured in the same run. That they lower for TPU at real\n"
          "model shapes is checked here, on CPU: tests/test_kernels.py::test_kernels_lower_for_tpu_at_real_model_shapes.")


if __name__ == "__main__":
  _benchmark()
