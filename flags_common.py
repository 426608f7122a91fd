"""The absl flags train.py and rollout.py share (same names and meaning), defined once: each entry point's
define_flags() calls define_shared_flags(), so importing a module still defines no flag. docs/FLAGS.md lists
every flag of both with its default (python docs/flags_page.py regenerates it)."""
from absl import flags


def define_shared_flags(max_new_tokens):
  """max_new_tokens: the entry point's default. The caller adopts these as its key flags (train's flags.json)."""
  flags.DEFINE_string("server", "127.0.0.1:5555", "Parameter server host:port. Default 127.0.0.1:5555.")
  flags.DEFINE_string("token_file", None, "File holding the server's shared secret (the trainer's push and the "
                      "worker's lease/put need it). Default none.")
  flags.DEFINE_string("tokenizer", None, "Tokenizer: sentencepiece .model or a dir with tokenizer.json. Required.")
  flags.DEFINE_integer("seed", 0, "Seed: the trainer's data order and init; the worker's sampling (folded with the "
                       "prompt id). Default 0.")
  flags.DEFINE_string("template", "plain", "Prompt template (data.render_prompt): plain, chatml or hf (the "
                      "checkpoint's own chat_template from --tokenizer's tokenizer_config.json). Default plain.")
  flags.DEFINE_string("attn_impl", "auto", "Attention path: auto (Pallas on TPU), ref or pallas. Default auto.")
  flags.DEFINE_bool("exact_logprobs", False, "Exact mode on XLA CPU (kernels.py): the worker's behaviour log-probs "
                    "and the trainer's recomputed ones bitwise equal (same weights, tokens, mesh; attn_impl ref; a worker "
                    "needs --slots >= 2; fp32 products cost six bf16 ones). Set it on the trainer and every worker "
                    "(launch.sh local --exact_logprobs does). Default off.")
  flags.DEFINE_integer("server_retries", 30, "Reconnect attempts (exponential backoff, max 2 s apart) before giving up "
                       "on the server. Default 30.")
  flags.DEFINE_integer("max_staleness", 4, "Max policy-version lag (versions) of a rollout: the trainer trains none "
                       "older, a worker regenerates older groups. Default 4.")
  # Sampling: the trainer's travel with the weights (it scores what workers sampled); rollout.py's are eval's.
  flags.DEFINE_integer("max_new_tokens", max_new_tokens, "Completion budget in tokens (trainer: sent to the workers, "
                       f"also DAPO overlong shaping; rollout.py: eval). Default {max_new_tokens}.")
  flags.DEFINE_float("temperature", 1.0, "Sampling temperature (trainer: sent to the workers, the loss scores "
                     "log-probs at it; rollout.py: eval, 0 = greedy). Default 1.0.")
  flags.DEFINE_integer("top_k", 0, "Top-k truncation (0 = off; trainer: sent to the workers). Default 0.")
  flags.DEFINE_float("top_p", 1.0, "Top-p (nucleus) mass (1 = off; trainer: sent to the workers, with truncation set "
                     "a tis_cap override). Default 1.0.")
  # Bad values fail at flag parsing (issue 15); temperature's rule differs per entry point (eval allows greedy).
  for name, ok, rule in (
      ("max_new_tokens", lambda v: v >= 1, ">= 1 (a completion budget)"), ("top_k", lambda v: v >= 0, ">= 0 (0 = off)"),
      ("max_staleness", lambda v: v >= 0, ">= 0 (a negative bound makes every rollout stale)"),
      ("server_retries", lambda v: v >= 0, ">= 0"), ("top_p", lambda v: 0 < v <= 1, "in (0, 1]")):
    flags.register_validator(name, ok, message=f"--{name} must be {rule}")
