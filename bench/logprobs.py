"""Memory of losses.py's log-prob paths against naive autodiff: XLA's temporary bytes (compiled, not run) of
grad(sum logp [+ entropy]) for bf16 logits, as multiples of one fp32 [B,T,V] buffer.

Run from the repo root: JAX_PLATFORMS=cpu python -m bench.logprobs
"""
import jax
import jax.numpy as jnp

from losses import chunked_token_logprobs, token_logprobs, token_logprobs_and_entropy


def memory_report(B=4, T=512, V=32768, D=512, chunk=64):
  logits = jax.ShapeDtypeStruct((B, T, V), jnp.bfloat16)
  targets = jnp.zeros((B, T), jnp.int32)
  full = B * T * V * 4  # one fp32 [B,T,V] buffer

  def naive(l, ent):
    ls = jax.nn.log_softmax(l.astype(jnp.float32), axis=-1)
    lp = jnp.take_along_axis(ls, targets[..., None], axis=-1)[..., 0]
    return jnp.sum(lp) + (jnp.sum(-jnp.exp(ls) * ls) if ent else 0.0)

  def temp(f, *args):
    return jax.jit(jax.grad(f, argnums=tuple(range(len(args))))).lower(*args).compile().memory_analysis(
        ).temp_size_in_bytes

  hidden, w = jax.ShapeDtypeStruct((B, T, D), jnp.bfloat16), jax.ShapeDtypeStruct((D, V), jnp.bfloat16)
  chunked = lambda h, w: sum(map(jnp.sum, chunked_token_logprobs(h, w, targets, chunk)))
  dense = lambda h, w: sum(map(jnp.sum, token_logprobs_and_entropy(jnp.einsum("btd,dv->btv", h, w), targets)))
  rows = [("naive log_softmax, logp", temp(lambda l: naive(l, False), logits)),
          ("token_logprobs", temp(lambda l: jnp.sum(token_logprobs(l, targets)), logits)),
          ("naive log_softmax, logp + entropy", temp(lambda l: naive(l, True), logits)),
          ("token_logprobs_and_entropy", temp(lambda l: sum(map(jnp.sum, token_logprobs_and_entropy(l, targets))),
                                              logits)),
          (f"hidden @ unembed -> token_logprobs_and_entropy (D={D})", temp(dense, hidden, w)),
          (f"chunked_token_logprobs (chunk={chunk}, D={D})", temp(chunked, hidden, w))]
  print(f"{jax.default_backend()}: grad temp bytes, bf16 logits B={B} T={T} V={V}; one fp32 [B,T,V] = {full / 2**20:.0f} MiB")
  for name, b in rows:
    print(f"  {name:58s} {b / 2**20:8.1f} MiB  ({b / full:.2f} x fp32 [B,T,V])")
  return rows


if __name__ == "__main__":
  memory_report()
