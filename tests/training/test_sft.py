"""Fine-tuning through the ordinary trainer (data.format=sft): the loss and its gradients come from
solution tokens only, and a fine-tuning run started from another checkpoint's weights resumes
exactly."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from megaloop.config import CheckpointConfig, DataConfig, ModelConfig, RunConfig, TrainConfig
from megaloop.training.trainer import Trainer
from tests.sft import PROMPT, SOLUTION, arithmetic_records, train_tokenizer, write_jsonl
from tests.training.conftest import resume_from, train_losses


@pytest.fixture(scope="module")
def sft_files(tmp_path_factory):
    directory = tmp_path_factory.mktemp("sft")
    records = arithmetic_records(24)
    return (str(write_jsonl(directory / "train.jsonl", records)),
            str(train_tokenizer(directory / "tok.model", records)))


def sft_run(files, out_dir, *, train=None, checkpoint=None) -> RunConfig:
    data, tokenizer = files
    return RunConfig(
        model=ModelConfig(arch="asymloop", num_layers=4, hidden_size=32, ffn_hidden_size=64,
                          num_attention_heads=4, num_query_groups=2, vocab_size=512,
                          seq_length=64, iterations=2),
        train=dataclasses.replace(TrainConfig(micro_batch_size=2, global_batch_size=4,
                                              train_steps=4, lr=3e-3, out_dir=str(out_dir),
                                              log_interval=100, eval_iters=1,
                                              tensorboard=False), **(train or {})),
        data=DataConfig(path=[data], format="sft", tokenizer_model=tokenizer, split="20,4,0",
                        sft_prompt=PROMPT, sft_solution=SOLUTION),
        checkpoint=dataclasses.replace(CheckpointConfig(), **(checkpoint or {})))


def test_prompt_and_padding_contribute_nothing_to_loss_and_gradients(mcore, sft_files, tmp_path):
    trainer = Trainer(sft_run(sft_files, tmp_path, train={"global_batch_size": 2}))
    samples = [trainer.train_data[i] for i in range(2)]
    batch = {key: torch.stack([s[key] for s in samples]) for key in samples[0]}
    mask = batch["loss_mask"].bool()
    assert mask.any() and (~mask).any()

    def loss_and_grads(b):
        trainer.ddp.zero_grad_buffer()
        loss, loss_tokens = trainer._run_microbatches(iter([b]), forward_only=False)
        assert loss_tokens == int(mask.sum())  # what the monitor's loss_tokens_per_s counts
        return loss, [p.main_grad.clone() for p in trainer.model.parameters()]

    loss, grads = loss_and_grads(batch)
    with torch.no_grad():  # an independent count: mean cross-entropy over the solution labels
        logits = trainer.model(batch["tokens"])
    expected = F.cross_entropy(logits[mask].double(), batch["labels"][mask])
    assert loss == pytest.approx(expected.item(), rel=1e-6)

    # Other labels on prompt and padding positions, other token ids in the padding: no change.
    changed = {k: v.clone() for k, v in batch.items()}
    generator = torch.Generator().manual_seed(0)
    noise = torch.randint(3, 400, batch["labels"].shape, generator=generator)
    changed["labels"][~mask] = noise[~mask]
    ends = [int(row.nonzero().max()) + 2 for row in mask]  # first position after the final EOD
    for row, end in enumerate(ends):
        changed["tokens"][row, end:] = noise[row, end:]
    assert not torch.equal(changed["labels"], batch["labels"])
    assert any(end < batch["tokens"].shape[1] for end in ends)
    same_loss, same_grads = loss_and_grads(changed)
    assert same_loss == loss
    assert all(torch.equal(a, b) for a, b in zip(grads, same_grads))

    # Every solution label counts: the first answer token and the closing EOD.
    for position in (0, -1):
        moved = {k: v.clone() for k, v in batch.items()}
        where = mask[0].nonzero()[position]
        moved["labels"][0, where] = (batch["labels"][0, where] + 1) % 400
        other_loss, other_grads = loss_and_grads(moved)
        assert other_loss != loss
        assert any(not torch.equal(a, b) for a, b in zip(grads, other_grads))
    trainer.close()


def test_finetuning_from_loaded_weights_resumes_bit_for_bit(mcore, sft_files, tmp_path):
    seed = Trainer(sft_run(sft_files, tmp_path / "base"))
    seed.save()
    seed.close()
    start = {"load": str(tmp_path / "base" / "checkpoints"), "load_optimizer": False}
    straight = tmp_path / "straight"
    Trainer(sft_run(sft_files, straight,
                    checkpoint={**start, "save_interval": 2})).train()
    resumed = tmp_path / "resumed"
    resume_from(straight, resumed, 2)
    trainer = Trainer(sft_run(sft_files, resumed, checkpoint=start))
    assert trainer.step == 2 and trainer.consumed_samples == 8  # not a fresh start from "load"
    trainer.train()
    a, b = train_losses(straight), train_losses(resumed)
    assert sorted(b) == [3, 4]
    assert [a[s] for s in b] == [b[s] for s in b]


def test_a_resume_with_a_smaller_global_batch_reads_on_to_its_last_step(mcore, sft_files,
                                                                         tmp_path):
    """Before: the data was sized train_steps x the new global batch, which the samples the
    checkpoint had read already at the old one used up: StopIteration, a traceback, at the first
    step after the resume."""
    Trainer(sft_run(sft_files, tmp_path, train={"global_batch_size": 8, "train_steps": 2})).train()
    with Trainer(sft_run(sft_files, tmp_path, train={"train_steps": 4})) as resumed:
        assert len(resumed.train_data) == 2 * 8 + 2 * 4
        assert resumed.train()["step"] == 4
    assert sorted(train_losses(tmp_path)) == [1, 2, 3, 4]


@pytest.mark.parametrize("setting", [dict(eval_iters=2**62), dict(train_steps=2**62)])
def test_more_samples_than_a_dataset_indexes_are_refused_naming_the_setting(mcore, sft_files,
                                                                            tmp_path, setting):
    """Fine-tuning data builds no index whose memory would refuse such counts (as indexed data's
    does). Before: accepted, and len() of the split failed at its first batch (OverflowError): for
    eval_iters after the whole training, at the final evaluation, before the final save."""
    import sys

    from megaloop.config import ConfigError
    from megaloop.training.data import build_datasets

    (name, value), = setting.items()
    with pytest.raises(ConfigError) as error:
        build_datasets(sft_run(sft_files, tmp_path, train=setting))
    assert str(error.value) == (f"train.{name}={value}: x train.global_batch_size=4 is "
                                f"{4 * value:,} samples, more than a dataset can index "
                                f"({sys.maxsize:,})")
