"""A job building a dataset's indices into a shared cache, for tests/data/test_index_cache.py.

    python index_cache_child.py PREFIX CACHE_DIR OUT.npz SYNC_DIR NAME {hold,die}

``hold``: if this job builds the indices, it creates ``SYNC_DIR/NAME-building`` and waits for
``SYNC_DIR/release`` first, so a test can start a second job while this one builds. ``die``: the
job stops in the middle of writing the last index file (the shuffle index) and creates
``SYNC_DIR/NAME-mid-write``, for the test to kill it there. The train split's indices, and
whether this job built them, go to OUT.npz.
"""

import logging
import os
import sys
import time

import numpy

from megaloop.data.datasets import DatasetTokenizer, build_gpt_datasets

TOKENIZER = DatasetTokenizer(vocab_size=32000, eod=2, name="llama2_tokenizer.model")
SAVES_BEFORE_THE_SHUFFLE_INDEX = 2  # GPTDataset saves the document, sample, then shuffle index


def _wait_for(path: str) -> None:
    deadline = time.monotonic() + 120  # a stuck test fails instead of hanging
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            sys.exit(f"{path} never appeared")
        time.sleep(0.01)


def main(prefix, cache_dir, out, sync_dir, name, mode):
    from megatron.core.datasets import gpt_dataset

    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    built = []
    build_shuffle_index = gpt_dataset._build_shuffle_index

    def held_build(*args, **kwargs):  # called only when the indices are built, not loaded
        built.append(True)
        if mode == "hold":
            open(os.path.join(sync_dir, f"{name}-building"), "w").close()
            _wait_for(os.path.join(sync_dir, "release"))
        return build_shuffle_index(*args, **kwargs)

    gpt_dataset._build_shuffle_index = held_build
    if mode == "die":
        save, saves = numpy.save, []

        def save_then_die_midway(file, arr, *args, **kwargs):
            saves.append(file)
            if len(saves) <= SAVES_BEFORE_THE_SHUFFLE_INDEX:
                return save(file, arr, *args, **kwargs)
            handle = open(file, "wb") if isinstance(file, (str, os.PathLike)) else file
            handle.write(b"\x93NUMPY partial")
            handle.flush()
            open(os.path.join(sync_dir, f"{name}-mid-write"), "w").close()
            time.sleep(600)  # until killed

        numpy.save = save_then_die_midway
    train = build_gpt_datasets([prefix], TOKENIZER, 64, (300, None, None), split="100,0,0",
                               cache_dir=cache_dir)[0]
    numpy.savez(out, document_index=train.document_index, sample_index=train.sample_index,
                shuffle_index=train.shuffle_index, built=bool(built))


if __name__ == "__main__":
    main(*sys.argv[1:])
