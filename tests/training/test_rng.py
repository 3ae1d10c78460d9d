"""The random state a checkpoint saves and the context that leaves every generator as it was."""

import random

import numpy as np
import torch

from megaloop.training.rng import preserved_rng


def test_generators_are_put_back():
    torch.manual_seed(1)
    random.seed(1)
    np.random.seed(1)
    with preserved_rng():
        torch.manual_seed(99)
        random.seed(99)
        np.random.seed(99)
        torch.rand(3), random.random(), np.random.rand()
    after = torch.rand(2), random.random(), np.random.rand()
    torch.manual_seed(1)
    random.seed(1)
    np.random.seed(1)
    assert torch.equal(after[0], torch.rand(2)) and after[1:] == (random.random(),
                                                                  np.random.rand())
