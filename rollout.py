"""rollout.py: the inference worker (pull weights, generate, score, send rollouts), the verifier role, pass@k eval.

The worker leases prompts from the parameter server, samples group_size completions of each with continuous
batching (Engine), scores them and puts the rollouts back; newer weights download in the background (Puller) and
are swapped in between decode chunks. Behaviour log-probs are those of the distribution actually sampled from
(logits / temperature, top-k / top-p truncated and renormalised, fp32): with temperature-only sampling (the
default) exactly what the trainer recomputes; with top-k / top-p the trainer's truncated IS corrects for the cut.

Run:
  worker: python rollout.py --server=127.0.0.1:5555 --token_file=runs/x/token --tokenizer=runs/x/tokenizer.model
  verifier: the same with --mode=verifier (run_verifier; launch.sh local --verifiers=V starts V)
  eval:   python rollout.py --mode=eval --checkpoint=runs/x/base --tokenizer=runs/x/tokenizer.model \
              --eval_n=200 --k=8 --out=runs/x/eval_before.json
  On a pod launch.sh starts one worker per inference host (launch.sh v5p-N --dry_run shows the commands).
"""
import dataclasses
import functools
import json
import math
import os
import queue
import threading
import time
import zlib
from collections import deque

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging

import common
import data
import model
import param_server

FLAGS = flags.FLAGS


def define_flags():
  """Called only by main(): importing this file defines no flag (see common)."""
  common.define_shared_flags(max_new_tokens=16, task_args_error=data.task_args_error)
  flags.adopt_module_key_flags(common)
  flags.DEFINE_enum("mode", "worker", ["worker", "verifier", "eval"], "worker: serve the RL run; verifier: score "
                    "the run's rollouts (the verifier role, run_verifier); eval: pass@k of --checkpoint. Default worker.")
  flags.DEFINE_string("checkpoint", None, "HF checkpoint dir (eval; a worker waits for pushed weights). Default none.")
  flags.DEFINE_string("worker_id", None, "Name used in logs and rollout records. Default host-pid.")
  flags.DEFINE_integer("tensor_parallel", 1, "Local devices the worker shards its weights over (tensor axis); it "
                       "pulls only the slices they hold (reshard on pull). Default 1.")
  flags.DEFINE_integer("slots", 32, "Concurrent sequences in the decode batch. Default 32.")
  flags.DEFINE_integer("chunk_steps", 8, "Decode steps between host syncs (refill granularity). Default 8.")
  flags.DEFINE_integer("max_prompt_len", 64, "Longest prompt in tokens when the trainer does not send one with the "
                       "sampling settings (it does: the longest prompt it kept). Default 64.")
  flags.DEFINE_bool("math_strict", True, "task=math: reward only a \\boxed{} answer (math-verify compares it); "
                    "False also takes 'answer is X', '#### X' or the last number. Default True.")
  flags.DEFINE_float("lease_s", 120.0, "Seconds a leased prompt stays ours before the server re-issues it. Default 120.")
  flags.DEFINE_float("score_lease_s", 120.0, "Verifier role: seconds a leased rollout to score stays ours before the "
                     "server re-issues it to another verifier (its own deadline, apart from --lease_s). Default 120.")
  flags.DEFINE_float("drain_s", 10.0, "On SIGTERM, seconds spent finishing in-flight groups. Default 10.")
  flags.DEFINE_integer("verifier_workers", 2, "Verifier process-pool size. Default 2.")
  flags.DEFINE_float("verifier_timeout_s", 10.0, "Per-completion verifier timeout in seconds. Default 10.")
  flags.DEFINE_bool("unsafe_code_sandbox", False, "task=code without bubblewrap: run candidate code with rlimits "
                    "only, no isolation (trusted code only); False refuses code items when bwrap is missing. "
                    "Default False.")
  flags.DEFINE_integer("max_failures_in_a_row", 8, "Prompts that may fail (reported to the server) in a row before "
                       "the worker treats itself as broken and exits (count). Default 8.")
  # Eval mode (the held-out set: common.define_shared_flags).
  flags.DEFINE_string("out", None, "Write eval metrics as JSON here. Default none.")
  # Bad values fail at flag parsing, before any work starts, with the flag and its value named.
  for name in ("slots", "chunk_steps", "max_prompt_len"):
    flags.register_validator(name, lambda v: v >= 1, message=f"--{name} must be >= 1")
  positive = lambda v: math.isfinite(v) and v > 0  # noqa: E731
  nonneg = lambda v: math.isfinite(v) and v >= 0  # noqa: E731
  for name, ok, rule in (("verifier_workers", lambda v: v >= 0, ">= 0 (0 = inline)"),
                         ("temperature", nonneg, "finite and >= 0 (0 = greedy)"),
                         ("drain_s", nonneg, "finite and >= 0"), ("lease_s", positive, "finite and > 0"),
                         ("score_lease_s", positive, "finite and > 0"),
                         ("verifier_timeout_s", positive, "finite and > 0")):
    flags.register_validator(name, ok, message=f"--{name} must be {rule}")


# --- Sampling ----------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  temperature: float = 1.0  # 0 = greedy
  top_k: int = 0  # 0 = off
  top_p: float = 1.0  # 1 = off
  max_new_tokens: int = 32
  stop_ids: tuple = ()

  def __post_init__(self):
    if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0 or self.max_new_tokens < 1:
      raise ValueError(f"bad sampling config {self}")


def sampling_logits(logits, sc: SamplingConfig):
  """[B,V] logits -> the fp32 logits sampled from: times 1/temperature (as losses scales them, so both round
  alike), -inf outside top-k / top-p."""
  x = logits.astype(jnp.float32) * (1.0 / (sc.temperature if sc.temperature > 0 else 1.0))
  if sc.top_k:
    x = jnp.where(x < jax.lax.top_k(x, sc.top_k)[0][:, -1:], -jnp.inf, x)
  if sc.top_p < 1.0:
    # Keep the smallest prefix of the sorted distribution whose mass reaches top_p (the top token always stays).
    order = jnp.argsort(-x, axis=-1)
    sp = jax.nn.softmax(jnp.take_along_axis(x, order, -1), -1)
    keep_sorted = (jnp.cumsum(sp, -1) - sp) < sc.top_p
    keep = jnp.zeros_like(keep_sorted).at[jnp.arange(x.shape[0])[:, None], order].set(keep_sorted)
    x = jnp.where(keep, x, -jnp.inf)
  return x


def greedy(x):
  """jnp.argmax(x, -1) as a max and a masked max of the negated index, which XLA CPU vectorises (its argmax is a
  variadic reduce, run element by element). Exact below V = 2^24; a row with a NaN gives the last index."""
  V = x.shape[-1]
  first = -jnp.max(jnp.where(x == jnp.max(x, -1, keepdims=True), -jnp.arange(V, dtype=jnp.float32), -V), -1)
  return jnp.minimum(first.astype(jnp.int32), V - 1)


def _last_positive(p):
  return jnp.max(jnp.where(p > 0, jnp.arange(p.shape[-1]), 0), -1)


def inverse_cdf_sample(logp, keys, block: int = 128):
  """One draw per row of the categorical exp(logp) [B,V] (unnormalised is fine) from ONE uniform per row (keys
  [B,2]); Gumbel-max draws V of them, a large part of a CPU decode step. Two levels (block sums, then the running
  sum inside the chosen block) keep each running sum short, so fp32 rounding moves a token's interval by ~1e-7 x
  its block's mass, not x 1. A token of probability 0 (cut by top-k/top-p) is never drawn: its interval is empty,
  and an index pushed past the end by rounding is clamped to the last positive one."""
  B, V = logp.shape
  nb = -(-V // block)
  p = jnp.pad(jnp.exp(logp), ((0, 0), (0, nb * block - V))).reshape(B, nb, block)  # padding: probability 0
  mass = p.sum(-1)  # [B, nb]
  ends = jnp.cumsum(mass, -1)
  u = jax.vmap(jax.random.uniform)(keys) * ends[:, -1]
  b = jnp.minimum(jnp.sum(ends <= u[:, None], -1), _last_positive(mass))
  start = jnp.take_along_axis(ends - mass, b[:, None], -1)[:, 0]
  inb = jnp.take_along_axis(p, b[:, None, None], 1)[:, 0]  # [B, block]
  i = jnp.minimum(jnp.sum(jnp.cumsum(inb, -1) <= (u - start)[:, None], -1), _last_positive(inb))
  return b * block + i


def sample(logits, keys, sc: SamplingConfig):
  """(tokens [B] int32, behaviour log-probs [B] fp32: each under the distribution it was drawn from)."""
  x = sampling_logits(logits, sc)
  # log_softmax's steps for the drawn token only: the [B,V] log-probs are never written.
  shifted = x - jnp.max(x, -1, keepdims=True)
  tok = greedy(x) if sc.temperature == 0 else inverse_cdf_sample(shifted, keys)
  lse = jnp.log(jnp.sum(jnp.exp(shifted), -1))
  return tok.astype(jnp.int32), jnp.take_along_axis(shifted, tok[:, None], -1)[:, 0] - lse


def sample_ids(prompt_id: str, G: int):
  """[G,2] uint32 (crc of the prompt id, j) of a prompt's G samples: with the seed, all the engine needs to derive
  sample j's key inside its jitted insert (sample_keys), so a re-issued prompt reproduces its tokens on any worker
  and a continued one goes on with the keys it started with. No device work per group on the host."""
  return np.stack([np.full(G, zlib.crc32(prompt_id.encode()) & 0x7FFFFFFF), np.arange(G)], 1).astype(np.uint32)


def sample_keys(seed, ids):
  """[n,2] keys from sample_ids rows: PRNGKey(seed) folded with the prompt's crc, then with j (the engine folds in
  the step)."""
  return jax.vmap(lambda c, j: jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(seed), c), j))(
      ids[:, 0], ids[:, 1])


# --- The decode engine -------------------------------------------------------------------------------------------

class Engine:
  """Continuous batching: `slots` sequences decode in one KV cache, `chunk_steps` jit-compiled steps per call and
  one device-to-host transfer per chunk (never per token or per group: the host copy serves every rows() call
  until the state changes), after which the host reads out the finished slots (rows) and refills them with new
  prompts (insert, prefilled as one batch, sampling keys derived inside it from `seed`; resume for continued
  samples)."""

  def __init__(self, cfg, sc: SamplingConfig, slots: int, max_prompt_len: int, chunk_steps: int = 8,
               attn_impl="auto", seed: int = 0):
    self.cfg, self.sc, self.B, self.chunk_steps, self.attn_impl = cfg, sc, slots, chunk_steps, attn_impl
    self.M, self.max_prompt_len, self.seed, self.state = sc.max_new_tokens, max_prompt_len, seed, None
    # Prefill lengths (data.BUCKETS, 16..2048): fresh prompts up to max_prompt_len, continued samples (prompt +
    # partial completion) up to max_prompt_len + M.
    longest, buckets = max_prompt_len + self.M, data.BUCKETS[:-1]
    self.buckets = (tuple(b for b in buckets if b < max_prompt_len) + (max_prompt_len,)
                    + tuple(b for b in buckets if max_prompt_len < b < longest) + (longest,))
    # A finished slot keeps decoding until the next host sync, so leave chunk_steps of slack in the cache.
    self.S = max_prompt_len + self.M + chunk_steps
    # XLA CPU copies each layer's weights out of the stacked [L,...] arrays at every decode step, so there the
    # engine decodes from a per-layer copy made once per weight version (one more copy in host memory while that
    # version is in use). XLA TPU reads the stacked slices inside the matmuls and uses the weights as given.
    self._unstack = jax.jit(model.unstack_layers) if jax.default_backend() == "cpu" else None
    self._weights_of = (None, None)  # (weights given, the per-layer copy)
    self._chunk = jax.jit(self._chunk_fn, donate_argnums=(1,))
    self._insert = jax.jit(self._insert_fn, donate_argnums=(1,))
    self._resume = jax.jit(self._resume_fn, donate_argnums=(0,))

  @property
  def state(self):
    return self._state

  @state.setter
  def state(self, st):  # every new state invalidates the host copy of the old one (_fetch)
    self._state, self._host = st, None

  def reset(self, dtype):
    B, M, cfg = self.B, self.M, self.cfg
    self.state = dict(
        cache=model.init_cache(cfg, B, self.S, dtype), logits=jnp.zeros((B, cfg.vocab_size), jnp.float32),
        active=jnp.zeros((B,), bool), n_gen=jnp.zeros((B,), jnp.int32),
        tokens=jnp.zeros((B, M), jnp.int32), logp=jnp.zeros((B, M), jnp.float32),
        # The policy version of each token: that of the weights whose forward gave the logits it was sampled
        # from (logits_version), so a token sampled right after a weight swap still counts as the old version.
        versions=jnp.zeros((B, M), jnp.int32), logits_version=jnp.zeros((B,), jnp.int32),
        keys=jnp.zeros((B, 2), jnp.uint32))

  def _insert_fn(self, params, st, prompts, lengths, rows, slots, ids, version):
    # Prefill n prompts [n,T] as one batch into a T-long cache, then copy prompt rows[j]'s cache row into slot
    # slots[j] (a prompt with G samples fills G slots; positions past T are never read: decode attends below
    # each slot's length). Padding entries have slot == B, out of range: mode="drop" skips their writes.
    n, T = prompts.shape
    one = model.init_cache(self.cfg, n, T, st["cache"]["k"][0].dtype)
    logits, one = model.prefill(params, self.cfg, prompts, lengths, one, attn_impl=self.attn_impl)
    c = st["cache"]
    put = lambda a, v: a.at[slots].set(v, mode="drop")  # noqa: E731
    copy = lambda n: [a.at[model.cache_at(n, slots, slice(0, T))].set(b[rows], mode="drop")  # noqa: E731
                      for a, b in zip(c[n], one[n])]
    cache = dict(c, k=copy("k"), v=copy("v"), lengths=put(c["lengths"], lengths[rows]))
    return dict(st, cache=cache, logits=put(st["logits"], logits[rows]), active=put(st["active"], True),
                n_gen=put(st["n_gen"], 0), tokens=put(st["tokens"], 0), logp=put(st["logp"], 0.0),
                versions=put(st["versions"], 0), logits_version=put(st["logits_version"], version),
                keys=put(st["keys"], sample_keys(self.seed, ids)))

  def _resume_fn(self, st, slots, n_gen, tokens, logp, versions, active):
    put = lambda a, v: a.at[slots].set(v, mode="drop")  # noqa: E731
    return dict(st, n_gen=put(st["n_gen"], n_gen), tokens=put(st["tokens"], tokens), logp=put(st["logp"], logp),
                versions=put(st["versions"], versions), active=put(st["active"], active))

  def _chunk_fn(self, params, st, version):
    sc, B, M = self.sc, self.B, self.M
    stop = jnp.asarray(sc.stop_ids or (-1,), jnp.int32)
    rows = jnp.arange(B)

    def step(st, _):
      keys = jax.vmap(jax.random.fold_in)(st["keys"], st["n_gen"])
      tok, lp = sample(st["logits"], keys, sc)
      live = st["active"]
      idx = jnp.minimum(st["n_gen"], M - 1)
      put = lambda name, x: st[name].at[rows, idx].set(jnp.where(live, x, st[name][rows, idx]))  # noqa: E731
      tokens, logp, versions = put("tokens", tok), put("logp", lp), put("versions", st["logits_version"])
      n_gen = st["n_gen"] + live
      done = live & (jnp.isin(tok, stop) | (n_gen >= M))
      old_len = st["cache"]["lengths"]
      logits, cache = model.decode_step(params, self.cfg, tok, st["cache"], attn_impl=self.attn_impl)
      # Inactive slots must not grow: their cache rows are dead until the next insert overwrites them.
      cache = dict(cache, lengths=jnp.where(live, cache["lengths"], old_len))
      return dict(st, cache=cache, logits=logits, active=live & ~done, n_gen=n_gen, tokens=tokens, logp=logp,
                  versions=versions, logits_version=jnp.full((B,), version, jnp.int32)), None

    return jax.lax.scan(step, st, None, length=self.chunk_steps)[0]

  def _weights(self, params):
    if self._unstack is not None and self._weights_of[0] is not params:  # a new version: one copy, then reused
      self._weights_of = (params, self._unstack(params))
    return params if self._unstack is None else self._weights_of[1]

  def bucket(self, n):
    for b in self.buckets:
      if n <= b:
        return b
    raise ValueError(f"prompt of {n} tokens exceeds max_prompt_len={self.buckets[-1]}")

  def insert(self, params, groups, version=0):
    """Prefills the prompts of groups = [(slots, prompt_tokens, sample_ids [len(slots), 2]), ...] in one batch and
    starts their slots; `version` tags the first token. The batch is padded to a power of two prompts and the
    longest prompt's bucket, so the compiled shapes stay few (log2(slots) x buckets)."""
    n = 1 << (len(groups) - 1).bit_length()
    T = self.bucket(max(len(p) for _, p, _ in groups))
    prompts, lengths = np.zeros((n, T), np.int32), np.ones(n, np.int32)
    rows, slots, keys = [], [], []
    for i, (sl, p, k) in enumerate(groups):
      prompts[i, :len(p)], lengths[i] = p, len(p)
      rows += [i] * len(sl)
      slots += list(sl)
      keys.append(np.asarray(k, np.uint32).reshape(len(sl), 2))
    pad = (1 << (len(slots) - 1).bit_length()) - len(slots)
    rows, slots = np.asarray(rows + [0] * pad, np.int32), np.asarray(slots + [self.B] * pad, np.int32)
    keys = np.concatenate(keys + [np.zeros((pad, 2), np.uint32)])
    self.state = self._insert(self._weights(params), self.state, jnp.asarray(prompts), jnp.asarray(lengths),
                              jnp.asarray(rows), jnp.asarray(slots), jnp.asarray(keys), np.int32(version))

  def resume(self, slots, tokens, logp, versions, done):
    """Continues samples another worker started (partial rollouts), right after insert() prefilled each slot with
    prompt + tokens[i] (just the prompt where done[i]): slot i then holds tokens[i], their log-probs and versions,
    and decodes on from step len(tokens[i]) with the same per-step keys as one uninterrupted run, unless done[i]."""
    m = 1 << (len(slots) - 1).bit_length()
    n_gen, active = np.zeros(m, np.int32), np.zeros(m, bool)
    tok, lp, ver = np.zeros((m, self.M), np.int32), np.zeros((m, self.M), np.float32), np.zeros((m, self.M), np.int32)
    for i, (t, l, v, d) in enumerate(zip(tokens, logp, versions, done)):
      assert len(t) == len(l) == len(v) <= self.M and (d or len(t) < self.M), (len(t), len(l), len(v), d)
      n_gen[i], active[i], tok[i, :len(t)], lp[i, :len(t)], ver[i, :len(t)] = len(t), not d, t, l, v
    sl = np.asarray(list(slots) + [self.B] * (m - len(slots)), np.int32)
    self.state = self._resume(self.state, *map(jnp.asarray, (sl, n_gen, tok, lp, ver, active)))

  def run_chunk(self, params, version=0):
    """Decodes one chunk; returns which slots are still generating."""
    self.state = self._chunk(self._weights(params), self.state, np.int32(version))
    return self._fetch()["active"]

  def _fetch(self):
    # The current state's host copy, made on first use: one transfer of everything the host reads ([B,M] x 3 +
    # [B] x 2: 0.4 MB at B=32, M=1024), not a gather per finished group.
    if self._host is None:
      self._host = jax.device_get({k: self.state[k] for k in ("active", "tokens", "logp", "n_gen", "versions")})
    return self._host

  def rows(self, slots):
    """Host copies of (tokens, logp, n_gen, versions) of the given slots; completions include the stop token."""
    h, s = self._fetch(), np.asarray(slots, np.int64)
    return tuple(h[k][s] for k in ("tokens", "logp", "n_gen", "versions"))


class Slots:
  """Which engine slots are free, and which group (G slots, plus what the caller adds) holds the others."""

  def __init__(self, n: int):
    self.free, self.groups = list(range(n)), {}

  def take(self, gid, G: int):
    assert len(self.free) >= G and gid not in self.groups, (len(self.free), G, gid)
    slots, self.free = self.free[:G], self.free[G:]
    self.groups[gid] = dict(slots=slots)
    return slots

  def release(self, gid):
    g = self.groups.pop(gid)
    self.free.extend(g["slots"])
    return g

  def finished(self, active):
    """Ids of the groups none of whose slots is still active (run_chunk's result)."""
    return [gid for gid, g in self.groups.items() if not active[g["slots"]].any()]


def generate_groups(engine, params, items, group_size):
  """Runs items = [(prompt_id, prompt_tokens)] through the engine, G samples each, without a server (eval, the
  benches). Returns {prompt_id: (completions, their log-probs)}, lists of G arrays."""
  G, B = group_size, engine.B
  if B < G:
    raise ValueError(f"slots={B} < group_size={G}")
  pending, out, slots = list(items), {}, Slots(B)
  while pending or slots.groups:
    new = []
    while pending and len(slots.free) >= G:
      pid, toks = pending.pop(0)
      if not 1 <= len(toks) <= engine.max_prompt_len:  # (the buckets go further: they also fit continuations)
        raise ValueError(f"prompt {pid!r} of {len(toks)} tokens exceeds max_prompt_len={engine.max_prompt_len}")
      new.append((slots.take(pid, G), toks, sample_ids(pid, G)))
    if new:
      engine.insert(params, new)  # every prompt that fits, prefilled as one batch
    for pid in slots.finished(engine.run_chunk(params)):
      toks, lps, n, _ = engine.rows(slots.release(pid)["slots"])
      out[pid] = ([toks[i, :n[i]] for i in range(G)], [lps[i, :n[i]] for i in range(G)])
  return out


# --- The worker: a loop of named steps over one Worker -----------------------------------------------------------

@dataclasses.dataclass
class Worker:
  """What the steps of the worker loop share; the loop's thread owns it (the Sender's thread counts `failed` and
  `sent` too)."""
  wid: str
  client: param_server.Client  # the loop's own connection (a long poll or a slow put elsewhere never holds it up)
  engine: Engine
  weights: "Weights"
  params: object  # the weights in use, and their version
  version: int
  slots: Slots  # groups: id -> dict(slots, item, t0, resumed)
  window: "Window"  # busy fraction and rates, sent with every rollout
  group_size: int = 1  # the last leased item's G: lease only what fits
  drain_deadline: float = None  # set on SIGTERM
  failed: list = dataclasses.field(default_factory=list)  # ids failed since the last success (fail_item)
  sent: int = 0
  leaser: "Leaser" = None
  stale_tokens: int = 0  # tokens regenerated as too stale since the last rollout sent
  forks: list = dataclasses.field(default_factory=list)  # the trainer's restarts (manifest field; common.policy_lag)
  scoring: tuple = (0.0, 0, 0)  # the "to_score" queue as last seen (verifiers): when, its consumers, its ready items


def connect():
  """(a new server connection each call, the tokenizer, the verifier pool) of a worker or a verifier."""
  token = open(FLAGS.token_file).read().strip() if FLAGS.token_file else None
  pool = data.VerifierPool(FLAGS.verifier_workers, timeout_s=FLAGS.verifier_timeout_s, strict_math=FLAGS.math_strict,
                           limits=data.SandboxLimits(unsafe=FLAGS.unsafe_code_sandbox))
  return lambda: param_server.connect(FLAGS.server, token, FLAGS.server_retries), data.load_tokenizer(FLAGS.tokenizer), pool


def run_worker():
  stop = param_server.StopFlag()
  client, tok, pool = connect()
  w = wait_for_weights(stop, client(), tok)
  if w is None:
    return
  puller = Puller(client(), w.weights.pull, w.version)
  # One refill of the slots leased ahead (one prompt until the first group shows the group size); none on SIGTERM.
  w.leaser = Leaser(client(), lambda: 0 if w.drain_deadline is not None else
                    FLAGS.slots // w.group_size if w.sent or w.slots.groups else 1, FLAGS.lease_s)
  sender = Sender(functools.partial(send_groups, w, client(), tok, pool), maxsize=FLAGS.slots)
  try:
    while not drained(w, stop):
      if new := puller.take():  # between chunks: the groups in flight keep their (older) tag
        w.version, w.params, w.forks = new[0]["version"], new[1], new[0].get("forks", [])
      # Pacing: a group started on weights more than --max_staleness behind the newest would only be regenerated;
      # wait for the puller instead.
      behind = puller.newest - w.version > FLAGS.max_staleness
      if w.drain_deadline is None and len(w.slots.free) >= w.group_size and not behind:
        start_groups(w, lease(w))
      elif behind and not w.slots.groups:
        t = time.time()
        puller.wait(1.0)
        w.window.add(wait_weights_s=time.time() - t)
      sender.check()
      if not w.slots.groups:  # idle: the Sender still looks for rollouts the verifier role left unscored
        sender.submit([])
      if w.slots.groups:
        t = time.time()
        active = w.engine.run_chunk(w.params, w.version)
        w.window.add(decode_s=time.time() - t)
        finish_groups(w, active, sender, puller.newest)
  finally:
    puller.close()
    ahead = w.leaser.close()
  sender.close()  # everything finished is scored and sent before the prompts in flight are handed back
  hand_back(w.client, w.engine, w.slots.groups, ahead)
  logging.info("worker %s stopped after %d groups", w.wid, w.sent)


def wait_for_weights(stop, client, tok):
  """Pulls the first published version (the trainer publishes one at startup) and builds the engine its sampling
  settings ask for; None if SIGTERM comes first."""
  wid = FLAGS.worker_id or f"{os.uname().nodename}-{os.getpid()}"
  logging.info("worker %s waiting for weights", wid)
  m = params = None
  while m is None and not stop.requested:
    m = client.manifest(newer_than=-1, wait_s=5.0)
  if m is None:
    return None
  cfg, s = model.Config.from_hf_dict(m["config"]), m["sampling"]
  mesh = model.make_mesh(1, 1, FLAGS.tensor_parallel, devices=jax.local_devices())
  jax.set_mesh(mesh)
  weights = Weights(wid, model.param_shardings(cfg, mesh), client.token)
  while params is None and not stop.requested:
    if (params := weights.pull(m)) is None:
      m = client.manifest(newer_than=-1, wait_s=1.0) or m
  if params is None:
    return None
  sc = SamplingConfig(s["temperature"], s["top_k"], s["top_p"], s["max_new_tokens"], tuple(sorted(tok.stop_ids)))
  # The KV cache is sized from the data: the trainer sends its longest kept prompt with the sampling settings.
  engine = Engine(cfg, sc, FLAGS.slots, int(s.get("max_prompt_len") or FLAGS.max_prompt_len), FLAGS.chunk_steps,
                  FLAGS.attn_impl, seed=FLAGS.seed)
  engine.reset(jax.tree.leaves(params)[0].dtype)
  logging.info("worker %s: v%d, sampling %s, mesh %s", wid, m["version"], sc, dict(mesh.shape))
  return Worker(wid, client, engine, weights, params, m["version"], Slots(FLAGS.slots), Window(),
                forks=m.get("forks", []))


def drained(w, stop):
  """On SIGTERM, stops leasing and gives the groups in flight --drain_s seconds: True once they are done or the
  time is up."""
  if stop.requested and w.drain_deadline is None:
    w.drain_deadline = time.time() + FLAGS.drain_s
    logging.info("worker %s: SIGTERM, draining %d groups", w.wid, len(w.slots.groups))
  return w.drain_deadline is not None and (not w.slots.groups or time.time() > w.drain_deadline)


def lease(w):
  """Takes from the Leaser's buffer the prompts that fit the free slots now; returns those to start. A malformed
  item fails alone; one that does not fit after all goes back to the front of the buffer."""
  t = time.time()
  items = w.leaser.take(len(w.slots.free) // w.group_size, wait_s=0.0 if w.slots.groups else 1.0)
  if not w.slots.groups:  # idle: nothing to decode while the lease call waits
    w.window.add(wait_prompts_s=time.time() - t)
  fits, room = [], len(w.slots.free)
  for raw in items:
    try:
      item = data.PromptItem.from_wire(raw)
    except ValueError as e:
      fail_item(w.client, raw["id"], e, w.failed)
      continue
    w.group_size = item.group_size
    if w.group_size > FLAGS.slots:  # this worker's configuration, not the item: fail loudly
      raise ValueError(f"group_size={w.group_size} > --slots={FLAGS.slots}")
    if w.group_size <= room:
      fits.append(item)
      room -= w.group_size
    else:
      w.leaser.put_back(raw)
  return fits


def start_groups(w, items):
  """Prefills the items' prompts as one batch into free slots, each sample of a partial rollout from prompt + its
  completion so far. An item whose prompt cannot run fails alone; an unusable or too stale partial rollout is
  dropped (the prompt generated afresh)."""
  batch, vocab = [], w.engine.cfg.vocab_size
  for it in items:
    if it.id in w.slots.groups:  # its lease expired while in flight here and it came back: keep the one running
      logging.warning("prompt %s leased again while in flight here; not started twice", it.id)
      continue
    p, part = it.prompt_tokens, None
    try:
      if not 1 <= len(p) <= w.engine.max_prompt_len:  # the trainer skips such prompts at load
        raise ValueError(f"prompt {it.problem.id!r} of {p.size} tokens exceeds max_prompt_len="
                         f"{w.engine.max_prompt_len} (or is empty)")
      if p.min() < 0 or p.max() >= vocab:
        raise ValueError(f"prompt {it.problem.id!r}: prompt_tokens are not token ids in [0, {vocab})")
    except Exception as e:
      fail_item(w.client, it.id, e, w.failed)
      continue
    try:
      part = partial_of(it.partial, it.group_size, w.engine.M, vocab)
      oldest = min(int(v.min()) for v in part[2] if len(v)) if part else None
      if part and common.policy_lag(w.version, oldest, w.forks) > FLAGS.max_staleness:
        raise ValueError(f"its oldest token is more than --max_staleness={FLAGS.max_staleness} versions "
                         f"behind v{w.version}")
    except ValueError as e:
      logging.warning("prompt %s: partial rollout not continued (%s); generating it afresh", it.id, e)
      part = None
    batch.append((it, w.slots.take(it.id, it.group_size), p, part))
  if not batch:
    return
  rows, resume = [], [[] for _ in range(5)]  # prefill rows; continued slots, their tokens, logp, versions, done
  for it, sl, p, part in batch:
    keys = sample_ids(it.id, len(sl))
    if part is None:
      rows.append((sl, p, keys))  # one prefill row for the whole group
      continue
    rows += [([s], p if part[3][i] else np.concatenate([p, part[0][i]]), keys[i:i + 1]) for i, s in enumerate(sl)]
    for lst, x in zip(resume, (sl,) + part):
      lst.extend(x)
  try:
    w.engine.insert(w.params, rows, w.version)
    if resume[0]:
      w.engine.resume(*resume)
  except Exception as e:  # not an item's fault as far as we could check: report each, the worker goes on
    for it, *_ in batch:
      w.slots.release(it.id)
      fail_item(w.client, it.id, e, w.failed)
    return
  for it, _, _, part in batch:
    w.slots.groups[it.id].update(item=it, t0=time.time(), resumed=sum(len(t) for t in part[0]) if part else 0)


def finish_groups(w, active, sender, latest):
  """Hands the groups whose slots all finished in this chunk to the Sender as one job, each tagged with the oldest
  version that produced any of its tokens (a conservative staleness bound; carried tokens may predate this
  worker). One more than --max_staleness versions behind the newest is regenerated from scratch instead (unless
  draining); its tokens are counted (stale_regen_tokens, sent with the next rollout) as generation thrown away.
  latest: the newest version the Puller's long poll has seen (no request on the decode loop's thread)."""
  done = w.slots.finished(active)
  if not done:
    return
  stale, out = [], []
  for gid in done:
    g = w.slots.release(gid)
    toks, lps, n, vers = w.engine.rows(g["slots"])  # host slices of the chunk's one transfer
    tag = min((int(vers[i, :n[i]].min()) for i in range(len(n)) if n[i]), default=w.version)
    if common.policy_lag(latest, tag, w.forks) > FLAGS.max_staleness and w.drain_deadline is None:
      stale.append(dataclasses.replace(g["item"], partial=None))
      w.stale_tokens += int(n.sum())
      continue
    w.window.add(tokens=float(n.sum()))
    r = w.window.rates()  # over the last 30 s; waiting for prompts: nothing to decode; for the sender: it fell behind
    stats = dict(w.weights.stats, worker_busy_frac=r.get("decode_s", 0.0), worker_tok_s=r.get("tokens", 0.0),
                 worker_wait_prompts_frac=r.get("wait_prompts_s", 0.0), worker_wait_send_frac=r.get("wait_send_s", 0.0),
                 worker_wait_weights_frac=r.get("wait_weights_s", 0.0),
                 resumed_tokens=g["resumed"], stale_regen_tokens=w.stale_tokens)  # resumed: a preempted worker's
    w.stale_tokens = 0
    out.append(data.Rollout(gid, tag, w.wid, g["item"].problem, g["item"].prompt_tokens,
                            [toks[i, :n[i]].astype(np.int32) for i in range(len(n))],
                            [lps[i, :n[i]].astype(np.float32) for i in range(len(n))], None, time.time() - g["t0"],
                            stats))
  if out:
    t = time.time()
    sender.submit(out)
    w.window.add(wait_send_s=time.time() - t)
  start_groups(w, stale)  # one batched prefill for all of them


def send_groups(w, client, tok, pool, rs):
  """The Sender's step, once per chunk: puts the chunk's finished groups in one request, then acks their prompts in
  one (only then: a crash in between re-issues the prompts, and the server drops the duplicate rollouts by id).
  They go to the run's verifier role when it has one (queue "to_score"), else they are scored here in one
  verifier call, and then this worker also scores as many the role left behind (its verifiers all gone). If the
  batch fails, each group goes alone, so a bad one fails alone."""
  remote = has_verifiers(w, client)
  if not remote and w.scoring[2]:  # (an idle worker sends rs=[] now and then for this)
    score_items(client, tok, pool, client.get("to_score", FLAGS.slots, lease_s=FLAGS.score_lease_s), w.failed)
  if not rs:
    return
  try:
    client.put("to_score" if remote else "rollouts", [r.to_wire() for r in (rs if remote else scored(pool, tok, rs))])
  except Exception as e:
    if len(rs) == 1 or isinstance(e, FATAL):
      return fail_item(client, rs[0].id, e, w.failed)  # (raises if FATAL)
    for r in rs:
      send_groups(w, client, tok, pool, [r])
    return
  w.failed.clear()
  client.ack("prompts", [r.id for r in rs])
  w.sent += len(rs)
  if w.sent // 20 > (w.sent - len(rs)) // 20:
    logging.info("worker %s v%d: %d groups sent, %.1f tok/s", w.wid, w.version, w.sent, rs[-1].stats["worker_tok_s"])


def has_verifiers(w, client):
  """Whether the run has verifiers now: a process asked "to_score" for work in the last 30 s (server stats, every 5 s)."""
  if time.time() - w.scoring[0] > 5:
    q = client.stats()["queues"].get("to_score", {})
    w.scoring = (time.time(), q.get("consumers", 0), q.get("ready", 0))
  return w.scoring[1] > 0


def scored(pool, tok, rs, remote=False):
  """The rollouts rs with their rewards, from one verifier call for all their completions."""
  n = pool.reused
  rewards = pool.score([r.problem for r in rs for _ in r.completions],
                       [tok.decode(c.tolist()) for r in rs for c in r.completions])
  stats = dict(verdicts_reused_frac=(pool.reused - n) / max(len(rewards), 1), scored_by_verifier=float(remote))
  return [dataclasses.replace(r, rewards=np.asarray(rewards[i:i + len(r.completions)], np.float32),
                              stats=dict(r.stats, **stats))
          for r, i in zip(rs, np.cumsum([0] + [len(r.completions) for r in rs]))]


def score_items(client, tok, pool, items, failed, remote=False):
  """Scores rollouts leased from "to_score" and moves them to "rollouts": put, then ack (a crash in between
  scores them again, and the server drops the duplicate by id). A batch that fails is retried one by one; an
  item that fails alone is reported (FAIL: re-issued to another verifier, quarantined after the server's
  --max_failures, which the trainer counts as consumed). Returns how many went on."""
  if not items:
    return 0
  try:
    client.put("rollouts", [r.to_wire() for r in scored(
        pool, tok, [data.Rollout.from_wire(it, scored=False) for it in items], remote)])
  except Exception as e:
    if len(items) > 1 and not isinstance(e, FATAL):
      return sum(score_items(client, tok, pool, [it], failed, remote) for it in items)
    fail_item(client, items[0]["id"], e, failed, "to_score")  # (raises if FATAL)
    return 0
  failed.clear()
  client.ack("to_score", [it["id"] for it in items])
  return len(items)


def run_verifier():
  """--mode=verifier, the verifier role (on any host that reaches the server: CPU hosts or the TPU hosts' CPUs):
  leases rollouts from "to_score" (--slots at a time, for --score_lease_s), scores them in its process pool and
  sandbox (verdict cache included) and moves them to "rollouts". Workers send there only while some verifier
  asks for work. SIGTERM: the batch in hand is finished, nothing more leased; kill -9: its leases expire and
  another verifier (or a worker, when none is left) scores them."""
  stop = param_server.StopFlag()
  client, tok, pool = connect()
  client, n, failed = client(), 0, []
  logging.info("verifier %s: serving the queue to_score", FLAGS.worker_id)
  while not stop.requested:
    items = client.get("to_score", FLAGS.slots, wait_s=2.0, lease_s=FLAGS.score_lease_s, consumer=True)
    n += score_items(client, tok, pool, items, failed, remote=True)
    if items and (n == len(items) or n // 100 > (n - len(items)) // 100):  # the first batch, then every 100
      logging.info("verifier %s: %d groups scored, %.0f%% of verdicts reused", FLAGS.worker_id, n,
                   100 * pool.reused / max(pool.reused + pool.ran, 1))
  logging.info("verifier %s stopped after %d groups", FLAGS.worker_id, n)


def hand_back(client, engine, groups, ahead=()):
  """Returns the unfinished prompts so they are re-issued now rather than after their lease expires, each with
  its partial rollout (data.PARTIAL_FIELDS) when it has one: the next worker continues it instead of generating
  those tokens again (slime / AReaL partial rollouts); kill -9 loses only the leases and the tokens in flight."""
  partial, plain, saved = [], list(ahead), 0  # ahead: leased, never started
  for gid, g in groups.items():
    toks, lps, n, vers = engine.rows(g["slots"])
    if not n.any():  # preempted before its first chunk: nothing to keep
      plain.append(gid)
      continue
    done = [bool(n[i] == engine.M or (n[i] and int(toks[i, n[i] - 1]) in engine.sc.stop_ids)) for i in range(len(n))]
    partial.append(dataclasses.replace(g["item"], partial=dict(
        partial_tokens=[toks[i, :n[i]] for i in range(len(n))], partial_logprobs=[lps[i, :n[i]] for i in range(len(n))],
        partial_versions=[vers[i, :n[i]] for i in range(len(n))], partial_done=done)).to_wire())
    saved += int(n.sum())
  if plain:
    client.requeue("prompts", plain)
  if partial:
    try:
      r = client.release("prompts", partial)
    except (ValueError, RuntimeError) as e:  # e.g. the server's disk is full: hand the prompts back without
      logging.warning("partial rollouts not stored (%s); handing the prompts back without them", e)
      client.requeue("prompts", [it["id"] for it in partial])
      return
    logging.info("handed back %d partial rollouts (%d generated tokens kept; %d no longer ours: %s)",
                 r["released"], saved, len(r["unknown"]), r["unknown"][:4])


def partial_of(fields, G, M, vocab):
  """A partial rollout handed back (a PromptItem's `partial`, or its wire dict) as four checked lists of G:
  tokens, behaviour log-probs, versions, done; None if there is none. A ValueError names the field and sample."""
  if not fields or not any(k in fields for k in data.PARTIAL_FIELDS):
    return None
  out = [fields.get(k) for k in data.PARTIAL_FIELDS]
  for k, v in zip(data.PARTIAL_FIELDS, out):
    if not isinstance(v, list) or len(v) != G:
      raise ValueError(f"{k} must be a list of group_size={G} entries, got {type(v).__name__} "
                       f"of {len(v) if isinstance(v, list) else '-'}")
  checked = ([], [], [], [])
  for i in range(G):
    t, lp, v, d = np.asarray(out[0][i]), np.asarray(out[1][i]), np.asarray(out[2][i]), out[3][i]
    if not isinstance(d, bool):
      raise ValueError(f"partial_done[{i}] must be a bool, got {d!r:.40}")
    if (t.ndim != 1 or t.dtype.kind not in "iu" or len(t) > M or (not d and len(t) == M) or (d and not len(t))
            or (len(t) and (t.min() < 0 or t.max() >= vocab))):
      raise ValueError(f"partial_tokens[{i}]: {t.size} tokens ({t.dtype}) are not ids in [0, {vocab}) within "
                       f"the budget of {M} new tokens (done={d})")
    if lp.shape != t.shape or lp.dtype.kind != "f" or not np.all(np.isfinite(lp)) or np.any(lp > 0):
      raise ValueError(f"partial_logprobs[{i}] must be {len(t)} finite log-probs <= 0")
    if v.shape != t.shape or v.dtype.kind not in "iu":
      raise ValueError(f"partial_versions[{i}] must be {len(t)} integer versions")
    for lst, x in zip(checked, (t.astype(np.int32), lp.astype(np.float32), v.astype(np.int32), d)):
      lst.append(x)
  return checked


FATAL = (ConnectionError, PermissionError, param_server.StorageError, param_server.QueueFullError)  # not an item's fault


def fail_item(client, gid, exc, failures, queue="prompts"):
  """Reports a prompt (or a rollout to score) this worker could not process (the server re-issues it and quarantines it after its
  --max_failures reports) and moves on. Errors that are not the item's fault (server unreachable, wrong token,
  server disk full) end the worker, and so do --max_failures_in_a_row failures in a row: a broken worker must not
  quarantine the whole dataset."""
  if isinstance(exc, FATAL):
    raise exc
  failures.append(gid)
  if len(failures) > FLAGS.max_failures_in_a_row:
    raise RuntimeError(f"{len(failures)} items failed in a row (last {gid!r}): the worker itself is broken") from exc
  reason = f"{type(exc).__name__}: {exc}"[:1000]
  logging.warning("prompt %s failed on this worker (%s); reported to the server", gid, reason)
  client.fail(queue, [gid], reason)


class Window:
  """Rates of running totals over the last span_s seconds: add(decode_s=...), then rates() -> {name: total gained
  per second} (decode seconds per second: the busy fraction)."""

  def __init__(self, span_s: float = 30.0):
    self.span_s, self.totals, self.marks = span_s, {}, deque()

  def add(self, **amounts):
    for k, v in amounts.items():
      self.totals[k] = self.totals.get(k, 0.0) + v
    now = time.time()
    self.marks.append((now, dict(self.totals)))
    while len(self.marks) > 2 and now - self.marks[1][0] >= self.span_s:
      self.marks.popleft()

  def rates(self):
    t0, c0 = self.marks[0] if self.marks else (time.time(), {})
    return {k: (v - c0.get(k, 0.0)) / max(time.time() - t0, 1e-9) for k, v in self.totals.items()}


# --- Background threads that keep the decode loop busy: the Sender, and the Puller with the pull side --------------

class Leaser:
  """Keeps want() prompts leased ahead on a background thread with its own connection: the decode loop takes them
  from memory (a lease request per chunk on its thread was half its wall in the demo). At exit the rest go back
  (hand_back); on kill -9 their leases expire like those of the prompts in flight."""

  def __init__(self, client, want, lease_s: float):
    self.client, self.want, self.lease_s = client, want, lease_s
    self.items, self.error, self.closed = deque(), None, False
    self.cond = threading.Condition()
    self.thread = threading.Thread(target=self._run, daemon=True, name="leaser")
    self.thread.start()

  def _run(self):
    try:
      while not self.closed:
        with self.cond:
          self.cond.wait_for(lambda: self.closed or len(self.items) < self.want(), timeout=1.0)
          n = self.want() - len(self.items)
        got = self.client.get("prompts", max_items=n, wait_s=1.0, lease_s=self.lease_s) if n > 0 else []
        with self.cond:
          self.items.extend(got)
          self.cond.notify_all()
    except BaseException as e:  # noqa: BLE001  (raised on the loop's thread by take())
      self.error = e
      with self.cond:
        self.cond.notify_all()

  def take(self, n: int, wait_s: float):
    """Up to n leased items (wire dicts), waiting up to wait_s for the first."""
    with self.cond:
      self.cond.wait_for(lambda: self.items or self.error is not None, timeout=wait_s)
      if self.error is not None:
        raise self.error
      out = [self.items.popleft() for _ in range(min(n, len(self.items)))]
      self.cond.notify_all()
    return out

  def put_back(self, raw):
    with self.cond:
      self.items.appendleft(raw)

  def close(self):
    """Stops leasing; returns the ids still held here (leased, never started)."""
    self.closed = True
    with self.cond:
      self.cond.notify_all()
    self.thread.join(timeout=10.0)  # a lease request in progress waits at most 1 s
    with self.cond:
      return [it["id"] for it in self.items]


class Sender:
  """Runs fn(job) for each submitted job, in order, on one background thread. The queue is bounded: if sending
  falls `maxsize` jobs behind, submit blocks (decoding waits). The first exception stops the sending and is
  raised on the loop's thread by check(), submit() or close()."""

  def __init__(self, fn, maxsize: int):
    self.fn, self.q, self.error = fn, queue.Queue(maxsize), None
    self.thread = threading.Thread(target=self._run, daemon=True, name="sender")
    self.thread.start()

  def _run(self):
    while (job := self.q.get()) is not None:
      if self.error is None:  # after an error keep draining, so submit never blocks on a dead consumer
        try:
          self.fn(job)
        except BaseException as e:  # noqa: BLE001  (handed to the loop's thread, which raises it)
          self.error = e

  def check(self):
    if self.error is not None:
      raise self.error

  def submit(self, job):
    self.check()
    self.q.put(job)

  def close(self):
    """Sends everything submitted, then stops."""
    self.q.put(None)
    self.thread.join()
    self.check()


# --- The pull side of the weight path: the slices this worker's devices hold, as deltas where it can --------

def pull_weights(manifest, shardings, clients, base=None, stats=None, token=None):
  """The manifest's weights placed with `shardings` (a pytree of Shardings, same structure as the published
  tree): only the distinct slices this process's devices hold (param_server.pull_slices). clients: dict
  "host:port" -> Client, filled on demand. Returns (pytree of jax.Array, bytes pulled). base=(manifest, params)
  the reader holds now (what an earlier pull returned with the same shardings): each slice it holds comes as a
  delta, applied on each device that holds the slice (_apply), so a pull moves and touches only what changed,
  never a host copy of the model; pull_slices says what `stats` gets. token: for the clients it opens. A malformed
  manifest raises ValueError, like a failed pull."""
  param_server.check_manifest(manifest)
  sh = param_server.flatten(shardings)
  if set(sh) != set(manifest["tensors"]):
    raise ValueError(f"manifest v{manifest['version']} tensors {sorted(manifest['tensors'])[:4]}... do not match "
                     f"the reader's {sorted(sh)[:4]}...")
  held = param_server.flatten(base[1]) if base is not None else {}
  wanted = {}  # name -> {distinct global slice: the local devices that hold it}
  for name, t in manifest["tensors"].items():
    for d, idx in sh[name].addressable_devices_indices_map(tuple(t["shape"])).items():
      wanted.setdefault(name, {}).setdefault(tuple(map(tuple, param_server.slice_index(idx, t["shape"]))), []).append(d)
  shards = {name: {(tuple(map(tuple, param_server.slice_index(s.index, x.shape))), s.device): s.data
                   for s in x.addressable_shards} for name, x in held.items()
            if name in base[0]["tensors"] and tuple(x.shape) == tuple(manifest["tensors"][name]["shape"])
            and base[0]["tensors"][name]["dtype"] == manifest["tensors"][name]["dtype"]}
  st, out = {}, {}
  for name, bufs, patches in param_server.pull_slices(
      manifest, wanted, clients, base=base and base[0], stats=st, token=token,
      held=lambda name, slices: [w for w in slices if all((w, d) in shards.get(name, {}) for d in wanted[name][w])]):
    ready = {w: [placed(p, tuple(hi - lo for lo, hi in w)) for p in ps] for w, ps in patches.items()}  # once a slice
    out[name] = jax.make_array_from_single_device_arrays(
        tuple(manifest["tensors"][name]["shape"]), sh[name],
        [_apply(shards[name][w, d], ready[w]) if w in ready else jax.device_put(bufs[w], d)
         for w, ds in wanted[name].items() for d in ds])
  if stats is not None:
    stats.update(st)
  return param_server.unflatten(out), st["bytes"]


def placed(p, shape):
  """One pull_slices patch (dest, kind, a, pos) of a slice of `shape`, ready for _apply, once per slice however
  many devices hold it: a sparse patch's region positions turned into positions in the slice, padded to a power of
  two (few compiled shapes). Only the patch's elements cross to the device."""
  dest, kind, a, pos = p
  dest = tuple((d.start, d.stop) for d in dest)
  if kind == "sparse":
    region = [hi - lo for lo, hi in dest]
    if region != list(shape):  # (a whole slice's positions are the slice's already)
      pos = np.ravel_multi_index(tuple(i + lo for i, (lo, _) in zip(np.unravel_index(pos, region), dest)), shape)
    n = 1 << max(len(pos) - 1, 0).bit_length()
    pos, a = np.pad(pos, (0, n - len(pos)), constant_values=math.prod(shape)), np.pad(a, (0, n - len(a)))
  return a, pos, dest, kind


def _apply(x, patches):
  """The slice x (a device array: the version in use, it stays) with `patches` (placed's) applied, bit for bit, in a
  new array on its device: the first patch writes it, the rest patch it in place (donated), so a slice under k
  trainer pieces costs one copy, not k. A bf16 slice is patched as uint16 between one bitcast each way: XLA CPU
  moves bf16 through fp32, which canonicalizes NaN payloads (tests/test_delta.py)."""
  raw = x.dtype == jnp.bfloat16
  y = _bitcast(x, jnp.dtype(jnp.uint16)) if raw else x
  for i, q in enumerate(patches):
    y = (_patch_again if i or raw else _patch)(y, *q)
  return _bitcast(y, x.dtype) if raw else y


def _patch_fn(x, a, pos, dest, kind):
  # The patched elements' bits as unsigned ints, XORed and written back in x's dtype (a move): only they are
  # bitcast, where bitcasting all of x costs XLA CPU two copies of it.
  bits, back = (functools.partial(jax.lax.bitcast_convert_type, new_dtype=t) for t in (a.dtype, x.dtype))
  if kind == "sparse":  # padding positions are out of range: their reads fill, their writes are dropped
    flat = x.reshape(-1)
    return flat.at[pos].set(back(bits(flat.at[pos].get(mode="fill", fill_value=0)) ^ a), mode="drop").reshape(x.shape)
  region = tuple(slice(lo, hi) for lo, hi in dest)
  new = a.reshape(x[region].shape)
  return x.at[region].set(back(new if kind == "set" else bits(x[region]) ^ new))


_patch = jax.jit(_patch_fn, static_argnums=(3, 4))  # dest, kind: x stays
_patch_again = jax.jit(_patch_fn, static_argnums=(3, 4), donate_argnums=(0,))  # x: a copy _apply made
_bitcast = jax.jit(jax.lax.bitcast_convert_type, static_argnums=(1,))


class Puller:
  """Downloads the next weight version on a background thread while the loop decodes with the current one, so a
  swap never waits for the network. Double-buffered: besides the version in use, at most one newer, complete
  version waits for take(), and the next pull starts only once it is taken, so a worker holds at most two versions
  of its weights (the memory plan). pull(manifest) -> params, or None (the version is gone: the next is tried)."""

  def __init__(self, client, pull, version: int, poll_s: float = 1.0):
    self.client, self.pull, self.version, self.poll_s = client, pull, version, poll_s
    self.ready, self.error, self.closed = None, None, False
    self.newest = version  # the newest version the server announced (being pulled, or ready)
    self.taken, self.arrived = threading.Event(), threading.Event()  # arrived: a version is ready for take()
    self.taken.set()
    self.thread = threading.Thread(target=self._run, daemon=True, name="puller")
    self.thread.start()

  def _run(self):
    try:
      while not self.closed:
        if not self.taken.wait(self.poll_s):
          continue
        m = self.client.manifest(newer_than=self.version, wait_s=self.poll_s)  # long poll
        if m is None or self.closed:
          continue
        self.newest = m["version"]
        new = self.pull(m)
        if new is not None:
          self.version = m["version"]
          self.taken.clear()
          self.arrived.set()  # before ready: a take() in between finds None, and the next finds it
          self.ready = (m, new)
    except BaseException as e:  # noqa: BLE001  (raised on the loop's thread by take())
      self.error = e

  def take(self):
    """(manifest, params) of a newer complete version, else None."""
    if self.error is not None:
      raise self.error
    r, self.ready = self.ready, None
    if r is not None:
      self.arrived.clear()
      self.taken.set()
    return r

  def wait(self, timeout_s: float):
    """Until a version is ready for take() (or timeout_s): a worker too far behind waits here, idle."""
    self.arrived.wait(timeout_s)

  def close(self):
    self.closed = True
    self.taken.set()
    self.thread.join(timeout=10 * self.poll_s)  # a pull in progress is abandoned (daemon thread)


class Weights:
  """The weight side of a worker: the version it holds, the base its next pull asks deltas against, the shard
  servers' connections, and the newest pull's figures (sent with every rollout). pull() runs on the Puller."""

  def __init__(self, wid, shardings, token=None):
    self.wid, self.shardings, self.clients, self.held, self.stats = wid, shardings, {}, None, {}
    self.token = token  # every read needs it too

  def pull(self, m):
    """The manifest's weights, only the slices this worker's devices hold, or None if they were garbage-collected
    meanwhile (a newer version exists) or a shard server is down (the trainer re-publishes to its replacement)."""
    t, st = time.time(), {}
    try:
      params = jax.block_until_ready(  # (pull_s: the patches and copies done, not only dispatched)
          pull_weights(m, self.shardings, self.clients, base=self.held, stats=st, token=self.token)[0])
    except (ValueError, ConnectionError) as e:
      logging.warning("worker %s: pull of v%d failed (%s); retrying with the next manifest", self.wid, m["version"], e)
      return None
    self.held = (m, params)
    # delta_frac: bytes moved / bytes a full pull moves (1.0 for a full pull); fallbacks: bad delta payloads.
    self.stats.update(pull_bytes=st["bytes"], pull_s=time.time() - t, delta_frac=st["bytes"] / max(st["full_bytes"], 1),
                      pull_fallbacks=st["fallbacks"])
    logging.info("worker %s: pulled v%d: %s", self.wid, m["version"], {k: round(v, 4) for k, v in self.stats.items()})
    return params


# --- Evaluation ----------------------------------------------------------------------------------------------------

def run_eval():
  """pass@1 and pass@k of --checkpoint over --eval_n problems, --k samples each: the mean over problems and its
  standard error (the problems are the independent draws); --out also gets each problem's prompt and its count
  of correct samples (`correct`), for breakdowns by kind of problem."""
  tok = data.load_tokenizer(FLAGS.tokenizer)
  # The worker's mesh (tensor parallel over --tensor_parallel local devices), the checkpoint read straight into it.
  mesh = model.make_mesh(1, 1, FLAGS.tensor_parallel, devices=jax.local_devices())
  jax.set_mesh(mesh)
  cfg, params = model.load_hf_checkpoint(FLAGS.checkpoint, mesh=mesh)
  problems = data.eval_problems(FLAGS.eval_jsonl, FLAGS.eval_n, FLAGS.eval_task, FLAGS.eval_task_args)
  encode = data.prompt_encoder(tok, FLAGS.template, FLAGS.tokenizer)
  ctx = cfg.max_position_embeddings  # --max_new_tokens=0: what it leaves after the prompts (as the trainer)
  max_new = FLAGS.max_new_tokens or data.completion_budget([len(encode(p)) for p in problems], ctx)
  problems = data.fit_prompts(problems, encode, max_new, ctx)[0]
  sc = SamplingConfig(FLAGS.temperature, FLAGS.top_k, FLAGS.top_p, max_new, tuple(sorted(tok.stop_ids)))
  enc = {p.id: encode(p) for p in problems}
  n, by_id = FLAGS.k, {p.id: p for p in problems}
  engine = Engine(cfg, sc, slots=max(FLAGS.slots, n), max_prompt_len=max(map(len, enc.values())), seed=FLAGS.seed)
  engine.reset(jax.tree.leaves(params)[0].dtype)
  t0 = time.time()
  res = generate_groups(engine, params, list(enc.items()), n)
  comps = [tok.decode(c.tolist()) for pid in res for c in res[pid][0]]
  probs = [by_id[pid] for pid in res for _ in range(n)]
  with data.VerifierPool(0, strict_math=FLAGS.math_strict) as pool:  # inline: eval scores in this process
    correct = np.asarray(pool.score(probs, comps)).reshape(len(res), n) > 0.5
  out = data.pass_at_k_summary(correct)
  out.update(n_problems=len(res), n_samples=n, temperature=sc.temperature, seconds=time.time() - t0,
             examples=[(probs[i].prompt, comps[i]) for i in range(0, min(len(comps), 5 * n), n)],
             checkpoint=FLAGS.checkpoint, correct=[(by_id[pid].prompt, int(c)) for pid, c in zip(res, correct.sum(1))])
  print(json.dumps({k: v for k, v in out.items() if k not in ("examples", "correct")}))
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      json.dump(out, f, indent=1)


def main(argv):
  del argv
  common.tune_malloc()  # before the first JAX computation: XLA's step buffers reused, not page-faulted in every step
  if FLAGS.tokenizer is None:
    raise app.UsageError("--tokenizer is required")
  if FLAGS.mode == "worker":
    run_worker()
  elif FLAGS.mode == "verifier":
    run_verifier()
  elif FLAGS.checkpoint is None:
    raise app.UsageError("--mode=eval needs --checkpoint")
  else:
    run_eval()


if __name__ == "__main__":
  define_flags()
  app.run(main)
