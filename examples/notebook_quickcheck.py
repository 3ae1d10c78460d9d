"""A notebook-style check: build AsymLoop on CPU, compare test-time depths, export to the reference.

    bash tools/bootstrap.sh python examples/notebook_quickcheck.py
"""

import torch

import megaloop.api as ml
from megaloop.models.export import to_reference

model = ml.build("tiny", arch="asymloop", iterations=3, seq_length=64)
tokens = torch.randint(0, model.cfg.vocab_size, (2, 64))
with torch.no_grad():
    for k in (1, 3, 6):
        loss = model(tokens[:, :-1], labels=tokens[:, 1:], num_iterations=k).mean()
        print(f"K={k}: loss {loss.item():.4f}")
    reference = to_reference(model)
    diff = (reference(tokens).logits - model(tokens)).abs().max().item()
print(f"reference vs megatron-core max |logit diff| = {diff:.2e}")
