"""Per-GPU memory of a run config under its parallel layout, and the layouts that fit. Prints JSON.

    python tools/memory_estimate.py --preset 7B --config examples/configs/asymloop_7b.yaml \\
        --world-size 128 --memory-gib 80 [section.field=value ...]

Parameters, gradients, optimizer states (with or without the distributed optimizer), activations
(with or without recomputation, the Global KV and the K iterations' saved activations) and working
memory, per pipeline stage, in GiB; the model and rules are megaloop.scale.memory's. ``--device
cpu`` estimates a CPU run (local spec, fp32 by default). ``--memory-gib`` is each process's device
memory that "fits" and the fitting layouts are judged against: a GPU's (default 80), or with
``--device cpu`` a process's share of the host's memory (default: this host's memory divided by
``--world-size``, the processes of one host). ``--gpu-memory-gib``, its former name, is taken for a
GPU and refused for a CPU (it was read as the CPU's memory). ``needed_gib`` adds to the busiest
stage's estimate the device's allocator slack and what its process holds besides (a GPU's CUDA
context and NCCL, a CPU process's libraries: megaloop.scale.memory.OVERHEADS). A global batch that does not split into
micro-batches on this layout is noted (a launch refuses it), and the layouts listed as fitting are
ones a launch accepts. The data section plays no part in an estimate: a placeholder replaces it,
and the fields a --config sets there and ``data.*`` overrides are noted as replaced and ignored.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from megaloop.cli import (default_model_note, float_above, int_at_least, replaced_settings,
                          train_config_args)

# What replaces the data section, for the notes (the section plays no part in an estimate).
NO_DATA = "a placeholder (the data section plays no part in a memory estimate)"


def host_memory_gib() -> float:
    """This host's physical memory in GiB."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", help="model size preset (as megaloop-train)")
    parser.add_argument("--config", help="YAML run config (as megaloop-train)")
    parser.add_argument("--world-size", type=int_at_least(1), required=True,
                        help="number of processes (GPUs; with --device cpu, CPU processes)")
    parser.add_argument("--memory-gib", type=float_above(0),
                        help="memory of each process's device in GiB: a GPU's (default 80); with "
                             "--device cpu its share of the host's (default: this host's memory "
                             "/ --world-size)")
    parser.add_argument("--gpu-memory-gib", type=float_above(0),
                        help="--memory-gib's former name, for --device gpu")
    parser.add_argument("--device", choices=("gpu", "cpu"), default="gpu")
    parser.add_argument("overrides", nargs="*", help="section.field=value, as megaloop-train")
    args = parser.parse_intermixed_args(argv)
    if args.gpu_memory_gib is not None and (args.device == "cpu" or args.memory_gib is not None):
        parser.error(f"--gpu-memory-gib {args.gpu_memory_gib:g} with "
                     f"{'--device cpu' if args.device == 'cpu' else '--memory-gib'}: give the "
                     "memory of each process's device once, as --memory-gib")
    memory_gib = args.memory_gib or args.gpu_memory_gib or (
        80.0 if args.device == "gpu" else host_memory_gib() / args.world_size)

    from megaloop.config import ConfigError, load_yaml, micro_batches_per_step
    from megaloop.scale.layout import layout_of
    from megaloop.scale.memory import GIB, estimate, fitting_layouts
    from megaloop.train import build_config

    # The data section plays no part in an estimate: a placeholder section (last, so that it
    # replaces the config's whole, SFT settings included) satisfies the config's validation.
    placeholder = ["data={path: [unused], eod_id: 0}"]
    try:
        cfg, _ = build_config(train_config_args(args.preset, args.config) + args.overrides
                              + placeholder)
        layout = layout_of(cfg.parallel, args.world_size)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    note = default_model_note(args.preset, args.config, cfg.model)
    if note:
        print(f"note: {note}", file=sys.stderr)
    # Read already by build_config: it cannot fail here.
    replaced = args.config and replaced_settings(load_yaml(args.config), [cfg], {"data.*": NO_DATA})
    if replaced:
        print(f"note: {args.config}: {replaced}", file=sys.stderr)
    ignored = [item for item in args.overrides if item.partition("=")[0].split(".")[0] == "data"]
    if ignored:
        print(f"note: {', '.join(ignored)}: ignored, replaced by {NO_DATA}", file=sys.stderr)
    try:  # the memory does not depend on it, but the launch would be refused
        micro_batches_per_step(cfg.train, cfg.parallel, layout.data)
    except ConfigError as e:
        print(f"note: {e} (a launch refuses it; memory estimated all the same)", file=sys.stderr)
    device_bytes = int(memory_gib * GIB)
    stages = [estimate(cfg, layout, device=args.device, stage=s)
              for s in range(layout.pipeline)]
    busiest = max(stages, key=lambda e: e.total)
    fitting = fitting_layouts(cfg, args.world_size, device_bytes, device=args.device)
    print(json.dumps({
        "layout": layout.name, "layout_fields": dataclasses.asdict(layout),
        "stages": [e.as_dict() for e in stages],
        "needed_gib": round(busiest.needed / GIB, 2),
        "device": args.device, "memory_gib": round(memory_gib, 2),
        "fits": busiest.fits(device_bytes),
        "fitting_layouts_cheapest_first": [
            {"layout": found.name, "total_gib": round(est.total / GIB, 2)}
            for found, est in fitting[:5]],
    }, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
