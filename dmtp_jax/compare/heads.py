"""The drafting side of the comparison (`dmtp_jax.compare`): the native MTP head against
transformers' `MtpModel` (and its cached path against its full forward), a `gemma4_assistant`
against transformers' `Gemma4AssistantForCausalLM` (steps chained as its candidate generator chains
them), a DFlash / DFlash2 drafter against the `dflash` package."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dmtp_jax.checkpoint.dflash_ckpt import load_drafter
from dmtp_jax.checkpoint.mtp_ckpt import load_mtp
from dmtp_jax.checkpoint.safetensors_io import CheckpointReader
from dmtp_jax.compare.checks import DECODE_STEPS, check, max_abs_diff, scaled_tolerance
from dmtp_jax.decode.caches import TargetCaches, kv_cache_shape, kv_cache_value_dim, new_kv_cache
from dmtp_jax.models.fusion import draft_block_embeds


def drafter_checks(target, hf_model, draft_dir: str, prompt: list[int], rtol: float, q: float) -> list[dict]:
    """`draft_hidden` / `draft_logits`: our DFlash / DFlash2 drafter vs the `dflash` package on one
    block drafted after `prompt` (context = the prompt's target features, anchor = HF's next token)."""
    import torch     # optional: the `test` extra
    from dflash.model import (DFlash2DraftModel, DFlashDraftModel,     # optional: the `test` extra
                              _make_cache, _output_head, extract_context_feature)

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


MTP_RENAMES = {"fc": "eh_proj", "pre_fc_norm_embedding": "enorm", "pre_fc_norm_hidden": "hnorm",
               "norm": "post_norm"}


def reference_mtp_model(hf_model, model_dir: str):
    """transformers' generic `MtpModel` on `hf_model`, filled from `model_dir`'s `mtp.*` tensors
    (Qwen3.5 names -> `layers.0.{eh_proj, enorm, hnorm, post_norm, mtp_block.*}`)."""
    import torch     # optional: the `test` extra
    from transformers.modeling_layers import MtpModel     # needs torch (the `test` extra)

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
    import torch     # optional: the `test` extra

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
    import torch     # optional: the `test` extra

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


@functools.partial(jax.jit, static_argnums=(0, 1))
def _assistant_steps(target_graphdef, assistant_graphdef, target_state, assistant_state, ids_bt, step_tokens_bs, cache):
    """The target over `ids_bt` (positions 0..p-1) through `cache`, then one assistant step per column
    of `step_tokens_bs`, all at position p over that cache: per step `(h', fp32 logits)`."""
    tm, am = nnx.merge(target_graphdef, target_state), nnx.merge(assistant_graphdef, assistant_state)
    p = ids_bt.shape[1]
    out = tm(ids_bt, jnp.broadcast_to(jnp.arange(p), ids_bt.shape), cache)
    state, positions, got = out.hidden_bth[:, -1:], jnp.full(ids_bt.shape[:1] + (1,), p), []
    for j in range(step_tokens_bs.shape[1]):
        state, _ = am(tm.embed(step_tokens_bs[:, j:j + 1]), state, positions, target_kv=out.cache.kv)
        got.append((am.feature(state), am.scores(tm, None, state).logits))
    return got


def assistant_check(target, hf_model, assistant_dir: str, prompt: list[int], rtol: float, q: float,
                    steps: int = 2) -> list[dict]:
    """`assistant_hidden` / `assistant_logits`: our `gemma4_assistant` vs transformers' on `steps` chained
    steps after `prompt[:-1]` (the first reads `(E(prompt[-1]), h_{p-1})`, each next one the reference's
    argmax and `h'`, all at position p over the target's K/V of positions < p), max over the steps."""
    import torch     # optional: the `test` extra
    from transformers import AutoModelForCausalLM     # needs torch (the `test` extra)

    assistant = load_mtp(assistant_dir, target.cfg, target.state_dtype, target.mesh)
    ref = AutoModelForCausalLM.from_pretrained(assistant_dir, dtype=torch.float32).eval()
    p = len(prompt) - 1
    ids = torch.tensor([prompt])
    tokens, want_h, want_logits = [prompt[p]], [], []
    with torch.no_grad():
        out = hf_model.model(ids[:, :p], output_hidden_states=True, return_shared_kv_states=True)
        h, tok = out.hidden_states[-1][:, -1:], ids[:, p:]
        for _ in range(steps):
            step = ref(inputs_embeds=torch.cat([hf_model.model.embed_tokens(tok), h], -1),
                       position_ids=torch.tensor([[p]]), shared_kv_states=out.shared_kv_states,
                       attention_mask=torch.ones(1, p + 1, dtype=torch.long))
            want_h.append(step.last_hidden_state[0].numpy())
            want_logits.append(step.logits[0].float().numpy())
            tok, h = step.logits.argmax(-1), step.last_hidden_state
            tokens.append(int(tok))
    cache = TargetCaches(target).new(1, -(-(p + 1) // 128) * 128)
    got = _assistant_steps(target.graphdef, assistant.graphdef, target.state, assistant.state,
                           jnp.asarray([prompt[:p]], jnp.int32), jnp.asarray([tokens[:steps]], jnp.int32), cache)
    got_h = np.concatenate([np.asarray(h[0], np.float32) for h, _ in got])
    got_logits = np.concatenate([np.asarray(lg[0], np.float32) for _, lg in got])
    want_h, want_logits = np.concatenate(want_h), np.concatenate(want_logits)
    return [check("assistant_hidden", max_abs_diff(got_h, want_h, q), scaled_tolerance(rtol, want_h)),
            check("assistant_logits", max_abs_diff(got_logits, want_logits, q), scaled_tolerance(rtol, want_logits))]
