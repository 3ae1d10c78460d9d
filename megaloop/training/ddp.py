"""megatron-core's DistributedDataParallel, made collectable.

megatron-core keeps each parameter's gradient accumulator (an autograd node) in ``grad_accs`` and
hangs a hook on it that closes over the DDP wrapper. The garbage collector cannot see through the
C++ node, so the cycle wrapper -> node -> hook -> wrapper is never freed: every dropped wrapper
keeps its model, its gradient buffers and its process groups alive (about fifty gloo threads per
set-up on CPU) until the process exits. Notebooks, sweeps and test sessions that build several
Trainers in one process piled those up. Here the hooks reach the wrapper through a weak proxy; a
live wrapper behaves exactly as before.
"""

from __future__ import annotations

import weakref

from megatron.core.distributed import DistributedDataParallel


class CollectableDDP(DistributedDataParallel):
    """DistributedDataParallel whose gradient hooks do not keep it alive."""

    def _make_backward_post_hook(self, param):
        return DistributedDataParallel._make_backward_post_hook(weakref.proxy(self), param)
