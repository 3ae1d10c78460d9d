"""Peak memory of a Hugging Face export (megaloop.hf.to_hf) and of its import back
(megaloop.hf.from_hf) against the size of the model's fp32 weights, all measured in this run.
Prints JSON.

    python tools/bench/export_memory.py [--preset 60M --arch asymloop --dtypes float32 bfloat16]
                                        [--set model.FIELD=VALUE ...]

``--set``: model fields on top of the preset, as a run's overrides, e.g. a Mixtral-like model:
``--arch dense --set model.iterations=1 model.num_experts=8 model.moe_top_k=2
model.moe_ffn_hidden_size=1512``.

A checkpoint of the preset (random weights, fp32) is saved once; each dtype is then exported in a
fresh process (glibc mapping every large block on its own), which first exports once unmeasured
(imports, lazily built modules), returns the freed memory to the system, then resets its peak
resident set size (Linux ``/proc/self/clear_refs``) and exports again.
``peak_over_fp32_weights``: how far the second export's peak RSS rose above the RSS it started
from, in units of the fp32 weights (4 bytes x parameters): about 1 means one fp32 copy of the model
at a time; each further full copy alive at once adds 1 (0.5 in bfloat16 or float16). Small presets
overstate it: a fixed few tens of MB (probe activations, transformers' bookkeeping) weigh more.
``checkpoint_read_peak_over_fp32_weights``: the same for reading the checkpoint alone
(``load_checkpoint_model``, the first step of an export), the floor of an export's peak;
``checkpoint_read_seconds``: that read's wall time. ``import_peak_over_fp32_weights``: the same
for importing that export into a megaloop checkpoint (``import_hf``, also after an unmeasured one).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from megaloop.cli import child_failure, parsed_preset, quiet_third_party_warnings


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _peak_rise(function):
    """(``function()``, how far the RSS rose above where it started while it ran, its wall time
    in seconds)."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # what earlier work freed leaves the RSS
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
    start = _status_bytes("VmRSS")
    began = time.perf_counter()
    result = function()
    seconds = time.perf_counter() - began
    return result, _status_bytes("VmHWM") - start, seconds


def measure(checkpoint: str, dtype: str, workdir: str) -> dict:
    """In this (fresh) process: the peak RSS rise of an export and of its import, each after an
    unmeasured one, and of reading the checkpoint alone."""
    from megaloop.hf.checkpoint import load_checkpoint_model
    from megaloop.hf.common import quiet_transformers
    from megaloop.hf.from_hf import import_hf
    from megaloop.hf.to_hf import export_checkpoint

    quiet_transformers()
    work = Path(workdir)
    export_checkpoint(checkpoint, work / f"warm-{dtype}", dtype=dtype)
    report, rise, _ = _peak_rise(lambda: export_checkpoint(checkpoint, work / f"out-{dtype}",
                                                           dtype=dtype))
    _, read_rise, read_seconds = _peak_rise(lambda: load_checkpoint_model(checkpoint))
    import_hf(work / f"out-{dtype}", work / f"warm-import-{dtype}")
    _, import_rise, _ = _peak_rise(lambda: import_hf(work / f"out-{dtype}",
                                                     work / f"import-{dtype}"))
    return {"peak_rss_rise": rise, "checkpoint_read_peak_rss_rise": read_rise,
            "checkpoint_read_seconds": round(read_seconds, 3), "import_peak_rss_rise": import_rise,
            "safetensors_bytes": report["safetensors_bytes"], "class": report["class"]}


def main(argv=None):
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="60M")
    parser.add_argument("--arch", default="asymloop")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--set", nargs="+", default=[], metavar="model.FIELD=VALUE",
                        help="model fields on top of the preset")
    parser.add_argument("--measure", nargs=3, metavar=("CHECKPOINT", "DTYPE", "WORKDIR"),
                        help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args(argv)
    quiet_third_party_warnings()
    if args.measure:
        print(json.dumps(measure(*args.measure)))
        return

    import torch

    from megaloop.config import DataConfig, RunConfig, apply_overrides
    from megaloop.hf.checkpoint import build_single_process_model, save_weights_checkpoint

    for item in args.set:
        if not item.startswith("model."):
            parser.error(f"--set {item}: only model fields (model.FIELD=VALUE) shape the bench")
    cfg = apply_overrides(RunConfig(model=parsed_preset(parser, args.preset, arch=args.arch)), args.set).model
    cfg.validate()
    with tempfile.TemporaryDirectory(prefix="megaloop-export-memory-") as workdir:
        torch.manual_seed(0)
        model = build_single_process_model(cfg)
        parameters = sum(p.numel() for p in model.parameters())
        checkpoint = save_weights_checkpoint(model, RunConfig(model=cfg, data=DataConfig(eod_id=2)),
                                             Path(workdir) / "checkpoint")
        del model
        rows = {}
        for dtype in args.dtypes:
            # Every block of 128 KiB or more mapped on its own, returned to the system when freed
            # (glibc), so that the RSS follows the tensors alive.
            child = subprocess.run([sys.executable, __file__, "--measure", str(checkpoint), dtype,
                                    workdir], capture_output=True, text=True,
                                   env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"})
            failure = child_failure(child, f"the {dtype} measurement")
            if failure:
                raise SystemExit(f"error: {failure}")
            row = json.loads(child.stdout.strip().splitlines()[-1])
            for key in ("peak", "checkpoint_read_peak", "import_peak"):
                row[f"{key}_over_fp32_weights"] = row[f"{key}_rss_rise"] / (4 * parameters)
            rows[dtype] = row
    print(json.dumps({"config": {"preset": args.preset, "arch": args.arch, "set": args.set,
                                 "parameters": parameters, "fp32_weight_bytes": 4 * parameters,
                                 "threads": torch.get_num_threads()},
                      "exports": rows}, indent=2))


if __name__ == "__main__":
    main()
