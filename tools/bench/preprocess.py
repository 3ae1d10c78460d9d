"""Benchmark tools/preprocess_data.py: throughput for 1 and 2 workers, and peak RSS as input grows.

    python tools/bench/preprocess.py [--articles PATH --tokenizer-model PATH --copies 40 --scale 10]

Input: the WikiText articles JSONL repeated ``--copies`` times (40 copies = 52 MB, the input of the
Megatron-LM anchor in DESIGN.md section 2: 2.9 MB/s with 1 worker, 2.8 MB/s with 2, LLaMA-2
SentencePiece). Rates exclude start-up, as Megatron-LM's own log lines do; wall time includes it.
Peak RSS is the largest sum over the tool's process tree (main process plus workers), sampled.
Encoder CPU seconds (sampled every 50 ms, so the last instants of each worker are missed) separate
the tokenizer's own speed from time lost to other load on these shared 2-core machines.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared" / "data"
ANCHOR_MBPS = {1: 2.9, 2: 2.8}  # Megatron-LM core_v0.16.1 preprocess_data.py on these machines
DONE = re.compile(r"done: ([\d,]+) documents, ([\d,]+) tokens in ([\d.]+)s")


def run_tool(input_path: str, tokenizer_model: str, workers: int, out_dir: str) -> dict:
    cmd = [sys.executable, str(REPO / "tools" / "preprocess_data.py"), "--input", input_path,
           "--output-prefix", os.path.join(out_dir, f"bench_w{workers}"), "--tokenizer-type",
           "SentencePieceTokenizer", "--tokenizer-model", tokenizer_model, "--append-eod",
           "--workers", str(workers), "--log-interval", "1000000000"]
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    tree, peak = psutil.Process(proc.pid), 0
    child_cpu: dict[int, float] = {}  # last CPU seconds seen per child (workers, resource tracker)
    while proc.poll() is None:
        try:
            children = tree.children(recursive=True)
            peak = max(peak, sum(p.memory_info().rss for p in [tree, *children]))
            for child in children:
                times = child.cpu_times()
                child_cpu[child.pid] = times.user + times.system
        except psutil.Error:  # a process exited between listing and reading
            pass
        time.sleep(0.05)
    wall = time.perf_counter() - started
    _, err = proc.communicate()
    match = DONE.search(err)
    if proc.returncode != 0 or match is None:
        raise SystemExit(f"error: preprocess_data.py failed (exit {proc.returncode}): {err.strip()[-500:]}")
    docs, tokens, seconds = int(match[1].replace(",", "")), int(match[2].replace(",", "")), float(match[3])
    size = os.path.getsize(input_path)
    return {
        "workers": workers, "input_MB": round(size / 1e6, 1), "docs": docs, "tokens": tokens,
        "docs_per_s": round(docs / seconds, 1), "tokens_per_s": round(tokens / seconds),
        "MB_per_s": round(size / seconds / 1e6, 2), "seconds": round(seconds, 2), "wall_s": round(wall, 2),
        "peak_rss_MB": round(peak / 2**20),
        # CPU time is what the encoders got, whatever else ran on the shared cores: MB per encoder
        # CPU-second far above MB_per_s / workers means the workers were waiting or descheduled.
        "encoder_cpu_s": round(sum(child_cpu.values()), 2),
        "MB_per_encoder_cpu_s": round(size / max(sum(child_cpu.values()), 1e-9) / 1e6, 2),
    }


def repeat(src: Path, copies: int, dest: str) -> None:
    data = src.read_bytes()
    with open(dest, "wb") as f:
        for _ in range(copies):
            f.write(data)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--articles", type=Path, default=SHARED / "wikitext2_raw_test_articles.jsonl")
    p.add_argument("--tokenizer-model", type=Path, default=SHARED / "llama2_tokenizer.model")
    p.add_argument("--copies", type=int, default=40)
    p.add_argument("--scale", type=int, default=10, help="the large input is this many times bigger")
    args = p.parse_args()
    for path in (args.articles, args.tokenizer_model):
        if not path.is_file():
            print(f"error: {path}: not found (pass --articles / --tokenizer-model)", file=sys.stderr)
            return 2
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        small, large = os.path.join(tmp, "small.jsonl"), os.path.join(tmp, "large.jsonl")
        repeat(args.articles, args.copies, small)
        for workers in (1, 2):
            r = run_tool(small, str(args.tokenizer_model), workers, tmp)
            r["speedup_vs_megatron_lm"] = round(r["MB_per_s"] / ANCHOR_MBPS[workers], 2)
            results[f"workers_{workers}"] = r
        os.remove(small)
        repeat(args.articles, args.copies * args.scale, large)
        results[f"workers_2_input_x{args.scale}"] = run_tool(large, str(args.tokenizer_model), 2, tmp)
    results["anchor_megatron_lm_MB_per_s"] = ANCHOR_MBPS
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
