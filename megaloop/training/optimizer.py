"""megatron-core optimizer and LR schedule, with per-matrix LR multipliers settable while training.

AdamW (decoupled weight decay: torch multiplies it by the group LR, so a matrix whose LR is scaled by
s also decays s times faster, as in the ALRS reference), gradient clipping, the distributed optimizer
over data-parallel ranks, and megatron-core's OptimizerParamScheduler (linear warmup, cosine decay to
a floor). ``LRMultipliers`` sets the LR of every logical weight matrix (``megaloop.alrs.blocks``) to
multiplier x base LR at any step; ALRS drives it.

Blocks inside a fused weight (Q/K/V of ``linear_qkv``, gate/up of ``linear_fc1``, Global K/V) share
one torch parameter and so one LR, and Adam ignores any scaling of their gradients. Their multipliers
are applied inside the optimizer step instead (``BlockUpdateScaling``): an Adam/AdamW update is
linear in the LR, p' = p - lr * (m_hat / (sqrt(v_hat) + eps) + wd * p), so scaling the update of
each block's elements by its multiplier gives exactly the step of a parameter group with that LR,
weight decay included. The other design, unfused Q/K/V/gate/up parameters, would change the model:
three GEMMs instead of one, Transformer Engine's fused norm+linear lost, and checkpoints that no
megatron-core tool reads. The cost here is one fp32 copy of the fused weights' optimizer shards
(1/DP of them under the distributed optimizer) for the duration of the step, and three element-wise
passes over them; nothing at all while every multiplier is 1.

Without apex / Transformer Engine, megatron-core's distributed optimizer runs torch Adam, whose
per-parameter state a checkpoint needs help with: ``materialise_optimizer_state`` before saving or
loading a fresh optimizer, ``restore_torch_adam_steps`` after a load.
"""

from __future__ import annotations

import math

import torch
from megatron.core.optimizer import (OptimizerConfig, ParamKey, get_megatron_optimizer,
                                     get_standard_config_overrides)
from megatron.core.optimizer.optimizer_config import ParamPredicate
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megaloop.alrs import experts
from megaloop.alrs.blocks import WeightBlock, fused_layouts, weight_blocks
from megaloop.config import ConfigError, RunConfig, TrainConfig

_GROUP_KEY = "megaloop_matrix"  # copied into each per-matrix param group by megatron-core


def _main_params(optimizer):
    """(torch optimizer, main param, model param, offset) for every parameter the torch optimizers
    update: the main param is the tensor stepped (the model param itself, its fp32 copy, or a
    distributed-optimizer shard, which holds the model param's flattened elements from offset on)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import (ChainedOptimizer, Float16OptimizerWithFloat16Params,
                                                   FP32Optimizer)

    if isinstance(optimizer, ChainedOptimizer):
        for inner in optimizer.chained_optimizers:
            yield from _main_params(inner)
    elif isinstance(optimizer, DistributedOptimizer):
        for models, shards in ((optimizer.model_fp32_groups, optimizer.shard_fp32_groups),
                               (optimizer.model_float16_groups,
                                optimizer.shard_fp32_from_float16_groups)):
            for model_group, shard_group in zip(models, shards):
                for model_param, shard in zip(model_group, shard_group):
                    start = optimizer._get_model_param_range_map(model_param)["param"].start
                    yield optimizer.optimizer, shard, model_param, start
    elif isinstance(optimizer, Float16OptimizerWithFloat16Params):
        for models, mains in zip(optimizer.float16_groups, optimizer.fp32_from_float16_groups):
            for model_param, main in zip(models, mains):
                yield optimizer.optimizer, main, model_param, 0
        for group in optimizer.fp32_from_fp32_groups:
            for param in group:
                yield optimizer.optimizer, param, param, 0
    elif isinstance(optimizer, FP32Optimizer):
        for group in optimizer.optimizer.param_groups:
            for param in group["params"]:
                yield optimizer.optimizer, param, param, 0
    else:
        raise ConfigError(f"per-block LRs inside fused weights do not support "
                          f"{type(optimizer).__name__}; set alrs.granularity=parameter")


def _scale_rows_(flat: torch.Tensor, row_scale: torch.Tensor, start: int, cols: int) -> None:
    """Multiplies, in place, the elements [start, start + len(flat)) of a row-major [rows, cols]
    matrix (given flattened) by the scale of their row: a partial first row, whole rows, a partial
    last row."""
    n = flat.numel()
    head = min(n, (-start) % cols)
    if head:
        flat[:head].mul_(row_scale[start // cols])
    first_full = (start + head) // cols
    full = (n - head) // cols
    if full:
        rows = row_scale[first_full:first_full + full, None]
        flat[head:head + full * cols].view(full, cols).mul_(rows)
    if head + full * cols < n:
        flat[head + full * cols:].mul_(row_scale[first_full + full])


class _Target:
    """One fused parameter's main tensor as one torch optimizer steps it."""

    def __init__(self, optimizer, main, model_param, start, blocks: list[WeightBlock]):
        self.optimizer, self.main, self.start = optimizer, main, start
        self.cols = model_param.shape[1]
        self.names = [b.name for b in blocks]
        row_block = torch.full((model_param.shape[0],), -1, dtype=torch.long)
        for i, block in enumerate(blocks):
            row_block[block.local_rows(model_param.shape[0])] = i
        assert bool((row_block >= 0).all()), f"{self.names}: the blocks do not cover every row"
        self.row_block = row_block.to(main.device)
        self.scales: list[float] = [1.0] * len(blocks)
        self.row_scale: torch.Tensor | None = None  # None: every block at multiplier 1
        self.before: torch.Tensor | None = None


class BlockUpdateScaling:
    """Scales the optimizer update of each block of a fused parameter by the block's multiplier.

    Hooks every torch optimizer under a megatron-core optimizer (FP32, mixed precision, distributed,
    chained): before its step it copies the main tensors of fused parameters whose blocks do not
    all have multiplier 1, after it sets p = p_before + s_row * (p - p_before) for each row's
    block multiplier s_row. The parameter's group LR stays the base LR. Exact for any update that
    is linear in the LR (Adam, AdamW, SGD with momentum); a distributed-optimizer shard may start
    and end anywhere in a block, which ``_scale_rows_`` handles.
    """

    def __init__(self, optimizer, fused: dict[torch.Tensor, list[WeightBlock]]):
        by_id = {id(p): blocks for p, blocks in fused.items()}
        self.targets: list[_Target] = []
        hooked = {}
        for inner, main, model_param, start in _main_params(optimizer):
            blocks = by_id.get(id(model_param))
            if blocks is None:
                continue
            if main is None or main.dtype != torch.float32:
                raise ConfigError("per-block LRs inside fused weights need fp32 main params (not "
                                  "megatron-core's precision-aware optimizer); set "
                                  "alrs.granularity=parameter")
            self.targets.append(_Target(inner, main, model_param, start, blocks))
            hooked[id(inner)] = inner
        for inner in hooked.values():
            inner.register_step_pre_hook(self._before_step)
            inner.register_step_post_hook(self._after_step)

    def set(self, multipliers: dict[str, float]) -> None:
        """Multipliers by block name (missing: 1), used from the next optimizer step on."""
        for target in self.targets:
            scales = [multipliers.get(name, 1.0) for name in target.names]
            if scales == target.scales:  # no host-to-device copy while the multipliers stand
                continue
            target.scales = scales
            if all(s == 1.0 for s in scales):
                target.row_scale = None
            else:
                table = torch.tensor(scales, dtype=torch.float32, device=target.main.device)
                target.row_scale = table[target.row_block]

    @torch.no_grad()
    def _before_step(self, optimizer, args, kwargs) -> None:
        for target in self.targets:
            if target.optimizer is optimizer and target.row_scale is not None:
                target.before = target.main.detach().clone()

    @torch.no_grad()
    def _after_step(self, optimizer, args, kwargs) -> None:
        for target in self.targets:
            if target.optimizer is not optimizer or target.before is None:
                continue
            main, before = target.main.detach(), target.before
            update = (main - before).view(-1)
            _scale_rows_(update, target.row_scale, target.start, target.cols)
            main.copy_(before.add_(update.view_as(before)))
            target.before = None


class LRMultipliers:
    """Per-block learning-rate multipliers: lr_b(t) = m_b * base_lr(t) for every weight block.

    A whole weight matrix has its own parameter group, whose LR is set; the blocks of a fused weight
    get theirs through ``BlockUpdateScaling``. The multipliers are megaloop's own state (saved in
    checkpoints), never read back from optimizer param groups: megatron-core matches param groups
    on reload by a key that per-matrix groups share.
    """

    def __init__(self, optimizer, scheduler: OptimizerParamScheduler, blocks: list[WeightBlock],
                 params: dict[str, list[torch.Tensor]], known: list[str] | None = None):
        """``params``: the tensors of each parameter name (several for the tied copies of a
        decoder layer on one pipeline rank); ``known``: names a multiplier may be set for, default
        the blocks'; under expert or pipeline parallelism also the blocks other ranks hold (set
        everywhere, applied where held)."""
        self.optimizer, self.scheduler = optimizer, scheduler
        self.names = [b.name for b in blocks]
        self._known = set(known or self.names)
        # Group order is deterministic (megatron-core sorts groups by their override key), so the
        # group -> parameter mapping is recorded once and re-applied after a checkpoint reload.
        self.group_names = [g.get(_GROUP_KEY) for g in optimizer.param_groups]
        fused: dict[str, list[WeightBlock]] = {}
        for block in blocks:
            if block.rows is not None:
                fused.setdefault(block.param, []).append(block)
        self.scaling = (BlockUpdateScaling(optimizer, {t: b for p, b in fused.items()
                                                       for t in params[p]})
                        if fused else None)
        self.multipliers: dict[str, float] = {}

    def set(self, multipliers: dict[str, float]) -> None:
        unknown = set(multipliers) - self._known
        if unknown:
            raise KeyError(f"no weight block named {sorted(unknown)[:3]} (known: blocks of the "
                           "model, e.g. 'decoder.layers.0.mlp.linear_fc2.weight', "
                           "'decoder.layers.0.mlp.linear_fc1.weight:gate')")
        bad = {k: v for k, v in multipliers.items() if not (math.isfinite(v) and v > 0)}
        if bad:
            raise ValueError(f"LR multipliers must be finite and > 0, got {bad}")
        self.multipliers.update(multipliers)

    def apply(self) -> None:
        """Sets every group's LR from the scheduler's base LR at its current step, and the block
        scales of fused weights. The trainer calls it before every optimizer step, which is when
        ``set`` takes effect."""
        for group, name in zip(self.optimizer.param_groups, self.group_names):
            group[_GROUP_KEY] = name
            # A fused weight's group keeps the base LR (its name is no block's name).
            group["lr"] = self.scheduler.get_lr(group) * self.multipliers.get(name, 1.0)
        if self.scaling is not None:
            self.scaling.set(self.multipliers)

    def block_lrs(self, base_lr: float) -> dict[str, float]:
        """The LR of every block at base LR ``base_lr``."""
        return {name: base_lr * self.multipliers.get(name, 1.0) for name in self.names}

    def state_dict(self) -> dict:
        return {"multipliers": dict(self.multipliers)}

    def load_state_dict(self, state: dict) -> None:
        unknown = set(state["multipliers"]) - self._known
        if unknown:
            raise ConfigError(f"the checkpoint's LR multipliers name weight blocks this model does "
                              f"not have (e.g. {sorted(unknown)[0]!r}): saved with another "
                              "alrs.granularity or model")
        self.multipliers = dict(state["multipliers"])


def load_fully_reshardable_into_torch_adam() -> None:
    """Lets megatron-core 0.16.1 load ``fully_reshardable`` distributed-optimizer state into
    torch's Adam (without Transformer Engine or Apex). Its ``load_state_dict`` first loads the
    step from the param groups into every parameter's Adam state, then
    ``load_parameter_state_from_fully_reshardable`` reads the parameter state leaving "step" out
    and ``_set_main_param_and_optimizer_states`` copies every key of the Adam state from it, "step"
    too: KeyError 'step'. Here a parameter's step, already loaded, stays as it is."""
    from megatron.core.optimizer import distrib_optimizer

    optimizer_class = distrib_optimizer.DistributedOptimizer
    original = optimizer_class._set_main_param_and_optimizer_states
    if distrib_optimizer.HAVE_APEX_OR_TE or getattr(original, "keeps_step", False):
        return

    def set_states(self, model_param, tensors):
        group, order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group]["params"][order]]
        if "step" in state and "step" not in tensors:
            tensors = {**tensors, "step": state["step"]}
        return original(self, model_param, tensors)

    set_states.keeps_step = True
    optimizer_class._set_main_param_and_optimizer_states = set_states


def decay_arguments(train: TrainConfig) -> dict:
    """megatron-core OptimizerParamScheduler's decay arguments for ``train.lr_schedule``."""
    if train.lr_schedule != "wsd":
        return {"lr_decay_style": train.lr_schedule}
    return {"lr_decay_style": "WSD", "wsd_decay_steps": train.wsd_decay_steps,
            "lr_wsd_decay_style": train.resolved_wsd_decay_style}


def scheduler_state(scheduler) -> dict:
    """megatron-core's scheduler state with the WSD decay (length, shape) its own leaves out: a
    resume that keeps a checkpoint's schedule (checkpoint.keep_schedule) gets it from there, and
    not from a config that may hold another (a run that kept an earlier checkpoint's)."""
    return {**scheduler.state_dict(), "wsd_decay_steps": scheduler.wsd_decay_steps,
            "lr_wsd_decay_style": scheduler.lr_wsd_decay_style}


def build_optimizer(model_chunks: list, models: list[torch.nn.Module], cfg: RunConfig):
    """Returns (optimizer, scheduler, LRMultipliers); every weight matrix gets its own group.
    ``model_chunks``: the DDP-wrapped chunks of ``models`` (this rank's pipeline stages)."""
    from megatron.core import parallel_state as ps

    train = cfg.train
    load_fully_reshardable_into_torch_adam()
    opt_config = OptimizerConfig(
        optimizer="adam", lr=train.lr, min_lr=train.lr * train.min_lr_ratio,
        weight_decay=train.weight_decay, adam_beta1=train.adam_beta1, adam_beta2=train.adam_beta2,
        clip_grad=train.clip_grad, bf16=models[0].config.bf16,
        params_dtype=models[0].config.params_dtype,
        use_distributed_optimizer=train.distributed_optimizer,
    )
    # Passing overrides replaces megatron-core's default "no weight decay on 1-D params" rule, so
    # it is merged back in.
    overrides = get_standard_config_overrides(opt_config)
    # Parameters by names every rank and layout agrees on (megaloop.alrs.experts): MoE experts by
    # their global index, as ALRS names them; the tied copies of a decoder layer that pipeline
    # stages hold share a name, so a group and an LR.
    copies: dict[str, list[torch.Tensor]] = {}
    layouts = {}
    for model in models:
        for name, param in experts.named_parameters(model):
            copies.setdefault(name, []).append(param)
        if cfg.alrs.granularity == "block":
            layouts.update(experts.global_layouts(model, fused_layouts(model)))
    blocks = weight_blocks(((n, held[0]) for n, held in copies.items() if held[0].requires_grad),
                           layouts)
    for name in dict.fromkeys(b.param for b in blocks):
        # Matched by identity, so wrapper prefixes ("module.") in the names do not matter.
        key = ParamKey(predicate=ParamPredicate(
            name=name, fn=lambda p, held=copies[name]: any(p is t for t in held)))
        overrides[key] = {_GROUP_KEY: name}
    optimizer = get_megatron_optimizer(opt_config, model_chunks, config_overrides=overrides)
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner._filter_and_reorder_param_groups = _groups_in_their_order
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=opt_config.lr, min_lr=opt_config.min_lr,
        lr_warmup_steps=train.warmup_steps, lr_decay_steps=train.train_steps, **decay_arguments(train),
        start_wd=train.weight_decay, end_wd=train.weight_decay, wd_incr_steps=train.train_steps,
        wd_incr_style="constant",
    )
    pipeline = ps.get_pipeline_model_parallel_group() if cfg.parallel.pipeline > 1 else None
    every = experts.every_block(blocks, experts.num_experts(models[0]), pipeline)
    return optimizer, scheduler, LRMultipliers(optimizer, scheduler, blocks, copies,
                                               known=[b.name for b in every])


def _groups_in_their_order(current_groups: list[dict], loaded_groups: list[dict]) -> list[dict]:
    """Stands in for megatron-core's ``_filter_and_reorder_param_groups`` when an optimizer
    without the distributed optimizer loads a checkpoint. That method pairs loaded groups with the
    optimizer's by (wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr), which megatron-core
    keeps unique by merging parameters; megaloop's groups are one per matrix and share those
    values, so the pairing collapsed them onto one group and scrambled the Adam state on resume.
    The groups are built in the same order for the same model, so they pair by position; a
    group whose identity differs (a changed weight-decay rule) is still refused."""
    from megatron.core.optimizer.optimizer import param_group_identifier_keys

    def identity(group: dict) -> tuple:
        return (group.get(_GROUP_KEY),) + tuple(group.get(k) for k in param_group_identifier_keys)

    mismatched = [(identity(a), identity(b)) for a, b in zip(current_groups, loaded_groups)
                  if identity(a) != identity(b)]
    if len(current_groups) != len(loaded_groups) or mismatched:
        raise ValueError(f"optimizer parameter groups differ from the checkpoint's: "
                         f"{len(loaded_groups)} saved, {len(current_groups)} now"
                         + (f"; first differing: {mismatched[0]}" if mismatched else ""))
    return loaded_groups


def materialise_optimizer_state(optimizer) -> None:
    """Without apex / Transformer Engine, megatron-core's DistributedOptimizer.state_dict() reads
    the step counter from torch Adam's per-parameter state, which exists only after a first step;
    a fresh optimizer (about to be loaded into, or saved at step 0) gets megatron-core's own
    zero-gradient dummy step. That step must move and count nothing, or a run that saved a seed
    checkpoint would train differently from one that did not: it runs with LR and weight decay 0
    in every group (the scheduler's LR is the peak LR at step 0 without warmup, and decoupled
    decay shrinks the weights even with zero gradients; L2 decay would fill Adam's moments), and
    the step counts it advanced (torch Adam's per parameter, fused Adam's per group) are set back
    to 0, where a first real step then counts 1 as in a fresh optimizer."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not isinstance(inner, DistributedOptimizer) or inner.optimizer.state:
            continue
        groups = inner.optimizer.param_groups
        saved = [(group["lr"], group["weight_decay"]) for group in groups]
        for group in groups:
            group["lr"] = group["weight_decay"] = 0.0
        try:
            inner._init_optimizer_states_with_dummy_values()
        finally:
            for group, (lr, weight_decay) in zip(groups, saved):
                group["lr"], group["weight_decay"] = lr, weight_decay
        for group in groups:
            if "step" in group:
                group["step"] = 0
        for state in inner.optimizer.state.values():
            if "step" in state:
                state["step"] = torch.zeros_like(state["step"])


def restore_torch_adam_steps(optimizer, optimizer_state: dict) -> None:
    """After ``optimizer.load_state_dict(optimizer_state)``: torch Adam (used without apex /
    Transformer Engine) keeps a per-parameter step count that megatron-core's dp_reshardable
    parameter state does not store, so the load leaves the loading template's value; the true
    count is in the saved param groups."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    states = [optimizer_state] if len(inner) == 1 else [optimizer_state[i]
                                                        for i in range(len(inner))]
    for distributed, saved in zip(inner, states):
        if not isinstance(distributed, DistributedOptimizer):
            continue
        steps = {g["step"] for g in saved["optimizer"]["param_groups"] if "step" in g}
        for param_state in distributed.optimizer.state.values():
            if "step" in param_state and len(steps) == 1:
                param_state["step"] = torch.tensor(float(next(iter(steps))))
