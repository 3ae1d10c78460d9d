"""Reads the data of megaloop's local lm-eval tasks (the YAML files beside this one) from local files.

Each task names its files in ``dataset_kwargs.data_files`` ({split: file name}); the directory they
are in is given at run time, so that the configs hold no machine's paths:

    lm_eval --model hf --model_args pretrained=DIR,trust_remote_code=True \\
        --include_path examples/eval --tasks local_piqa --metadata '{"data_dir": "/data/eval"}'

or ``MEGALOOP_EVAL_DATA=/data/eval`` in the environment (tools/evaluate.py passes ``--data-dir``
as the metadata). Files are JSON lines (.jsonl) or Parquet (.parquet) records in the benchmark's
own field names; nothing is downloaded.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

DATA_DIR_ENV = "MEGALOOP_EVAL_DATA"


def _records(path: Path) -> list[dict]:
    """The file's records; a file without any is refused, Parquet as JSON lines (a task over no
    records would score nothing)."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        records = pq.read_table(path).to_pylist()
    else:
        records = _json_lines(path)
    if not records:
        raise ValueError(f"{path}: holds no records")
    return records


def _json_lines(path: Path) -> list[dict]:
    records = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not a JSON record ({e.msg})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{number}: not a JSON object")
            records.append(record)
    return records


@functools.lru_cache(maxsize=32)
def _dataset(path: str, modified_ns: int, size: int):
    """The file's records as a Dataset, read again only when the file changes (lm-eval builds
    its tasks anew for every evaluation, e.g. at each checkpoint of a training run)."""
    import datasets

    return datasets.Dataset.from_list(_records(Path(path)))


def load(data_files: dict[str, str], data_dir: str | None = None, **_metadata):
    """``custom_dataset`` of the local tasks: a DatasetDict of ``data_files`` read from
    ``data_dir`` (task metadata) or $MEGALOOP_EVAL_DATA. The other metadata lm-eval passes along
    (version, model arguments) is not ours to read."""
    import datasets

    directory = data_dir or os.environ.get(DATA_DIR_ENV)
    if not directory:
        raise ValueError(f"local task data: no data directory given (--metadata "
                         f"'{{\"data_dir\": DIR}}', ${DATA_DIR_ENV}, or tools/evaluate.py "
                         f"--data-dir)")
    splits = {}
    for split, name in data_files.items():
        path = Path(directory).expanduser() / name
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such file (data directory {directory})")
        stat = path.stat()
        splits[split] = _dataset(str(path.resolve()), stat.st_mtime_ns, stat.st_size)
    return datasets.DatasetDict(splits)
