"""No model setting is dropped by an export's config.json: each ModelConfig field, set to another
valid value on each variant, comes back as megaloop's import reads config.json
(``megaloop.hf.from_hf.read_config``), except what a native class cannot hold (``NATIVE_LOSES``).
A field added to ModelConfig fails here until ``OTHER_VALUES`` says what to set it to."""

import dataclasses

import pytest

from megaloop.config import ConfigError, ModelConfig
from megaloop.hf.from_hf import read_config
from megaloop.hf.native import native_config, native_family
from megaloop.models.export import reference_config
from tests.hf.exports import NATIVE_VARIANTS, variant_config
from tests.models.variants import ALL_VARIANTS

# Values each field is set to in turn (those a variant refuses are skipped).
OTHER_VALUES = dict(
    arch=["dense", "fullloop", "asymloop", "latentloop"], num_layers=[6], hidden_size=[96],
    ffn_hidden_size=[80], num_attention_heads=[2, 8], num_query_groups=[1, 4], head_dim=[8, 24],
    vocab_size=[100], seq_length=[24], encoder_layers=[1, 3], iterations=[1, 2, 4],
    block=["llama", "olmo"], qk_norm=[True, False], injection=["none", "additive", "global_kv"],
    local_kv=[False, True], global_kv_norm=[False], decoder_ffn_hidden_size=[128],
    joint_attention=["masked"], rotary_base=[500.0], norm_eps=[1e-6], init_std=[0.01],
    tie_embeddings=[True], num_experts=[0, 4, 8], moe_layers=["encoder", "decoder"],
    moe_top_k=[3, 4], moe_ffn_hidden_size=[48], moe_shared_expert_size=[0, 16],
    moe_aux_loss_coeff=[0.05], moe_z_loss_coeff=[0.0, 0.01], prelude_layers=[0, 2],
    coda_layers=[0, 2], latent_visits=[[], [2], [1, 2]], latent_stride=[3, 4],
    latent_writeback_lag=[1], latent_reduction=["width", "top_k", "expert_ffn"],
    residual_scale=["fixed"], residual_scale_init=[[0.5, 1.0]], untie_attention=[True],
    untie_moe=[True])
# (family, field): why a native class's config cannot hold it (docs/huggingface.md says so too).
NATIVE_LOSES = {
    **{("mixtral", name): "Mixtral has no dense FFN width (it comes back as expert width x top-k)"
       for name in ("ffn_hidden_size", "decoder_ffn_hidden_size")},
    **{(family, "moe_z_loss_coeff"): "no router z-loss (to-hf warns, from-hf sets 0)"
       for family in ("mixtral", "qwen3_moe")},
}


def test_every_field_has_other_values():
    assert set(OTHER_VALUES) == {f.name for f in dataclasses.fields(ModelConfig)}


@pytest.mark.parametrize("variant", list(ALL_VARIANTS) + list(NATIVE_VARIANTS))
def test_every_field_comes_back_from_config_json(variant, tmp_path):
    base, checked = variant_config(variant), 0
    for name, values in OTHER_VALUES.items():
        for value in values:
            cfg = dataclasses.replace(base, **{name: value})
            try:
                cfg.validate()
            except ConfigError:
                continue
            family, _ = native_family(cfg)
            config = reference_config(cfg) if family is None else \
                native_config(cfg, family, {"bos_token_id": None, "eos_token_id": 3})
            config.to_json_file(tmp_path / "config.json")
            _, back, _, _ = read_config(tmp_path)
            lost = {f.name: (getattr(cfg, f.name), getattr(back, f.name))
                    for f in dataclasses.fields(ModelConfig)
                    if getattr(back, f.name) != getattr(cfg, f.name)
                    and (family, f.name) not in NATIVE_LOSES}
            assert not lost, f"{variant} with {name}={value!r} ({family or 'remote code'}): " \
                             f"(set, read back) {lost}"
            checked += 1
    assert checked >= 20  # most changes are valid on every variant
