"""megaloop: Megatron-core training for looped (recurrent-depth) language models.

Heavy imports (torch, megatron-core) happen in the submodules, so ``import megaloop`` stays cheap.
"""

__version__ = "0.1.0"
