"""megaloop.api: build (one call, any preset and field, reproducible weights) and load (a
checkpoint's model and weights)."""

import re
import runpy
from pathlib import Path

import pytest
import torch

import megaloop.api as ml
from megaloop.config import ConfigError
from tests.docs import documentation
from tests.training.conftest import one_line


def test_build_is_reproducible_per_seed_and_takes_any_field(mcore):
    a = ml.build("tiny", arch="fullloop", seq_length=32, vocab_size=256, seed=5)
    b = ml.build("tiny", arch="fullloop", seq_length=32, vocab_size=256, seed=5)
    c = ml.build("tiny", arch="fullloop", seq_length=32, vocab_size=256, seed=6)
    assert a.cfg.iterations == 2 and a.cfg.vocab_size == 256
    for (name, pa), (_, pb), (_, pc) in zip(a.named_parameters(), b.named_parameters(),
                                            c.named_parameters()):
        assert torch.equal(pa, pb), name
    assert any(not torch.equal(pa, pc) for pa, pc in zip(a.parameters(), c.parameters()))


def test_build_puts_the_whole_model_on_the_process_device(mcore, monkeypatch):
    """On a GPU megatron-core makes its layers there and megaloop's norms, LatentLoop's scales
    and the MoE routers on the CPU: build() returned a model split between the two, which no
    input could run. Here the process device is the meta device, which nothing is made on."""
    from megaloop.training import collective

    monkeypatch.setattr(collective, "collective_device", lambda: torch.device("meta"))
    model = ml.build("tiny", arch="latentloop", num_experts=4, seq_length=32, vocab_size=256)
    assert {p.device.type for p in model.parameters()} == {"meta"}


def test_build_rejects_bad_fields_in_one_line(mcore):
    with pytest.raises(ConfigError, match="model.encoder_layers=9: must be in"):
        ml.build("tiny", arch="asymloop", encoder_layers=9)
    with pytest.raises(ConfigError, match=r"unknown field model.hiden_size \(did you mean "
                                          r"hidden_size\?\)"):
        ml.build("tiny", hiden_size=3)


def test_load_takes_a_runs_out_dir_for_its_latest_checkpoint(mcore, tmp_path):
    """A run's train.out_dir holds the run's config.yaml, not a checkpoint: load goes to the
    checkpoint directory that config names (or <out_dir>/checkpoints), rather than reading the
    out_dir as a checkpoint and failing on its missing files."""
    import dataclasses

    from megaloop.config import CheckpointConfig, RunConfig, save_yaml
    from megaloop.training.checkpoint import save_checkpoint

    model = ml.build("tiny", arch="fullloop", hidden_size=32, ffn_hidden_size=64,
                     num_attention_heads=2, vocab_size=256, seq_length=16, seed=3)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(tokens)
    for out_dir, checkpoint_dir in ((tmp_path / "default", tmp_path / "default" / "checkpoints"),
                                    (tmp_path / "named", tmp_path / "elsewhere")):
        cfg = RunConfig(model=model.cfg)
        if checkpoint_dir.parent != out_dir:
            cfg = dataclasses.replace(cfg, checkpoint=CheckpointConfig(dir=str(checkpoint_dir)))
        save_checkpoint(checkpoint_dir, 4, {"model": model.sharded_state_dict()}, cfg, keep_last=1)
        out_dir.mkdir(exist_ok=True)
        save_yaml(cfg, out_dir / "config.yaml")
        with torch.no_grad():
            assert torch.equal(ml.load(out_dir)(tokens), expected), out_dir


def test_load_gives_the_saved_model_and_refuses_what_the_weights_fix(mcore, tmp_path):
    from megaloop.config import RunConfig
    from megaloop.training.checkpoint import CheckpointError, save_checkpoint

    model = ml.build("tiny", arch="asymloop", iterations=2, hidden_size=32, ffn_hidden_size=64,
                     num_attention_heads=2, vocab_size=256, seq_length=16, seed=3)
    save_checkpoint(tmp_path / "ckpt", 7, {"model": model.sharded_state_dict()},
                    RunConfig(model=model.cfg), keep_last=1)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, deeper = model(tokens), model(tokens, num_iterations=5)
    loaded = ml.load(tmp_path / "ckpt")  # the run's checkpoint directory: its latest
    assert not loaded.training and loaded.cfg == model.cfg
    with torch.no_grad():
        assert torch.equal(loaded(tokens), expected)
        assert torch.equal(ml.load(tmp_path / "ckpt" / "iter_0000007", iterations=5)(tokens),
                           deeper)
    with pytest.raises(ConfigError, match=r"model.hidden_size: fixed by the checkpoint .*"
                                          r"iter_0000007; a loaded model may change only "
                                          r"iterations, joint_attention"):
        ml.load(tmp_path / "ckpt", hidden_size=64)
    # Before: "model.iteratons: fixed by the checkpoint", about a field that does not exist.
    with pytest.raises(ConfigError, match=r"^unknown field model.iteratons \(did you mean "
                                          r"iterations\?\)$"):
        ml.load(tmp_path / "ckpt", iteratons=5)
    with pytest.raises(CheckpointError, match=r"nowhere: no checkpoint there"):
        ml.load(tmp_path / "nowhere")
    config = tmp_path / "ckpt" / "iter_0000007" / "config.yaml"
    saved = config.read_text()
    config.write_text(saved.replace("hidden_size:", "hiden_size:", 1))
    with pytest.raises(CheckpointError, match=r"config.yaml: unknown field model.hiden_size"):
        ml.load(tmp_path / "ckpt")
    config.write_text(saved)
    (tmp_path / "ckpt" / "iter_0000007" / "common.pt").unlink()
    with pytest.raises(CheckpointError, match=r"common.pt: missing or truncated"):
        ml.load(tmp_path / "ckpt")


# One of each architecture, and the parameters megaloop makes itself: Global KV projections, tied
# embeddings, MoE routers and experts (a shared one), LatentLoop's compression scales, width
# projections and learned residual scales.
LOADED_VARIANTS = ["dense", "fullloop", "asymloop_tied_gqa1", "asymloop_moe", "latentloop",
                   "latentloop_moe_width"]


def _small(variant: str) -> dict:
    from tests.models.variants import ALL_VARIANTS, SMALL

    return {**SMALL, **ALL_VARIANTS[variant]}


@pytest.mark.parametrize("variant", LOADED_VARIANTS)
def test_load_fills_every_tensor_from_the_checkpoint(mcore, tmp_path, variant):
    from megaloop.config import RunConfig
    from megaloop.training.checkpoint import save_checkpoint

    model = ml.build("tiny", seed=3, **_small(variant))
    save_checkpoint(tmp_path, 1, {"model": model.sharded_state_dict()}, RunConfig(model=model.cfg),
                    keep_last=1)
    loaded = ml.load(tmp_path)
    saved, filled = model.state_dict(), loaded.state_dict()
    assert saved.keys() == filled.keys()
    for name, tensor in saved.items():
        if isinstance(tensor, torch.Tensor):
            assert torch.equal(filled[name], tensor), name
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(tokens), model.eval()(tokens))


@pytest.mark.parametrize("variant", LOADED_VARIANTS)
def test_a_model_built_to_be_loaded_draws_no_random_weights(mcore, variant):
    from megaloop.models.model import build_model
    from megaloop.presets import preset

    cfg = preset("tiny", **_small(variant))
    before = torch.get_rng_state()
    build_model(cfg, initialize=False)
    assert torch.equal(torch.get_rng_state(), before)
    build_model(cfg)  # training builds initialise, drawing from the generator
    assert not torch.equal(torch.get_rng_state(), before)


def _saved_asymloop(tmp_path):
    from megaloop.config import RunConfig
    from megaloop.training.checkpoint import save_checkpoint

    model = ml.build("tiny", seed=3, **_small("asymloop"))
    return model, save_checkpoint(tmp_path, 1, {"model": model.sharded_state_dict()},
                                  RunConfig(model=model.cfg), keep_last=1)


def test_load_refuses_a_model_tensor_the_checkpoint_does_not_fill(mcore, tmp_path):
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject

    from megaloop.api import _build_on_device
    from megaloop.training.checkpoint import CheckpointError

    _, path = _saved_asymloop(tmp_path)
    name = "output_layer.weight"

    def build(map_entry):
        def build_model(cfg):
            model = _build_on_device(cfg)
            full = model.sharded_state_dict

            def sharded_state_dict(*args, **kwargs):
                state = full(*args, **kwargs)
                entry = map_entry(state.pop(name), model.state_dict()[name])
                return state if entry is None else {**state, name: entry}

            model.sharded_state_dict = sharded_state_dict
            return model
        return build_model

    # Loaded as the model's own (unfilled) tensor: megatron-core and load_state_dict accept it.
    with pytest.raises(CheckpointError, match=rf"^{path}: did not fill the model's {name} \(NaN"):
        ml.load_with(build(lambda entry, own: LocalNonpersistentObject(own)), path)
    # Not asked of the checkpoint at all.
    with pytest.raises(CheckpointError, match=rf"^{path}: holds no value for the model's {name}$"):
        ml.load_with(build(lambda entry, own: None), path)


def test_load_refuses_a_depth_a_latentloop_cannot_run(mcore, tmp_path):
    """iterations= sets a looped model's test-time depth; a MoE Loop (LatentLoop) runs exactly
    its visits. Its fixed residual scales are no weights, so nothing else noticed (before: a
    3-visit model of 2-visit weights, without a word)."""
    from megaloop.config import RunConfig
    from megaloop.training.checkpoint import save_checkpoint

    model = ml.build("tiny", seed=3, **_small("moe_loop"))
    save_checkpoint(tmp_path, 1, {"model": model.sharded_state_dict()}, RunConfig(model=model.cfg),
                    keep_last=1)
    with pytest.raises(ConfigError, match=r"^model.iterations=3: .*iter_0000001: arch=latentloop "
                                          r"runs exactly its iterations=2 visits"):
        ml.load(tmp_path, iterations=3)
    assert ml.load(tmp_path, iterations=model.cfg.num_iterations).cfg == model.cfg


REPO = Path(__file__).parents[1]


def test_documented_python_api_snippet_runs_as_written(mcore):
    """The Python API block of the documentation (docs/models.md), executed as it stands: its calls
    and the shapes its comments state hold against the current API."""
    block = re.search(r"^#+ Python API.*?```python\n(.*?)```", documentation(), re.S | re.M).group(1)
    names = {}
    exec(compile(block, "docs (Python API)", "exec"), names)
    tokens, vocab = names["tokens"], names["model"].cfg.vocab_size
    assert names["logits"].shape == (*tokens.shape, vocab)  # [B, N, V]
    assert names["losses"].shape == tokens.shape  # [B, N]
    assert names["deeper"].shape == (*tokens.shape, vocab)


def test_notebook_example_runs(mcore, capsys):
    """examples/notebook_quickcheck.py: three depths' losses, and the reference model's logits
    equal to megatron-core's."""
    runpy.run_path(str(REPO / "examples" / "notebook_quickcheck.py"), run_name="__main__")
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines[:3]] == ["K=1", "K=3", "K=6"]
    assert float(lines[3].rsplit("=", 1)[1]) < 1e-4


def test_load_refuses_initial_values_the_loaded_weights_replace(mcore, tmp_path):
    """Before: accepted, model.cfg reading them while the model computed with the checkpoint's
    learned residual scales (and init_std changed nothing)."""
    from megaloop.config import RunConfig
    from megaloop.training.checkpoint import save_checkpoint

    model = ml.build("tiny", seed=3, **_small("latentloop_moe"))
    save_checkpoint(tmp_path, 1, {"model": model.sharded_state_dict()}, RunConfig(model=model.cfg),
                    keep_last=1)
    for name, value, why in (("residual_scale_init", [0.01, 5.0], "learned residual scales are "
                              "weights"), ("init_std", 0.5, "it initialises weights")):
        with pytest.raises(ConfigError) as err:
            ml.load(tmp_path, **{name: value})
        assert one_line(err).startswith(f"model.{name}={value!r}: {tmp_path / 'iter_0000001'}: "
                                        f"without effect on a loaded model ({why}")
    assert ml.load(tmp_path, init_std=model.cfg.init_std).cfg == model.cfg  # as saved: no change
    # Fixed scales are no weights: the ones asked for are those the loaded model runs with.
    fixed = ml.build("tiny", seed=3, **_small("moe_loop"))
    save_checkpoint(tmp_path / "fixed", 1, {"model": fixed.sharded_state_dict()},
                    RunConfig(model=fixed.cfg), keep_last=1)
    loaded = ml.load(tmp_path / "fixed", residual_scale_init=[0.5, 0.5])
    assert [v.residual_scale.item() for v in loaded.visits] == [0.5, 0.5]


def test_a_latentloop_loads_for_an_odd_context_and_infers_as_the_trained_one(mcore, tmp_path):
    """Inference pools only complete groups of k tokens (the odd tail forms no latent, and still
    receives its writeback), so a LatentLoop runs at any length: loaded with seq_length=31 (it
    was refused: "a divisor of seq_length", a rule for training sequences), its logits at 31
    tokens and its greedy and cached decodings to the 31-token context are those of the trained
    32-token model's canonical forward. Training at 31 stays refused."""
    from megaloop.config import RunConfig
    from megaloop.generation import Cached, FullForward, greedy_generate
    from megaloop.models.export import to_reference
    from megaloop.training.checkpoint import save_checkpoint

    trained = ml.build("tiny", seed=3, **{**_small("latentloop_moe"), "seq_length": 32})
    save_checkpoint(tmp_path, 1, {"model": trained.sharded_state_dict()},
                    RunConfig(model=trained.cfg), keep_last=1)
    loaded = ml.load(tmp_path, seq_length=31)
    assert loaded.cfg.seq_length == 31
    tokens = torch.randint(0, trained.cfg.vocab_size, (2, 32), generator=torch.Generator()
                           .manual_seed(0))
    with torch.no_grad():
        canonical = trained.eval()(tokens)
        torch.testing.assert_close(loaded(tokens[:, :31]), canonical[:, :31], rtol=0, atol=1e-5)
    prompt = tokens[0, :6].tolist()
    out = greedy_generate(FullForward(loaded), prompt, 25, eos_id=None)
    assert len(out.tokens) == 25  # to the 31-token context
    sequence = torch.tensor([prompt + out.tokens])
    with torch.no_grad():
        expected = trained(sequence)[0, len(prompt) - 1:-1].argmax(-1)
    assert out.tokens == expected.tolist()
    assert greedy_generate(Cached(to_reference(loaded)), prompt, 25, eos_id=None).tokens == \
        out.tokens
    with pytest.raises(ConfigError, match=r"^model.latent_stride=2: must be a divisor of "
                                          r"model.seq_length=31 for training"):
        RunConfig(model=loaded.cfg).validate()
