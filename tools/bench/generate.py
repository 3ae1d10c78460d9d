"""Decode speed of the Hugging Face model (megaloop/reference): a looped model with its cache,
without it, and a Dense model of the same effective depth and width with its cache, in one run.
Prints JSON.

    python tools/bench/generate.py [--preset 60M --arch asymloop --iterations 3 --prompt 64
                                    --new-tokens 64 --batch 1 --repeats 5]

Each arm decodes greedily after a prompt, one token per forward: with the cache a forward sees the
new token only (the looped model's Local KV per (iteration, layer), its Global KV per decoder
layer, the encoder once per token); without it every forward recomputes the whole sequence. The
Dense model has J = E + K x D layers (the looped model's effective depth) of the same width. The
prefill is not timed. Arms alternate within each repeat, so that machine noise hits all of them.
Goal (issue 9): cached decoding of a looped model costs no more per token than the Dense model of
equal effective depth, within 10% (``looped_vs_dense_time_per_token`` <= 1.1).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch

from megaloop.cli import int_at_least, parsed_preset


@torch.no_grad()
def decode(model, prompt: torch.Tensor, steps: int, cached: bool) -> tuple[float, torch.Tensor]:
    """(seconds for ``steps`` greedy decode forwards after the prompt, the tokens)."""
    def next_token(logits):
        return logits[:, -1].argmax(-1, keepdim=True)

    cache = model.new_cache() if cached else None
    sequence = prompt
    token = next_token(model(prompt, cache=cache, use_cache=cached, logits_to_keep=1).logits)
    tokens = [token]
    start = time.perf_counter()
    for _ in range(steps - 1):
        if cached:
            logits = model(token, cache=cache, logits_to_keep=1).logits
        else:
            sequence = torch.cat([sequence, token], dim=1)
            logits = model(sequence, use_cache=False, logits_to_keep=1).logits
        token = next_token(logits)
        tokens.append(token)
    if prompt.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start, torch.cat(tokens, dim=1)


def main(argv=None):
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="60M")
    parser.add_argument("--arch", default="asymloop", choices=["fullloop", "asymloop"])
    parser.add_argument("--iterations", type=int_at_least(1), default=3)
    parser.add_argument("--prompt", type=int_at_least(1), default=64)
    # The first new token comes from the prefill: one more makes the first timed forward.
    parser.add_argument("--new-tokens", type=int_at_least(2), default=64)
    parser.add_argument("--batch", type=int_at_least(1), default=1)
    parser.add_argument("--repeats", type=int_at_least(1), default=5)
    args = parser.parse_args(argv)

    from megaloop.models.export import reference_class, reference_config

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    looped_cfg = parsed_preset(parser, args.preset, arch=args.arch, iterations=args.iterations)
    dense_cfg = dataclasses.replace(parsed_preset(parser, args.preset, arch="dense", iterations=1),
                                    num_layers=looped_cfg.effective_depth)
    torch.manual_seed(0)
    models = {name: reference_class(cfg)(reference_config(cfg)).to(device, dtype).eval()
              for name, cfg in (("looped", looped_cfg), ("dense", dense_cfg))}
    prompt = torch.randint(0, looped_cfg.vocab_size, (args.batch, args.prompt), device=device)
    arms = {"looped_cached": ("looped", True), "looped_uncached": ("looped", False),
            "dense_cached": ("dense", True)}
    times = {arm: [] for arm in arms}
    tokens = {}
    for repeat in range(args.repeats + 1):  # the first round warms up
        for arm, (name, cached) in arms.items():
            seconds, tokens[arm] = decode(models[name], prompt, args.new_tokens, cached)
            if repeat:
                times[arm].append(seconds)
    generated = args.batch * (args.new_tokens - 1)
    median = {arm: statistics.median(t) for arm, t in times.items()}
    fastest = {arm: min(t) for arm, t in times.items()}
    print(json.dumps({
        "config": {"preset": args.preset, "arch": args.arch, "iterations": args.iterations,
                   "effective_depth": looped_cfg.effective_depth,
                   "looped_layers": looped_cfg.num_layers, "dense_layers": dense_cfg.num_layers,
                   "hidden": looped_cfg.hidden_size, "vocab": looped_cfg.vocab_size,
                   "prompt": args.prompt, "new_tokens": args.new_tokens, "batch": args.batch,
                   "device": device, "dtype": str(dtype), "threads": torch.get_num_threads()},
        "decode_tokens_per_s": {"median": {a: generated / t for a, t in median.items()},
                                "max": {a: generated / t for a, t in fastest.items()}},
        "cache_speedup": {"median": median["looped_uncached"] / median["looped_cached"],
                          "min": fastest["looped_uncached"] / fastest["looped_cached"]},
        "looped_vs_dense_time_per_token": {
            "median": median["looped_cached"] / median["dense_cached"],
            "min": fastest["looped_cached"] / fastest["dense_cached"]},
        "goal_looped_vs_dense": 1.1,
        "cached_tokens_equal_uncached": bool(torch.equal(tokens["looped_cached"],
                                                         tokens["looped_uncached"])),
        "all_s": times,
    }, indent=2))


if __name__ == "__main__":
    main()
