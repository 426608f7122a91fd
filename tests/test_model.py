"""model.py against the Hugging Face reference (torch CPU), plus cache, packing and sharding invariants.

Run: XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu python -m pytest -q tests/test_model.py
"""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import pallas_kernels as kernels
import model as M

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

FAMILIES = {
    # Qwen2: QKV bias, tied embeddings (like Qwen2.5-0.5B), GQA 8q/2kv.
    "qwen2": (transformers.Qwen2Config, dict(num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True,
                                            rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    # Qwen3: q/k RMSNorm, head_dim != d_model / heads, untied.
    "qwen3": (transformers.Qwen3Config, dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                            tie_word_embeddings=False)),
    # Llama with Llama-3 rope scaling; original context 16 puts the head-dim frequencies in all three bands.
    "llama": (transformers.LlamaConfig, dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=False,
                                            rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0,
                                                             "factor": 8.0, "low_freq_factor": 1.0,
                                                             "high_freq_factor": 4.0,
                                                             "original_max_position_embeddings": 16})),
}
VOCAB = 256


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)


def _hf_model(family, seed=0):
  cls, kw = FAMILIES[family]
  hf_cfg = cls(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, rms_norm_eps=1e-5,
               max_position_embeddings=256, bos_token_id=None, eos_token_id=None, pad_token_id=None, **kw)
  torch.manual_seed(seed)
  m = transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="eager").eval()
  # HF init zeroes biases and sets norms to 1: randomize everything so loading each tensor really matters.
  # Std 0.1 makes the logits peaked enough that greedy decoding has no near-ties.
  with torch.no_grad():
    for name, p in m.named_parameters():
      if "norm" in name:
        p.copy_(1 + 0.2 * torch.randn_like(p))
      elif name.endswith("bias"):
        p.copy_(0.2 * torch.randn_like(p))
      else:
        p.copy_(0.1 * torch.randn_like(p))
  return m


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
  """family -> (checkpoint dir, HF model) saved with HF's own save_pretrained (fp32)."""
  out = {}
  for family in FAMILIES:
    m = _hf_model(family)
    d = str(tmp_path_factory.mktemp(family))
    m.save_pretrained(d)
    out[family] = (d, m)
  return out


# One (B, T) and cache length for every forward/prefill/decode on the HF families: each compiles once per family.
B, T, S = 2, 16, 48


def _tokens(B, T, seed=0):
  return np.random.default_rng(seed).integers(0, VOCAB, (B, T)).astype(np.int32)


def _hf_logits(m, tokens):
  with torch.no_grad():
    return m(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()


# LLVM backend optimization level 0: ~2-3x faster compiles on 2 busy cores. It only changes how XLA's
# (already optimized and partitioned) HLO is lowered to machine code, not what is computed, and the fp32
# checks below pass at the default level too (`FAST = {}` to verify).
FAST = {"xla_backend_optimization_level": 0}
fwd = jax.jit(M.forward, static_argnums=1, compiler_options=FAST)
prefill = jax.jit(M.prefill, static_argnums=1, compiler_options=FAST)
decode = jax.jit(M.decode_step, static_argnums=1, compiler_options=FAST)


# --------------------------------------------------------------------------------------------------- config

def test_config_json_as_written_by_installed_transformers(ckpts):
  d, _ = ckpts["llama"]
  raw = json.load(open(os.path.join(d, "config.json")))
  assert "rope_parameters" in raw  # transformers 5 spelling; 4.x spelling is covered below
  cfg = M.Config.from_hf(d)
  assert (cfg.arch, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.tie_embeddings) == ("LlamaForCausalLM", 4, 1,
                                                                                      16, False)
  assert dict(cfg.rope_scaling)["original_max_position_embeddings"] == 16
  q2, q3 = M.Config.from_hf(ckpts["qwen2"][0]), M.Config.from_hf(ckpts["qwen3"][0])
  assert (q2.qkv_bias, q2.qk_norm, q2.tie_embeddings, q2.rope_theta, q2.head_dim) == (True, False, True, 1e6, 8)
  assert (q3.qkv_bias, q3.qk_norm, q3.head_dim) == (False, True, 16)
  hash(cfg)  # static jit arg


def test_config_transformers4_spelling_equals_5():
  base = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128, hidden_size=64,
              intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
  scaling = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)
  v4 = M.Config.from_hf_dict({**base, "rope_theta": 5e5, "torch_dtype": "bfloat16",
                              "rope_scaling": {"type": "llama3", **scaling}})
  v5 = M.Config.from_hf_dict({**base, "dtype": "bfloat16",
                              "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **scaling}})
  assert v4 == v5 and v4.rope_theta == 5e5
  assert M.Config.from_hf_dict(v5.to_hf_dict()) == v5
  # No head_dim: d_model // n_heads for llama/qwen2 (Qwen3's HF default is 128, mirrored).
  assert v4.head_dim == 16
  q3 = M.Config.from_hf_dict({**base, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]})
  assert q3.head_dim == 128 and q3.qk_norm


@pytest.mark.parametrize("patch,field", [
    ({"model_type": "gpt2"}, "model_type"),
    ({"num_key_value_heads": 3}, "n_kv_heads"),
    ({"vocab_size": None}, "vocab_size"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "rope_type"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 4.0}}, "low_freq_factor"),
    ({"attention_bias": True}, "attention_bias"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"architectures": ["Qwen2ForCausalLM"]}, "architectures"),
    ({"num_hidden_layers": 0}, "n_layers"),
])
def test_config_errors_name_the_field(patch, field):
  d = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128, hidden_size=64,
           intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
  d.update(patch)
  with pytest.raises(ValueError, match=field):
    M.Config.from_hf_dict(d, source="x/config.json")


def test_config_family_flags_enforced():
  with pytest.raises(ValueError, match="qkv_bias"):
    M.Config(vocab_size=8, d_model=8, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=4, ffw_dim=8,
             arch="LlamaForCausalLM", qkv_bias=True)


# ----------------------------------------------------------------------------------------- HF numerics, I/O

@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_hf(ckpts, family):
  d, m = ckpts[family]
  cfg, params = M.load_hf_checkpoint(d)
  assert params["embed"].dtype == jnp.float32
  tokens = _tokens(B, T, seed=1)
  ref = _hf_logits(m, tokens)
  ours = np.asarray(fwd(params, cfg, jnp.asarray(tokens)))
  assert ours.dtype == np.float32 and ours.shape == ref.shape
  err = _rel(ours, ref)
  print(f"\n{family}: logits max|ours-hf|/max|hf| = {err:.1e}")
  assert err < 1e-4, err


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_generation_matches_hf(ckpts, family):
  d, m = ckpts[family]
  cfg, params = M.load_hf_checkpoint(d)
  p_len, n_new = 7, 32
  prompt = _tokens(B, p_len, seed=2)
  with torch.no_grad():
    ref = m.generate(torch.tensor(prompt, dtype=torch.long), attention_mask=torch.ones(prompt.shape, dtype=torch.long),
                     max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False)[:, p_len:].numpy()
  padded = np.zeros((B, T), np.int32)
  padded[:, :p_len] = prompt
  logits, cache = prefill(params, cfg, jnp.asarray(padded), jnp.full((B,), p_len), M.init_cache(cfg, B, S))
  out = []
  for _ in range(n_new):
    tok = jnp.argmax(logits, -1).astype(jnp.int32)
    out.append(np.asarray(tok))
    logits, cache = decode(params, cfg, tok, cache)
  out = np.stack(out, 1)
  assert all(len(set(row)) > 1 for row in out)  # non-degenerate continuations
  np.testing.assert_array_equal(out, ref)


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_save_then_hf_load_same_logits(ckpts, family, tmp_path):
  d, _ = ckpts[family]
  cfg, params = M.load_hf_checkpoint(d)
  out = str(tmp_path / "ours")
  M.save_hf_checkpoint(out, cfg, params)
  hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager", dtype=torch.float32)
  tokens = _tokens(B, T, seed=3)
  ours = np.asarray(fwd(params, cfg, jnp.asarray(tokens)))
  assert _rel(_hf_logits(hf, tokens), ours) < 1e-4
  # And our own loader reads it back bit-exactly.
  cfg2, params2 = M.load_hf_checkpoint(out)
  assert cfg2 == cfg
  jax.tree.map(np.testing.assert_array_equal, params2, params)


def test_save_single_file_qwen3_roundtrip(ckpts, tmp_path):
  d, _ = ckpts["qwen3"]
  cfg, params = M.load_hf_checkpoint(d)
  M.save_hf_checkpoint(str(tmp_path), cfg, params)
  assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
  hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager",
                                                         dtype=torch.float32)
  tokens = _tokens(B, T, seed=4)
  assert _rel(_hf_logits(hf, tokens), np.asarray(fwd(params, cfg, jnp.asarray(tokens)))) < 1e-4


def test_load_hf_sharded_index(ckpts, tmp_path):
  d, m = ckpts["qwen3"]
  m.save_pretrained(str(tmp_path), max_shard_size="50KB")
  files = [f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]
  assert len(files) > 1 and os.path.isfile(tmp_path / "model.safetensors.index.json")
  _, sharded = M.load_hf_checkpoint(str(tmp_path))
  _, single = M.load_hf_checkpoint(d)
  jax.tree.map(np.testing.assert_array_equal, sharded, single)


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_load_with_a_mesh_reads_each_slice_into_place(ckpts, family, monkeypatch):
  """Loading onto a mesh: every param lands in its sharding (param_shardings), the values are the whole-array
  load's bit for bit, and no read of a sharded tensor covers the whole tensor (each device's slice is read)."""
  d, _ = ckpts[family]
  _, single = M.load_hf_checkpoint(d)
  reads = []
  real = M._read_slice
  monkeypatch.setattr(M, "_read_slice", lambda sl, n_in, shape, idx: reads.append(
      (sl.get_shape(), out := real(sl, n_in, shape, idx))) or out)
  mesh = M.make_mesh(1, 2, 4)
  cfg, params = M.load_hf_checkpoint(d, mesh=mesh)
  want = M.param_shardings(cfg, mesh)
  for (path, x), s, y in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(want),
                             jax.tree.leaves(single)):
    assert x.sharding == s, path
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  sharded = {tuple(shape) for shape, _ in reads if len(shape) == 2}  # the 2-D (matrix) tensors
  assert sharded and all(out.size < np.prod(shape) for shape, out in reads if len(shape) == 2)
  assert len(params["layers"]["wq"].sharding.device_set) == 8


def test_load_bf16_checkpoint(tmp_path):
  m16 = _hf_model("qwen2").to(torch.bfloat16)
  m16.save_pretrained(str(tmp_path))
  cfg, p16 = M.load_hf_checkpoint(str(tmp_path))
  assert p16["embed"].dtype == jnp.bfloat16 and p16["layers"]["bq"].dtype == jnp.bfloat16
  tokens = _tokens(B, T, seed=5)
  # Upcast on load: exactly HF loading the bf16 checkpoint into fp32 (a fresh load, so its RoPE inv_freq
  # buffer is fp32 rather than the bf16-rounded one m16 carries).
  _, p32 = M.load_hf_checkpoint(str(tmp_path), dtype=jnp.float32)
  ref = _hf_logits(transformers.AutoModelForCausalLM.from_pretrained(
      str(tmp_path), attn_implementation="eager", dtype=torch.float32), tokens)
  assert _rel(np.asarray(fwd(p32, cfg, jnp.asarray(tokens))), ref) < 1e-4
  # bf16 compute (bf16 matmuls, fp32 accumulation): logits fp32 and close to the fp32 result.
  l16 = np.asarray(fwd(p16, cfg, jnp.asarray(tokens)))
  assert l16.dtype == np.float32 and _rel(l16, ref) < 5e-2


def test_load_errors(ckpts, tmp_path):
  import shutil
  from safetensors.numpy import load_file, save_file
  d, _ = ckpts["qwen3"]
  shutil.copy(os.path.join(d, "config.json"), tmp_path / "config.json")
  t = load_file(os.path.join(d, "model.safetensors"))
  missing = {k: v for k, v in t.items() if k != "model.layers.1.self_attn.k_norm.weight"}
  save_file(missing, str(tmp_path / "model.safetensors"))
  with pytest.raises(ValueError, match="model.layers.1.self_attn.k_norm.weight"):
    M.load_hf_checkpoint(str(tmp_path))
  save_file({**t, "model.layers.0.self_attn.q_proj.weight": np.zeros((3, 3), np.float32)},
            str(tmp_path / "model.safetensors"))
  with pytest.raises(ValueError, match="q_proj.weight.*shape"):
    M.load_hf_checkpoint(str(tmp_path))
  save_file({**t, "model.layers.0.self_attn.q_proj.bias": np.zeros((64,), np.float32)},
            str(tmp_path / "model.safetensors"))
  with pytest.raises(ValueError, match="unexpected tensor.*q_proj.bias"):
    M.load_hf_checkpoint(str(tmp_path))


# ----------------------------------------------------------------------------------- cache, packing (ours)

def test_prefill_decode_equals_forward_ragged(ckpts):
  cfg, params = M.load_hf_checkpoint(ckpts["qwen3"][0])
  n_steps = 6
  seqs = _tokens(B, T, seed=6)
  lengths = np.array([5, 9])
  full = np.asarray(fwd(params, cfg, jnp.asarray(seqs)))  # causal: row b's logit at t sees only seqs[b, :t+1]
  prompts = np.where(np.arange(T)[None] < lengths[:, None], seqs, 0)  # right-padded
  logits, cache = prefill(params, cfg, jnp.asarray(prompts), jnp.asarray(lengths), M.init_cache(cfg, B, S))
  np.testing.assert_array_equal(np.asarray(cache["lengths"]), lengths)
  got = [np.asarray(logits)]
  for i in range(n_steps):
    logits, cache = decode(params, cfg, jnp.asarray(seqs[np.arange(B), lengths + i]), cache)
    got.append(np.asarray(logits))
  for i, g in enumerate(got):
    want = full[np.arange(B), lengths - 1 + i]
    assert _rel(g, want) < 1e-5, (i, _rel(g, want))
  print(f"\nprefill+decode vs forward: max rel err {max(_rel(g, full[np.arange(B), lengths - 1 + i]) for i, g in enumerate(got)):.1e}")
  np.testing.assert_array_equal(np.asarray(cache["lengths"]), lengths + n_steps)
  # Row 0 holds exactly prompt + decoded tokens; slots past that stay zero (prefill padding is not written).
  k = np.stack([np.asarray(c) for c in cache["k"]]).swapaxes(-1, -2)  # [L,B,K,H,S] -> [L,B,K,S,H]
  v = np.stack([np.asarray(c) for c in cache["v"]])  # [L,B,K,S,H]
  for x in (k, v):
    assert np.all(x[:, 0, :, lengths[0] + n_steps:] == 0)
    assert np.all(np.abs(x[:, 0, :, :lengths[0] + n_steps]).sum(-1) > 0)


def test_packed_segments_equal_separate_sequences(ckpts):
  cfg, params = M.load_hf_checkpoint(ckpts["qwen2"][0])
  a, b = _tokens(1, 7, seed=7)[0], _tokens(1, 9, seed=8)[0]
  packed = np.stack([np.concatenate([a, b]), np.concatenate([b, a])])
  seg = np.array([[1] * 7 + [2] * 9, [1] * 9 + [2] * 7], np.int32)
  pos = np.array([list(range(7)) + list(range(9)), list(range(9)) + list(range(7))], np.int32)
  out = np.asarray(fwd(params, cfg, jnp.asarray(packed), jnp.asarray(pos), jnp.asarray(seg)))
  sep = np.zeros((B, T), np.int32)  # right padding cannot affect causal logits
  sep[0, :7], sep[1, :9] = a, b
  alone = np.asarray(fwd(params, cfg, jnp.asarray(sep)))
  for got, want in [(out[0, :7], alone[0, :7]), (out[0, 7:], alone[1, :9]), (out[1, :9], alone[1, :9]),
                    (out[1, 9:], alone[0, :7])]:
    assert _rel(got, want) < 1e-5
  # Without segment ids the second sequence would see the first: the test can tell the difference.
  mixed = np.asarray(fwd(params, cfg, jnp.asarray(packed), jnp.asarray(pos)))
  assert _rel(mixed[0, 7:], out[0, 7:]) > 1e-3


def test_forward_hidden_and_chunked_logits(ckpts):
  cfg, params = M.load_hf_checkpoint(ckpts["llama"][0])
  tokens = jnp.asarray(_tokens(B, T, seed=9))
  h = jax.jit(M.forward_hidden, static_argnums=1, compiler_options=FAST)(params, cfg, tokens)
  assert h.shape == (B, T, cfg.d_model) and h.dtype == jnp.float32
  chunks = jnp.concatenate([M.logits_from_hidden(params, cfg, h[:, i:i + 4]) for i in range(0, T, 4)], 1)
  assert _rel(chunks, fwd(params, cfg, tokens)) < 1e-6


# --------------------------------------------------------------------------------------------- sharding

SHARD_CFG = M.Config(vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=8, n_kv_heads=2, head_dim=8, ffw_dim=128,
                     qkv_bias=True, arch="Qwen2ForCausalLM", rope_theta=1e4)



def test_logical_spec_fallback_rule():
  m118 = M.make_mesh(1, 1, 8)
  specs = M.param_specs(SHARD_CFG, m118)
  assert specs["layers"]["wq"] == P(None, None, "tensor", None)
  assert specs["layers"]["wk"] == P(None, None, None, None)  # K=2 not divisible by 8: replicated
  assert specs["embed"] == P("tensor", None)
  m222 = M.make_mesh(2, 2, 2)
  specs = M.param_specs(SHARD_CFG, m222)
  assert specs["layers"]["wk"] == P(None, "fsdp", "tensor", None)
  assert specs["lm_head"] == P("fsdp", "tensor")
  m181 = M.make_mesh(1, 8, 1)
  assert M.logical_spec(("batch", "seq", "act_embed"), (8, 4, 64), m181) == P("fsdp", None, None)
  assert M.logical_spec(("batch", "seq"), (2, 4), m222) == P("data", None)  # 2 % (2*2): keep data only
  assert M.logical_spec(("batch", "seq"), (3, 4), m222) == P(None, None)
  with pytest.raises(ValueError, match="mesh"):
    M.param_specs(SHARD_CFG)
  with pytest.raises(ValueError, match="devices"):
    M.make_mesh(4, 4, 1)


def _loss(params, cfg, tokens, remat):
  logits = M.forward(params, cfg, tokens, remat=remat)
  logp = jax.nn.log_softmax(logits[:, :-1])
  return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1)), logits


def _generate(params, cfg, tokens, lengths):
  # Prefill 8 right-padded tokens, then 3 teacher-forced decode steps in a scan (as a rollout loop runs).
  lg0, cache = M.prefill(params, cfg, tokens[:, :8], lengths, M.init_cache(cfg, tokens.shape[0], 16))

  def step(cache, tok):
    lg, cache = M.decode_step(params, cfg, tok, cache)
    return cache, lg

  cache, lgs = jax.lax.scan(step, cache, tokens[:, 8:11].T)
  return jnp.concatenate([lg0[None], lgs]), cache


grad_fn = jax.jit(jax.grad(_loss, has_aux=True), static_argnums=(1, 3), compiler_options=FAST)
gen_fn = jax.jit(_generate, static_argnums=1, compiler_options=FAST)


@pytest.fixture(scope="module")
def shard_case():
  """Random params (every leaf perturbed, so biases and norms matter) and the 1-device results (no remat)."""
  params = M.init_params(SHARD_CFG, jax.random.key(0))
  leaves, tdef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(1), len(leaves))
  params = jax.tree.unflatten(tdef, [x + 0.1 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])
  tokens = jnp.asarray(_tokens(8, 16, seed=10))
  lengths = jnp.array([8, 3, 5, 8, 1, 7, 2, 6], jnp.int32)
  grads, logits = grad_fn(params, SHARD_CFG, tokens, False)
  return params, tokens, lengths, (logits, grads, *gen_fn(params, SHARD_CFG, tokens, lengths))


@pytest.mark.parametrize("shape", [(8, 1, 1), (1, 8, 1), (2, 2, 2), (1, 1, 8)])
def test_sharded_equals_single_device(shape, shard_case):
  assert jax.device_count() == 8, "tests/conftest.py sets 8 fake CPU devices"
  params, tokens, lengths, (ref_logits, ref_grads, ref_dec, ref_cache) = shard_case
  cfg, mesh = SHARD_CFG, M.make_mesh(*shape)
  sp = M.shard_params(params, cfg, mesh)
  stokens = jax.device_put(tokens, NamedSharding(mesh, M.logical_spec(("batch", "seq"), tokens.shape, mesh)))
  with jax.set_mesh(mesh):
    grads, logits = grad_fn(sp, cfg, stokens, True)  # remat on here: also checks remat changes no value
    dec, cache = gen_fn(sp, cfg, stokens, lengths)
  errs = [_rel(logits, ref_logits), max(_rel(g, r) for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads))),
          _rel(dec, ref_dec)]
  print(f"\nmesh {shape}: rel err vs 1 device: logits {errs[0]:.1e}, grads {errs[1]:.1e}, decode {errs[2]:.1e}")
  assert _rel(logits, ref_logits) < 1e-5
  for (path, g), r in zip(jax.tree.flatten_with_path(grads)[0], jax.tree.leaves(ref_grads)):
    assert _rel(g, r) < 1e-5, (path, _rel(g, r))
  assert _rel(dec, ref_dec) < 1e-5
  np.testing.assert_array_equal(np.asarray(cache["lengths"]), np.asarray(ref_cache["lengths"]))
  for name in ("k", "v"):
    assert len(cache[name]) == cfg.n_layers and max(_rel(a, b) for a, b in zip(cache[name], ref_cache[name])) < 1e-5
  # The outputs really are distributed as the table says (not silently replicated).
  want = M.logical_spec(("batch", "seq", "vocab"), logits.shape, mesh)
  assert logits.sharding.is_equivalent_to(NamedSharding(mesh, want), 3), (logits.sharding, want)
  for name in ("k", "v"):
    want = M.logical_spec(M.cache_axes()[name], cache[name][0].shape, mesh)
    for c in cache[name]:
      assert c.sharding.is_equivalent_to(NamedSharding(mesh, want), 4), (name, c.sharding, want)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_projection_backward_equals_autodiff(dtype, monkeypatch):
  """M._proj's hand-written backward (two flat matmuls, issue 17: XLA CPU ran autodiff's at a third of its
  matmul speed) gives autodiff's gradients: each projection form, and the whole model's loss gradient."""
  rng = np.random.default_rng(0)
  R = lambda *s: jnp.asarray(rng.standard_normal(s).astype(np.float32))  # noqa: E731
  for eq, xs, ws in (("btd,dnh->btnh", (2, 3, 8), (8, 4, 5)), ("btnh,nhd->btd", (2, 3, 4, 5), (4, 5, 8)),
                     ("...d,dv->...v", (2, 3, 8), (8, 7))):
    x, w = R(*xs), R(*ws).astype(dtype)
    ct = R(*M._dot(eq, x, w).shape)
    ours = jax.grad(lambda x, w: (M._dot(eq, x, w) * ct).sum(), (0, 1))(x, w)
    auto = jax.grad(lambda x, w: (jnp.einsum(eq, x.astype(w.dtype), w, preferred_element_type=jnp.float32)
                                  * ct).sum(), (0, 1))(x, w)
    for a, b in zip(ours, auto):
      assert a.dtype == b.dtype and a.shape == b.shape
      np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-6, atol=1e-6)
  tokens = jnp.asarray(rng.integers(0, 64, (2, 9)), jnp.int32)
  einsum = lambda eq, x, w: jnp.einsum(eq, x, w, preferred_element_type=jnp.float32)  # noqa: E731
  for tie in (False, True):  # tied: the lm head is _proj on embed^T, its gradient summed with the gather's
    cfg = M.Config(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffw_dim=48,
                   tie_embeddings=tie, qkv_bias=True, arch="Qwen2ForCausalLM")
    params = jax.tree.map(lambda a: a.astype(dtype), M.init_params(cfg, jax.random.PRNGKey(0)))
    loss = lambda p: jax.nn.log_softmax(M.forward(p, cfg, tokens)).mean()  # noqa: E731
    ours = jax.grad(loss)(params)
    with monkeypatch.context() as mp:
      mp.setattr(M, "_proj", einsum)
      auto = jax.grad(loss)(params)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(ours), jax.tree.leaves(auto)):
      np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-5, atol=1e-7,
                                 err_msg=f"tie={tie} {jax.tree_util.keystr(path)}")


def test_unrolled_training_forward_equals_the_layer_scan():
  """forward_hidden unrolls the layer scan on CPU (model.py: the scan's slices and stacks are copies there);
  it must give the scan's hidden states and gradients (the same ops, up to summation order)."""
  cfg = M.Config(vocab_size=64, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8, ffw_dim=48,
                 tie_embeddings=True, qkv_bias=True, arch="Qwen2ForCausalLM")
  params = M.init_params(cfg, jax.random.PRNGKey(1))
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, 64, (2, 9)), jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(9), (2, 9))
  attn = lambda q, k, v, _: (kernels.attention(q, k, v, causal=True), None)  # noqa: E731
  hidden = {u: jax.jit(lambda p, u=u: M._run(p, cfg, tokens, pos, attn, unroll=u)) for u in (False, True)}
  grads = {u: jax.jit(jax.grad(lambda p, u=u: jnp.sum(M._run(p, cfg, tokens, pos, attn, unroll=u) ** 2)))
           for u in (False, True)}
  assert jax.default_backend() == "cpu"
  np.testing.assert_allclose(M.forward_hidden(params, cfg, tokens), hidden[False](params), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(hidden[True](params), hidden[False](params), rtol=1e-6, atol=1e-6)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads[True](params)),
                          jax.tree.leaves(grads[False](params))):
    # Summation order may differ (the embedding's scatter-add: 3e-5 on gradients up to 1.5), so scale-relative.
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-4 * float(jnp.abs(b).max()), err_msg=jax.tree_util.keystr(path))
