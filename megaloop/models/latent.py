"""LatentLoop: a looped (MoE) model whose middle block is visited V times, some visits on a sequence
compressed k times, with a causal, scaled writeback (seed paper 001).

    h = Prelude(Embed(x))                            P layers once      (checkpoint keys encoder.*)
    for v = 1..V:                                    M middle layers    (decoder.*, visits.visit<v>.*)
        compressed v:  z = Pool(h);  D = Block(z) - z;  h = h + a_v * WriteBack(D)
        full v:        h = h + a_v * (Block(h) - h)
    logits = Head(Norm(Coda(h)))                     C layers once      (coda.*)

A visit is a module built from a spec (``visit_spec``); its compression, when the visit is
compressed, is a submodule of that spec (``LatentCompression``), not a wrapper around the model. The
residual scale a_v is learned or fixed per visit.

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

Weight sharing across visits. The middle block (``decoder``) is shared by every visit unless a visit
needs other weights or another top-k: ``untie_attention`` / ``untie_moe`` give visits 2..V their own
attention / FFN; ``latent_reduction="top_k"`` runs the reduced visits with half the router's top-k.
Such a visit gets its own TransformerBlock whose shared parts are *borrowed* from ``decoder``:
referenced, not registered, so they are saved, counted, moved and optimised once, as the owner's.
Every visit is static (no per-call switch), so activation recomputation replays it exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
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


@dataclass
class LatentVisitSubmodules:
    compression: ModuleSpec | type | None = None


class LatentVisit(MegatronModule):
    """Visit v of the middle block: h + a_v * f(h), f the block's update, on the full sequence or
    (with ``compression``) on latents. ``block`` is set by the model: this visit's own block, or a
    borrowed reference to the shared one."""

    def __init__(self, config, submodules: LatentVisitSubmodules, visit: int,
                 residual_scale: float, learned: bool):
        super().__init__(config=config)
        self.visit = visit
        self.compression = (build_module(submodules.compression, config=config)
                            if submodules.compression is not None else None)
        scale = torch.full([1], float(residual_scale), dtype=config.params_dtype)
        if learned:
            self.residual_scale = torch.nn.Parameter(scale)
        else:  # set by the config on every build: not part of checkpoints
            self.register_buffer("residual_scale", scale, persistent=False)
        # A fixed scale of 1 is the plain visit h <- Block(h), computed as such.
        self.plain = not learned and residual_scale == 1.0
        self.block: TransformerBlock | None = None

    def forward(self, hidden: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        if self.compression is None:
            out = self.block(hidden, attention_mask=None, rotary_pos_emb=rope)
            return out if self.plain else hidden + self.residual_scale * (out - hidden)
        latents = self.compression.pool(hidden)
        if latents.shape[0] == 0:  # shorter than one group: nothing to write back
            return hidden
        delta = self.block(latents, attention_mask=None,
                           rotary_pos_emb=self.compression.latent_rope(rope, latents.shape[0]))
        update = self.compression.write_back(delta - latents, hidden.shape[0])
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
    """The spec of visit ``visit`` (1-based): its residual scale and, if compressed, its
    compression."""
    compressed = visit in cfg.latent_visits and cfg.latent_reduction == "sequence"
    compression = (ModuleSpec(LatentCompression, params={"stride": cfg.latent_stride,
                                                         "lag": cfg.latent_writeback_lag})
                   if compressed else None)
    scale = cfg.residual_scale_init[visit - 1] if cfg.residual_scale_init else 1.0
    return ModuleSpec(LatentVisit, params={"visit": visit, "residual_scale": scale,
                                           "learned": cfg.residual_scale == "learned"},
                      submodules=LatentVisitSubmodules(compression=compression))


def visit_top_k(cfg: ModelConfig, visit: int) -> int:
    reduced = visit in cfg.latent_visits and cfg.latent_reduction == "top_k"
    return cfg.moe_top_k // 2 if reduced else cfg.moe_top_k


def _borrow(module: torch.nn.Module, name: str, value) -> None:
    """``module.<name>`` becomes ``value``, a submodule or parameter another module owns and
    registers. Unregistered here, it is saved, counted, moved and optimised once, by its owner."""
    module._modules.pop(name, None)
    module._parameters.pop(name, None)
    object.__setattr__(module, name, value)


class LatentLoopLM(LoopedLM):
    """LoopedLM with a LatentLoop core: prelude (``encoder``), visits of the middle block
    (``decoder``, ``visits``), coda. Pipeline parallelism and test-time depth do not apply."""

    first_group, loop_group = "prelude", "visit"

    def __init__(self, cfg: ModelConfig, parallel: ParallelConfig | None = None,
                 use_te: bool | None = None, params_dtype=torch.float32, parallel_output=True,
                 pre_process: bool = True, post_process: bool = True, fp8: str | None = None):
        super().__init__(cfg, parallel, use_te, params_dtype, parallel_output, pre_process,
                         post_process, fp8)
        cfg, parallel = self.cfg, parallel or ParallelConfig()
        use_te = specs.transformer_engine_available() if use_te is None else use_te
        before, middle, after = cfg.num_prelude_layers, cfg.num_decoder_layers, cfg.num_coda_layers

        def block(num_layers: int, offset: int, top_k: int | None = None) -> TransformerBlock:
            config = transformer_config(cfg, parallel, num_layers, cfg.ffn_hidden_size,
                                        params_dtype, fp8, use_te, moe_top_k=top_k)
            spec = specs.layer_spec(cfg, "plain", use_te, moe=cfg.uses_moe, layer_offset=offset)
            return TransformerBlock(config, spec, post_layer_norm=False)

        visits = []
        for v in range(1, cfg.iterations + 1):
            visit = build_module(visit_spec(cfg, v), config=self.config)
            own_attention = cfg.untie_attention and v > 1  # visit 1 uses the shared weights
            own_ffn = cfg.untie_moe and v > 1
            if own_attention or own_ffn or visit_top_k(cfg, v) != cfg.moe_top_k:
                visit.block = block(middle, before, visit_top_k(cfg, v))
                self._share(visit.block, attention=not own_attention, ffn=not own_ffn)
            else:
                _borrow(visit, "block", self.decoder)
            visits.append(visit)
        self.visits = LatentVisits(self.config, visits)
        self.coda = block(after, before + middle) if after else None
        self.routing_stats = self._attach_routing_stats(
            ([self.first_group] if before else []) + [f"visit{v}" for v in
                                                      range(1, cfg.iterations + 1)]
            + (["coda"] if after else []))

    def _share(self, block: TransformerBlock, attention: bool, ffn: bool) -> None:
        """Points ``block``'s attention and/or FFN at the shared middle block's. A MoE FFN with
        another top-k keeps its own router and dispatcher but the shared router weight and experts."""
        for owner, layer in zip(self.decoder.layers, block.layers):
            if attention:
                _borrow(layer, "input_layernorm", owner.input_layernorm)
                _borrow(layer, "self_attention", owner.self_attention)
            if not ffn:
                continue
            _borrow(layer, "pre_mlp_layernorm", owner.pre_mlp_layernorm)
            if getattr(layer.mlp, "router", None) is None or layer.mlp.router.topk == \
                    owner.mlp.router.topk:
                _borrow(layer, "mlp", owner.mlp)
                continue
            _borrow(layer.mlp.router, "weight", owner.mlp.router.weight)
            _borrow(layer.mlp, "experts", owner.mlp.experts)
            if owner.mlp.shared_experts is not None:
                _borrow(layer.mlp, "shared_experts", owner.mlp.shared_experts)

    def loop(self, hidden: torch.Tensor, rope: torch.Tensor, steps: int) -> torch.Tensor:
        """The V visits, then the coda. They are V distinct modules applied in order (each its own
        residual scale and compression) over the shared block, so there is no test-time depth."""
        if steps != self.cfg.iterations:
            raise ValueError(f"num_iterations={steps}: arch=latentloop runs exactly its "
                             f"iterations={self.cfg.iterations} visits (each has its own scales)")
        for visit in self.visits:
            with self.applying(f"visit{visit.visit}"):
                hidden = visit(hidden, rope)
        if self.coda is not None:
            with self.applying("coda"):
                hidden = self.coda(hidden, attention_mask=None, rotary_pos_emb=rope)
        return hidden
