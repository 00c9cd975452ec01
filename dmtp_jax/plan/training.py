"""`train.py plan`: the drafter's train step compiled for the plan's machine on abstract weights,
with the frozen target's and the optimizer's shares shown apart.

Example:
    >>> plan = plan_training("configs/models/qwen3.6-27b.json", method="dmtp", mesh="data=2,fsdp=4",
    ...                      topology="v5p:2x2x2", batch_size=64, seq_len=4096)  # doctest: +SKIP
"""

from __future__ import annotations

from dmtp_jax.plan.report import PlanResult, cost_notes


def plan_training(target: str, *, method: str = "dmtp", mesh: str | None = None, batch_size: int = 8,
                  seq_len: int = 4096, target_dtype: str = "bfloat16", compute_dtype: str = "bfloat16",
                  draft_layers: int = 5, block_size: int = 8, num_anchors: int = 16, grad_accum: int = 1,
                  topology: str = "cpu:1", hbm_gb: float | None = None, exact_cost: bool = False,
                  progress=None) -> PlanResult:
    """Compiles `Trainer.lower_step(batch_size, seq_len)` for a fresh drafter of the target
    (`default_drafter_config` with `draft_layers` / `block_size`), the target (and, for the DMTP
    methods, its MTP head) frozen at `target_dtype`.

    Example:
        >>> plan = plan_training("configs/models/qwen3.6-27b.json", topology="v5p:2x2x2",
        ...                      mesh="data=2,fsdp=4", batch_size=64)  # doctest: +SKIP
    """
    from dmtp_jax.errors import InputError
    from dmtp_jax.models.drafter_shape import default_drafter_config
    from dmtp_jax.plan.compile import compile_function
    from dmtp_jax.plan.models import shard_bytes, target_config_of
    from dmtp_jax.plan.topology import open_topology
    from dmtp_jax.platform import compiling_for
    from dmtp_jax.sharding import make_mesh
    from dmtp_jax.train.loop import default_gamma
    from dmtp_jax.train.loss import uses_mtp
    from dmtp_jax.train.step import OptimConfig, StepConfig, Trainer, abstract_models

    for name, value in (("batch-size", batch_size), ("seq-len", seq_len), ("draft-layers", draft_layers),
                        ("num-anchors", num_anchors), ("grad-accum", grad_accum)):
        if value < 1:
            raise InputError(f"--{name} must be >= 1, got {value}")
    if batch_size % grad_accum:
        raise InputError(f"--batch-size {batch_size} is not a multiple of --grad-accum {grad_accum}")
    if seq_len < block_size + 1:
        raise InputError(f"--seq-len {seq_len} is shorter than a block ({block_size}) + 1")
    topo = open_topology(topology)
    device_mesh = make_mesh(mesh, devices=topo.devices)
    cfg = target_config_of(target)
    dcfg = default_drafter_config(cfg, draft_layers, block_size)
    with compiling_for(topo.platform, device_mesh.size):
        target_model, mtp = abstract_models(cfg, target_dtype, device_mesh, with_mtp=uses_mtp(method))
        scfg = StepConfig(method=method, block_size=block_size, num_anchors=num_anchors,
                          gamma=default_gamma(block_size),
                          grad_accum=grad_accum, compute_dtype=compute_dtype)
        trainer = Trainer(target_model, dcfg, scfg, OptimConfig(), device_mesh, mtp=mtp)
        train_state = trainer.abstract_state()
        weights = {"target (frozen)": shard_bytes(target_model.state)}
        if mtp is not None:
            weights["mtp (frozen)"] = shard_bytes(mtp.state)
        state = {"drafter params (fp32)": shard_bytes(train_state.params), "optimizer": shard_bytes(train_state.opt_state)}
        parts = {**{f"weights:{k}": v for k, v in weights.items()}, **{f"state:{k}": v for k, v in state.items()}}
        if progress:
            progress("train_step")
        fn = compile_function("train_step", lambda: trainer.lower_step(batch_size, seq_len),
                              min_bytes=sum(weights.values()) + sum(state.values()),
                              tokens_per_call=batch_size * seq_len, parts=parts, exact_cost=exact_cost)
    settings = {"method": method, "batch": batch_size, "seq": seq_len, "target dtype": target_dtype,
                "compute dtype": compute_dtype, "draft layers": draft_layers, "block": block_size,
                "anchors": num_anchors}
    if grad_accum > 1:
        settings["grad accum"] = grad_accum
    notes = cost_notes([fn], exact_cost) + [f"drafter: a fresh {draft_layers}-layer DFlash drafter of the target's width, context from target "
             f"layers {list(dcfg.target_layer_ids)}; AdamW state in fp32"]
    return PlanResult("training", topology, topo.platform, topo.device_kind, device_mesh.size,
                      {k: int(v) for k, v in device_mesh.shape.items()},
                      int(hbm_gb * 2**30) if hbm_gb else topo.hbm_bytes, topo.peak_bytes_per_s, settings, weights,
                      state, [fn], notes)
