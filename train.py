"""train.py: the master trainer. Leases scored rollouts, computes the RL loss, updates with optax, publishes weights.

What the default run does (GRPO, arXiv 2402.03300, as the RLAX paper trains): each step takes --prompts_per_step
groups of --group_size completions that the workers sampled from a recent policy and the verifiers scored; a
completion's advantage is its reward minus its group's mean, over the group's std; the loss is decoupled PPO
(Hilton et al. 2021; AReaL): the clipped (0.2) ratio pi_theta / pi_prox times the advantage, weighted by the
behaviour correction min(pi_prox / mu, 2) (pi_prox: the policy at the step's start; mu: the worker's own log-probs
of what it sampled, up to --max_staleness versions old), averaged over each completion's tokens and then over
completions, plus a k3 KL penalty (beta 0.04) to the frozen initial policy; one AdamW update per batch, then the
new weights go to the workers. It deliberately leaves out a value network (GRPO needs none; --algo=ppo adds a
value head), an entropy bonus, dynamic sampling and clip-higher (--algo=dapo), and waiting for the freshest
weights: workers generate asynchronously, which the behaviour weight accounts for. Other algorithms: --algo
(losses.ALGORITHMS; every preset gets the same behaviour correction).

Reading order (top-down): flags; setup (mesh, prompts, params, optimizer); run_rl, the loop as named steps
(collect -> batch -> step -> publish -> checkpoint -> log); the step (loss, PPO epochs, gradient accumulation);
the batch (rollout groups -> padded arrays, process 0 -> every process); publish (each process stages its own
shards on its shard server, process 0 commits the manifest last: no process gathers the model); checkpoint
(orbax: sharded, asynchronous, restorable onto another mesh or process count) and the HF export; the
exactly-once ledger (a rollout is acked on the server only after a checkpoint that records it as consumed has
committed, so a trainer killed or SIGTERMed at any point neither loses nor retrains one); the SFT warm-start
that builds the demo's base policy (--mode=sft). Tests and benches import the pieces from here.

Precision: fp32 master weights; --param_dtype=bfloat16 casts them for the forward and the workers; log-probs and
the loss in fp32. Process 0 alone talks to the queues and broadcasts each batch; every process runs the same
jitted step over one global (data, fsdp, tensor) mesh (jax.distributed; gloo on CPU, the multi-host code path).

Run:
  CPU, one process:  python train.py --run_dir=runs/x --init_checkpoint=runs/x/base --tokenizer=runs/x/tokenizer.model
  CPU, 2 processes:  add --num_processes=2 --process_id={0,1} --coordinator=127.0.0.1:12355 (launch.sh does this)
  TPU pod:           bash launch.sh v5p-1024  (one trainer process per trainer host; see --dry_run)
"""
import collections
import concurrent.futures
import dataclasses
import functools
import json
import math
import os
import random
import shutil
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags, logging
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

import common
import data
import losses
import model
import param_server
from tasks import arithmetic

FLAGS = flags.FLAGS


# --- Flags -----------------------------------------------------------------------------------------------------------

def define_flags():
  """Called only by main(): importing this file defines no flag (see common)."""
  common.define_shared_flags(max_new_tokens=8, task_args_error=data.task_args_error)
  flags.adopt_module_key_flags(common)
  flags.DEFINE_enum("mode", "rl", ["rl", "sft"], "rl: RL from rollouts; sft: supervised warm-start. Default rl.")
  flags.DEFINE_string("run_dir", "runs/local", "Directory for checkpoints, metrics and the final model. Default runs/local.")
  flags.DEFINE_string("shard_servers", "", "Comma-separated host:port of the shard servers; trainer process i "
                      "stages its shards on entry i % S, the manifest goes to --server; self:PORT = the server on each "
                      "process's own host (a pod). Default empty: --server alone (S=1).")
  flags.DEFINE_string("init_checkpoint", None, "HF checkpoint dir of the initial policy (rl mode). Required for rl.")
  # Data.
  flags.DEFINE_string("task", "arithmetic", "Built-in task when --train_jsonl is not given. Default arithmetic.")
  flags.DEFINE_string("task_args", "", "The built-in task's own options, name=value,... e.g. difficulty=2,ops=+ "
                      "(its generate in tasks/). Default empty: the task's own (arithmetic: difficulty=3,ops=+-).")
  flags.DEFINE_string("train_jsonl", None, "jsonl prompt file (id, prompt, answer[, task, tests]). Default none.")
  flags.DEFINE_integer("train_size", 8000, "Number of built-in training problems generated. Default 8000.")
  flags.DEFINE_string("jsonl_shape", "auto", "Record shape of --train_jsonl (data.load_jsonl): auto, prompt, "
                      "messages, gsm8k, math. Default auto (detected per line).")
  flags.DEFINE_integer("max_seq_len", 0, "Longest prompt + completion in tokens; a prompt that cannot fit with "
                       "--max_new_tokens is skipped at load (logged with file:line). 0 = the checkpoint's "
                       "max_position_embeddings. Default 0.")
  # RL.
  flags.DEFINE_enum("algo", "grpo", list(losses.ALGORITHMS), "Loss preset (losses.ALGORITHMS). Default grpo.")
  flags.DEFINE_multi_string("loss_override", [], "field=value overrides of the LossConfig, e.g. kl_coef=0.01. Default none.")
  flags.DEFINE_integer("steps", 100, "Optimizer steps in the run. Default 100.")
  flags.DEFINE_integer("prompts_per_step", 16, "Prompt groups per optimizer step. Default 16.")
  flags.DEFINE_integer("group_size", 8, "Samples per prompt (G). Default 8.")
  flags.DEFINE_integer("prefetch_steps", 2, "Steps worth of prompts kept issued ahead of training. Default 2.")
  flags.DEFINE_bool("dynamic_sampling", False, "Drop zero-variance groups and refill (DAPO). Default False.")
  flags.DEFINE_integer("curate_prompts", 0, "Offline curation before RL (the paper's pass-rate band): the stream's "
                       "next N prompts get group_size samples of the base policy through the workers (scored, never "
                       "trained on); their pass rates seed the table that skips prompts outside --pass_band when "
                       "issuing. 0 = off. Default 0.")
  flags.DEFINE_string("pass_band", "", "low,high pass rates: keep prompts with low < rate < high, offline "
                      "(--curate_prompts) and online (a prompt whose tracked pass rate left the band is not issued "
                      "again). Empty = off. Default empty.")
  flags.DEFINE_integer("ppo_epochs", 1, "Passes over each batch (PPO epochs); >1 recomputes the proximal log-probs "
                       "(and, for ppo, the values V_old that fix the GAE advantages) once per batch for the clip. "
                       "Default 1.")
  flags.DEFINE_integer("minibatches", 1, "Optimizer updates per epoch (the batch split in this many). Default 1.")
  flags.DEFINE_float("gae_gamma", 1.0, "GAE discount gamma (ppo only). Default 1.0.")
  flags.DEFINE_float("gae_lambda", 1.0, "GAE lambda (ppo only). Default 1.0.")
  flags.DEFINE_float("value_coef", 0.5, "Value-loss weight (PPO with GAE only). Default 0.5.")
  flags.DEFINE_float("value_clip", 0.0, "PPO value clipping (GAE only): bound on |V - V_old| in absolute value units "
                     "(returns are rewards, not normalised), V_old = the value head before the step's first update; a "
                     "no-op with --ppo_epochs=1 --minibatches=1. 0 = off. Default 0.")
  flags.DEFINE_float("lr", 1e-4, "Peak learning rate. Default 1e-4.")
  flags.DEFINE_integer("warmup_steps", 5, "Linear warmup steps, then cosine decay to 10%. Default 5.")
  flags.DEFINE_float("weight_decay", 0.0, "AdamW weight decay. Default 0.")
  flags.DEFINE_float("grad_clip", 1.0, "Global-norm gradient clip. Default 1.0.")
  flags.DEFINE_integer("grad_accum", 0, "Micro-batches per optimizer update (a divisor of its rows). 0 = the fewest "
                       "whose compiled step fits --memory_gb (fit_grad_accum). Default 0.")
  flags.DEFINE_float("memory_gb", 0.0, "Memory budget per device for --grad_accum=0, GiB. 0 = the device's limit "
                     "(TPU/GPU) or, on CPU, half the host's RAM over its devices. Default 0.")
  flags.DEFINE_integer("max_nonfinite_steps", 5, "Steps in a row whose loss or gradient is non-finite (each update "
                       "is skipped, the weights untouched) after which the run stops with an error. Default 5.")
  flags.DEFINE_enum("param_dtype", "float32", ["float32", "bfloat16"], "Compute/worker weight dtype (master stays fp32). "
                    "Default float32.")
  flags.DEFINE_integer("push_every", 1, "Push weights every N steps. Default 1.")
  flags.DEFINE_integer("checkpoint_every", 10, "Checkpoint (and ack) every N steps. Default 10.")
  flags.DEFINE_integer("export_every", 0, "Also export the policy as an HF checkpoint to <run_dir>/exports/"
                       "step_NNNNNN every N steps (held-out pass@k versus step: python -m tools.curation). 0 = off (a 32B "
                       "export is a full gather per export). Default 0.")
  flags.DEFINE_integer("eval_every", 0, "Every N steps, the held-out set (--eval_jsonl or --eval_task, --eval_n "
                       "problems, --k samples) goes to the workers with the training prompts at the run's sampling "
                       "settings; its pass@1/pass@k land in metrics.jsonl when the last group is back (the trainer "
                       "never waits for them). 0 = off. Default 0.")
  flags.DEFINE_bool("tensorboard", True, "Also write metrics.jsonl's numbers as TensorBoard scalars to "
                    "<run_dir>/tensorboard (tensorboardX). Default True.")
  flags.DEFINE_integer("keep_checkpoints", 2, "Checkpoints kept on disk. Default 2.")
  flags.DEFINE_string("checkpoint_dir", "", "Where checkpoints go (a path or gs://bucket/path). Default '' = "
                      "<run_dir>/ckpt. With several trainer hosts it must be storage they all share (orbax: each "
                      "process writes its shards into it, process 0 commits).")
  flags.DEFINE_float("get_wait_s", 2.0, "Seconds one rollout lease call may block. Default 2.")
  flags.DEFINE_float("rollout_lease_s", 600.0, "Rollout lease on the server, seconds (must outlast checkpoint_every "
                     "steps). Default 600.")
  flags.DEFINE_bool("remat", False, "Recompute each layer's activations in the backward pass (keeps only the "
                    "per-layer residual [B,T,D]; ~1/3 more step FLOPs). Default False.")
  flags.DEFINE_integer("logprob_chunk", 0, "Sequence positions per chunk of the log-prob/entropy computation, so the "
                       "fp32 [B,T,V] logits are never formed (0 = whole sequence at once). Default 0.", lower_bound=0)
  flags.DEFINE_string("mesh", "1,1,-1", "data,fsdp,tensor mesh shape; one -1 takes the remaining devices. Default 1,1,-1.")
  # Multi-process.
  flags.DEFINE_integer("num_processes", 1, "JAX processes in the trainer (0 = auto-detect on a TPU slice). Default 1.")
  flags.DEFINE_integer("process_id", 0, "This process's index. Default 0.")
  flags.DEFINE_string("coordinator", "127.0.0.1:12355", "jax.distributed coordinator host:port. Default 127.0.0.1:12355.")
  # SFT warm-start (the demo's base policy).
  flags.DEFINE_integer("sft_steps", 300, "SFT steps. Default 300.")
  flags.DEFINE_integer("sft_batch", 64, "SFT sequences per step. Default 64.")
  flags.DEFINE_float("sft_lr", 3e-3, "SFT peak learning rate. Default 3e-3.")
  flags.DEFINE_float("sft_target_loss", 0.0, "Stop SFT once the mean loss (nats/token) of the last 50 steps is <= "
                     "this, --sft_steps being the cap: the base then lands at the same quality whatever the seed or "
                     "machine, instead of wherever a fixed step count leaves it. 0 = off. Default 0.")
  flags.DEFINE_float("sft_slip", 0.0, "Probability (0-1) that the SFT teacher writes the answer's last digit one too "
                     "high (9 -> 0): a flawed teacher. SFT run to convergence then lands at a known per-sample pass "
                     "rate (1 - slip) whatever the seed, and RL with the verifier has to unlearn the habit. "
                     "0 = a perfect teacher. Default 0.")
  flags.DEFINE_enum("sft_slip_if", "always", ["always", "carry"], "Where the teacher slips: on every answer, or "
                    "only on sums whose units digits carry (an input-dependent flaw: RL must tell the two apart). "
                    "Default always.")
  flags.DEFINE_string("sft_out", None, "Where SFT writes its HF checkpoint. Default <run_dir>/base.")
  flags.DEFINE_string("model_config", "d_model=128,n_layers=2,n_heads=4,n_kv_heads=2,ffw_dim=512",
                      "Tiny model shape for SFT from scratch. Default d_model=128,n_layers=2,n_heads=4,n_kv_heads=2,"
                      "ffw_dim=512.")
  # Bad values fail at flag parsing, before any work starts (issue 15), with the flag and its value named.
  at_least = lambda n: (lambda v: v >= n)  # noqa: E731
  positive = lambda v: math.isfinite(v) and v > 0  # noqa: E731
  nonneg = lambda v: math.isfinite(v) and v >= 0  # noqa: E731
  for name, ok, rule in (
      ("steps", at_least(1), ">= 1"), ("prompts_per_step", at_least(1), ">= 1"), ("group_size", at_least(1), ">= 1"),
      ("prefetch_steps", at_least(1), ">= 1 (0 issues no prompts: the trainer would wait forever)"),
      ("grad_accum", at_least(0), ">= 0 (0 = auto)"), ("push_every", at_least(1), ">= 1"),
      ("max_nonfinite_steps", at_least(1), ">= 1"),
      ("checkpoint_every", at_least(1), ">= 1"), ("keep_checkpoints", at_least(1), ">= 1"),
      ("warmup_steps", at_least(0), ">= 0"), ("sft_steps", at_least(1), ">= 1"), ("sft_batch", at_least(1), ">= 1"),
      ("train_size", at_least(1), ">= 1"),
      ("temperature", positive, "finite and > 0"), ("lr", positive, "finite and > 0"),
      ("sft_lr", positive, "finite and > 0"), ("get_wait_s", positive, "finite and > 0"),
      ("rollout_lease_s", positive, "finite and > 0"), ("grad_clip", positive, "finite and > 0"),
      ("weight_decay", nonneg, "finite and >= 0"), ("sft_target_loss", nonneg, "finite and >= 0 (0 = off)"),
      ("sft_slip", lambda v: 0 <= v < 1, "in [0, 1)"), ("value_coef", nonneg, "finite and >= 0"),
      ("value_clip", nonneg, "finite and >= 0 (0 = off)"), ("export_every", at_least(0), ">= 0 (0 = off)"),
      ("curate_prompts", at_least(0), ">= 0 (0 = off)")):
    flags.register_validator(name, ok, message=f"--{name} must be {rule}")
  common.register_task_validator("task", "task_args", "train_jsonl", data.task_args_error)
  flags.register_validator("pass_band", lambda v: parse_band(v) is not None or not v,
                           message="--pass_band must be 'low,high' with 0 <= low < high <= 1, or empty (off)")
  flags.register_multi_flags_validator(
      ["curate_prompts", "pass_band"], lambda f: not f["curate_prompts"] or f["pass_band"],
      message="--curate_prompts needs a --pass_band (e.g. 0,1: drop never- and always-solved prompts)")
  flags.register_multi_flags_validator(["sft_slip_if", "task", "train_jsonl"], lambda f: f["sft_slip_if"] == "always"
      or (f["task"] == "arithmetic" and not f["train_jsonl"]), message="--sft_slip_if=carry needs generated "
      "arithmetic (--task=arithmetic, no --train_jsonl)")
  flags.register_multi_flags_validator(
      ["group_size", "dynamic_sampling"], lambda f: f["group_size"] >= 2 or not f["dynamic_sampling"],
      message="--dynamic_sampling needs --group_size >= 2 (a group of 1 always has zero variance: every group "
              "would be dropped and the trainer would wait forever)")


# --- Setup -----------------------------------------------------------------------------------------------------------

def setup_mesh():
  if FLAGS.num_processes == 0:  # TPU pod: the slice tells each host its process id and the coordinator
    jax.distributed.initialize()
  elif FLAGS.num_processes > 1:
    # Cross-process collectives on CPU go through gloo (ignored on TPU). Asking for the backend here would
    # initialise it before jax.distributed, which must come first.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=FLAGS.coordinator, num_processes=FLAGS.num_processes,
                               process_id=FLAGS.process_id)
  return model.make_mesh(*parse_mesh(FLAGS.mesh, jax.device_count()), devices=jax.devices())


def parse_mesh(spec, n_devices):
  dims = [int(x) for x in spec.split(",")]
  if len(dims) != 3 or dims.count(-1) > 1:
    raise ValueError(f"--mesh must be data,fsdp,tensor with at most one -1, got {spec!r}")
  known = int(np.prod([d for d in dims if d != -1]))
  dims = [n_devices // known if d == -1 else d for d in dims]
  if int(np.prod(dims)) != n_devices:
    raise ValueError(f"--mesh {spec} gives {dims}, which does not use the {n_devices} devices")
  return dims


def training_prompts(cfg, tok, flags_file):
  """(encode, the training prompts that fit, the longest kept prompt's length, batch buckets); saves the run's
  flags once (process 0; a resumed run keeps the first record). encode: problem -> prompt token ids with --template
  applied. A prompt that cannot fit in --max_seq_len (capped by the checkpoint's positions) is refused here (logged
  with file:line), never handed to a worker."""
  encode = data.prompt_encoder(tok, FLAGS.template, FLAGS.tokenizer)
  problems = (data.load_jsonl(FLAGS.train_jsonl, FLAGS.jsonl_shape) if FLAGS.train_jsonl else
              data.make_task_problems(FLAGS.task, FLAGS.train_size, seed=FLAGS.seed, split="train",
                                      **data.parse_task_args(FLAGS.task_args)))
  budget = min(FLAGS.max_seq_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
  if FLAGS.max_new_tokens == 0:  # auto: what the context leaves (then recorded in flags.json, sent to the workers)
    FLAGS.max_new_tokens = data.completion_budget([len(encode(p)) for p in problems], budget)
    logging.info("--max_new_tokens=0: %d (context %d)", FLAGS.max_new_tokens, budget)
  problems, skipped, max_prompt = data.fit_prompts(problems, encode, FLAGS.max_new_tokens, budget)
  if not problems:
    raise app.UsageError(f"no training prompt fits: all {len(skipped)} exceed max_seq_len {budget} - "
                         f"max_new_tokens {FLAGS.max_new_tokens}")
  path = os.path.join(FLAGS.run_dir, flags_file)
  if jax.process_index() == 0 and not os.path.exists(path):
    vals = {f.name: f.value for f in FLAGS.get_key_flags_for_module(sys.modules[__name__])}
    common.write_atomic(path, json.dumps(vals, indent=1, sort_keys=True, default=str))
  return encode, problems, max_prompt, buckets_for(max_prompt + FLAGS.max_new_tokens)


def buckets_for(max_len):
  """Padded batch lengths: data.BUCKETS, extended (x2) until max_len fits, so 8k-32k sequences get a bucket
  (compiled shapes stay few: one per power of two)."""
  b = list(data.BUCKETS)
  while b[-1] < max_len:
    b.append(b[-1] * 2)
  return tuple(b)


def init_learner(mesh, cfg, init):
  """(loss config, params = {policy, value}, optimizer state, frozen reference policy or None, build_step):
  build_step(grad_accum) -> the jitted step."""
  lcfg = loss_config(losses.ALGORITHMS[FLAGS.algo], FLAGS.loss_override, FLAGS.max_new_tokens)
  compute_dtype = jnp.dtype(FLAGS.param_dtype)
  optimizer = make_optimizer(FLAGS.lr, FLAGS.warmup_steps, FLAGS.steps, FLAGS.weight_decay, FLAGS.grad_clip)
  policy = model.shard_params(init, cfg, mesh)  # fp32 master weights (already in place when loaded with the mesh)
  # PPO's value head (only when the advantage estimator is GAE): a linear map of the final hidden state.
  params = dict(policy=policy, value=dict(w=jnp.zeros((cfg.d_model,), jnp.float32), b=jnp.zeros((), jnp.float32))
                if lcfg.advantage == "gae" else None)
  # optax may hand out one buffer for several state leaves (e.g. step counts); copies make donation safe.
  opt_state = jax.tree.map(jnp.copy, optimizer.init(params))
  # The frozen reference policy for the KL term (in the loss or in the reward); a real copy, since astype to the
  # same dtype would alias the donated params buffers.
  ref_params = (jax.tree.map(lambda x: jnp.array(x, compute_dtype, copy=True), policy)
                if lcfg.kl_coef > 0 else None)
  kw = dict(cfg=cfg, temperature=FLAGS.temperature, compute_dtype=compute_dtype, attn_impl=FLAGS.attn_impl,
            logprob_chunk=FLAGS.logprob_chunk)
  loss_fn = functools.partial(rl_loss, lcfg=lcfg, value_coef=FLAGS.value_coef, gae_gamma=FLAGS.gae_gamma,
                              gae_lambda=FLAGS.gae_lambda, value_clip=FLAGS.value_clip, remat=FLAGS.remat, **kw)
  # Pin the outputs to the inputs' shardings: XLA would otherwise leave updated params/moments replicated.
  shardings = jax.tree.map(lambda x: x.sharding, (params, opt_state))

  def build_step(grad_accum):
    step = make_train_step(optimizer, loss_fn, grad_accum, lcfg.agg, epochs=FLAGS.ppo_epochs,
                           minibatches=FLAGS.minibatches, prox_fn=functools.partial(proximal, **kw))
    return jax.jit(step, donate_argnums=(0, 1), out_shardings=(*shardings, None))
  return lcfg, params, opt_state, ref_params, build_step


def fit_grad_accum(build_step, args, rows, length, bsh, budget):
  """--grad_accum=0: the fewest micro-batches (a divisor of the rows of an update) whose compiled step fits
  `budget` bytes per device at the longest bucket, as XLA's own buffer assignment counts it
  (compiled.memory_analysis(): arguments + outputs - donated + temporaries), not as a formula guesses: a binary
  search, ~log2(rows) compiles of the step at startup. The logits dominate for real vocabularies (16 x 8 rows x 2048
  x 49k x 4 B = 51 GB at one micro-batch); see --logprob_chunk and --remat for the other two levers."""
  batch = {k: jax.ShapeDtypeStruct((rows,) if k == "advantages" else (rows, length), dt, sharding=bsh)
           for k, dt in BATCH_KEYS.items()}

  @functools.lru_cache(maxsize=None)
  def peak(g):
    m = build_step(g).lower(*args, batch).compile().memory_analysis()
    need = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
    logging.info("--grad_accum=0: %d micro-batches of %d x %d tokens: step peak %.1f MiB per device (budget %.1f)",
                 g, per_update // g, length, need / 2**20, budget / 2**20)
    return need

  per_update = rows // FLAGS.minibatches
  divisors = [g for g in range(1, per_update + 1) if per_update % g == 0]
  lo, hi = 0, len(divisors) - 1  # invariant: divisors[hi] fits, or nothing does
  if peak(1) <= budget:  # the common case (the demo, a small model on a big device): one compile
    hi = 0
  while lo < hi:
    mid = (lo + hi) // 2
    lo, hi = (lo, mid) if peak(divisors[mid]) <= budget else (mid + 1, hi)
  g = divisors[hi]
  need = peak(g)
  if need > budget:
    raise app.UsageError(f"--grad_accum=0: even {g} micro-batches of one sequence of {length} tokens need "
                         f"{need / 2**20:.1f} MiB per device > the --memory_gb budget of {budget / 2**20:.1f} MiB; "
                         "use --remat, --logprob_chunk, a bigger --memory_gb or more devices")
  logging.info("--grad_accum=0: chose %d", g)
  return g


def memory_budget():
  """--memory_gb per device in bytes; 0 = the device's own limit (TPU/GPU), or on CPU half the host's RAM shared
  by its devices (the workers, the server and the host copies of a local run get the other half)."""
  if FLAGS.memory_gb:
    return int(FLAGS.memory_gb * 2**30)
  stats = jax.local_devices()[0].memory_stats() or {}
  if "bytes_limit" in stats:
    return int(stats["bytes_limit"])
  return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2 // jax.local_device_count()


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


def parse_band(spec):
  """--pass_band "low,high" -> (low, high) with 0 <= low < high <= 1; None when empty or malformed."""
  try:
    low, high = (float(x) for x in spec.split(","))
  except ValueError:
    return None
  return (low, high) if 0.0 <= low < high <= 1.0 else None


def connect_servers():
  """A client per parameter server: entry 0 (--server) holds the queues and the manifest; every trainer process
  stages its weight shards on entry process_index % S (publish_shards)."""
  token = open(FLAGS.token_file).read().strip() if FLAGS.token_file else None
  if FLAGS.shard_servers.startswith("self:"):  # a pod: one server per trainer host, on this port
    addrs = own_server_addresses(FLAGS.server, int(FLAGS.shard_servers[5:]))
  else:
    addrs = [FLAGS.server] + [a for a in FLAGS.shard_servers.split(",") if a and a != FLAGS.server]
  return [param_server.connect(a, token, FLAGS.server_retries) for a in addrs]


# --- The loop --------------------------------------------------------------------------------------------------------

def run_rl():
  """collect -> batch -> step -> publish -> checkpoint -> log, until --steps or a SIGTERM (a TPU preemption:
  the partial batch goes back to the server, the checkpoint is written, a rerun resumes)."""
  from tqdm import tqdm
  stop = param_server.StopFlag()
  mesh = setup_mesh()
  jax.set_mesh(mesh)  # activations are constrained by model.py's logical-axis table over this mesh
  lead = jax.process_index() == 0
  if FLAGS.init_checkpoint is None:
    raise app.UsageError("--mode=rl needs --init_checkpoint (an HF checkpoint dir)")
  tok = data.load_tokenizer(FLAGS.tokenizer)
  cfg, init = model.load_hf_checkpoint(FLAGS.init_checkpoint, dtype=jnp.float32, mesh=mesh)  # read sharded
  encode, problems, max_prompt, buckets = training_prompts(cfg, tok, "flags.json")  # (resolves --max_new_tokens=0)
  lcfg, params, opt_state, ref_params, build_step = init_learner(mesh, cfg, init)
  bsh = NamedSharding(mesh, P(("data", "fsdp")))
  rows, longest = FLAGS.prompts_per_step * FLAGS.group_size, next(b for b in buckets if b >= max_prompt + FLAGS.max_new_tokens)
  train_step = build_step(FLAGS.grad_accum or fit_grad_accum(build_step, (params, opt_state, ref_params), rows,
                                                             longest, bsh, memory_budget()))
  servers = connect_servers()
  collector = Collector(
      servers[0] if lead else None, data.PromptStream(problems, seed=FLAGS.seed), data.PassRateTracker(), encode,
      group_size=FLAGS.group_size, prefetch_steps=FLAGS.prefetch_steps, lease_s=FLAGS.rollout_lease_s,
      wait_s=FLAGS.get_wait_s, max_staleness=FLAGS.max_staleness, dynamic_sampling=FLAGS.dynamic_sampling,
      band=parse_band(FLAGS.pass_band))
  # The trainer draws no random numbers of its own: data order is the stream's state (in the checkpoint) and
  # sampling keys derive from prompt ids on the workers, so the seed is the whole RNG state.
  state = dict(step=0, version=-1, seed=FLAGS.seed)
  ckpt = Checkpointer(FLAGS.checkpoint_dir or os.path.join(FLAGS.run_dir, "ckpt"), FLAGS.keep_checkpoints)
  got = ckpt.restore(params, opt_state)  # onto this run's mesh, whatever mesh wrote it
  if got:
    params, opt_state, st = got
    collector.load_state_dict(st)
    state = {k: st[k] for k in ("step", "version", "seed", "curated") if k in st}
    logging.info("resumed at step %d", state["step"])
  if lead:
    # One trainer per run: from now on any older trainer still talking to the server is refused (fenced).
    logging.info("trainer epoch %d", servers[0].register_trainer())
    servers[0].requeue("rollouts")  # leases held by a previous incarnation of this trainer come back now
    collector.ledger.resumed(servers[0])
  # The workers' sampling settings travel with the weights (manifest header fields): one source of truth for
  # what the loss scores. max_prompt_len: the longest kept prompt, so the workers size their KV cache from it.
  meta = dict(config=cfg.to_hf_dict(), sampling=dict(temperature=FLAGS.temperature, top_k=FLAGS.top_k,
                                                     top_p=FLAGS.top_p, max_new_tokens=FLAGS.max_new_tokens,
                                                     max_prompt_len=max_prompt))
  gen = {k: meta["sampling"][k] for k in ("temperature", "top_p", "max_new_tokens")}  # the exports' generation_config
  restored, state["version"] = state["version"], publish(servers, state["version"], params["policy"], meta)
  if restored >= 0:  # resumed: the weights of `restored` are published again as a newer version (policy_lag)
    collector.forks = meta["forks"] = (collector.forks + [[restored, state["version"]]])[-16:]
  metrics = Metrics(os.path.join(FLAGS.run_dir, "metrics.jsonl"),
                    FLAGS.tensorboard and os.path.join(FLAGS.run_dir, "tensorboard"))
  if ckpt.damaged and lead:
    metrics.write(dict(step=state["step"], ckpt_damaged=ckpt.damaged))  # steps set aside by the restore
  lr_at = lr_schedule_fn(FLAGS.lr, FLAGS.warmup_steps, FLAGS.steps)  # the optimizer's schedule, for the log
  # Held-out eval during training: prompts longer than the workers' KV cache (sized for the longest training
  # prompt) are skipped, logged.
  eval_set = data.fit_prompts(data.eval_problems(FLAGS.eval_jsonl, FLAGS.eval_n, FLAGS.eval_task, FLAGS.eval_task_args),
                              encode, 0, max_prompt)[0] if FLAGS.eval_every and lead else []
  if eval_set and state["step"] == 0:
    collector.issue_eval(0, eval_set, FLAGS.k)  # the base policy's point of the curve
  if FLAGS.curate_prompts and not state.get("curated"):
    if lead:
      curate(collector, stop, metrics)  # its rates are in the checkpointed tracker
    state["curated"] = True
  bar = tqdm(total=FLAGS.steps, initial=state["step"], desc=FLAGS.algo, dynamic_ncols=True, mininterval=1.0,
             miniters=1, disable=not lead)
  push_s, nonfinite = 0.0, 0
  while state["step"] < FLAGS.steps:
    # 1. Collect a batch of rollout groups (process 0), exactly once.
    t0 = time.time()
    got = collector.collect(FLAGS.prompts_per_step, state["version"], stop) if lead else None
    if lead_says(stop.requested):  # the partial batch was never trained: back to the server
      if lead:
        collector.hand_back()
      break
    wait_s = time.time() - t0
    # 2. Batch: pad and pack on process 0, broadcast to the others.
    batch, rewards, lengths = (rl_batch(got.groups, lcfg, tok.pad_id, buckets, FLAGS.max_new_tokens) if lead
                               else (None, None, None))
    batch = broadcast_batch(batch)
    # 3. Step: one jitted update over the global mesh.
    t1 = time.time()
    params, opt_state, m = train_step(params, opt_state, ref_params, to_global(batch, bsh))
    m = {k: float(v) for k, v in m.items()}  # host sync: the step is done
    step_s = time.time() - t1
    nonfinite = nonfinite + 1 if m["update_skipped"] > 0 else 0
    if nonfinite:
      logging.warning("step %d: non-finite loss or gradient (loss %s, grad norm %s): update skipped (%d in a row)",
                      state["step"] + 1, m["loss"], m["grad_norm"], nonfinite)
    if nonfinite >= FLAGS.max_nonfinite_steps:
      raise RuntimeError(f"{nonfinite} steps in a row had a non-finite loss or gradient (last: loss {m['loss']}, "
                         f"grad norm {m['grad_norm']}); stopping before publishing. The weights of step "
                         f"{state['step']} are intact in the last checkpoint; see metrics.jsonl")
    state["step"] += 1
    if lead:
      collector.step_done()
    trained_version = state["version"]  # the weights these groups are measured against (before this push)
    # 4. Publish the new weights to the workers (again if a restarted server lost them).
    last = state["step"] == FLAGS.steps
    if state["step"] % FLAGS.push_every == 0 or last or weights_lost(servers, state["version"]):
      t2 = time.time()
      state["version"] = publish(servers, state["version"], params["policy"], meta)
      push_s = time.time() - t2
    # 5. Checkpoint (asynchronous; the rollouts it records are acked once it commits) and export.
    if state["step"] % FLAGS.checkpoint_every == 0 or last:
      checkpoint(ckpt, collector, state, params, opt_state)
    if eval_set and state["step"] % FLAGS.eval_every == 0:
      collector.issue_eval(state["step"], eval_set, FLAGS.k)
    if FLAGS.export_every and state["step"] % FLAGS.export_every == 0:
      export_hf(os.path.join(FLAGS.run_dir, "exports", f"step_{state['step']:06d}"), cfg, params["policy"],
                tokenizer_src=FLAGS.tokenizer, sampling=gen)
    # 6. Log.
    if lead:
      rec = step_record(state, got, collector, trained_version, rewards, lengths, batch, m,
                        dict(wait_s=wait_s, step_s=step_s, push_s=push_s), float(lr_at(state["step"] - 1)))
      metrics.write(rec)
      for ev in collector.pop_eval_records():  # held-out rounds whose last group came back
        logging.info("held-out eval of step %d: %s", ev["step"], {k: v for k, v in ev.items() if k != "step"})
        metrics.write(ev)
      bar.update(1)
      bar.set_postfix(reward=f"{rec['reward']:.3f}", kl=f"{m.get('kl', 0):.4f}", ent=f"{m.get('entropy', 0):.3f}")
  checkpoint(ckpt, collector, state, params, opt_state, final=True)
  ckpt.close()
  if state["step"] >= FLAGS.steps:
    out = os.path.join(FLAGS.run_dir, "final")
    export_hf(out, cfg, params["policy"], tokenizer_src=FLAGS.tokenizer, sampling=gen)
    if lead:
      with open(os.path.join(FLAGS.run_dir, "DONE"), "w") as f:
        f.write(str(state["step"]))
      logging.info("training done at step %d: %s", state["step"], out)
  else:
    logging.info("stopped at step %d (checkpointed); rerun to resume", state["step"])


def publish(servers, version, policy, meta):
  """Every process stages its own shards (no gather); process 0 commits the manifest, a version newer than
  both ours and the server's (publish_shards). Returns the version published."""
  want = max(version, servers[0].latest_version()) + 1 if jax.process_index() == 0 else 0
  dtype = jnp.dtype(FLAGS.param_dtype)
  return publish_shards(servers, want, jax.tree.map(lambda x: x.astype(dtype), policy), meta)[0]


def weights_lost(servers, version):
  """A restarted server has lost our newest version (weights are not persisted: the trainer re-publishes)."""
  return lead_says(jax.process_index() == 0 and (servers[0].latest_version() < version or any(
      version not in c.staged()["versions"] for c in servers)))


def checkpoint(ckpt, collector, state, params, opt_state, final=False):
  """Waits for the previous checkpoint's commit and acks what it recorded, then starts writing this step's
  (each process its own shards, asynchronously); final=True also waits for this one and acks it."""
  def commit():
    ckpt.wait()
    if jax.process_index() == 0:
      collector.committed()

  commit()
  if ckpt.save(state["step"], params, opt_state, dict(state, **collector.state_dict())):
    collector.saved()
  if final:
    commit()


def curate(collector, stop, metrics):
  """Once per run, before training: the base policy's pass rates on --curate_prompts prompts (Collector.curate)
  decide what is issued; curated.jsonl shows the user what was kept."""
  t = time.time()
  cand, rates = collector.curate(FLAGS.curate_prompts, stop)
  kept = data.filter_by_pass_rate(cand, rates, *collector.band)
  data.write_jsonl(os.path.join(FLAGS.run_dir, "curated.jsonl"), kept, rates)
  r = np.asarray(list(rates.values()))
  rec = dict(step=0, curation_prompts=len(cand), curation_kept=len(kept), curation_s=time.time() - t,
             curation_mean_rate=float(r.mean()), curation_never=float((r == 0).mean()),
             curation_always=float((r == 1).mean()))
  logging.info("curation: %s", rec)
  metrics.write(rec)


# What a rollout's worker reports with it (rollout.pull_weights figures, its load over the last 30 s); logged as the mean
# over a step's groups. With the trainer's own wait fraction they say which side to grow (tools/plot.py's balance line,
# docs/GUIDE.md "Sizing").
WORKER_STATS = ("pull_bytes", "pull_s", "delta_frac", "worker_busy_frac", "worker_tok_s", "worker_wait_prompts_frac",
                "worker_wait_send_frac", "worker_wait_weights_frac", "scored_by_verifier", "verdicts_reused_frac")


def step_record(state, got, collector, trained_version, rewards, lengths, batch, m, times, lr):
  """The step's line in metrics.jsonl (lr: the learning rate this step used)."""
  groups = got.groups
  lag = np.asarray([common.policy_lag(trained_version, g.version, collector.forks) for g in groups], int)
  rec = dict(step=state["step"], time=time.time(), lr=lr,
             reward=float(rewards.mean()), reward_std=float(rewards.std()),
             truncated_frac=float((lengths >= FLAGS.max_new_tokens).mean()), pass_rate=float((rewards > 0.5).mean()),
             completion_len=float(lengths.mean()), staleness_mean=float(lag.mean()), staleness_max=int(lag.max()),
             stale_dropped=got.stale, zero_var_dropped=got.zero_var, duplicates_skipped=got.duplicates,
             malformed_skipped=got.malformed, quarantined=len(collector.quarantined),
             band_skipped=collector.band_skipped, **times,
             tokens_per_s=float(batch["loss_mask"].sum()) / max(times["step_s"], 1e-9),
             version=state["version"], rollout_ids=[g.id for g in groups], skipped_ids=got.skipped, **m)
  for k in WORKER_STATS:
    vals = [g.stats[k] for g in groups if k in g.stats]
    if vals:
      rec[k] = float(np.mean(vals))
  # Generation spent: trained vs thrown away (by reason), and staleness per trained token (its group's tag: the
  # oldest token's version, an upper bound for the others) as a histogram [tokens at lag 0, 1, ...].
  ntok = np.asarray([g.n_tokens for g in groups])
  rec.update(trained_tokens=int(ntok.sum()), dropped_tokens=dict(got.dropped_tokens),
             staleness_tokens=np.bincount(lag, weights=ntok).astype(int).tolist(), keep_rate=collector.keep_rate(),
             issued_ahead=collector.ahead(FLAGS.prompts_per_step))
  # Tokens a preempted worker generated and handed back (partial rollouts) that another worker continued.
  rec.update(resumed_tokens=int(sum(g.stats.get("resumed_tokens", 0) for g in groups)),
             workers=len({g.worker for g in groups}),
             trainer_wait_frac=times["wait_s"] / max(sum(times.values()), 1e-9))
  return rec


# --- The step: loss over a batch, PPO epochs, gradient accumulation, the optimizer -----------------------------------

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
  The ratio of the clip is pi_theta / pi_prox and the behaviour weight min(pi_prox / mu, tis_cap), mu =
  batch["behaviour_logp"]; pi_prox = batch["prox_logp"] when present (several updates per batch, make_train_step),
  else the current policy without gradient.
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
  # Decoupled PPO, always (the data may be stale, or continued from a partial rollout of an older version): the
  # clip is on pi / pi_prox and the behaviour correction is the capped weight pi_prox / mu. pi_prox is the step's
  # starting policy: fixed by make_train_step for several updates, else the current one (ratio 1 inside the clip).
  prox = batch["prox_logp"] if "prox_logp" in batch else jax.lax.stop_gradient(logp)
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


def make_train_step(optimizer, loss_fn, grad_accum, agg, *, epochs=1, minibatches=1, prox_fn=None):
  """One trainer step on a batch. epochs x minibatches optimizer updates (PPO epochs, as verl/OpenRLHF/TRL);
  with more than one update, prox_fn(params, batch) (e.g. proximal) is called once before the first update and
  its arrays added to the batch: the fixed proximal policy of the clip and V_old, while the worker's behaviour
  log-probs stay in the batch for TIS (decoupled PPO / AReaL). With 1 x 1 the update is the plain one (ratio
  pi_theta / mu). The updates are unrolled (epochs * minibatches copies in the compiled step, each a grad_accum
  scan); metrics are the mean over updates; clip_frac/ratio_min/ratio_max(/value_clip_frac)_last are the last's.
  agg: the loss's aggregation (LossConfig.agg), which decides what a micro-batch's share of the update is."""
  if epochs < 1 or minibatches < 1:
    raise ValueError(f"make_train_step: epochs={epochs} and minibatches={minibatches} must be >= 1")
  update = _make_update(optimizer, loss_fn, grad_accum, agg)
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


def _make_update(optimizer, loss_fn, grad_accum, agg):
  def step(params, opt_state, ref_params, batch):
    def scaled(p, mb, s):  # micro-batch loss x (grad_accum x its share): the scan's mean is then the global mean
      loss, m = loss_fn(p, ref_params, mb)
      return loss * s, m

    def micro(acc, xs):
      (loss, m), g = jax.value_and_grad(scaled, has_aux=True)(params, *xs)
      return jax.tree.map(jnp.add, acc, (g, loss, m)), None

    mbs = _microbatches(batch, grad_accum)
    # Token means normalise by the whole update's token count (sequence count for the per-sequence aggregations),
    # not each micro-batch's: with micro-batches of 8 and 7 tokens, the mean of their token means weighs a token of
    # the short one 8/7 of one of the long one.
    per_row = mbs["loss_mask"].sum(-1)  # [grad_accum, rows]
    counts = (per_row if agg == "token_mean" else (per_row > 0)).sum(-1).astype(jnp.float32)
    shares = grad_accum * counts / jnp.maximum(counts.sum(), 1)
    zero = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), jax.eval_shape(
        lambda: (params, *jax.value_and_grad(scaled, has_aux=True)(params, jax.tree.map(lambda x: x[0], mbs),
                                                                    shares[0])[0])))
    (g, loss, m), _ = jax.lax.scan(micro, zero, (mbs, shares))
    g, loss, m = jax.tree.map(lambda x: x / grad_accum, (g, loss, m))
    updates, new_opt = optimizer.update(g, opt_state, params)
    gnorm = optax.tree.norm(g)
    # The numerical firewall: a non-finite loss or gradient (one bad batch, one bad chip) never reaches the weights
    # or the optimizer moments; the update is skipped and counted (run_rl stops after --max_nonfinite_steps).
    ok = jnp.isfinite(loss) & jnp.isfinite(gnorm)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)  # noqa: E731
    return (keep(optax.apply_updates(params, updates), params), keep(new_opt, opt_state),
            dict(m, loss=loss, grad_norm=gnorm, update_skipped=1.0 - ok))
  return step


# --- The batch: rollout groups -> padded arrays, process 0 -> every process ------------------------------------------

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


def to_global(host_tree, sharding):
  """Every process holds the same host copy; build global arrays sharded over the mesh from it."""
  return jax.tree.map(lambda x: jax.make_array_from_callback(x.shape, sharding, lambda idx, x=x: x[idx]), host_tree)


def lead_says(flag):
  """Process 0's bool, on every process (each process must take the same branch around a collective)."""
  if jax.process_count() == 1:
    return bool(flag)
  return bool(multihost_utils.broadcast_one_to_all(np.int32(bool(flag))))


class Metrics:
  """jsonl metrics (process 0 only); one line per step. tensorboard_dir: the same numbers as TensorBoard scalars
  (tensorboardX, imported only then), keyed by the record's step; pass@k is tagged pass_at_k."""

  def __init__(self, path, tensorboard_dir=None):
    lead = jax.process_index() == 0
    self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if lead else None
    self.tb = None
    if tensorboard_dir and lead:
      from tensorboardX import SummaryWriter
      self.tb = SummaryWriter(tensorboard_dir)

  def write(self, rec):
    # One write() per line: a buffered text file splits a long line (a step's sample ids run past 8 KiB) into
    # several writes, and a reader tailing the file (tools/plot.py, the system tests, a user's `tail -f | jq`) then sees
    # a cut line that is not the sign of a crash.
    if self.fd is not None:
      data = (json.dumps(rec) + "\n").encode()
      while data:
        data = data[os.write(self.fd, data):]
    if self.tb is not None:
      for k, v in rec.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("step", "time"):
          self.tb.add_scalar(k.replace("@", "_at_"), v, rec.get("step", 0), walltime=rec.get("time"))  # TB tag rules
      self.tb.flush()  # as the jsonl line: on disk now (a preempted or killed trainer leaves no buffered records)


# --- Publish: every process stages its own shards, process 0 commits the manifest last -------------------------------

def own_server_addresses(manifest_server, port):
  """A pod: every trainer process has a shard server on its own host at `port`, except process 0, whose host
  runs the main server (manifest_server). Returns all of them in process order, as host:port (this host's
  address is the one that reaches the manifest server): process i stages on entry i. Collective."""
  import socket
  host, mport = manifest_server.rsplit(":", 1)
  with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    s.connect((host, int(mport)))
    me = f"{s.getsockname()[0]}:{port}".encode()
  buf = np.zeros(64, np.uint8)
  buf[:len(me)] = np.frombuffer(me, np.uint8)
  allb = multihost_utils.process_allgather(buf) if jax.process_count() > 1 else buf[None]
  return [manifest_server] + [bytes(b).rstrip(b"\0").decode() for b in np.asarray(allb)][1:]


def _agree(version):
  """Process 0's (version, nonce) on every process: all stage under the same tag."""
  v = np.asarray([version, random.getrandbits(31)], np.int64)
  if jax.process_count() > 1:
    v = multihost_utils.broadcast_one_to_all(v)
  return int(v[0]), int(v[1])


def publish_shards(clients, version, tree, meta):
  """Stages this process's replica-0 shards of `tree` on its server; process 0 commits the manifest last.
  Collective: every trainer process calls it. Returns (version, bytes this process sent)."""
  version, nonce = _agree(version)
  flat = param_server.flatten(tree)
  own, sent = clients[jax.process_index() % len(clients)], 0
  for name, x in flat.items():
    for s in x.addressable_shards:
      if s.replica_id == 0:
        host = np.asarray(s.data)  # this shard only, device -> host
        own.stage(version, nonce, name, param_server.slice_index(s.index, x.shape), host)
        sent += host.nbytes
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(f"publish v{version}")  # every process has staged
  if jax.process_index() == 0:
    _commit(clients, version, nonce, flat, meta)
  return version, sent


def _commit(clients, version, nonce, flat, meta):
  """Builds the manifest from what the servers really hold, checks it covers every slice, commits it, GCs."""
  with concurrent.futures.ThreadPoolExecutor(len(clients)) as pool:
    tables = list(pool.map(lambda c: c.staged(version, nonce)["pieces"], clients))
  tensors = {n: dict(dtype=str(x.dtype), shape=list(x.shape), pieces=[]) for n, x in flat.items()}
  for k, table in enumerate(tables):
    for p in table:
      tensors[p["name"]]["pieces"].append(dict(index=p["index"], crc=p["crc"], server=k))
  for n, x in flat.items():
    need = {json.dumps(param_server.slice_index(i, x.shape)) for i in x.sharding.devices_indices_map(x.shape).values()}
    have = [json.dumps(p["index"]) for p in tensors[n]["pieces"]]
    if need != set(have) or len(have) != len(need):
      raise RuntimeError(f"publish v{version}: tensor {n!r} staged slices {sorted(have)} != expected {sorted(need)}")
  kept = clients[0].commit(dict(meta, version=version, servers=[f"{c.host}:{c.port}" for c in clients],
                                tensors=tensors))
  for c in clients:
    c.staged(keep=kept)


# --- Checkpoint and HF export ----------------------------------------------------------------------------------------

def _checksum(x):
  bits = jax.lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize])
  w = jnp.arange(x.size, dtype=jnp.uint32).reshape(x.shape) * jnp.uint32(2) + jnp.uint32(1)
  return jnp.sum(bits.astype(jnp.uint32) * w * jnp.uint32(2654435761), dtype=jnp.uint32)


_checksums = jax.jit(lambda tree: [_checksum(x) for x in jax.tree.leaves(tree)])


def checksums(tree):
  """Per array: sum of its bits times odd position weights, mod 2**32 (one fused pass on the devices, each shard
  where it lives; any single changed element changes it): a few bytes per leaf to store, cheap to recompute."""
  return [int(v) for v in jax.device_get(_checksums(tree))]


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
    self.path = ckpt_dir if "://" in ckpt_dir else os.path.abspath(ckpt_dir)  # gs://... goes to orbax as is
    self.damaged = 0  # steps set aside by restore()
    self.mngr = ocp.CheckpointManager(self.path, options=ocp.CheckpointManagerOptions(
        max_to_keep=keep, enable_async_checkpointing=True, create=True))

  def save(self, step, params, opt_state, state):
    """Starts writing step (collective) with a checksum of every array; returns False if that step is saved."""
    if self.mngr.latest_step() == step:
      return False
    a = self.ocp.args
    self.mngr.save(step, args=a.Composite(params=a.StandardSave(params), opt=a.StandardSave(opt_state),
                                          state=a.JsonSave(state), sums=a.JsonSave(checksums((params, opt_state)))))
    self._seal()
    return True

  def wait(self):
    """Blocks until the last save is committed."""
    self.mngr.wait_until_finished()
    self._seal()

  def _sizes(self, step):
    d = os.path.join(self.path, str(step))
    return {os.path.relpath(os.path.join(r, f), d): os.path.getsize(os.path.join(r, f))
            for r, _, fs in os.walk(d) for f in fs if not f.startswith("sizes.json")}

  def _seal(self):
    """Process 0 records each committed step's file sizes beside it, once; restore() compares them on every process
    before orbax reads a byte, so a file truncated or lost for one process fails there and on all the others alike
    (orbax's own read error comes on that process alone, inside its collectives: the others wait forever)."""
    if jax.process_index() == 0 and "://" not in self.path:  # a step dir gets its number when orbax commits it
      for step in (n for n in os.listdir(self.path) if n.isdigit()):
        try:  # (orbax may be deleting a step past max_to_keep meanwhile)
          if not os.path.exists(f := os.path.join(self.path, step, "sizes.json")):
            common.write_atomic(f, json.dumps(self._sizes(step)))
        except OSError:
          pass

  def restore(self, params_like, opt_like):
    """(params, opt_state, state) of the newest intact committed step placed like params_like/opt_like, or None.
    A step whose files are not the sizes recorded at commit (_seal), that does not restore, or whose arrays fail
    their checksums (a flipped bit) is set aside as <step>.damaged-<unix time> (never deleted), logged and counted
    in self.damaged, and the step before it is tried; if no step restores, nothing is set aside and the newest
    step's error is raised (a config mismatch, not damage, fails every step alike)."""
    a, bad = self.ocp.args, []
    abstract = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), t)  # noqa: E731
    for step in sorted(self.mngr.all_steps(), reverse=True):
      try:
        f = os.path.join(self.path, str(step), "sizes.json")
        if "://" not in self.path and os.path.exists(f) and json.load(open(f)) != self._sizes(step):
          raise ValueError("its files are not the sizes recorded when it was committed (truncated or lost)")
        r = self.mngr.restore(step, args=a.Composite(params=a.StandardRestore(abstract(params_like)),
                                                     opt=a.StandardRestore(abstract(opt_like)),
                                                     state=a.JsonRestore(), sums=a.JsonRestore()))
        if checksums((r["params"], r["opt"])) != r["sums"]:
          raise ValueError("the arrays do not match their checksums")
      except Exception as e:  # noqa: BLE001  (orbax and tensorstore raise many kinds on bad bytes)
        bad.append((step, e))
        continue
      for b, e in bad:
        logging.error("checkpoint step %d is damaged (%s: %s); set aside, resuming from step %d",
                      b, type(e).__name__, str(e)[:300], step)
        if jax.process_index() == 0 and "://" not in self.path:
          os.rename(os.path.join(self.path, str(b)), os.path.join(self.path, f"{b}.damaged-{int(time.time())}"))
      multihost_utils.sync_global_devices("checkpoint set aside")
      self.damaged += len(bad)
      self.mngr.reload()
      return r["params"], r["opt"], r["state"]
    if bad:
      raise bad[0][1]
    return None

  def close(self):
    self.mngr.close()


def export_hf(out, cfg, params, dtype=None, tokenizer_src=None, sampling=None, chunk_bytes=256 << 20):
  """HF safetensors from (possibly cross-process sharded) params; process 0 writes. Collective: every process
  calls it. Pieces are gathered one layer's slice (or <= 256 MiB of HF rows) at a time, so no device ever holds a
  whole layer-stacked tensor (one QwQ-32B w_up is 33.8 GiB fp32). Written to out.tmp and renamed (complete or
  absent). With tokenizer_src, the tokenizer files go beside it and generation_config.json carries the run's
  sampling (temperature, top_p, max_new_tokens), so transformers' from_pretrained(out) loads and samples as the
  run did."""
  lead = jax.process_index() == 0

  def get_piece(*a):
    x = model.hf_piece(params, *a)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True) if jax.process_count() > 1 else x)

  model.save_hf_checkpoint_streamed(out + ".tmp", cfg, get_piece, dtype or params["embed"].dtype, write=lead,
                                    chunk_bytes=chunk_bytes)
  if lead and tokenizer_src:
    src = tokenizer_src if os.path.isdir(tokenizer_src) else os.path.dirname(os.path.abspath(tokenizer_src))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                 "chat_template.jinja", "generation_config.json", "vocab.json", "merges.txt"):
      if os.path.exists(os.path.join(src, name)):
        shutil.copy(os.path.join(src, name), os.path.join(out + ".tmp", name))
    gen_path = os.path.join(out + ".tmp", "generation_config.json")
    gen = json.load(open(gen_path)) if os.path.exists(gen_path) else dict(
        bos_token_id=cfg.bos_token_id, eos_token_id=list(cfg.eos_token_ids) or None)
    with open(gen_path, "w") as f:
      json.dump(dict(gen, do_sample=True, **(sampling or {})), f, indent=1)
  if lead:
    shutil.rmtree(out, ignore_errors=True)
    os.rename(out + ".tmp", out)


# --- The exactly-once ledger: prompts issued, rollouts leased, acked after the checkpoint commits --------------------
# Process 0's side of the queues. A rollout leased for step s is consumed (trained, or skipped as stale /
# zero-variance / malformed, listed in the step's skipped_ids) only once a checkpoint holding step s has committed,
# and only then acked on the server. A trainer killed before that gets the rollouts again (the startup requeue
# releases its leases) and trains them once in the surviving lineage; ids a committed checkpoint records but that
# were not acked before a crash are skipped by id. Prompts get deterministic ids ("s<seq>") from a resumable
# data.PromptStream whose cursor is in the checkpoint, so a restarted trainer re-issues the same ids and the server
# drops duplicates; a stale rollout's prompt is re-issued as "<id>r". Online curation skips prompts whose recent
# pass rate left --pass_band (at most one pass over the stream per draw, so an empty band cannot stall). A prompt
# the server quarantined (workers failed it --max_failures times) counts as consumed without training, once.

# Where the server leaves its quarantine notices: prompts the workers kept failing on, and rollouts the verifier
# role could not score (rollout.score_items); either way the prompt is consumed without training.
FAILED = ("prompts.failed", "to_score.failed")


class RolloutLedger:
  """Which rollout ids this trainer lineage consumed, for exactly-once acks; bounded for runs of any length.

  Bounded: a checkpoint records a count plus the ids of its newest `keep` generations (a generation = the ids
  settled between two checkpoints), not every id ever consumed. That suffices: an id comes back from the server
  only while it is unacked, and a generation is acked right after the checkpoint recording it commits, so after
  a crash the only recorded-but-unacked ids are in the newest generations.
  """

  def __init__(self, keep=3):
    self.keep, self.count, self.gens, self._recorded = keep, 0, [], set()  # as in the newest checkpoint
    self.unacked, self.unacked_notices = [], []  # recorded by a checkpoint not yet committed
    self.settled, self.notices = [], []  # trained / skipped / quarantined in steps done since that checkpoint
    self.batch = []     # leased for the step being collected
    self.reissued = 0   # prompts re-issued (stale) for the step being collected

  def __len__(self):  # every prompt this lineage consumed or holds (leased and not handed back)
    return self.count + len(self.settled) + len(self.notices) + len(self.batch)

  def _held(self, rid):
    return rid in self._recorded or rid in self.batch or rid in self.settled or rid in self.notices

  def lease(self, rid):
    """'acked_dup': in a committed checkpoint but not acked before a crash (ack it again); 'dup': leased twice
    in this incarnation (a lease expired) or in a checkpoint still being committed; 'new': now part of the step
    being collected."""
    if rid in self._recorded and rid not in self.unacked:
      return "acked_dup"
    if self._held(rid):
      return "dup"
    self.batch.append(rid)
    return "new"

  def settle_notice(self, rid, client):
    """A quarantine notice for prompt rid: consumed without training, acked after the next checkpoint commits.
    False if rid is already held (its rollout arrived first, or the notice came back after a crash): then the
    notice is only acked, at once."""
    if rid in self.unacked_notices or rid in self.notices:
      return False
    if self._held(rid):
      for q in FAILED:
        client.ack(q, [rid])
      return False
    self.notices.append(rid)
    return True

  def step_done(self):
    self.settled += self.batch
    self.batch, self.reissued = [], 0

  def release(self, client):
    """A stop mid-collection: the partial batch goes back to the server untrained. Returns the prompts this
    batch had re-issued (the caller un-counts them: the re-issue repeats, deduplicated by id)."""
    if self.batch:
      client.requeue("rollouts", self.batch)
    n, self.batch, self.reissued = self.reissued, [], 0
    return n

  def state_dict(self):
    """What the next checkpoint records: everything settled so far."""
    assert not self.batch, "a checkpoint inside a collection would record untrained rollouts"
    return dict(count=self.count + len(self.settled) + len(self.notices),
                gens=(self.gens + [self.settled + self.notices])[-self.keep:])

  def saved(self):
    """The checkpoint holding state_dict() is being written: its ids wait for the commit to be acked."""
    self.load_state_dict(self.state_dict())
    self.unacked += self.settled
    self.unacked_notices += self.notices
    self.settled, self.notices = [], []

  def committed(self, client):
    """That checkpoint is on disk: ack, and its ids are consumed."""
    if self.unacked:
      client.ack("rollouts", self.unacked)
    for q in FAILED if self.unacked_notices else ():
      client.ack(q, self.unacked_notices)
    self.unacked, self.unacked_notices = [], []

  def resumed(self, client):
    """At a restart: what the restored checkpoint records may not have been acked before the crash (acks follow
    the next commit); ack it now, so no consumed rollout waits on the server to be delivered and skipped."""
    if self._recorded:
      client.ack("rollouts", sorted(self._recorded))

  def load_state_dict(self, d):
    if not isinstance(d, dict) or not isinstance(d.get("count"), int) or not isinstance(d.get("gens"), list):
      raise ValueError(f"RolloutLedger.load_state_dict: expected {{count: int, gens: [[ids]]}}, got {str(d)[:80]}")
    self.count, self.gens = d["count"], [list(g) for g in d["gens"]]
    self._recorded = {r for g in self.gens for r in g}


def in_band(tracker, pid, band, min_samples):
  """Online curation: is prompt pid still worth issuing? Unknown or barely sampled prompts are; otherwise its
  recent (EMA) pass rate must lie strictly inside the band (the paper drops always- and never-solved prompts)."""
  st = tracker.stats.get(pid)
  if band is None or st is None or st[0] < min_samples:
    return True
  return band[0] < tracker.ema_rate(pid) < band[1]


@dataclasses.dataclass
class Collected:
  """One step's collection: the groups to train on and what was consumed without training (for metrics)."""
  groups: list = dataclasses.field(default_factory=list)  # data.Rollout
  skipped: list = dataclasses.field(default_factory=list)  # ids: stale (re-issued), zero-variance, malformed
  stale: int = 0
  zero_var: int = 0
  duplicates: int = 0
  malformed: int = 0
  # Generation thrown away, in completion tokens: groups dropped here as stale or zero-variance, and groups a worker
  # regenerated as too stale before sending (the count rides on its next rollout).
  dropped_tokens: dict = dataclasses.field(default_factory=lambda: dict(stale=0, zero_var=0, worker_stale=0))


class Collector:
  """Process 0's side of the "prompts" / "rollouts" queues (section comment above). `encode(problem)` -> prompt ids;
  `band`: (low, high) pass-rate band of online curation, or None; `lease_s` / `wait_s`: the rollout lease and
  the long-poll wait of each get, in seconds."""

  def __init__(self, client, stream, tracker, encode, *, group_size, prefetch_steps, lease_s, wait_s,
               max_staleness, dynamic_sampling, band):
    self.client, self.stream, self.tracker, self.encode = client, stream, tracker, encode
    self.group_size, self.prefetch_steps, self.lease_s, self.wait_s = group_size, prefetch_steps, lease_s, wait_s
    self.max_staleness, self.dynamic_sampling, self.band = max_staleness, dynamic_sampling, band
    self.ledger = RolloutLedger()
    self.seq = self.issued = self.band_skipped = 0  # prompts given ids / issued / skipped as out of band
    self.quarantined = []  # dict(id, reason, failures) per prompt the server quarantined
    self._rated = []  # (prompt id, rewards) of the step being collected: into the tracker once it is trained
    self.evals, self.eval_records = {}, []  # held-out rounds in flight (by id tag); finished rounds' records
    self.outcomes = collections.deque(maxlen=256)  # recent groups taken: kept (True) or dropped as zero-variance
    self.forks = []  # this lineage's restarts, for common.policy_lag

  # -- checkpointed state
  def state_dict(self):
    return dict(seq=self.seq, issued=self.issued, band_skipped=self.band_skipped, quarantined=self.quarantined,
                stream=self.stream.state_dict(), pass_rates=self.tracker.state_dict(),
                consumed=self.ledger.state_dict(), forks=self.forks)

  def load_state_dict(self, st):
    self.seq, self.issued = st["seq"], st["issued"]
    self.band_skipped, self.quarantined = st.get("band_skipped", 0), st.get("quarantined", [])
    self.forks = st.get("forks", [])
    self.stream.load_state_dict(st["stream"])
    self.tracker.load_state_dict(st["pass_rates"])
    self.ledger.load_state_dict(st["consumed"])

  # -- the loop's calls
  def collect(self, n, version, stop):
    """Leases rollouts until n groups to train on, or until stop.requested (then the caller hands back)."""
    got, idle = Collected(), True
    while len(got.groups) < n and not stop.requested:
      if idle:  # (a request: only when the queue gave nothing, or at the start)
        self.note_quarantined()
      self.issue(self.ahead(n))
      # As many as the keep rate says the missing groups take (dynamic sampling drops most of them late in
      # training: one group per request made the trainer wait on round trips); the ones this step does not need
      # go back to the head of the queue for the next.
      items = self.client.get("rollouts", max_items=math.ceil((n - len(got.groups)) / self.keep_rate()),
                              wait_s=self.wait_s, lease_s=self.lease_s)
      idle = not items
      for i, it in enumerate(items):
        if len(got.groups) == n:
          self.client.requeue("rollouts", [x["id"] for x in items[i:]])
          break
        self._take(it, version, got)
    return got

  def hand_back(self):
    n = len(self.ledger.batch)
    self.issued -= self.ledger.release(self.client)
    self._rated = []  # not trained: must not count in the pass rates
    logging.info("stop requested mid-collection: %d leased rollouts handed back untrained", n)

  def step_done(self):
    self.ledger.step_done()
    for pid, r in self._rated:  # not before: a partial batch handed back on SIGTERM must not count twice
      self.tracker.update(pid, r)
    self._rated = []

  def saved(self):
    self.ledger.saved()

  def committed(self):
    self.ledger.committed(self.client)  # only now are these rollouts durably consumed

  # -- the parts
  def _take(self, it, version, got):
    """One leased rollout: a duplicate, stale, malformed, zero-variance, or one to train on."""
    rid = it["id"]
    if rid[0] in "ce":  # held-out eval, or an earlier incarnation's curation: never training data
      self.client.ack("rollouts", [rid])
      if rid[0] == "e":
        self._eval_rollout(it)
      return
    seen = self.ledger.lease(rid)
    if seen != "new":
      if seen == "acked_dup":  # recorded by a checkpoint but not acked before a crash
        self.client.ack("rollouts", [rid])
      got.duplicates += 1
      return
    try:
      r = data.Rollout.from_wire(it)
    except ValueError as e:  # consumed without training; its prompt goes out again if it can be read
      logging.error("%s; skipped", e)
      got.malformed += 1
      got.skipped.append(rid)
      try:
        self._reissue(rid, data.PromptItem.from_wire(dict(it, group_size=self.group_size)))
      except ValueError:
        logging.error("rollout %r: its prompt fields are unreadable too; the prompt is not re-issued", rid)
      return
    got.dropped_tokens["worker_stale"] += int(r.stats.get("stale_regen_tokens", 0))
    if common.policy_lag(version, r.version, self.forks) > self.max_staleness:
      got.stale += 1  # too old to train on: re-issue the prompt under a fresh id
      got.dropped_tokens["stale"] += r.n_tokens
      got.skipped.append(rid)
      self._reissue(rid, r.prompt_item(rid, self.group_size))
      return
    self._rated.append((r.problem.id, r.rewards))  # counted once the step is done
    keep = not self.dynamic_sampling or data.group_has_signal(r.rewards)
    self.outcomes.append(keep)
    if not keep:
      got.zero_var += 1
      got.dropped_tokens["zero_var"] += r.n_tokens
      got.skipped.append(rid)
      return
    got.groups.append(r)

  def _reissue(self, rid, item):
    self.client.put("prompts", [dataclasses.replace(item, id=rid + "r").to_wire()])
    self.issued += 1
    self.ledger.reissued += 1

  def keep_rate(self):
    """The fraction of recent groups dynamic sampling kept (1 without it), at least 0.1: issuing is bounded."""
    return max(sum(self.outcomes) / len(self.outcomes), 0.1) if self.outcomes else 1.0

  def ahead(self, n):
    """Pacing: prompts to keep issued and not consumed, n kept groups per step. Enough for --prefetch_steps steps
    at the measured keep rate (so dropped groups do not starve the workers), but no more steps than
    --max_staleness allows (at least the current one): a prompt consumed later would be trained stale, or thrown
    away, so the fleet never generates what the staleness bound would discard."""
    return math.ceil(max(1, min(self.prefetch_steps, self.max_staleness)) * n / self.keep_rate())

  def issue(self, target):
    """Keeps `target` prompts issued and not yet consumed."""
    items = []
    while self.issued - len(self.ledger) < target:
      items.append(self.prompt_item(f"s{self.seq}", self.next_in_band()).to_wire())
      self.seq += 1
      self.issued += 1
    if items:
      self.client.put("prompts", items)

  def prompt_item(self, pid, problem):
    return data.PromptItem(pid, problem, np.asarray(self.encode(problem), np.int32), self.group_size)

  def next_in_band(self):
    # At most one pass over the stream is skipped, so a band that nothing is inside cannot stall the run.
    for _ in range(len(self.stream.problems)):
      p = self.stream.next()
      if in_band(self.tracker, p.id, self.band, self.group_size):
        return p
      self.band_skipped += 1
    return p

  # -- held-out eval during training (--eval_every): the same queues, never trained on, not checkpointed (a round
  # in flight at a restart is dropped: the restarted trainer acks its rollouts and ignores them)
  def issue_eval(self, step, problems, k):
    """k samples of each problem, as items of at most group_size samples (what every worker's slots take; the
    item ids seed distinct samples). Ids e<step>-<random>-<problem>.<chunk>: this incarnation's own, as curation's."""
    tag, G = f"e{step}-{os.urandom(4).hex()}", self.group_size
    items = [dataclasses.replace(self.prompt_item(f"{tag}-{i}.{j}", p), group_size=min(G, k - j * G)).to_wire()
             for i, p in enumerate(problems) for j in range(-(-k // G))]
    for s in range(0, len(items), 256):  # bounded frames
      self.client.put("prompts", items[s:s + 256])
    self.evals[tag] = dict(step=step, pending={it["id"] for it in items}, rewards={}, versions=[], t=time.time(), k=k)

  def _eval_rollout(self, it):
    ev = self.evals.get(it["id"].rsplit("-", 1)[0])
    if ev is None or it["id"] not in ev["pending"]:
      return  # an earlier incarnation's round, or a duplicate
    ev["pending"].discard(it["id"])
    try:
      r = data.Rollout.from_wire(it)
      ev["rewards"].setdefault(it["id"].rsplit(".", 1)[0], []).extend(r.rewards)
      ev["versions"].append(r.version)
    except ValueError as e:  # one bad item must not hold the round: its problem is left out (eval_problems)
      logging.error("%s; held-out rollout left out of its round", e)
    self._eval_round_done(ev)

  def _eval_round_done(self, ev):
    full = [np.asarray(r) > 0.5 for r in ev["rewards"].values() if len(r) == ev["k"]]
    if not ev["pending"] and full:
      self.evals = {t: e for t, e in self.evals.items() if e is not ev}
      self.eval_records.append(dict(
          step=ev["step"], time=time.time(), eval_problems=len(full), eval_s=time.time() - ev["t"],
          eval_version_min=min(ev["versions"]), eval_version_max=max(ev["versions"]),
          **{f"eval_{k}": v for k, v in data.pass_at_k_summary(full).items()}))

  def pop_eval_records(self):
    out, self.eval_records = self.eval_records, []
    return out

  def note_quarantined(self):
    """Prompts the server quarantined (notices in the queues FAILED) count as consumed without
    training, so issue() sends a replacement; each is recorded once in the checkpointed state and its notice
    acked once that checkpoint commits."""
    for it in [it for q in FAILED for it in self.client.get(q, max_items=1000, lease_s=self.lease_s)]:
      if it["id"].startswith("e"):  # a held-out prompt the workers kept failing on: out of its round
        self.client.ack(it["queue"] + ".failed", [it["id"]])
        if (ev := self.evals.get(it["id"].rsplit("-", 1)[0])) is not None:
          ev["pending"].discard(it["id"])
          self._eval_round_done(ev)
        continue
      if self.ledger.settle_notice(it["id"], self.client):
        self.quarantined.append(dict(id=it["id"], reason=it["reason"], failures=it["failures"]))
        logging.warning("prompt %s quarantined by the server after %d failures: %s", it["id"], it["failures"],
                        it["reason"][:300])

  def curate(self, n, stop):
    """Offline curation through the workers at the base weights: group_size samples of each of the next n
    prompts of the stream (ids c<incarnation>.<i>, scored, never trained on); their pass rates go into the tracker, which
    decides what is issued (in_band). The stream itself stays the whole training set: RL on a small kept subset
    memorises it (measured: a 754-prompt subset, each drawn ~25 times, raised the training reward 0.19 -> 0.47
    and held-out pass@8 fell 36.6% -> 18.8%). Returns (the rated candidates, {problem id: pass rate}); a malformed
    rollout is logged and its prompt left unrated."""
    from tqdm import tqdm
    cand = self.stream.peek(min(n, len(self.stream.problems)))
    # Ids of this incarnation's own: a trainer killed or SIGTERMed mid-curation rates again from scratch, and the
    # server, which remembers acked ids and drops their re-puts, must not see the old ids again (it would answer
    # nothing and the new incarnation would wait forever).
    tag = f"c{os.urandom(4).hex()}."
    for s in range(0, len(cand), 256):  # bounded frames
      self.client.put("prompts", [self.prompt_item(f"{tag}{i}", p).to_wire() for i, p in enumerate(cand[s:s + 256], s)])
    seen = set()
    bar = tqdm(total=len(cand), desc="curation: base pass rates", dynamic_ncols=True, mininterval=1.0)
    while len(seen) < len(cand):
      if stop.requested:  # nothing trained yet: the restarted trainer curates again
        raise SystemExit("stopped during curation")
      for it in self.client.get("rollouts", max_items=64, wait_s=self.wait_s, lease_s=self.lease_s):
        if it["id"].startswith(tag) and it["id"] not in seen:
          seen.add(it["id"])
          bar.update(1)
          try:
            r = data.Rollout.from_wire(it)
            self.tracker.update(r.problem.id, r.rewards)
          except ValueError as e:  # its prompt stays unrated, which in_band treats as worth issuing
            logging.error("%s; curation rollout skipped", e)
        self.client.ack("rollouts", [it["id"]])
    bar.close()
    rates = {p.id: r for p in cand if (r := self.tracker.rate(p.id)) is not None}  # not malformed rollouts' prompts
    return [p for p in cand if p.id in rates], rates


# --- SFT warm-start (the demo's base policy) -------------------------------------------------------------------------

def run_sft():
  mesh = setup_mesh()
  tok = data.load_tokenizer(FLAGS.tokenizer)
  shape = {k: int(v) for k, v in (kv.split("=") for kv in FLAGS.model_config.split(","))}
  cfg = model.Config.from_hf_dict(dict(
      model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=tok.vocab_size,
      hidden_size=shape["d_model"], num_hidden_layers=shape["n_layers"], num_attention_heads=shape["n_heads"],
      num_key_value_heads=shape["n_kv_heads"], intermediate_size=shape["ffw_dim"], max_position_embeddings=512,
      rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=tok.bos_id,
      eos_token_id=tok.eos_id, hidden_act="silu", torch_dtype="float32"))
  jax.set_mesh(mesh)
  params = model.shard_params(model.init_params(cfg, jax.random.PRNGKey(FLAGS.seed)), cfg, mesh)
  opt = make_optimizer(FLAGS.sft_lr, FLAGS.warmup_steps, FLAGS.sft_steps, FLAGS.weight_decay, FLAGS.grad_clip)
  opt_state = opt.init(params)
  encode, problems, _, buckets = training_prompts(cfg, tok, "sft_flags.json")
  stream = data.PromptStream(problems, seed=FLAGS.seed)
  teacher_rng = random.Random(f"sft-teacher|{FLAGS.seed}")
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

  metrics = Metrics(os.path.join(FLAGS.run_dir, "sft_metrics.jsonl"),
                    FLAGS.tensorboard and os.path.join(FLAGS.run_dir, "tensorboard", "sft"))
  t0 = time.time()
  recent = []  # device scalars; read back every 10 steps (one host sync per 10, not per step)
  for i in range(FLAGS.sft_steps):
    probs = stream.take(FLAGS.sft_batch)
    b = data.make_batch([encode(p) for p in probs],
                        [tok.encode(teacher_completion(p, FLAGS.sft_slip, teacher_rng, FLAGS.sft_slip_if)) + [tok.eos_id]
                         for p in probs], buckets, tok.pad_id)
    b = {k: b[k].astype(np.float32 if k == "loss_mask" else np.int32) for k in ("tokens", "targets", "positions",
                                                                               "segment_ids", "loss_mask")}
    params, opt_state, loss = step(params, opt_state, to_global(b, bsh))
    recent = (recent + [loss])[-50:]
    if FLAGS.sft_target_loss and len(recent) == 50 and i % 10 == 0:
      mean = float(np.mean([float(x) for x in recent]))
      if mean <= FLAGS.sft_target_loss:
        metrics.write(dict(step=i, sft_loss_mean50=mean, stopped_at_target=FLAGS.sft_target_loss,
                           seconds=time.time() - t0))
        logging.info("sft step %d: mean loss of the last 50 steps %.4f <= target %.4f: done (%.0fs)", i, mean,
                     FLAGS.sft_target_loss, time.time() - t0)
        break
    if i % 20 == 0 or i == FLAGS.sft_steps - 1:
      loss = float(loss)
      metrics.write(dict(step=i, sft_loss=loss, seconds=time.time() - t0))
      logging.info("sft step %d loss %.4f (%.0fs)", i, loss, time.time() - t0)
  out = FLAGS.sft_out or os.path.join(FLAGS.run_dir, "base")
  export_hf(out, cfg, params)  # collective: every process takes part
  logging.info("sft done: %s", out)


def teacher_completion(problem, slip: float, rng, where="always") -> str:
  """The SFT target: the reference completion, except that with probability `slip` (one draw of `rng`) the last
  digit is written one too high (9 -> 0), on every problem or (where="carry") only on a sum whose units digits
  carry. The rest of the answer stays right, so the student must still learn the task to imitate the slip; the
  slip is a habit RL can remove, not a skill it has to discover."""
  text = data.reference_completion(problem)
  last = max((i for i, c in enumerate(text) if c.isdigit()), default=None)
  if where == "carry" and not arithmetic.units_carry(problem.prompt):
    return text
  if slip and rng.random() < slip and last is not None:
    text = text[:last] + str((int(text[last]) + 1) % 10) + text[last + 1:]
  return text


# --- main ------------------------------------------------------------------------------------------------------------

def main(argv):
  del argv
  common.tune_malloc()  # before the first JAX computation: XLA's step buffers reused, not page-faulted in every step
  if FLAGS.tokenizer is None:
    raise app.UsageError("--tokenizer is required")
  os.makedirs(FLAGS.run_dir, exist_ok=True)
  try:
    run_sft() if FLAGS.mode == "sft" else run_rl()
  except param_server.FencedError as e:  # not a crash to retry: another trainer owns the run now
    logging.error("another trainer registered on this run's server; this one stops: %s", e)
    sys.exit(3)


if __name__ == "__main__":
  define_flags()
  app.run(main)
