"""Benchmark: achieved FLOP/s of train.py's RL training step against this machine's measured matmul peak.

What is measured, in one run:
  peak   the best of --matmul_reps timings of a jitted fp32 [n,n] x [n,n] jnp matmul (2 n^3 FLOPs), warmed up
         first, taken before and again after the training steps (best of both, as the load on a shared box
         moves): the ceiling XLA's CPU backend reaches on this box.  Also timed: the model's largest matmul
         shape ([B*T,D] x [D,F], the MLP up-projection) as the ceiling for matmuls of this size.
  step   train.make_train_step(train.make_optimizer(...), train.rl_loss, grad_accum=1) jitted with donated
         params/optimizer state exactly as train.run_rl builds it, in --param_dtype (fp32 by default), on one
         device, losses.ALGORITHMS [--algo] (GRPO by default; --kl_coef > 0 adds the frozen reference forward, as
         the trainer does) on a synthetic batch from train.rl_batch: B/G groups of G completions, prompts of T/2
         and completions of T/2 random tokens, so every row is exactly T tokens (no padding).  Compile is
         excluded (one warm-up step, reported as compile_s); best and median of --steps steps, each ended by a
         host sync on its outputs.
Model FLOPs per step (the MFU convention of PaLM, arXiv 2204.02311, App. B: matmuls only, no recompute):
  sequence forward   f = 2 * (L * (D*N*H + 2*D*K*H + N*H*D + 3*D*F) + D*V) * T + 4 * L * N*H * P
                     (QKV/O and SwiGLU projections, the lm head, and QK^T plus PV over the P (query, key) pairs
                     the jnp attention computes on CPU: masked query blocks that skip the keys above the
                     diagonal, pallas_kernels.flash.causal_blocks; P = 3/4 T^2 at T=128, T^2 below 128)
  step               B * (3 * f  [forward + 2x backward]  + f if kl_coef > 0  [reference forward])
achieved FLOP/s = model FLOPs / best step time; fraction = achieved / measured peak.  Also tokens/s (B*T / s).
  torch  the same step in PyTorch eager (torch_reference: transformers' Qwen2 on the same weights, reference
         forward, PPO-clip + k3 KL, seq-mean-token-mean, clip 1.0, AdamW) at each --torch_threads count, timed
         after ours; speed_vs_torch = its best time / ours (> 1: ours faster). Needs requirements-dev.txt.
  faults minor page faults per timed step, each side. The process runs with common.tune_malloc() as train.py does
         (--host_malloc=default: glibc's own settings, for both sides; the A/B of common.tune_malloc).

Run from the repo root:
  python -m bench.train_step                             # defaults: D=256, L=4, V=2048, B=16, T=128
  python -m bench.train_step --batch=32 --seq_len=256 --json=train.json
  python -m bench.train_step --host_malloc=default       # the same without common.tune_malloc() (its A/B)
  python -m bench.train_step --quick                     # tiny smoke run (tests/test_bench.py)
  python -m bench.train_step --d_model=512 --n_layers=8 --vocab=32000 --batch=2 --group_size=2 \
      --memory_seq_lens=1024,4096,8192                   # memory per token: plain / --remat / --logprob_chunk
"""
import argparse
import dataclasses
import json
import math
import os
import resource
import statistics
import sys
import time

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np

import common
import data
import losses
import model
import train
from bench.util import QUICK_SHAPE, add_shape_flags, matmul_flops_per_s, random_params
from pallas_kernels.flash import causal_blocks


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--matmul_n", type=int, default=2048, help="peak matmul size n (units) of [n,n] x [n,n] fp32")
  p.add_argument("--matmul_reps", type=int, default=5, help="timed peak matmuls, best is kept (count)")
  add_shape_flags(p, dict(d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, ffw_dim=1024, vocab=2048))
  p.add_argument("--batch", type=int, default=16, help="sequences per step B (sequences)")
  p.add_argument("--seq_len", type=int, default=128, help="tokens per sequence T (tokens; half prompt, half "
                 "completion)")
  p.add_argument("--group_size", type=int, default=4, help="completions per prompt G (sequences; divides B)")
  p.add_argument("--algo", default="grpo", help=f"loss preset, one of {sorted(losses.ALGORITHMS)} (name)")
  p.add_argument("--kl_coef", type=float, default=None, help="override the preset's KL coefficient (float; "
                 "default: the preset's, 0.04 for grpo); > 0 adds a reference forward to each step")
  p.add_argument("--steps", type=int, default=5, help="timed training steps after the warm-up (count)")
  p.add_argument("--seed", type=int, default=0, help="seed for weights and data (int)")
  p.add_argument("--json", default=None, help="write the results as JSON to this path (file)")
  p.add_argument("--memory_seq_lens", default="", help="comma list of sequence lengths T (tokens): instead of "
                 "timing, print the compiled step's temporary memory per token (XLA buffer assignment) plain, "
                 "with --remat, with --logprob_chunk, and both, then exit; '' = time the step")
  p.add_argument("--logprob_chunk", type=int, default=512, help="chunk (positions) for the memory table's "
                 "chunked log-prob rows")
  p.add_argument("--torch_threads", default=None, help="comma-separated torch thread counts to time the "
                 "PyTorch reference step at (threads); default 1 and os.cpu_count(); 0 = skip the reference")
  p.add_argument("--host_malloc", default="tuned", choices=("tuned", "default"), help="glibc malloc of this "
                 "process (both sides): tuned = common.tune_malloc() as train.py runs, default = glibc's (A/B); "
                 "--quick keeps glibc's: it runs inside pytest, whose process stays untuned (tests/conftest.py)")
  p.add_argument("--param_dtype", default="float32", choices=("float32", "bfloat16"), help="compute dtype of the "
                 "step (train.py's --param_dtype; master weights stay fp32)")
  p.add_argument("--quick", action="store_true", help="tiny shapes, 2 steps, kl_coef 0 unless "
                 "--kl_coef, torch at 1 thread unless --torch_threads; for tests (overrides the shape flags)")
  a = p.parse_args(argv)
  if a.quick:
    a.matmul_n, a.matmul_reps, a.steps, a.host_malloc = 256, 2, 2, "default"
    vars(a).update(QUICK_SHAPE)
    a.batch, a.seq_len, a.group_size = 4, 32, 2
    a.kl_coef = 0.0 if a.kl_coef is None else a.kl_coef  # no reference forward: a third less to compile
    a.torch_threads = a.torch_threads or "1"
  try:
    a.torch_threads = sorted({int(t) for t in (a.torch_threads or f"1,{os.cpu_count()}").split(",")} - {0})
  except ValueError:
    p.error(f"--torch_threads must be comma-separated ints, got {a.torch_threads!r}")
  for f in ("matmul_n", "matmul_reps", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffw_dim", "vocab",
            "batch", "group_size", "steps"):
    if getattr(a, f) < 1:
      p.error(f"--{f} must be >= 1, got {getattr(a, f)}")
  if a.seq_len < 2 or a.seq_len % 2:
    p.error(f"--seq_len must be even and >= 2 (half prompt, half completion), got {a.seq_len}")
  if a.batch % a.group_size:
    p.error(f"--group_size={a.group_size} must divide --batch={a.batch}")
  if a.d_model % a.n_heads or (a.d_model // a.n_heads) % 2:
    p.error(f"--d_model={a.d_model} must split into --n_heads={a.n_heads} heads of even size")
  if a.algo not in losses.ALGORITHMS:
    p.error(f"--algo={a.algo!r} is not one of {sorted(losses.ALGORITHMS)}")
  if losses.ALGORITHMS[a.algo].advantage == "gae":
    p.error(f"--algo={a.algo}: the value-head (GAE) path is not benchmarked; pick a group-advantage algorithm")
  return a


def forward_flops_per_sequence(cfg, T):
  """Matmul FLOPs of one T-token sequence's forward (see the module docstring)."""
  D, N, K, H, F, L = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffw_dim, cfg.n_layers
  proj = L * (D * N * H + 2 * D * K * H + N * H * D + 3 * D * F) + D * cfg.vocab_size
  scores = sum((b - a) * b for a, b in causal_blocks(T))  # (query, key) pairs the reference computes
  return 2 * proj * T + 4 * L * N * H * scores


def jaxpr_matmul_flops(jaxpr):
  """2 * M*N*K summed over every dot_general in a (Closed)Jaxpr, scan bodies times their length, cond
  branches at their largest: an independent count of the program actually traced (XLA's cost_analysis
  counts a scan body once, so it cannot check an L-layer scan)."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  total = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      (contract, _), _ = eqn.params["dimension_numbers"]
      lhs = eqn.invars[0].aval.shape
      total += 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in contract)
    subs = [jaxpr_matmul_flops(j) for j in jax.extend.core.jaxprs_in_params(eqn.params)]
    if subs:
      inner = max(subs) if eqn.primitive.name == "cond" else sum(subs)
      total += inner * (eqn.params["length"] if eqn.primitive.name == "scan" else 1)
  return total


def synthetic_groups(a, rng):
  """B/G rollout groups in the shape rollout.py sends: prompt T/2 tokens, G completions of T/2 tokens each."""
  half, V = a.seq_len // 2, a.vocab
  groups = []
  for _ in range(a.batch // a.group_size):
    rewards = rng.integers(0, 2, a.group_size).astype(np.float32)
    rewards[0] = 1.0 - rewards[-1]  # non-zero group variance, so GRPO advantages are not all zero
    groups.append(data.Rollout(
        id=f"s{len(groups)}", version=0, worker="bench", problem=data.Problem(f"p{len(groups)}", "", ""),
        prompt_tokens=rng.integers(0, V, half).astype(np.int32),
        completions=[rng.integers(0, V, half).astype(np.int32) for _ in range(a.group_size)],
        # Near-uniform random-init policy: behaviour log-probs of about -log V keep the PPO ratio near 1.
        logprobs=[(-np.log(V) + 0.01 * rng.standard_normal(half)).astype(np.float32)
                  for _ in range(a.group_size)],
        rewards=rewards))
  return groups


def torch_reference(cfg, policy, batch, lcfg, threads, steps):
  """The same step in PyTorch eager, the reference issue 17 measures against: transformers' Qwen2 model on the
  same weights (written with model.save_hf_checkpoint), the frozen reference forward under no_grad when
  kl_coef > 0, the policy forward, decoupled PPO-clip loss (behaviour weight capped at tis_cap) with k3 KL in the
  loss, seq-mean-token-mean, entropy as a metric (no grad), backward, global-norm clip 1.0, AdamW. Returns ({threads: (best s, median s)} over `steps`
  steps after one warm-up step at each thread count, the loss of the very first step: at the initial weights,
  so it must equal ours there)."""
  import tempfile
  import torch
  import transformers
  transformers.utils.logging.disable_progress_bar()
  with tempfile.TemporaryDirectory() as d:
    model.save_hf_checkpoint(d, cfg, policy)
    load = lambda: transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)  # noqa: E731
    pol = load().train()
    ref = load().eval() if lcfg.kl_coef > 0 else None
  opt = torch.optim.AdamW(pol.parameters(), lr=1e-4, weight_decay=0.0)
  t = {k: torch.from_numpy(np.array(v)) for k, v in batch.items()}  # a writable host copy
  tokens, targets, mask = t["tokens"].long(), t["targets"].long(), t["loss_mask"]
  blp, adv = t["behaviour_logp"], t["advantages"][:, None]

  def logps(m):
    lsm = torch.log_softmax(m(input_ids=tokens).logits.float(), -1)
    return lsm.gather(-1, targets[..., None])[..., 0], lsm

  def step():
    if ref is not None:
      with torch.no_grad():
        ref_lp = logps(ref)[0]
    lp, lsm = logps(pol)
    with torch.no_grad():
      entropy = (-(lsm.exp() * lsm).sum(-1) * mask).sum() / mask.sum()
    prox = lp.detach()  # decoupled PPO, one update per batch: the clip on pi / pi_prox, the weight pi_prox / mu
    ratio, w = torch.exp(lp - prox), torch.exp(prox - blp).clamp(max=lcfg.tis_cap)
    tok_loss = -w * torch.minimum(ratio * adv, ratio.clamp(1 - lcfg.eps_low, 1 + lcfg.eps_high) * adv)
    if ref is not None:
      d = ref_lp - lp
      tok_loss = tok_loss + lcfg.kl_coef * (torch.exp(d) - d - 1)
    loss = ((tok_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(pol.parameters(), 1.0)
    opt.step()
    return loss.item(), entropy.item()

  out, first_loss = {}, None
  for th in threads:
    torch.set_num_threads(th)
    loss = step()[0]  # warm-up: allocator, kernels
    first_loss = loss if first_loss is None else first_loss
    ts, f0 = [], minor_faults()
    for _ in range(steps):
      t0 = time.perf_counter()
      step()
      ts.append(time.perf_counter() - t0)
    out[th] = (min(ts), statistics.median(ts), (minor_faults() - f0) / steps)
  return out, first_loss


def memory_table(a, cfg, lcfg, optimizer, params, opt_state, ref_params, n_params):
  """Temporary bytes per token of the compiled RL step (XLA's buffer assignment on this backend: activations,
  logits, gradients in flight; params and optimizer state are arguments, not temporaries) for each T, with and
  without remat and chunked log-probs. Compile only: nothing runs, so 8k-32k fit on a small box."""
  rows = []
  print(f"model D={cfg.d_model} L={cfg.n_layers} V={cfg.vocab_size} ({n_params / 1e6:.1f} M params), batch "
        f"{a.batch} x T, {a.algo} kl_coef={lcfg.kl_coef}; MiB of temporaries per token of the compiled step")
  print(f"{'T':>6} {'plain':>9} {'remat':>9} {'chunk ' + str(a.logprob_chunk):>11} {'both':>9}  plain/both")
  for T in (int(x) for x in a.memory_seq_lens.split(",")):
    batch = {k: jax.ShapeDtypeStruct((a.batch,) if k == "advantages" else (a.batch, T), dt)
             for k, dt in train.BATCH_KEYS.items()}
    per = []
    for remat, chunk in ((False, 0), (True, 0), (False, a.logprob_chunk), (True, a.logprob_chunk)):
      fn = lambda p, r, b, remat=remat, chunk=chunk: train.rl_loss(  # noqa: E731
          p, r, b, cfg=cfg, lcfg=lcfg, temperature=1.0, compute_dtype=jnp.float32, attn_impl="auto",
          value_coef=0.5, remat=remat, logprob_chunk=chunk)
      step = jax.jit(train.make_train_step(optimizer, fn, 1, lcfg.agg), donate_argnums=(0, 1))
      mem = step.lower(params, opt_state, ref_params, batch).compile().memory_analysis()
      per.append(mem.temp_size_in_bytes / (a.batch * T))
    rows.append(dict(seq_len=T, temp_bytes_per_token=dict(zip(("plain", "remat", "chunk", "both"), per))))
    print(f"{T:>6} " + " ".join(f"{x / 2**20:>9.3f}" for x in per[:2]) + f" {per[2] / 2**20:>11.3f} "
          f"{per[3] / 2**20:>9.3f}  {per[0] / per[3]:.1f}x")
  if a.json:
    with open(a.json, "w") as f:
      json.dump(rows, f, indent=1)
  return rows


def minor_faults():
  """Minor page faults of this process so far (first touches of fresh pages; see common.tune_malloc)."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  a = parse_args(argv)
  tuned = a.host_malloc == "tuned" and common.tune_malloc()  # before the first JAX computation, as train.main
  rng = np.random.default_rng(a.seed)
  peak = matmul_flops_per_s(a.matmul_n, a.matmul_n, a.matmul_n, a.matmul_reps, a.seed)

  cfg = model.Config(vocab_size=a.vocab, d_model=a.d_model, n_layers=a.n_layers, n_heads=a.n_heads,
                     n_kv_heads=a.n_kv_heads, head_dim=a.d_model // a.n_heads, ffw_dim=a.ffw_dim,
                     tie_embeddings=True, qkv_bias=True, arch="Qwen2ForCausalLM")
  B, T = a.batch, a.seq_len
  shape_peak = matmul_flops_per_s(B * T, cfg.d_model, cfg.ffw_dim, a.matmul_reps, a.seed)
  base = losses.ALGORITHMS[a.algo]
  lcfg = base if a.kl_coef is None else dataclasses.replace(base, kl_coef=a.kl_coef)
  policy = random_params(cfg, a.seed)
  policy_host = jax.device_get(policy)  # the PyTorch reference starts from these (ours are donated)
  n_params = sum(x.size for x in jax.tree.leaves(policy))
  params = dict(policy=policy, value=None)
  optimizer = train.make_optimizer(1e-4, 5, 100, 0.0, 1.0)
  # As in train.run_rl: copies make donation safe where optax shares buffers between state leaves.
  # Setup under jit: eagerly, every small op would compile on its own (seconds in all on a busy box).
  opt_state = jax.jit(lambda p: jax.tree.map(jnp.copy, optimizer.init(p)))(params)
  # The frozen reference in the compute dtype, as train.init_learner keeps it.
  ref_params = (jax.jit(lambda p: jax.tree.map(lambda x: jnp.array(x, a.param_dtype, copy=True), p))(policy)
                if lcfg.kl_coef > 0 else None)
  loss_fn = lambda p, r, b: train.rl_loss(p, r, b, cfg=cfg, lcfg=lcfg, temperature=1.0,  # noqa: E731
                                          compute_dtype=jnp.dtype(a.param_dtype), attn_impl="auto",
                                          value_coef=0.5)
  step = jax.jit(train.make_train_step(optimizer, loss_fn, 1, lcfg.agg), donate_argnums=(0, 1))
  batch, _, _ = train.rl_batch(synthetic_groups(a, rng), lcfg, 0, (T,), T // 2)
  assert batch["tokens"].shape == (B, T), batch["tokens"].shape
  batch = jax.tree.map(jnp.asarray, batch)

  if a.memory_seq_lens:
    return memory_table(a, cfg, lcfg, optimizer, params, opt_state, ref_params, n_params)

  t = time.perf_counter()
  params, opt_state, m = step(params, opt_state, ref_params, batch)
  jax.block_until_ready((params, m))
  compile_s = time.perf_counter() - t
  first_loss = float(m["loss"])  # at the initial weights: the PyTorch reference's first step must agree
  times, f0 = [], minor_faults()
  for _ in range(a.steps):
    t = time.perf_counter()
    params, opt_state, m = step(params, opt_state, ref_params, batch)
    jax.block_until_ready((params, m))  # the host sync the trainer does when it reads the metrics
    times.append(time.perf_counter() - t)
  faults = (minor_faults() - f0) / a.steps
  # The load on a shared box moves during the run: time the peak again after the steps and keep the best.
  peak_after = matmul_flops_per_s(a.matmul_n, a.matmul_n, a.matmul_n, a.matmul_reps, a.seed)
  peak_before, peak = peak, max(peak, peak_after)
  loss = float(m["loss"])
  if not np.isfinite(loss):
    raise RuntimeError(f"training step produced a non-finite loss {loss}")

  step_flops = B * forward_flops_per_sequence(cfg, T) * (3 + (lcfg.kl_coef > 0))
  # Cross-check of the formula against the traced step (tracing only, no compile).
  traced = jaxpr_matmul_flops(jax.make_jaxpr(train.make_train_step(optimizer, loss_fn, 1, lcfg.agg))(
      params, opt_state, ref_params, batch))
  best, med = min(times), statistics.median(times)
  res = dict(
      config=dict(d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
                  ffw_dim=cfg.ffw_dim, vocab=cfg.vocab_size, n_params=int(n_params), batch=B, seq_len=T,
                  group_size=a.group_size, algo=a.algo, kl_coef=lcfg.kl_coef, steps=a.steps,
                  matmul_n=a.matmul_n, cores=os.cpu_count(), loadavg_1m=os.getloadavg()[0],
                  param_dtype=a.param_dtype, host_malloc="tuned" if tuned else "default"),
      peak_matmul_flops_per_s=peak, peak_matmul_flops_per_s_before=peak_before,
      peak_matmul_flops_per_s_after=peak_after, model_shape_matmul_flops_per_s=shape_peak,
      step_flops=step_flops, traced_matmul_flops=traced, step_s_best=best, step_s_median=med, compile_s=compile_s,
      achieved_flops_per_s=step_flops / best, achieved_flops_per_s_median=step_flops / med,
      fraction_of_peak=step_flops / best / peak, fraction_of_model_shape_matmul=step_flops / best / shape_peak,
      tokens_per_s=B * T / best, completion_tokens_per_s=float(batch["loss_mask"].sum()) / best, loss=loss,
      minor_faults_per_step=faults)

  print(f"model D={cfg.d_model} L={cfg.n_layers} N={cfg.n_heads} K={cfg.n_kv_heads} F={cfg.ffw_dim} "
        f"V={cfg.vocab_size} ({n_params / 1e6:.2f} M params, {a.param_dtype} compute, tied embeddings); "
        f"batch {B}x{T} tokens; "
        f"{a.algo} kl_coef={lcfg.kl_coef}; cores={os.cpu_count()} (jax {jax.__version__})")
  print(f"peak matmul fp32 {a.matmul_n}^3: {peak / 1e9:8.2f} GFLOP/s (best of before/after the steps: "
        f"{peak_before / 1e9:.2f}, {peak_after / 1e9:.2f})   model-shape matmul "
        f"[{B * T},{cfg.d_model}]x[{cfg.d_model},{cfg.ffw_dim}]: {shape_peak / 1e9:.2f} GFLOP/s")
  print(f"train step: {step_flops / 1e9:.3f} GFLOP model FLOPs (traced program's matmuls: "
        f"{traced / 1e9:.3f} GFLOP), best {best * 1e3:.1f} ms, median "
        f"{med * 1e3:.1f} ms, compile {compile_s:.1f} s (excluded); {faults:.0f} minor page faults per step "
        f"(host malloc {res['config']['host_malloc']})")
  print(f"achieved {res['achieved_flops_per_s'] / 1e9:8.2f} GFLOP/s = {res['fraction_of_peak']:.1%} of measured "
        f"peak ({res['fraction_of_model_shape_matmul']:.1%} of the model-shape matmul); "
        f"{res['tokens_per_s']:.0f} tokens/s ({res['completion_tokens_per_s']:.0f} completion tokens/s); "
        f"load avg (1 min) {res['config']['loadavg_1m']:.2f}")
  if a.torch_threads:
    ref, torch_first = torch_reference(cfg, policy_host, batch, lcfg, a.torch_threads, a.steps)
    th = min(ref, key=lambda k: ref[k][0])
    res["torch"] = dict(by_threads={str(k): dict(step_s_best=b, step_s_median=m, minor_faults_per_step=f)
                                    for k, (b, m, f) in ref.items()},
                        threads=th, step_s_best=ref[th][0], step_s_median=ref[th][1], first_loss=torch_first)
    res["first_loss"] = first_loss
    res["speed_vs_torch"] = ref[th][0] / best  # > 1: ours is faster
    for k, (b, m, f) in ref.items():
      print(f"pytorch eager reference @{k} thread(s): best {b * 1e3:.1f} ms, median {m * 1e3:.1f} ms; "
            f"{f:.0f} minor page faults per step")
    print(f"same step: first-step loss ours {first_loss:.6f}, pytorch {torch_first:.6f}")
    print(f"speed ours vs pytorch (best vs its best, @{th} thread(s)): {res['speed_vs_torch']:.2f}x "
          f"(ours best {best * 1e3:.1f} ms, median {med * 1e3:.1f} ms)")
  if a.json:
    with open(a.json, "w") as f:
      json.dump(res, f, indent=1)
  return res


if __name__ == "__main__":
  main(sys.argv[1:])
