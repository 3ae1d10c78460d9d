"""The ALRS training hook: spectra computed once per logical matrix, spread over ranks by cost.

The matrices are ``WeightBlock``s (``megaloop.alrs.blocks``): by default Q, K, V, Global K, Global V,
gate and up are split out of megatron-core's fused weights, as the reference analyses them; a
weight-tied decoder matrix is analysed once. Per analysis step every rank of ``group`` (default:
the whole world) does the same:
1. Each TP rank cuts its part of every block out of its shard of the parameter (megatron-core marks
   TP-sharded parameters ``tensor_model_parallel=True`` with a ``partition_dim``); the parts are
   gathered over ``tp_group`` onto the rank that owns the block and concatenated in TP rank order,
   because α must be that of the full block, never of a shard.
2. Each rank computes the statistics of the matrices it owns. Owners come from a greedy
   longest-processing-time assignment on m·n·min(m, n), identical on every rank.
3. One all-gather of the small per-matrix (α, stable rank, normalised stable rank) table in fp64.
   Every rank then runs the same float arithmetic on the same numbers, so all ranks apply
   bit-identical multipliers.

Every rank must call ``step`` with the same step numbers (the collectives must line up). Every
rank lists every matrix of the model, under names no layout changes (``megaloop.alrs.experts``),
and only a rank holding a matrix analyses it; the all-gathered table gives every rank all
multipliers. MoE experts are blocks of their own, named by their global index: under expert
parallelism a rank holds some experts. Pipeline stages hold some layers (``pipeline_group``
completes each stage's list with the others'); the tied copies of a decoder layer that several
stages hold share one name, so the layer is analysed once, by one of its holders, and every copy
gets its multiplier.
A failure inside the hook never reaches training: it is logged as a warning and the multipliers
stay as they were. What may fail on one rank alone before a collective is agreed on first (the
blocks' parts and buffers, before the first TP gather), so that no rank goes on to training's
collectives while its peers wait in the hook's.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from megaloop.alrs import experts
from megaloop.alrs.allocator import allocate, initial_multipliers, is_decoder, is_embedding_or_head
from megaloop.alrs.blocks import fused_layouts, weight_blocks
from megaloop.alrs.estimator import SpectralStats, spectral_stats
from megaloop.alrs.log import ALRSLog, require_zarr
from megaloop.alrs.schedule import ALRSConfig, MultiplierSchedule, config_error
from megaloop.training.collective import said_by_this_rank

logger = logging.getLogger("megaloop.alrs")

BASE_GROUP = "base"  # LR-log name of everything ALRS does not scale (norms, biases, excluded)
NamedParameters = Callable[[], Iterable[tuple[str, torch.Tensor]]]
# torch 2.13 renamed all_gather_into_tensor (deprecated there); older releases only have the old name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _by_name(models: list[nn.Module]) -> Iterable[tuple[str, torch.Tensor]]:
    """The models' parameters under their layout-independent names, each name once (the tied
    copies a pipeline rank holds of a decoder layer are equal)."""
    named = {}
    for model in models:
        for name, param in experts.named_parameters(model):
            named.setdefault(name, param)
    return named.items()


def balance_by_cost(costs: list[int], n_ranks: int,
                    allowed: list[list[int] | None] | None = None) -> list[int]:
    """Owner rank per item: largest first onto the least-loaded rank (ties: lowest index), among
    ``allowed[i]`` (the ranks that hold item i; None: any)."""
    loads = [0] * n_ranks
    owner = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        candidates = allowed[i] if allowed is not None and allowed[i] is not None \
            else range(n_ranks)
        rank = min(candidates, key=lambda r: (loads[r], r))
        owner[i] = rank
        loads[rank] += costs[i]
    return owner


class ALRS:
    """Heavy-tail-guided layerwise LR multipliers, one per logical weight matrix.

    Args:
        named_parameters: the model, or a callable returning its (name, parameter) pairs. It is
            called at each analysis, so the hook always reads the live tensors. Fused weights are
            split into blocks (``config.granularity="block"``) only when the model is given: a
            callable's parameters are analysed whole.
        total_steps: T, the number of optimizer steps of the run.
        config: ALRS options (default: the paper's).
        group: the ranks that share the work (default: the world when torch.distributed is up).
        tp_group: megatron-core's tensor-parallel group, needed when TP > 1.
        log_path: zarr store for spectra and LRs, written by global rank 0 only (every rank
            checks that zarr is installed, so that all fail alike when it is not).

    Call ``step(step, base_lr)`` once per optimizer step (1-based), after backward and before the
    optimizer step, on every rank; it returns ``{block_name: multiplier}`` for the analysed blocks
    (``WeightBlock.name``: the parameter name, plus ``:q`` etc. for a part of a fused weight).
    Each block's LR is multiplier·base_lr; ``megaloop.training.optimizer.LRMultipliers`` applies
    that exactly, also inside fused parameters. Other parameters keep base_lr.
    """

    def __init__(self, named_parameters: nn.Module | list[nn.Module] | NamedParameters,
                 total_steps: int, config: ALRSConfig | None = None, *,
                 group: dist.ProcessGroup | None = None, tp_group: dist.ProcessGroup | None = None,
                 pipeline_group: dist.ProcessGroup | None = None, log_path: str | None = None):
        if total_steps < 1:
            raise ValueError(f"ALRS total_steps must be >= 1, got total_steps={total_steps}")
        self.config = config or ALRSConfig()
        self.total_steps = total_steps
        models = ([named_parameters] if isinstance(named_parameters, nn.Module)
                  else list(named_parameters) if isinstance(named_parameters, (list, tuple))
                  else None)
        self._named_parameters = ((lambda: _by_name(models)) if models is not None
                                  else named_parameters)
        self._distributed = dist.is_available() and dist.is_initialized()
        self.group = group if group is not None or not self._distributed else dist.group.WORLD
        self.world_size = dist.get_world_size(self.group) if self._distributed else 1
        self.rank = dist.get_rank(self.group) if self._distributed else 0
        self.tp_group = tp_group
        tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
        layouts = {}
        if models is not None and self.config.granularity == "block":
            for model in models:
                layouts.update(experts.global_layouts(model, fused_layouts(model)))
        named = list(self._named_parameters())
        self._check_exclude_matches([name for name, param in named if param.ndim == 2])
        local = weight_blocks(named, layouts, self.config.exclude, tp_size)
        self.matrices = (experts.every_block(local, experts.num_experts(models[0]),
                                             pipeline_group) if models is not None else local)
        self.names = [m.name for m in self.matrices]
        self._check_prefixes_match()
        if log_path is not None:
            require_zarr()
        if self.world_size > 1:
            self._check_same_matrices_on_all_ranks()
        self.owner = balance_by_cost([m.cost for m in self.matrices], self.world_size,
                                     self._holders({m.name for m in local}))
        self.schedule = MultiplierSchedule(initial_multipliers(self.names, self.config),
                                           self.config.transition)
        self.last_stats: dict[str, SpectralStats] = {}
        self._last_analysis = 0
        self._last_step = 0
        is_writer = not self._distributed or dist.get_rank() == 0
        unread = self.config.unread_options()
        if unread and is_writer:
            logger.warning("ALRS: %s does not read %s (no effect on this run)",
                           self.config.reader(), ", ".join(f"alrs.{u}" for u in unread))
        # The default prefixes need not all match (a tied model has no output_layer), but a model
        # of other names (the hook on another code base, or one without embedding) pins nothing.
        held = any(p.ndim == 2 and is_embedding_or_head(n, self.config) for n, p in named)
        if ("embedding_head_prefixes" in self.config.read_options()
                and not any(self._from_every_rank(held)) and is_writer):
            logger.warning("ALRS: no weight name starts with alrs.embedding_head_prefixes=%s, so "
                           "alrs.embedding_head=%r treats no matrix as embedding or head (set "
                           "them to this model's; its names are e.g. %r)",
                           list(self.config.embedding_head_prefixes), self.config.embedding_head,
                           self.names[0] if self.names else "-")
        note = self.config.transition_note(total_steps)
        if note and is_writer:
            logger.warning("%s", note)
        if is_writer and self._boosts_every_layer():
            logger.warning("ALRS: alrs.decoder_prefix=%r starts the name of every matrix but the "
                           "embedding and head's (a model without encoder layers, e.g. "
                           "model.arch=dense or fullloop): alrs.mode='decoder_boost' multiplies "
                           "the LR of all layers alike, by alrs.decoder_boost=%g",
                           self.config.decoder_prefix, self.config.decoder_boost)
        self.log, self._log_rewound = None, False
        error = None
        if log_path is not None and is_writer:
            try:
                self.log = ALRSLog(log_path, self.names, [m.full_shape for m in self.matrices],
                                   self.names + [BASE_GROUP], self.config.to_dict(),
                                   self.config.log_eigenvalues)
            except (ValueError, OSError) as e:  # ConfigError: another run's log
                error = str(e)
        # The writer's failure fails every rank, none waits for it.
        error = next((e for e in self._from_every_rank(error) if e), None)
        if error is not None:
            raise config_error(error)

    def step(self, step: int, base_lr: float | None = None) -> dict[str, float]:
        """Multipliers for optimizer step ``step``; analyses and allocates when the schedule says.
        The first call forgets the log's rows at and after ``step`` (those of a run that started
        over in the same directory, or went past the checkpoint it is resumed from)."""
        if self.log is not None and not self._log_rewound:
            self.log.truncate_after(step - 1)
            self._log_rewound = True
        if step != self._last_analysis and self.config.analyses_at(step, self.total_steps):
            try:
                self._analyse(step)
            except Exception:  # the hook must never stop training
                logger.warning("ALRS: analysis at step %d failed; multipliers unchanged", step,
                               exc_info=True)
            self._last_analysis = step
        multipliers = self.schedule.at(step)
        self._last_step = step
        if self.log is not None and base_lr is not None:
            try:
                lrs = {name: m * base_lr for name, m in multipliers.items()}
                self.log.append_lrs(step, {**lrs, BASE_GROUP: base_lr})
            except Exception:
                logger.warning("ALRS: writing the LR log failed at step %d", step, exc_info=True)
        return multipliers

    def state_dict(self) -> dict:
        """What a checkpoint holds; also commits the buffered LR rows, so that a resume from
        this checkpoint continues a log without a gap."""
        if self.log is not None:
            self.log.flush()
        return {"names": list(self.names), "schedule": self.schedule.state_dict(),
                "last_analysis": self._last_analysis, "last_step": self._last_step}

    def load_state_dict(self, state: dict) -> None:
        """Restores the exact multipliers; log rows after the checkpoint's step are forgotten."""
        if list(state["names"]) != self.names:
            raise config_error(
                f"the checkpoint's ALRS state names other matrices than this model (e.g. "
                f"{next(iter(set(state['names']) ^ set(self.names)), '-')!r}): a checkpoint "
                f"saved with another alrs.granularity (now {self.config.granularity!r}), "
                "alrs.exclude or model")
        self.schedule.load_state_dict(state["schedule"])
        self._last_analysis = int(state["last_analysis"])
        self._last_step = int(state["last_step"])
        if self.log is not None:
            self.log.flush()
            self.log.truncate_after(self._last_step)

    def close(self) -> None:
        """Writes buffered LR rows; call at the end of training."""
        if self.log is not None:
            self.log.flush()

    def _analyse(self, step: int) -> None:
        params = dict(self._named_parameters())
        full = self._gather_owned(params)
        mine = [i for i, r in enumerate(self.owner) if r == self.rank]
        rows, eigs = [], []
        for i in mine:
            name = self.names[i]
            stats, lam = SpectralStats(math.nan, math.nan, math.nan), torch.empty(0)
            try:
                if i in full:  # else its failure to be joined is logged
                    stats, lam = spectral_stats(full.pop(i), name, self.config.eig_method)
            except Exception:
                logger.warning("ALRS: statistics of %s failed; alpha is NaN", name, exc_info=True)
            rows.append((stats.alpha, stats.stable_rank, stats.norm_stable_rank))
            eigs.append(lam)
        table, eig_table = self._all_gather(rows, eigs)
        self.last_stats = {n: SpectralStats(*table[i]) for i, n in enumerate(self.names)}
        allocated = self.config.allocates_at(step, self.total_steps)
        if allocated:
            alphas = {n: s.alpha for n, s in self.last_stats.items()}
            self.schedule.retarget(step, allocate(alphas, self.config, self.schedule.target))
        if self.log is not None:
            stats = {"alpha": [s.alpha for s in self.last_stats.values()],
                     "stable_rank": [s.stable_rank for s in self.last_stats.values()],
                     "norm_stable_rank": [s.norm_stable_rank for s in self.last_stats.values()],
                     "multiplier": [self.schedule.target[n] for n in self.names]}
            try:  # after the allocation: step()'s warning would say the multipliers did not change
                self.log.append_spectra(step, allocated, stats, eig_table)
            except Exception:
                logger.warning("ALRS: writing the spectra log failed at step %d (the multipliers "
                               "are allocated)", step, exc_info=True)

    def _gather_owned(self, params: dict[str, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Full blocks this rank owns; TP ranks' parts of a block are gathered to its owner, one
        block at a time (a block's fp32 copies and parts are freed before the next: all of them
        at once would cost 4 bytes per local parameter at each analysis).

        What may fail on one rank alone (a part's copy, the owner's buffers: its memory) is
        agreed over the TP group before each gather, and over ``group`` at the end: a rank that
        failed between gathers went on to training's collectives while its peers waited in the
        next gather, until the process-group timeout. Then every rank raises the failure alike
        (``step`` logs it). A block that cannot be joined after its gather is its owner's alone."""
        tp_ranks = dist.get_process_group_ranks(self.tp_group) if self._tp_sharded() else []
        full, error = {}, None
        for i, block in enumerate(self.matrices):
            owner = self.owner[i]
            if block.partition_dim is not None:
                owner = dist.get_global_rank(self.group, owner)
                if owner not in tp_ranks:  # another TP group holds the owner and gathers it
                    continue
            elif owner != self.rank:
                continue
            shard = parts = None
            if error is None:
                try:
                    shard = block.local(params[block.param].detach())
                    if block.partition_dim is None:
                        full[i] = shard
                        continue
                    shard = shard.to(torch.float32).contiguous()
                    parts = ([torch.empty_like(shard) for _ in tp_ranks]
                             if owner == dist.get_rank() else None)
                except Exception as e:
                    error = said_by_this_rank(f"{type(e).__name__}: {e}")
            if block.partition_dim is None:
                continue
            if self._failed_in_tp_group(error is not None):
                break
            dist.gather(shard, parts, dst=owner, group=self.tp_group)
            if parts is not None:
                try:  # gather_list follows TP rank order, i.e. shard order
                    full[i] = torch.cat(parts, dim=block.partition_dim)
                except Exception:  # after the gather: this block's alone, its alpha NaN
                    logger.warning("ALRS: joining the parts of %s failed; alpha is NaN",
                                   self.names[i], exc_info=True)
        error = next((e for e in self._from_every_rank(error) if e), None)
        if error is not None:
            raise RuntimeError(f"gathering the blocks to analyse failed: {error}")
        return full

    def _failed_in_tp_group(self, failed: bool) -> bool:
        """Collective over the TP group: whether any of its ranks failed (one small all-reduce
        per gathered block)."""
        flag = torch.tensor([float(failed)], device=self._collective_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.tp_group)
        return bool(flag.item())

    def _holders(self, local: set[str]) -> list[list[int] | None]:
        """Per matrix, the ranks of ``group`` that hold it (the stages of a pipeline, the ranks of
        an expert), or None for a matrix every rank holds."""
        everyone = self._from_every_rank(local)
        holders = []
        for m in self.matrices:
            ranks = [r for r, held in enumerate(everyone) if m.name in held]
            holders.append(None if len(ranks) == self.world_size else ranks)
        return holders

    def _from_every_rank(self, value) -> list:
        """Collective over ``group``: every rank's ``value``, in rank order (``[value]`` alone)."""
        if self.world_size == 1:
            return [value]
        everyone = [None] * self.world_size
        dist.all_gather_object(everyone, value, group=self.group)
        return everyone

    def _tp_sharded(self) -> bool:
        return any(m.partition_dim is not None for m in self.matrices)

    def _all_gather(self, rows: list[tuple], eigs: list[torch.Tensor]):
        """Every matrix's (α, stable rank, normalised stable rank) on every rank, in fp64; also
        the eigenvalues by name when they are logged."""
        counts = [self.owner.count(r) for r in range(self.world_size)]
        width = max(counts, default=0)
        n_eig = max((min(m.full_shape) for m in self.matrices), default=0)
        n_eig = n_eig if self.config.log_eigenvalues else 0
        device = self._collective_device()
        local = torch.full((width, 3 + n_eig), math.nan, dtype=torch.float64)
        for row, (stats, lam) in enumerate(zip(rows, eigs)):
            local[row, :3] = torch.tensor(stats, dtype=torch.float64)
            if n_eig and lam.numel():
                local[row, 3:3 + lam.numel()] = lam.cpu()
        if self.world_size > 1:
            gathered = torch.empty((self.world_size * width, 3 + n_eig), dtype=torch.float64,
                                   device=device)
            _all_gather_single(gathered, local.to(device), group=self.group)
            gathered = gathered.cpu()
        else:
            gathered = local
        slot, position = [], [0] * self.world_size
        for r in self.owner:  # rank r's rows are its matrices in index order, like ``mine``
            slot.append(r * width + position[r])
            position[r] += 1
        table = [tuple(gathered[s, :3].tolist()) for s in slot]
        eig_table = None
        if n_eig:
            eig_table = {m.name: gathered[s, 3:3 + min(m.full_shape)].numpy()
                         for m, s in zip(self.matrices, slot)}
        return table, eig_table

    def _collective_device(self) -> torch.device:
        if self._distributed and dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _check_exclude_matches(self, names: list[str]) -> None:
        """A pattern of ``exclude`` that no 2-D parameter (``names``) of any rank contains would
        exclude nothing: a typo leaves the matrices it was meant for scaled, and one naming only
        norms or biases leaves what ALRS never scales. Refused in one line."""
        unmatched = {p for p in self.config.exclude if not any(p in name for name in names)}
        unmatched = set.intersection(*self._from_every_rank(unmatched))
        if unmatched:
            raise config_error(f"alrs.exclude={list(self.config.exclude)!r}: "
                               f"{sorted(unmatched)[0]!r} is in no weight matrix's name (ALRS "
                               f"analyses and scales 2-D weights only; e.g. "
                               f"{names[0] if names else 'none'!r})")

    def _check_prefixes_match(self) -> None:
        """A prefix the mode reads (``ALRSConfig.read_options``) that no matrix name starts with
        (a typo) would leave the matrices it was meant for at multiplier 1 or in the α range:
        refused in one line. Every rank lists the same names, so every rank decides alike. The
        default embedding/head prefixes are exempt: a tied model has no output_layer."""
        config, read = self.config, self.config.read_options()
        prefixes = []
        if "decoder_prefix" in read:
            prefixes.append(("decoder_prefix", config.decoder_prefix))
        if ("embedding_head_prefixes" in read
                and config.embedding_head_prefixes != ALRSConfig().embedding_head_prefixes):
            prefixes += [("embedding_head_prefixes", p) for p in config.embedding_head_prefixes]
        for field, prefix in prefixes:
            if not any(name.startswith(prefix) for name in self.names):
                example = self.names[0] if self.names else "-"
                raise config_error(f"alrs.{field}: {prefix!r} starts no matrix name (e.g. "
                                   f"{example!r}), so alrs.mode={config.mode!r} would treat no "
                                   "matrix by it")

    def _boosts_every_layer(self) -> bool:
        """Whether decoder_boost leaves no layer matrix unboosted: a boost that differs from a
        higher base LR only on embedding and head."""
        config = self.config
        return config.mode == "decoder_boost" and all(
            is_decoder(name, config) or is_embedding_or_head(name, config)
            for name in self.names)

    def _check_same_matrices_on_all_ranks(self) -> None:
        mine = [(m.name, m.full_shape) for m in self.matrices]
        if any(other != mine for other in self._from_every_rank(mine)):
            raise ValueError("ALRS needs every rank of its group to list the same matrices; give "
                             "it the model (its expert and pipeline blocks are then completed)")
