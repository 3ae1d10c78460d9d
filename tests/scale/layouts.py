"""Loss curves of one tiny run config under several layout strings, for the parity tests: one
seed checkpoint, "single" in this process, the others on tests.distributed's reused workers."""

from pathlib import Path

from megaloop.scale.layout import parse_layout
from megaloop.scale.loss_compare import save_seed_checkpoint, train_curve
from tests.distributed import run_distributed


def layout_curves(cfg, layouts, root: Path, steps: int) -> dict[str, dict[int, float]]:
    seed = save_seed_checkpoint(cfg, str(root / "seed"))
    curves = {}
    for layout in layouts:
        kwargs = dict(cfg=cfg, layout=layout, seed_checkpoint=seed,
                      out_dir=str(root / layout.replace(",", "_")))
        size = parse_layout(layout).world_size
        curves[layout] = (train_curve(0, 1, **kwargs) if size == 1 else
                          run_distributed(train_curve, world_size=size, **kwargs)[0])
        assert sorted(curves[layout]) == list(range(1, steps + 1)), layout
    return curves
