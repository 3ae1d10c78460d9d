"""megatron-core modules that megaloop's layer specs plug in.

- ``CausalCoreAttention`` / ``JointCoreAttention``: core-attention modules (the CoreAttention protocol
  of ``megatron.core.transformer.attention``). The joint one attends to [Global; Local] keys under one
  softmax, causal on each half.
- ``JointSelfAttention`` (AsymLoop decoder): megatron-core's SelfAttention plus per-layer Global KV.
- ``GlobalOnlyAttention`` (the "no Local KV" ablation): queries against Global KV only.
- ``PostNormLinear``: a row-parallel projection followed by RMSNorm, the OLMo-2 sublayer output norm.
- ``LoopedTransformerLayer``: routes the Global KV that ``TransformerBlock`` forwards as ``context``
  into the layer's attention.
- ``LayerBlock``: a TransformerBlock holding some layers of a block (a pipeline stage's share), with
  spans of them to run.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.transformer.attention import Attention, SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer

from megaloop.models.joint_attention import joint_attention_fused


class CausalCoreAttention(MegatronModule):
    """Causal softmax attention through torch SDPA (flash kernels on CPU and GPU).

    Used by the local spec in place of megatron-core's DotProductAttention, which materialises the
    full score matrix; Dense / Full Loop baselines and AsymLoop then run on the same kernel family,
    so their measured step times compare like with like.
    """

    def __init__(self, config, layer_number, attn_mask_type=None, attention_type="self",
                 attention_dropout=None, softmax_scale=None, cp_comm_type=None,
                 pg_collection=None):
        super().__init__(config=config)
        # Causality comes from the layer spec, as for Transformer Engine's core attention, so that
        # a role whose spec is not causal fails here on CPU instead of attending to the future on
        # a GPU.
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"{type(self).__name__} is causal only; the layer spec asks for "
                             f"attn_mask_type={attn_mask_type}")
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)

    @staticmethod
    def _heads_first(x, n_heads):
        """[s, b, g, d] -> [b, n_heads, s, d], repeating grouped kv heads for GQA."""
        x = x.permute(1, 2, 0, 3)
        return x.repeat_interleave(n_heads // x.shape[1], dim=1) if x.shape[1] != n_heads else x

    def _attend(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        assert packed_seq_params is None and attention_bias is None, "not supported here"
        n_heads = query.shape[2]
        q = query.permute(1, 2, 0, 3)
        out = self._attend(q, self._heads_first(key, n_heads), self._heads_first(value, n_heads))
        b, h, s, d = out.shape
        return out.permute(2, 0, 1, 3).reshape(s, b, h * d)


class _HeadsRepeatedOnce(torch.autograd.Function):
    """One call's view of Global keys or values ``x`` [N, B, groups, d] with their heads
    repeated for GQA: ``repeated``, CausalCoreAttention._heads_first(x) computed once per forward
    (without grad) and read by all K calls, as [N, B, heads, d] (_heads_first then only
    permutes). The backward is repeat_interleave's for this call (the sum over each group's
    heads, on the same layout), so the K calls' gradients reach ``x`` as they did when every
    call repeated the heads itself."""

    @staticmethod
    def forward(ctx, x, repeated):
        ctx.groups = x.shape[2]
        return repeated.permute(2, 0, 1, 3)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.permute(1, 2, 0, 3).unflatten(1, (ctx.groups, -1)).sum(2)
        return grad.permute(2, 0, 1, 3), None


class JointCoreAttention(CausalCoreAttention):
    """Attends to [Global; Local] under one softmax, causal on each half.

    Local keys/values arrive through the CoreAttention call; the layer's (pre-rotated) Global
    keys/values through ``self.global_kv``, which ``JointSelfAttention`` sets for this one call.
    Keeping the halves apart avoids concatenating 2N keys in every iteration.

    ``impl="fused"`` runs two causal flash calls merged by log-sum-exp with an exact hand-written
    backward; ``impl="masked"`` is the exact [N, 2N] masked softmax of the reference model.
    """

    global_kv: tuple | None = None

    def __init__(self, *args, impl: str = "fused", **kwargs):
        super().__init__(*args, **kwargs)
        if impl == "fused":
            self.kernel = joint_attention_fused
        else:  # the reference imports transformers: only loaded when asked for
            from megaloop.reference.modeling_asymloop import joint_attention

            self.kernel = joint_attention

    def _attend(self, q, k, v):
        assert self.global_kv is not None, "Global KV missing: JointSelfAttention sets it per call"
        (k_glob, v_glob), self.global_kv = self.global_kv, None
        n_heads = q.shape[1]
        k_glob, v_glob = self._heads_first(k_glob, n_heads), self._heads_first(v_glob, n_heads)
        return self.kernel(q, k_glob, v_glob, k, v, self.softmax_scale)


@dataclass
class GlobalKVSubmodules(SelfAttentionSubmodules):
    linear_q: object = None  # GlobalOnlyAttention's query projection
    global_kv_layernorm: object = None
    linear_kv_global: object = None


class GlobalKVMixin:
    """Per-layer Global KV: G_l = (k_norm(Wgk RMSNorm(H_E)), Wgv RMSNorm(H_E)).

    ``project_global_kv`` runs once per forward pass for each decoder layer (not once per iteration);
    the result reaches ``get_query_key_value_tensors`` through ``self.global_kv``, which the owning
    layer sets for the duration of one attention call.
    """

    global_kv: tuple | None = None  # (keys, values)

    def _build_global_kv(self, submodules: GlobalKVSubmodules) -> None:
        cfg = self.config
        self.global_kv_layernorm = build_module(
            submodules.global_kv_layernorm, config=cfg, hidden_size=cfg.hidden_size,
            eps=cfg.layernorm_epsilon,
        )
        # Rows are laid out per query group as [k_g; v_g] (like CrossAttention.linear_kv), so a
        # column-parallel split gives every tensor-parallel rank whole groups.
        self.linear_kv_global = build_module(
            submodules.linear_kv_global, cfg.hidden_size, 2 * self.kv_projection_size, config=cfg,
            init_method=cfg.init_method, gather_output=False, bias=False, skip_bias_add=False,
            is_expert=False, tp_comm_buffer_name="kv_global", tp_group=self.pg_collection.tp,
        )

    def project_global_kv(self, encoder_output: torch.Tensor, rotary_pos_emb: torch.Tensor | None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """[N, B, h] -> (keys, values), each [N, B, groups_per_partition, head_dim]: keys QK-normed
        and rotated (Global key j sits at position j, fixed across iterations, so it is rotated
        once). Returned apart: the caller stacks every layer's in one copy
        (LoopedLM._global_kv_context)."""
        kv, _ = self.linear_kv_global(self.global_kv_layernorm(encoder_output))
        kv = kv.view(*kv.shape[:2], self.num_query_groups_per_partition, -1)
        k, v = kv.split(self.hidden_size_per_attention_head, dim=-1)
        if self.k_layernorm is not None:
            k = self.k_layernorm(k)
        if rotary_pos_emb is not None:
            k = apply_rotary_pos_emb(k, rotary_pos_emb, config=self.config)
        return k, v

    def _global_keys_values(self):
        assert self.global_kv is not None, "Global KV missing: the layer must set it per call"
        return self.global_kv

    def loop_global_kv(self, keys: torch.Tensor, values: torch.Tensor):
        """What the K calls of one forward read as this layer's Global KV (LoopedLM.
        _global_kv_context): a function giving each call its (keys, values). Here the
        projections themselves."""
        return lambda: (keys, values)


class JointSelfAttention(GlobalKVMixin, SelfAttention):
    """AsymLoop decoder attention: one softmax over [Global; Local] keys/values."""

    def __init__(self, config, submodules: GlobalKVSubmodules, layer_number, **kwargs):
        super().__init__(config, submodules, layer_number, **kwargs)
        self._build_global_kv(submodules)

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None,
                                    output_gate=False, split_qkv=True):
        # Local q/k/v go through megatron-core's RoPE as usual; the Global half is handed to the
        # core attention of this same call.
        self.core_attention.global_kv = self._global_keys_values()
        return super().get_query_key_value_tensors(hidden_states, None, False, True)

    def loop_global_kv(self, keys: torch.Tensor, values: torch.Tensor):
        """Under GQA the joint core attention repeats the Global heads; the Global KV is the
        same in all K calls, so they are repeated once per forward (one copy per layer, not one
        per call, and one held for the backward pass instead of K)."""
        n_heads = self.num_attention_heads_per_partition
        if keys.shape[2] == n_heads:
            return super().loop_global_kv(keys, values)
        with torch.no_grad():
            repeated = [(t, CausalCoreAttention._heads_first(t, n_heads)) for t in (keys, values)]
        return lambda: tuple(_HeadsRepeatedOnce.apply(t, r) for t, r in repeated)

    def _checkpointed_attention_forward(self, query, key, value, attention_mask,
                                        rotary_pos_emb=None, attn_mask_type=None,
                                        attention_bias=None, packed_seq_params=None):
        """Selective recomputation of the core attention (recompute_modules "core_attn"):
        megatron-core's checkpoint of it, with this call's Global keys/values among the replay's
        inputs beside query, key and value. Set as an attribute only, they would be gone (or
        another call's) when the backward pass replays the call, and their gradient would not
        reach the Global KV projection. Each of the K calls of a tied layer saves its own."""
        k_glob, v_glob = self.core_attention.global_kv
        self.core_attention.global_kv = None

        def attend(query, key, value, k_glob, v_glob):
            self.core_attention.global_kv = (k_glob, v_glob)
            return self.core_attention(query, key, value, attention_mask,
                                       attn_mask_type=attn_mask_type,
                                       attention_bias=attention_bias,
                                       packed_seq_params=packed_seq_params)

        return tensor_parallel.checkpoint(attend, False, query, key, value, k_glob, v_glob)


class GlobalOnlyAttention(GlobalKVMixin, Attention):
    """Ablation "no Local KV": queries from the decoder state attend (causally) to Global KV only."""

    def __init__(self, config, submodules: GlobalKVSubmodules, layer_number, attn_mask_type=None,
                 **kwargs):
        super().__init__(config=config, submodules=submodules, layer_number=layer_number,
                         attn_mask_type=attn_mask_type, attention_type="self", **kwargs)
        self.linear_q = build_module(
            submodules.linear_q, config.hidden_size, self.query_projection_size, config=config,
            init_method=config.init_method, gather_output=False, bias=False, skip_bias_add=False,
            is_expert=False, tp_comm_buffer_name="q", tp_group=self.pg_collection.tp,
        )
        head = dict(hidden_size=self.hidden_size_per_attention_head, config=config,
                    eps=config.layernorm_epsilon)
        self.q_layernorm = build_module(submodules.q_layernorm, **head)
        self.k_layernorm = build_module(submodules.k_layernorm, **head)
        self._build_global_kv(submodules)

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None,
                                    output_gate=False, split_qkv=True):
        query, _ = self.linear_q(hidden_states)
        query = query.view(*query.shape[:2], self.num_attention_heads_per_partition, -1)
        k_glob, v_glob = self._global_keys_values()
        return self.q_layernorm(query), k_glob, v_glob


@dataclass
class PostNormLinearSubmodules:
    linear: object = None
    norm: object = None


class PostNormLinear(MegatronModule):
    """A (row-parallel) projection whose output is RMS-normalised: OLMo 2's h + Norm(f(h)).

    The norm sits after the tensor-parallel reduction, where each token's full hidden vector exists.
    """

    def __init__(self, input_size, output_size, *, config, submodules: PostNormLinearSubmodules,
                 **linear_kwargs):
        super().__init__(config=config)
        self.linear = build_module(submodules.linear, input_size, output_size, config=config,
                                   **linear_kwargs)
        self.norm = build_module(submodules.norm, config=config, hidden_size=output_size,
                                 eps=config.layernorm_epsilon)

    def forward(self, x):
        out, bias = self.linear(x)
        assert bias is None, "PostNormLinear expects a bias-free projection"
        return self.norm(out), None


class LoopedTransformerLayer(TransformerLayer):
    """A TransformerLayer whose attention may read this layer's slice of the stacked Global KV.

    ``TransformerBlock`` hands every layer the same ``context``; for AsymLoop under full
    recomputation that is the Global KV of all decoder layers stacked on dim 0, computed once per
    forward. Passing it as ``context`` (a tensor argument) keeps it visible to megatron-core's
    activation recomputation, which replays the layer with the same arguments.

    Layer numbers: megatron-core numbers the layers of every block from 1 (``layer_number``, which
    also indexes the block's checkpoint stacking); the stacked Global KV has one entry per layer
    the building block holds, in order (``context_index``).
    ``global_layer_number`` = ``layer_offset`` + ``layer_number`` is unique in the model (encoder
    1..E, decoder E+1..E+D; LatentLoop prelude, middle, coda in order); it keys what is shared
    model-wide: the attention's inference KV cache and the MoE router's statistics.
    """

    def __init__(self, *args, layer_offset: int = 0,
                 block_layer_numbers: tuple[int, ...] | None = None, **kwargs):
        # TransformerBlock builds its layers numbered 1, 2, ...; a block holding only some layers
        # of a longer block (a pipeline stage's share, ``LayerBlock``) gives their numbers there.
        position = kwargs.get("layer_number", 1)
        if block_layer_numbers is not None:
            kwargs["layer_number"] = block_layer_numbers[position - 1]
        super().__init__(*args, **kwargs)
        self.context_index = position - 1  # into the building block's stacked Global KV
        # (context, a call's (keys, values): GlobalKVMixin.loop_global_kv): _global_kv_slice
        self.global_kv_projections: tuple | None = None
        self.global_layer_number = self.layer_number + layer_offset
        self.self_attention.layer_number = self.global_layer_number
        if hasattr(self.mlp, "set_layer_number"):
            self.mlp.set_layer_number(self.global_layer_number)

    def _global_kv_slice(self, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's (keys, values) of the stacked Global KV ``context``.

        When ``context`` is the forward running's (``global_kv_projections``, set by
        LoopedLM._global_kv_context: the stack under full recomputation, else None): the layer's
        projections themselves (or, GlobalKVMixin.loop_global_kv, their heads repeated once),
        whose gradients from the K calls add up in their own size and reach the projection
        directly. A slice of the
        stack would send each of the D x K calls' gradients through the stack: indexed, as a
        zero-filled stack-sized tensor with the slice copied in, all of them then added up.
        megatron-core's activation recomputation replays the layer on a detached copy of the
        stack, whose gradient it hands to the stack: that copy is indexed, by Python indices
        (an index tensor copied from the host synchronised the GPU once per layer call)."""
        if self.global_kv_projections is not None and self.global_kv_projections[0] is context:
            return self.global_kv_projections[1]()
        assert context is not None, (f"decoder layer {self.layer_number}: no Global KV (the "
                                     "stacked context is built for full recomputation only)")
        return tuple(context[self.context_index].unbind(0))

    def _forward_attention(self, hidden_states, *args, context=None, rotary_pos_emb=None, **kwargs):
        attention = self.self_attention
        if not isinstance(attention, GlobalKVMixin):
            return super()._forward_attention(hidden_states, *args, context=context,
                                              rotary_pos_emb=rotary_pos_emb, **kwargs)
        if isinstance(attention, GlobalOnlyAttention) and rotary_pos_emb is not None:
            # Its keys are the Global keys, already rotated: rotate only the queries.
            rotary_pos_emb = (rotary_pos_emb, None)
        global_kv = self._global_kv_slice(context)
        # Without grad mode (the first pass of activation recomputation, evaluation) a view of a
        # tensor that requires grad still claims to require it but has no grad_fn, which trips
        # module-level autograd hooks (FlopCounterMode); nothing needs its gradient there.
        attention.global_kv = (global_kv if torch.is_grad_enabled()
                               else tuple(t.detach() for t in global_kv))
        try:
            return super()._forward_attention(hidden_states, *args, context=context,
                                              rotary_pos_emb=rotary_pos_emb, **kwargs)
        finally:
            attention.global_kv = None


class LayerBlock(TransformerBlock):
    """A TransformerBlock holding layers ``numbers`` (1-based, ascending) of a block of
    ``config.num_layers`` layers: a pipeline stage's share of the encoder or of the looped decoder
    (megaloop.models.pipeline), or all of it. Its layers keep their numbers in the whole block,
    where checkpoints stack them, so that a checkpoint reads the same in every pipeline layout.

    ``span(first, count)`` is a block running layers first..first+count-1 in order: this block when
    that is all of it, else a TransformerBlock over the same layer modules (not registered as a
    submodule: the owner saves, counts and moves them; ``LoopedLM.train`` sets its mode).
    """

    def __init__(self, config, layer_spec: ModuleSpec, numbers: tuple[int, ...]):
        spec = dataclasses.replace(layer_spec, params={**layer_spec.params,
                                                       "block_layer_numbers": tuple(numbers)})
        super().__init__(config, TransformerBlockSubmodules(layer_specs=[spec] * len(numbers)),
                         post_layer_norm=False)

    def span(self, first: int, count: int) -> TransformerBlock:
        numbers = [layer.layer_number for layer in self.layers]
        start = numbers.index(first)
        if start == 0 and count == len(numbers):
            return self
        view = TransformerBlock(self.config, TransformerBlockSubmodules(layer_specs=[]),
                                post_layer_norm=False)
        view.layers = self.layers[start:start + count]
        view.num_layers_per_pipeline_rank = count
        return view

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None):
        """megatron-core's, whose local keys name a layer by its number in the whole block; loading
        (``load_state_dict``) needs its position in this one."""
        state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        position = {layer.layer_number - 1: i for i, layer in enumerate(self.layers)}
        layers, renamed = f"{prefix}layers.", {}
        for key, value in state.items():
            if key.startswith(layers):
                number, rest = key[len(layers):].split(".", 1)
                key = f"{layers}{position[int(number)]}.{rest}"
            renamed[key] = value
        return renamed
