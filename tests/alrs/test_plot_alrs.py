import torch
from torch import nn

from megaloop.alrs import ALRS, ALRSConfig
from tools import plot_alrs


def test_classify_megatron_names():
    attention = "encoder.layers.0.self_attention.linear_qkv.weight"
    assert plot_alrs.classify(attention) == ("encoder", "attention")
    assert plot_alrs.classify(attention + ":k") == ("encoder", "attention")
    assert plot_alrs.classify("decoder.layers.1.self_attention.linear_proj.weight") == ("decoder", "attention")
    for part in ("", ":global_k", ":global_v"):
        name = "decoder.layers.1.self_attention.linear_kv_global.weight" + part
        assert plot_alrs.classify(name) == ("decoder", "global_kv")
    assert plot_alrs.classify("decoder.layers.1.mlp.linear_fc1.weight:gate") == ("decoder", "ffn")
    assert plot_alrs.classify("decoder.layers.1.mlp.linear_fc2.weight") == ("decoder", "ffn")
    # LatentLoop: before, the coda and the untied middle-block copies were in no figure.
    assert plot_alrs.classify("coda.layers.0.mlp.linear_fc2.weight") == ("coda", "ffn")
    assert plot_alrs.classify("visits.visit2.block.layers.0.self_attention.linear_qkv.weight:q"
                              ) == ("decoder", "attention")
    assert plot_alrs.classify("visits.visit1.projection.up_weight") is None
    assert plot_alrs.classify("embedding.word_embeddings.weight") is None
    assert plot_alrs.classify("output_layer.weight") is None


def _run(path, mode, layers=("encoder", "decoder")):
    g = torch.Generator().manual_seed(0)
    names = [f"{layer}.layers.0.{matrix}.weight" for layer in layers
             for matrix in ("self_attention.linear_qkv", "mlp.linear_fc1")]
    names += ["decoder.layers.0.self_attention.linear_kv_global.weight"]
    params = {n: nn.Parameter(torch.randn(24, 16, generator=g) * torch.rand(24, 16, generator=g) ** -(i / 2))
              for i, n in enumerate(names)}
    alrs = ALRS(lambda: params.items(), 60, ALRSConfig(mode=mode, interval=5, transition=3, fraction=0.5),
                log_path=str(path))
    for t in range(1, 61):
        alrs.step(t, 1e-3)
    alrs.close()


def test_figures_are_written_from_logs(tmp_path):
    _run(tmp_path / "a.zarr", "alrs")
    _run(tmp_path / "u.zarr", "uniform")
    assert plot_alrs.main(["--alrs", str(tmp_path / "a.zarr"), "--uniform", str(tmp_path / "u.zarr"),
                           "--out", str(tmp_path / "plots")]) == 0
    for path in (tmp_path / "plots" / "fig3_lr.png", tmp_path / "plots" / "fig4_stable_rank.png"):
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_figure_4_labels_a_decoder_boost_run_as_such(tmp_path, monkeypatch):
    """--alrs takes the log of any run but a uniform one; before, a decoder_boost run's curves
    were labelled "ALRS"."""
    _run(tmp_path / "b.zarr", "decoder_boost")
    _run(tmp_path / "u.zarr", "uniform")
    figures = []
    monkeypatch.setattr(plot_alrs, "save_figure", lambda fig, path: figures.append(fig))
    assert plot_alrs.main(["--alrs", str(tmp_path / "b.zarr"), "--uniform", str(tmp_path / "u.zarr"),
                           "--out", str(tmp_path / "plots")]) == 0
    labels = figures[1].axes[0].get_legend_handles_labels()[1]
    assert labels == ["encoder, decoder boost", "decoder, decoder boost", "encoder, uniform",
                      "decoder, uniform"]


def test_attention_means_local_q_k_v_o_and_global_kv_is_its_own_group():
    import numpy as np

    layer = "decoder.layers.0.self_attention."
    names = [layer + "linear_qkv.weight:q", layer + "linear_qkv.weight:k",
             layer + "linear_qkv.weight:v", layer + "linear_proj.weight",
             layer + "linear_kv_global.weight:global_k", layer + "linear_kv_global.weight:global_v"]
    means = plot_alrs.group_means(np.array([[1.0, 2.0, 3.0, 6.0, 10.0, 20.0]]), names)
    assert means.keys() == {("decoder", "attention"), ("decoder", "global_kv")}
    assert means["decoder", "attention"].tolist() == [3.0]
    assert means["decoder", "global_kv"].tolist() == [15.0]


def test_group_means_over_matching_matrices():
    import numpy as np

    names = ["encoder.layers.0.mlp.linear_fc1.weight", "encoder.layers.1.mlp.linear_fc2.weight",
             "decoder.layers.0.mlp.linear_fc1.weight", "base"]
    means = plot_alrs.group_means(np.array([[1.0, 3.0, 5.0, 7.0]]), names)
    assert means.keys() == {("encoder", "ffn"), ("decoder", "ffn")}
    assert means["encoder", "ffn"].tolist() == [2.0] and means["decoder", "ffn"].tolist() == [5.0]


def test_bad_inputs_are_one_line_errors_writing_nothing(tmp_path, capsys):
    from megaloop.alrs import ALRSLog

    _run(tmp_path / "a.zarr", "alrs")
    _run(tmp_path / "u.zarr", "uniform")
    _run(tmp_path / "dense.zarr", "uniform", layers=("decoder",))
    ALRSLog(tmp_path / "new.zarr", ["decoder.layers.0.mlp.linear_fc2.weight"], [(4, 4)],
            ["decoder.layers.0.mlp.linear_fc2.weight", "base"])  # a run killed before its rows
    ALRSLog(tmp_path / "other.zarr", ["layers.0.attn.weight"], [(4, 4)],
            ["layers.0.attn.weight", "base"])  # the ALRS API on a model of other names
    (tmp_path / "file").write_text("x")
    out = str(tmp_path / "plots")
    cases = [  # before the fix: tracebacks, or empty figures and exit 0
        (["--alrs", str(tmp_path / "none.zarr"), "--out", out],
         f"{tmp_path / 'none.zarr'}: no ALRS log there (a run with train.use_alrs=true writes "
         "<out_dir>/alrs.zarr)"),
        (["--alrs", str(tmp_path), "--out", out], f"{tmp_path}: no ALRS log there"),
        (["--alrs", str(tmp_path / "new.zarr"), "--out", out],
         f"{tmp_path / 'new.zarr'}: no spectra rows committed yet"),
        (["--alrs", str(tmp_path / "a.zarr"), "--uniform", str(tmp_path / "none.zarr"),
          "--out", out], f"{tmp_path / 'none.zarr'}: no ALRS log there"),
        # Before: swapped paths drew the uniform run as "ALRS" and the ALRS run as "uniform".
        (["--alrs", str(tmp_path / "u.zarr"), "--uniform", str(tmp_path / "a.zarr"), "--out",
          out], f"--alrs {tmp_path / 'u.zarr'}: the log of an alrs.mode='uniform' run; give it "
                "as --uniform"),
        (["--alrs", str(tmp_path / "a.zarr"), "--uniform", str(tmp_path / "a.zarr"), "--out",
          out], f"--uniform {tmp_path / 'a.zarr'}: the log of an alrs.mode='alrs' run; "
                "--uniform takes the log of an alrs.mode='uniform' run"),
        # Before: fig3_lr.png written, then "Number of columns must be a positive integer, not 0".
        (["--alrs", str(tmp_path / "other.zarr"), "--out", out],
         f"--alrs {tmp_path / 'other.zarr'}: none of its 1 matrices (e.g. 'layers.0.attn.weight') "
         "is an attention or FFN matrix of megatron-core's encoder or decoder layers"),
        # Before: the uniform run of another model drawn as Figure 4's comparison.
        (["--alrs", str(tmp_path / "a.zarr"), "--uniform", str(tmp_path / "dense.zarr"), "--out",
          out], f"--uniform {tmp_path / 'dense.zarr'}: its matrices differ from those of --alrs "
                f"{tmp_path / 'a.zarr'} (e.g. 'encoder.layers.0.mlp.linear_fc1.weight'): Figure 4 "
                "compares one model under ALRS and under uniform LRs"),
        (["--alrs", str(tmp_path / "a.zarr"), "--out", str(tmp_path / "file")],
         f"--out {tmp_path / 'file'}: cannot be written ({tmp_path / 'file'} is not a writable "
         "directory)"),
    ]
    capsys.readouterr()
    for argv, message in cases:
        assert plot_alrs.main(argv) == 2  # was 1 (SystemExit with a message)
        err = capsys.readouterr().err
        assert err.startswith(f"error: {message}") and err.count("\n") == 1, err
    assert not (tmp_path / "plots").exists()
