"""LatentLoop: a looped (MoE) model whose middle block is visited V times, some visits reduced to
save compute, with a causal, scaled writeback when the reduction compresses the sequence (seed
paper 001).

    h = Prelude(Embed(x))                            P layers once      (checkpoint keys encoder.*)
    for v = 1..V:                                    M middle layers    (decoder.*, visits.visit<v>.*)
        full v:        h = h + a_v * (Block(h) - h)
        reduced v:     z = Reduce(h);  D = Block_v(z) - z;  h = h + a_v * Expand(D)
    logits = Head(Norm(Coda(h)))                     C layers once      (coda.*)

A visit is a module built from a spec (``visit_spec``). The visits in ``latent_visits`` are reduced
by one of the paper's four first-visit reductions (``latent_reduction``):
- ``sequence``: Reduce pools k tokens into a latent, Expand writes the latents' updates back
  (``LatentCompression``, a submodule of the visit's spec, not a wrapper around the model);
- ``width``: Reduce projects the residual stream d -> d/2, Expand projects the update back d/2 -> d
  (``LatentProjection``, learned [d/2, d] and [d, d/2] matrices, a submodule of the spec), and
  Block_v is the middle block at width d/2 (below);
- ``top_k``: Block_v routes each token to moe_top_k // 2 experts (Reduce, Expand: identity);
- ``expert_ffn``: Block_v's experts (and shared expert) use the first half of their hidden units.
The residual scale a_v is learned or fixed per visit.

Compression with stride k and writeback lag l, positions 0-based:
- latent i is the mean of tokens ki .. ki+k-1. Only complete groups are pooled: the N mod k tokens
  of an odd-length tail form no latent (they still receive the writeback below), so a position's
  output never depends on the sequence length (generation extends a prefix unchanged);
- latent i's update D_i is written to the k positions ki+k-1+l+s, s = 0..k-1, scaled by learned
  channel vectors: h[ki+k-1+l+s] += w_s * D_i. Position p receives only latents made of tokens <= p,
  and latents attend causally to earlier latents, so no position sees a later token. The first
  k-1+l positions receive nothing. The paper's pairs (2j-1, 2j) with receivers (2j, 2j+1), 1-based,
  are k=2, l=0; its "writeback lag" ablation is l=1;
- RoPE: latent i takes the position of its last token, ki+k-1, so distances between latents are
  those between the tokens they end at, and a latent never sits before a token it contains.

Weight sharing across visits. The middle block (``decoder``) is shared by every visit unless a
visit needs other weights or another shape: ``untie_attention`` / ``untie_moe`` give visits 2..V
their own attention / FFN, and a reduced visit of the top_k, width or expert_ffn kind runs a block
built for its reduction. Such a visit gets its own TransformerBlock whose shared parameters are
*borrowed* from ``decoder``: referenced, not registered, so they are saved, counted, moved and
optimised once, as the owner's. Where the visit's block is narrower (width: every d-sized side of
a matrix or norm is d/2; expert_ffn: the experts' hidden units), its parameters are the leading
block of the shared ones, cut at each call (``_NarrowedParameters``); a gated FFN's fused
[gate; up] rows give the leading rows of each half.

Why the narrowed visits share the block rather than own narrow weights: the paper prices every
untied part it reports in experts (untying attention: 76 -> 75 experts; untying MoE: 75 -> 50) but
compares the four reductions at one matched budget with no such trade, so they keep the loop's
parameters; and it calls the halved experts incomplete, i.e. part of the same experts. The width
reduction keeps the heads, head dim, expert count and expert width: only the residual width
halves, so every matrix of the visit has half its parameters and the attention scores are
unchanged. Any fixed part of a shared matrix would do (the projections are learned); the leading
one is the same in every layout: tensor parallelism splits heads and FFN units, never d, and a MoE
LatentLoop runs without tensor parallelism (no sequence parallelism), so expert hidden units are
not split either.

Every visit is static (no per-call switch), so activation recomputation replays it exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_block import TransformerBlock

from megaloop.config import ModelConfig, ParallelConfig
from megaloop.models import specs
from megaloop.models.model import LoopedLM, transformer_config


class LatentCompression(MegatronModule):
    """Mean-pooling of k consecutive tokens into a latent and the scaled, causal writeback of the
    latents' updates (module docstring). Parameters: the k channel-scale vectors w_s, stored flat
    ([w_0; ..; w_{k-1}], 1-D: no weight decay, not a matrix for ALRS), initialised to 1 (the direct
    writeback)."""

    def __init__(self, config, stride: int, lag: int):
        super().__init__(config=config)
        self.stride, self.lag = stride, lag
        self.channel_scales = torch.nn.Parameter(
            torch.ones(stride * config.hidden_size, dtype=config.params_dtype))

    def pool(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, B, d] -> [N // k, B, d]: means of complete groups of k tokens."""
        k = self.stride
        n = hidden.shape[0] // k
        return hidden[:n * k].view(n, k, *hidden.shape[1:]).mean(dim=1)

    def latent_rope(self, rope: torch.Tensor, latents: int) -> torch.Tensor:
        """Rotary angles of the latents: each at its last token's position (ki + k - 1)."""
        return rope[self.stride - 1::self.stride][:latents]

    def write_back(self, delta: torch.Tensor, length: int) -> torch.Tensor:
        """[N // k, B, d] latent updates -> [length, B, d]: w_s * D_i at position ki+k-1+l+s."""
        n, batch, d = delta.shape
        k = self.stride
        scales = self.channel_scales.view(k, 1, d)
        spread = (delta.unsqueeze(1) * scales).reshape(n * k, batch, d)  # row ki + s
        start = k - 1 + self.lag
        return torch.cat([spread.new_zeros(start, batch, d), spread])[:length]

    def reduce(self, hidden: torch.Tensor, rope: torch.Tensor, padding: torch.Tensor | None):
        """Latents, their rotary angles and their padding mask ([B, N] -> [B, N // k]): a latent
        with any padding among its tokens is padding, as the latent it stands for does not exist
        in the unpadded sequence (padding is trailing, so its tokens form an incomplete group
        there); its writeback lands on padding positions only."""
        latents = self.pool(hidden)
        if padding is not None:
            n = latents.shape[0]
            padding = padding[:, :n * self.stride].reshape(padding.shape[0], n, -1).any(-1)
        return latents, self.latent_rope(rope, latents.shape[0]), padding

    def expand(self, delta: torch.Tensor, length: int) -> torch.Tensor:
        return self.write_back(delta, length)


class LatentProjection(MegatronModule):
    """The width reduction's projections: the visit's block runs on z = W_down h (d -> d/2) and its
    update returns through W_up (d/2 -> d). Both are ordinary 2-D matrices (weight decay, ALRS),
    replicated on tensor-parallel ranks (the residual stream is), initialised like the model's
    input (W_down) and residual-output (W_up) projections."""

    def __init__(self, config):
        super().__init__(config=config)
        d = config.hidden_size
        self.down_weight = torch.nn.Parameter(torch.empty(d // 2, d, dtype=config.params_dtype))
        self.up_weight = torch.nn.Parameter(torch.empty(d, d // 2, dtype=config.params_dtype))
        if config.perform_initialization:
            config.init_method(self.down_weight)
            config.output_layer_init_method(self.up_weight)

    def reduce(self, hidden: torch.Tensor, rope: torch.Tensor, padding: torch.Tensor | None):
        return F.linear(hidden, self.down_weight), rope, padding

    def expand(self, delta: torch.Tensor, length: int) -> torch.Tensor:
        return F.linear(delta, self.up_weight)


@dataclass
class LatentVisitSubmodules:
    compression: ModuleSpec | type | None = None  # latent_reduction=sequence
    projection: ModuleSpec | type | None = None  # latent_reduction=width


class LatentVisit(MegatronModule):
    """Visit v of the middle block: h + a_v * f(h), f the block's update, on the full sequence or
    between its reduction's ``reduce`` and ``expand`` (the compression or the projection).
    ``block`` is set by the model: this visit's own block, or a borrowed reference to the shared
    one."""

    def __init__(self, config, submodules: LatentVisitSubmodules, visit: int,
                 residual_scale: float, learned: bool):
        super().__init__(config=config)
        self.visit = visit
        self.compression, self.projection = (
            build_module(spec, config=config) if spec is not None else None
            for spec in (submodules.compression, submodules.projection))
        scale = torch.full([1], float(residual_scale), dtype=config.params_dtype)
        if learned:
            self.residual_scale = torch.nn.Parameter(scale)
        else:  # set by the config on every build: not part of checkpoints
            self.register_buffer("residual_scale", scale, persistent=False)
        # A fixed scale of 1 is the plain visit h <- Block(h), computed as such.
        self.plain = not learned and residual_scale == 1.0
        self.block: TransformerBlock | None = None

    def forward(self, hidden: torch.Tensor, rope: torch.Tensor,
                padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        reduction = self.compression if self.compression is not None else self.projection
        if reduction is None:
            out = self.block(hidden, attention_mask=None, rotary_pos_emb=rope,
                             padding_mask=padding_mask)
            return out if self.plain else hidden + self.residual_scale * (out - hidden)
        reduced, reduced_rope, padding_mask = reduction.reduce(hidden, rope, padding_mask)
        if reduced.shape[0] == 0:  # shorter than one group: nothing to write back
            return hidden
        delta = self.block(reduced, attention_mask=None, rotary_pos_emb=reduced_rope,
                           padding_mask=padding_mask) - reduced
        update = reduction.expand(delta, hidden.shape[0])
        return hidden + (update if self.plain else self.residual_scale * update)


class LatentVisits(MegatronModule):
    """The V visits in order, as children visit1..visitV (a MegatronModule, so that checkpoints
    keep their blocks' tensor-parallel sharding)."""

    def __init__(self, config, visits: list[LatentVisit]):
        super().__init__(config=config)
        for visit in visits:
            self.add_module(f"visit{visit.visit}", visit)

    def __iter__(self):
        return iter(self.children())

    def __len__(self):
        return len(self._modules)


def visit_spec(cfg: ModelConfig, visit: int) -> ModuleSpec:
    """The spec of visit ``visit`` (1-based): its residual scale and its reduction's module, if
    the reduction has one."""
    reduction = cfg.visit_reduction(visit)
    compression = (ModuleSpec(LatentCompression, params={"stride": cfg.latent_stride,
                                                         "lag": cfg.latent_writeback_lag})
                   if reduction == "sequence" else None)
    projection = ModuleSpec(LatentProjection) if reduction == "width" else None
    scale = cfg.residual_scale_init[visit - 1] if cfg.residual_scale_init else 1.0
    return ModuleSpec(LatentVisit, params={"visit": visit, "residual_scale": scale,
                                           "learned": cfg.residual_scale == "learned"},
                      submodules=LatentVisitSubmodules(compression=compression,
                                                       projection=projection))


def _borrow(module: torch.nn.Module, name: str, value) -> None:
    """``module.<name>`` becomes ``value``, a submodule or parameter another module owns and
    registers. Unregistered here, it is saved, counted, moved and optimised once, by its owner."""
    module._modules.pop(name, None)
    module._parameters.pop(name, None)
    object.__setattr__(module, name, value)


def narrowed(owner: torch.Tensor, shape: torch.Size, gated: bool) -> torch.Tensor:
    """The part of ``owner`` that a narrower copy of its module (parameter ``shape``) computes with:
    the leading block of every dimension; with ``gated`` (a SwiGLU FFN's fused [gate; up] rows), the
    leading rows of each half, i.e. the first hidden units of gate and up alike."""
    if gated and shape[0] != owner.shape[0]:
        half, keep = owner.shape[0] // 2, shape[0] // 2
        owner = torch.cat([owner[:keep], owner[half:half + keep]])
    return owner[tuple(slice(0, size) for size in shape)]


class _NarrowedParameters:
    """Forward hooks that give a module, for each call, the ``narrowed`` parts of parameters another
    module owns (name -> (owner parameter, shape, gated)). Cut per call, so that they follow the
    owner's parameters wherever those move (device, dtype, a data-parallel gradient buffer) and
    are cut again when activation recomputation replays the call; gradients reach the owner's."""

    def __init__(self, module: torch.nn.Module, parts: dict):
        self.parts = parts
        module.register_forward_pre_hook(self.attach)
        module.register_forward_hook(self.detach)

    def attach(self, module, args):
        for name, (owner, shape, gated) in self.parts.items():
            module.__dict__[name] = narrowed(owner, shape, gated)

    def detach(self, module, args, output):
        for name in self.parts:
            module.__dict__.pop(name, None)


def _borrow_parameters(module: torch.nn.Module, owner: torch.nn.Module) -> None:
    """Every parameter of ``module`` (a part of a visit's own block) becomes the same-named
    parameter of ``owner`` (the same part of the shared block), or its narrowed part where this
    visit's block is narrower."""
    for path, sub in module.named_modules():
        source = owner.get_submodule(path)
        parts = {}
        for name, param in list(sub.named_parameters(recurse=False)):
            shared = getattr(source, name)
            if param.shape == shared.shape:
                _borrow(sub, name, shared)
                continue
            sub._parameters.pop(name)
            gated = path.rsplit(".", 1)[-1] == "linear_fc1" and name.startswith("weight")
            parts[name] = (shared, param.shape, gated)
        if parts:
            _NarrowedParameters(sub, parts)


class LatentLoopLM(LoopedLM):
    """LoopedLM with a LatentLoop core: prelude (``encoder``), visits of the middle block
    (``decoder``, ``visits``), coda. Pipeline parallelism and test-time depth do not apply."""

    first_group, loop_group = "prelude", "visit"

    def __init__(self, cfg: ModelConfig, parallel: ParallelConfig | None = None,
                 use_te: bool | None = None, params_dtype=torch.float32, parallel_output=True,
                 fp8: str | None = None, stage: int = 0, initialize: bool = True):
        super().__init__(cfg, parallel, use_te, params_dtype, parallel_output, fp8, stage,
                         initialize)
        cfg, parallel = self.cfg, parallel or ParallelConfig()
        use_te = specs.transformer_engine_available() if use_te is None else use_te
        before, middle, after = cfg.num_prelude_layers, cfg.num_decoder_layers, cfg.num_coda_layers

        def block(block_cfg: ModelConfig, num_layers: int, offset: int) -> TransformerBlock:
            config = transformer_config(block_cfg, parallel, num_layers, block_cfg.ffn_hidden_size,
                                        params_dtype, fp8, use_te, initialize)
            spec = specs.layer_spec(block_cfg, "plain", use_te, moe=cfg.uses_moe,
                                    layer_offset=offset)
            return TransformerBlock(config, spec, post_layer_norm=False)

        visits = []
        for v in range(1, cfg.iterations + 1):
            visit = build_module(visit_spec(cfg, v), config=self.config)
            own_attention = cfg.untie_attention and v > 1  # visit 1 uses the shared weights
            own_ffn = cfg.untie_moe and v > 1
            block_cfg = cfg.visit_block_config(v)
            if own_attention or own_ffn or block_cfg != cfg:
                visit.block = block(block_cfg, middle, before)
                self._share(visit.block, attention=not own_attention, ffn=not own_ffn)
            else:
                _borrow(visit, "block", self.decoder)
            visits.append(visit)
        self.visits = LatentVisits(self.config, visits)
        self.coda = block(cfg, after, before + middle) if after else None
        self.routing_stats = self._attach_routing_stats(
            ([self.first_group] if before else []) + [f"visit{v}" for v in
                                                      range(1, cfg.iterations + 1)]
            + (["coda"] if after else []))

    def _share(self, block: TransformerBlock, attention: bool, ffn: bool) -> None:
        """Points the parameters of ``block``'s attention and/or FFN (with their norms) at the
        shared middle block's, narrowed where ``block`` is narrower. Its modules stay its own: a
        MoE FFN with another top-k keeps its own router, which computes with the shared weight."""
        parts = ((("input_layernorm", "self_attention") if attention else ())
                 + (("pre_mlp_layernorm", "mlp") if ffn else ()))
        for owner, layer in zip(self.decoder.layers, block.layers):
            for part in parts:
                _borrow_parameters(getattr(layer, part), getattr(owner, part))

    def loop(self, hidden: torch.Tensor, encoding: torch.Tensor | None, rope: torch.Tensor,
             steps: int, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The V visits, then the coda. They are V distinct modules applied in order (each its own
        residual scale and compression) over the shared block, so there is no test-time depth:
        ``steps`` is its iterations, as LoopedLM.forward has checked (ModelConfig.depth_refusal)."""
        for visit in self.visits:
            with self.applying(f"visit{visit.visit}"):
                hidden = visit(hidden, rope, padding_mask)
        if self.coda is not None:
            with self.applying("coda"):
                hidden = self.coda(hidden, attention_mask=None, rotary_pos_emb=rope,
                                   padding_mask=padding_mask)
        return hidden
