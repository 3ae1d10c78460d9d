"""megatron-core optimizer and LR schedule, with per-matrix LR multipliers settable while training.

AdamW (decoupled weight decay: torch multiplies it by the group LR, so a matrix whose LR is scaled by
s also decays s times faster, as in the ALRS reference), gradient clipping, the distributed optimizer
over data-parallel ranks, and megatron-core's OptimizerParamScheduler (linear warmup, cosine decay to
a floor). ``LRMultipliers`` gives every weight matrix its own parameter group so that its LR can be
set to multiplier x base LR at any step; ALRS drives it.
"""

from __future__ import annotations

import math

import torch
from megatron.core.optimizer import (OptimizerConfig, ParamKey, get_megatron_optimizer,
                                     get_standard_config_overrides)
from megatron.core.optimizer.optimizer_config import ParamPredicate
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megaloop.config import RunConfig

_GROUP_KEY = "megaloop_matrix"  # copied into each per-matrix param group by megatron-core


class LRMultipliers:
    """Per-matrix learning-rate multipliers: lr_i(t) = m_i * base_lr(t).

    The multipliers are megaloop's own state (saved in checkpoints), never read back from optimizer
    param groups: megatron-core matches param groups on reload by a key that per-matrix groups share.
    """

    def __init__(self, optimizer, scheduler: OptimizerParamScheduler, matrix_names: list[str]):
        self.optimizer, self.scheduler = optimizer, scheduler
        self.names = set(matrix_names)
        # Group order is deterministic (megatron-core sorts groups by their override key), so the
        # group -> matrix mapping is recorded once and re-applied after a checkpoint reload.
        self.group_names = [g.get(_GROUP_KEY) for g in optimizer.param_groups]
        self.multipliers: dict[str, float] = {}

    def set(self, multipliers: dict[str, float]) -> None:
        unknown = set(multipliers) - self.names
        if unknown:
            raise KeyError(f"no per-matrix LR group for {sorted(unknown)[:3]} (known: matrices "
                           "of the model, e.g. 'decoder.layers.0.mlp.linear_fc1.weight')")
        bad = {k: v for k, v in multipliers.items() if not (math.isfinite(v) and v > 0)}
        if bad:
            raise ValueError(f"LR multipliers must be finite and > 0, got {bad}")
        self.multipliers.update(multipliers)

    def apply(self) -> None:
        """Sets every group's LR from the scheduler's base LR at its current step. The trainer
        calls it before every optimizer step, which is when ``set`` takes effect."""
        for group, name in zip(self.optimizer.param_groups, self.group_names):
            group[_GROUP_KEY] = name
            group["lr"] = self.scheduler.get_lr(group) * self.multipliers.get(name, 1.0)

    def group_lrs(self) -> dict[str, float]:
        return {name or "base": group["lr"]
                for group, name in zip(self.optimizer.param_groups, self.group_names)}

    def state_dict(self) -> dict:
        return {"multipliers": dict(self.multipliers)}

    def load_state_dict(self, state: dict) -> None:
        self.multipliers = dict(state["multipliers"])


def matrix_names(model: torch.nn.Module) -> list[str]:
    """Names of the physical 2-D weights (a module called K times is listed once)."""
    return [name for name, p in model.named_parameters() if p.dim() == 2 and p.requires_grad]


def build_optimizer(model_chunks: list, unwrapped: torch.nn.Module, cfg: RunConfig):
    """Returns (optimizer, scheduler, LRMultipliers); every weight matrix gets its own group."""
    train = cfg.train
    opt_config = OptimizerConfig(
        optimizer="adam", lr=train.lr, min_lr=train.lr * train.min_lr_ratio,
        weight_decay=train.weight_decay, adam_beta1=train.adam_beta1, adam_beta2=train.adam_beta2,
        clip_grad=train.clip_grad, bf16=unwrapped.config.bf16,
        params_dtype=unwrapped.config.params_dtype,
        use_distributed_optimizer=train.distributed_optimizer,
    )
    # Passing overrides replaces megatron-core's default "no weight decay on 1-D params" rule, so
    # it is merged back in.
    overrides = get_standard_config_overrides(opt_config)
    names = matrix_names(unwrapped)
    params = dict(unwrapped.named_parameters())
    for name in names:
        # Matched by identity, so wrapper prefixes ("module.") in the names do not matter.
        key = ParamKey(predicate=ParamPredicate(name=name, fn=lambda p, t=params[name]: p is t))
        overrides[key] = {_GROUP_KEY: name}
    optimizer = get_megatron_optimizer(opt_config, model_chunks, config_overrides=overrides)
    warmup = int(train.warmup_fraction * train.train_steps)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=opt_config.lr, min_lr=opt_config.min_lr,
        lr_warmup_steps=warmup, lr_decay_steps=train.train_steps, lr_decay_style="cosine",
        start_wd=train.weight_decay, end_wd=train.weight_decay, wd_incr_steps=train.train_steps,
        wd_incr_style="constant",
    )
    return optimizer, scheduler, LRMultipliers(optimizer, scheduler, names)
