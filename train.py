"""train.py: the master trainer. Consumes rollouts, computes the RL loss, updates with optax, pushes weights.

Design:
  * Process 0 is the only one that talks to the parameter server: it issues prompts (queue "prompts"), leases
    scored rollout groups (queue "rollouts"), and broadcasts each batch to the other JAX processes, which all
    run the same jitted step over one global (data, fsdp, tensor) mesh (`jax.distributed`, gloo on CPU: the
    same code path as a multi-host TPU slice).
  * The loop (run_rl) reads as named steps: collect -> batch -> step -> publish -> checkpoint -> log.
  * Exactly once (ledger.py): a rollout is acked only after a checkpoint that records it commits; SIGTERM
    mid-collection hands the partial batch back; a restarted trainer skips the ids its checkpoint holds.
  * Precision (learner.py): fp32 master weights; --param_dtype=bfloat16 casts them for the forward and the workers.
  * Weights are published without gathering (shards.publish): each process stages its own shards on its shard
    server (--shard_servers), process 0 commits the manifest last; workers reshard on pull.
  * Checkpoints (params, optimizer state, step, data cursor, seed, consumed ids, pass-rate table, version):
    learner.Checkpointer (orbax, sharded, asynchronous, restores onto another mesh / process count), every
    --checkpoint_every steps and on SIGTERM. The final HF export gathers one tensor at a time.
  * The step, batches, checkpoints and export are a library (learner.py) that tests and benches import; this
    file is the script: flags, the SFT warm-start, the RL loop.
  * --mode=sft is the supervised warm-start that builds the demo's base policy (an HF checkpoint dir); with
    --sft_slip=p it imitates a flawed teacher (learner.teacher_completion) so the base lands at a known pass rate.

Run:
  CPU, one process:  python train.py --run_dir=runs/x --init_checkpoint=runs/x/base --tokenizer=runs/x/tokenizer.model
  CPU, 2 processes:  add --num_processes=2 --process_id={0,1} --coordinator=127.0.0.1:12355 (launch.sh does this)
  TPU pod:           bash launch.sh v5p-1024  (one trainer process per trainer host; see --dry_run)
"""
import functools
import json
import math
import os
import random
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags, logging
from jax.sharding import NamedSharding, PartitionSpec as P

import data
import fileio
import flags_common
import hostmem
import kernels
import learner
import ledger
import losses
import model
import shards

FLAGS = flags.FLAGS

def define_flags():
  """Called only by main(): importing this file defines no flag (see flags_common)."""
  flags_common.define_shared_flags(max_new_tokens=8)
  flags.adopt_module_key_flags(flags_common)
  flags.DEFINE_enum("mode", "rl", ["rl", "sft"], "rl: RL from rollouts; sft: supervised warm-start. Default rl.")
  flags.DEFINE_string("run_dir", "runs/local", "Directory for checkpoints, metrics and the final model. Default runs/local.")
  flags.DEFINE_string("shard_servers", "", "Comma-separated host:port of the shard servers; trainer process i "
                      "stages its shards on entry i % S, the manifest goes to --server; self:PORT = the server on each "
                      "process's own host (a pod). Default empty: --server alone (S=1).")
  flags.DEFINE_string("init_checkpoint", None, "HF checkpoint dir of the initial policy (rl mode). Required for rl.")
  # Data.
  flags.DEFINE_string("task", "arithmetic", "Built-in task when --train_jsonl is not given. Default arithmetic.")
  flags.DEFINE_integer("difficulty", 3, "Built-in task difficulty. Default 3.")
  flags.DEFINE_string("ops", None, "Operators of the built-in task, e.g. + or +-* (data.make_task_problems). Default "
                      "none: the task's own (arithmetic +-, countdown +-*).")
  flags.DEFINE_string("train_jsonl", None, "jsonl prompt file (id, prompt, answer[, task, tests]). Default none.")
  flags.DEFINE_integer("train_size", 8000, "Number of built-in training problems generated. Default 8000.")
  flags.DEFINE_string("jsonl_shape", "auto", "Record shape of --train_jsonl (data.load_jsonl): auto, prompt, "
                      "messages, gsm8k, math. Default auto (detected per line).")
  flags.DEFINE_integer("max_seq_len", 0, "Longest prompt + completion in tokens; a prompt that cannot fit with "
                       "--max_new_tokens is skipped at load (logged with file:line). 0 = the checkpoint's "
                       "max_position_embeddings. Default 0.")
  # RL.
  flags.DEFINE_string("algo", "grpo", "Loss preset from losses.ALGORITHMS (grpo, dr_grpo, dapo, gspo, cispo, ppo, rloo, "
                      "reinforce_pp). Default grpo.")
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
  flags.DEFINE_integer("grad_accum", 1, "Micro-batches per optimizer step. Default 1.")
  flags.DEFINE_enum("param_dtype", "float32", ["float32", "bfloat16"], "Compute/worker weight dtype (master stays fp32). "
                    "Default float32.")
  flags.DEFINE_integer("push_every", 1, "Push weights every N steps. Default 1.")
  flags.DEFINE_integer("checkpoint_every", 10, "Checkpoint (and ack) every N steps. Default 10.")
  flags.DEFINE_integer("export_every", 0, "Also export the policy as an HF checkpoint to <run_dir>/exports/"
                       "step_NNNNNN every N steps (held-out pass@k versus step: bench_curation.py). 0 = off (a 32B "
                       "export is a full gather per export). Default 0.")
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
      ("grad_accum", at_least(1), ">= 1"), ("push_every", at_least(1), ">= 1"),
      ("checkpoint_every", at_least(1), ">= 1"), ("keep_checkpoints", at_least(1), ">= 1"),
      ("warmup_steps", at_least(0), ">= 0"), ("sft_steps", at_least(1), ">= 1"), ("sft_batch", at_least(1), ">= 1"),
      ("train_size", at_least(1), ">= 1"), ("difficulty", at_least(1), ">= 1"),
      ("temperature", positive, "finite and > 0"), ("lr", positive, "finite and > 0"),
      ("sft_lr", positive, "finite and > 0"), ("get_wait_s", positive, "finite and > 0"),
      ("rollout_lease_s", positive, "finite and > 0"), ("grad_clip", positive, "finite and > 0"),
      ("weight_decay", nonneg, "finite and >= 0"), ("sft_target_loss", nonneg, "finite and >= 0 (0 = off)"),
      ("sft_slip", lambda v: 0 <= v < 1, "in [0, 1)"), ("value_coef", nonneg, "finite and >= 0"),
      ("value_clip", nonneg, "finite and >= 0 (0 = off)"), ("export_every", at_least(0), ">= 0 (0 = off)"),
      ("curate_prompts", at_least(0), ">= 0 (0 = off)")):
    flags.register_validator(name, ok, message=f"--{name} must be {rule}")
  flags.register_validator("pass_band", lambda v: learner.parse_band(v) is not None or not v,
                           message="--pass_band must be 'low,high' with 0 <= low < high <= 1, or empty (off)")
  flags.register_multi_flags_validator(
      ["curate_prompts", "pass_band"], lambda f: not f["curate_prompts"] or f["pass_band"],
      message="--curate_prompts needs a --pass_band (e.g. 0,1: drop never- and always-solved prompts)")
  flags.register_multi_flags_validator(
      ["group_size", "dynamic_sampling"], lambda f: f["group_size"] >= 2 or not f["dynamic_sampling"],
      message="--dynamic_sampling needs --group_size >= 2 (a group of 1 always has zero variance: every group "
              "would be dropped and the trainer would wait forever)")


def training_prompts(cfg, tok, flags_file):
  """(encode, the training prompts that fit, the longest kept prompt's length, batch buckets); saves the run's
  flags once (process 0; a resumed run keeps the first record). encode: problem -> prompt token ids with --template
  applied. A prompt that cannot fit in --max_seq_len (capped by the checkpoint's positions) is refused here (logged
  with file:line), never handed to a worker."""
  chat = data.load_chat_template(FLAGS.tokenizer) if FLAGS.template == "hf" else None
  encode = lambda p: tok.encode(data.render_prompt(p, FLAGS.template, chat_template=chat), add_bos=True)  # noqa: E731
  problems = (data.load_jsonl(FLAGS.train_jsonl, FLAGS.jsonl_shape) if FLAGS.train_jsonl else
              data.make_task_problems(FLAGS.task, FLAGS.train_size, FLAGS.difficulty, seed=FLAGS.seed, split="train",
                                      ops=FLAGS.ops))
  budget = min(FLAGS.max_seq_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
  problems, skipped, max_prompt = data.fit_prompts(problems, encode, FLAGS.max_new_tokens, budget)
  if not problems:
    raise app.UsageError(f"no training prompt fits: all {len(skipped)} exceed max_seq_len {budget} - "
                         f"max_new_tokens {FLAGS.max_new_tokens}")
  path = os.path.join(FLAGS.run_dir, flags_file)
  if jax.process_index() == 0 and not os.path.exists(path):
    vals = {f.name: f.value for f in FLAGS.get_key_flags_for_module(sys.modules[__name__])}
    fileio.write_atomic(path, json.dumps(vals, indent=1, sort_keys=True, default=str))
  return encode, problems, max_prompt, learner.buckets_for(max_prompt + FLAGS.max_new_tokens)


def setup_mesh():
  if FLAGS.num_processes == 0:  # TPU pod: the slice tells each host its process id and the coordinator
    jax.distributed.initialize()
  elif FLAGS.num_processes > 1:
    # Cross-process collectives on CPU go through gloo (ignored on TPU). Asking for the backend here would
    # initialise it before jax.distributed, which must come first.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=FLAGS.coordinator, num_processes=FLAGS.num_processes,
                               process_id=FLAGS.process_id)
  return model.make_mesh(*learner.parse_mesh(FLAGS.mesh, jax.device_count()), devices=jax.devices())


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
  opt = learner.make_optimizer(FLAGS.sft_lr, FLAGS.warmup_steps, FLAGS.sft_steps, FLAGS.weight_decay, FLAGS.grad_clip)
  opt_state = opt.init(params)
  _, problems, _, buckets = training_prompts(cfg, tok, "sft_flags.json")
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

  metrics = learner.Metrics(os.path.join(FLAGS.run_dir, "sft_metrics.jsonl"))
  t0 = time.time()
  recent = []  # device scalars; read back every 10 steps (one host sync per 10, not per step)
  for i in range(FLAGS.sft_steps):
    probs = stream.take(FLAGS.sft_batch)
    b = data.make_batch([tok.encode(data.render_prompt(p, FLAGS.template), add_bos=True) for p in probs],
                        [tok.encode(learner.teacher_completion(p, FLAGS.sft_slip, teacher_rng)) + [tok.eos_id]
                         for p in probs], buckets, tok.pad_id)
    b = {k: b[k].astype(np.float32 if k == "loss_mask" else np.int32) for k in ("tokens", "targets", "positions",
                                                                               "segment_ids", "loss_mask")}
    params, opt_state, loss = step(params, opt_state, learner.to_global(b, bsh))
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
  learner.export_hf(out, cfg, params)  # collective: every process takes part
  logging.info("sft done: %s", out)


def init_learner(mesh, cfg, init):
  """(loss config, params = {policy, value}, optimizer state, frozen reference policy or None, jitted step)."""
  lcfg = learner.loss_config(losses.ALGORITHMS[FLAGS.algo], FLAGS.loss_override, FLAGS.max_new_tokens)
  compute_dtype = jnp.dtype(FLAGS.param_dtype)
  optimizer = learner.make_optimizer(FLAGS.lr, FLAGS.warmup_steps, FLAGS.steps, FLAGS.weight_decay, FLAGS.grad_clip)
  policy = model.shard_params(jax.tree.map(jnp.asarray, init), cfg, mesh)  # fp32 master weights
  # PPO's value head (only when the advantage estimator is GAE): a linear map of the final hidden state.
  params = dict(policy=policy, value=dict(w=jnp.zeros((cfg.d_model,), jnp.float32), b=jnp.zeros((), jnp.float32))
                if lcfg.advantage == "gae" else None)
  # optax may hand out one buffer for several state leaves (e.g. step counts); copies make donation safe.
  opt_state = jax.tree.map(jnp.copy, optimizer.init(params))
  # The frozen reference policy for the KL term (in the loss or in the reward); a real copy, since astype to the
  # same dtype would alias the donated params buffers.
  ref_params = (jax.tree.map(lambda x: jnp.array(x, compute_dtype, copy=True), policy)
                if lcfg.kl_coef > 0 else None)
  common = dict(cfg=cfg, temperature=FLAGS.temperature, compute_dtype=compute_dtype, attn_impl=FLAGS.attn_impl,
                logprob_chunk=FLAGS.logprob_chunk)
  loss_fn = functools.partial(learner.rl_loss, lcfg=lcfg, value_coef=FLAGS.value_coef, gae_gamma=FLAGS.gae_gamma,
                              gae_lambda=FLAGS.gae_lambda, value_clip=FLAGS.value_clip, remat=FLAGS.remat, **common)
  step = learner.make_train_step(optimizer, loss_fn, FLAGS.grad_accum, epochs=FLAGS.ppo_epochs,
                                 minibatches=FLAGS.minibatches, prox_fn=functools.partial(learner.proximal, **common))
  # Pin the outputs to the inputs' shardings: XLA would otherwise leave updated params/moments replicated.
  shardings = jax.tree.map(lambda x: x.sharding, (params, opt_state))
  train_step = jax.jit(step, donate_argnums=(0, 1), out_shardings=(*shardings, None))
  return lcfg, params, opt_state, ref_params, train_step


def connect_servers():
  """A client per parameter server: entry 0 (--server) holds the queues and the manifest; every trainer process
  stages its weight shards on entry process_index % S (shards.publish)."""
  token = open(FLAGS.token_file).read().strip() if FLAGS.token_file else None
  if FLAGS.shard_servers.startswith("self:"):  # a pod: one server per trainer host, on this port
    addrs = shards.own_server_addresses(FLAGS.server, int(FLAGS.shard_servers[5:]))
  else:
    addrs = [FLAGS.server] + [a for a in FLAGS.shard_servers.split(",") if a and a != FLAGS.server]
  return [shards.connect(a, token, FLAGS.server_retries) for a in addrs]


def publish(servers, version, policy, meta):
  """Every process stages its own shards (no gather); process 0 commits the manifest, a version newer than
  both ours and the server's (shards.publish). Returns the version published."""
  want = max(version, servers[0].latest_version()) + 1 if jax.process_index() == 0 else 0
  dtype = jnp.dtype(FLAGS.param_dtype)
  return shards.publish(servers, want, jax.tree.map(lambda x: x.astype(dtype), policy), meta)[0]


def weights_lost(servers, version):
  """A restarted server may have lost our newest version (it persists weights in the background)."""
  return learner.lead_says(jax.process_index() == 0 and (servers[0].latest_version() < version or any(
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


# What a rollout's worker reports with it (shards.pull figures, its load over the last 30 s); logged as the mean
# over a step's groups. With the trainer's own wait fraction they say which side to grow (plot.py's balance line,
# docs/GUIDE.md "Sizing").
WORKER_STATS = ("pull_bytes", "pull_s", "delta_frac", "worker_busy_frac", "worker_tok_s", "worker_wait_prompts_frac",
                "worker_wait_send_frac")


def step_record(state, got, collector, trained_version, rewards, lengths, batch, m, times, lr):
  """The step's line in metrics.jsonl (lr: the learning rate this step used)."""
  groups = got.groups
  lag = trained_version - np.asarray([g.version for g in groups])
  rec = dict(step=state["step"], time=time.time(),
             lr=lr,
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
  # Tokens a preempted worker generated and handed back (partial rollouts) that another worker continued.
  rec.update(resumed_tokens=int(sum(g.stats.get("resumed_tokens", 0) for g in groups)),
             workers=len({g.worker for g in groups}),
             trainer_wait_frac=times["wait_s"] / max(sum(times.values()), 1e-9))
  return rec


def run_rl():
  """collect -> batch -> step -> publish -> checkpoint -> log, until --steps or a SIGTERM (a TPU preemption:
  the partial batch goes back to the server, the checkpoint is written, a rerun resumes)."""
  import param_server
  from tqdm import tqdm
  stop = param_server.StopFlag()
  mesh = setup_mesh()
  jax.set_mesh(mesh)  # activations are constrained by model.py's logical-axis table over this mesh
  lead = jax.process_index() == 0
  if FLAGS.init_checkpoint is None:
    raise app.UsageError("--mode=rl needs --init_checkpoint (an HF checkpoint dir)")
  tok = data.load_tokenizer(FLAGS.tokenizer)
  cfg, init = model.load_hf_checkpoint(FLAGS.init_checkpoint, dtype=jnp.float32)
  lcfg, params, opt_state, ref_params, train_step = init_learner(mesh, cfg, init)
  encode, problems, max_prompt, buckets = training_prompts(cfg, tok, "flags.json")
  servers = connect_servers()
  collector = ledger.Collector(
      servers[0] if lead else None, data.PromptStream(problems, seed=FLAGS.seed), data.PassRateTracker(), encode,
      group_size=FLAGS.group_size, prefetch_steps=FLAGS.prefetch_steps, lease_s=FLAGS.rollout_lease_s,
      wait_s=FLAGS.get_wait_s, max_staleness=FLAGS.max_staleness, dynamic_sampling=FLAGS.dynamic_sampling,
      band=learner.parse_band(FLAGS.pass_band))
  # The trainer draws no random numbers of its own: data order is the stream's state (in the checkpoint) and
  # sampling keys derive from prompt ids on the workers, so the seed is the whole RNG state.
  state = dict(step=0, version=-1, seed=FLAGS.seed)
  ckpt = learner.Checkpointer(FLAGS.checkpoint_dir or os.path.join(FLAGS.run_dir, "ckpt"), FLAGS.keep_checkpoints)
  got = ckpt.restore(params, opt_state)  # onto this run's mesh, whatever mesh wrote it
  if got:
    params, opt_state, st = got
    collector.load_state_dict(st)
    state = {k: st[k] for k in ("step", "version", "seed", "curated") if k in st}
    logging.info("resumed at step %d", state["step"])
  if lead:
    servers[0].requeue("rollouts")  # leases held by a previous incarnation of this trainer come back now
  # The workers' sampling settings travel with the weights (manifest header fields): one source of truth for
  # what the loss scores. max_prompt_len: the longest kept prompt, so the workers size their KV cache from it.
  meta = dict(config=cfg.to_hf_dict(), sampling=dict(temperature=FLAGS.temperature, top_k=FLAGS.top_k,
                                                     top_p=FLAGS.top_p, max_new_tokens=FLAGS.max_new_tokens,
                                                     max_prompt_len=max_prompt))
  gen = {k: meta["sampling"][k] for k in ("temperature", "top_p", "max_new_tokens")}  # the exports' generation_config
  state["version"] = publish(servers, state["version"], params["policy"], meta)
  metrics = learner.Metrics(os.path.join(FLAGS.run_dir, "metrics.jsonl"))
  lr_at = learner.lr_schedule_fn(FLAGS.lr, FLAGS.warmup_steps, FLAGS.steps)  # the optimizer's schedule, for the log
  if FLAGS.curate_prompts and not state.get("curated"):
    if lead:
      curate(collector, stop, metrics)  # its rates are in the checkpointed tracker
    state["curated"] = True
  bsh = NamedSharding(mesh, P(("data", "fsdp")))
  bar = tqdm(total=FLAGS.steps, initial=state["step"], desc=FLAGS.algo, dynamic_ncols=True, mininterval=1.0,
             miniters=1, disable=not lead)
  push_s = 0.0
  while state["step"] < FLAGS.steps:
    # 1. Collect a batch of rollout groups (process 0), exactly once.
    t0 = time.time()
    got = collector.collect(FLAGS.prompts_per_step, state["version"], stop) if lead else None
    if learner.lead_says(stop.requested):  # the partial batch was never trained: back to the server
      if lead:
        collector.hand_back()
      break
    wait_s = time.time() - t0
    # 2. Batch: pad and pack on process 0, broadcast to the others.
    batch, rewards, lengths = (learner.rl_batch(got.groups, lcfg, tok.pad_id, buckets, FLAGS.max_new_tokens) if lead
                               else (None, None, None))
    batch = learner.broadcast_batch(batch)
    # 3. Step: one jitted update over the global mesh.
    t1 = time.time()
    params, opt_state, m = train_step(params, opt_state, ref_params, learner.to_global(batch, bsh))
    m = {k: float(v) for k, v in m.items()}  # host sync: the step is done
    step_s = time.time() - t1
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
    if FLAGS.export_every and state["step"] % FLAGS.export_every == 0:
      learner.export_hf(os.path.join(FLAGS.run_dir, "exports", f"step_{state['step']:06d}"), cfg,
                        params["policy"], tokenizer_src=FLAGS.tokenizer, sampling=gen)
    # 6. Log.
    if lead:
      rec = step_record(state, got, collector, trained_version, rewards, lengths, batch, m,
                        dict(wait_s=wait_s, step_s=step_s, push_s=push_s), float(lr_at(state["step"] - 1)))
      metrics.write(rec)
      bar.update(1)
      bar.set_postfix(reward=f"{rec['reward']:.3f}", kl=f"{m.get('kl', 0):.4f}", ent=f"{m.get('entropy', 0):.3f}")
  checkpoint(ckpt, collector, state, params, opt_state, final=True)
  ckpt.close()
  if state["step"] >= FLAGS.steps:
    out = os.path.join(FLAGS.run_dir, "final")
    learner.export_hf(out, cfg, params["policy"], tokenizer_src=FLAGS.tokenizer, sampling=gen)
    if lead:
      with open(os.path.join(FLAGS.run_dir, "DONE"), "w") as f:
        f.write(str(state["step"]))
      logging.info("training done at step %d: %s", state["step"], out)
  else:
    logging.info("stopped at step %d (checkpointed); rerun to resume", state["step"])


def main(argv):
  del argv
  hostmem.tune()  # before the first JAX computation: XLA's step buffers reused, not page-faulted in every step
  if FLAGS.exact_logprobs:
    kernels.enable_exact_mode()  # also before the first computation: an XLA flag (kernels.py)
    if not kernels.exact_mode_measured_cpu():
      logging.warning("--exact_logprobs: this CPU has no AVX512-BF16, where exact mode was not measured: log-probs "
                      "may still differ in the last bits (metrics.jsonl's mismatch_max shows it every step)")
  if FLAGS.tokenizer is None:
    raise app.UsageError("--tokenizer is required")
  os.makedirs(FLAGS.run_dir, exist_ok=True)
  run_sft() if FLAGS.mode == "sft" else run_rl()


if __name__ == "__main__":
  define_flags()
  app.run(main)
