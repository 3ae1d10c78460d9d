"""TransformerLayer ModuleSpecs for every megaloop variant; a variant is a spec swap, not a fork.

A layer has one of three attention roles:
- ``plain``: causal self-attention (Dense, Full Loop, the AsymLoop encoder, "no Global KV" ablations);
- ``joint``: AsymLoop decoder attention over [Global; Local] keys under one softmax;
- ``global_only``: the "no Local KV" ablation.
and one of two block styles: ``llama`` (pre-norm) or ``olmo`` (RMSNorm on sublayer outputs inside the
residual). The FFN is a SwiGLU MLP or a megatron-core MoE layer (megaloop.models.moe). The backend is
megatron-core's local modules on CPU, or Transformer Engine on GPU.
"""

from __future__ import annotations

from typing import Literal

from megatron.core.models.backends import LocalSpecProvider
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add

from megaloop.config import ModelConfig
from megaloop.models import moe as moe_specs
from megaloop.models.build_device import builds_on_gpu
from megaloop.models.norms import RMSNorm
from megaloop.models.layers import (
    CausalCoreAttention,
    GlobalKVSubmodules,
    GlobalOnlyAttention,
    JointCoreAttention,
    JointSelfAttention,
    LoopedTransformerLayer,
    PostNormLinear,
    PostNormLinearSubmodules,
)

Role = Literal["plain", "joint", "global_only"]


def transformer_engine_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return builds_on_gpu()


class _LocalBackend(LocalSpecProvider):
    """megatron-core's local modules, with a norm that supports sequence parallelism (its torch
    norm refuses it; see megaloop.models.norms)."""

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False) -> type:
        assert rms_norm, "megaloop's models use RMSNorm only"
        return RMSNorm


def _backend(use_te: bool):
    if use_te:
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

        return TESpecProvider()
    return _LocalBackend()


def layer_spec(cfg: ModelConfig, role: Role, use_te: bool, *, moe: bool = False,
               layer_offset: int = 0) -> ModuleSpec:
    """``moe``: the FFN is a MoE layer; ``layer_offset``: model-wide number of the block's first
    layer minus one (LoopedTransformerLayer.global_layer_number)."""
    backend = _backend(use_te)
    norm = backend.layer_norm(rms_norm=True, for_qk=False)
    qk_norm = backend.layer_norm(rms_norm=True, for_qk=True) if cfg.qk_norm else IdentityOp
    olmo = cfg.block == "olmo"
    # Transformer Engine fuses the pre-norm into the following linear; the OLMo block has no pre-norm.
    fused_norm = backend.fuse_layernorm_and_linear() and not olmo
    column = (backend.column_parallel_layer_norm_linear() if fused_norm
              else backend.column_parallel_linear())
    row = backend.row_parallel_linear()
    output_proj = (ModuleSpec(PostNormLinear, submodules=PostNormLinearSubmodules(row, norm))
                   if olmo else row)
    pre_norm = IdentityOp if (olmo or fused_norm) else norm
    if moe:  # the router needs the normalised input itself (no norm fused into an expert linear)
        ffn, pre_ffn_norm = moe_specs.moe_spec(backend, grouped_gemm=use_te), norm
    else:
        ffn = ModuleSpec(MLP, submodules=MLPSubmodules(linear_fc1=column, linear_fc2=output_proj))
        pre_ffn_norm = pre_norm

    if role == "joint":
        core = ModuleSpec(JointCoreAttention, params={"impl": cfg.joint_attention})
    elif use_te:
        core = backend.core_attention()
    else:
        core = CausalCoreAttention
    attention_sub = dict(core_attention=core, linear_proj=output_proj, q_layernorm=qk_norm,
                         k_layernorm=qk_norm)
    if role == "plain":
        module, sub = SelfAttention, SelfAttentionSubmodules(linear_qkv=column, **attention_sub)
    else:
        global_kv = dict(global_kv_layernorm=norm if cfg.global_kv_norm else IdentityOp,
                         linear_kv_global=backend.column_parallel_linear())
        if role == "joint":
            module, sub = JointSelfAttention, GlobalKVSubmodules(linear_qkv=column, **global_kv,
                                                                 **attention_sub)
        else:
            module, sub = GlobalOnlyAttention, GlobalKVSubmodules(linear_qkv=None, linear_q=column,
                                                                  **global_kv,
                                                                  **attention_sub)
    # Every role is causal, and says so in the one place every backend reads: Transformer Engine's
    # core attention masks by this type (it never receives a mask tensor), and so do megaloop's.
    # Queries and keys are N x N for every role; the joint role's core attention applies it to
    # each N x N half of its [Global; Local] keys.
    attention = ModuleSpec(module, params={"attn_mask_type": AttnMaskType.causal}, submodules=sub)

    keys_map = {}
    if not olmo:
        # Checkpoints keep Transformer Engine's fused-norm key names whatever the backend, so a
        # checkpoint moves between the local (CPU) and TE (GPU) specs.
        qkv_name = "linear_q" if role == "global_only" else "linear_qkv"
        keys_map = {"input_layernorm.": f"self_attention.{qkv_name}.layer_norm_"}
        if not moe:
            keys_map["pre_mlp_layernorm."] = "mlp.linear_fc1.layer_norm_"
    return ModuleSpec(
        LoopedTransformerLayer,
        params={"layer_offset": layer_offset},
        submodules=TransformerLayerSubmodules(
            input_layernorm=pre_norm,
            self_attention=attention,
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=pre_ffn_norm,
            mlp=ffn,
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map=keys_map,
        ),
    )


def final_norm_spec(use_te: bool):
    return _backend(use_te).layer_norm(rms_norm=True, for_qk=False)


def load_absent_extra_state_as_fresh(sharded_state_dict: dict, checkpoint_dir: str) -> dict:
    """Lets a checkpoint lacking some modules' ``_extra_state`` load into a model that has them.

    Transformer Engine modules (norms, core attention, linears) carry ``_extra_state``, their FP8
    scaling state; a local-spec (CPU) checkpoint has it only where megatron-core's local linears
    write an empty one. Every requested ``_extra_state`` the checkpoint lacks is loaded as None,
    which Transformer Engine reads as "keep the fresh state", instead of failing the load. The
    other direction needs nothing: entries a model does not request are not read.
    """
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedObject
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    saved = {item.key for item in load_sharded_metadata(str(checkpoint_dir)).values()}

    def fresh_if_absent(value):
        if (isinstance(value, ShardedObject) and value.key.endswith("_extra_state")
                and value.key not in saved):
            return LocalNonpersistentObject(None)
        return value

    return dict_list_map_inplace(fresh_if_absent, sharded_state_dict)
