import pytest

from megaloop.config import ConfigError
from megaloop.models.flops import forward_flops
from megaloop.presets import ARCH_BOUND, PRESETS, no_global_kv_wide, preset
from megaloop.models.flops import parameter_count


def _overhead(name):
    asym = forward_flops(preset(name, arch="asymloop", iterations=3)).total
    full = forward_flops(preset(name, arch="fullloop", iterations=2)).total
    return 100 * (asym / full - 1)


def test_flops_overhead_reproduces_the_paper_endpoints():
    """Paper (App. D, Table 9): +15.23% at 135M and +9.38% at 1B over Full Loop at matched depth."""
    assert _overhead("135M") == pytest.approx(15.23, abs=0.005)
    assert _overhead("1B") == pytest.approx(9.38, abs=0.005)
    assert _overhead("60M") > _overhead("350M") > _overhead("1B")


def test_matched_effective_depth_defaults():
    assert preset("135M", arch="asymloop").effective_depth == 24
    assert preset("135M", arch="fullloop").effective_depth == 24


def test_every_preset_validates_and_olmo_is_a_block_variant():
    for name in PRESETS:
        if name in ARCH_BOUND:
            preset(name)
            continue
        for arch in ("dense", "fullloop", "asymloop"):
            preset(name, arch=arch)
    assert preset("olmo", arch="fullloop").block == "olmo"
    assert preset("olmo", arch="fullloop").qk_norm is True


def test_an_architecture_bound_preset_refuses_another_architecture_naming_it():
    """Before: "model.prelude_layers=1: must be left at its default None unless arch=latentloop",
    a field the user had not set."""
    with pytest.raises(ConfigError, match=r"^arch='asymloop': preset 'latentloop-tiny' is an "
                                          r"arch='latentloop' model; the size presets tiny, 60M"):
        preset("latentloop-tiny", arch="asymloop")
    assert preset("moe-base-1.3B", arch="dense").arch == "dense"


def test_unknown_preset_is_a_clear_error():
    with pytest.raises(ConfigError, match="preset '2B': unknown; choose one of tiny, 60M"):
        preset("2B")


@pytest.mark.parametrize("overrides, message", [
    # Before: a bare KeyError('asym') from the iteration defaults.
    ({"arch": "asym"}, "model.arch='asym': must be one of 'dense', 'fullloop', 'asymloop', "
                       "'latentloop'"),
    ({"hidden_size": "wide"}, "model.hidden_size='wide': must be of type int"),
    ({"hiden_size": 64}, "unknown field model.hiden_size (did you mean hidden_size?)"),
])
def test_bad_overrides_are_one_line_errors_naming_the_field(overrides, message):
    with pytest.raises(ConfigError) as error:
        preset("tiny", **overrides)
    assert str(error.value) == message


def test_no_global_kv_wide_matches_parameters_within_a_percent():
    asym = preset("135M", arch="asymloop")
    wide = no_global_kv_wide(asym)
    assert wide.injection == "none" and wide.decoder_ffn_hidden_size > asym.ffn_hidden_size
    assert abs(parameter_count(wide) / parameter_count(asym) - 1) < 0.001


def test_the_command_lines_of_slurm_and_examples_validate():
    """What slurm/train_paper.sh and slurm/asymloop_7b.sh run: a preset, its architecture set by an
    override (the preset unresolved, so nothing of another architecture is left set), and the
    example YAML on the 7B preset; every architecture-bound preset as it is."""
    from pathlib import Path

    from megaloop.train import build_config

    data = ["data.path=[x]", "data.eod_id=0"]
    for name in ("60M", "135M", "350M", "1B"):
        for arch in ("dense", "fullloop", "asymloop"):
            cfg, _ = build_config(["--preset", name, f"model.arch={arch}", *data])
            assert cfg.model.arch == arch
    examples = Path(__file__).resolve().parents[1] / "examples" / "configs"
    for path in sorted(examples.glob("*.yaml")):
        build_config(["--preset", "7B", "--config", str(path), *data])
    for name in ARCH_BOUND:
        build_config(["--preset", name, *data])
