"""A hand-written JAX decoder-only transformer that loads and saves real Hugging Face checkpoints.

Families: Qwen2 / Qwen2.5 / QwQ (QKV bias), Qwen3 (q/k RMSNorm, no bias), Llama (no bias; Llama-3 rope scaling).
All are the same block: pre-RMSNorm, GQA attention with RoPE (HF "rotate_half" layout), SwiGLU MLP.

Dimension legend (einsums and shape comments):
  B batch   T query len   S key / cache len   D d_model   F ffw dim   N q heads   K kv heads   H head dim
  V vocab   L layers

Design
  * Params are a plain nested dict, per-layer weights stacked on a leading L axis (`param_axes`: every shape and
    logical axis). The training forward, prefill and decode all run `_block` and differ only in the attention
    callback (pallas_kernels: jnp on CPU, Pallas on TPU), so the trainer's and the worker's log-probs come from
    the same math.
  * Precision: params fp32 or bf16; matmuls take inputs in the param dtype and return fp32 (fp32 accumulation);
    the residual stream, RMSNorm, RoPE, SiLU and the logits are fp32, q/k/v and the attention output the param
    dtype (softmax in fp32). In fp32 this is HF's math (on TPU with jax_default_matmul_precision=highest).
  * Sharding: LOGICAL_RULES maps logical axes onto a ("data","fsdp","tensor") mesh, for params (`shard_params`)
    and activations (with_sharding_constraint, whenever jax.set_mesh has set a mesh). A dim keeps its rule's mesh
    axes only while their product divides it (dropping axes from the end: batch 2 on data=2,fsdp=4 -> data), and
    a mesh axis is used once per array (first dim wins). The axes are Auto: XLA inserts the collectives.
  * KV cache: per layer a k [B,K,H,S] and a v [B,K,S,H] buffer, and lengths [B]: row b holds positions
    [0, lengths[b]); decode writes at lengths[b], its RoPE position (kept < S by the caller: XLA drops a write past
    the end). Prefill and decode loop over the layers in Python, updating each layer's (donated) buffer in place
    (a scan over a stacked cache made copies on XLA CPU). Keys are [H,S]: both attention products are plain
    matmuls (XLA CPU ran q k^T on [S,H] keys 2-3x slower; the Pallas decode kernel gets the MXU's [H, block_s]).

Example:  cfg, params = load_hf_checkpoint("/ckpt/Qwen2.5-0.5B", dtype=jnp.bfloat16)
          mesh = make_mesh(1, 2, 4); params = shard_params(params, cfg, mesh)
          with jax.set_mesh(mesh): logits = jax.jit(forward, static_argnums=1)(params, cfg, tokens)
"""
import dataclasses
import functools
import json
import math
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import pallas_kernels

# ----------------------------------------------------------------------------------------------------- Config

# HF architecture name -> model_type. The family fixes which optional pieces exist (bias, q/k norm).
_ARCHS = {"Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama"}
_FAMILY_FLAGS = {"qwen2": dict(qkv_bias=True, qk_norm=False), "qwen3": dict(qkv_bias=False, qk_norm=True),
                 "llama": dict(qkv_bias=False, qk_norm=False)}
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclasses.dataclass(frozen=True)
class Config:
  vocab_size: int
  d_model: int
  n_layers: int
  n_heads: int
  n_kv_heads: int
  head_dim: int
  ffw_dim: int
  rope_theta: float = 10000.0
  rope_scaling: tuple | None = None  # None, or sorted (key, value) items incl. ("rope_type", "llama3")
  rms_norm_eps: float = 1e-6
  tie_embeddings: bool = False
  qkv_bias: bool = False
  qk_norm: bool = False
  max_position_embeddings: int = 32768
  arch: str = "LlamaForCausalLM"
  bos_token_id: int | None = None
  eos_token_ids: tuple = ()

  def __post_init__(self):
    for f in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffw_dim",
              "max_position_embeddings"):
      v = getattr(self, f)
      if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v <= 0:
        raise ValueError(f"Config.{f} must be a positive int, got {v!r}")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(f"Config.n_heads={self.n_heads} must be divisible by n_kv_heads={self.n_kv_heads} (GQA)")
    if self.head_dim % 2:
      raise ValueError(f"Config.head_dim={self.head_dim} must be even (RoPE rotates pairs)")
    if not (self.rope_theta > 0 and self.rms_norm_eps > 0):
      raise ValueError(f"Config.rope_theta={self.rope_theta} and rms_norm_eps={self.rms_norm_eps} must be > 0")
    if self.arch not in _ARCHS:
      raise ValueError(f"Config.arch={self.arch!r} unsupported; supported: {sorted(_ARCHS)}")
    for f, v in _FAMILY_FLAGS[_ARCHS[self.arch]].items():
      if getattr(self, f) != v:
        raise ValueError(f"Config.{f}={getattr(self, f)} does not match arch {self.arch} (which has {f}={v})")
    rs = dict(self.rope_scaling or {})
    if self.rope_scaling is not None and (rs.get("rope_type") != "llama3" or any(k not in rs for k in _LLAMA3_KEYS)):
      raise ValueError(f"Config.rope_scaling={self.rope_scaling!r}: only rope_type 'llama3' with keys "
                       f"{_LLAMA3_KEYS} is supported")
    if not isinstance(self.eos_token_ids, tuple):
      raise ValueError(f"Config.eos_token_ids must be a tuple (hashable), got {self.eos_token_ids!r}")

  @classmethod
  def from_hf(cls, path):
    """Reads a checkpoint directory's config.json (or the path of a config.json itself)."""
    fn = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(fn):
      raise ValueError(f"no HF config at {fn!r}")
    try:
      with open(fn) as f:
        return cls.from_hf_dict(json.load(f), source=fn)
    except json.JSONDecodeError as e:
      raise ValueError(f"{fn}: invalid JSON: {e}") from e

  @classmethod
  def from_hf_dict(cls, d, source="config.json"):
    """Parses an HF config dict (transformers 4.x or 5.x spelling). ValueError names the offending field."""
    def bad(msg):
      raise ValueError(f"{source}: {msg}")

    if not isinstance(d, dict):
      bad(f"expected a JSON object, got {type(d).__name__}")
    mt = d.get("model_type")
    if mt not in _FAMILY_FLAGS:
      bad(f"model_type={mt!r} unsupported; supported: {sorted(_FAMILY_FLAGS)}")
    archs = d.get("architectures") or [next(a for a, m in _ARCHS.items() if m == mt)]
    if not isinstance(archs, list) or len(archs) != 1 or _ARCHS.get(archs[0]) != mt:
      bad(f"architectures={archs!r} does not match model_type={mt!r} (supported: {sorted(_ARCHS)})")
    if d.get("hidden_act", "silu") != "silu":
      bad(f"hidden_act={d['hidden_act']!r} unsupported (only 'silu')")
    if d.get("use_sliding_window"):
      bad("use_sliding_window=true unsupported (full attention only)")
    for t in d.get("layer_types") or []:
      if t != "full_attention":
        bad(f"layer_types contains {t!r}; only 'full_attention' is supported")
    for f in ("attention_bias", "mlp_bias"):
      # Qwen2 hard-codes q/k/v bias; Qwen3/Llama attention_bias would also add an o_proj bias we don't model.
      if mt != "qwen2" and d.get(f):
        bad(f"{f}=true unsupported for model_type={mt!r}")
    # RoPE: transformers 5 writes rope_parameters={rope_type, rope_theta, ...}; 4.x wrote rope_theta at top
    # level and rope_scaling={type|rope_type, ...} or null.
    field = "rope_scaling" if d.get("rope_parameters") is None else "rope_parameters"
    rp = d[field] if field == "rope_parameters" else {"rope_theta": d.get("rope_theta", 10000.0),
                                                      **dict(d.get("rope_scaling") or {})}
    if not isinstance(rp, dict):
      bad(f"{field} must be an object, got {rp!r}")
    rtype = rp.get("rope_type", rp.get("type", "default"))
    if rp.get("partial_rotary_factor", 1.0) != 1.0:
      bad(f"{field}.partial_rotary_factor={rp['partial_rotary_factor']} unsupported")
    if rtype not in ("default", "llama3"):
      bad(f"{field}.rope_type={rtype!r} unsupported (supported: 'default', 'llama3')")
    missing = [k for k in _LLAMA3_KEYS if k not in rp] if rtype == "llama3" else []
    if missing:
      bad(f"{field} of rope_type 'llama3' is missing {missing[0]!r}")
    rope_scaling = (tuple(sorted([(k, float(rp[k])) for k in _LLAMA3_KEYS] + [("rope_type", "llama3")]))
                    if rtype == "llama3" else None)
    for key in ("num_attention_heads", "hidden_size", "vocab_size", "num_hidden_layers", "intermediate_size"):
      if d.get(key) is None:
        bad(f"missing required field {key!r}")

    n_heads, d_model = d["num_attention_heads"], d["hidden_size"]
    # Qwen3Config's head_dim defaults to 128 (not d_model // n_heads); mirror HF exactly.
    head_dim = d.get("head_dim") or (128 if mt == "qwen3" else d_model // max(int(n_heads), 1))
    eos = d.get("eos_token_id")
    eos = () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
    try:
      return cls(
          vocab_size=d["vocab_size"], d_model=d_model, n_layers=d["num_hidden_layers"], n_heads=n_heads,
          n_kv_heads=d.get("num_key_value_heads") or n_heads, head_dim=head_dim,
          ffw_dim=d["intermediate_size"], rope_theta=float(rp.get("rope_theta", 10000.0)),
          rope_scaling=rope_scaling, rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
          tie_embeddings=bool(d.get("tie_word_embeddings", False)),
          max_position_embeddings=d.get("max_position_embeddings") or 32768,
          arch=archs[0], bos_token_id=d.get("bos_token_id"), eos_token_ids=eos, **_FAMILY_FLAGS[mt])
    except ValueError as e:
      raise ValueError(f"{source}: {e}") from e

  def to_hf_dict(self, dtype=None):
    """HF config dict in transformers-5 spelling; `dtype` (e.g. "bfloat16") is recorded when given."""
    rp = {"rope_type": "default", "rope_theta": self.rope_theta}
    if self.rope_scaling is not None:
      rp.update(dict(self.rope_scaling))
      rp["original_max_position_embeddings"] = int(rp["original_max_position_embeddings"])
    eos, mt = list(self.eos_token_ids), _ARCHS[self.arch]
    d = {
        "architectures": [self.arch], "model_type": mt, "vocab_size": self.vocab_size,
        "hidden_size": self.d_model, "intermediate_size": self.ffw_dim, "num_hidden_layers": self.n_layers,
        "num_attention_heads": self.n_heads, "num_key_value_heads": self.n_kv_heads, "head_dim": self.head_dim,
        "hidden_act": "silu", "max_position_embeddings": self.max_position_embeddings,
        "rms_norm_eps": self.rms_norm_eps, "tie_word_embeddings": self.tie_embeddings, "rope_parameters": rp,
        "bos_token_id": self.bos_token_id, "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "attention_dropout": 0.0, "use_cache": True,
    }
    if mt != "qwen2":
      d["attention_bias"] = False
    d["mlp_bias" if mt == "llama" else "use_sliding_window"] = False
    if dtype is not None:
      d["dtype"] = str(jnp.dtype(dtype))
    return d


# --------------------------------------------------------------------------------------------------- Sharding

# Logical axis -> mesh axes; anything not listed (layers, seq, head_dim, norm, act_embed) is replicated.
# Activations use "act_embed" for D, so the fsdp axis shards the batch there and the weights' D here.
LOGICAL_RULES = (("batch", pallas_kernels.BATCH_AXES),  # the attention kernels' shard_map split: the same axes
                 ("embed", ("fsdp",)), ("heads", (pallas_kernels.HEAD_AXIS,)),
                 ("kv_heads", (pallas_kernels.HEAD_AXIS,)), ("ffw", ("tensor",)), ("vocab", ("tensor",)))


def make_mesh(data, fsdp, tensor, devices=None):
  """A ("data","fsdp","tensor") mesh with Auto axis types (XLA inserts the collectives)."""
  n = data * fsdp * tensor
  devices = list(jax.devices() if devices is None else devices)
  if n > len(devices):
    raise ValueError(f"mesh {data}x{fsdp}x{tensor} needs {n} devices, only {len(devices)} available")
  return jax.make_mesh((data, fsdp, tensor), ("data", "fsdp", "tensor"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 3, devices=devices[:n])


def logical_spec(axes, shape, mesh):
  """PartitionSpec of an array with logical `axes` under LOGICAL_RULES and the fallback rule (module docstring)."""
  assert len(axes) == len(shape), (axes, shape)
  sizes, rules, used, spec = dict(mesh.shape), dict(LOGICAL_RULES), set(), []
  for name, dim in zip(axes, shape):
    cand = pallas_kernels.fit_axes(dim, [a for a in rules.get(name, ()) if a not in used], sizes)
    cand = [a for a in cand if sizes[a] > 1]  # size-1 axes add nothing; keeps specs readable
    used.update(cand)
    spec.append(None if not cand else cand[0] if len(cand) == 1 else tuple(cand))
  return P(*spec)


def _constrain(x, axes):
  mesh = jax.sharding.get_abstract_mesh()
  return x if mesh.empty else jax.lax.with_sharding_constraint(x, logical_spec(axes, x.shape, mesh))


def param_axes(cfg):
  """name -> (shape, logical axes) for every param; the single source of truth for init, sharding and I/O.
  lm_head is absent when tie_embeddings (logits use embed.T); bq/bk/bv exist with qkv_bias, q_norm/k_norm with
  qk_norm."""
  L, D, N, K, H, F, V = (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffw_dim,
                         cfg.vocab_size)
  norm, kv, up = ((L, D), ("layers", "norm")), ((L, D, K, H), ("layers", "embed", "kv_heads", "head_dim")), \
      ((L, D, F), ("layers", "embed", "ffw"))
  layers = {"attn_norm": norm, "wq": ((L, D, N, H), ("layers", "embed", "heads", "head_dim")), "wk": kv, "wv": kv,
            "wo": ((L, N, H, D), ("layers", "heads", "head_dim", "embed")), "mlp_norm": norm, "w_gate": up,
            "w_up": up, "w_down": ((L, F, D), ("layers", "ffw", "embed"))}
  if cfg.qkv_bias:
    layers["bq"] = ((L, N, H), ("layers", "heads", "head_dim"))
    layers["bk"] = layers["bv"] = ((L, K, H), ("layers", "kv_heads", "head_dim"))
  if cfg.qk_norm:
    layers["q_norm"] = layers["k_norm"] = ((L, H), ("layers", "head_dim"))
  out = {"embed": ((V, D), ("vocab", "embed")), "final_norm": ((D,), ("norm",)), "layers": layers}
  if not cfg.tie_embeddings:
    out["lm_head"] = ((D, V), ("embed", "vocab"))
  return out


def _is_leaf(x):
  return isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], tuple)


def param_specs(cfg, mesh=None):
  """PartitionSpec pytree matching init_params; mesh defaults to the one set by jax.set_mesh."""
  mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
  if mesh.empty:
    raise ValueError("param_specs needs a mesh (pass one or call inside `with jax.set_mesh(mesh):`)")
  return jax.tree.map(lambda sa: logical_spec(sa[1], sa[0], mesh), param_axes(cfg), is_leaf=_is_leaf)


def param_shardings(cfg, mesh):
  return jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(cfg, mesh))


def shard_params(params, cfg, mesh):
  return jax.device_put(params, param_shardings(cfg, mesh))


def cache_axes():
  """Logical axes of each layer's k buffer [B,K,H,S] and v buffer [B,K,S,H], and of lengths [B]."""
  return {"k": ("batch", "kv_heads", "head_dim", "cache_seq"), "v": ("batch", "kv_heads", "cache_seq", "head_dim"),
          "lengths": ("batch",)}


def cache_at(name, rows, pos):
  """Index of cache buffer `name` ("k" or "v") at batch rows `rows` and sequence positions `pos`, wherever
  cache_axes puts the sequence axis (for prefill, decode_step and rollout.Engine)."""
  return (rows,) + (slice(None),) * (cache_axes()[name].index("cache_seq") - 1) + (pos,)


# ----------------------------------------------------------------------------------------------------- Params

def init_params(cfg, key, dtype=jnp.float32, std=0.02, normal=None, zero_bias=True):
  """HF-style random params: N(0, std) matrices (the N(0, 0.02) draw times std/0.02), unit norms, zero biases
  (zero_bias=False: QKV biases drawn too). normal(shape) -> fp32 N(0, 1) draws in tree order replaces jax.random
  (key unused). Sharded: jax.jit(init_params, static_argnums=(0, 2), out_shardings=param_shardings(cfg, mesh))."""
  flat, treedef = jax.tree.flatten_with_path(param_axes(cfg), is_leaf=_is_leaf)
  keys = jax.random.split(key, len(flat)) if normal is None else [None] * len(flat)
  leaves = []
  for (path, (shape, _)), k in zip(flat, keys):
    name = path[-1].key
    if "norm" in name:
      leaves.append(jnp.ones(shape, dtype))
    elif zero_bias and name in ("bq", "bk", "bv"):
      leaves.append(jnp.zeros(shape, dtype))
    else:
      x = jax.random.normal(k, shape, jnp.float32) if normal is None else normal(shape)
      leaves.append(jnp.asarray(0.02 * x * (std / 0.02)).astype(dtype))
  return jax.tree.unflatten(treedef, leaves)


# ---------------------------------------------------------------------------------------------------- Forward

def _dot(eq, x, w):
  # Inputs in the weight's dtype (bf16 MXU path), fp32 accumulation and result. Every projection contracts x's
  # trailing dims with w's leading ones (w is [in..., out...]), which _proj's backward relies on.
  return _proj(eq, x.astype(w.dtype), w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _proj(eq, x, w):
  return jnp.einsum(eq, x, w, preferred_element_type=jnp.float32)


def _proj_bwd(eq, res, g):
  """Autodiff's math as two 2-D matmuls on flattened [tokens, in] x [in, out]: XLA CPU ran autodiff's transposed
  einsums (the weight gradient contracting over B and T at once) at a third of its matmul speed."""
  x, w = res
  xs, ws = eq.split("->")[0].split(",")
  k = math.prod(w.shape[:sum(c in xs for c in ws)])  # the contracted (leading) dims of w
  x2, w2 = x.reshape(-1, k), w.reshape(k, -1)
  g2 = g.reshape(-1, w2.shape[1])  # fp32, as autodiff keeps it (a mixed fp32 x bf16 matmul for bf16 weights)
  dx = jnp.matmul(g2, w2.T, preferred_element_type=jnp.float32).astype(x.dtype).reshape(x.shape)
  dw = jnp.matmul(x2.T, g2, preferred_element_type=jnp.float32).astype(w.dtype).reshape(w.shape)
  return dx, dw


_proj.defvjp(lambda eq, x, w: (_proj(eq, x, w), (x, w)), _proj_bwd)


def _rms_norm(x, w, eps):  # fp32 statistics whatever the param dtype (as HF)
  x = x.astype(jnp.float32)
  x = x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) / x.shape[-1] + eps)
  return w.astype(jnp.float32) * x


def _inv_freq(cfg):
  """RoPE inverse frequencies [H/2] (numpy fp32, as HF computes them), with optional Llama-3 scaling."""
  H = cfg.head_dim
  inv = 1.0 / (np.float32(cfg.rope_theta) ** (np.arange(0, H, 2, dtype=np.float32) / np.float32(H)))
  if cfg.rope_scaling is not None:
    factor, lo, hi, old = map(dict(cfg.rope_scaling).get, _LLAMA3_KEYS)
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > old / lo, inv / factor, inv)  # long wavelengths: interpolate fully
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
    inv = np.where(medium, smoothed, scaled)
  return inv.astype(np.float32)


def _rope_tables(cfg, positions):  # positions [B,T] int -> cos/sin [B,T,H/2] fp32
  ang = positions.astype(jnp.float32)[..., None] * jnp.asarray(_inv_freq(cfg))
  return jnp.cos(ang), jnp.sin(ang)


def _rope(x, cos, sin):  # HF rotate_half layout: the two halves of the head dim are the rotated pairs
  h = x.shape[-1] // 2
  x1, x2 = x[..., :h], x[..., h:]
  c, s = cos[:, :, None], sin[:, :, None]
  return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def _block(x, lp, cfg, cos, sin, attn_fn, layer_xs):
  """One transformer layer. x [B,T,D] fp32 residual; attn_fn(q, k, v, layer_xs) -> (o [B,T,N,H], y)."""
  eps, dt = cfg.rms_norm_eps, lp["wq"].dtype
  h = _rms_norm(x, lp["attn_norm"], eps)
  q = _dot("btd,dnh->btnh", h, lp["wq"])
  k = _dot("btd,dkh->btkh", h, lp["wk"])
  v = _dot("btd,dkh->btkh", h, lp["wv"])
  if cfg.qkv_bias:
    q, k, v = q + lp["bq"].astype(jnp.float32), k + lp["bk"].astype(jnp.float32), v + lp["bv"].astype(jnp.float32)
  if cfg.qk_norm:  # Qwen3: per-head RMSNorm before RoPE
    q, k = _rms_norm(q, lp["q_norm"], eps), _rms_norm(k, lp["k_norm"], eps)
  q, k = _rope(q, cos, sin), _rope(k, cos, sin)
  q = _constrain(q.astype(dt), ("batch", "seq", "heads", "head_dim"))
  k = _constrain(k.astype(dt), ("batch", "seq", "kv_heads", "head_dim"))
  v = _constrain(v.astype(dt), ("batch", "seq", "kv_heads", "head_dim"))
  o, y = attn_fn(q, k, v, layer_xs)
  # o x wo with N*H as one contracted dim (free reshapes): as "btnh,nhd->btd" XLA transposed wo and o every call.
  o, wo = o.reshape(*o.shape[:2], -1), lp["wo"].reshape(-1, lp["wo"].shape[-1])
  x = _constrain(x + _dot("btf,fd->btd", o, wo), ("batch", "seq", "act_embed"))
  h = _rms_norm(x, lp["mlp_norm"], eps)
  gate, up = _dot("btd,df->btf", h, lp["w_gate"]), _dot("btd,df->btf", h, lp["w_up"])
  a = _constrain(jax.nn.silu(gate) * up, ("batch", "seq", "ffw"))
  x = _constrain(x + _dot("btf,fd->btd", a, lp["w_down"]), ("batch", "seq", "act_embed"))
  return x, y


def _embed(params, tokens):
  tokens = _constrain(tokens, ("batch", "seq"))
  # Gather from a table whose D is not fsdp-sharded: the fsdp axis is the batch's here, and a D-sharded
  # gather output would need an all-to-all that the partitioner can only do by full rematerialization.
  table = _constrain(params["embed"], ("vocab", "act_embed"))
  return _constrain(table[tokens].astype(jnp.float32), ("batch", "seq", "act_embed"))


def _run(params, cfg, tokens, positions, attn_fn, remat=False, unroll=False):
  """The training forward: embed, a scan (or unrolled loop) of _block over the L axis, final norm -> h [B,T,D]."""
  x = _embed(params, tokens)
  cos, sin = _rope_tables(cfg, positions)

  def body(x, lp):
    return _block(x, lp, cfg, cos, sin, attn_fn, None)[0], None

  if remat:  # training memory: keep only the per-layer residual, recompute the rest in the backward pass
    body = jax.checkpoint(body, policy=jax.checkpoint_policies.nothing_saveable)
  x, _ = jax.lax.scan(body, x, params["layers"], unroll=unroll)
  return _rms_norm(x, params["final_norm"], cfg.rms_norm_eps)


def unstack_layers(params):
  """params with "layers" as a list of L per-layer dicts instead of stacked [L,...] arrays: what rollout.Engine
  decodes from on CPU, where slicing stacked weights (for the Python layer loop of prefill and decode) copies."""
  if isinstance(params["layers"], list):
    return params
  n = jax.tree.leaves(params["layers"])[0].shape[0]
  return dict(params, layers=[jax.tree.map(lambda a, i=i: a[i], params["layers"]) for i in range(n)])


def _run_cached(params, cfg, tokens, positions, attn_fn, lengths):
  """Prefill's and decode's forward: embed, the L layers as a Python loop, final norm. attn_fn(q, k, v, i) returns
  (o, (layer i's new k buffer, v buffer)). Returns (h [B,T,D] fp32, the cache of those buffers and `lengths`)."""
  x = _embed(params, tokens)
  cos, sin = _rope_tables(cfg, positions)
  layers, bufs = params["layers"], []
  for i in range(cfg.n_layers):  # static slices of stacked weights, or unstack_layers' list
    lp = layers[i] if isinstance(layers, list) else jax.tree.map(lambda a: a[i], layers)
    x, kv = _block(x, lp, cfg, cos, sin, attn_fn, i)
    bufs.append(kv)
  axes = cache_axes()
  cache = {n: [_constrain(kv[j], axes[n]) for kv in bufs] for j, n in enumerate(("k", "v"))}
  return _rms_norm(x, params["final_norm"], cfg.rms_norm_eps), dict(cache, lengths=_constrain(lengths, axes["lengths"]))


def logits_from_hidden(params, cfg, h):
  """h [..., D] (final normed hidden) -> fp32 logits [..., V]; lets a loss compute log-probs in chunks."""
  # The tied head goes through _proj too (embed.T folds into the dot), so its weight gradient is h^T @ dlogits
  # and not a transposed copy of the [B*T,V] dlogits.
  logits = _dot("...d,dv->...v", h, params["embed"].T if cfg.tie_embeddings else params["lm_head"])
  return _constrain(logits, ("batch", "seq", "vocab")) if logits.ndim == 3 else logits


def _check_tokens(tokens, ndim, what):
  if tokens.ndim != ndim or not jnp.issubdtype(tokens.dtype, jnp.integer):
    raise ValueError(f"{what}: tokens must be an integer array of rank {ndim}, got {tokens.dtype}{tokens.shape}")


def forward_hidden(params, cfg, tokens, positions=None, segment_ids=None, *, attn_impl="auto", remat=False):
  """Training forward to the final normed hidden [B,T,D] fp32. positions [B,T] (default arange(T)) drive RoPE;
  packed sequences (segment_ids [B,T], default one) attend within their segment; restart positions at each."""
  _check_tokens(tokens, 2, "forward")
  B, T = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)) if positions is None else positions
  segment_ids = jnp.ones((B, T), jnp.int32) if segment_ids is None else segment_ids
  segment_ids = _constrain(segment_ids, ("batch", "seq"))

  def attn(q, k, v, _):
    return pallas_kernels.attention(q, k, v, segment_ids, causal=True, impl=attn_impl), None

  # Unrolled on XLA CPU, where the loop copies each layer's weight slices and stacks the residuals for the
  # backward; on TPU the scan's slices fuse into the matmuls and one loop body keeps compile time flat in depth.
  return _run(params, cfg, tokens, positions, attn, remat=remat, unroll=jax.default_backend() == "cpu")


def forward(params, cfg, tokens, positions=None, segment_ids=None, *, attn_impl="auto", remat=False):
  """Training forward: tokens [B,T] -> logits [B,T,V] fp32 (arguments: forward_hidden)."""
  h = forward_hidden(params, cfg, tokens, positions, segment_ids, attn_impl=attn_impl, remat=remat)
  return logits_from_hidden(params, cfg, h)


# --------------------------------------------------------------------------------------------------- KV cache

def init_cache(cfg, batch, max_len, dtype=jnp.float32):
  """Empty cache: k a list of L [B,K,H,S] zeros, v of L [B,K,S,H] zeros, lengths [B] int32 zeros (S = max_len)."""
  B, K, S, H = batch, cfg.n_kv_heads, max_len, cfg.head_dim
  return {"k": [jnp.zeros((B, K, H, S), dtype) for _ in range(cfg.n_layers)],
          "v": [jnp.zeros((B, K, S, H), dtype) for _ in range(cfg.n_layers)], "lengths": jnp.zeros((B,), jnp.int32)}


def prefill(params, cfg, tokens, lengths, cache, *, attn_impl="auto"):
  """Right-padded prompts tokens [B,T] (row b valid on [0, lengths[b]), lengths >= 1, T <= S) into an empty cache:
  returns (fp32 logits of each row's last prompt token [B,V], the cache with [0, lengths[b]) and lengths set)."""
  _check_tokens(tokens, 2, "prefill")
  B, T = tokens.shape
  if T > cache["v"][0].shape[2] or cache["v"][0].shape[0] != B:
    raise ValueError(f"prefill: tokens {tokens.shape} do not fit cache v {cache['v'][0].shape} [B,K,S,H] (need B "
                     "equal, T <= S)")
  lengths = lengths.astype(jnp.int32)
  valid = jnp.arange(T)[None, :] < lengths[:, None]  # [B,T]
  segment_ids = valid.astype(jnp.int32)  # padding is segment 0: it attends only to padding, never leaks into rows
  positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))

  def write(name, i, new, m):  # new laid out as layer i's buffer `name` -> its positions [0, T), the valid (m) ones
    c, at = cache[name][i], cache_at(name, slice(None), slice(0, T))
    return c.at[at].set(jnp.where(m, new.astype(c.dtype), c[at]))

  def attn(q, k, v, i):
    o = pallas_kernels.attention(q, k, v, segment_ids, causal=True, impl=attn_impl)
    kc = write("k", i, k.transpose(0, 2, 3, 1), valid[:, None, None, :])  # [B,T,K,H] -> [B,K,H,T]
    vc = write("v", i, v.transpose(0, 2, 1, 3), valid[:, None, :, None])  # [B,T,K,H] -> [B,K,T,H]
    return o, (kc, vc)

  h, filled = _run_cached(params, cfg, tokens, positions, attn, lengths)
  return logits_from_hidden(params, cfg, h[jnp.arange(B), lengths - 1]), filled


def decode_step(params, cfg, tokens, cache, *, attn_impl="auto"):
  """One token per row: tokens [B] go to position cache.lengths[b]; returns (logits [B,V] fp32, cache)."""
  _check_tokens(tokens, 1, "decode_step")
  lengths = cache["lengths"]
  rows = jnp.arange(tokens.shape[0])

  def attn(q, k, v, i):  # write the new token into layer i's (donated) cache in place, then attend to it
    kc = cache["k"][i].at[cache_at("k", rows, lengths)].set(k[:, 0].astype(cache["k"][i].dtype))  # [b,:,:,len_b]
    vc = cache["v"][i].at[cache_at("v", rows, lengths)].set(v[:, 0].astype(cache["v"][i].dtype))  # [b,:,len_b]
    o = pallas_kernels.decode_attention(q[:, 0], kc, vc, lengths + 1, impl=attn_impl)
    return o[:, None], (kc, vc)

  h, written = _run_cached(params, cfg, tokens[:, None], lengths[:, None], attn, lengths + 1)
  return logits_from_hidden(params, cfg, h[:, 0]), written


# ----------------------------------------------------------------------------------------------------- HF I/O

# Our param -> (HF name; under model.layers.{i}. for layer params, number of leading "in" dims of ours).
# HF nn.Linear stores [out, in], ours [in..., out...]: ours = W.T.reshape(...), W = ours.reshape(in, out).T.
# n_in None: not a Linear weight, flattened (biases [N*H] <-> [N,H], norms); "same": identical layout (embed).
_HF_LAYER = {"attn_norm": ("input_layernorm.weight", None), "mlp_norm": ("post_attention_layernorm.weight", None),
             **{f"w{p}": (f"self_attn.{p}_proj.weight", 2 if p == "o" else 1) for p in "qkvo"},
             **{f"b{p}": (f"self_attn.{p}_proj.bias", None) for p in "qkv"},
             **{f"{p}_norm": (f"self_attn.{p}_norm.weight", None) for p in "qk"},
             **{f"w_{p}": (f"mlp.{p}_proj.weight", 1) for p in ("gate", "up", "down")}}
_HF_TOP = {"embed": ("model.embed_tokens.weight", "same"), "final_norm": ("model.norm.weight", None),
           "lm_head": ("lm_head.weight", 1)}
_HF_DTYPES = {"F32": np.dtype(np.float32), "BF16": np.dtype(ml_dtypes.bfloat16), "F16": np.dtype(np.float16)}


def _hf_names(cfg):
  """Yields (our path, layer index or None, HF tensor name, n_in, our per-layer shape), in HF order."""
  axes = param_axes(cfg)
  for name, (shape, _) in ((n, a) for n, a in axes.items() if n != "layers"):
    yield (name,), None, _HF_TOP[name][0], _HF_TOP[name][1], shape
  for name, (shape, _) in axes["layers"].items():
    suffix, n_in = _HF_LAYER[name]
    for i in range(cfg.n_layers):
      yield ("layers", name), i, f"model.layers.{i}.{suffix}", n_in, shape[1:]


def _hf_shape(n_in, shape):
  if n_in in (None, "same"):
    return tuple(shape) if n_in == "same" else (math.prod(shape),)
  return (math.prod(shape[n_in:]), math.prod(shape[:n_in]))  # torch Linear [out, in]


def _to_hf(w, n_in):
  hf_shape = _hf_shape(n_in, w.shape)
  return np.ascontiguousarray(w.reshape(hf_shape) if n_in in (None, "same") else w.reshape(hf_shape[::-1]).T)


def _np_dtype(dtype):
  d = jnp.dtype(dtype)
  if d not in _HF_DTYPES.values():
    raise ValueError(f"dtype must be float32, bfloat16 or float16, got {d}")
  return d


def load_hf_checkpoint(path, dtype=None, mesh=None):
  """(cfg, params) of an HF checkpoint directory (config.json + model.safetensors or index.json shards); dtype None
  keeps the embedding's. With a mesh every param is built in its sharding (param_shardings) from the slices this
  process's devices hold, each read straight from safetensors: no process reads, and no device holds, a whole
  tensor it does not keep (a 32B model never lands on one chip). Without one, whole arrays on the default device.
  ValueError names the file and tensor that is missing, unexpected, mis-shaped or non-finite."""
  from safetensors import safe_open  # numpy API; bf16 arrives as ml_dtypes.bfloat16
  cfg = Config.from_hf(path)
  index_fn = os.path.join(path, "model.safetensors.index.json")
  if os.path.isfile(index_fn):
    with open(index_fn) as f:
      weight_map = json.load(f).get("weight_map")
    if not isinstance(weight_map, dict):
      raise ValueError(f"{index_fn}: missing 'weight_map' object")
    files = sorted(set(weight_map.values()))
  else:
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
  if not files:
    raise ValueError(f"{path}: no *.safetensors files")
  handles, where = {}, {}
  for fn in files:
    full = os.path.join(path, fn)
    if not os.path.isfile(full):
      raise ValueError(f"{index_fn}: lists missing file {fn!r}")
    try:
      handles[fn] = safe_open(full, framework="numpy")
    except Exception as e:  # SafetensorError on a truncated or corrupt header
      raise ValueError(f"{full}: not a readable safetensors file ({type(e).__name__}: {e})") from None
    where.update(dict.fromkeys(handles[fn].keys(), fn))
  if dtype is None:
    if "model.embed_tokens.weight" not in where:
      raise ValueError(f"{path}: missing tensor 'model.embed_tokens.weight'")
    dtype = handles[where["model.embed_tokens.weight"]].get_slice("model.embed_tokens.weight").get_dtype()
    dtype = _HF_DTYPES.get(dtype, dtype)
  dtype = _np_dtype(dtype)
  # Every tensor's presence and shape from the headers alone, before any data is read.
  names = {}  # our path -> [(layer, HF name, n_in, per-layer shape)]
  for key, layer, hf_name, n_in, shape in _hf_names(cfg):
    if hf_name not in where:
      raise ValueError(f"{path}: missing tensor {hf_name!r} (config {cfg.arch}, tie={cfg.tie_embeddings})")
    got = tuple(handles[where[hf_name]].get_slice(hf_name).get_shape())
    if got != _hf_shape(n_in, shape):
      raise ValueError(f"{where[hf_name]}: tensor {hf_name!r} has shape {got}, config implies {_hf_shape(n_in, shape)}")
    names.setdefault(key, []).append((layer, hf_name, n_in, shape))
  # Derived buffers we recompute, and a redundant lm_head in tied checkpoints, are fine to skip.
  seen = {e[1] for v in names.values() for e in v}
  extra = [n for n in where if n not in seen and not n.endswith("rotary_emb.inv_freq")
           and not (cfg.tie_embeddings and n == "lm_head.weight")]
  if extra:
    raise ValueError(f"{where[extra[0]]}: unexpected tensor {extra[0]!r} ({len(extra)} unexpected in total)")

  def read(hf_name, n_in, shape, idx):
    try:
      w = _read_slice(handles[where[hf_name]].get_slice(hf_name), n_in, shape, idx)
    except Exception as e:  # data section shorter than the header says (a truncated copy)
      raise ValueError(f"{os.path.join(path, where[hf_name])}: cannot read tensor {hf_name!r} "
                       f"({type(e).__name__}: {e}); truncated file?") from None
    if not np.isfinite(w).all():  # a NaN/inf weight would silently poison every step and rollout
      raise ValueError(f"{where[hf_name]}: tensor {hf_name!r} has non-finite values "
                       f"({int((~np.isfinite(w)).sum())} of {w.size})")
    return w.astype(dtype)

  def leaf(key, sharding):
    parts = names[key]
    layered = parts[0][0] is not None
    shape = ((cfg.n_layers,) if layered else ()) + tuple(parts[0][3])

    @functools.lru_cache(maxsize=None)  # devices holding the same slice (replicas) read it once
    def piece(idx):
      idx = tuple(slice(*s) for s in idx)
      if not layered:
        return read(parts[0][1], parts[0][2], shape, idx)
      return np.stack([read(hf, n_in, shape[1:], idx[1:]) for _, hf, n_in, _ in parts[idx[0]]])
    return jax.make_array_from_callback(shape, sharding, lambda idx: piece(
        tuple(s.indices(d) for s, d in zip(idx, shape))), dtype=dtype)

  shardings = (param_shardings(cfg, mesh) if mesh is not None else
               jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(jax.local_devices()[0]), param_axes(cfg),
                            is_leaf=_is_leaf))
  try:
    out = {n: leaf((n,), shardings[n]) for n in shardings if n != "layers"}
    out["layers"] = {n: leaf(("layers", n), shardings["layers"][n]) for n in shardings["layers"]}
  finally:
    handles.clear()
  return cfg, out


def _read_slice(sl, n_in, shape, idx):
  """Our tensor's slice idx (slices over our per-layer `shape`) from an HF tensor's safetensors slice `sl`,
  reading only the HF rows and columns of the leading dim of our in dims and of our out dims (the trailing dims of
  each group are read whole, then cut): HF Linear weights are [out..., in...] flattened to 2-D, ours [in..., out...]."""
  def span(sls, dims):  # a group's flat HF range covering its first dim's slice, and the cuts of the rest
    inner = math.prod(dims[1:])
    return slice(sls[0].start * inner, sls[0].stop * inner), (sls[0].stop - sls[0].start, *dims[1:]), sls[1:]
  if n_in == "same":  # same layout as HF (the embedding)
    return sl[tuple(idx)]
  if n_in is None:  # a vector HF stores flat (norms, biases [N*H] <- [N, H])
    rows, box, rest = span(idx, shape)
    return sl[rows].reshape(box)[(slice(None), *rest)]
  (ri, bi, ci), (ro, bo, co) = span(idx[:n_in], shape[:n_in]), span(idx[n_in:], shape[n_in:])
  w = sl[ro, ri].T.reshape(*bi, *bo)  # [in rows, out rows] -> our layout
  return np.ascontiguousarray(w[(slice(None), *ci, slice(None), *co)])


def hf_piece(params, key, layer, axis, rows):
  """The piece save_hf_checkpoint_streamed asks for, as a (possibly sharded) array: params[key], layer `layer` of a
  layer-stacked tensor, cut to `rows` along `axis` (None: whole). Slicing on the device keeps a sharded array's
  other slices where they are."""
  x = params[key[0]] if len(key) == 1 else params["layers"][key[1]][layer]
  return x if axis is None else jax.lax.slice_in_dim(x, rows.start, rows.stop, axis=axis)


def save_hf_checkpoint(path, cfg, params, dtype=None):
  """save_hf_checkpoint_streamed of params (fully addressable from this process); dtype None: the params'."""
  save_hf_checkpoint_streamed(path, cfg, lambda *a: np.asarray(jax.device_get(hf_piece(params, *a))),
                              params["embed"].dtype if dtype is None else dtype)


def save_hf_checkpoint_streamed(path, cfg, get_piece, dtype, write=True, chunk_bytes=256 << 20):
  """Writes config.json + one model.safetensors (HF Linear weights [out,in]; transformers loads it) one piece at a
  time: get_piece(key, layer, axis, rows) returns, as numpy, our tensor `key` (e.g. ("layers", "wq")) of `layer`
  (None: not layer-stacked), cut to `rows` (a slice) along `axis` (None: whole), where the cut is whole HF rows:
  the first out dim of a Linear weight, dim 0 of the embedding. Pieces hold at most ~chunk_bytes, so a sharded
  trainer gathers one layer's slice at a time (train.export_hf), never a whole tensor. The header follows from
  the shapes, so it is written first and the bytes stream after it. write=False only calls get_piece (the other
  processes of a collective gather)."""
  dtype = _np_dtype(dtype)
  names = list(_hf_names(cfg))
  header, off = {}, 0
  for _, _, hf_name, n_in, shape in names:
    hf_shape = _hf_shape(n_in, shape)
    n = math.prod(hf_shape) * dtype.itemsize
    header[hf_name] = {"dtype": {v: k for k, v in _HF_DTYPES.items()}[dtype], "shape": list(hf_shape),
                       "data_offsets": [off, off + n]}
    off += n
  f = None
  if write:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as cf:
      json.dump(cfg.to_hf_dict(dtype=dtype), cf, indent=2)
    hb = json.dumps(dict(header, __metadata__={"format": "pt"}), separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    f = open(os.path.join(path, "model.safetensors"), "wb")
    f.write(len(hb).to_bytes(8, "little") + hb)
  try:
    for key, layer, hf_name, n_in, shape in names:
      axis = None if n_in is None else (0 if n_in == "same" else n_in)  # the axis of whole HF rows
      step = (max(1, chunk_bytes // (math.prod(shape) // shape[axis] * dtype.itemsize)) if axis is not None else 1)
      for r in range(0, 1 if axis is None else shape[axis], step):
        w = get_piece(key, layer, axis, None if axis is None else slice(r, min(r + step, shape[axis])))
        if f is not None:
          f.write(_to_hf(w.astype(dtype), n_in).tobytes())
        del w
  finally:
    if f is not None:
      f.close()
