"""rollout.py: the inference worker (pull weights, generate, score, send rollouts) and pass@k evaluation.

Design:
  * Generation is a jit-compiled KV-cache loop over a fixed number of *slots* (continuous batching): every
    `--chunk_steps` decode steps (one host sync per chunk, never per token) the host hands the groups of finished
    slots (stop token or max new tokens) to the sender and refills free slots with newly leased prompts, prefilled
    as one batch; a prompt with G samples is prefilled once and its cache row copied into G slots.
  * The decode loop never waits on I/O: the next weights download on a background thread (Puller; at most two
    versions held), and finished groups are scored, put and acked in order on another (Sender), each thread
    with its own server connection.  Sampling is inverse-CDF with one uniform per row (inverse_cdf_sample).
  * Behaviour log-probs are those of the distribution actually sampled from (logits / temperature, top-k / top-p
    truncation, renormalised, fp32): with temperature-only sampling (the default) exactly what the trainer
    recomputes (losses.token_logprobs_and_entropy(..., temperature)); with top-k/top-p the trainer's ratio
    includes the truncation and truncated IS corrects for it.
  * RNG is deterministic per prompt: sample j of prompt id p uses fold_in(fold_in(seed, hash(p)), j) and
    step t folds in t, so a re-issued prompt with the same weights reproduces the same tokens.
  * Weights are swapped between chunks once a newer version is fully downloaded; a rollout is tagged with the
    oldest version that produced any of its tokens (a conservative staleness bound) and regenerated before it is
    sent if that is more than --max_staleness versions behind the newest.
  * Preemption: SIGTERM stops leasing, finishes the groups in flight for at most --drain_s seconds, sends them,
    and hands the rest back with their partial rollouts (tokens so far, behaviour log-probs, each token's
    version; Client.release), which the server re-issues first.  The next worker prefills prompt + partial
    completion and decodes on with the same per-step keys, so no generated token is wasted (tagged with its
    oldest token's version; generated afresh if that is too stale).  kill -9 loses only leases, which expire
    on the server and are re-issued (the tokens in flight are lost).
  * A bad item never ends the worker: an exception while inserting, scoring or sending one prompt is reported
    to the server (Client.fail, with the reason), which re-issues it and quarantines it after its
    --max_failures reports; the worker goes on with the next (fail_item).

Run:
  worker (CPU, one TPU host): python rollout.py --server=127.0.0.1:5555 --token_file=runs/x/token \
      --tokenizer=runs/x/tokenizer.model
  eval:  python rollout.py --mode=eval --checkpoint=runs/x/base --tokenizer=runs/x/tokenizer.model \
      --eval_n=200 --k=8 --out=runs/x/eval_before.json
  On a pod launch.sh starts one worker per inference host (see launch.sh v5p-N --dry_run).
"""
import dataclasses
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

import common
import data

import model
import param_server


# ----------------------------------------------------------------------------------------------------------------
# Sampling


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


def _inv_temperature(sc: SamplingConfig):
  # Logits are scaled by 1/T as losses._logp_entropy_fwd does (XLA may or may not rewrite / T into this product).
  return 1.0 / (sc.temperature if sc.temperature > 0 else 1.0)


def sampling_logits(logits, sc: SamplingConfig):
  """[B,V] fp32 logits -> [B,V] the scaled logits we sample from (temperature; -inf outside top-k / top-p)."""
  x = logits.astype(jnp.float32) * _inv_temperature(sc)
  if sc.top_k:
    kth = jax.lax.top_k(x, sc.top_k)[0][:, -1:]
    x = jnp.where(x < kth, -jnp.inf, x)
  if sc.top_p < 1.0:
    # Keep the smallest prefix of the sorted distribution whose mass reaches top_p (the top token always stays).
    order = jnp.argsort(-x, axis=-1)
    sx = jnp.take_along_axis(x, order, -1)
    sp = jax.nn.softmax(sx, -1)
    keep_sorted = (jnp.cumsum(sp, -1) - sp) < sc.top_p
    keep = jnp.zeros_like(keep_sorted).at[jnp.arange(x.shape[0])[:, None], order].set(keep_sorted)
    x = jnp.where(keep, x, -jnp.inf)
  return x


def sampling_logprobs(logits, sc: SamplingConfig):
  """[B,V] fp32 logits -> [B,V] log-probs of the distribution we sample from (temperature, top-k, top-p)."""
  return jax.nn.log_softmax(sampling_logits(logits, sc), axis=-1)


def greedy(x):
  """jnp.argmax(x, -1) (the first maximal index of each row), as a max and a masked max of the negated index, which
  XLA CPU vectorises: its argmax is a variadic (value, index) reduce, run element by element (bench_decode's big
  shape: 4.6 ms of a 56 ms decode step at [64, 32k], against 0.7). fp32 holds the index exactly below 2^24; a row
  with a NaN (no entry equals its max) gives the last index."""
  V = x.shape[-1]
  first = -jnp.max(jnp.where(x == jnp.max(x, -1, keepdims=True), -jnp.arange(V, dtype=jnp.float32), -V), -1)
  return jnp.minimum(first.astype(jnp.int32), V - 1)


def _last_positive(p):
  """[..., n] -> index of the last entry > 0 (0 if none): where a sampled index is clamped after fp32 rounding."""
  return jnp.max(jnp.where(p > 0, jnp.arange(p.shape[-1]), 0), -1)


def inverse_cdf_sample(logp, keys, block: int = 128):
  """One draw per row of the categorical exp(logp) [B,V] (normalised or not: logp may be off by a per-row
  constant), with ONE uniform per row (keys [B,2]).
  Gumbel-max (jax.random.categorical) draws V random numbers per row: at V=32k, batch 64 that was 28% of a
  decode step on CPU (issue 17). Inverse-CDF needs one, and two levels (block sums of `block` tokens, then
  the running sum inside the chosen block) keep each running sum short, so fp32 rounding moves a token's
  interval by ~1e-7 x its block's mass, not x 1. A token of probability 0 (cut by top-k/top-p) is never drawn: its
  interval is empty, and an index pushed past the end by rounding is clamped to the last positive one."""
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
  """Returns (tokens [B] int32, behaviour log-probs [B] fp32): the log-prob of each drawn token under the
  distribution it was drawn from."""
  x = sampling_logits(logits, sc)
  # log_softmax's own steps (jax.nn.log_softmax: shifted - log(sum(exp(shifted)))), taken for the drawn token only:
  # the [B,V] log-probs are never written, and greedy takes the first max of x itself (what HF's argmax does; the
  # max is shared). One max, one exp and one index (greedy) or block-sum (inverse-CDF) pass over [B,V]: at
  # bench_decode's big shape ([64, 32k] logits) the log_softmax and the argmax of it took 2.7 of a 48 ms step.
  shifted = x - jnp.max(x, -1, keepdims=True)
  tok = greedy(x) if sc.temperature == 0 else inverse_cdf_sample(shifted, keys)  # exp(shifted): unnormalised p
  lse = jnp.log(jnp.sum(jnp.exp(shifted), -1))
  return tok.astype(jnp.int32), jnp.take_along_axis(shifted, tok[:, None], -1)[:, 0] - lse


def prompt_key(seed: int, prompt_id: str):
  return jax.random.fold_in(jax.random.PRNGKey(seed), zlib.crc32(prompt_id.encode()) & 0x7FFFFFFF)


def group_keys(seed: int, prompt_id: str, G: int):
  """[G,2] keys of a prompt's G samples: sample j folds j into the prompt's key."""
  return jax.vmap(lambda j: jax.random.fold_in(prompt_key(seed, prompt_id), j))(jnp.arange(G))


# ----------------------------------------------------------------------------------------------------------------
# Continuous-batching generation engine


class Engine:
  """Slots x KV cache generation.  Host API: insert(params, [(slots, prompt_tokens, keys), ...], version),
  resume() of continued samples, run_chunk(params, version), rows() of the finished slots."""

  def __init__(self, cfg, sc: SamplingConfig, slots: int, max_prompt_len: int, chunk_steps: int = 8,
               attn_impl="auto", prompt_buckets=data.BUCKETS[:-1]):  # 16..2048
    self.cfg, self.sc, self.B, self.chunk_steps = cfg, sc, slots, chunk_steps
    self.M, self.max_prompt_len = sc.max_new_tokens, max_prompt_len
    # Prefill lengths: prompts up to max_prompt_len (the same buckets as before partial rollouts, so a fresh
    # prompt's prefill shape is unchanged); a continued sample (resume) prefills prompt + its partial
    # completion, up to max_prompt_len + M.
    longest = max_prompt_len + self.M
    self.buckets = (tuple(b for b in prompt_buckets if b < max_prompt_len) + (max_prompt_len,)
                    + tuple(b for b in prompt_buckets if max_prompt_len < b < longest) + (longest,))
    # A finished slot keeps decoding until the next host sync, so leave chunk_steps of slack in the cache.
    self.S = max_prompt_len + self.M + chunk_steps
    self.attn_impl = attn_impl
    self.state = None
    # On XLA CPU every decode step copied each layer's weights out of the stacked [L,...] arrays (~7 ms of the 56 of
    # bench_decode's big shape, RESULTS.md); so there the engine decodes from a per-layer copy made once per weight
    # version (model.unstack_layers): one more copy of the weights in host memory while that version is in use.
    # XLA TPU reads the stacked slices inside the matmuls, so on TPU the engine uses the weights as given.
    self._unstack = jax.jit(model.unstack_layers) if jax.default_backend() == "cpu" else None
    self._weights_of = (None, None)  # (weights given, the per-layer copy)
    self._chunk = jax.jit(self._chunk_fn, donate_argnums=(1,))
    self._insert = jax.jit(self._insert_fn, donate_argnums=(1,))
    self._resume = jax.jit(self._resume_fn, donate_argnums=(0,))

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

  def _insert_fn(self, params, st, prompts, lengths, rows, slots, keys, version):
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
                keys=put(st["keys"], keys))

  def _resume_fn(self, st, slots, n_gen, tokens, logp, versions, active):
    # Continued samples: their completion so far (written after insert prefilled prompt + it), so decoding
    # goes on at step n_gen with the same per-step keys as one uninterrupted run.
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

    st, _ = jax.lax.scan(step, st, None, length=self.chunk_steps)
    return st

  def _weights(self, params):
    if self._unstack is None:
      return params
    if self._weights_of[0] is not params:  # a new version (or the first): one copy, reused until the next
      self._weights_of = (params, self._unstack(params))
    return self._weights_of[1]

  def bucket(self, n):
    for b in self.buckets:
      if n <= b:
        return b
    raise ValueError(f"prompt of {n} tokens exceeds max_prompt_len={self.buckets[-1]}")

  def insert(self, params, groups, version=0):
    """Prefills the prompts of groups = [(slots, prompt_tokens, keys [len(slots), 2]), ...] in one batch and
    starts their slots; `version` (the weights' policy version) tags the first token. The batch is padded to a
    power of two prompts and the longest prompt's bucket, so the compiled shapes stay few (log2(slots) x
    buckets)."""
    n = 1 << (len(groups) - 1).bit_length()
    T = self.bucket(max(len(p) for _, p, _ in groups))
    prompts, lengths = np.zeros((n, T), np.int32), np.ones(n, np.int32)
    rows, slots, keys = [], [], []
    for i, (sl, p, k) in enumerate(groups):
      prompts[i, :len(p)], lengths[i] = p, len(p)
      rows += [i] * len(sl)
      slots += list(sl)
      keys.append(np.asarray(k, np.uint32).reshape(len(sl), 2))
    m = 1 << (len(slots) - 1).bit_length()
    pad = m - len(slots)
    rows, slots = np.asarray(rows + [0] * pad, np.int32), np.asarray(slots + [self.B] * pad, np.int32)
    keys = np.concatenate(keys + [np.zeros((pad, 2), np.uint32)])
    self.state = self._insert(self._weights(params), self.state, jnp.asarray(prompts), jnp.asarray(lengths),
                              jnp.asarray(rows), jnp.asarray(slots), jnp.asarray(keys), np.int32(version))

  def resume(self, slots, tokens, logp, versions, done):
    """Continues samples another worker started (partial rollouts): call right after insert() prefilled each
    slot with prompt + tokens[i] (just the prompt where done[i]). Slot i then holds tokens[i], their behaviour
    log-probs logp[i] and versions versions[i], and decodes on from step len(tokens[i]) unless done[i]."""
    m = 1 << (len(slots) - 1).bit_length()
    n_gen, active = np.zeros(m, np.int32), np.zeros(m, bool)
    tok, lp, ver = np.zeros((m, self.M), np.int32), np.zeros((m, self.M), np.float32), np.zeros((m, self.M), np.int32)
    for i, (t, l, v, d) in enumerate(zip(tokens, logp, versions, done)):
      assert len(t) == len(l) == len(v) <= self.M and (d or len(t) < self.M), (len(t), len(l), len(v), d)
      n_gen[i], active[i], tok[i, :len(t)], lp[i, :len(t)], ver[i, :len(t)] = len(t), not d, t, l, v
    sl = np.asarray(list(slots) + [self.B] * (m - len(slots)), np.int32)
    self.state = self._resume(self.state, *map(jnp.asarray, (sl, n_gen, tok, lp, ver, active)))

  def run_chunk(self, params, version=0):
    self.state = self._chunk(self._weights(params), self.state, np.int32(version))
    # One host sync per chunk: which slots are still generating.
    return np.asarray(self.state["active"])

  def rows(self, slots):
    """Host copies of (tokens, logp, n_gen, versions) for the given slots; completions include the stop token."""
    s = jnp.asarray(slots, jnp.int32)
    return tuple(np.asarray(self.state[k][s]) for k in ("tokens", "logp", "n_gen", "versions"))


class Slots:
  """Continuous batching's bookkeeping, shared by generate_groups and the worker: which engine slots are free
  and which group (G slots, plus whatever the caller keeps with it) holds the others."""

  def __init__(self, n: int):
    self.free, self.groups = list(range(n)), {}  # groups: id -> dict(slots=[...], **info)

  def take(self, gid, G: int, **info):
    """G free slots for group gid (the caller checked len(free) >= G)."""
    assert len(self.free) >= G and gid not in self.groups, (len(self.free), G, gid)
    slots, self.free = self.free[:G], self.free[G:]
    self.groups[gid] = dict(info, slots=slots)
    return slots

  def release(self, gid):
    """Frees a group's slots; returns its record."""
    g = self.groups.pop(gid)
    self.free.extend(g["slots"])
    return g

  def finished(self, active):
    """Ids of the groups none of whose slots is still active (run_chunk's result)."""
    return [gid for gid, g in self.groups.items() if not active[g["slots"]].any()]


def generate_groups(engine, params, items, group_size, seed):
  """Runs `items` (list of (prompt_id, prompt_tokens)) through the engine, G samples each; continuous batching.
  Returns {prompt_id: (list of completion token arrays, list of logp arrays)}. Used by eval, tests and benches;
  the worker loop below interleaves the same steps with the server."""
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
      new.append((slots.take(pid, G), toks, group_keys(seed, pid, G)))
    if new:
      engine.insert(params, new)  # every prompt that fits, prefilled as one batch
    active = engine.run_chunk(params)
    for pid in slots.finished(active):
      toks, lps, n, _ = engine.rows(slots.release(pid)["slots"])
      out[pid] = ([toks[i, :n[i]] for i in range(G)], [lps[i, :n[i]] for i in range(G)])
  return out


# ----------------------------------------------------------------------------------------------------------------
# What keeps the decode loop busy: weights download and rollouts are scored and sent on background threads


class Sender:
  """Runs fn(job) for each submitted job, in order, on one background thread (the worker scores, puts and acks
  finished groups there). The queue is bounded: if sending falls `maxsize` groups behind, submit blocks (decoding
  waits). The first exception stops the sending and is re-raised on the loop's thread by check/submit/close()."""

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

def pull_weights(manifest, shardings, clients, base=None, stats=None):
  """The manifest's weights placed with `shardings` (a pytree of Shardings, same structure as the published
  tree): only the distinct slices this process's devices hold, reassembled on the host by
  param_server.pull_slices. clients: dict "host:port" -> Client, filled on demand. Returns (pytree of jax.Array,
  bytes pulled). base=(manifest, params) the reader holds now (what an earlier pull returned with the same
  shardings): each slice it holds comes as a delta against a host copy of it (see pull_slices, which also says
  what `stats` gets).
  """
  sh = param_server.flatten(shardings)
  if set(sh) != set(manifest["tensors"]):
    raise ValueError(f"manifest v{manifest['version']} tensors {sorted(manifest['tensors'])[:4]}... do not match "
                     f"the reader's {sorted(sh)[:4]}...")
  held = param_server.flatten(base[1]) if base is not None else {}
  wanted = {}  # name -> {distinct global slice: the local devices that hold it}
  for name, t in manifest["tensors"].items():
    for d, idx in sh[name].addressable_devices_indices_map(tuple(t["shape"])).items():
      wanted.setdefault(name, {}).setdefault(tuple(map(tuple, param_server.slice_index(idx, t["shape"]))), []).append(d)
  st, out = {}, {}
  for name, bufs in param_server.pull_slices(
      manifest, wanted, clients, base=base and base[0], stats=st,
      held=lambda name, slices: _held_slices(base, name, manifest["tensors"][name], held, slices)):
    out[name] = jax.make_array_from_single_device_arrays(
        tuple(manifest["tensors"][name]["shape"]), sh[name],
        [jax.device_put(bufs[w], d) for w, ds in wanted[name].items() for d in ds])
  if stats is not None:
    stats.update(st)
  return param_server.unflatten(out), st["bytes"]


def _held_slices(base, name, t, held, wanted):
  """{slice: writable host copy of the base's bytes for it} for the wanted slices a delta can apply to: the base
  holds the tensor with the same dtype and shape, and one of its local shards is exactly that slice."""
  if name not in held or name not in base[0]["tensors"]:
    return {}
  bt, x = base[0]["tensors"][name], held[name]
  if (bt["dtype"], bt["shape"]) != (t["dtype"], t["shape"]) or tuple(x.shape) != tuple(t["shape"]):
    return {}
  shards = {tuple(map(tuple, param_server.slice_index(s.index, x.shape))): s for s in x.addressable_shards}
  # A copy: a device array may alias host memory (CPU), and the pull must not change the weights in use.
  return {w: np.array(shards[w].data, copy=True) for w in wanted if w in shards}


class Puller:
  """Downloads the next weight version on a background thread while the loop decodes with the current one.
  Double-buffered: the version in use plus at most one newer, complete version waiting to be taken, so a worker
  holds at most two versions of its weight slices (the next pull starts only after take()). pull(manifest) ->
  params or None (version gone: the next manifest is tried). take() returns (manifest, params) once a newer
  version is complete, else None; the loop calls it between chunks, so a swap never waits for the network."""

  def __init__(self, client, pull, version: int, poll_s: float = 1.0):
    self.client, self.pull, self.version, self.poll_s = client, pull, version, poll_s
    self.ready, self.error, self.closed = None, None, False
    self.taken = threading.Event()
    self.taken.set()
    self.thread = threading.Thread(target=self._run, daemon=True, name="puller")
    self.thread.start()

  def _run(self):
    try:
      while not self.closed:
        if not self.taken.wait(self.poll_s):
          continue  # the last version is not taken yet: a third copy would not fit the memory plan
        m = self.client.manifest(newer_than=self.version, wait_s=self.poll_s)  # long poll
        if m is None or self.closed:
          continue
        new = self.pull(m)
        if new is not None:
          self.version = m["version"]
          self.taken.clear()
          self.ready = (m, new)
    except BaseException as e:  # noqa: BLE001  (raised on the loop's thread by take())
      self.error = e

  def take(self):
    if self.error is not None:
      raise self.error
    r, self.ready = self.ready, None
    if r is not None:
      self.taken.set()
    return r

  def close(self):
    self.closed = True
    self.taken.set()
    self.thread.join(timeout=10 * self.poll_s)  # a pull in progress is abandoned (daemon thread)


class Window:
  """Rates of a worker's running totals over the last span_s seconds: add(decode_s=...) then rates() ->
  {name: total gained per second over the window}, e.g. decode seconds per second = busy fraction."""

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
    if not self.marks:
      return {}
    t0, c0 = self.marks[0]
    dt = max(time.time() - t0, 1e-9)
    return {k: (v - c0.get(k, 0.0)) / dt for k, v in self.totals.items()}


# ----------------------------------------------------------------------------------------------------------------
# Evaluation


def pass_at_k(n: int, c: int, k: int) -> float:
  """Unbiased pass@k estimator (Chen et al. 2021, "Evaluating LLMs trained on code"): 1 - C(n-c,k)/C(n,k)."""
  if n < k:
    raise ValueError(f"pass@{k} needs n >= k samples, got n={n}")
  if n - c < k:
    return 1.0
  return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def evaluate(cfg, params, tok, problems, *, n_samples, ks, sc, slots, seed, template="plain", pool=None,
             chat_template=None):
  """pass@k for each k in ks over problems, n_samples samples each. Returns a dict of metrics."""
  enc = {p.id: tok.encode(data.render_prompt(p, template, chat_template=chat_template), add_bos=True)
         for p in problems}
  engine = Engine(cfg, sc, slots=max(slots, n_samples), max_prompt_len=max(map(len, enc.values())))
  engine.reset(jax.tree.leaves(params)[0].dtype)
  t0 = time.time()
  res = generate_groups(engine, params, list(enc.items()), n_samples, seed)
  by_id = {p.id: p for p in problems}
  pids = list(res)
  comps = [tok.decode(c.tolist()) for pid in pids for c in res[pid][0]]
  probs = [by_id[pid] for pid in pids for _ in range(n_samples)]
  scores = pool.score(probs, comps) if pool else [data.verify(p, c) for p, c in zip(probs, comps)]
  correct = np.asarray(scores).reshape(len(pids), n_samples) > 0.5
  out = {}
  for k in ks:  # the mean over problems and its standard error (the problems are the independent draws)
    per = np.asarray([pass_at_k(n_samples, int(c.sum()), k) for c in correct])
    out[f"pass@{k}"] = float(per.mean())
    out[f"pass@{k}_se"] = float(per.std(ddof=1) / np.sqrt(len(per))) if len(per) > 1 else 0.0
  out.update(n_problems=len(pids), n_samples=n_samples, temperature=sc.temperature, seconds=time.time() - t0,
             examples=[(probs[i].prompt, comps[i]) for i in range(0, min(len(comps), 5 * n_samples), n_samples)])
  return out


# ----------------------------------------------------------------------------------------------------------------
# The worker: absl entry point

from absl import app, flags, logging  # noqa: E402  (flags only in the entry point, below the library part)

FLAGS = flags.FLAGS

def define_flags():
  """Called only by main(): importing this file defines no flag (see common)."""
  common.define_shared_flags(max_new_tokens=16)
  flags.adopt_module_key_flags(common)
  flags.DEFINE_enum("mode", "worker", ["worker", "eval"], "worker: serve the RL run; eval: pass@k of --checkpoint. "
                    "Default worker.")
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
  flags.DEFINE_float("drain_s", 10.0, "On SIGTERM, seconds spent finishing in-flight groups. Default 10.")
  flags.DEFINE_integer("verifier_workers", 2, "Verifier process-pool size. Default 2.")
  flags.DEFINE_float("verifier_timeout_s", 10.0, "Per-completion verifier timeout in seconds. Default 10.")
  flags.DEFINE_integer("max_failures_in_a_row", 8, "Prompts that may fail (reported to the server) in a row before "
                       "the worker treats itself as broken and exits (count). Default 8.")
  # Eval mode.
  flags.DEFINE_string("eval_task", "arithmetic", "Built-in task for eval (ignored with --eval_jsonl). Default arithmetic.")
  flags.DEFINE_string("eval_task_args", "", "The built-in eval task's own options, name=value,... e.g. "
                      "difficulty=2,ops=+ (as train.py --task_args). Default empty: the task's defaults.")
  flags.DEFINE_string("eval_jsonl", None, "Held-out jsonl prompts instead of a built-in task. Default none.")
  flags.DEFINE_integer("eval_n", 200, "Number of held-out problems. Default 200.")
  flags.DEFINE_integer("k", 8, "Samples per problem; reports pass@1 and pass@k. Default 8.")
  flags.DEFINE_string("out", None, "Write eval metrics as JSON here. Default none.")
  # Bad values fail at flag parsing, before any work starts (issue 15), with the flag and its value named.
  at_least = lambda n: (lambda v: v >= n)  # noqa: E731
  positive = lambda v: math.isfinite(v) and v > 0  # noqa: E731
  for name, ok, rule in (
      ("slots", at_least(1), ">= 1"), ("chunk_steps", at_least(1), ">= 1"), ("max_prompt_len", at_least(1), ">= 1"),
      ("verifier_workers", at_least(0), ">= 0 (0 = inline)"),
      ("eval_n", at_least(1), ">= 1"), ("k", at_least(1), ">= 1"),
      ("temperature", lambda v: math.isfinite(v) and v >= 0, "finite and >= 0 (0 = greedy)"),
      ("lease_s", positive, "finite and > 0"),
      ("drain_s", lambda v: math.isfinite(v) and v >= 0, "finite and >= 0"),
      ("verifier_timeout_s", positive, "finite and > 0")):
    flags.register_validator(name, ok, message=f"--{name} must be {rule}")
  flags.register_multi_flags_validator(["eval_task", "eval_task_args", "eval_jsonl"], check_eval_task_flags, message="")


def check_eval_task_flags(f):
  """--eval_task_args must suit --eval_task (unless --eval_jsonl replaces it): refused at parse time."""
  if not f["eval_jsonl"] and (err := data.task_args_error(f["eval_task"], f["eval_task_args"])):
    raise flags.ValidationError(err)
  return True


def _client(token):
  host, port = FLAGS.server.rsplit(":", 1)
  return param_server.Client(host, int(port), token=token, retries=FLAGS.server_retries)


def partial_of(fields, G, M, vocab):
  """The partial rollout a preempted worker handed back (`fields`: a PromptItem's `partial`, or its wire dict:
  per sample its tokens so far, their behaviour log-probs and policy versions, and whether it had finished) as
  four lists of G, checked; a ValueError names the field and sample. None if it carries none."""
  if not fields or not any(k in fields for k in data.PARTIAL_FIELDS):
    return None
  out = [fields.get(k) for k in data.PARTIAL_FIELDS]
  for k, v in zip(data.PARTIAL_FIELDS, out):
    if not isinstance(v, list) or len(v) != G:
      raise ValueError(f"{k} must be a list of group_size={G} entries, got {type(v).__name__} "
                       f"of {len(v) if isinstance(v, list) else '-'}")
  checked = ([], [], [], [])  # tokens, log-probs, versions, done
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


def fail_item(client, gid, exc, failures):
  """Reports a prompt this worker could not process (the server re-issues it to the tail of the queue and
  quarantines it after its --max_failures reports, telling the trainer); the worker moves on. Errors that are
  not the item's fault (server unreachable, wrong token, server disk full) propagate and end the worker, and
  so do failures of every item in a row (a broken worker must not quarantine the whole dataset)."""
  if isinstance(exc, (ConnectionError, PermissionError, param_server.StorageError, param_server.QueueFullError)):
    raise exc
  failures.append(gid)
  if len(failures) > FLAGS.max_failures_in_a_row:
    raise RuntimeError(f"{len(failures)} items failed in a row (last {gid!r}): the worker itself is broken") from exc
  reason = f"{type(exc).__name__}: {exc}"[:1000]
  logging.warning("prompt %s failed on this worker (%s); reported to the server", gid, reason)
  client.fail("prompts", [gid], reason)


def run_worker():
  stop = param_server.StopFlag()
  wid = FLAGS.worker_id or f"{os.uname().nodename}-{os.getpid()}"
  token = open(FLAGS.token_file).read().strip() if FLAGS.token_file else None
  client = _client(token)
  tok = data.load_tokenizer(FLAGS.tokenizer)
  pool = data.VerifierPool(FLAGS.verifier_workers, timeout_s=FLAGS.verifier_timeout_s, strict_math=FLAGS.math_strict)

  # Wait for the first published weights; the trainer publishes version >= 0 at startup.
  logging.info("worker %s waiting for weights", wid)
  manifest = None
  while manifest is None and not stop.requested:
    manifest = client.manifest(newer_than=-1, wait_s=5.0)
  if manifest is None:
    return
  cfg = model.Config.from_hf_dict(manifest["config"])
  s = manifest["sampling"]
  sc = SamplingConfig(s["temperature"], s["top_k"], s["top_p"], s["max_new_tokens"], tuple(sorted(tok.stop_ids)))
  mesh = model.make_mesh(1, 1, FLAGS.tensor_parallel, devices=jax.local_devices())
  jax.set_mesh(mesh)
  shardings, shard_clients = model.param_shardings(cfg, mesh), {}

  held = None  # (manifest, params) this worker holds: the base its next pull asks deltas against
  last_pull = {}  # the newest pull's figures, sent with every rollout (the trainer logs them in metrics.jsonl)

  def pull(m):
    """The manifest's weights, only the slices this worker's devices hold (pull_weights), as deltas against the
    version it holds (each piece's result crc-checked, a mismatch pulled in full); None if they were
    garbage-collected meanwhile (a newer version exists: the next poll gets it) or a shard server is down (the
    trainer re-publishes to its replacement)."""
    nonlocal held
    t, st = time.time(), {}
    try:
      params = pull_weights(m, shardings, shard_clients, base=held, stats=st)[0]
    except (ValueError, ConnectionError) as e:
      logging.warning("worker %s: pull of v%d failed (%s); retrying with the next manifest", wid, m["version"], e)
      return None
    held = (m, params)
    # delta_frac: bytes moved / bytes a full pull moves (1.0 for a full pull); fallbacks: result crc mismatches.
    last_pull.update(pull_bytes=st["bytes"], pull_s=time.time() - t, delta_frac=st["bytes"] / max(st["full_bytes"], 1),
                     pull_fallbacks=st["fallbacks"])
    logging.info("worker %s: pulled v%d: %s", wid, m["version"], {k: round(v, 4) for k, v in last_pull.items()})
    return params

  params = None
  while params is None and not stop.requested:
    params = pull(manifest)
    if params is None:
      manifest = client.manifest(newer_than=-1, wait_s=1.0) or manifest
  if params is None:
    return
  version = manifest["version"]
  logging.info("worker %s: v%d, sampling %s, mesh %s", wid, version, sc, dict(mesh.shape))
  # The KV cache is sized from the data: the trainer sends its longest kept prompt with the sampling settings.
  engine = Engine(cfg, sc, FLAGS.slots, int(s.get("max_prompt_len") or FLAGS.max_prompt_len), FLAGS.chunk_steps,
                  FLAGS.attn_impl)
  engine.reset(jax.tree.leaves(params)[0].dtype)
  slots = Slots(FLAGS.slots)  # item id -> dict(item, slots, t0, resumed)
  groups = slots.groups
  group_size = 1  # learnt from the first prompt item
  sent = dict(groups=0, tokens=0)
  t_start = time.time()
  drain_deadline = None
  failed = []  # ids of the items that failed since the last success (reset by a success)
  # The puller and the sender each have their own connection: a long poll or a slow put never holds up another.
  puller = Puller(_client(token), pull, version)
  window = Window()  # this worker's busy fraction and rates, sent with every rollout

  def send(job):
    """Sender thread: score one finished group, put its rollout, then ack its prompt."""
    it, gid = job["item"], job["id"]
    try:  # scoring and sending one item: a bad item is reported and skipped, never the end of the worker
      comps = job["completions"]
      rewards = pool.score([it.problem] * len(comps), [tok.decode(c.tolist()) for c in comps])
      rollout = data.Rollout(gid, int(job["version"]), wid, it.problem, it.prompt_tokens, comps, job["logprobs"],
                             np.asarray(rewards, np.float32), job["gen_s"], job["stats"])
      send_client.put("rollouts", [rollout.to_wire()])
    except Exception as e:
      return fail_item(send_client, gid, e, failed)
    failed.clear()
    # Ack the prompt only after its rollout is safely queued: a crash in between re-issues the prompt, and
    # the server drops the duplicate rollout by id.
    send_client.ack("prompts", [gid])
    sent["groups"] += 1
    sent["tokens"] += int(sum(len(c) for c in comps))
    if sent["groups"] % 20 == 0:
      logging.info("worker %s v%d: %d groups sent, %.1f tok/s", wid, version, sent["groups"],
                   sent["tokens"] / (time.time() - t_start))

  send_client = _client(token)
  sender = Sender(send, maxsize=max(FLAGS.slots, 1))

  def start(items):
    """Prefills the items' (data.PromptItem) prompts as one batch into free slots. An item whose prompt cannot
    run (not token ids of this vocab, longer than the cache) fails alone (reported); the others start."""
    batch = []
    for item in items:
      if item.id in groups:  # its lease expired while we generate it and came back to us: keep the one running
        logging.warning("prompt %s leased again while in flight here; not started twice", item.id)
        continue
      try:
        p = item.prompt_tokens
        if not 1 <= len(p) <= engine.max_prompt_len:  # the trainer skips such prompts at load
          raise ValueError(f"prompt {item.problem.id!r} of {p.size} tokens exceeds max_prompt_len="
                           f"{engine.max_prompt_len} (or is empty)")
        if p.min() < 0 or p.max() >= cfg.vocab_size:
          raise ValueError(f"prompt {item.problem.id!r}: prompt_tokens are not token ids in [0, {cfg.vocab_size})")
      except Exception as e:  # this item fails (reported, re-issued, quarantined after --max_failures)
        fail_item(client, item.id, e, failed)
        continue
      G = item.group_size
      try:  # a partial rollout from a preempted worker: continued, unless unusable or too stale to train on
        part = partial_of(item.partial, G, engine.M, cfg.vocab_size)
        if part and version - min(int(v.min()) for v in part[2] if len(v)) > FLAGS.max_staleness:
          raise ValueError(f"its oldest token is more than --max_staleness={FLAGS.max_staleness} versions "
                           f"behind v{version}")
      except ValueError as e:  # the prompt itself is fine: generate it afresh (nothing is lost but the tokens)
        logging.warning("prompt %s: partial rollout not continued (%s); generating it afresh", item.id, e)
        part = None
      batch.append((item, slots.take(item.id, G), p, part))
    if not batch:
      return
    rows, resume = [], [[] for _ in range(5)]  # prefill rows; continued slots, their tokens, logp, versions, done
    for it, sl, p, part in batch:
      keys = group_keys(FLAGS.seed, it.id, len(sl))
      if part is None:
        rows.append((sl, p, keys))  # one prefill row for the whole group
        continue
      for i, s in enumerate(sl):  # each continued sample prefills prompt + its own completion so far
        rows.append(([s], p if part[3][i] else np.concatenate([p, part[0][i]]), keys[i:i + 1]))
      for lst, x in zip(resume, (sl,) + part):
        lst.extend(x)
    try:
      engine.insert(params, rows, version)
      if resume[0]:
        engine.resume(*resume)
    except Exception as e:  # not an item's fault as far as we could check: report each, the worker goes on
      for it, _, _, _ in batch:
        slots.release(it.id)
        fail_item(client, it.id, e, failed)
      return
    for it, _, _, part in batch:
      groups[it.id].update(item=it, t0=time.time(), resumed=sum(len(t) for t in part[0]) if part else 0)

  try:
    while True:
      if stop.requested and drain_deadline is None:
        drain_deadline = time.time() + FLAGS.drain_s
        logging.info("worker %s: SIGTERM, draining %d groups", wid, len(groups))
      if drain_deadline is not None and (not groups or time.time() > drain_deadline):
        break
      new = puller.take()  # in-flight groups keep their (older) tag
      if new:
        version, params = new[0]["version"], new[1]
      if drain_deadline is None and len(slots.free) >= group_size:
        # Lease only what fits now (group_size: the last group's G), so no prompt waits in a busy worker.
        t = time.time()
        items = client.get("prompts", max_items=len(slots.free) // group_size, wait_s=0.0 if groups else 1.0,
                           lease_s=FLAGS.lease_s)
        if not groups:  # idle: nothing to decode while the lease call waits
          window.add(wait_prompts_s=time.time() - t)
        fits, room = [], len(slots.free)
        for raw in items:
          try:
            item = data.PromptItem.from_wire(raw)
          except ValueError as e:  # a malformed item fails alone (reported; quarantined after --max_failures)
            fail_item(client, raw["id"], e, failed)
            continue
          group_size = item.group_size
          if group_size > FLAGS.slots:  # this worker's configuration, not the item: fail loudly
            raise ValueError(f"group_size={group_size} > --slots={FLAGS.slots}")
          if group_size <= room:
            fits.append(item)
            room -= group_size
          else:  # not enough room now: hand it straight back so another worker can take it
            client.requeue("prompts", [item.id])
        start(fits)
      sender.check()
      if not groups:
        continue
      t = time.time()
      active = engine.run_chunk(params, version)
      window.add(decode_s=time.time() - t)
      done = slots.finished(active)
      if not done:
        continue
      latest, stale = client.latest_version(), []
      for gid in done:
        g = slots.release(gid)
        toks, lps, n, vers = engine.rows(g["slots"])
        # Tagged with the oldest version that produced any token: the engine keeps each token's version, the
        # carried ones of a continued group included (they may predate this worker).
        tag = min((int(vers[i, :n[i]].min()) for i in range(len(n)) if n[i]), default=version)
        if latest - tag > FLAGS.max_staleness and drain_deadline is None:
          # Too stale for the trainer: regenerated below with the newest weights, from scratch.
          stale.append(dataclasses.replace(g["item"], partial=None))
          continue
        # Rates over the last 30 s: decode busy fraction, generated tokens/s, the fraction of time spent
        # waiting for prompts (nothing to decode) or for the sender (scoring fell a queue behind).
        window.add(tokens=float(n.sum()))
        r = window.rates()
        stats = dict(last_pull, worker_busy_frac=r.get("decode_s", 0.0), worker_tok_s=r.get("tokens", 0.0),
                     worker_wait_prompts_frac=r.get("wait_prompts_s", 0.0),
                     worker_wait_send_frac=r.get("wait_send_s", 0.0),
                     resumed_tokens=g["resumed"])  # generated by a preempted worker, continued here
        t = time.time()
        sender.submit(dict(id=gid, item=g["item"], version=tag, gen_s=time.time() - g["t0"], stats=stats,
                           completions=[toks[i, :n[i]].astype(np.int32) for i in range(len(g["slots"]))],
                           logprobs=[lps[i, :n[i]].astype(np.float32) for i in range(len(g["slots"]))]))
        window.add(wait_send_s=time.time() - t)
      start(stale)  # one batched prefill for all of them
  except BaseException:
    puller.close()
    raise
  puller.close()
  sender.close()  # everything finished is scored and sent before the prompts in flight are handed back
  hand_back(client, engine, groups)
  logging.info("worker %s stopped after %d groups", wid, sent["groups"])


def hand_back(client, engine, groups):
  """Returns the unfinished prompts so they are re-issued now rather than after their lease expires, each with
  its partial rollout (tokens so far, behaviour log-probs, versions, done; data.PARTIAL_FIELDS) when it has one:
  the next worker continues it instead of generating those tokens again (slime / AReaL partial rollouts)."""
  partial, plain, saved = [], [], 0
  for gid, g in groups.items():
    toks, lps, n, vers = engine.rows(g["slots"])
    if not n.any():  # preempted before its first chunk: nothing to keep
      plain.append(gid)
      continue
    stop_ids = engine.sc.stop_ids
    done = [bool(n[i] == engine.M or (n[i] and int(toks[i, n[i] - 1]) in stop_ids)) for i in range(len(n))]
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


def run_eval():
  tok = data.load_tokenizer(FLAGS.tokenizer)
  cfg, params = model.load_hf_checkpoint(FLAGS.checkpoint)
  if FLAGS.eval_jsonl:
    problems = data.load_jsonl(FLAGS.eval_jsonl)[:FLAGS.eval_n]
  else:
    problems = data.make_task_problems(FLAGS.eval_task, FLAGS.eval_n, seed=1234, split="eval",
                                       **data.parse_task_args(FLAGS.eval_task_args))
  sc = SamplingConfig(FLAGS.temperature, FLAGS.top_k, FLAGS.top_p, FLAGS.max_new_tokens, tuple(sorted(tok.stop_ids)))
  chat = data.load_chat_template(FLAGS.tokenizer) if FLAGS.template == "hf" else None
  with data.VerifierPool(0, strict_math=FLAGS.math_strict) as pool:  # inline: eval scores in this process
    res = evaluate(cfg, params, tok, problems, n_samples=FLAGS.k, ks=sorted({1, FLAGS.k}), sc=sc,
                   slots=FLAGS.slots, seed=FLAGS.seed, template=FLAGS.template, pool=pool, chat_template=chat)
  res["checkpoint"] = FLAGS.checkpoint
  print(json.dumps({k: v for k, v in res.items() if k != "examples"}))
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      json.dump(res, f, indent=1)


def main(argv):
  del argv
  common.tune_malloc()  # before the first JAX computation: XLA's step buffers reused, not page-faulted in every step
  if FLAGS.tokenizer is None:
    raise app.UsageError("--tokenizer is required")
  if FLAGS.mode == "eval":
    if FLAGS.checkpoint is None:
      raise app.UsageError("--mode=eval needs --checkpoint")
    run_eval()
  else:
    run_worker()


if __name__ == "__main__":
  define_flags()
  app.run(main)
