"""The target's log-probabilities at the tokens a round or a prefill emits, for the server's
`logprobs`: raw (log-softmax of the target's logits before temperature and filters, as vLLM's
default), the emitted token's and the top `MAX_TOP_LOGPROBS` (a fixed width: one program whatever a
request asks).

Example:
    >>> lp = token_logprobs(jnp.log(jnp.array([[0.5, 0.25, 0.25]])), jnp.array([1]), width=2)
    >>> [round(float(x), 4) for x in jnp.exp(lp.logprob)], lp.top_ids.tolist()
    ([0.25], [[0, 1]])
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

MAX_TOP_LOGPROBS = 20       # the most top logprobs a request may ask for (OpenAI's cap)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TokenLogprobs:
    """Per emitted token (leading axes `...`): its logprob, the top ids and their logprobs (best first)."""
    logprob: jax.Array          # [...] float32
    top_ids: jax.Array          # [..., W] int32
    top_logprobs: jax.Array     # [..., W] float32


def token_logprobs(logits_xv: jax.Array, tokens_x: jax.Array, width: int = MAX_TOP_LOGPROBS) -> TokenLogprobs:
    """`TokenLogprobs` of `tokens_x` under `logits_xv [..., V]` (fp32 log-softmax; top `width`)."""
    lp = jax.nn.log_softmax(logits_xv.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(lp, tokens_x[..., None].astype(jnp.int32), axis=-1)[..., 0]
    top_lp, top_ids = jax.lax.top_k(lp, min(width, lp.shape[-1]))
    return TokenLogprobs(chosen, top_ids.astype(jnp.int32), top_lp)
