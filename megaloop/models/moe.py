"""Mixture-of-experts FFNs through megatron-core's MoELayer, for every megaloop architecture.

A MoE layer is a spec swap of the layer's ``mlp``: megatron-core's ``MoELayer`` (top-k router in
fp32, dropless token dispatch, SequentialMLP experts on CPU / Transformer Engine grouped GEMM on GPU,
allgather dispatch on CPU / alltoall on GPU, optional shared expert). A weight-tied block applied K
times calls the same MoE layer K times: routing is recomputed on every call, and every call adds its
own load-balancing and z-loss terms to the gradient (the objective counts each application once,
exactly as K unrolled copies of the layer would).

One thing megatron-core's bookkeeping cannot do for a loop is done here instead: ``LoopedRouter``
records the routing statistics of every application separately (encoder, decoder iteration 1..K,
LatentLoop visit 1..V) into the model's ``RoutingStats``. megatron-core's own tracker
sums all applications of a layer into one slot keyed by a block-local layer number and, under
activation recomputation, logs during the backward replay; it is left unused.
"""

from __future__ import annotations

import contextlib

import torch
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.moe_utils import (MoEAuxLossAutoScaler,
                                                     compute_routing_scores_for_aux_loss,
                                                     get_tokens_per_expert_and_token_count,
                                                     switch_load_balancing_loss_func, z_loss_func)
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.spec_utils import ModuleSpec

from megaloop.config import ModelConfig
from megaloop.models.build_device import builds_on_gpu

# megatron-core 0.16.1's router gating (RouterGatingLinearFunction) tests ``te_general_gemm is not
# None``, a name moe_utils imports only with Transformer Engine: without it (a CPU, or a GPU with no
# Transformer Engine) every MoE forward raised NameError. None selects its torch matmul.
if not hasattr(moe_utils, "te_general_gemm"):
    moe_utils.te_general_gemm = None


def transformer_config_fields(cfg: ModelConfig, grouped_gemm: bool) -> dict:
    """The MoE fields of a megatron-core TransformerConfig (empty for a dense model).

    ``grouped_gemm`` (Transformer Engine on a GPU) selects grouped-GEMM experts; on a GPU the
    dispatcher is alltoall (it needs CUDA streams), on CPU allgather with SequentialMLP experts."""
    if not cfg.uses_moe:
        return {}
    return dict(
        num_moe_experts=cfg.num_experts,
        moe_ffn_hidden_size=cfg.moe_ffn_hidden_size,
        moe_router_topk=cfg.moe_top_k,
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=cfg.moe_aux_loss_coeff,
        moe_z_loss_coeff=cfg.moe_z_loss_coeff or None,
        moe_router_dtype="fp32",
        # Dropless: a capacity limit would let later tokens of the batch decide whether an earlier
        # token is dropped, a leak across positions.
        moe_expert_capacity_factor=None,
        moe_shared_expert_intermediate_size=cfg.moe_shared_expert_size or None,
        moe_token_dispatcher_type="alltoall" if builds_on_gpu() else "allgather",
        moe_grouped_gemm=grouped_gemm,
    )


class RoutingStats:
    """Routing statistics per application group of one training step.

    Groups are named by the model: "encoder", "iter1".."iterK" (decoder iterations), LatentLoop's
    "prelude", "visit1".."visitV", "coda". The model sets ``group`` before running a block; every MoE
    application records its load-balancing loss, z-loss and tokens per expert (this rank's tokens)
    into the group's row. ``report`` reduces over all ranks and starts the next step.
    """

    def __init__(self, groups: list[str], num_experts: int):
        self.groups, self.num_experts = list(groups), num_experts
        self.group: str | None = None
        # [groups, 4 + experts]: weighted lb, weighted z, weights, routing applications, tokens
        self._sums: torch.Tensor | None = None
        self._units: dict[str, int] = {}  # group -> positions of its first application this step

    @contextlib.contextmanager
    def applying(self, group: str):
        previous, self.group = self.group, group
        try:
            yield
        finally:
            self.group = previous

    def record(self, load_balancing: torch.Tensor, z_loss: torch.Tensor,
               tokens_per_expert: torch.Tensor, positions: int,
               valid: torch.Tensor | None = None, ranks: int = 1) -> None:
        """One application's statistics from this rank's share of its tokens, ``ranks`` ranks
        (sequence or context parallelism) routing the application's tokens between them: the
        load-balancing term is this rank's part of a sum over those ranks (megatron-core's
        formulation), ``z_loss`` this rank's part of the mean over the application's tokens, and
        the tokens its own; so each rank counts 1/``ranks`` of the application, and ``report``'s
        sum over the ranks gives the whole application's values, as one rank computing it all
        would.

        ``positions``: the application's positions over its ranks; ``valid``: how many of them are
        not padding (None: all). The losses are weighed by the valid tokens, so that a padded
        step reports what the same step without its padding would, and an application of padding
        only counts for nothing. The weight's unit is the group's first application this step, so
        an application without padding of the step's shape weighs exactly 1 (the means of an
        unpadded run are plain means, to the bit)."""
        if self.group not in self.groups:  # outside a labelled block, or beyond the trained depth
            return
        if self._sums is None:
            self._sums = torch.zeros(len(self.groups), 4 + self.num_experts, dtype=torch.float64,
                                     device=tokens_per_expert.device)
        unit = self._units.setdefault(self.group, positions or 1)
        if valid is None:
            weight, routing = positions / unit, 1.0
        else:  # tensors: no host synchronisation per application
            weight, routing = valid.double() / unit, (valid > 0).double()
        row = self._sums[self.groups.index(self.group)]
        row[0] += load_balancing.double() * weight
        row[1] += z_loss.double() * weight
        row[2] += weight / ranks
        row[3] += routing / ranks
        row[4:] += tokens_per_expert.double()

    def report(self, group=None) -> dict[str, float]:
        """Per group, over all ranks of ``group`` (collective); resets.

        Keys: moe_lb_loss_<g>, moe_z_loss_<g> (means over the applications weighed by their valid
        tokens), moe_max_load_<g> (largest expert load over the mean load; 1 is balanced) and
        moe_tokens_<g>_e<i> (tokens routed to expert i per application that routes any, i.e. per
        micro-batch of one data-parallel rank). A group none of whose applications routes a
        token is left out. Every layout gives the values of one process (``record``)."""
        sums = self._sums
        if sums is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
            sums = torch.zeros(len(self.groups), 4 + self.num_experts, dtype=torch.float64,
                               device=device)
        self._sums, self._units = None, {}
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(sums, group=group)
        out = {}
        for name, row in zip(self.groups, sums.tolist()):
            weight, applications = row[2], row[3]
            if not weight:
                continue
            tokens = [t / applications for t in row[4:]]
            mean_load = sum(tokens) / len(tokens)
            out[f"moe_lb_loss_{name}"] = row[0] / weight
            out[f"moe_z_loss_{name}"] = row[1] / weight
            out[f"moe_max_load_{name}"] = max(tokens) / mean_load if mean_load else 0.0
            out.update({f"moe_tokens_{name}_e{i}": t for i, t in enumerate(tokens)})
        return out


class LoopedRouter(TopKRouter):
    """megatron-core's TopKRouter that records each application into the model's RoutingStats.

    Statistics are recorded once per application of a training forward: under full activation
    recomputation the layer also runs in the backward pass, outside any labelled group of the
    model's forward, so the replay is not recorded. megatron-core's per-layer tracker stays off (its
    slot, the router's ``layer_number``, stays None).
    """

    stats: RoutingStats | None = None

    def __init__(self, config, pg_collection=None):
        super().__init__(config=config, pg_collection=pg_collection)
        self.global_layer_number: int | None = None

    def set_layer_number(self, layer_number: int) -> None:
        self.global_layer_number = layer_number  # the tracker's slot stays None (see class doc)

    # The trainer's loss is a sum over tokens that finalize_model_grads divides by the token count
    # (calculate_per_token_loss). megatron-core 0.16 then scales each auxiliary loss by the tokens
    # *this rank* routes; under sequence parallelism that is 1/tp of them, while the router's
    # gradient is summed over the tensor-parallel ranks and divided by the whole count, so both
    # auxiliary losses reached the gradient at 1/tp of their weight at TP=1. The two overrides below
    # scale by the tokens of the whole tensor-parallel group instead. And the count divided by is
    # that of the loss tokens, while every position is routed: with a loss mask (fine-tuning's
    # prompt and padding, data.eod_mask_loss) the auxiliary losses weighed positions / loss tokens
    # times their coefficients. ``loss_token_fraction`` (weigh_auxiliary_losses) scales that away.
    # Padding (a ``padding_mask``) is routed by no one, and the ranks' shares of the valid tokens
    # differ: ``valid_tokens`` (this rank's, the group's) counts them (megatron-core's own count,
    # ``valid_token_count``, is the group's under padding: its all-reduce works in place).
    # A LatentLoop compressed visit routes k times fewer tokens (its latents) than the loss counts
    # positions: scaled by its own tokens, its auxiliary losses weighed 1/k of their coefficients
    # in training (at the model level, without per-token loss, 1). ``micro_batch_positions``
    # (weigh_auxiliary_losses; a micro-batch's positions, all its shards) gives each routed token
    # the positions it stands for (``_positions_per_token``), from the shapes of the call itself,
    # so that an activation recomputation's replay weighs alike.
    loss_token_fraction: float = 1.0
    micro_batch_positions: int | None = None
    valid_tokens: tuple[torch.Tensor, torch.Tensor] | None = None

    def _positions_per_token(self, routed: int) -> float:
        """Positions of the micro-batch per token this call routes (``routed`` on this rank, its
        tensor-parallel group's shards together): 1, or a compressed visit's stride (whole:
        training's sequences hold whole latents; a shorter tail, which forms no latent, is left
        out)."""
        if not self.micro_batch_positions or not routed:
            return 1
        return max(1, self.micro_batch_positions // (routed * self.tp_cp_group.size()))

    def attach_and_log_load_balancing_loss(self, activation, aux_loss_coeff, aux_loss,
                                           aux_loss_name, reduce_group, reduce_group_has_dp=False,
                                           valid_token_count=None):
        if self.calculate_per_token_loss:
            if self.valid_tokens is not None:
                group = self.valid_tokens[1]
            else:
                local = activation.shape[0] if valid_token_count is None else valid_token_count
                group = local * self.tp_cp_group.size()
            valid_token_count = (group * self.loss_token_fraction
                                 * self._positions_per_token(activation.shape[0]))
        return super().attach_and_log_load_balancing_loss(
            activation, aux_loss_coeff, aux_loss, aux_loss_name, reduce_group,
            reduce_group_has_dp=reduce_group_has_dp, valid_token_count=valid_token_count)

    def _apply_aux_loss(self, probs, scores_for_aux_loss, routing_map, with_padding_mask=False):
        """megatron-core's load-balancing loss, but one that a tensor-parallel group whose every
        token is padding adds nothing to: megatron-core divides by its 0 valid tokens (0 x inf,
        NaN in every gradient of the step). A LatentLoop micro-batch of records shorter than
        ``latent_stride`` has only padding latents in its compressed visit."""
        coeff = self.get_aux_loss_coeff("aux_loss")
        if coeff == 0 or not with_padding_mask:
            return super()._apply_aux_loss(probs, scores_for_aux_loss, routing_map,
                                           with_padding_mask=with_padding_mask)
        tokens, local, total = get_tokens_per_expert_and_token_count(
            routing_map, self.tp_cp_group, self.topk, with_padding_mask=True)
        aux_loss = switch_load_balancing_loss_func(
            scores_for_aux_loss, tokens, total.clamp(min=1), self.topk,
            self.config.num_moe_experts, coeff, fused=self.config.moe_router_fusion)
        return self.attach_and_log_load_balancing_loss(
            probs, coeff, aux_loss, "load_balancing_loss", self.tp_cp_group,
            valid_token_count=local)

    def apply_z_loss(self, logits: torch.Tensor, padding_mask=None):
        coeff = self.config.moe_z_loss_coeff
        if not (self.calculate_per_token_loss and coeff and self.training
                and torch.is_grad_enabled()):
            return super().apply_z_loss(logits, padding_mask=padding_mask)
        # coeff x (mean over this rank's tokens) x (its token count): the rank's share of the sum
        # over all tokens, which the tensor-parallel reduction completes.
        z_loss = z_loss_func(logits, coeff, padding_mask=padding_mask)
        local = logits.shape[0] if padding_mask is None else (~padding_mask).sum()
        weight = self.loss_token_fraction * self._positions_per_token(logits.shape[0])
        return MoEAuxLossAutoScaler.apply(logits, z_loss * local * weight)

    def routing(self, logits: torch.Tensor, padding_mask=None):
        """megatron-core's routing, and the statistics. With a ``padding_mask`` ([N, B], True at
        padding), megatron-core leaves padding out of the auxiliary losses but still dispatches
        it to experts; here padding is dispatched to none (its FFN output is zero: padding is
        trailing, so that output reaches no real position, and no loss reads it)."""
        ranks = self.tp_cp_group.size()
        self.valid_tokens = None
        if padding_mask is not None:
            padding_mask = padding_mask.reshape(-1)
            if self.training:
                local = (~padding_mask).sum()
                group = local.clone()
                if ranks > 1:
                    torch.distributed.all_reduce(group, group=self.tp_cp_group)
                self.valid_tokens = (local, group)
        probs, routing_map = super().routing(logits, padding_mask)
        if padding_mask is not None:
            valid = ~padding_mask[:, None]
            probs, routing_map = probs * valid, routing_map & valid
        if self.stats is not None and self.training:
            with torch.no_grad():
                logits = logits.view(-1, self.config.num_moe_experts).float()
                aux_map, scores = compute_routing_scores_for_aux_loss(
                    logits, self.topk, self.score_function, padding_mask=padding_mask)
                tokens, _, total = get_tokens_per_expert_and_token_count(
                    aux_map, self.tp_cp_group, self.topk,
                    with_padding_mask=padding_mask is not None)
                if padding_mask is not None:  # all padding: 0, not 0 / 0 (_apply_aux_loss)
                    total = total.clamp(min=1)
                load_balancing = switch_load_balancing_loss_func(
                    scores, tokens, total, self.topk, self.config.num_moe_experts, 1.0)
                z_loss = z_loss_func(logits, 1.0, padding_mask=padding_mask)
                # This rank's part of the mean over the application's (valid) tokens.
                if self.valid_tokens is None:
                    z_loss = z_loss.double() / ranks
                else:
                    local, group = self.valid_tokens
                    z_loss = z_loss.double() * local / group.clamp(min=1)
                valid = None if self.valid_tokens is None else self.valid_tokens[1]
                self.stats.record(load_balancing, z_loss, routing_map.sum(dim=0),
                                  positions=logits.shape[0] * ranks, valid=valid, ranks=ranks)
        return probs, routing_map


class CpuSeededSequentialMLP(SequentialMLP):
    """megatron-core's SequentialMLP (the local spec's experts), whose CPU initialisation gives
    every expert-parallel rank its own experts: the weights of a layout with expert parallelism
    are then those of the same model without it.

    megatron-core's CPU initialisation (use_cpu_initialization) draws each weight from torch's
    default generator, which every rank seeds alike; each expert-parallel rank drew its local
    experts from where rank 0 drew its own, so expert e + E/EP started as a copy of expert e.
    Here every rank draws all E experts, in order, and keeps its own, as megatron-core's CPU
    initialisation of a tensor-parallel weight draws the whole matrix on every rank and keeps
    its shard. (A GPU build draws its experts from megatron-core's expert-parallel RNG stream,
    seeded per expert-parallel rank and alike on an expert's replicas; a layout with expert
    parallelism then starts from other expert weights than one without.)"""

    def __init__(self, num_local_experts, config, submodules, pg_collection=None):
        ep = pg_collection.ep
        if not (config.use_cpu_initialization and config.perform_initialization) or ep.size() == 1:
            super().__init__(num_local_experts, config, submodules, pg_collection)
            return
        super().__init__(num_local_experts * ep.size(), config, submodules, pg_collection)
        first = ep.rank() * num_local_experts
        self.local_experts = torch.nn.ModuleList(
            self.local_experts[first:first + num_local_experts])
        self.num_local_experts = num_local_experts


def moe_spec(backend, grouped_gemm: bool) -> ModuleSpec:
    """The ``mlp`` spec of a MoE layer: megatron-core's MoELayer with LoopedRouter, local or TE
    experts and a shared-expert spec (used when the config sets a shared expert size)."""
    expert_module, expert_submodules = backend.grouped_mlp_modules(grouped_gemm, False)
    if expert_module is SequentialMLP:
        expert_module = CpuSeededSequentialMLP
    dense = MLPSubmodules(linear_fc1=backend.column_parallel_linear(),
                          linear_fc2=backend.row_parallel_linear())
    return ModuleSpec(
        MoELayer,
        submodules=MoESubmodules(experts=ModuleSpec(expert_module, submodules=expert_submodules),
                                 shared_experts=ModuleSpec(SharedExpertMLP, submodules=dense),
                                 router=LoopedRouter),
    )


def routers(module: torch.nn.Module) -> list[LoopedRouter]:
    return [m for m in module.modules() if isinstance(m, LoopedRouter)]


def weigh_auxiliary_losses(models: list[torch.nn.Module], batches: list[dict]) -> None:
    """Before a training step: sets every router's ``loss_token_fraction`` to the step's loss
    tokens over its routed positions (those not padding), over all ranks (a collective;
    ``batches``: this rank's micro-batches, with ``loss_mask`` and, for fine-tuning,
    ``padding_mask``), so that each auxiliary loss reaches the gradient with its coefficient, as
    a token-weighted mean over the routed positions, however many of them the loss masks."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    counts = torch.tensor(
        [sum(float(batch["loss_mask"].sum()) for batch in batches),
         sum(batch["loss_mask"].numel() - int(batch.get("padding_mask", torch.zeros(())).sum())
             for batch in batches)], dtype=torch.float64, device=device)
    if torch.distributed.is_initialized():  # replicas (TP, PP) count alike: the ratio holds
        torch.distributed.all_reduce(counts)
    fraction = (counts[0] / counts[1]).item() if counts[1] else 1.0
    positions = batches[0]["loss_mask"].numel() if batches else None  # all alike: [B, seq]
    for model in models:
        for router in routers(model):
            router.loss_token_fraction = fraction
            router.micro_batch_positions = positions
