"""RL losses for LLM policies: token log-probs, advantages, policy losses, KL, entropy, aggregation, off-policy fixes.

Pure functions of arrays plus one frozen `LossConfig`; no flags, no state. Shapes (legend as in model.py):
B sequences, T tokens, V vocab, D model dim, P prompts, G samples per prompt (B = P * G).

Design choices
- Log-probs are fp32 (fp64 if the input is fp64) whatever the logits dtype, and of the distribution actually
  sampled from: logits are divided by the sampling temperature before the log-softmax.
- `token_logprobs_and_entropy` is a custom VJP that saves only [B,T] statistics and recomputes the softmax in the
  backward: one fp32 [B,T,V] buffer of gradient temporaries, against two (logp) or three (+ entropy) for
  log_softmax autodiff. `chunked_token_logprobs` never forms the full [B,T,V] logits (`python -m bench.logprobs`).
- Every per-token quantity is masked with `jnp.where` first, so padding (any value, even inf/nan) has zero effect
  and zero gradient.
- A policy-loss family (`ppo`, `gspo`, `cispo`, `reinforce`) maps per-token arrays to a per-token loss;
  `policy_loss` adds the shared pieces once (masking, off-policy correction, KL, entropy, one `aggregate`,
  metrics). An algorithm is a `LossConfig` in `ALGORITHMS` naming its family.
"""
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp


ADVANTAGE_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce")
AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")
KL_ESTIMATORS = ("k1", "k2", "k3")
sg = jax.lax.stop_gradient  # the papers' sg(.)


def _compute_dtype(dtype):
  # At least fp32: bf16 logits are upcast, fp64 (tests) stays fp64.
  return jnp.promote_types(dtype, jnp.float32)


# ------------------------------------------------------------------------------------ Token log-probs and entropy

@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _logp_entropy(logits, targets, temperature, with_entropy):
  return _logp_entropy_fwd(logits, targets, temperature, with_entropy)[0]


def _logp_entropy_fwd(logits, targets, temperature, with_entropy):
  dt = _compute_dtype(logits.dtype)
  # Times 1/T, not / T: XLA rewrites a division by a constant into this product in some graphs and not in others.
  s = logits.astype(dt) * (1.0 / temperature)
  m = jnp.max(s, axis=-1)
  e = jnp.exp(s - m[..., None])
  z = jnp.sum(e, axis=-1)
  lse = m + jnp.log(z)
  # Gather from the raw logits, then upcast: [B,T] work instead of [B,T,V].
  tgt = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0].astype(dt) * (1.0 / temperature)
  es = None
  if with_entropy:  # E_p[s]; where() keeps -inf logits from giving 0 * -inf
    es = jnp.sum(jnp.where(e > 0, e * s, 0), axis=-1) / z
  ent = lse - es if with_entropy else jnp.zeros_like(lse)
  return (tgt - lse, ent), (logits, targets, lse, es)


def _logp_entropy_bwd(temperature, with_entropy, res, g):
  logits, targets, lse, es = res
  g_logp, g_ent = g
  dt = _compute_dtype(logits.dtype)
  s = logits.astype(dt) / temperature
  p = jnp.exp(s - lse[..., None])  # recomputed, not saved: the point of the custom VJP
  onehot = jnp.arange(logits.shape[-1]) == targets[..., None]
  ds = g_logp[..., None] * (onehot - p)  # d logp / ds = onehot - p
  if with_entropy:  # d H / ds = -p (s - E_p[s])
    ds = ds - g_ent[..., None] * jnp.where(p > 0, p * (s - es[..., None]), 0)
  return (ds / temperature).astype(logits.dtype), None


_logp_entropy.defvjp(_logp_entropy_fwd, _logp_entropy_bwd)


def _check_logits(logits, targets, temperature):
  if logits.ndim < 2 or targets.shape != logits.shape[:-1]:
    raise ValueError(f"token_logprobs: logits {logits.shape} must be [..., V] with targets {targets.shape} = [...]")
  if not jnp.issubdtype(targets.dtype, jnp.integer):
    raise ValueError(f"token_logprobs: targets must be integer token ids, got dtype {targets.dtype}")
  if not isinstance(temperature, (int, float)) or not temperature > 0:
    raise ValueError(f"token_logprobs: temperature must be a Python number > 0, got {temperature!r}")


def token_logprobs_and_entropy(logits, targets, temperature=1.0):
  """log pi(target) and entropy H(pi) per position, pi = softmax(logits / temperature), in fp32.

  logp_t = s_t[y_t] - logsumexp(s_t),  H_t = logsumexp(s_t) - sum_v p_tv s_tv,  s = logits / temperature.
  Gradients flow to logits through both outputs; the backward writes dlogits in logits.dtype."""
  _check_logits(logits, targets, temperature)
  return _logp_entropy(logits, targets, float(temperature), True)


def token_logprobs(logits, targets, temperature=1.0):
  """log softmax(logits / temperature)[targets], fp32, [B,T]: token_logprobs_and_entropy without the entropy."""
  _check_logits(logits, targets, temperature)
  return _logp_entropy(logits, targets, float(temperature), False)[0]


def chunked_token_logprobs(hidden, unembed, targets, chunk, temperature=1.0):
  """(logp, entropy) [B,T] from final hidden states, with peak logits memory [B,chunk,V] instead of [B,T,V].
  unembed: a [D,V] matrix or a function [B,C,D] -> [B,C,V] (e.g. final norm + tied embedding). T is padded to a
  multiple of `chunk` and scanned; each chunk is rematerialised in the backward (jax.checkpoint)."""
  B, T, D = hidden.shape
  if targets.shape != (B, T):
    raise ValueError(f"chunked_token_logprobs: targets {targets.shape} must be [B,T] = {(B, T)}")
  if not isinstance(chunk, int) or chunk <= 0:
    raise ValueError(f"chunked_token_logprobs: chunk must be a positive int, got {chunk!r}")
  project = unembed if callable(unembed) else lambda h: jnp.einsum("bcd,dv->bcv", h, unembed)
  pad = (-T) % chunk
  n = (T + pad) // chunk
  h = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))).reshape(B, n, chunk, D).swapaxes(0, 1)  # [n,B,C,D]
  tg = jnp.pad(targets, ((0, 0), (0, pad))).reshape(B, n, chunk).swapaxes(0, 1)  # [n,B,C]

  @jax.checkpoint  # keep only the chunk inputs; recompute the [B,C,V] logits in the backward
  def one(hc, tc):
    return token_logprobs_and_entropy(project(hc), tc, temperature)

  lp, ent = jax.lax.map(lambda xs: one(*xs), (h, tg))
  unchunk = lambda x: x.swapaxes(0, 1).reshape(B, T + pad)[:, :T]
  return unchunk(lp), unchunk(ent)


# -------------------------------------------------- Advantage estimators (outcome rewards, one scalar per sample)

def compute_advantages(estimator, rewards, *, lengths=None, std_normalize=True, group_baseline=True, eps=1e-6):
  """Per-sample advantages [P,G] from outcome rewards [P,G] (row p holds the G samples of prompt p).

  grpo          A = (r - mean_g r) / (std_g r + eps); std is the sample std (ddof=1, as torch.std in TRL/verl);
                std_normalize=False drops the division. Shao et al. 2024, DeepSeekMath, arXiv 2402.03300.
  dr_grpo       A = r - mean_g r (no std; the length normaliser is removed by agg="seq_mean_token_sum").
                Liu et al. 2025, "Understanding R1-Zero-Like Training" (Dr. GRPO), arXiv 2503.20783.
  rloo          A_i = r_i - mean_{j != i} r_j = G/(G-1) (r_i - mean_g r). Kool et al. 2019 "Buy 4 REINFORCE
                samples, get a baseline for free!"; Ahmadian et al. 2024 "Back to Basics", arXiv 2402.14740.
  reinforce_pp  global batch normalisation: A~ = r - mean_g r if group_baseline (REINFORCE++-baseline) else r;
                A = (A~ - mean_batch A~) / (std_batch A~ + eps) over all P*G samples, token-weighted by `lengths`
                when given (the paper whitens over all tokens). Hu 2025, REINFORCE++, arXiv 2501.03262.
  reinforce     A = r (no baseline). Williams 1992.
  PPO with a value head uses `gae` instead (token-level, needs values).
  """
  if estimator not in ADVANTAGE_ESTIMATORS:
    hint = " (PPO with a value head: use losses.gae)" if estimator == "gae" else ""
    raise ValueError(f"compute_advantages: estimator {estimator!r} not in {ADVANTAGE_ESTIMATORS}{hint}")
  r = jnp.asarray(rewards)
  if r.ndim != 2:
    raise ValueError(f"compute_advantages: rewards must be [P,G] (prompts x samples), got shape {r.shape}")
  r = r.astype(_compute_dtype(r.dtype))
  G = r.shape[1]
  if estimator in ("grpo", "dr_grpo", "rloo") and G < 2:
    raise ValueError(f"compute_advantages: {estimator} needs G >= 2 samples per prompt, got rewards {r.shape}")
  mean = jnp.mean(r, axis=1, keepdims=True)
  if estimator == "reinforce":
    return r
  if estimator == "dr_grpo" or (estimator == "grpo" and not std_normalize):
    return r - mean
  if estimator == "grpo":
    return (r - mean) / (jnp.std(r, axis=1, ddof=1, keepdims=True) + eps)
  if estimator == "rloo":
    return (r - mean) * (G / (G - 1))
  # reinforce_pp
  a = r - mean if group_baseline else r
  w = jnp.ones_like(a) if lengths is None else jnp.asarray(lengths, a.dtype).reshape(a.shape)
  wsum = jnp.maximum(jnp.sum(w), 1e-12)
  mu = jnp.sum(w * a) / wsum
  std = jnp.sqrt(jnp.sum(w * (a - mu) ** 2) / wsum)
  return (a - mu) / (std + eps)


def gae(rewards, values, mask, gamma=1.0, lam=1.0):
  """Generalised advantage estimation over tokens. Schulman et al. 2016, arXiv 1506.02438.

  delta_t = r_t + gamma V_{t+1} - V_t,  A_t = delta_t + gamma lam A_{t+1},  returns_t = A_t + V_t,
  where "t+1" is the next *valid* token: masked positions are skipped (they carry V and A through unchanged, as in
  verl), so both right padding and masked spans inside a sequence work. values [B,T+1] gives a bootstrap value
  V_T for sequences cut off at T; values [B,T] means the episode ends after the last token (V = 0 beyond).
  Outputs are zero at masked positions.
  """
  B, T = rewards.shape
  if mask.shape != (B, T) or values.shape not in ((B, T), (B, T + 1)):
    raise ValueError(f"gae: rewards {rewards.shape}, mask {mask.shape} must be [B,T]; values {values.shape} "
                     f"must be [B,T] or [B,T+1]")
  dt = _compute_dtype(rewards.dtype)
  m = mask.astype(bool)
  r = jnp.where(m, rewards, 0).astype(dt)
  v = values.astype(dt)
  v_last = v[:, T] if v.shape[1] == T + 1 else jnp.zeros((B,), dt)
  v = v[:, :T]

  def step(carry, xs):
    next_v, next_a = carry
    r_t, v_t, m_t = xs
    a_t = r_t + gamma * next_v - v_t + gamma * lam * next_a
    # A masked token is transparent: the recursion skips it.
    return (jnp.where(m_t, v_t, next_v), jnp.where(m_t, a_t, next_a)), jnp.where(m_t, a_t, 0)

  _, adv = jax.lax.scan(step, (v_last, jnp.zeros((B,), dt)), (r.T, v.T, m.T), reverse=True)
  adv = adv.T
  return adv, jnp.where(m, adv + v, 0)


def value_loss(values, returns, mask, *, old_values=None, clip=None, with_clip_frac=False):
  """PPO value loss 0.5 max((V - R)^2, (V_clip - R)^2), V_clip = old + clip(V - old, -clip, clip), token mean.
  Schulman et al. 2017 (PPO, arXiv 1707.06347) as implemented in OpenAI baselines; clip=None gives plain 0.5 (V-R)^2.
  with_clip_frac: return (loss, clip_frac), clip_frac = the fraction of valid tokens where the clipped branch is
  the strictly larger one (the gradient is the clipped one's there), as verl/OpenRLHF's vf_clipfrac; 0 without clip.
  """
  err = (values - jax.lax.stop_gradient(returns)) ** 2
  frac = jnp.zeros((), jnp.float32)
  if clip is not None:
    if old_values is None:
      raise ValueError("value_loss: clip needs old_values")
    v_clip = old_values + jnp.clip(values - old_values, -clip, clip)
    err_clip = (v_clip - jax.lax.stop_gradient(returns)) ** 2
    frac = aggregate((err_clip > err).astype(jnp.float32), mask, "token_mean")
    err = jnp.maximum(err, err_clip)
  loss = aggregate(0.5 * err, mask, "token_mean")
  return (loss, frac) if with_clip_frac else loss


# ----------------------------------------------------------------------- KL, entropy, reward shaping, aggregation

def kl_penalty(logp, ref_logp, estimator):
  """Per-token estimate of KL(pi || pi_ref) from samples of pi. Schulman 2020, "Approximating KL Divergence"
  (http://joschu.net/blog/kl-approx.html). With d = ref_logp - logp = log(pi_ref / pi):
    k1 = -d (unbiased, high variance),  k2 = d^2 / 2 (low variance, biased),  k3 = e^d - 1 - d (unbiased, >= 0;
    the GRPO loss term). k3 clamps d to [-20, 20] before exp so one bad token cannot overflow fp32.
  """
  d = ref_logp - logp
  if estimator == "k1":
    return -d
  if estimator == "k2":
    return 0.5 * d * d
  if estimator == "k3":
    d = jnp.clip(d, -20.0, 20.0)
    return jnp.exp(d) - 1.0 - d
  raise ValueError(f"kl_penalty: estimator {estimator!r} not in {KL_ESTIMATORS}")


def overlong_shaping(lengths, max_len, buffer):
  """DAPO soft overlong punishment (Yu et al. 2025, arXiv 2503.14476, eq. 13), a reward *added* to the verifier's:
    0                                   if L <= max_len - buffer
    ((max_len - buffer) - L) / buffer   if max_len - buffer < L <= max_len   (linear from 0 down to -1)
    -1                                  if L > max_len
  DAPO uses max_len = 20480 (the generation budget) with buffer = 4096.
  """
  if not (isinstance(max_len, int) and isinstance(buffer, int) and 0 < buffer <= max_len):
    raise ValueError(f"overlong_shaping: need ints 0 < buffer <= max_len, got buffer={buffer!r} max_len={max_len!r}")
  L = jnp.asarray(lengths, jnp.float32)
  expected = max_len - buffer
  pen = jnp.where(L <= expected, 0.0, (expected - L) / buffer)
  return jnp.where(L > max_len, -1.0, pen)


def aggregate(x, mask, mode, max_tokens=None):
  """Reduce a per-token loss x [B,T] over valid tokens (mask [B,T]) to a scalar.

  token_mean           sum_bt m x / sum_bt m                  (DAPO, arXiv 2503.14476: every token weighs the same)
  seq_mean_token_mean  mean_b (sum_t m x / sum_t m)           (GRPO, arXiv 2402.03300: every sequence weighs the same)
  seq_mean_token_sum   mean_b (sum_t m x) / max_tokens        (Dr. GRPO, arXiv 2503.20783: a constant normaliser,
                                                               no length bias); max_tokens=None uses T
  Sequences with no valid token are left out of mean_b, so padding rows change nothing; no valid token -> 0.
  """
  if x.shape != mask.shape or x.ndim != 2:
    raise ValueError(f"aggregate: x {x.shape} and mask {mask.shape} must both be [B,T]")
  m = mask.astype(bool)
  xm = jnp.where(m, x, 0)  # where, not x * m: padding that is inf/nan must not leak
  n_tok = jnp.sum(m, axis=-1)  # [B]
  n_seq = jnp.maximum(jnp.sum(n_tok > 0), 1)
  if mode == "token_mean":
    return jnp.sum(xm) / jnp.maximum(jnp.sum(n_tok), 1)
  if mode == "seq_mean_token_mean":
    return jnp.sum(jnp.sum(xm, axis=-1) / jnp.maximum(n_tok, 1)) / n_seq
  if mode == "seq_mean_token_sum":
    return jnp.sum(xm) / (n_seq * (x.shape[1] if max_tokens is None else max_tokens))
  raise ValueError(f"aggregate: mode {mode!r} not in {AGG_MODES}")


# ----------------------------------------------------------------------- Policy losses: families, config, presets
# A family maps [B,T] arrays (zero at padding) to a per-token loss and a dict for metrics ("ratio", default
# exp(log_ratio); bool "clip_low"/"clip_high"/"dual_clip", default all False). log_ratio = logp - log pi_prox (or
# - log mu); w = truncated-IS weight, an input so each family keeps its product order; keep = tokens in the loss.
# New algorithm: copy a family, name it in POLICY_LOSSES and a preset in ALGORITHMS.

def ppo(cfg, logp, log_ratio, adv, w, keep):
  """-w min(r A, clip(r, 1-eps_low, 1+eps_high) A) (Schulman et al. 2017, arXiv 1707.06347); eps_high > eps_low is
  DAPO clip-higher. dual_clip_c = c: for A < 0 the objective is max(that, c A) (Ye et al. 2020, arXiv 1912.09729)."""
  ratio = jnp.exp(log_ratio)
  lo, hi = 1 - cfg.eps_low, 1 + cfg.eps_high
  obj = jnp.minimum(ratio * adv, jnp.clip(ratio, lo, hi) * adv)
  info = dict(ratio=ratio, clip_low=(ratio < lo) & (adv < 0), clip_high=(ratio > hi) & (adv > 0))  # grad cut
  if cfg.dual_clip_c is not None:
    info["dual_clip"] = (adv < 0) & (ratio > cfg.dual_clip_c)
    obj = jnp.where(adv < 0, jnp.maximum(obj, cfg.dual_clip_c * adv), obj)
  return -w * obj, info


def gspo(cfg, logp, log_ratio, adv, w, keep):
  """ppo on the GSPO-token ratio sg(s_b) pi_t / sg(pi_t), s_b = exp(mean_t log r_bt) (Zheng et al. 2025, arXiv
  2507.18071): value s_b, gradient s_b A grad log pi_t at every token; with agg="seq_mean_token_mean" exactly GSPO."""
  log_s = jnp.sum(jnp.where(keep, log_ratio, 0), -1) / jnp.maximum(jnp.sum(keep, -1), 1)  # [B]
  return ppo(cfg, logp, sg(log_s)[:, None] + logp - sg(logp), adv, w, keep)


def cispo(cfg, logp, log_ratio, adv, w, keep):
  """-w sg(clip(r, 1-cispo_eps_low, 1+cispo_eps_high)) A log pi (MiniMax-M1, arXiv 2506.13585): the IS weight is
  clipped, every token keeps its gradient; cispo_eps_low=None means no lower bound."""
  ratio = jnp.exp(log_ratio)
  lo, hi = 0.0 if cfg.cispo_eps_low is None else 1 - cfg.cispo_eps_low, 1 + cfg.cispo_eps_high
  return -w * sg(jnp.clip(ratio, lo, hi)) * adv * logp, dict(ratio=ratio, clip_low=ratio < lo, clip_high=ratio > hi)


def reinforce(cfg, logp, log_ratio, adv, w, keep):
  """-w A log pi (Williams 1992; RLOO uses it on-policy)."""
  return -w * adv * logp, {}


POLICY_LOSSES = dict(ppo=ppo, gspo=gspo, cispo=cispo, reinforce=reinforce)


@dataclasses.dataclass(frozen=True)
class LossConfig:
  """Everything policy_loss / config_advantages need (None = off); validated on construction and on replace."""
  policy_loss: str = "ppo"  # a POLICY_LOSSES family
  advantage: str = "grpo"  # an ADVANTAGE_ESTIMATORS name, or "gae" (PPO with a value head: losses.gae)
  agg: str = "token_mean"  # an AGG_MODES name
  eps_low: float = 0.2  # ratio clip [1 - eps_low, 1 + eps_high] (ppo, gspo); eps_high > eps_low: DAPO clip-higher
  eps_high: float = 0.2
  dual_clip_c: float | None = None  # dual-clip bound (> 1) for negative advantages
  cispo_eps_low: float | None = None  # CISPO IS-weight clip [1 - low, 1 + high]; low None: no lower bound
  cispo_eps_high: float = 0.28
  std_normalize: bool = True  # std_normalize, group_baseline, adv_eps: options of compute_advantages
  group_baseline: bool = True
  adv_eps: float = 1e-6
  kl_coef: float = 0.0
  kl_estimator: str = "k3"  # a KL_ESTIMATORS name (kl_penalty)
  kl_mode: str = "loss"  # "loss": + kl_coef * agg(kl); "reward": kl_coef * KL-to-go off the advantages
  entropy_coef: float = 0.0  # loss -= entropy_coef * agg(entropy)
  # The behaviour weight min(pi_prox / mu, tis_cap), per "token" or "sequence" (tis_level): on in every preset (the
  # data is off-policy whenever it is stale, from several updates, or a continued partial rollout). 2 as in Yao et
  # al. 2025 (verl's TIS); None turns the correction off (then stale data is trained as if on-policy).
  tis_cap: float | None = 2.0
  tis_level: str = "token"
  mask_ratio_cap: float | None = None  # drop tokens whose trainer/behaviour ratio is outside [1/cap, cap]
  max_tokens: int | None = None  # seq_mean_token_sum's constant normaliser (None: the padded length T)
  # DAPO overlong shaping buffer, a fraction of the generation budget max_new: the trainer adds
  # overlong_shaping(lengths, max_new, round(frac * max_new)) to the rewards.
  overlong_buffer_frac: float | None = None

  def __post_init__(self):
    nonneg = lambda v: 0 <= v  # noqa: E731
    optional = lambda ok: lambda v: v is None or ok(v)  # noqa: E731
    choices = dict(policy_loss=tuple(POLICY_LOSSES), advantage=ADVANTAGE_ESTIMATORS + ("gae",), agg=AGG_MODES,
                   kl_estimator=KL_ESTIMATORS, kl_mode=("loss", "reward"), tis_level=("token", "sequence"))
    # (field, ok, expected), checked in this order: the first failure is the error.
    checks = [(f, lambda v, a=allowed: v in a, f"one of {allowed}") for f, allowed in choices.items()]
    checks += [(f, nonneg, "a number >= 0") for f in ("eps_low", "eps_high", "cispo_eps_high")] + [
        ("eps_low", lambda v: v < 1, "< 1 (the lower clip bound 1 - eps_low must stay positive)"),
        ("cispo_eps_low", optional(lambda v: 0 <= v <= 1), "None or in [0, 1]"),
        ("dual_clip_c", optional(lambda v: v > 1), "None or > 1"),
        ("tis_cap", optional(lambda v: v > 0), "None or > 0"),
        ("mask_ratio_cap", optional(lambda v: v > 1), "None or > 1"),
        ("max_tokens", optional(lambda v: isinstance(v, int) and v > 0), "None or a positive int"),
        ("overlong_buffer_frac", optional(lambda v: 0 < v <= 1), "None or in (0, 1]")]
    checks += [(f, nonneg, "a number >= 0") for f in ("kl_coef", "entropy_coef", "adv_eps")]
    for field, ok, allowed in checks:
      if not ok(getattr(self, field)):
        raise ValueError(f"LossConfig.{field} = {getattr(self, field)!r}, expected {allowed}")


# Each entry is the combination its paper describes, as changes to LossConfig's defaults (PPO-clip 0.2, GRPO
# advantages, token mean, k3 KL in the loss). KL coefficients are the papers' where they use one; set kl_coef=0
# to train without a reference model.
ALGORITHMS = {
    # PPO-clip (Schulman et al. 2017, arXiv 1707.06347) for LMs with a value head and GAE, per-token k1 KL in the
    # reward with beta = 0.02 (InstructGPT, Ouyang et al. 2022, arXiv 2203.02155).
    "ppo": LossConfig(advantage="gae", kl_coef=0.02, kl_estimator="k1", kl_mode="reward"),
    # GRPO (Shao et al. 2024, arXiv 2402.03300): group mean/std advantages, per-sequence token mean, k3 KL in the
    # loss with beta = 0.04.
    "grpo": LossConfig(agg="seq_mean_token_mean", kl_coef=0.04),
    # Dr. GRPO (Liu et al. 2025, arXiv 2503.20783): no std, no per-length normaliser (constant max_tokens), no KL.
    "dr_grpo": LossConfig(advantage="dr_grpo", agg="seq_mean_token_sum"),
    # DAPO (Yu et al. 2025, arXiv 2503.14476): clip-higher (0.2 / 0.28), token-level mean, no KL, overlong
    # shaping with a 4096/20480 = 0.2 buffer. (Dynamic sampling is batch curation: data.py.)
    "dapo": LossConfig(eps_high=0.28, overlong_buffer_frac=0.2),
    # GSPO (Zheng et al. 2025, arXiv 2507.18071): sequence-level length-normalised ratio, clip 3e-4 / 4e-4,
    # group-normalised advantages, per-sequence mean, no KL.
    # Its behaviour weight is per sequence too, like its ratio.
    "gspo": LossConfig(policy_loss="gspo", agg="seq_mean_token_mean", eps_low=3e-4, eps_high=4e-4,
                       tis_level="sequence"),
    # CISPO (MiniMax-M1, arXiv 2506.13585): clipped stop-gradient IS weight on log pi, token-level mean, group-
    # normalised advantages, no lower IS bound. eps_high^IS is tuned in the paper; 0.28 here is our choice.
    "cispo": LossConfig(policy_loss="cispo", cispo_eps_low=None, cispo_eps_high=0.28),
    # RLOO (Ahmadian et al. 2024, arXiv 2402.14740): leave-one-out baseline, REINFORCE on the whole sequence's
    # log-prob (token sum; constant normaliser only rescales the learning rate), no clipping.
    "rloo": LossConfig(policy_loss="reinforce", advantage="rloo", agg="seq_mean_token_sum"),
    # REINFORCE++-baseline (Hu 2025, arXiv 2501.03262): group-mean baseline, then global batch normalisation,
    # PPO-clip loss, token mean; the paper's k2 KL-as-loss variant (coefficient 0 here: no reference by default).
    "reinforce_pp": LossConfig(advantage="reinforce_pp", group_baseline=True, kl_estimator="k2"),
    # Rejection-sampling fine-tuning, STaR-style (Zelikman et al. 2022, arXiv 2203.14465), online as in RAFT (Dong
    # et al. 2023, arXiv 2304.06767): A = r in {0, 1}, no baseline: -log pi of the correct samples, token mean.
    # Run it without --dynamic_sampling (a group of all-correct samples is SFT data too).
    "star": LossConfig(policy_loss="reinforce", advantage="reinforce"),
}


def config_advantages(cfg, rewards, lengths=None):
  """compute_advantages(cfg.advantage, rewards, ...) with cfg's advantage options."""
  return compute_advantages(cfg.advantage, rewards, lengths=lengths, std_normalize=cfg.std_normalize,
                            group_baseline=cfg.group_baseline, eps=cfg.adv_eps)


# ---------------------------------------------------------------- Policy loss: the shared wrapper around a family

def policy_loss(cfg, logp, old_logp, advantages, mask, *, ref_logp=None, prox_logp=None, entropy=None):
  """Scalar loss to minimise and a dict of jnp-scalar metrics. All [B,T] inputs; advantages [B] or [B,T].

  logp: the trainer's log-probs of the sampled tokens (differentiated); old_logp: the worker's behaviour mu.
  prox_logp: the proximal policy pi_prox (the trainer's log-probs at the start of the step, no gradient); None
  (one update per batch): the current policy, sg(logp). Always decoupled PPO (Hilton et al. 2021, arXiv
  2110.00641; AReaL, arXiv 2505.24298): the family sees r = pi_theta / pi_prox, and the behaviour mismatch is the
  weight w = min(pi_prox / mu, tis_cap) on every term of the family, so mu never drops out, whatever the number of
  updates per batch (Espeholt et al. 2018, arXiv 1802.01561; Yao et al. 2025, "Your Efficient RL Framework
  Secretly Brings You Off-Policy RL Training"): per token, or w_b = min(prod_t pi_prox/mu, cap) per sequence
  (in log space). mask_ratio_cap = C drops tokens whose pi_prox / mu is outside [1/C, C] from every term (masked
  importance sampling, as in IcePop / MIS, 2025).
  KL (needs ref_logp when kl_coef > 0): mode "loss" adds kl_coef * agg(kl_t); mode "reward" subtracts
  kl_coef * sum_{s>=t} kl_s (gamma = 1, from the fixed pi_prox, no gradient) from A_t, after the advantage
  estimator (so REINFORCE++ whitening does not see it). Entropy bonus: loss -= entropy_coef * agg(entropy).
  """
  B, T = logp.shape
  for name, x in dict(old_logp=old_logp, mask=mask, ref_logp=ref_logp, prox_logp=prox_logp, entropy=entropy).items():
    if x is not None and x.shape != (B, T):
      raise ValueError(f"policy_loss: {name} shape {x.shape} != logp shape {(B, T)}")
  if advantages.shape not in ((B,), (B, T)):
    raise ValueError(f"policy_loss: advantages shape {advantages.shape} must be [B]={(B,)} or [B,T]={(B, T)}")
  if cfg.kl_coef > 0 and ref_logp is None:
    raise ValueError(f"policy_loss: kl_coef={cfg.kl_coef} needs ref_logp (or set kl_coef=0)")
  if cfg.entropy_coef > 0 and entropy is None:
    raise ValueError(f"policy_loss: entropy_coef={cfg.entropy_coef} needs entropy (token_logprobs_and_entropy)")

  dt = _compute_dtype(logp.dtype)
  valid = mask.astype(bool)
  # Zero padding first (where, not *): inf/nan there then cannot reach the loss or the gradient.
  clean = lambda x: None if x is None else jnp.where(valid, x, 0).astype(dt)
  prox_logp = sg(logp) if prox_logp is None else prox_logp  # one update per batch: pi_prox is the current policy
  logp, old_logp, ref_logp, prox_logp, entropy = map(clean, (logp, old_logp, ref_logp, prox_logp, entropy))
  adv = jnp.broadcast_to(advantages[:, None], (B, T)) if advantages.ndim == 1 else advantages
  adv = jnp.where(valid, sg(adv), 0).astype(dt)
  base = sg(prox_logp)

  # The behaviour correction between the proximal policy and the worker's: log(pi_prox / mu).
  behav_lr = base - old_logp
  keep = valid
  if cfg.mask_ratio_cap is not None:
    keep = valid & (jnp.abs(behav_lr) <= math.log(cfg.mask_ratio_cap))
  w = jnp.ones((B, T), dt)
  if cfg.tis_cap is not None:  # capped in log space, so a sequence's product of ratios cannot overflow
    log_cap = math.log(cfg.tis_cap)
    w = (jnp.exp(jnp.minimum(behav_lr, log_cap)) if cfg.tis_level == "token" else
         jnp.broadcast_to(jnp.exp(jnp.minimum(jnp.sum(jnp.where(keep, behav_lr, 0), -1), log_cap))[:, None], (B, T)))

  kl = None
  if ref_logp is not None:
    kl = jnp.where(valid, kl_penalty(logp, ref_logp, cfg.kl_estimator), 0)
    if cfg.kl_mode == "reward" and cfg.kl_coef > 0:
      kl_fixed = jnp.where(keep, kl_penalty(base, ref_logp, cfg.kl_estimator), 0)
      kl_to_go = jnp.flip(jnp.cumsum(jnp.flip(kl_fixed, -1), -1), -1)
      adv = jnp.where(valid, adv - cfg.kl_coef * kl_to_go, 0)

  log_ratio = logp - base
  per_tok, info = POLICY_LOSSES[cfg.policy_loss](cfg, logp, log_ratio, adv, w, keep)
  ratio = info.get("ratio", jnp.exp(log_ratio))
  clip_low, clip_high, dual = (info.get(k, jnp.zeros((B, T), bool)) for k in ("clip_low", "clip_high", "dual_clip"))

  agg = lambda x: aggregate(x, keep, cfg.agg, cfg.max_tokens)
  pg_loss = agg(per_tok)
  kl_loss = cfg.kl_coef * agg(kl) if (kl is not None and cfg.kl_mode == "loss" and cfg.kl_coef > 0) else 0.0
  ent_loss = -cfg.entropy_coef * agg(entropy) if cfg.entropy_coef > 0 else 0.0
  loss = pg_loss + kl_loss + ent_loss

  # Metrics over valid tokens (jnp scalars, safe inside jit).
  n = jnp.maximum(jnp.sum(valid), 1)
  frac = lambda b: jnp.sum(b & valid) / n
  vmean = lambda x: jnp.sum(jnp.where(valid, x, 0)) / n
  vmax = lambda x: jnp.where(jnp.any(valid), jnp.max(jnp.where(valid, x, -jnp.inf)), 0.0)
  vmin = lambda x: jnp.where(jnp.any(valid), jnp.min(jnp.where(valid, x, jnp.inf)), 0.0)
  metrics = dict(
      loss=loss, pg_loss=pg_loss, kl_loss=jnp.asarray(kl_loss, dt), entropy_loss=jnp.asarray(ent_loss, dt),
      clip_frac_low=frac(clip_low), clip_frac_high=frac(clip_high), clip_frac=frac(clip_low | clip_high),
      dual_clip_frac=frac(dual), ratio_mean=vmean(sg(ratio)), ratio_min=vmin(sg(ratio)), ratio_max=vmax(sg(ratio)),
      is_weight_mean=vmean(w), is_weight_max=vmax(w), masked_frac=frac(~keep),
      behav_ratio_mean=vmean(jnp.exp(behav_lr)), behav_abs_logratio_max=vmax(jnp.abs(behav_lr)),
      kl=vmean(sg(kl)) if kl is not None else jnp.zeros((), dt),
      entropy=vmean(sg(entropy)) if entropy is not None else jnp.zeros((), dt),
      adv_mean=vmean(adv), n_tokens=jnp.sum(keep).astype(dt),
  )
  return loss, metrics
