"""The layer specs behave the same whatever backend builds them: causality for every attention role,
and checkpoints that move between the local (CPU) spec and the Transformer Engine spec.

Transformer Engine does not install on CPU machines. Its two relevant behaviours are reproduced
with megatron-core's own local modules: its core attention masks by the spec's ``attn_mask_type``
(no mask tensor is passed), as megatron-core's DotProductAttention does; and its modules carry
``_extra_state`` (FP8 scaling state) that local-spec norms and core attention do not. The GPU check
(tests/models/test_gpu.py) repeats both with the real Transformer Engine.
"""

import pickle
import tempfile
from pathlib import Path

import pytest
import torch
from megatron.core import dist_checkpointing
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.transformer.dot_product_attention import DotProductAttention

from megaloop.models import specs
from megaloop.models.model import build_model
from megaloop.training.checkpoint import load_checkpoint
from tests.models.variants import assert_causal, small_config

# One variant per attention role: plain (and OLMo post-norms), joint, global_only.
ROLE_VARIANTS = ["dense_olmo", "asymloop", "asymloop_no_local_kv"]


class TEStyleExtraState:
    """Transformer Engine's extra state: pickled bytes, read back on load (None: keep fresh)."""

    loaded = "fresh"

    def get_extra_state(self):
        return torch.frombuffer(bytearray(pickle.dumps({"recipe": "none"})), dtype=torch.uint8)

    def set_extra_state(self, state):
        if state is not None:
            self.loaded = pickle.loads(state.numpy().tobytes())


class TEStyleRMSNorm(TEStyleExtraState, torch.nn.RMSNorm):
    pass


class TEStyleNorm:
    """Builds norms the way megatron-core's TENorm does (a factory class), with extra state."""

    def __new__(cls, config, hidden_size, eps=1e-5, **kwargs):
        return TEStyleRMSNorm(hidden_size, eps=eps)


class TEStyleDotProductAttention(TEStyleExtraState, DotProductAttention):
    """As Transformer Engine's DotProductAttention: extra state that megatron-core leaves out of
    distributed checkpoints, and a hook that forgives its absence on load."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)

        def forgive_missing_extra_state(module, incompatible_keys):
            for key in list(incompatible_keys.missing_keys):
                if key.endswith("core_attention._extra_state"):
                    incompatible_keys.missing_keys.remove(key)

        self.register_load_state_dict_post_hook(forgive_missing_extra_state)


class TEStyleProvider(LocalSpecProvider):
    """megatron-core's local modules, with Transformer Engine's masking and extra state."""

    def layer_norm(self, rms_norm=False, for_qk=False):
        return TEStyleNorm

    def core_attention(self):
        return TEStyleDotProductAttention


@pytest.fixture
def te_style_backend(monkeypatch):
    monkeypatch.setattr(specs, "_backend",
                        lambda use_te: TEStyleProvider() if use_te else LocalSpecProvider())


def _tokens(cfg, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=g)


@pytest.mark.parametrize("variant", ROLE_VARIANTS)
def test_every_role_is_causal_under_a_backend_that_masks_by_spec(seeded, te_style_backend,
                                                                 variant):
    cfg = small_config(variant)
    assert_causal(build_model(cfg, use_te=True).eval(), _tokens(cfg), t=9)


def _roundtrip(source, target):
    """Saves ``source`` with dist_checkpointing and loads it into ``target`` as training does."""
    with tempfile.TemporaryDirectory() as directory:
        dist_checkpointing.save(source.sharded_state_dict(), directory)
        state = load_checkpoint(Path(directory), target.sharded_state_dict())
    target.load_state_dict(state)


@pytest.mark.parametrize("variant", ROLE_VARIANTS)
def test_checkpoints_move_between_local_and_transformer_engine_specs(seeded, te_style_backend,
                                                                     variant):
    cfg = small_config(variant)
    local, te = build_model(cfg, use_te=False), build_model(cfg, use_te=True)
    extra = [m for m in te.modules() if isinstance(m, TEStyleRMSNorm)]
    assert extra, "the TE-style model must carry extra state, or this test proves nothing"
    x = _tokens(cfg)

    # (Logits agree to rounding only: the TE-style core attention is DotProductAttention, the
    # local one SDPA.)
    _roundtrip(local, te)  # a CPU checkpoint onto the GPU spec: no _extra_state in it
    assert all(m.loaded == "fresh" for m in extra)
    with torch.no_grad():
        torch.testing.assert_close(te(x), local(x), atol=1e-5, rtol=1e-5)

    fresh_local = build_model(cfg, use_te=False)
    _roundtrip(te, fresh_local)  # and back: the TE extra state is not needed on CPU
    with torch.no_grad():
        torch.testing.assert_close(fresh_local(x), local(x), atol=0, rtol=0)

    # TE onto TE keeps the extra state that checkpoints hold (the norms').
    again = build_model(cfg, use_te=True)
    _roundtrip(te, again)
    norms = [m for m in again.modules() if isinstance(m, TEStyleRMSNorm)]
    assert norms and all(m.loaded == {"recipe": "none"} for m in norms)
