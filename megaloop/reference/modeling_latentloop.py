"""Plain-PyTorch reference of LatentLoop and its Hugging Face model (torch and transformers only,
like the rest of the reference).

    h = Prelude(Embed(x))
    for v = 1..V:
        full v:        h = h + a_v * (Middle(h) - h)
        sequence v:    z_i = mean(h[ki], .., h[ki+k-1]);  D = Middle(z) - z
                       h[ki+k-1+l+s] += a_v * w_{v,s} * D_i,   s = 0..k-1
        width v:       z = W_down,v h;  h = h + a_v * W_up,v (Middle_{d/2}(z) - z)
        top_k v:       h = h + a_v * (Middle(h) - h), routing to moe_top_k // 2 experts
        expert_ffn v:  h = h + a_v * (Middle(h) - h), experts using their first half of hidden units
    logits = Head(Norm(Coda(h)))

Positions 0-based; latents are complete groups of k tokens at the RoPE position of their last token;
l is the writeback lag. Middle_{d/2} is the middle block computing with the leading block of each of
its parameters: d/2 of every d-sized side (norm weights, the input columns of q/k/v, router and
experts, the output rows of o and down projections), heads and expert widths unchanged; the
expert_ffn visits use the leading half of each expert's gate/up rows and down columns. Visits 2..V
use their own attention and/or FFN when untied. The canonical model (megaloop.models.latent) is held
to this file by parity tests.

Cached generation is exact and causal. A compressed visit keeps, in the cache, the visit inputs of
the tokens of the latent group not yet complete and the updates D_i of the latents so far; a latent
completes with the last token of its group (every k-th token), then runs through the middle block
against the cached latents of that visit (its own KV slots, latent resolution), and position p
receives the update of latent (p - k + 1 - l) // k, which is complete by then. Every other visit and
the prelude/coda have one KV slot per (visit, layer) / layer, as in modeling_asymloop.

Left padding (``attention_mask``, as batched generation pads) gives each row the logits of the row
alone: a row's groups are formed of its own tokens, wherever its padding puts them.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call
from transformers import GenerationMixin
from transformers import initialization as init

from .configuration_megaloop import LatentLoopConfig
from .modeling_asymloop import Block, MegaloopPreTrainedModel, causal_mask, rope
# Unused here: transformers' remote-code loader copies, from a local directory, only the files the
# auto_map module imports itself (5.0 does; 5.24 follows imports), and modeling_asymloop needs it.
from .modeling_moe import MoEFeedForward  # noqa: F401


class _Part(nn.Module):
    """One sublayer of a Block, with its norm: attention (attn_norm, attn) or FFN (mlp_norm,
    mlp), for the visits that untie it."""

    def __init__(self, block: Block, attention: bool):
        super().__init__()
        if attention:
            self.attn_norm, self.attn = block.attn_norm, block.attn
        else:
            self.mlp_norm, self.mlp = block.mlp_norm, block.mlp


class _Projection(nn.Module):
    """A width-reduced visit's projections d -> d/2 (down) and d/2 -> d (up)."""

    def __init__(self, d: int):
        super().__init__()
        self.down = nn.Linear(d, d // 2, bias=False)
        self.up = nn.Linear(d // 2, d, bias=False)


def _leading(param: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    return param[tuple(slice(0, size) for size in shape)]


class LatentLoopLM(MegaloopPreTrainedModel, GenerationMixin):
    """LatentLoop, MoE Loop (no compressed visit) and their ablations, as ``AutoModelForCausalLM``."""

    config_class = LatentLoopConfig

    def __init__(self, cfg: LatentLoopConfig):
        super().__init__(cfg)
        d, moe = cfg.hidden_size, cfg.num_experts > 0
        middle = cfg.num_layers - cfg.prelude_layers - cfg.coda_layers
        self._build_embeddings(cfg)

        def blocks(n):
            return nn.ModuleList(Block(cfg, cfg.ffn_hidden_size, moe=moe) for _ in range(n))

        self.prelude, self.middle, self.coda = (blocks(cfg.prelude_layers), blocks(middle),
                                                blocks(cfg.coda_layers))
        # visit v >= 2 with untied parts: "<v>" -> per middle layer, the attention / FFN part
        self.untied_attention = nn.ModuleDict({
            str(v): nn.ModuleList(_Part(b, attention=True) for b in blocks(middle))
            for v in range(2, cfg.iterations + 1) if cfg.untie_attention})
        self.untied_ffn = nn.ModuleDict({
            str(v): nn.ModuleList(_Part(b, attention=False) for b in blocks(middle))
            for v in range(2, cfg.iterations + 1) if cfg.untie_moe})
        scales = self._initial_scales()
        if cfg.residual_scale == "learned":
            self.residual_scales = nn.Parameter(scales)
        else:
            self.register_buffer("residual_scales", scales, persistent=False)
        # writeback channel scales w_{v,s} of each compressed visit: "<v>" -> [k, d]
        self.writeback = nn.ParameterDict({str(v): nn.Parameter(torch.ones(cfg.latent_stride, d))
                                           for v in self.reduced_visits("sequence")})
        self.projection = nn.ModuleDict({str(v): _Projection(d)
                                         for v in self.reduced_visits("width")})
        self.narrow_shapes = self._narrow_shapes(moe)
        self.post_init()

    def _narrow_shapes(self, moe: bool) -> dict[str, torch.Size]:
        """Parameter shapes (names relative to a middle Block) of the block that the width or
        expert_ffn visits run: a Block of the reduced config, built on the meta device."""
        cfg = self.config
        if cfg.latent_reduction not in ("width", "expert_ffn"):
            return {}
        if cfg.latent_reduction == "width":  # heads and head_dim (set explicitly) stay
            changes = {"hidden_size": cfg.hidden_size // 2, "head_dim": cfg.head_dim}
        else:
            changes = {"moe_ffn_hidden_size": cfg.moe_ffn_hidden_size // 2,
                       "moe_shared_expert_size": cfg.moe_shared_expert_size // 2}
        narrow = type(cfg).from_dict({**cfg.to_dict(), **changes})
        with torch.device("meta"):
            template = Block(narrow, narrow.ffn_hidden_size, moe=moe)
        return {name: p.shape for name, p in template.named_parameters()}

    def _initial_scales(self) -> torch.Tensor:
        """In the default dtype, which from_pretrained sets to the model's (config.json's dtype):
        a float32 scale in a bfloat16 model would make ``model.dtype`` say float32."""
        cfg = self.config
        return torch.tensor(cfg.residual_scale_init or [1.0] * cfg.iterations,
                            dtype=torch.get_default_dtype())

    def _set_fixed_scales(self, value) -> None:
        """A fixed scale's edited ``residual_scale_init`` (one value per visit, checked by
        load_time_refusal; learned scales refuse one), as from_pretrained would set it."""
        with torch.no_grad():
            self.residual_scales.copy_(torch.tensor(value or [1.0] * self.config.iterations))

    def _init_weights(self, module):
        """transformers' init functions leave loaded tensors alone; a fixed scale is a buffer
        outside the state dict, so it is always set here."""
        super()._init_weights(module)
        if module is self:
            init.copy_(self.residual_scales, self._initial_scales())
        elif module is self.writeback:
            for w in module.values():
                init.ones_(w)

    def reduced_visits(self, reduction: str) -> list[int]:
        """The visits that ``reduction`` (a latent_reduction value) applies to."""
        cfg = self.config
        return cfg.latent_visits if cfg.latent_reduction == reduction else []

    def _part(self, module, name: str, narrow: bool, *args, **kwargs):
        """``module`` (the part ``name`` of a middle Block) called, for a narrowed visit, with the
        leading block of each of its parameters."""
        if not narrow:
            return module(*args, **kwargs)
        params = {key: _leading(p, self.narrow_shapes[f"{name}.{key}"])
                  for key, p in module.named_parameters()}
        return functional_call(module, params, args, kwargs)

    def _middle(self, h, rotary, allowed, cache, first_slot: int, visit: int):
        cfg = self.config
        top_k = {"top_k": cfg.moe_top_k // 2} if visit in self.reduced_visits("top_k") else {}
        narrow = visit in self.reduced_visits("width") + self.reduced_visits("expert_ffn")
        for index, block in enumerate(self.middle):
            attention = self.untied_attention[str(visit)][index] \
                if str(visit) in self.untied_attention else block
            ffn = self.untied_ffn[str(visit)][index] if str(visit) in self.untied_ffn else block
            sublayers = (
                (attention.attn_norm, attention.attn, "attn",
                 (rotary, allowed, cache, first_slot + index), {}),
                (ffn.mlp_norm, ffn.mlp, "mlp", (), top_k))
            for norm, layer, name, args, kwargs in sublayers:
                if block.post_norm:  # OLMo 2: h + Norm(f(h))
                    out = self._part(layer, name, narrow, h, *args, **kwargs)
                    h = h + self._part(norm, f"{name}_norm", narrow, out)
                else:
                    normed = self._part(norm, f"{name}_norm", narrow, h)
                    h = h + self._part(layer, name, narrow, normed, *args, **kwargs)
        return h

    def _compressed_update(self, h, positions, valid, cache, first_slot: int, visit: int):
        """The writeback of compressed visit ``visit`` to the new tokens ``h`` [B, N, d] at RoPE
        positions ``positions`` [B, N]; ``valid`` [B, past + N]: left padding (None: none).

        Each row groups its own tokens (left padding shifts the rows' groups against each other):
        its tokens not yet in a latent, the visit inputs of its incomplete group (``pending``,
        right-aligned in k - 1 slots) and its valid new tokens, end every row at the last index.
        A call runs G latents per row through the middle block, G the most that a row completes;
        a row completing fewer runs placeholders first, whose outputs are dropped and whose KV
        slots stay hidden (``latent_valid``). The updates D_i are kept per row in latent order."""
        cfg = self.config
        k, lag = cfg.latent_stride, cfg.latent_writeback_lag
        batch, n, d = h.shape
        state = cache.state if cache is not None else {}
        new_valid = valid[:, -n:] if valid is not None else h.new_ones(batch, n, dtype=torch.bool)
        seen = cache.seen if cache is not None else 0
        total = valid.sum(1) if valid is not None else \
            torch.full((batch,), seen + n, device=h.device)
        done = (total - new_valid.sum(1)) // k  # per row: latents completed before this call
        completes = total // k - done  # ... and by this call
        seq = torch.cat([state.get(f"pending{visit}", h.new_zeros(batch, k - 1, d)), h], dim=1)
        latent_valid = state.get(f"latent_valid{visit}", new_valid[:, :0])
        deltas = state.get(f"deltas{visit}", h[:, :0])
        if valid is None:  # no padding, ever (``_positions``): every row's counts known here,
            # without reading them back from the device at every generated token
            groups, latent_count = (seen + n) // k - seen // k, (seen + n) // k
        else:
            groups, latent_count = int(completes.max()), int((done + completes).max())
        if groups:
            j = torch.arange(groups, device=h.device)
            placeholders = (groups - completes)[:, None]
            new_latents = j >= placeholders  # [B, G]
            last = seq.shape[1] - 1 - total % k  # per row: the last token of its last group
            index = (last[:, None, None] - (groups - j[:, None]) * k + 1 +
                     torch.arange(k, device=h.device)).clamp(min=0).flatten(1)
            latents = seq.gather(1, index[..., None].expand(-1, -1, d)).unflatten(
                1, (groups, k)).mean(dim=2)
            latent_index = (done[:, None] + j - placeholders).clamp(min=0)
            rotary = rope(latent_index * k + k - 1, cfg.head_dim, cfg.rotary_base)
            latent_valid = torch.cat([latent_valid, new_latents], dim=1)
            allowed = causal_mask(groups, latent_valid.shape[1], h.device,
                                  None if valid is None else latent_valid)
            out = self._middle(latents, rotary, allowed, cache, first_slot, visit)
            # row b's D_i, i >= done_b, come from its new latents, after its placeholders
            kept = deltas.shape[1]
            target = torch.arange(latent_count, device=h.device)[None]
            source = torch.where(target < done[:, None], target,
                                 kept + target - done[:, None] + placeholders)
            deltas = torch.cat([deltas, out - latents], dim=1).gather(
                1, source.clamp(max=kept + groups - 1)[..., None].expand(-1, -1, d))
        if cache is not None:
            state[f"pending{visit}"] = seq[:, seq.shape[1] - (k - 1):]
            state[f"deltas{visit}"], state[f"latent_valid{visit}"] = deltas, latent_valid
        if deltas.shape[1] == 0:
            return torch.zeros_like(h)
        offset = positions - (k - 1) - lag
        receives = (offset >= 0) & new_valid  # the first k - 1 + l positions receive nothing
        offset = offset.clamp(min=0)
        latent = (offset // k).clamp(max=deltas.shape[1] - 1)
        update = deltas.gather(1, latent[..., None].expand(-1, -1, d)) * \
            self.writeback[str(visit)][offset % k]
        return update * receives[..., None]

    def body(self, h, positions, allowed, valid, cache, steps, states=None):
        """Slots: prelude layer i -> i; visit v (1-based), middle layer i -> P + (v - 1) * M + i
        (latent resolution for a compressed visit); coda layer i -> P + V * M + i. ``states`` (a
        list, or None) receives the embeddings, each prelude layer's output, the stream after each
        visit (a compressed or width-reduced visit has no per-token, full-width stream inside it)
        and each coda layer's output: 1 + P + V + C tensors [B, N, d]."""
        cfg = self.config
        if steps != cfg.iterations:
            raise ValueError(f"num_iterations={steps}: arch=latentloop runs exactly its "
                             f"iterations={cfg.iterations} visits (each has its own scales)")
        if valid is not None and bool((valid[:, :-1] & ~valid[:, 1:]).any()):
            raise ValueError("arch=latentloop takes left padding only (a pad after a token would "
                             f"split a group of {cfg.latent_stride} tokens): pad on the left")
        p, m = len(self.prelude), len(self.middle)
        keep = states.append if states is not None else lambda _: None
        keep(h)
        rotary = rope(positions, cfg.head_dim, cfg.rotary_base)
        for index, block in enumerate(self.prelude):
            h = block(h, rotary, allowed, cache, index)
            keep(h)
        for visit in range(1, steps + 1):
            first, scale = p + (visit - 1) * m, self.residual_scales[visit - 1]
            if visit in self.reduced_visits("sequence"):
                h = h + scale * self._compressed_update(h, positions, valid, cache, first,
                                                        visit)
            elif visit in self.reduced_visits("width"):
                projection = self.projection[str(visit)]
                z = projection.down(h)
                h = h + scale * projection.up(self._middle(z, rotary, allowed, cache, first,
                                                           visit) - z)
            else:
                h = h + scale * (self._middle(h, rotary, allowed, cache, first, visit) - h)
            keep(h)
        for index, block in enumerate(self.coda):
            h = block(h, rotary, allowed, cache, p + steps * m + index)
            keep(h)
        return h
