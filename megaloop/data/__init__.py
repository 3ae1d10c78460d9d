"""Data pipeline: text -> Megatron .bin/.idx (tools/preprocess_data.py) -> megatron-core GPT datasets.

Training builds its datasets with::

    from megaloop.data import DatasetTokenizer, build_gpt_datasets, load_tokenizer

    tokenizer = DatasetTokenizer.from_text_tokenizer(load_tokenizer("SentencePieceTokenizer", "tok.model"))
    train, valid, test = build_gpt_datasets(["0.7", "data/a_text_document", "0.3", "data/b_text_document"],
                                            tokenizer, seq_length=2048, num_samples=(n_train, n_valid, 0))

Nothing here imports torch or megatron-core at import time: preprocessing workers import this
package in fresh processes.
"""

from megaloop.lazy import lazy_exports

# Each name is imported from its module on first use (megaloop.lazy).
_SOURCES = {
    "blend": ("parse_blend",),
    "datasets": ("DatasetTokenizer", "build_gpt_datasets"),
    "indexed": ("merge_indexed", "validate_indexed"),
    "readers": ("DataError",),
    "tokenizer": ("TokenizerError", "load_tokenizer", "padded_vocab_size"),
}
__all__, __getattr__, __dir__ = lazy_exports(globals(), _SOURCES)
