"""Shared statistical check: sampled speculative decoding reproduces the target's distribution.

`assert_matches_target_joint(engine, target, prompt, sp)` draws 4096 three-token continuations with
`engine` and compares them, by chi-square, against the exact target joint distribution obtained by
enumerating the support of `sp` (keep `top_k` small). The same test must reject a colder target, so
it is shown to have power. `target_joint_pvalues` gives the two p-values (a test that expects a
wrong verifier to fail checks the first one).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dmtp_jax.decode.sampling import SamplingParams, filtered_probs

DRAWS_PER_CALL, CALLS = 256, 16


@functools.partial(jax.jit, static_argnums=0)
def last_token_probs(graphdef, state, ids_bt, sp):
    """The target's filtered next-token probabilities after each row of `ids_bt` (one compiled
    program per target architecture and shape, shared by every check in the run; the temperature is
    traced, so the colder target of the power check reuses it)."""
    model = nnx.merge(graphdef, state)
    out = model(ids_bt, jnp.broadcast_to(jnp.arange(ids_bt.shape[1]), ids_bt.shape))
    return filtered_probs(model.logits(out.hidden_bth[:, -1]), sp)


def exact_joint(target, prompt, sp, depth=3):
    """Exact target distribution of the first `depth` sampled tokens, by enumerating the support."""
    def next_probs(seqs):
        return np.asarray(last_token_probs(target.graphdef, target.state, jnp.asarray(seqs), sp), np.float64)

    joint = {(): 1.0}
    for _ in range(depth):
        prefixes = list(joint)
        probs = next_probs([prompt + list(p) for p in prefixes])
        joint = {p + (t,): joint[p] * probs[i, t] for i, p in enumerate(prefixes)
                 for t in np.nonzero(probs[i])[0].tolist()}
    return joint


def _cells(joint, keys, n):
    expected = np.array([joint.get(k, 0.0) for k in keys]) * n
    return expected


def assert_matches_target_joint(engine, target, prompt, sp: SamplingParams):
    pvalue, cold_pvalue = target_joint_pvalues(engine, target, prompt, sp)
    assert pvalue > 1e-3
    assert cold_pvalue < 1e-6


def target_joint_pvalues(engine, target, prompt, sp: SamplingParams):
    """`(pvalue, cold_pvalue)` of the check above: the chi-square p-value of the engine's samples
    against the exact target joint, and against the colder target's (the power check); both 0 when
    a sample lies outside the target's support."""
    from scipy.stats import chisquare
    joint = exact_joint(target, prompt, sp)
    counts = dict.fromkeys(joint, 0)
    accepted_drafts = outside = 0
    for seed in range(CALLS):
        res = engine.generate([prompt] * DRAWS_PER_CALL, max_new_tokens=3, sampling=sp, seed=seed, stop_ids=[])
        for out in res.output_ids:
            if tuple(out) in counts:
                counts[tuple(out)] += 1
            else:
                outside += 1
        accepted_drafts += sum(k * n for k, n in enumerate(res.stats["histogram"]))
    assert accepted_drafts > 0, "no draft was ever accepted: the check would not exercise verification"
    if outside:
        return 0.0, 0.0
    n = DRAWS_PER_CALL * CALLS
    keys = sorted(joint, key=lambda k: -joint[k])
    expected = _cells(joint, keys, n)
    observed = np.array([counts[k] for k in keys], float)
    big = expected >= 5
    tail = [] if big.all() else [expected[~big].sum()]         # no empty pooled cell (0 / 0 is NaN)
    exp_cells = np.append(expected[big], tail)
    obs_cells = np.append(observed[big], [observed[~big].sum()] if tail else [])
    pvalue = chisquare(obs_cells, exp_cells * obs_cells.sum() / exp_cells.sum()).pvalue
    cold = _cells(exact_joint(target, prompt, SamplingParams.make(temperature=0.5, top_k=int(sp.top_k))), keys, n)
    cold_cells = np.append(cold[big], [cold[~big].sum()] if tail else []) + 1e-9
    return pvalue, chisquare(obs_cells, cold_cells * obs_cells.sum() / cold_cells.sum()).pvalue
