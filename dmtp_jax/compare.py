"""Numerics of our JAX target against transformers on the same checkpoint directory.

The checkpoint is loaded twice: in transformers (fp32 torch, eval, no_grad; the reference) and in
JAX through `load_target` at the requested dtype. A few prompts of random token ids of different
lengths (one of ~300 tokens, to catch RoPE errors at far positions) are run through both, and each
comparison becomes one check `{"name", "max_abs_diff", "tolerance", "ok"}`:

* `logits`              max |ours - HF| over every real position of every prompt.
* `argmax_agreement`    1 - (fraction of positions whose argmax agrees).
* `hidden_layer_{k}`    our output of layer k vs HF `hidden_states[k+1]`; the last layer is compared
                        after the final norm (HF's last entry is post-norm, like our `hidden_bth`).
* `cached_decode`       JAX only: a cache prefill of the first n-4 tokens followed by 4
                        single-token decode steps vs the full (cache-free) forward, all n positions
                        (the prefill chunk and decode-step forward the decoders run).
* `deltanet_state`      (hybrid targets) every Gated DeltaNet layer's conv window and recurrent state
                        after a prefill vs transformers' cache after the same prompt.
* `greedy_continuation` fraction of tokens where our `ARDecoder` greedy continuation differs from
                        `model.generate(do_sample=False)` with EOS stopping disabled.
* `mtp`                 (targets carrying `mtp.*`) our MTP head's logits vs transformers' `MtpModel`.
* `mtp_cache`           JAX only: the MTP's cached path as decoding runs it (a prefill of the first
                        rows, then single-row steps) vs its full-window forward on the same rows.
* `draft_hidden`, `draft_logits`  (with a drafter) our DFlash / DFlash2 block, built as the decode
                        round builds it (`fusion.draft_block_embeds`), vs the `dflash` package.

Tolerances (`TOLERANCES`). Float checks are relative to the reference's magnitude:
`tol = rtol * max(1, max |reference|)`, the reference being the HF logits (`logits`, and
`cached_decode`, whose reference is our own full forward) or the HF hidden state of that layer
(`hidden_layer_k`; residual streams grow with depth and real models carry outlier channels, so a
per-layer scale is used). `rtol` is 1e-4 for float32 (only accumulation-order noise is allowed) and
5e-2 for bfloat16 (bf16 keeps ~3 significant digits, and errors compound over layers). Token checks
are exact in float32 (tolerance 0). In bfloat16 a near-tie can flip an argmax (tolerance: 10% of
positions), and a greedy continuation diverges for good after its first flip, so there the greedy
mismatch fraction is reported but not gated (tolerance 1.0; seen: 0.42 on the tiny MoE checkpoint).
Also in low precision an MoE router near-tie can pick another expert for a token, an O(1) change at
that one position (seen: 2 of 340 positions on the tiny MoE checkpoint in bf16), so there the float
checks' "max_abs_diff" is the 99th percentile over positions of the per-position max |diff|
(`TOLERANCES`' quantile; float32 uses the plain max).

Example:
    >>> report = compare_target("/path/to/Qwen3-0.6B", dtype="float32")  # doctest: +SKIP
    >>> print(format_table(report))  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dmtp_jax.decode.ar import step_logits
from dmtp_jax.decode.prefill import target_chunk
from dmtp_jax.decode.sampling import SamplingParams

TOLERANCES = {  # dtype -> (rtol of float checks, their position quantile, argmax, greedy mismatch)
    "float32": (1e-4, 1.0, 0.0, 0.0),
    "bfloat16": (5e-2, 0.99, 0.1, 1.0),
    "float16": (5e-2, 0.99, 0.1, 1.0),
}
DECODE_STEPS = 4


def check(name: str, max_abs_diff: float, tolerance: float) -> dict:
    """One check row. Example: `check("logits", 2e-6, 1e-4)["ok"]` is True."""
    diff = float(max_abs_diff)
    return {"name": name, "max_abs_diff": diff, "tolerance": float(tolerance),
            "ok": bool(np.isfinite(diff) and diff <= tolerance)}


def max_abs_diff(ours, ref, quantile: float = 1.0) -> float:
    """|ours - ref| maxed over the last axis, then the `quantile` over positions (1.0: the plain max);
    float64, inf on shape mismatch. Example: `max_abs_diff([[1, 2], [3, 4]], [[1, 2.5], [3, 4]])` = 0.5."""
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    if ours.shape != ref.shape:
        return float("inf")
    per_position = np.abs(ours - ref).reshape(-1, ours.shape[-1] if ours.ndim else 1).max(-1)
    return float(np.quantile(per_position, quantile)) if quantile < 1 else float(per_position.max())


def scaled_tolerance(rtol: float, ref) -> float:
    """`rtol * max(1, max |ref|)`. Example: `scaled_tolerance(1e-4, [[-30.0, 2.0]])` = 3e-3."""
    return rtol * max(1.0, float(np.max(np.abs(np.asarray(ref, np.float64)))))


def make_prompts(vocab_size: int, max_positions: int, seed: int = 0, reserve: int = 8,
                 lengths=(7, 33, 300)) -> list[list[int]]:
    """Random token-id prompts; every length is clipped so that `length + reserve <= max_positions`.

    Example:
        >>> [len(p) for p in make_prompts(128, 512, seed=0)]
        [7, 33, 300]
    """
    rng = np.random.default_rng(seed)
    lengths = [max(DECODE_STEPS + 1, min(n, max_positions - reserve)) for n in lengths]
    return [rng.integers(0, vocab_size, size=n).tolist() for n in lengths]


def right_pad(prompts: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """`([B, max_len] int32 tokens right-padded with 0, [B] lengths)`."""
    lengths = np.array([len(p) for p in prompts], np.int32)
    tokens = np.zeros((len(prompts), int(lengths.max())), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
    return tokens, lengths


# ---------------------------------------------------------------- transformers (the reference)
def hf_reference(model, prompts, num_new_tokens: int) -> list[dict]:
    """Per prompt: fp32 `logits [T, V]`, `hidden` (HF hidden_states[1:], each `[T, H]`), greedy `generated`."""
    import torch

    # generate() merges a per-call eos_token_id=None with the model's default: clear it at the source.
    model.generation_config.eos_token_id = None
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], dtype=torch.long)
            res = model(ids, output_hidden_states=True)
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=num_new_tokens, pad_token_id=0)
            out.append({"logits": res.logits[0].float().numpy(),
                        "hidden": [h[0].float().numpy() for h in res.hidden_states[1:]],
                        "generated": gen[0, len(p):].tolist()})
    return out


# ---------------------------------------------------------------- ours (JAX)
# Module-level jits with the graphdef static: repeated comparisons of one architecture compile once.
@functools.partial(jax.jit, static_argnums=(0, 1))
def _full_forward(graphdef, layers, state, tokens_bt):
    model = nnx.merge(graphdef, state)
    positions = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1]), tokens_bt.shape)
    out = model(tokens_bt, positions, capture_layers=layers)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    return f32(model.logits(out.hidden_bth)), f32(out.hidden_bth), tuple(map(f32, out.captured))


@functools.partial(jax.jit, static_argnums=(0,))
def prefill_logits(graphdef, state, tokens_bt, lengths_b, cache):
    """Our prefill (`decode/prefill.py:target_chunk`, the chunk every decoder's prefill runs; tokens
    at positions `>= lengths_b` are invalid) and fp32 logits at every position: `(logits, cache)`.

    Example:
        >>> logits, cache = prefill_logits(target.graphdef, target.state, tokens_bt, lengths_b, cache)  # doctest: +SKIP
    """
    model = nnx.merge(graphdef, state)
    b = tokens_bt.shape[0]
    res = target_chunk(model, tokens_bt, jnp.int32(0), lengths_b, cache, jnp.zeros(b, jnp.int32),
                       SamplingParams.make(), jax.random.key(0), True)
    return model.logits(res.out.hidden_bth).astype(jnp.float32), res.out.cache


@functools.partial(jax.jit, static_argnums=(0,))
def decode_step_logits(graphdef, state, tokens_b, positions_b, cache):
    """Our single-token decode step (`decode/ar.py:step_logits`, the forward of `decode_step`):
    fp32 `(logits [B, V], cache)`.

    Example:
        >>> logits, cache = decode_step_logits(target.graphdef, target.state, tokens_b, positions_b,
        ...                                    cache)  # doctest: +SKIP
    """
    logits, cache = step_logits(nnx.merge(graphdef, state), tokens_b, positions_b, cache)
    return logits.astype(jnp.float32), cache


def jax_forward(target, tokens_bt) -> dict:
    """Full forward of a right-padded batch: fp32 `logits [B,T,V]`, `final [B,T,H]`, `captured` per layer."""
    layers = tuple(range(target.cfg.num_hidden_layers))
    logits, final, captured = _full_forward(target.graphdef, layers, target.state, tokens_bt)
    return {"logits": np.asarray(logits), "final": np.asarray(final),
            "captured": [np.asarray(c) for c in captured]}


def jax_cached_logits(target, tokens_bt, lengths_b, steps: int = DECODE_STEPS) -> np.ndarray:
    """Logits `[B,T,V]` from a cache prefill of each row's first `len-steps` tokens, then `steps`
    single-token decode steps at per-row positions (the prefill's later tokens are marked invalid:
    their K/V slots are overwritten before being read, and they never enter a DeltaNet state)."""
    from dmtp_jax.decode.caches import TargetCaches

    b, t = tokens_bt.shape
    cache = TargetCaches(target).new(b, -(-(t + 1) // 128) * 128)
    logits, cache = prefill_logits(target.graphdef, target.state, tokens_bt, (lengths_b - steps).astype(np.int32),
                                   cache)
    logits = np.array(logits)
    rows = np.arange(b)
    for j in range(steps):
        pos = (lengths_b - steps + j).astype(np.int32)
        logits_bv, cache = decode_step_logits(target.graphdef, target.state, tokens_bt[rows, pos], pos, cache)
        logits[rows, pos] = np.asarray(logits_bv)
    return logits


def drafter_checks(target, hf_model, draft_dir: str, prompt: list[int], rtol: float, q: float) -> list[dict]:
    """`draft_hidden` / `draft_logits`: our DFlash / DFlash2 drafter vs the `dflash` package on one
    block drafted after `prompt` (context = the prompt's target features, anchor = HF's next token).

    Example:
        >>> drafter_checks(target, hf_model, "/tmp/tiny-dflash", [1, 2, 3], 1e-4, 1.0)  # doctest: +SKIP
    """
    import torch
    from dflash.model import (DFlash2DraftModel, DFlashDraftModel, _make_cache, _output_head,
                              extract_context_feature)

    from dmtp_jax.checkpoint.dflash_ckpt import load_drafter
    from dmtp_jax.models.fusion import draft_block_embeds

    drafter = load_drafter(draft_dir, target.cfg, target.state_dtype, target.mesh)
    dcfg, n, length = drafter.cfg, drafter.cfg.block_size, len(prompt)
    ref = (DFlash2DraftModel if dcfg.version == 2 else DFlashDraftModel).from_pretrained(
        draft_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf_model(torch.tensor([prompt]), output_hidden_states=True)
        anchor = int(out.logits[0, -1].argmax())
        block = torch.full((1, n), dcfg.mask_token_id, dtype=torch.long)
        block[0, 0] = anchor
        noise = hf_model.get_input_embeddings()(block) * dcfg.input_embedding_scale
        ref_hidden = ref(target_hidden=extract_context_feature(out.hidden_states, ref.target_layer_ids),
                         noise_embedding=noise, position_ids=torch.arange(length + n)[None],
                         past_key_values=_make_cache(ref.config), use_cache=True)
        ref_logits = ref.compute_logits(ref_hidden[:, 1:], _output_head(hf_model)).numpy()
        ref_hidden = ref_hidden.numpy()
    model = nnx.merge(target.graphdef, target.state)
    dr = nnx.merge(drafter.graphdef, drafter.state)
    ctx_pos = jnp.arange(length)[None]
    feats = model(jnp.asarray([prompt]), ctx_pos, capture_layers=dcfg.target_layer_ids).captured
    k, v = dr.context_kv(dr.project_context(jnp.concatenate(feats, axis=-1)), ctx_pos)
    embeds = draft_block_embeds("dflash", n, model.embed, dcfg, None, jnp.asarray([anchor]), None, None)
    hidden = dr(embeds, length + jnp.arange(n)[None], k, v, ctx_pos, jnp.ones((1, length), bool))
    logits = np.asarray(dr.draft_logits(hidden[:, 1:], model.logits), np.float32)
    hidden = np.asarray(hidden, np.float32)
    return [check("draft_hidden", max_abs_diff(hidden[0], ref_hidden[0], q), scaled_tolerance(rtol, ref_hidden)),
            check("draft_logits", max_abs_diff(logits[0], ref_logits[0], q), scaled_tolerance(rtol, ref_logits))]


def deltanet_state_check(target, hf_model, prompt: list[int], rtol: float, q: float) -> dict:
    """`deltanet_state`: our conv windows and recurrent states after a prefill of `prompt` vs the
    transformers cache (whose conv state keeps K columns; ours the last K-1 inputs), max over layers,
    scaled by the largest reference state entry."""
    import torch
    from transformers import DynamicCache

    from dmtp_jax.decode.caches import TargetCaches

    ids = torch.tensor([prompt])
    with torch.no_grad():
        hf_cache = DynamicCache(config=hf_model.config)
        hf_model(ids, cache=hf_cache, use_cache=True)
    cache = TargetCaches(target).new(1, -(-(len(prompt) + 1) // 128) * 128)
    _, cache = prefill_logits(target.graphdef, target.state, np.asarray([prompt], np.int32),
                              np.asarray([len(prompt)], np.int32), cache)
    diffs, scale = [], 0.0
    for j, layer in enumerate(target.cfg.linear_layers):
        ref_conv = hf_cache.get_conv_state(layer, state_idx=0)[0].float().numpy()   # [C, K]
        ref_ssm = hf_cache.get_recurrent_state(layer, state_idx=0)[0].float().numpy()
        width = cache.conv_lbwc.shape[2]
        diffs += [max_abs_diff(np.asarray(cache.conv_lbwc[j, 0], np.float32), ref_conv[:, -width:].T, q),
                  max_abs_diff(np.asarray(cache.ssm_lbhkv[j, 0]), ref_ssm, q)]
        scale = max(scale, float(np.abs(ref_ssm).max()), float(np.abs(ref_conv).max()))
    return check("deltanet_state", max(diffs), rtol * max(1.0, scale))


MTP_RENAMES = {"fc": "eh_proj", "pre_fc_norm_embedding": "enorm", "pre_fc_norm_hidden": "hnorm",
               "norm": "post_norm"}


def reference_mtp_model(hf_model, model_dir: str):
    """transformers' generic `MtpModel` on `hf_model`, filled from `model_dir`'s `mtp.*` tensors
    (Qwen3.5 names -> `layers.0.{eh_proj, enorm, hnorm, post_norm, mtp_block.*}`).

    Example:
        >>> ref = reference_mtp_model(AutoModelForCausalLM.from_pretrained(d), d)  # doctest: +SKIP
    """
    import torch
    from transformers.modeling_layers import MtpModel

    from dmtp_jax.checkpoint.safetensors_io import CheckpointReader

    hf_model.config.num_mtp_layers, hf_model.config.mtp_layer_types = 1, ["full_attention"]
    ref = MtpModel(hf_model, 1).eval()
    reader = CheckpointReader(model_dir)
    state = {}
    for key in reader.keys():
        if key.startswith("mtp."):
            head, _, rest = key[4:].partition(".")
            name = (f"layers.0.{MTP_RENAMES[head]}.{rest}" if head in MTP_RENAMES
                    else f"layers.0.mtp_block.{rest.partition('.')[2]}")
            state[name] = torch.tensor(np.array(reader.array(key), np.float32))
    state = _fuse_expert_tensors(state, ref.state_dict())
    missing = ref.load_state_dict(state, strict=False).missing_keys
    if sorted(missing) != ["embed_tokens.weight", "shared_head.weight"]:
        raise ValueError(f"{model_dir}: MtpModel weights not covered by mtp.*: {missing}")
    return ref


def _fuse_expert_tensors(state: dict, module_state: dict) -> dict:
    """Per-expert `experts.{e}.{gate,up,down}_proj.weight` -> fused `experts.gate_up_proj` /
    `experts.down_proj` where the reference module stores fused experts (Qwen3.5-MoE)."""
    import re

    import torch

    fused, out = {}, {}
    for name, value in state.items():
        m = re.fullmatch(r"(.*experts\.)(\d+)\.(gate|up|down)_proj\.weight", name)
        if m and m.group(1) + "gate_up_proj" in module_state:
            fused.setdefault(m.group(1), {}).setdefault(m.group(3), {})[int(m.group(2))] = value
        else:
            out[name] = value
    for base, parts in fused.items():
        stack = {w: torch.stack([parts[w][e] for e in sorted(parts[w])]) for w in parts}
        out[base + "gate_up_proj"] = torch.cat([stack["gate"], stack["up"]], dim=1)
        out[base + "down_proj"] = stack["down"]
    return out


def mtp_cache_check(target, mtp, hidden_th, prompt: list[int], rtol: float, q: float) -> dict:
    """`mtp_cache`: the MTP over rows (h_t, x_{t+1}) at positions 1..n-1 through its private KV
    cache, as decoding runs it (all rows but the last 4 in one prefill call, then one row per
    call), vs the same rows in one cache-free forward."""
    from dmtp_jax.decode.caches import kv_cache_shape, kv_cache_value_dim, new_kv_cache

    model, head = nnx.merge(target.graphdef, target.state), nnx.merge(mtp.graphdef, mtp.state)
    n, split = len(prompt), len(prompt) - 1 - DECODE_STEPS
    embeds = model.embed(jnp.asarray([prompt[1:]]))
    hidden = jnp.asarray(hidden_th[None, :-1], target.state_dtype)
    positions = jnp.arange(1, n)[None]
    full, _ = head(embeds, hidden, positions)
    cfg = target.cfg
    cache = new_kv_cache(target.mesh, kv_cache_shape(cfg, 1, -(-(n + 1) // 128) * 128, layers=1),
                         target.state_dtype, kv_cache_value_dim(cfg))
    parts = []
    for lo, hi in [(0, split)] + [(j, j + 1) for j in range(split, n - 1)]:
        h, cache = head(embeds[:, lo:hi], hidden[:, lo:hi], positions[:, lo:hi], cache)
        parts.append(h)
    cached = np.asarray(head.post_norm(jnp.concatenate(parts, axis=1)), np.float32)
    want = np.asarray(head.post_norm(full), np.float32)
    return check("mtp_cache", max_abs_diff(cached[0], want[0], q), scaled_tolerance(rtol, want))


def mtp_check(target, hf_model, model_dir: str, prompt: list[int], rtol: float, q: float) -> dict:
    """`mtp`: our MTP head's logits vs `MtpModel` over rows (h_t, x_{t+1}) of `prompt`; and
    `mtp_cache` (`mtp_cache_check`) on the same rows."""
    import torch

    from dmtp_jax.checkpoint.mtp_ckpt import load_mtp

    mtp = load_mtp(model_dir, target.cfg, target.state_dtype, target.mesh)
    ref = reference_mtp_model(hf_model, model_dir)
    ids = torch.tensor([prompt])
    n = len(prompt)
    with torch.no_grad():
        hidden = hf_model(ids, output_hidden_states=True).hidden_states[-1]
        want = ref._project_to_logits(ref.forward_layer(0, hidden[:, :-1], torch.arange(1, n)[None], None,
                                                        input_ids=ids[:, 1:])).numpy()
    model, head = nnx.merge(target.graphdef, target.state), nnx.merge(mtp.graphdef, mtp.state)
    h, _ = head(model.embed(jnp.asarray([prompt[1:]])), jnp.asarray(hidden[:, :-1].numpy(), target.state_dtype),
                jnp.arange(1, n)[None])
    got = np.asarray(model.logits(head.post_norm(h)), np.float32)
    return [check("mtp", max_abs_diff(got[0], want[0], q), scaled_tolerance(rtol, want)),
            mtp_cache_check(target, mtp, hidden[0].numpy(), prompt, rtol, q)]


def compare_target(model_dir: str, dtype: str = "float32", mesh_spec: str | None = None, seed: int = 0,
                   num_new_tokens: int = 8, reference_dir: str | None = None,
                   draft_dir: str | None = None) -> dict:
    """Compares our JAX target with transformers on `model_dir`; see the module docstring.

    Returns `{"ok", "checks": [{"name", "max_abs_diff", "tolerance", "ok"}, ...], "argmax_agreement",
    "greedy": {"ours", "hf"}, "prompt_lengths", "dtype", "float_quantile"}`. `mesh_spec` (e.g.
    `"tensor=4,data=2"`) places our params on that mesh (default: `make_mesh()`). `reference_dir` loads
    the transformers side from another directory (default `model_dir`), e.g. to check a converted or
    re-exported checkpoint against its original. `draft_dir` adds the drafter checks
    (`drafter_checks`) of a DFlash / DFlash2 directory against the `dflash` package.

    Example:
        >>> r = compare_target("/tmp/tiny-qwen3", dtype="float32", mesh_spec="tensor=1")  # doctest: +SKIP
        >>> r["ok"], [c["name"] for c in r["checks"]][:2]  # doctest: +SKIP
        (True, ['logits', 'argmax_agreement'])
    """
    with quiet_transformers():
        return _compare_target(model_dir, dtype, mesh_spec, seed, num_new_tokens, reference_dir, draft_dir)


@contextlib.contextmanager
def quiet_transformers():
    """transformers' warnings and progress bars off (its load report lists the `mtp.*` tensors it
    does not use, Qwen3.5 models announce their PyTorch fallback kernels): expected, so not shown."""
    from transformers.utils import logging as hf_logging

    level, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


def _compare_target(model_dir: str, dtype: str, mesh_spec: str | None, seed: int, num_new_tokens: int,
                    reference_dir: str | None, draft_dir: str | None) -> dict:
    """The body of `compare_target`."""
    import torch
    from transformers import AutoModelForCausalLM

    from dmtp_jax.checkpoint.hf import load_target
    from dmtp_jax.decode.ar import ARDecoder
    from dmtp_jax.sharding import make_mesh

    dtype = jnp.dtype(dtype).name
    if dtype not in TOLERANCES:
        raise ValueError(f"no tolerances for dtype '{dtype}'; known: {', '.join(TOLERANCES)}")
    rtol, q, argmax_tol, greedy_tol = TOLERANCES[dtype]
    target = load_target(model_dir, dtype, make_mesh(mesh_spec) if mesh_spec else None)
    cfg = target.cfg
    hf_model = AutoModelForCausalLM.from_pretrained(reference_dir or model_dir, dtype=torch.float32).eval()
    prompts = make_prompts(cfg.vocab_size, cfg.max_position_embeddings, seed, reserve=num_new_tokens)
    ref = hf_reference(hf_model, prompts, num_new_tokens)
    tokens, lengths = right_pad(prompts)
    ours = jax_forward(target, tokens)
    cached = jax_cached_logits(target, tokens, lengths)

    def cat(rows):  # real (unpadded) positions of every prompt, concatenated: [sum(T), ...]
        return np.concatenate([r[:n] for r, n in zip(rows, lengths)])

    ref_logits = np.concatenate([r["logits"] for r in ref])
    our_logits = cat(ours["logits"])
    checks = [check("logits", max_abs_diff(our_logits, ref_logits, q), scaled_tolerance(rtol, ref_logits))]
    agree = float(np.mean(our_logits.argmax(-1) == ref_logits.argmax(-1)))
    checks.append(check("argmax_agreement", 1.0 - agree, argmax_tol))
    num_layers = cfg.num_hidden_layers
    for k in range(num_layers):
        mine = cat(ours["final"] if k == num_layers - 1 else ours["captured"][k])
        theirs = np.concatenate([r["hidden"][k] for r in ref])
        checks.append(check(f"hidden_layer_{k}", max_abs_diff(mine, theirs, q), scaled_tolerance(rtol, theirs)))
    checks.append(check("cached_decode", max_abs_diff(cat(cached), our_logits, q),
                        scaled_tolerance(rtol, ref_logits)))
    if cfg.linear_layers:
        checks.append(deltanet_state_check(target, hf_model, prompts[1], rtol, q))

    result = ARDecoder(target).generate(prompts, num_new_tokens, seed=seed, stop_ids=[])
    hf_gen = [r["generated"] for r in ref]
    mismatched = sum(sum(a != b for a, b in zip(o, h)) + abs(len(o) - len(h))
                     for o, h in zip(result.output_ids, hf_gen))
    checks.append(check("greedy_continuation", mismatched / (num_new_tokens * len(prompts)), greedy_tol))
    from dmtp_jax.checkpoint.mtp_ckpt import has_mtp
    if has_mtp(model_dir) and not cfg.is_mla:    # the MLA next-token layer: tests/test_deepseek.py's formula
        checks += mtp_check(target, hf_model, model_dir, prompts[1], rtol, q)
    if draft_dir:
        checks += drafter_checks(target, hf_model, draft_dir, prompts[1], rtol, q)
    return {"ok": all(c["ok"] for c in checks), "checks": checks, "argmax_agreement": agree,
            "greedy": {"ours": result.output_ids, "hf": hf_gen},
            "prompt_lengths": lengths.tolist(), "dtype": dtype, "float_quantile": q}


def format_table(report: dict) -> str:
    """A fixed-width table of the checks and a final `OK` / `FAILED: <names>` line.

    Example:
        >>> print(format_table({"ok": True, "checks": [check("logits", 1.5e-6, 1e-4)]}))
        check     max_abs_diff     tolerance  ok
        logits       1.500e-06     1.000e-04  yes
        OK
    """
    width = max([len("check")] + [len(c["name"]) for c in report["checks"]]) + 2
    lines = [f"{'check':<{width}}{'max_abs_diff':>14}{'tolerance':>14}  ok"]
    for c in report["checks"]:
        lines.append(f"{c['name']:<{width}}{c['max_abs_diff']:>14.3e}{c['tolerance']:>14.3e}  "
                     f"{'yes' if c['ok'] else 'NO'}")
    failed = [c["name"] for c in report["checks"] if not c["ok"]]
    lines.append("OK" if not failed else "FAILED: " + ", ".join(failed))
    return "\n".join(lines)


class mtp_tensors_expected:
    """Context: transformers' targets do not run `mtp.*` tensors and its load report lists them as
    UNEXPECTED (a coloured table on stderr); they are expected here, so they are left out of it.

    Example:
        >>> with mtp_tensors_expected():
        ...     pass
    """

    PATTERN = r"^mtp\."

    def __enter__(self):
        from transformers import PreTrainedModel
        self.saved = PreTrainedModel.__dict__.get("_keys_to_ignore_on_load_unexpected")
        PreTrainedModel._keys_to_ignore_on_load_unexpected = [*(self.saved or []), self.PATTERN]
        return self

    def __exit__(self, *exc):
        from transformers import PreTrainedModel
        PreTrainedModel._keys_to_ignore_on_load_unexpected = self.saved
        return False


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Compare our JAX target with transformers.")
    parser.add_argument("model_dir")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--mesh", default=None, help='e.g. "tensor=4,data=2"')
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-new-tokens", type=int, default=8)
    parser.add_argument("--reference", default=None, help="HF directory of the reference (default: model_dir)")
    args = parser.parse_args()
    rep = compare_target(args.model_dir, args.dtype, args.mesh, args.seed, args.num_new_tokens, args.reference)
    print(format_table(rep))
    raise SystemExit(0 if rep["ok"] else 1)
