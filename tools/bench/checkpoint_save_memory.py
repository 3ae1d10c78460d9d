"""Peak memory of saving a model's weights as a megatron-core checkpoint
(megaloop.training.checkpoint.save_checkpoint), against the size of its fp32 weights. Prints JSON.

    python tools/bench/checkpoint_save_memory.py [--preset 60M --arch asymloop]

Each layout is measured in a fresh process, on the CPU: ``model`` is the bare model (a seed or
converted checkpoint), ``ddp`` the model wrapped as training wraps it, megatron-core's
DistributedDataParallel with the distributed optimizer (parameters become views into one flat
buffer). A first save runs unmeasured; then the peak resident set size is reset (Linux
``/proc/self/clear_refs``) and a second save measured.
``peak_over_fp32_weights``: how far that save's peak RSS rose above the RSS it started from, in
units of the fp32 weights. ``view_bytes_over_fp32_weights``: the tensors of the sharded state dict
(megatron-core's factories applied) that are views of a larger storage, in the same unit:
megatron-core's writer clones each such CPU tensor before writing (torch.save of a view would
write its whole storage), all of them alive until the save ends.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from megaloop.cli import child_failure, parsed_preset, quiet_third_party_warnings
from megaloop.config import DEFAULT_ITERATIONS
from megaloop.presets import preset


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _view_bytes(sharded_state: dict) -> tuple[int, list[str]]:
    """Bytes of the tensors the writer would clone, and the local names of their weights."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    total, names = 0, set()
    for entry in nested_values(sharded_state):
        built = entry.build() if isinstance(entry, ShardedTensorFactory) else entry
        for item in built if isinstance(built, list) else [built]:
            if not isinstance(item, ShardedTensor):
                continue
            data = item.data
            if data.untyped_storage().size() != data.numel() * data.itemsize:
                total += data.numel() * data.itemsize
                names.add(item.key.rsplit(".", 2)[-2] + "." + item.key.rsplit(".", 1)[-1])
    return total, sorted(names)


def measure(preset_name: str, arch: str, layout: str) -> dict:
    import torch

    from megaloop.config import DataConfig, RunConfig
    from megaloop.hf.checkpoint import build_single_process_model
    from megaloop.training.checkpoint import save_checkpoint

    cfg = preset(preset_name, arch=arch).resolve()
    torch.manual_seed(0)
    model = build_single_process_model(cfg)
    parameters = sum(p.numel() for p in model.parameters())
    if layout == "ddp":
        from megatron.core.distributed import DistributedDataParallelConfig

        from megaloop.training.ddp import CollectableDDP

        CollectableDDP(model.config, DistributedDataParallelConfig(
            use_distributed_optimizer=True, grad_reduce_in_fp32=True, overlap_grad_reduce=False),
            model)
    run = RunConfig(model=cfg, data=DataConfig(eod_id=2))
    views, view_names = _view_bytes(model.sharded_state_dict())
    with tempfile.TemporaryDirectory(prefix="megaloop-save-memory-") as workdir:
        save_checkpoint(Path(workdir) / "warm", 0, {"model": model.sharded_state_dict()}, run, 1)
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
        start = _status_bytes("VmRSS")
        save_checkpoint(Path(workdir) / "measured", 0, {"model": model.sharded_state_dict()}, run,
                        1)
        rise = _status_bytes("VmHWM") - start
    return {"parameters": parameters, "peak_rss_rise": rise,
            "peak_over_fp32_weights": round(rise / (4 * parameters), 3),
            "view_bytes_over_fp32_weights": round(views / (4 * parameters), 3),
            "views": view_names}


def main(argv=None):
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="60M")
    parser.add_argument("--arch", default="asymloop", choices=sorted(DEFAULT_ITERATIONS))
    parser.add_argument("--measure", metavar="LAYOUT", help=argparse.SUPPRESS)  # the child
    args = parser.parse_args(argv)
    parsed_preset(parser, args.preset, arch=args.arch)
    quiet_third_party_warnings()
    if args.measure:
        print(json.dumps(measure(args.preset, args.arch, args.measure)))
        return
    rows = {}
    for layout in ("model", "ddp"):
        # Every block of 128 KiB or more mapped on its own, returned to the system when freed
        # (glibc), so that the RSS follows the tensors alive.
        child = subprocess.run([sys.executable, __file__, "--preset", args.preset, "--arch",
                                args.arch, "--measure", layout], capture_output=True, text=True,
                               env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"})
        failure = child_failure(child, f"the {layout} measurement")
        if failure:
            raise SystemExit(f"error: {failure}")
        rows[layout] = json.loads(child.stdout.strip().splitlines()[-1])
    print(json.dumps({"config": {"preset": args.preset, "arch": args.arch}, "saves": rows},
                     indent=2))


if __name__ == "__main__":
    main()
