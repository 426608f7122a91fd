"""train.py: the master trainer. Consumes rollouts, computes the RL loss, updates with optax, pushes weights.

Design:
  * Process 0 is the only one that talks to the parameter server: it issues prompts (queue "prompts"), leases
    scored rollout groups (queue "rollouts"), and broadcasts each batch to the other JAX processes, which all
    run the same jitted step over one global (data, fsdp, tensor) mesh (`jax.distributed`, gloo on CPU: the
    same code path as a multi-host TPU slice).
  * Exactly-once: a rollout is acked on the server only after a checkpoint that records it as consumed has been
    written.  A trainer killed before that checkpoint gets the rollouts again (leases are released by
    `requeue` at startup) and, having rolled back, trains them once in the surviving lineage; rollouts already
    recorded in the checkpoint but not yet acked are skipped by id.
  * Prompts are issued with deterministic ids ("s<seq>") from a resumable PromptStream whose cursor is in the
    checkpoint, so a restarted trainer re-issues the same ids and the server drops the duplicates.
  * Staleness: a rollout more than --max_staleness versions behind the current weights is not trained on; its
    prompt is re-issued under a new id.  DAPO dynamic sampling drops zero-variance groups and refills.
  * Precision: fp32 master weights in the optimizer; --param_dtype=bfloat16 casts them for the forward and for
    the workers.  Log-probs, softmax and the loss are fp32 (model.py / losses.py).
  * Checkpoints (params, optimizer state, step, data cursor, seed, consumed ids, pass-rate table, version) are
    written to a temp dir and renamed, every --checkpoint_every steps and on SIGTERM.
  * --mode=sft is the supervised warm-start that builds the demo's base policy (an HF checkpoint dir).

Run:
  CPU, one process:  python train.py --run_dir=runs/x --init_checkpoint=runs/x/base --tokenizer=runs/x/tokenizer.model
  CPU, 2 processes:  add --num_processes=2 --process_id={0,1} --coordinator=127.0.0.1:12355 (launch.sh does this)
  TPU pod:           bash launch.sh v5p-1024  (one trainer process per trainer host; see --dry_run)
"""
import dataclasses
import json
import os
import shutil
import time

from absl import app, flags, logging

FLAGS = flags.FLAGS

def define_flags():
  """Flags exist only when this file is the entry point: importing it (tests, other tools) defines none, so
  train.py and rollout.py can be imported together."""
  flags.DEFINE_enum("mode", "rl", ["rl", "sft"], "rl: RL from rollouts; sft: supervised warm-start. Default rl.")
  flags.DEFINE_string("run_dir", "runs/local", "Directory for checkpoints, metrics and the final model. Default runs/local.")
  flags.DEFINE_string("server", "127.0.0.1:5555", "Parameter server host:port. Default 127.0.0.1:5555.")
  flags.DEFINE_string("token_file", None, "File with the server's shared secret (push needs it). Default none.")
  flags.DEFINE_string("init_checkpoint", None, "HF checkpoint dir of the initial policy (rl mode). Required for rl.")
  flags.DEFINE_string("tokenizer", None, "Tokenizer (.model or dir with tokenizer.json). Required.")
  # Data.
  flags.DEFINE_string("task", "arithmetic", "Built-in task when --train_jsonl is not given. Default arithmetic.")
  flags.DEFINE_integer("difficulty", 3, "Built-in task difficulty. Default 3.")
  flags.DEFINE_string("ops", None, "Operators of the built-in task, e.g. + or +-* (data.make_task_problems). Default "
                      "none: the task's own (arithmetic +-, countdown +-*).")
  flags.DEFINE_string("train_jsonl", None, "jsonl prompt file (id, prompt, answer[, task, tests]). Default none.")
  flags.DEFINE_integer("train_size", 8000, "Number of built-in training problems generated. Default 8000.")
  flags.DEFINE_string("template", "plain", "Prompt template (data.render_prompt). Default plain.")
  flags.DEFINE_integer("seed", 0, "Seed for data order and init. Default 0.")
  # RL.
  flags.DEFINE_string("algo", "grpo", "Loss preset from losses.ALGORITHMS (grpo, dr_grpo, dapo, gspo, cispo, ppo, rloo, "
                      "reinforce_pp). Default grpo.")
  flags.DEFINE_multi_string("loss_override", [], "field=value overrides of the LossConfig, e.g. kl_coef=0.01. Default none.")
  flags.DEFINE_integer("steps", 100, "Optimizer steps in the run. Default 100.")
  flags.DEFINE_integer("prompts_per_step", 16, "Prompt groups per optimizer step. Default 16.")
  flags.DEFINE_integer("group_size", 8, "Samples per prompt (G). Default 8.")
  flags.DEFINE_integer("prefetch_steps", 2, "Steps worth of prompts kept issued ahead of training. Default 2.")
  flags.DEFINE_integer("max_staleness", 4, "Max policy-version lag of a trained rollout. Default 4.")
  flags.DEFINE_bool("dynamic_sampling", False, "Drop zero-variance groups and refill (DAPO). Default False.")
  flags.DEFINE_integer("max_new_tokens", 8, "Workers' completion budget in tokens, sent with the weights (also DAPO "
                       "overlong shaping). Default 8.")
  flags.DEFINE_float("value_coef", 0.5, "Value-loss weight (PPO with GAE only). Default 0.5.")
  flags.DEFINE_float("temperature", 1.0, "Workers' sampling temperature, sent with the weights; the loss scores "
                     "log-probs at it. Default 1.0.")
  flags.DEFINE_integer("top_k", 0, "Workers' top-k (0 = off), sent with the weights. Default 0.")
  flags.DEFINE_float("top_p", 1.0, "Workers' top-p (1 = off), sent with the weights; with truncation set a tis_cap "
                     "override. Default 1.0.")
  flags.DEFINE_float("lr", 1e-4, "Peak learning rate. Default 1e-4.")
  flags.DEFINE_integer("warmup_steps", 5, "Linear warmup steps, then cosine decay to 10%. Default 5.")
  flags.DEFINE_float("weight_decay", 0.0, "AdamW weight decay. Default 0.")
  flags.DEFINE_float("grad_clip", 1.0, "Global-norm gradient clip. Default 1.0.")
  flags.DEFINE_integer("grad_accum", 1, "Micro-batches per optimizer step. Default 1.")
  flags.DEFINE_enum("param_dtype", "float32", ["float32", "bfloat16"], "Compute/worker weight dtype (master stays fp32). "
                    "Default float32.")
  flags.DEFINE_integer("push_every", 1, "Push weights every N steps. Default 1.")
  flags.DEFINE_integer("checkpoint_every", 10, "Checkpoint (and ack) every N steps. Default 10.")
  flags.DEFINE_integer("keep_checkpoints", 2, "Checkpoints kept on disk. Default 2.")
  flags.DEFINE_float("get_wait_s", 2.0, "Seconds one rollout lease call may block. Default 2.")
  flags.DEFINE_float("rollout_lease_s", 600.0, "Rollout lease on the server, seconds (must outlast checkpoint_every "
                     "steps). Default 600.")
  flags.DEFINE_string("attn_impl", "auto", "Attention path: auto, ref or pallas. Default auto.")
  flags.DEFINE_integer("server_retries", 30, "Reconnect attempts (exponential backoff, max 2 s apart) before giving up on "
                       "the server. Default 30.")
  flags.DEFINE_string("mesh", "1,1,-1", "data,fsdp,tensor mesh shape; one -1 takes the remaining devices. Default 1,1,-1.")
  # Multi-process.
  flags.DEFINE_integer("num_processes", 1, "JAX processes in the trainer (0 = auto-detect on a TPU slice). Default 1.")
  flags.DEFINE_integer("process_id", 0, "This process's index. Default 0.")
  flags.DEFINE_string("coordinator", "127.0.0.1:12355", "jax.distributed coordinator host:port. Default 127.0.0.1:12355.")
  # SFT warm-start (the demo's base policy).
  flags.DEFINE_integer("sft_steps", 300, "SFT steps. Default 300.")
  flags.DEFINE_integer("sft_batch", 64, "SFT sequences per step. Default 64.")
  flags.DEFINE_float("sft_lr", 3e-3, "SFT peak learning rate. Default 3e-3.")
  flags.DEFINE_string("sft_out", None, "Where SFT writes its HF checkpoint. Default <run_dir>/base.")
  flags.DEFINE_string("model_config", "d_model=128,n_layers=2,n_heads=4,n_kv_heads=2,ffw_dim=512",
                      "Tiny model shape for SFT from scratch. Default d_model=128,n_layers=2,n_heads=4,n_kv_heads=2,"
                      "ffw_dim=512.")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import safetensors.numpy  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import data  # noqa: E402
import losses  # noqa: E402
import model  # noqa: E402


# ----------------------------------------------------------------------------------------------------------------
# Optimizer, step


def make_optimizer(lr, warmup, total, weight_decay, grad_clip):
  # Warmup starts at lr/(warmup+1), not 0: the first step must already move the weights.
  sched = optax.warmup_cosine_decay_schedule(lr / (warmup + 1), lr, max(warmup, 1), max(total, warmup + 1),
                                             end_value=lr * 0.1)
  return optax.chain(optax.clip_by_global_norm(grad_clip), optax.adamw(sched, b1=0.9, b2=0.95,
                                                                        weight_decay=weight_decay))


def _microbatches(batch, n):
  b = next(iter(batch.values())).shape[0]
  if b % n:
    raise ValueError(f"batch of {b} sequences is not divisible by grad_accum={n}")
  return jax.tree.map(lambda x: x.reshape(n, b // n, *x.shape[1:]), batch)


def rl_loss(trainable, ref_params, batch, *, cfg, lcfg, temperature, compute_dtype, attn_impl, value_coef):
  """trainable = {"policy": params, "value": value head or None}. Returns (loss, metrics)."""
  p = jax.tree.map(lambda x: x.astype(compute_dtype), trainable["policy"])
  tok, pos, seg, mask = batch["tokens"], batch["positions"], batch["segment_ids"], batch["loss_mask"]
  h = model.forward_hidden(p, cfg, tok, pos, seg, attn_impl=attn_impl)
  logp, ent = losses.token_logprobs_and_entropy(model.logits_from_hidden(p, cfg, h), batch["targets"], temperature)
  ref_logp = None
  if ref_params is not None:
    ref_logits = model.forward(ref_params, cfg, tok, pos, seg, attn_impl=attn_impl)
    ref_logp = jax.lax.stop_gradient(losses.token_logprobs(ref_logits, batch["targets"], temperature))
  adv, extra = batch["advantages"], {}
  if trainable["value"] is not None:
    # PPO with a value head on the shared trunk: V(s_t) predicts the return of the sequence from position t;
    # the outcome reward sits on the last completion position (batch["token_rewards"]).
    vh = trainable["value"]
    values = jnp.einsum("btd,d->bt", h.astype(jnp.float32), vh["w"]) + vh["b"]
    adv, returns = losses.gae(batch["token_rewards"], jax.lax.stop_gradient(values), mask)
    extra["value_loss"] = losses.value_loss(values, returns, mask)
  # Truncated IS needs a proximal policy: with one update per batch that is the current policy (ratio 1 inside
  # the clip), so the correction is the IS weight min(pi / mu, cap) on the behaviour samples.
  prox = jax.lax.stop_gradient(logp) if lcfg.tis_cap is not None else None
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


def make_train_step(optimizer, loss_fn, grad_accum):
  def step(params, opt_state, ref_params, batch):
    def micro(acc, mb):
      (loss, m), g = jax.value_and_grad(loss_fn, has_aux=True)(params, ref_params, mb)
      return jax.tree.map(jnp.add, acc, (g, loss, m)), None

    mbs = _microbatches(batch, grad_accum)
    zero = jax.tree.map(jnp.zeros_like, jax.eval_shape(
        lambda: (params, *jax.value_and_grad(loss_fn, has_aux=True)(params, ref_params,
                                                                    jax.tree.map(lambda x: x[0], mbs))[0])))
    zero = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), zero)
    (g, loss, m), _ = jax.lax.scan(micro, zero, mbs)
    g, loss, m = jax.tree.map(lambda x: x / grad_accum, (g, loss, m))
    updates, opt_state = optimizer.update(g, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, dict(m, loss=loss, grad_norm=optax.tree.norm(g))
  return step


# ----------------------------------------------------------------------------------------------------------------
# Checkpoints: <run_dir>/ckpt/<step>/{params,opt}.safetensors + state.json, written to a temp dir then renamed.


def _flat_leaves(tree):
  return {f"{i:05d}": np.asarray(x) for i, x in enumerate(jax.tree.leaves(tree))}


def save_checkpoint(ckpt_dir, step, params, opt_state, state, keep):
  final = os.path.join(ckpt_dir, f"{step:08d}")
  tmp = final + f".tmp{os.getpid()}"
  os.makedirs(tmp, exist_ok=True)
  safetensors.numpy.save_file(_flat_leaves(params), os.path.join(tmp, "params.safetensors"))
  safetensors.numpy.save_file(_flat_leaves(opt_state), os.path.join(tmp, "opt.safetensors"))
  with open(os.path.join(tmp, "state.json"), "w") as f:
    json.dump(state, f)
    f.flush()
    os.fsync(f.fileno())
  if os.path.exists(final):
    shutil.rmtree(final)
  os.rename(tmp, final)  # atomic: a checkpoint dir without ".tmp" is always complete
  for old in sorted(d for d in os.listdir(ckpt_dir) if d.isdigit())[:-keep]:
    shutil.rmtree(os.path.join(ckpt_dir, old), ignore_errors=True)


def latest_checkpoint(ckpt_dir):
  steps = sorted(d for d in os.listdir(ckpt_dir) if d.isdigit()) if os.path.isdir(ckpt_dir) else []
  return os.path.join(ckpt_dir, steps[-1]) if steps else None


def load_checkpoint(path, params_like, opt_like):
  def fill(tree, file):
    flat = safetensors.numpy.load_file(file)
    leaves, treedef = jax.tree.flatten(tree)
    if len(flat) != len(leaves):
      raise ValueError(f"{file}: {len(flat)} tensors, expected {len(leaves)} (model or optimizer changed?)")
    return jax.tree.unflatten(treedef, [flat[f"{i:05d}"].astype(np.asarray(x).dtype) for i, x in enumerate(leaves)])
  with open(os.path.join(path, "state.json")) as f:
    state = json.load(f)
  return fill(params_like, os.path.join(path, "params.safetensors")), fill(opt_like, os.path.join(path, "opt.safetensors")), state


# ----------------------------------------------------------------------------------------------------------------
# Helpers


def parse_mesh(spec, n_devices):
  dims = [int(x) for x in spec.split(",")]
  if len(dims) != 3 or dims.count(-1) > 1:
    raise ValueError(f"--mesh must be data,fsdp,tensor with at most one -1, got {spec!r}")
  known = int(np.prod([d for d in dims if d != -1]))
  dims = [n_devices // known if d == -1 else d for d in dims]
  if int(np.prod(dims)) != n_devices:
    raise ValueError(f"--mesh {spec} gives {dims}, which does not use the {n_devices} devices")
  return dims


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


def host_params(params):
  """Full host copy of (possibly cross-process sharded) params, identical on every process."""
  if jax.process_count() > 1:
    return jax.tree.map(np.asarray, multihost_utils.process_allgather(params, tiled=True))
  return jax.tree.map(np.asarray, params)


def place_params(params_np, cfg, mesh):
  return model.shard_params(jax.tree.map(jnp.asarray, params_np), cfg, mesh)


def problems_for_training():
  if FLAGS.train_jsonl:
    return data.load_jsonl(FLAGS.train_jsonl)
  return data.make_task_problems(FLAGS.task, FLAGS.train_size, FLAGS.difficulty, seed=FLAGS.seed, split="train",
                                 ops=FLAGS.ops)


def rl_batch(groups, lcfg, pad_id, buckets, max_new_tokens):
  """Rollout groups -> host batch dict (numpy), rewards [P,G], completion lengths [P,G].

  Behaviour log-probs ride along as a completion extra, so they sit where loss_mask is 1: the completion token
  at sequence index p+j (p = prompt length) is the target of position p+j-1.  Rewards are the verifier's plus,
  when the algorithm asks for it, DAPO's soft overlong penalty.
  """
  prompts, comps, blp, tok_r = [], [], [], []
  rewards = np.stack([np.asarray(g["rewards"], np.float32) for g in groups])  # [P,G]
  lengths = np.asarray([[len(c) for c in g["completions"]] for g in groups], np.float32)
  if lcfg.overlong_buffer_frac:
    buffer = max(1, round(lcfg.overlong_buffer_frac * max_new_tokens))
    rewards = rewards + np.asarray(losses.overlong_shaping(lengths, max_new_tokens, buffer))
  for g, row in zip(groups, rewards):
    for c, lp, r in zip(g["completions"], g["logprobs"], row):
      prompts.append(np.asarray(g["prompt_tokens"], np.int32))
      comps.append(np.asarray(c, np.int32))
      blp.append(np.asarray(lp, np.float32))
      tok_r.append(np.eye(1, len(c), len(c) - 1, dtype=np.float32)[0] * r)  # outcome reward on the last token
  b = data.make_batch(prompts, comps, buckets, pad_id,
                      completion_extras={"behaviour_logp": blp, "token_rewards": tok_r})
  adv = np.asarray(losses.config_advantages(lcfg, jnp.asarray(rewards), jnp.asarray(lengths))).reshape(-1) \
      if lcfg.advantage != "gae" else np.zeros(len(prompts))  # gae: computed in the step from the value head
  batch = {k: b[k] for k in BATCH_KEYS if k != "advantages"}
  batch["advantages"] = adv.astype(np.float32)
  return batch, rewards, lengths


def setup_mesh():
  if FLAGS.num_processes == 0:  # TPU pod: the slice tells each host its process id and the coordinator
    jax.distributed.initialize()
  elif FLAGS.num_processes > 1:
    # Cross-process collectives on CPU go through gloo (ignored on TPU). Asking for the backend here would
    # initialise it before jax.distributed, which must come first.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=FLAGS.coordinator, num_processes=FLAGS.num_processes,
                               process_id=FLAGS.process_id)
  dims = parse_mesh(FLAGS.mesh, jax.device_count())
  return model.make_mesh(*dims, devices=jax.devices())


class Metrics:
  """jsonl metrics (process 0 only); one line per step."""

  def __init__(self, path):
    self.f = open(path, "a") if jax.process_index() == 0 else None

  def write(self, rec):
    if self.f:
      self.f.write(json.dumps(rec) + "\n")
      self.f.flush()


def run_sft():
  mesh = setup_mesh()
  tok = data.load_tokenizer(FLAGS.tokenizer)
  shape = {k: int(v) for k, v in (kv.split("=") for kv in FLAGS.model_config.split(","))}
  hf = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=tok.vocab_size,
            hidden_size=shape["d_model"], num_hidden_layers=shape["n_layers"],
            num_attention_heads=shape["n_heads"], num_key_value_heads=shape["n_kv_heads"],
            intermediate_size=shape["ffw_dim"], max_position_embeddings=512, rope_theta=10000.0,
            rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id,
            hidden_act="silu", torch_dtype="float32")
  cfg = model.Config.from_hf_dict(hf)
  jax.set_mesh(mesh)
  params = model.shard_params(model.init_params(cfg, jax.random.PRNGKey(FLAGS.seed)), cfg, mesh)
  opt = make_optimizer(FLAGS.sft_lr, FLAGS.warmup_steps, FLAGS.sft_steps, FLAGS.weight_decay, FLAGS.grad_clip)
  opt_state = opt.init(params)
  stream = data.PromptStream(problems_for_training(), seed=FLAGS.seed)
  bsh = NamedSharding(mesh, P(("data", "fsdp")))

  def loss_fn(params, b):
    logits = model.forward(params, cfg, b["tokens"], b["positions"], b["segment_ids"], attn_impl=FLAGS.attn_impl)
    logp = losses.token_logprobs(logits, b["targets"])
    return -(logp * b["loss_mask"]).sum() / jnp.maximum(b["loss_mask"].sum(), 1)

  @jax.jit
  def step(params, opt_state, b):
    loss, g = jax.value_and_grad(loss_fn)(params, b)
    upd, opt_state = opt.update(g, opt_state, params)
    return optax.apply_updates(params, upd), opt_state, loss

  metrics = Metrics(os.path.join(FLAGS.run_dir, "sft_metrics.jsonl"))
  t0 = time.time()
  for i in range(FLAGS.sft_steps):
    probs = stream.take(FLAGS.sft_batch)
    b = data.make_batch([tok.encode(data.render_prompt(p, FLAGS.template), add_bos=True) for p in probs],
                        [tok.encode(data.reference_completion(p)) + [tok.eos_id] for p in probs],
                        BUCKETS, tok.pad_id)
    b = {k: b[k].astype(np.float32 if k == "loss_mask" else np.int32) for k in ("tokens", "targets", "positions",
                                                                               "segment_ids", "loss_mask")}
    params, opt_state, loss = step(params, opt_state, to_global(b, bsh))
    if i % 20 == 0 or i == FLAGS.sft_steps - 1:
      loss = float(loss)
      metrics.write(dict(step=i, sft_loss=loss, seconds=time.time() - t0))
      logging.info("sft step %d loss %.4f (%.0fs)", i, loss, time.time() - t0)
  out = FLAGS.sft_out or os.path.join(FLAGS.run_dir, "base")
  hp = host_params(params)  # collective: every process takes part
  if jax.process_index() == 0:
    model.save_hf_checkpoint(out + ".tmp", cfg, hp)
    shutil.rmtree(out, ignore_errors=True)
    os.rename(out + ".tmp", out)
  logging.info("sft done: %s", out)


# Fields a prompt item and its rollout share (the worker copies them), so a stale rollout can be re-issued.
BATCH_KEYS = ("tokens", "targets", "positions", "segment_ids", "loss_mask", "behaviour_logp", "token_rewards",
              "advantages")
PROMPT_FIELDS = ("prompt_id", "prompt", "answer", "task", "tests", "prompt_tokens")
# Row lengths a batch pads to. 16 first: a built-in arithmetic row (bos, prompt, answer, eos) is <= 12 tokens, and
# padding it to 16 rather than 32 halves the demo's SFT and RL step time.
BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


def like(host_tree, like_tree):
  """Place a host pytree with the shardings of an existing (global) pytree."""
  return jax.tree.map(lambda h, x: jax.make_array_from_callback(x.shape, x.sharding, lambda idx, h=h: h[idx]),
                      host_tree, like_tree)


def broadcast_batch(batch):
  """Process 0's host batch -> every process (shapes first, since broadcast needs equal shapes)."""
  if jax.process_count() == 1:
    return batch
  keys = BATCH_KEYS
  lead = jax.process_index() == 0
  shape = np.asarray(batch["tokens"].shape if lead else (0, 0), np.int32)
  shape = tuple(int(x) for x in multihost_utils.broadcast_one_to_all(shape))
  dtypes = dict(tokens=np.int32, targets=np.int32, positions=np.int32, segment_ids=np.int32, loss_mask=np.float32,
                behaviour_logp=np.float32, token_rewards=np.float32, advantages=np.float32)
  tmpl = {k: (batch[k] if lead else np.zeros(shape[:1] if k == "advantages" else shape, dtypes[k])) for k in keys}
  return jax.tree.map(np.asarray, multihost_utils.broadcast_one_to_all(tmpl))


def run_rl():
  import param_server
  stop = param_server.StopFlag()
  mesh = setup_mesh()
  lead = jax.process_index() == 0
  os.makedirs(FLAGS.run_dir, exist_ok=True)
  tok = data.load_tokenizer(FLAGS.tokenizer)
  if FLAGS.init_checkpoint is None:
    raise app.UsageError("--mode=rl needs --init_checkpoint (an HF checkpoint dir)")
  jax.set_mesh(mesh)  # activations are constrained by model.py's logical-axis table over this mesh
  cfg, init = model.load_hf_checkpoint(FLAGS.init_checkpoint, dtype=jnp.float32)
  base = losses.ALGORITHMS[FLAGS.algo]
  lcfg = dataclasses.replace(base, **parse_overrides(FLAGS.loss_override, base))
  compute_dtype = jnp.dtype(FLAGS.param_dtype)
  optimizer = make_optimizer(FLAGS.lr, FLAGS.warmup_steps, FLAGS.steps, FLAGS.weight_decay, FLAGS.grad_clip)
  policy = place_params(init, cfg, mesh)  # fp32 master weights
  # PPO's value head (only when the advantage estimator is GAE): a linear map of the final hidden state.
  value = (dict(w=jnp.zeros((cfg.d_model,), jnp.float32), b=jnp.zeros((), jnp.float32))
           if lcfg.advantage == "gae" else None)
  params = dict(policy=policy, value=value)
  # optax may hand out one buffer for several state leaves (e.g. step counts); copies make donation safe.
  opt_state = jax.tree.map(jnp.copy, optimizer.init(params))
  # The frozen reference policy for the KL term (in the loss or in the reward); a real copy, since astype to the
  # same dtype would alias the donated params buffers.
  ref_params = (jax.tree.map(lambda x: jnp.array(x, compute_dtype, copy=True), policy)
                if lcfg.kl_coef > 0 else None)
  stream = data.PromptStream(problems_for_training(), seed=FLAGS.seed)
  tracker = data.PassRateTracker()
  # The trainer draws no random numbers of its own: data order is the stream's state (saved below) and sampling
  # keys derive from prompt ids on the workers, so the seed is the whole RNG state.
  state = dict(step=0, version=-1, seq=0, issued=0, consumed=[], seed=FLAGS.seed)
  ckpt_dir = os.path.join(FLAGS.run_dir, "ckpt")
  path = latest_checkpoint(ckpt_dir)
  if path:
    p_np, o_np, state = load_checkpoint(path, params, opt_state)
    params, opt_state = like(p_np, params), like(o_np, opt_state)
    stream.load_state_dict(state["stream"])
    tracker.load_state_dict(state["pass_rates"])
    logging.info("resumed from %s at step %d", path, state["step"])
  consumed = set(state["consumed"])
  loss_fn = lambda p, r, b: rl_loss(p, r, b, cfg=cfg, lcfg=lcfg, temperature=FLAGS.temperature,  # noqa: E731
                                    compute_dtype=compute_dtype, attn_impl=FLAGS.attn_impl,
                                    value_coef=FLAGS.value_coef)
  # Pin the outputs to the inputs' shardings: XLA would otherwise leave updated params/moments replicated.
  shardings = jax.tree.map(lambda x: x.sharding, (params, opt_state))
  train_step = jax.jit(make_train_step(optimizer, loss_fn, FLAGS.grad_accum), donate_argnums=(0, 1),
                       out_shardings=(*shardings, None))
  bsh = NamedSharding(mesh, P(("data", "fsdp")))
  metrics = Metrics(os.path.join(FLAGS.run_dir, "metrics.jsonl"))

  client = None
  if lead:
    host, port = FLAGS.server.rsplit(":", 1)
    token = open(FLAGS.token_file).read().strip() if FLAGS.token_file else None
    client = param_server.Client(host, int(port), token=token, retries=FLAGS.server_retries)
    client.requeue("rollouts")  # leases held by a previous incarnation of this trainer come back now

  def publish():
    nonlocal push_s
    t = time.time()
    hp = host_params(jax.tree.map(lambda x: x.astype(compute_dtype), params["policy"]))  # collective
    if lead:
      state["version"] = max(state["version"], client.latest_version()) + 1
      flat = param_server.flatten(hp)
      flat["__config__"] = np.frombuffer(json.dumps(cfg.to_hf_dict()).encode(), np.uint8)
      flat["__sampling__"] = np.frombuffer(json.dumps(sampling).encode(), np.uint8)
      client.push(state["version"], flat)
    push_s = time.time() - t

  def checkpoint():
    hp, ho = host_params(params), host_params(opt_state)
    if lead:
      st = dict(state, stream=stream.state_dict(), pass_rates=tracker.state_dict())
      save_checkpoint(ckpt_dir, state["step"], hp, ho, st, FLAGS.keep_checkpoints)
      if to_ack:  # only now are these rollouts durably consumed
        client.ack("rollouts", list(to_ack))
      to_ack.clear()

  def issue(target):
    items = []
    while state["issued"] - len(consumed) < target:
      p = stream.next()
      items.append(prompt_item(f"s{state['seq']}", p))
      state["seq"] += 1
      state["issued"] += 1
    if items:
      client.put("prompts", items)

  def prompt_item(pid, p):
    return dict(id=pid, prompt_id=p.id, prompt=p.prompt, answer=p.answer, task=p.task,
                tests=list(p.tests) if p.tests else None, group_size=FLAGS.group_size,
                prompt_tokens=np.asarray(tok.encode(data.render_prompt(p, FLAGS.template), add_bos=True), np.int32))

  to_ack, push_s = [], 0.0
  # The workers' sampling settings travel with the weights: one source of truth for what the loss scores.
  sampling = dict(temperature=FLAGS.temperature, top_k=FLAGS.top_k, top_p=FLAGS.top_p,
                  max_new_tokens=FLAGS.max_new_tokens)
  publish()
  bar = None
  if lead:
    from tqdm import tqdm
    bar = tqdm(total=FLAGS.steps, initial=state["step"], desc=f"{FLAGS.algo}", dynamic_ncols=True)
  P_ = FLAGS.prompts_per_step
  while state["step"] < FLAGS.steps:
    t0 = time.time()
    groups, n_stale, n_dropped, n_dup = [], 0, 0, 0
    if lead:
      while len(groups) < P_ and not stop.requested:
        issue(P_ * FLAGS.prefetch_steps)
        for it in client.get("rollouts", max_items=P_ - len(groups), wait_s=FLAGS.get_wait_s,
                             lease_s=FLAGS.rollout_lease_s):
          rid = it["id"]
          if rid in consumed:  # recorded by a checkpoint but not acked before a crash
            client.ack("rollouts", [rid])
            n_dup += 1
            continue
          consumed.add(rid)
          state["consumed"].append(rid)
          to_ack.append(rid)
          if state["version"] - int(it["version"]) > FLAGS.max_staleness:
            n_stale += 1  # too old to train on: re-issue the prompt under a fresh id
            client.put("prompts", [dict({k: it[k] for k in PROMPT_FIELDS}, id=rid + "r",
                                        group_size=FLAGS.group_size)])
            state["issued"] += 1
            continue
          tracker.update(it["prompt_id"], np.asarray(it["rewards"]))
          if FLAGS.dynamic_sampling and np.std(it["rewards"]) == 0:
            n_dropped += 1
            continue
          groups.append(it)
    stop_now = bool(multihost_utils.broadcast_one_to_all(np.int32(stop.requested))) \
        if jax.process_count() > 1 else stop.requested
    if stop_now:
      break
    wait_s = time.time() - t0
    trained_version = state["version"]  # the weights these groups are measured against (before this push)
    if lead:
      batch, rewards, lengths = rl_batch(groups, lcfg, tok.pad_id, BUCKETS, FLAGS.max_new_tokens)
    else:
      batch, rewards, lengths = None, None, None
    batch = broadcast_batch(batch)
    t1 = time.time()
    params, opt_state, m = train_step(params, opt_state, ref_params, to_global(batch, bsh))
    m = {k: float(v) for k, v in m.items()}  # host sync: the step is done
    step_s = time.time() - t1
    state["step"] += 1
    # A restarted server may have lost our newest version (it persists weights in the background): re-publish.
    lost = lead and client.latest_version() < state["version"]
    if jax.process_count() > 1:
      lost = bool(multihost_utils.broadcast_one_to_all(np.int32(lost)))
    if state["step"] % FLAGS.push_every == 0 or state["step"] == FLAGS.steps or lost:
      publish()
    if state["step"] % FLAGS.checkpoint_every == 0 or state["step"] == FLAGS.steps:
      checkpoint()
    if lead:
      lag = trained_version - np.asarray([int(g["version"]) for g in groups])
      rec = dict(step=state["step"], reward=float(rewards.mean()), pass_rate=float((rewards > 0.5).mean()),
                 completion_len=float(lengths.mean()), staleness_mean=float(lag.mean()),
                 staleness_max=int(lag.max()), stale_dropped=n_stale,
                 zero_var_dropped=n_dropped, duplicates_skipped=n_dup, wait_s=wait_s, step_s=step_s,
                 push_s=push_s, tokens_per_s=float(batch["loss_mask"].sum()) / max(step_s, 1e-9),
                 version=state["version"], rollout_ids=[g["id"] for g in groups], **m)
      metrics.write(rec)
      bar.update(1)
      bar.set_postfix(reward=f"{rec['reward']:.3f}", kl=f"{m.get('kl', 0):.4f}", ent=f"{m.get('entropy', 0):.3f}")
  checkpoint()
  if state["step"] >= FLAGS.steps:
    hp = host_params(params["policy"])
    if lead:
      out = os.path.join(FLAGS.run_dir, "final")
      model.save_hf_checkpoint(out + ".tmp", cfg, hp)
      shutil.rmtree(out, ignore_errors=True)
      os.rename(out + ".tmp", out)
      with open(os.path.join(FLAGS.run_dir, "DONE"), "w") as f:
        f.write(str(state["step"]))
      logging.info("training done at step %d: %s", state["step"], out)
  else:
    logging.info("stopped at step %d (checkpointed); rerun to resume", state["step"])


def main(argv):
  del argv
  if FLAGS.tokenizer is None:
    raise app.UsageError("--tokenizer is required")
  os.makedirs(FLAGS.run_dir, exist_ok=True)
  run_sft() if FLAGS.mode == "sft" else run_rl()


if __name__ == "__main__":
  define_flags()
  app.run(main)
