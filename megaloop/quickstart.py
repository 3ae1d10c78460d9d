"""Quickstart: a tiny AsymLoop next to Dense and Full Loop at matched effective depth, on CPU.

    python -m megaloop.quickstart [--steps 40]

Builds the three architectures from megatron-core specs, prints parameters and analytical FLOPs,
then trains each for a few AdamW steps on an embedded multi-hop task and prints the loss curve ends.
"""

from __future__ import annotations

import argparse
import time

import torch

from megaloop.models.flops import forward_flops


def multi_hop_batch(batch: int, seq: int, vocab: int, hops: int, generator) -> torch.Tensor:
    """Chains of variable bindings "a=b b=c c=d ..." where predicting a value needs earlier
    bindings: a small task where depth (and looping) matters, unlike random tokens."""
    symbols = torch.stack([torch.randperm(vocab - 1, generator=generator)[:seq] + 1
                           for _ in range(batch)])
    out = symbols.clone()
    for h in range(1, hops + 1):  # every hops-th token repeats a token seen earlier
        out[:, h::hops + 1] = symbols[:, : out[:, h::hops + 1].shape[1]]
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args(argv)

    import megaloop.api as ml

    size = dict(seq_length=args.seq, vocab_size=256, hidden_size=64, ffn_hidden_size=172,
                num_attention_heads=4)
    runs = {"dense (8 layers)": dict(arch="dense", num_layers=8),
            "fullloop (4 layers x R=2)": dict(arch="fullloop", iterations=2),
            "asymloop (2 + 2 layers x K=3)": dict(arch="asymloop", iterations=3)}
    print(f"{'model':<30} {'params':>8} {'MFLOP/token':>12} {'loss@1':>8} {'loss@end':>9} {'s':>6}")
    for name, arch in runs.items():
        model = ml.build("tiny", **size, **arch)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
        generator = torch.Generator().manual_seed(0)
        losses, start = [], time.perf_counter()
        for _ in range(args.steps):
            tokens = multi_hop_batch(args.batch, args.seq + 1, 256, hops=3, generator=generator)
            loss = model(tokens[:, :-1], labels=tokens[:, 1:]).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        params = sum(p.numel() for p in model.parameters())
        print(f"{name:<30} {params / 1e3:>7.0f}K {forward_flops(model.cfg).total / 1e6:>12.2f} "
              f"{losses[0]:>8.3f} {losses[-1]:>9.3f} {time.perf_counter() - start:>6.1f}")


if __name__ == "__main__":
    main()
