"""Issue 17 item 1 prototype (session 8, not on the run path): decode-step variants at a bench_decode preset.

  JAX_PLATFORMS=cpu python wip/decode_layouts.py big     # ms per decode step (8 steps in one jit, best of 5),
                                                          # 4 interleaved rounds, median

current = model.decode_step ([L,B,S,K,H] cache, scan over stacked layers); merge = attend the old cache and the
new token separately (no in-scan cache write); list-bksh = Python-unrolled layers over per-layer weights and
per-layer [B,K,S,H] caches (scatter in place, then attend); scan-bksh-merge = [L,B,K,S,H] + scan + merge.
Findings in wip/README.md.
"""
import functools, os, sys, time
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jax, jax.numpy as jnp, numpy as np
import model, kernels, rollout
from bench_train import best_time

preset = sys.argv[1] if len(sys.argv) > 1 else "big"
import bench_decode
P = bench_decode.PRESETS[preset]
cfg = model.Config(vocab_size=P["vocab"], d_model=P["d_model"], n_layers=P["n_layers"], n_heads=P["n_heads"],
                   n_kv_heads=P["n_kv_heads"], head_dim=P["d_model"] // P["n_heads"], ffw_dim=P["ffw_dim"],
                   tie_embeddings=True)
B, S = P["batch"], P["prompt_len"] + P["new_tokens"] + 8
ctx = P["prompt_len"] + P["new_tokens"] // 2
params = model.init_params(cfg, jax.random.PRNGKey(0))
cache = model.init_cache(cfg, B, S)
cache = dict(cache, k=jax.random.normal(jax.random.PRNGKey(1), cache["k"].shape) * 0.1,
             v=jax.random.normal(jax.random.PRNGKey(2), cache["v"].shape) * 0.1, lengths=jnp.full((B,), ctx, jnp.int32))
tok = jnp.arange(B, dtype=jnp.int32) % cfg.vocab_size

def steps(fn, n=8):
  def run(params, cache):
    def body(c, _):
      logits, c2 = fn(params, cfg, tok, c)
      return dict(c2, lengths=c["lengths"]), logits[:, 0]
    return jax.lax.scan(body, cache, None, length=n)
  return jax.jit(run)

def decode_merge(params, cfg, tokens, cache, attn_impl="ref"):
  B = tokens.shape[0]
  lengths = cache["lengths"]
  rows = jnp.arange(B)
  def attn(q, k, v, layer_cache):
    kc, vc = layer_cache
    q1, k1, v1 = q[:, 0], k[:, 0], v[:, 0]  # [B,N,H], [B,K,H]
    Bq, N, H = q1.shape
    K = kc.shape[2]
    qg = q1.reshape(Bq, K, N // K, H)
    sc = H ** -0.5
    s_old = jnp.einsum("bkgh,bskh->bkgs", qg, kc, preferred_element_type=jnp.float32) * sc
    valid = jnp.arange(kc.shape[1])[None, :] < lengths[:, None]
    s_old = jnp.where(valid[:, None, None], s_old, kernels.NEG_INF)
    s_new = jnp.einsum("bkgh,bkh->bkg", qg, k1, preferred_element_type=jnp.float32)[..., None] * sc
    s = jnp.concatenate([s_old, s_new], -1)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bkgs,bskh->bkgh", p[..., :-1].astype(vc.dtype), vc, preferred_element_type=jnp.float32)
    o = o + p[..., -1:] * v1[:, :, None, :].astype(jnp.float32)
    return o.reshape(Bq, N, H).astype(q.dtype)[:, None], (k1, v1)
  h, (k_new, v_new) = model._run(params, cfg, tokens[:, None], lengths[:, None], attn, xs=(cache["k"], cache["v"]))
  k = cache["k"].at[:, rows, lengths].set(k_new.astype(cache["k"].dtype))
  v = cache["v"].at[:, rows, lengths].set(v_new.astype(cache["v"].dtype))
  logits = model.logits_from_hidden(params, cfg, h[:, 0])
  return logits, {"k": k, "v": v, "lengths": lengths + 1}

def no_logits(fn):
  def f(params, cfg, tokens, cache):
    lg, c = fn(params, cfg, tokens, cache)
    return lg[:, :8], c
  return f


n = 8
NEG = kernels.NEG_INF
def attn_bksh(q1, kc, vc, lengths, k1=None, v1=None):
  """q1 [B,N,H]; kc/vc [B,K,S,H]; valid keys < lengths; optional extra (new) key/value [B,K,H] merged."""
  B, N, H = q1.shape
  K, S = kc.shape[1], kc.shape[2]
  qg = q1.reshape(B, K, N // K, H)
  sc = H ** -0.5
  s = jnp.einsum("bkgh,bksh->bkgs", qg, kc, preferred_element_type=jnp.float32) * sc
  valid = jnp.arange(S)[None, :] < lengths[:, None]
  s = jnp.where(valid[:, None, None], s, NEG)
  if k1 is None:
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bkgs,bksh->bkgh", p.astype(vc.dtype), vc, preferred_element_type=jnp.float32)
  else:
    s1 = jnp.einsum("bkgh,bkh->bkg", qg, k1, preferred_element_type=jnp.float32)[..., None] * sc
    p = jax.nn.softmax(jnp.concatenate([s, s1], -1), axis=-1)
    o = jnp.einsum("bkgs,bksh->bkgh", p[..., :-1].astype(vc.dtype), vc, preferred_element_type=jnp.float32)
    o = o + p[..., -1:] * v1[:, :, None, :].astype(jnp.float32)
  return o.reshape(B, N, H).astype(q1.dtype)

def decode_list_bksh(params, cfg, tokens, cache, merge=False):
  B = tokens.shape[0]
  lengths = cache["lengths"]
  rows = jnp.arange(B)
  x = params["embed"][tokens[:, None]].astype(jnp.float32)
  cos, sin = model._rope_tables(cfg, lengths[:, None])
  ks, vs = [], []
  for i in range(cfg.n_layers):
    lp = params["layer_list"][i]
    box = {}
    def attn(q, k, v, _):
      kc0, vc0 = cache["k"][i], cache["v"][i]
      kc = kc0.at[rows, :, lengths].set(k[:, 0].astype(kc0.dtype))
      vc = vc0.at[rows, :, lengths].set(v[:, 0].astype(vc0.dtype))
      box["kv"] = (kc, vc)
      if merge:
        o = attn_bksh(q[:, 0], kc0, vc0, lengths, k[:, 0], v[:, 0])
      else:
        o = attn_bksh(q[:, 0], kc, vc, lengths + 1)
      return o[:, None], None
    x, _ = model._block(x, lp, cfg, cos, sin, attn, None)
    ks.append(box["kv"][0]); vs.append(box["kv"][1])
  h = model._rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
  return model.logits_from_hidden(params, cfg, h[:, 0]), {"k": ks, "v": vs, "lengths": lengths + 1}

def decode_scan_bksh(params, cfg, tokens, cache):
  """[L,B,K,S,H] cache, scan over layers, attend old cache + new token (no in-scan write), one scatter after."""
  B = tokens.shape[0]
  lengths = cache["lengths"]
  rows = jnp.arange(B)
  def attn(q, k, v, layer_cache):
    kc, vc = layer_cache
    o = attn_bksh(q[:, 0], kc, vc, lengths, k[:, 0], v[:, 0])
    return o[:, None], (k[:, 0], v[:, 0])
  h, (kn, vn) = model._run(params, cfg, tokens[:, None], lengths[:, None], attn, xs=(cache["k"], cache["v"]))
  k = cache["k"].at[:, rows, :, lengths].set(jnp.swapaxes(kn, 0, 1))  # [B,L,K,H] for index [rows,:,:,lengths]?
  v = cache["v"].at[:, rows, :, lengths].set(jnp.swapaxes(vn, 0, 1))
  return model.logits_from_hidden(params, cfg, h[:, 0]), {"k": k, "v": v, "lengths": lengths + 1}

params2 = dict(params, layer_list=[jax.tree.map(lambda a: a[i], params["layers"]) for i in range(cfg.n_layers)])
kT, vT = jnp.swapaxes(cache["k"], 2, 3), jnp.swapaxes(cache["v"], 2, 3)  # [L,B,K,S,H]
cache_list = dict(cache, k=[kT[i] for i in range(cfg.n_layers)], v=[vT[i] for i in range(cfg.n_layers)])
cache_stk = dict(cache, k=kT, v=vT)
ref_logits = jax.jit(lambda p, c: model.decode_step(p, cfg, tok, c)[0])(params, cache)
variants = [("current", model.decode_step, cache), ("list-bksh", decode_list_bksh, cache_list),
            ("scan-bksh-merge", decode_scan_bksh, cache_stk)]
for name, fn, c in variants:
  lg = jax.jit(lambda p, c: fn(p, cfg, tok, c)[0])(params2, c)
  print(f"{preset} {name:22s} max|dlogit| {float(jnp.abs(lg - ref_logits).max()):.2e}", flush=True)
fs = {name: steps(fn, n) for name, fn, c in variants}
res = {name: [] for name, _, _ in variants}
for rnd in range(4):  # interleaved rounds: the box's load drifts
  for name, fn, c in variants:
    res[name].append(1000 * best_time(fs[name], (params2, c), 5)[0] / n)
for name, ts in res.items():
  print(f"{preset} {name:22s} " + " ".join(f"{t:7.2f}" for t in ts) + f"  median {sorted(ts)[len(ts) // 2]:.2f} ms/step")
