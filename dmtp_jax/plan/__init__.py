"""Plan before you rent: compile the functions a run would use for the machine it would run on, on
this CPU machine, without the weights and without the hardware.

`plan_inference` (`infer.py plan`) and `plan_training` (`train.py plan`) lower the very jitted
functions a run compiles on abstract models (`plan.models`), compile them for the target machine
(`plan.topology`) and report per-device memory, FLOPs, bytes against the analytic minimum and, on
TPU, the compiler's time estimate (`plan.report`). Usage: docs/sizing.md."""

from __future__ import annotations

from dmtp_jax.plan.compile import DoesNotFitError  # noqa: F401
from dmtp_jax.plan.report import PlanResult, cost_notes, format_plan, gib  # noqa: F401
from dmtp_jax.decode import make_decoder
from dmtp_jax.decode.drafting import DEFER_WINDOW, deferred_nbytes, deferred_widths
from dmtp_jax.plan.compile import compile_function
from dmtp_jax.plan.inference import inference_calls
from dmtp_jax.plan.models import plan_models, shard_bytes
from dmtp_jax.plan.topology import open_topology
from dmtp_jax.platform import compiling_for
from dmtp_jax.sharding import make_mesh
from dmtp_jax.models.draft_head import head_name
from dmtp_jax.checkpoint.hf import place_abstract
from dmtp_jax.checkpoint.draft_head_ckpt import abstract_draft_head


def _mesh_sizes(mesh) -> dict:
    return {k: int(v) for k, v in mesh.shape.items()}


def _hbm(topo, hbm_gb: float | None) -> int:
    return int(hbm_gb * 2**30) if hbm_gb else topo.hbm_bytes


def plan_inference(target: str, *, method: str = "dmtp", draft: str | None = None, block_size: int | None = None,
                   mesh: str | None = None, batch_size: int = 1, prompt_len: int = 1024, max_new_tokens: int = 256,
                   dtype: str = "bfloat16", rounds_per_dispatch: int = 1, topology: str = "cpu:1",
                   hbm_gb: float | None = None, temperature: float = 0.0, mtp_steps: int = 4,
                   verify: str = "rejection", accept_len: float | None = None, prefill_chunk: int | None = None,
                   exact_cost: bool = False, draft_head: str = "full", draft_head_rank: int | None = None,
                   draft_head_shortlist: int | None = None, draft_head_vocab: int | None = None,
                   prefix_cache_gb: float = 0.0, mtp: str | None = None, progress=None) -> PlanResult:
    """Compiles the prefill and the decode step / round / K-round dispatch of `method` for one request of
    `batch_size` prompts of `prompt_len` tokens and `max_new_tokens` new ones.

    `target` / `draft`: checkpoint directories or `config.json` files (no weights; without `draft`
    the default drafter shape). `accept_len`: tokens per round, turns the time estimate into
    tokens/s. `prefill_chunk`: tokens per prefill call. `exact_cost`: also compile an unrolled copy
    for exact FLOPs, bytes and time. `draft_head`: "efficient" (`draft_head_vocab` N: N scored ids) or
    "int8". `prefix_cache_gb`: `serve`'s prefix-cache budget, counted whole per device. `mtp`: a
    separate MTP head's directory or `config.json` (a `gemma4_assistant`; default: the target's native head).
    `progress(name)` is called before each compile."""
    topo = open_topology(topology)
    device_mesh = make_mesh(mesh, devices=topo.devices)
    notes = []
    with compiling_for(topo.platform, device_mesh.size):
        models = plan_models(target, method, device_mesh, dtype, draft, block_size, mtp)
        if draft_head != "full" and method != "ar":
            models["draft_head"] = place_abstract(*abstract_draft_head(
                draft_head, models["target"].cfg, dtype, draft_head_rank, draft_head_shortlist, draft_head_vocab),
                device_mesh)
        if "mtp" in models and models["mtp"].model_dir is None:
            notes.append("the target's config declares no MTP layer (mtp_num_hidden_layers); planned with one "
                         "native MTP head of the target's layer shape")
        decoder = make_decoder(method, models["target"], models.get("drafter"), mtp=models.get("mtp"),
                               fusion=models.get("fusion"), block_size=block_size, mtp_steps=mtp_steps,
                               verify=verify, rounds_per_dispatch=rounds_per_dispatch,
                               prefill_chunk=prefill_chunk, draft_head=models.get("draft_head"),
                               draft_model=models.get("draft_model"))
        calls = inference_calls(decoder, batch_size, prompt_len, max_new_tokens, temperature, accept_len)
        functions = []
        for call in calls:
            if progress:
                progress(call.name)
            functions.append(compile_function(call.name, call.lower, min_bytes=call.min_bytes, calls=call.calls,
                                              tokens_per_call=call.tokens_per_call, parts=call.parts,
                                              exact_cost=exact_cost))
    weights = {name: shard_bytes(m.state) for name, m in models.items()}
    state = {k.split(":", 1)[1]: v for k, v in calls[0].parts.items() if k.startswith("cache:")}
    settings = {"method": method, "batch": batch_size, "prompt": prompt_len, "new tokens": max_new_tokens,
                "dtype": dtype, "prefill chunk": decoder.prefill_chunk}
    if method != "ar":
        settings["block"] = decoder.slots
        settings["draft head"] = head_name(models["draft_head"].cfg if "draft_head" in models else None)
    if rounds_per_dispatch > 1:
        settings["rounds/dispatch"] = rounds_per_dispatch
    if temperature:
        settings["temperature"] = temperature
    resident = 0
    if prefix_cache_gb:           # GiB, as serve's `--prefix-cache-gb` (checked >= 0 by preflight)
        resident = state["prefix cache (serve)"] = int(prefix_cache_gb * 2**30)
    if draft is None and "drafter" in models:
        d = models["drafter"].cfg
        notes.append(f"drafter: the default shape ({d.num_hidden_layers} layers of the target's width, "
                     f"context from target layers {list(d.target_layer_ids)}); --draft DIR|CONFIG.json for yours")
    if method != "ar" and models.keys() & {"drafter", "mtp", "draft_model"}:    # serve's switching bank
        hidden, captured = deferred_widths(models["target"].cfg, models["drafter"].cfg if "drafter" in models else None)
        notes.append(f"`serve --method auto` over {method} also keeps "
                     f"{gib(deferred_nbytes(batch_size, DEFER_WINDOW, hidden, captured, dtype))} of deferred rows per "
                     f"device ({DEFER_WINDOW} positions per row, replicated; not in the peak)")
    notes += cost_notes(functions, exact_cost)
    return PlanResult("inference", topology, topo.platform, topo.device_kind, device_mesh.size,
                      _mesh_sizes(device_mesh), _hbm(topo, hbm_gb), topo.peak_bytes_per_s, settings, weights, state,
                      functions, notes, resident)
