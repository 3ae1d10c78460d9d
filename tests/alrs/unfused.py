"""Test helpers: a megatron-core LoopedLM's weights as the unfused plain-PyTorch reference model.

``full_state_dict`` undoes tensor parallelism by hand (all-gather along each parameter's partition
dim; a gated ``linear_fc1`` shard is [gate_r; up_r] per rank, so gates and ups are gathered apart),
independently of ``megaloop.alrs.blocks``. ``reference_name`` maps an ALRS block name onto the
reference model's parameter name, so block-level results can be checked against separate matrices.
"""

from __future__ import annotations

import re

import torch

from megaloop.models.export import reference_config, to_reference_state_dict

_BLOCK_TO_REFERENCE = {
    "self_attention.linear_qkv.weight:q": "attn.q_proj.weight",
    "self_attention.linear_qkv.weight:k": "attn.k_proj.weight",
    "self_attention.linear_qkv.weight:v": "attn.v_proj.weight",
    "self_attention.linear_kv_global.weight:global_k": "attn.global_k_proj.weight",
    "self_attention.linear_kv_global.weight:global_v": "attn.global_v_proj.weight",
    "self_attention.linear_proj.weight": "attn.o_proj.weight",
    "mlp.linear_fc1.weight:gate": "mlp.gate_proj.weight",
    "mlp.linear_fc1.weight:up": "mlp.up_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
_TOP = {"embedding.word_embeddings.weight": "embed_tokens.weight",
        "output_layer.weight": "lm_head.weight"}


def reference_name(block: str) -> str:
    if block in _TOP:
        return _TOP[block]
    section, index, rest = re.match(r"^(encoder|decoder)\.layers\.(\d+)\.(.+)$", block).groups()
    return f"{section}.{index}.{_BLOCK_TO_REFERENCE[rest]}"


def full_state_dict(model) -> dict[str, torch.Tensor]:
    """The TP=1 state dict of a (possibly tensor-parallel) LoopedLM, fp32, on every rank."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    group = ps.get_tensor_model_parallel_group()
    out = {}
    for name, param in model.named_parameters():
        local = param.detach().float()
        if tp == 1 or not getattr(param, "tensor_model_parallel", False):
            out[name] = local.clone()
            continue
        if name.endswith("mlp.linear_fc1.weight"):
            gate, up = local.chunk(2, dim=0)
            out[name] = torch.cat(_all_gather(gate, group, tp) + _all_gather(up, group, tp), dim=0)
        else:
            out[name] = torch.cat(_all_gather(local, group, tp), dim=param.partition_dim)
    return out


def _all_gather(tensor, group, size):
    import torch.distributed as dist

    shards = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(shards, tensor.contiguous(), group=group)
    return shards


def reference_model(model):
    """A plain-PyTorch reference model (unfused Q/K/V/gate/up) carrying ``model``'s weights."""
    from megaloop.reference.modeling_asymloop import LoopedLM

    reference = LoopedLM(reference_config(model.cfg))
    reference.load_state_dict(to_reference_state_dict(full_state_dict(model), model.cfg), strict=True)
    return reference
