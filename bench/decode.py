"""Benchmark: decode tokens/s of rollout.Engine against Hugging Face `transformers` generate, same run, on CPU.

What is measured (both sides on one checkpoint directory, the same B prompts of P random tokens, N new tokens
per prompt, greedy, no early stop):
  ours  rollout.Engine(cfg, SamplingConfig(temperature=0, max_new_tokens=N, stop_ids=()), slots=B, max_prompt_len=P,
        chunk_steps=C): one insert of the B prompts (a batched prefill, as the worker does with the prompts it
        leases together) then run_chunk until no slot is active (one host sync per chunk).  Compile time is excluded
        by a full warm-up pass with the same shapes (its time: compile_s). stop_ids=() so every slot makes exactly N
        tokens; when C does not divide N the last chunk's extra steps are paid for (the engine's real cost).
  hf    AutoModelForCausalLM.from_pretrained(dir, dtype=float32).generate(input_ids [B,P], max_new_tokens=N,
        min_new_tokens=N, do_sample=False, use_cache=True) in torch fp32 on CPU, timed at each
        torch.set_num_threads(t) for t in --hf_threads (default 1 and the core count; XLA's CPU backend uses
        one thread per core), and compared at its faster setting: on a loaded box torch's OpenMP threads
        spin-wait on each other and 2 threads can be ~10x slower per small matmul than 1.  Its prefill is timed
        as generate with max_new_tokens=1; its decode time is the difference.
Reported per side: prefill s, decode s, end-to-end s and tokens/s = B*N / time (decode-only tokens/s uses the
tokens made after the prefill: B*N for ours, B*(N-1) for hf, whose first token comes out of the prefill),
best and median over --reps rounds that alternate ours/hf so both see the same load; ratios ours/hf use the
best times.  `greedy_match` compares the two sides' [B,N] greedy tokens (fraction of equal tokens and whether
all are equal; where a row diverges, hf's logit gap between its token and ours there: near 0 is a near-tie that
rounding flips).  Without --checkpoint a random-init Qwen2-style checkpoint of the shape flags is written to a temp dir.

Needs torch and transformers (in requirements-dev.txt; the rest of the repo does not).

Run from the repo root:
  python -m bench.decode                                   # defaults: B=8, P=64, N=64, D=384, L=4, V=2048
  python -m bench.decode --checkpoint=runs/local/base --batch=16 --new_tokens=32 --json=decode.json
  python -m bench.decode --quick                           # tiny smoke run (tests/test_bench.py)
  python -m bench.decode --preset=all --hf_threads=1,2     # issue 17's three shapes (demo, big, long), a table

The floor (issue 41's yardstick): before hf first runs and after the timed rounds the script measures this
machine's read bandwidth (a sum over 256 MiB: numpy on 1 and on every core, jitted; the fastest) and its matmul
peak (2048^3, in --dtype), each kept at the faster of the two, and prints the floor of the whole generation, the
prefill plus every decode step, each max(matmul FLOPs / peak, bytes read / read bandwidth) (`floor`), beside ours
end to end (`x floor`) and per step.
"""
import argparse
import concurrent.futures
import json
import os
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import common
import model
import rollout
from bench.util import QUICK_SHAPE, add_shape_flags, best_time, matmul_flops_per_s, random_params


# --preset: the three shapes issue 17 measures (model and generation shape: a preset overrides those flags).
DEMO = dict(d_model=384, n_layers=4, n_heads=6, n_kv_heads=2, ffw_dim=1024, vocab=2048, batch=8, prompt_len=64,
            new_tokens=64)  # also the shape flags' defaults
PRESETS = dict(demo=DEMO, big=dict(d_model=512, n_layers=8, n_heads=8, n_kv_heads=2, ffw_dim=1536, vocab=32768,
                                   batch=64, prompt_len=64, new_tokens=128),
               long=dict(DEMO, prompt_len=512, new_tokens=512))


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--checkpoint", default=None, help="HF checkpoint dir to benchmark (dir); default: write a "
                 "random-init Qwen2-style one from the shape flags to a temp dir")
  add_shape_flags(p, DEMO, " of the generated checkpoint")
  p.add_argument("--batch", type=int, default=8, help="prompts decoded together B (sequences)")
  p.add_argument("--prompt_len", type=int, default=64, help="prompt length P (tokens, all prompts equal)")
  p.add_argument("--new_tokens", type=int, default=64, help="new tokens per prompt N (tokens, no early stop)")
  p.add_argument("--chunk_steps", type=int, default=8, help="Engine decode steps per host sync C (steps; "
                 "rollout.py's default)")
  p.add_argument("--hf_threads", default=None, help="comma-separated torch thread counts to time hf at "
                 "(threads); default 1 and os.cpu_count()")
  p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="our side's weights and KV "
                 "cache (a --param_dtype=bfloat16 worker's); hf stays fp32, so bf16 tokens may differ from its")
  p.add_argument("--reps", type=int, default=3, help="timed rounds per side, alternating (count)")
  p.add_argument("--seed", type=int, default=0, help="seed for weights and prompts (int)")
  p.add_argument("--json", default=None, help="write the results as JSON to this path (file)")
  p.add_argument("--quick", action="store_true", help="tiny shapes, 1 round, hf at 1 thread unless "
                 "--hf_threads; for tests (overrides the shape flags)")
  p.add_argument("--preset", choices=sorted(PRESETS) + ["all"], default=None, help="model + generation shape of "
                 f"issue 17 (overrides the shape, batch and length flags): {PRESETS}; all = the three in turn, "
                 "then a summary table")
  a = p.parse_args(argv)
  if a.preset in PRESETS:
    vars(a).update(PRESETS[a.preset])
  if a.quick:
    vars(a).update(QUICK_SHAPE)
    a.batch, a.prompt_len, a.new_tokens, a.chunk_steps, a.reps = 2, 8, 8, 4, 1
    a.hf_threads = a.hf_threads or "1"
  try:
    a.hf_threads = sorted({int(t) for t in (a.hf_threads or f"1,{os.cpu_count()}").split(",")})
  except ValueError:
    p.error(f"--hf_threads must be comma-separated ints, got {a.hf_threads!r}")
  if min(a.hf_threads) < 1:
    p.error(f"--hf_threads must be >= 1, got {a.hf_threads}")
  for f in ("d_model", "n_layers", "n_heads", "n_kv_heads", "ffw_dim", "vocab", "batch", "prompt_len",
            "new_tokens", "chunk_steps", "reps"):
    if getattr(a, f) < 1:
      p.error(f"--{f} must be >= 1, got {getattr(a, f)}")
  if a.d_model % a.n_heads or (a.d_model // a.n_heads) % 2:
    p.error(f"--d_model={a.d_model} must split into --n_heads={a.n_heads} heads of even size")
  return a


def make_checkpoint(a, path):
  """Random-init Qwen2-style model (QKV bias, tied embeddings) saved as an HF checkpoint dir; returns path."""
  cfg = model.Config(vocab_size=a.vocab, d_model=a.d_model, n_layers=a.n_layers, n_heads=a.n_heads,
                     n_kv_heads=a.n_kv_heads, head_dim=a.d_model // a.n_heads, ffw_dim=a.ffw_dim,
                     tie_embeddings=True, qkv_bias=True, arch="Qwen2ForCausalLM",
                     max_position_embeddings=max(512, a.prompt_len + a.new_tokens))
  model.save_hf_checkpoint(path, cfg, random_params(cfg, a.seed))
  return path


def read_bandwidth(nbytes=256 << 20, reps=5):
  """Best measured bytes/s of reading nbytes once: numpy sums on one thread and on one per core (each a share;
  numpy releases the GIL), and a jitted sum; the largest. The bound a decode step's weight and KV-cache reads meet:
  they are read, not copied (a copy's rate, read + write, made the floor too lenient)."""
  a = np.ones(nbytes // 4, np.float32)
  parts = np.array_split(a, os.cpu_count())
  with concurrent.futures.ThreadPoolExecutor(len(parts)) as pool:
    t_threads = best_time(lambda: list(pool.map(np.sum, parts)), (), reps)[0]
  t_np = best_time(np.sum, (a,), reps)[0]
  t_jax = best_time(jax.jit(jnp.sum), (jnp.asarray(a),), reps)[0]
  return nbytes / min(t_np, t_threads, t_jax)


def machine_rates(dt, seed):
  """(read bandwidth bytes/s, matmul peak FLOP/s in dtype dt) of this machine, measured now."""
  return read_bandwidth(), matmul_flops_per_s(2048, 2048, 2048, 5, seed, dt)


def floor(cfg, n_params, B, P, N, wbytes, bytes_per_s, flops_per_s):
  """This machine's floor for the whole generation: the prefill of B x P tokens plus the N - 1 decode steps after
  it (the prefill's logits give the first token), each max(matmul FLOPs / peak, bytes read / read bandwidth), the
  weights and K/V cache of wbytes bytes per element. FLOPs: 2 x weights per token (the lm head for the last
  prompt token only), attention 4 x L x N x H per (query, key) pair, causal. Bytes: every weight once (the input
  embedding is a gather of B rows, except where tied to the lm head) + each row's K/V up to its context.
  Returns (seconds in all, the steps' mean seconds, what binds the steps)."""
  L, emb = cfg.n_layers, cfg.vocab_size * cfg.d_model
  body = n_params - emb * (1 if cfg.tie_embeddings else 2)  # everything but the embedding and the lm head
  attn = 4 * L * cfg.n_heads * cfg.head_dim  # FLOPs per (query, key) pair
  kv = L * 2 * cfg.n_kv_heads * cfg.head_dim * wbytes  # cache bytes per token
  read = wbytes * (body + emb)
  pre = max((2 * body * P * B + 2 * emb * B + attn * B * P * (P + 1) / 2) / flops_per_s, read / bytes_per_s)
  steps = [((2 * (body + emb) * B + attn * B * c) / flops_per_s, (read + B * c * kv) / bytes_per_s)
           for c in range(P + 1, P + N)]
  total = pre + sum(max(s) for s in steps)
  binds = "matmul" if sum(s[0] > s[1] for s in steps) * 2 > len(steps) else "memory"
  return total, (total - pre) / max(len(steps), 1), binds


def run_ours(engine, params, prompts, dtype):
  """One full generation; returns (prefill s, decode s, tokens [B,N])."""
  B = len(prompts)
  engine.reset(dtype)
  jax.block_until_ready(engine.state)
  keys = np.zeros((1, 2), np.uint32)  # greedy: keys unused
  t0 = time.perf_counter()
  engine.insert(params, [([b], prompts[b], keys) for b in range(B)])  # one batched prefill, as the worker does
  jax.block_until_ready(engine.state)
  t1 = time.perf_counter()
  while engine.run_chunk(params).any():  # run_chunk's host sync ends each chunk
    pass
  toks, _, n, _ = engine.rows(list(range(B)))
  t2 = time.perf_counter()
  assert (n == engine.M).all(), n  # stop_ids=() so every slot generated exactly N tokens
  return t1 - t0, t2 - t1, toks


def hf_greedy(hf_model, torch, input_ids, n_new, **kw):
  """hf's greedy generate of exactly n_new tokens per row (no early stop)."""
  with torch.inference_mode():
    return hf_model.generate(input_ids, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False, use_cache=True,
                             attention_mask=torch.ones_like(input_ids), pad_token_id=0, **kw)


def run_hf(hf_model, torch, input_ids, n_new):
  """generate N tokens (prefill + N-1 decode forwards) and 1 token (prefill); returns (prefill s, total s, toks)."""
  t0 = time.perf_counter()
  hf_greedy(hf_model, torch, input_ids, 1)
  t1 = time.perf_counter()
  out = hf_greedy(hf_model, torch, input_ids, n_new)
  t2 = time.perf_counter()
  return t1 - t0, t2 - t1, out[:, input_ids.shape[1]:].numpy()


def near_ties(hf_model, torch, input_ids, n_new, ours, theirs):
  """At each row's first differing token: hf's logit of its own token minus its logit of ours (from an untimed
  generate with its scores). Near 0: a near-tie that float rounding flips (the rest of the row then follows its
  own prefix); large: a real difference."""
  rows = [b for b in range(len(ours)) if (ours[b] != theirs[b]).any()]
  if not rows:
    return []
  scores = hf_greedy(hf_model, torch, input_ids, n_new, output_scores=True, return_dict_in_generate=True).scores
  t = [int(np.argmax(ours[b] != theirs[b])) for b in rows]
  return [float(scores[i][b, theirs[b, i]] - scores[i][b, ours[b, i]]) for b, i in zip(rows, t)]


def side(rows, B, N, n_decoded):
  """Timing rows [(prefill s, decode s, ...)] -> summary dict (best = min time; tokens/s = B*N / time)."""
  pre, dec = [r[0] for r in rows], [r[1] for r in rows]
  tot = [p + d for p, d in zip(pre, dec)]
  return dict(prefill_s_best=min(pre), decode_s_best=min(dec), total_s_best=min(tot),
              total_s_median=statistics.median(tot), tokens_per_s=B * N / min(tot),
              tokens_per_s_median=B * N / statistics.median(tot),
              decode_tokens_per_s=n_decoded / min(dec) if n_decoded else float("nan"))


def main(argv=None):
  a = parse_args(argv)
  import torch
  import transformers
  with tempfile.TemporaryDirectory() as tmp:
    ckpt = a.checkpoint if a.checkpoint is not None else make_checkpoint(a, os.path.join(tmp, "ckpt"))
    cfg, params = model.load_hf_checkpoint(ckpt, dtype=jnp.float32)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
  B, P, N = a.batch, a.prompt_len, a.new_tokens
  rng = np.random.default_rng(a.seed)
  prompts = rng.integers(0, cfg.vocab_size, (B, P)).astype(np.int32)
  input_ids = torch.from_numpy(prompts.astype(np.int64))
  n_params = sum(x.size for x in jax.tree.leaves(params))
  print(f"model {cfg.arch} D={cfg.d_model} L={cfg.n_layers} N={cfg.n_heads} K={cfg.n_kv_heads} "
        f"F={cfg.ffw_dim} V={cfg.vocab_size} ({n_params / 1e6:.2f} M params, fp32); B={B} P={P} N={N} "
        f"chunk_steps={a.chunk_steps}; cores={os.cpu_count()}, hf threads {a.hf_threads} (torch "
        f"{torch.__version__}, transformers {transformers.__version__}, jax {jax.__version__})")

  dt = jnp.dtype(a.dtype)
  params = jax.tree.map(lambda x: x.astype(dt), params)  # as a --param_dtype worker receives them
  sc = rollout.SamplingConfig(temperature=0.0, max_new_tokens=N, stop_ids=())
  engine = rollout.Engine(cfg, sc, slots=B, max_prompt_len=P, chunk_steps=a.chunk_steps)
  t = time.perf_counter()
  run_ours(engine, params, prompts, dt)  # compiles insert (this prompt bucket) and the chunk
  compile_s = time.perf_counter() - t
  # The machine's read bandwidth and matmul peak, before hf first runs and again after the timed rounds, the faster
  # kept: either moves by up to 2x within a run (bf16's peak measured ~100 or ~200 GFLOP/s).
  before = machine_rates(dt, a.seed)
  for th in a.hf_threads:  # warm-up (allocator, kernels)
    torch.set_num_threads(th)
    run_hf(hf_model, torch, input_ids, N)

  ours, hf = [], {th: [] for th in a.hf_threads}
  for _ in range(a.reps):  # alternate so every side sees the same background load
    ours.append(run_ours(engine, params, prompts, dt))
    for th in a.hf_threads:
      torch.set_num_threads(th)
      hf[th].append(run_hf(hf_model, torch, input_ids, N))

  o = side(ours, B, N, B * N)
  # hf's "decode" (total - prefill-only run) makes N-1 tokens: its first one comes out of the prefill.
  h_all = {th: side([(p, t - p) for p, t, _ in rows], B, N, B * (N - 1)) for th, rows in hf.items()}
  best_th = max(h_all, key=lambda th: h_all[th]["tokens_per_s"])
  h = dict(h_all[best_th], threads=best_th)
  equal = ours[-1][2] == hf[best_th][-1][2]
  res = dict(
      config=dict(d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
                  ffw_dim=cfg.ffw_dim, vocab=cfg.vocab_size, n_params=int(n_params), batch=B, prompt_len=P,
                  new_tokens=N, chunk_steps=a.chunk_steps, reps=a.reps, cores=os.cpu_count(),
                  hf_threads=a.hf_threads, checkpoint=a.checkpoint, loadavg_1m=os.getloadavg()[0]),
      ours=dict(o, compile_s=compile_s), hf=h, hf_by_threads={str(th): r for th, r in h_all.items()},
      ratio_tokens_per_s=o["tokens_per_s"] / h["tokens_per_s"],
      ratio_decode_tokens_per_s=o["decode_tokens_per_s"] / h["decode_tokens_per_s"],
      ratio_prefill_time=o["prefill_s_best"] / h["prefill_s_best"],
      greedy_match=bool(equal.all()), greedy_match_fraction=float(equal.mean()),
      mismatch_logit_gaps=near_ties(hf_model, torch, input_ids, N, ours[-1][2], hf[best_th][-1][2]))

  # The machine's floor for this shape and dtype.
  bw, peak = map(max, zip(before, machine_rates(dt, a.seed)))
  floor_s, floor_step_s, binds = floor(cfg, n_params, B, P, N, dt.itemsize, bw, peak)
  step_s = o["decode_s_best"] / N
  res["roofline"] = dict(bytes_per_s=bw, matmul_flops_per_s=peak, dtype=a.dtype, floor_s=floor_s,
                         floor_step_s=floor_step_s, binds=binds, ours_s=o["total_s_best"],
                         ours_over_floor=o["total_s_best"] / floor_s, ours_step_s=step_s,
                         ours_step_over_floor=step_s / floor_step_s)

  for name, r in [("ours", o)] + [(f"hf@{th}t", r) for th, r in h_all.items()]:
    print(f"{name:7s} prefill {r['prefill_s_best'] * 1e3:8.1f} ms  decode {r['decode_s_best'] * 1e3:8.1f} ms  "
          f"end-to-end {r['tokens_per_s']:8.1f} tok/s (median {r['tokens_per_s_median']:.1f})  "
          f"decode-only {r['decode_tokens_per_s']:8.1f} tok/s")
  print(f"ours compile (excluded): {compile_s:.1f} s; load avg (1 min) {res['config']['loadavg_1m']:.2f}")
  print(f"ratio ours/hf (hf at its faster {best_th} thread(s)): end-to-end tok/s {res['ratio_tokens_per_s']:.2f}x, "
        f"decode-only tok/s {res['ratio_decode_tokens_per_s']:.2f}x; prefill time ours/hf "
        f"{res['ratio_prefill_time']:.2f}")
  gaps = res["mismatch_logit_gaps"]
  print(f"greedy_match={res['greedy_match']} ({equal.sum()}/{equal.size} tokens equal" + (
      f"; rows diverging: {len(gaps)}, hf's logit of its token minus of ours there: max {max(gaps):.2g})"
      if gaps else ")"))
  print(f"floor: measured {bw / 1e9:.1f} GB/s read, {peak / 1e9:.1f} GFLOP/s {a.dtype} matmul -> the whole "
        f"generation {floor_s * 1e3:.1f} ms, ours {o['total_s_best'] * 1e3:.1f} ms = "
        f"{o['total_s_best'] / floor_s:.2f}x; "
        f"a decode step {floor_step_s * 1e3:.2f} ms ({binds}-bound), ours {step_s * 1e3:.2f} ms = "
        f"{step_s / floor_step_s:.2f}x")
  if a.json:
    with open(a.json, "w") as f:
      json.dump(res, f, indent=1)
  return res


def main_all(argv):
  """--preset=all: each preset in turn (same other flags), then one table."""
  rest = [x for x in argv if not x.startswith(("--preset", "--json"))]
  out = {}
  for name in PRESETS:
    print(f"\n== preset {name}")
    out[name] = main(rest + [f"--preset={name}"])
  path = next((x.split("=", 1)[1] for x in argv if x.startswith("--json=")), None)
  if path:
    with open(path, "w") as f:
      json.dump(out, f, indent=1)
  print(f"\n{'preset':7s} {'ours tok/s':>11s} {'hf tok/s':>9s} {'ours/hf':>8s} {'ours ms':>8s} {'floor ms':>9s} "
        f"{'x floor':>8s} {'step ms':>8s} {'floor':>6s} {'x floor':>8s}")
  for name, r in out.items():
    f = r["roofline"]
    print(f"{name:7s} {r['ours']['tokens_per_s']:11.1f} {r['hf']['tokens_per_s']:9.1f} {r['ratio_tokens_per_s']:7.2f}x "
          f"{f['ours_s'] * 1e3:8.1f} {f['floor_s'] * 1e3:9.1f} {f['ours_over_floor']:7.2f}x "
          f"{f['ours_step_s'] * 1e3:8.2f} {f['floor_step_s'] * 1e3:6.2f} {f['ours_step_over_floor']:7.2f}x")
  return out


if __name__ == "__main__":
  # As rollout.py's worker runs (the HF side shares the process and its malloc settings). Here, not in main():
  # tests call main() inside pytest, whose process stays on glibc's defaults (tests/conftest.py).
  common.tune_malloc()
  argv = sys.argv[1:]
  main_all(argv) if "--preset=all" in argv else main(argv)
