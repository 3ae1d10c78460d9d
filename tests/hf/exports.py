"""Helpers of the conversion tests: tiny models of every variant (and of each native class), saved
as checkpoints and exported once per session."""

import dataclasses
from pathlib import Path

import torch

from megaloop.config import DataConfig, ModelConfig, RunConfig
from tests.models.variants import ALL_VARIANTS, MOE, SMALL, small_config

# Dense models that load as a native transformers class (the name), beside ALL_VARIANTS.
NATIVE_VARIANTS = {
    "qwen3": (dict(arch="dense", iterations=1, qk_norm=True), "Qwen3ForCausalLM"),
    "olmo2_one_head": (dict(arch="dense", iterations=1, block="olmo", num_attention_heads=1,
                            num_query_groups=1), "Olmo2ForCausalLM"),
    "mixtral": (dict(arch="dense", iterations=1, **MOE, ffn_hidden_size=64),
                "MixtralForCausalLM"),
    "qwen3_moe": (dict(arch="dense", iterations=1, qk_norm=True, **MOE, head_dim=20),
                  "Qwen3MoeForCausalLM"),
    "llama_tied": (dict(arch="dense", iterations=1, tie_embeddings=True), "LlamaForCausalLM"),
}
EXPECTED_CLASS = {"dense": "LlamaForCausalLM",
                  **{name: cls for name, (_, cls) in NATIVE_VARIANTS.items()}}


def variant_config(name: str) -> ModelConfig:
    if name in NATIVE_VARIANTS:
        return ModelConfig(**{**SMALL, **NATIVE_VARIANTS[name][0]})
    return small_config(name)


def expected_class(name: str) -> str:
    if name in EXPECTED_CLASS:
        return EXPECTED_CLASS[name]
    return "LatentLoopLM" if ALL_VARIANTS[name]["arch"] == "latentloop" else "LoopedLM"


def perturb_norms(model, seed: int = 3) -> None:
    """Norm weights start at 1; perturb them so that a swapped or missing norm cannot hide."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn(p.shape, generator=g))


def sample_tokens(cfg: ModelConfig, seed: int = 5) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (2, cfg.seq_length),
                         generator=torch.Generator().manual_seed(seed))


@dataclasses.dataclass
class Exported:
    cfg: ModelConfig
    checkpoint: Path
    hf_dir: Path
    logits: torch.Tensor  # the megaloop model's on sample_tokens(cfg)
    report: dict


class Exports:
    """Each variant's checkpoint and Hugging Face export (in each dtype asked for), made on first
    use; ``dtype=None`` is the export's default, here float32 (the checkpoints hold fp32)."""

    def __init__(self, root: Path):
        self.root, self.done = root, {}

    def get(self, name: str, dtype: str | None = None) -> Exported:
        if (name, None) not in self.done:
            self.done[name, None] = self._export_fp32(name)
        if (name, dtype) not in self.done:
            from megaloop.hf.to_hf import export_checkpoint

            source, out = self.done[name, None], self.root / name / f"hf-{dtype}"
            self.done[name, dtype] = dataclasses.replace(
                source, hf_dir=out, report=export_checkpoint(source.checkpoint, out, dtype=dtype))
        return self.done[name, dtype]

    def _export_fp32(self, name: str) -> Exported:
        from megaloop.hf.checkpoint import build_single_process_model, save_weights_checkpoint
        from megaloop.hf.to_hf import export_checkpoint

        cfg = variant_config(name)
        torch.manual_seed(0)
        model = build_single_process_model(cfg)
        perturb_norms(model)
        with torch.no_grad():
            logits = model(sample_tokens(cfg)).float()
        run = RunConfig(model=cfg, data=DataConfig(eod_id=3))
        checkpoint = save_weights_checkpoint(model, run, self.root / name / "checkpoint")
        report = export_checkpoint(checkpoint, self.root / name / "hf")
        return Exported(cfg, checkpoint, self.root / name / "hf", logits, report)


def fp32_weight_bytes(cfg: ModelConfig) -> int:
    """Bytes of the reference model's tensors in fp32 (a tied head counted as its own)."""
    from megaloop.models.export import reference_class, reference_config

    with torch.device("meta"):
        reference = reference_class(cfg)(reference_config(cfg))
    return 4 * sum(t.numel() for t in reference.state_dict().values())


def _live_storages() -> dict[int, int]:
    """Bytes of every tensor storage Python holds (views counted once), by address."""
    import gc

    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in gc.get_objects() if isinstance(t, torch.Tensor) and t.device.type != "meta"}


class StoragePeaks:
    """The bytes of the tensor storages alive (beyond those alive when it was made) each time one
    of the ``functions`` ((owner, name) pairs, monkeypatched) is entered or left; ``calls``: the
    names called, in order."""

    def __init__(self, monkeypatch, *functions):
        self.before, self.peaks, self.calls = _live_storages(), [], []
        for owner, name in functions:
            monkeypatch.setattr(owner, name, self._measured(getattr(owner, name), name))

    def _measured(self, function, name):  # holds no argument or result: keeps no tensor alive
        def wrapper(*args, **kwargs):
            self.calls.append(name)
            self.peaks.append(self._alive())
            result = function(*args, **kwargs)
            self.peaks.append(self._alive())
            return result
        return wrapper

    def _alive(self) -> int:
        return sum(n for ptr, n in _live_storages().items() if ptr not in self.before)

    def most(self) -> int:
        return max(self.peaks)
