"""learner.py: the trainer's library. The RL step (loss over a batch, PPO epochs, gradient accumulation), the
optimizer, rollout groups -> padded batch, sharded asynchronous checkpoints, HF export, multi-process helpers.

train.py is the script around it (flags, the SFT warm-start, the RL loop); the exactly-once queue bookkeeping is
ledger.py. Tests and benches import this module, not the script. No flags here: everything is an argument.

Design:
  * Precision: fp32 master weights in the optimizer; a compute dtype (bf16) for the forward. Log-probs, softmax
    and the loss are fp32 (model.py / losses.py).
  * One jitted step (make_train_step): optional PPO epochs x minibatches over the batch, each an update with
    gradient accumulation; the proximal log-probs (decoupled PPO) are computed once per batch, before the update.
  * Checkpoints (Checkpointer) are orbax: each process writes its own shards, asynchronously; they restore onto
    another mesh / process count. export_hf gathers one tensor at a time (never the whole model on one host).
  * Process 0 builds each batch (rl_batch) and broadcasts it (broadcast_batch); every process then runs the same
    step over one global mesh.

Run the tests:  python -m pytest -q tests/test_train.py tests/test_ppo_epochs.py
"""
import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils

import data
import losses
import model
import shards


# ----------------------------------------------------------------------------------------------------------------
# Optimizer, loss, step


def lr_schedule_fn(lr, warmup, total):
  # Warmup starts at lr/(warmup+1), not 0: the first step must already move the weights.
  return optax.warmup_cosine_decay_schedule(lr / (warmup + 1), lr, max(warmup, 1), max(total, warmup + 1),
                                            end_value=lr * 0.1)


def make_optimizer(lr, warmup, total, weight_decay, grad_clip):
  return optax.chain(optax.clip_by_global_norm(grad_clip),
                     optax.adamw(lr_schedule_fn(lr, warmup, total), b1=0.9, b2=0.95, weight_decay=weight_decay))


def _microbatches(batch, n):
  b = next(iter(batch.values())).shape[0]
  if b % n:
    raise ValueError(f"batch of {b} sequences is not divisible by grad_accum={n}")
  return jax.tree.map(lambda x: x.reshape(n, b // n, *x.shape[1:]), batch)


def score(p, cfg, batch, *, temperature, attn_impl, remat=False, logprob_chunk=0):
  """(logp, entropy) [B,T] of batch["targets"] under params p, and the final hidden state [B,T,D].
  remat: each layer's activations are recomputed in the backward pass (only the per-layer residual is kept).
  logprob_chunk: the log-softmax runs over chunks of that many positions, each recomputed in the backward, so the
  fp32 [B,T,V] logits (the largest activation for real vocabularies: 8 x 8192 x 152k x 4 B = 40 GB) is never
  formed; 0 = the whole sequence at once."""
  h = model.forward_hidden(p, cfg, batch["tokens"], batch["positions"], batch["segment_ids"], attn_impl=attn_impl,
                           remat=remat)
  if logprob_chunk:
    logp, ent = losses.chunked_token_logprobs(h, lambda hc: model.logits_from_hidden(p, cfg, hc), batch["targets"],
                                              logprob_chunk, temperature)
  else:
    logp, ent = losses.token_logprobs_and_entropy(model.logits_from_hidden(p, cfg, h), batch["targets"], temperature)
  return logp, ent, h


def policy_logp(trainable, batch, *, cfg, temperature, compute_dtype, attn_impl, remat=False, logprob_chunk=0):
  """The trainer's log-probs of batch["targets"] and the final hidden state: the one forward rl_loss differentiates
  and make_train_step calls once (no gradient, via proximal) for the proximal policy of PPO epochs."""
  p = jax.tree.map(lambda x: x.astype(compute_dtype), trainable["policy"])
  return score(p, cfg, batch, temperature=temperature, attn_impl=attn_impl, remat=remat, logprob_chunk=logprob_chunk)


def value_head(vh, h):
  """V(s_t) [B,T] from the final hidden state h [B,T,D]: a linear map, in fp32."""
  return jnp.einsum("btd,d->bt", h.astype(jnp.float32), vh["w"]) + vh["b"]


def proximal(trainable, batch, **kw):
  """What PPO epochs hold fixed over a step's updates, from one fresh forward at its starting weights (no
  gradient; make_train_step adds these to the batch): prox_logp [B,T] and, with a value head, old_values [B,T].
  kw: policy_logp's."""
  logp, _, h = policy_logp(trainable, batch, **kw)
  out = dict(prox_logp=logp)
  if trainable["value"] is not None:
    out["old_values"] = value_head(trainable["value"], h)
  return out


def rl_loss(trainable, ref_params, batch, *, cfg, lcfg, temperature, compute_dtype, attn_impl, value_coef,
            gae_gamma=1.0, gae_lambda=1.0, value_clip=0.0, remat=False, logprob_chunk=0):
  """trainable = {"policy": params, "value": value head or None}. Returns (loss, metrics).
  batch["prox_logp"], when present (PPO epochs/minibatches, make_train_step), is the proximal policy of the clip:
  ratio pi_theta / pi_prox, and TIS (if tis_cap) weighs pi_prox / mu with mu = batch["behaviour_logp"].
  batch["old_values"], present with it when there is a value head, is V_old: GAE advantages and returns come from
  it (fixed over the step's updates, as verl/OpenRLHF compute them once per batch) and value_clip > 0 bounds
  |V - V_old| in the value loss. Without it V_old = stop_gradient(V), where the clip is a no-op and is skipped."""
  mask = batch["loss_mask"]
  logp, ent, h = policy_logp(trainable, batch, cfg=cfg, temperature=temperature, compute_dtype=compute_dtype,
                             attn_impl=attn_impl, remat=remat, logprob_chunk=logprob_chunk)
  ref_logp = None
  if ref_params is not None:  # no gradient flows here, so remat would only add work; chunking still saves memory
    ref_logp = jax.lax.stop_gradient(score(ref_params, cfg, batch, temperature=temperature, attn_impl=attn_impl,
                                           logprob_chunk=logprob_chunk)[0])
  adv, extra = batch["advantages"], {}
  if trainable["value"] is not None:
    # PPO with a value head on the shared trunk: V(s_t) predicts the return of the sequence from position t;
    # the outcome reward sits on the last completion position (batch["token_rewards"]).
    values = value_head(trainable["value"], h)
    adv, returns = losses.gae(batch["token_rewards"], batch.get("old_values", jax.lax.stop_gradient(values)), mask,
                              gae_gamma, gae_lambda)
    clip = value_clip if value_clip > 0 and "old_values" in batch else None
    extra["value_loss"], frac = losses.value_loss(values, returns, mask, old_values=batch.get("old_values"),
                                                  clip=clip, with_clip_frac=True)
    if value_clip > 0:  # without old_values (one update per batch) V_old = V: nothing can be clipped, frac is 0
      extra["value_clip_frac"] = frac
  # Truncated IS needs a proximal policy: with one update per batch that is the current policy (ratio 1 inside
  # the clip), so the correction is the IS weight min(pi / mu, cap) on the behaviour samples.
  prox = (batch["prox_logp"] if "prox_logp" in batch else
          jax.lax.stop_gradient(logp) if lcfg.tis_cap is not None else None)
  loss, m = losses.policy_loss(lcfg, logp, batch["behaviour_logp"], adv, mask, ref_logp=ref_logp,
                               prox_logp=prox, entropy=ent)
  if extra:
    loss = loss + value_coef * extra["value_loss"]
  # Trainer/inference mismatch on the tokens actually trained (issue 8): |logp_train - logp_infer|.
  lr = jnp.where(mask > 0, jax.lax.stop_gradient(logp) - batch["behaviour_logp"], 0.0)
  n = jnp.maximum(mask.sum(), 1)
  ratio = jnp.exp(lr)
  m = dict(m, **extra, mismatch_mean=jnp.abs(lr).sum() / n, mismatch_max=jnp.abs(lr).max(),
           mismatch_p99=jnp.nanpercentile(jnp.where(mask > 0, jnp.abs(lr), jnp.nan), 99),
           mismatch_k1=(-lr).sum() / n, mismatch_k3=jnp.where(mask > 0, ratio - 1 - lr, 0.0).sum() / n,
           is_ratio_std=jnp.sqrt(jnp.where(mask > 0, (ratio - (ratio * mask).sum() / n) ** 2, 0.0).sum() / n))
  return loss, m


def make_train_step(optimizer, loss_fn, grad_accum, *, epochs=1, minibatches=1, prox_fn=None):
  """One trainer step on a batch. epochs x minibatches optimizer updates (PPO epochs, as verl/OpenRLHF/TRL);
  with more than one update, prox_fn(params, batch) (e.g. proximal) is called once before the first update and
  its arrays added to the batch: the fixed proximal policy of the clip and V_old, while the worker's behaviour
  log-probs stay in the batch for TIS (decoupled PPO / AReaL). With 1 x 1 the update is the plain one (ratio
  pi_theta / mu). The updates are unrolled (epochs * minibatches copies in the compiled step, each a grad_accum
  scan); metrics are the mean over updates; clip_frac/ratio_min/ratio_max(/value_clip_frac)_last are the last's."""
  if epochs < 1 or minibatches < 1:
    raise ValueError(f"make_train_step: epochs={epochs} and minibatches={minibatches} must be >= 1")
  update = _make_update(optimizer, loss_fn, grad_accum)
  if epochs == 1 and minibatches == 1:
    return update
  if prox_fn is None:
    raise ValueError("make_train_step: several updates per batch need prox_fn (the proximal log-probs)")

  def step(params, opt_state, ref_params, batch):
    batch = dict(batch, **jax.lax.stop_gradient(prox_fn(params, batch)))
    mbs = _microbatches(batch, minibatches)
    ms = []
    for _ in range(epochs):
      for i in range(minibatches):
        params, opt_state, m = update(params, opt_state, ref_params, jax.tree.map(lambda x: x[i], mbs))
        ms.append(m)
    m = jax.tree.map(lambda *xs: sum(xs) / len(xs), *ms)
    last = ("clip_frac", "ratio_min", "ratio_max", "value_clip_frac")  # the last update's, where clips act most
    m.update({k + "_last": ms[-1][k] for k in last if k in m})
    return params, opt_state, m
  return step


def _make_update(optimizer, loss_fn, grad_accum):
  def step(params, opt_state, ref_params, batch):
    def micro(acc, mb):
      (loss, m), g = jax.value_and_grad(loss_fn, has_aux=True)(params, ref_params, mb)
      return jax.tree.map(jnp.add, acc, (g, loss, m)), None

    mbs = _microbatches(batch, grad_accum)
    zero = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), jax.eval_shape(
        lambda: (params, *jax.value_and_grad(loss_fn, has_aux=True)(params, ref_params,
                                                                    jax.tree.map(lambda x: x[0], mbs))[0])))
    (g, loss, m), _ = jax.lax.scan(micro, zero, mbs)
    g, loss, m = jax.tree.map(lambda x: x / grad_accum, (g, loss, m))
    updates, opt_state = optimizer.update(g, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, dict(m, loss=loss, grad_norm=optax.tree.norm(g))
  return step


# ----------------------------------------------------------------------------------------------------------------
# Checkpoints (<run_dir>/ckpt/<step>/{params,opt,state}) and the HF export


class Checkpointer:
  """Sharded, asynchronous, elastic checkpoints (orbax-checkpoint, as MaxText and Tunix use).
  Each process writes only its own shards of params and optimizer state (OCDBT/tensorstore); save() returns
  once the shards are copied to host and training goes on while they are written; a step directory becomes a
  checkpoint only when orbax has committed it (its marker written last, after every process finished), so a
  checkpoint is either complete or ignored. restore() reads onto whatever mesh / process count the `like` arrays
  have (written by 4 processes fsdp=4, resumed by 2 or 1). The run state (step, cursor, pass rates, consumed ids,
  version) is a JSON item of the same step. Why orbax: it is the JAX ecosystem's multi-host checkpointer; a
  hand-rolled per-process writer would have to redo its resharding reads and its cross-process commit protocol.
  """

  def __init__(self, ckpt_dir, keep):
    import orbax.checkpoint as ocp
    self.ocp = ocp
    path = ckpt_dir if "://" in ckpt_dir else os.path.abspath(ckpt_dir)  # gs://... goes to orbax as is
    self.mngr = ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(
        max_to_keep=keep, enable_async_checkpointing=True, create=True))

  def save(self, step, params, opt_state, state):
    """Starts writing step (collective); returns False if that step is already saved."""
    if self.mngr.latest_step() == step:
      return False
    a = self.ocp.args
    self.mngr.save(step, args=a.Composite(params=a.StandardSave(params), opt=a.StandardSave(opt_state),
                                          state=a.JsonSave(state)))
    return True

  def wait(self):
    """Blocks until the last save is committed."""
    self.mngr.wait_until_finished()

  def restore(self, params_like, opt_like):
    """(params, opt_state, state) of the newest committed step placed like params_like/opt_like, or None."""
    step = self.mngr.latest_step()
    if step is None:
      return None
    a = self.ocp.args
    abstract = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), t)  # noqa: E731
    r = self.mngr.restore(step, args=a.Composite(params=a.StandardRestore(abstract(params_like)),
                                                 opt=a.StandardRestore(abstract(opt_like)), state=a.JsonRestore()))
    return r["params"], r["opt"], r["state"]

  def close(self):
    self.mngr.close()


def read_state(ckpt_dir):
  """The run state of the newest committed checkpoint (no arrays read), or None."""
  c = Checkpointer(ckpt_dir, keep=1 << 30)
  try:
    step = c.mngr.latest_step()
    return None if step is None else c.mngr.restore(step, args=c.ocp.args.Composite(
        state=c.ocp.args.JsonRestore()))["state"]
  finally:
    c.close()


def export_hf(out, cfg, params, dtype=None, tokenizer_src=None, sampling=None):
  """HF safetensors from (possibly cross-process sharded) params, gathering one tensor at a time; process 0
  writes. Collective: every process calls it. Written to out.tmp and renamed (complete or absent). With
  tokenizer_src, the tokenizer files and a generation_config.json go beside it, so transformers'
  AutoTokenizer/AutoModelForCausalLM.from_pretrained(out) load the export as is (sampling: the run's temperature,
  top_p and max_new_tokens for generation_config.json)."""
  lead = jax.process_index() == 0
  flat = shards.flat_leaves(params)

  def get_leaf(key):
    x = flat["/".join(key)]
    return np.asarray(multihost_utils.process_allgather(x, tiled=True) if jax.process_count() > 1 else x)

  model.save_hf_checkpoint_streamed(out + ".tmp", cfg, get_leaf, dtype or params["embed"].dtype, write=lead)
  if lead and tokenizer_src:
    src = tokenizer_src if os.path.isdir(tokenizer_src) else os.path.dirname(os.path.abspath(tokenizer_src))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                 "chat_template.jinja", "generation_config.json", "vocab.json", "merges.txt"):
      if os.path.exists(os.path.join(src, name)):
        shutil.copy(os.path.join(src, name), os.path.join(out + ".tmp", name))
    gen = os.path.join(out + ".tmp", "generation_config.json")
    if not os.path.exists(gen):
      with open(gen, "w") as f:
        json.dump(dict(bos_token_id=cfg.bos_token_id, eos_token_id=list(cfg.eos_token_ids) or None,
                       do_sample=True, **(sampling or {})), f, indent=1)
  if lead:
    shutil.rmtree(out, ignore_errors=True)
    os.rename(out + ".tmp", out)


# ----------------------------------------------------------------------------------------------------------------
# Configuration, placement, batches, metrics


def parse_mesh(spec, n_devices):
  dims = [int(x) for x in spec.split(",")]
  if len(dims) != 3 or dims.count(-1) > 1:
    raise ValueError(f"--mesh must be data,fsdp,tensor with at most one -1, got {spec!r}")
  known = int(np.prod([d for d in dims if d != -1]))
  dims = [n_devices // known if d == -1 else d for d in dims]
  if int(np.prod(dims)) != n_devices:
    raise ValueError(f"--mesh {spec} gives {dims}, which does not use the {n_devices} devices")
  return dims


def loss_config(base, overrides, max_new_tokens):
  """The LossConfig the trainer uses: base + --loss_override; seq_mean_token_sum (Dr. GRPO, RLOO) gets the
  constant generation budget as its normaliser unless max_tokens is overridden, so the loss scale does not change
  with each batch's padded bucket length."""
  lcfg = dataclasses.replace(base, **parse_overrides(overrides, base))
  if lcfg.agg == "seq_mean_token_sum" and lcfg.max_tokens is None:
    lcfg = dataclasses.replace(lcfg, max_tokens=int(max_new_tokens))
  return lcfg


def parse_overrides(items, base):
  """["kl_coef=0.01", ...] -> dict of typed values for dataclasses.replace(base, **dict)."""
  out = {}
  for it in items:
    k, sep, v = it.partition("=")
    if not sep or not hasattr(base, k):
      raise ValueError(f"bad --loss_override {it!r}: expected field=value, field one of "
                       f"{[f.name for f in dataclasses.fields(base)]}")
    cur = getattr(base, k)
    if v == "None":
      out[k] = None
    elif isinstance(cur, bool):
      out[k] = v.lower() in ("1", "true", "yes")
    elif isinstance(cur, (int, float)):
      out[k] = type(cur)(float(v)) if isinstance(cur, float) else int(v)
    elif cur is None:  # optional numeric knobs default to None (off)
      out[k] = float(v)
    else:
      out[k] = v
  return out


def to_global(host_tree, sharding):
  """Every process holds the same host copy; build global arrays sharded over the mesh from it."""
  return jax.tree.map(lambda x: jax.make_array_from_callback(x.shape, sharding, lambda idx, x=x: x[idx]), host_tree)


def buckets_for(max_len):
  """Padded batch lengths: data.BUCKETS, extended (x2) until max_len fits, so 8k-32k sequences get a bucket
  (compiled shapes stay few: one per power of two)."""
  b = list(data.BUCKETS)
  while b[-1] < max_len:
    b.append(b[-1] * 2)
  return tuple(b)


def parse_band(spec):
  """--pass_band "low,high" -> (low, high) with 0 <= low < high <= 1; None when empty or malformed."""
  try:
    low, high = (float(x) for x in spec.split(","))
  except ValueError:
    return None
  return (low, high) if 0.0 <= low < high <= 1.0 else None


def rl_batch(groups, lcfg, pad_id, buckets, max_new_tokens):
  """Rollout groups -> host batch dict (numpy), rewards [P,G], completion lengths [P,G].

  Behaviour log-probs ride along as a completion extra, so they sit where loss_mask is 1: the completion token
  at sequence index p+j (p = prompt length) is the target of position p+j-1.  Rewards are the verifier's plus,
  when the algorithm asks for it, DAPO's soft overlong penalty.
  """
  prompts, comps, blp, tok_r = [], [], [], []
  rewards = np.stack([np.asarray(g.rewards, np.float32) for g in groups])  # [P,G]
  lengths = np.asarray([[len(c) for c in g.completions] for g in groups], np.float32)
  if lcfg.overlong_buffer_frac:
    buffer = max(1, round(lcfg.overlong_buffer_frac * max_new_tokens))
    rewards = rewards + np.asarray(losses.overlong_shaping(lengths, max_new_tokens, buffer))
  for g, row in zip(groups, rewards):
    for c, lp, r in zip(g.completions, g.logprobs, row):
      prompts.append(np.asarray(g.prompt_tokens, np.int32))
      comps.append(np.asarray(c, np.int32))
      blp.append(np.asarray(lp, np.float32))
      tok_r.append(np.eye(1, len(c), len(c) - 1, dtype=np.float32)[0] * r)  # outcome reward on the last token
  b = data.make_batch(prompts, comps, buckets, pad_id,
                      completion_extras={"behaviour_logp": blp, "token_rewards": tok_r})
  adv = np.asarray(losses.config_advantages(lcfg, jnp.asarray(rewards), jnp.asarray(lengths))).reshape(-1) \
      if lcfg.advantage != "gae" else np.zeros(len(prompts))  # gae: computed in the step from the value head
  return dict({k: b[k] for k in BATCH_KEYS if k != "advantages"}, advantages=adv.astype(np.float32)), rewards, lengths


class Metrics:
  """jsonl metrics (process 0 only); one line per step."""

  def __init__(self, path):
    self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if jax.process_index() == 0 else None

  def write(self, rec):
    # One write() per line: a buffered text file splits a long line (a step's sample ids run past 8 KiB) into
    # several writes, and a reader tailing the file (plot.py, the system tests, a user's `tail -f | jq`) then sees
    # a cut line that is not the sign of a crash.
    if self.fd is not None:
      data = (json.dumps(rec) + "\n").encode()
      while data:
        data = data[os.write(self.fd, data):]


def teacher_completion(problem, slip: float, rng) -> str:
  """The SFT target: the reference completion, except that with probability `slip` (one draw of `rng`) the last
  digit is written one too high (9 -> 0). The rest of the answer stays right, so the student must still learn the
  task to imitate the slip; the slip is a habit RL can remove, not a skill it has to discover."""
  text = data.reference_completion(problem)
  last = max((i for i, c in enumerate(text) if c.isdigit()), default=None)
  if slip and rng.random() < slip and last is not None:
    text = text[:last] + str((int(text[last]) + 1) % 10) + text[last + 1:]
  return text


# ----------------------------------------------------------------------------------------------------------------
# Multi-process: process 0's batch and decisions, on every process

# Fields of a training batch and their dtypes, in the order broadcast_batch sends them.
BATCH_KEYS = dict(tokens=np.int32, targets=np.int32, positions=np.int32, segment_ids=np.int32, loss_mask=np.float32,
                  behaviour_logp=np.float32, token_rewards=np.float32, advantages=np.float32)


def broadcast_batch(batch):
  """Process 0's host batch -> every process (shapes first, since broadcast needs equal shapes)."""
  if jax.process_count() == 1:
    return batch
  lead = jax.process_index() == 0
  shape = np.asarray(batch["tokens"].shape if lead else (0, 0), np.int32)
  shape = tuple(int(x) for x in multihost_utils.broadcast_one_to_all(shape))
  tmpl = {k: (batch[k] if lead else np.zeros(shape[:1] if k == "advantages" else shape, dt))
          for k, dt in BATCH_KEYS.items()}
  return jax.tree.map(np.asarray, multihost_utils.broadcast_one_to_all(tmpl))


def lead_says(flag):
  """Process 0's bool, on every process (each process must take the same branch around a collective)."""
  if jax.process_count() == 1:
    return bool(flag)
  return bool(multihost_utils.broadcast_one_to_all(np.int32(bool(flag))))
