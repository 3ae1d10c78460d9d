"""ALRS analyses the matrices the reference analyses: the α of every block of megatron-core's fused
weights (Q, K, V, Global K, Global V, gate, up) equals the α of the same matrix in the unfused
plain-PyTorch model, with GQA, at TP=1 and TP=2 (where each rank holds its slice of every block)."""

import pytest
import torch
from torch import nn

from megaloop.alrs import ALRS, ALRSConfig, fused_layouts, spectral_stats, weight_blocks
from tests.alrs.unfused import reference_model, reference_name
from tests.distributed import run_distributed

MODEL = dict(arch="asymloop", num_layers=4, hidden_size=32, ffn_hidden_size=48,
             num_attention_heads=4, num_query_groups=2, vocab_size=64, seq_length=16, iterations=2)


def _alphas(rank, world_size, granularity="block"):
    from megatron.core import parallel_state as ps

    from megaloop.config import ModelConfig, ParallelConfig
    from megaloop.models.model import build_model
    from megaloop.platform.distributed import init_distributed

    init_distributed(tensor_parallel=world_size, seed=5)
    model = build_model(ModelConfig(**MODEL), ParallelConfig(tensor=world_size))
    g = torch.Generator().manual_seed(11 + rank)
    with torch.no_grad():  # heavy, element-wise different tails: every matrix gets its own α
        for param in model.parameters():
            param.mul_(torch.rand(param.shape, generator=g) ** -0.6)
    alrs = ALRS(model, 100, ALRSConfig(granularity=granularity),
                tp_group=ps.get_tensor_model_parallel_group())
    alrs.step(1)
    reference = {n: p.detach() for n, p in reference_model(model).named_parameters()}
    return {n: s.alpha for n, s in alrs.last_stats.items()}, reference


def _check_against_reference(alphas, reference):
    matrices = {n for n, p in reference.items() if p.ndim == 2}
    assert {reference_name(b) for b in alphas} == matrices  # each reference matrix, once
    for block, alpha in alphas.items():
        expected = spectral_stats(reference[reference_name(block)], block)[0].alpha
        assert alpha == pytest.approx(expected, rel=1e-9), block


def test_block_alphas_equal_the_unfused_reference_matrices(mcore):
    alphas, reference = _alphas(0, 1)
    assert len(alphas) == 1 + 2 * 7 + 2 * 9 + 1  # embedding, encoder, decoder layers, head
    _check_against_reference(alphas, reference)


def test_tp2_blocks_are_reassembled_from_every_rank(mcore):
    (alphas0, reference0), (alphas1, _) = run_distributed(_alphas, world_size=2)
    assert alphas0 == alphas1
    _check_against_reference(alphas0, reference0)


def test_parameter_granularity_analyses_each_fused_weight_whole(mcore):
    alphas, reference = _alphas(0, 1, granularity="parameter")
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert len(alphas) == 1 + 2 * 4 + 2 * 5 + 1 and qkv in alphas
    fused = torch.cat([reference[f"decoder.0.attn.{p}_proj.weight"] for p in "qkv"])
    # Row order does not change singular values, so the reference's [Q; K; V] has the fused α.
    assert alphas[qkv] == pytest.approx(spectral_stats(fused)[0].alpha, rel=1e-9)


class _Attention(nn.Module):
    def __init__(self, rows):
        super().__init__()
        self.linear_qkv = nn.Linear(8, rows, bias=False)
        self.num_query_groups_per_partition, self.num_attention_heads_per_partition = 2, 4
        self.hidden_size_per_attention_head = 2


def test_weights_that_do_not_fit_the_layout_are_refused_not_split_wrongly():
    assert fused_layouts(_Attention(16))["linear_qkv.weight"].period == 8  # 2 groups x (2q+k+v)
    # 24 rows = 2 groups with an attention output gate [q; gate; k; v]: a multiple of the period,
    # still not the layout.
    for rows in (24, 30):
        with pytest.raises(ValueError, match=r"cannot split linear_qkv.weight .*granularity"):
            fused_layouts(_Attention(rows))


def test_blocks_of_a_tp_shard_have_the_full_shape():
    weight = nn.Parameter(torch.zeros(16, 8))
    weight.tensor_model_parallel, weight.partition_dim = True, 0
    blocks = weight_blocks([("a.linear_qkv.weight", weight)],
                           fused_layouts(nn.ModuleDict({"a": _Attention(16)})), tp_size=2)
    assert [(b.name, b.full_shape) for b in blocks] == [
        ("a.linear_qkv.weight:q", (16, 8)), ("a.linear_qkv.weight:k", (8, 8)),
        ("a.linear_qkv.weight:v", (8, 8))]
    assert blocks[1].local_rows(16).tolist() == [4, 5, 12, 13]
