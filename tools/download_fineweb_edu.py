"""Download FineWeb-Edu parquet shards from the Hugging Face hub, resumably, checking sizes.

    python tools/download_fineweb_edu.py --name sample-10BT --output data/fineweb-edu
    python tools/download_fineweb_edu.py --shards 'data/CC-MAIN-2024-10/*' --max-files 2 --output data/fwe

Only for users with network access: nothing in megaloop's tests or quickstart needs it. A rerun
skips files whose size already matches the hub's listing and resumes partial ones. ``--source``
may name a local directory laid out like the hub repository (a mirror on a shared filesystem).
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import shutil
import sys

from megaloop.cli import int_at_least
from megaloop.data.readers import first_line

REPO_ID = "HuggingFaceFW/fineweb-edu"
# Named subsets -> folder in the hub repository.
SUBSETS = {"sample-10BT": "sample/10BT", "sample-100BT": "sample/100BT", "sample-350BT": "sample/350BT"}
# Seconds the listing may wait to connect and for each read. huggingface_hub sets none for it (its
# downloads have HF_HUB_ETAG_TIMEOUT and HF_HUB_DOWNLOAD_TIMEOUT), so a network that drops packets
# or a proxy that never answers would hang the tool.
LIST_TIMEOUT_S = 60.0


class DownloadError(RuntimeError):
    pass


class HubSource:
    """The dataset repository on the Hugging Face hub (huggingface_hub resumes partial files)."""

    def __init__(self, repo_id: str = REPO_ID, revision: str | None = None):
        try:
            from huggingface_hub import HfApi
        except ImportError:
            raise DownloadError("the hub needs huggingface_hub, which is not installed: pip "
                                "install -e .[hf] (or give --source a local mirror)") from None

        self.repo_id, self.revision, self.api = repo_id, revision, HfApi()

    def list_files(self) -> dict[str, int]:
        try:
            info = self.api.dataset_info(self.repo_id, revision=self.revision, files_metadata=True,
                                         timeout=LIST_TIMEOUT_S)
        except Exception as err:  # network and HTTP errors: huggingface_hub has several families
            raise DownloadError(f"{self.repo_id}: cannot list the hub repository ({first_line(err)})")
        return {s.rfilename: s.size for s in info.siblings if s.size is not None}

    def fetch(self, path: str, output: str) -> None:
        from huggingface_hub import hf_hub_download

        try:
            hf_hub_download(self.repo_id, path, repo_type="dataset", revision=self.revision, local_dir=output)
        except Exception as err:
            raise DownloadError(f"{self.repo_id}/{path}: download failed ({first_line(err)}); rerun to resume")


class LocalSource:
    """A directory laid out like the hub repository; partial copies resume from where they stopped."""

    def __init__(self, root: str):
        if not os.path.isdir(root):
            raise DownloadError(f"{root}: source directory not found")
        self.root = root

    def list_files(self) -> dict[str, int]:
        files = {}
        for folder, _, names in os.walk(self.root):
            for name in names:
                full = os.path.join(folder, name)
                files[os.path.relpath(full, self.root).replace(os.sep, "/")] = os.path.getsize(full)
        return files

    def fetch(self, path: str, output: str) -> None:
        dest = os.path.join(output, path)
        partial = dest + ".incomplete"
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        source = os.path.join(self.root, path)
        done = os.path.getsize(partial) if os.path.exists(partial) else 0
        # A partial file longer than the source belongs to another version of it: appending to it
        # would fail the size check on every rerun, so start that one again.
        resume = done <= os.path.getsize(source)
        with open(source, "rb") as src, open(partial, "ab" if resume else "wb") as dst:
            src.seek(done if resume else 0)
            shutil.copyfileobj(src, dst, 1 << 20)
        os.replace(partial, dest)


def select(files: dict[str, int], name: str | None, shards: list[str] | None, max_files: int | None) -> list[str]:
    """Parquet files of a named subset or matching shard patterns, sorted, at most ``max_files``."""
    if name:
        if name not in SUBSETS:
            raise DownloadError(f"unknown subset {name!r}; choose one of {', '.join(SUBSETS)} or pass --shards")
        patterns = [SUBSETS[name] + "/*"]
    else:
        patterns = shards
    chosen = sorted(p for p in files if p.endswith(".parquet") and any(fnmatch.fnmatch(p, pat) for pat in patterns))
    if not chosen:
        raise DownloadError(f"no parquet files match {', '.join(patterns)}")
    return chosen[:max_files] if max_files else chosen


def download(source, output: str, paths: list[str], sizes: dict[str, int], log=print) -> int:
    """Fetch ``paths`` that are missing or the wrong size; returns the number fetched."""
    fetched = 0
    for n, path in enumerate(paths, 1):
        dest = os.path.join(output, path)
        if os.path.isfile(dest) and os.path.getsize(dest) == sizes[path]:
            log(f"[{n}/{len(paths)}] {path}: complete, skipped")
            continue
        if os.path.isfile(dest):  # the wrong size: a stale or corrupted copy
            os.remove(dest)
        log(f"[{n}/{len(paths)}] {path}: {sizes[path] / 1e6:,.1f} MB")
        source.fetch(path, output)
        got = os.path.getsize(dest)
        if got != sizes[path]:
            os.replace(dest, dest + ".incomplete")  # keep it for the next resume, not as a final file
            raise DownloadError(f"{dest}: {got} bytes after download, expected {sizes[path]}; rerun to resume")
        fetched += 1
    return fetched


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--name", help=f"named subset: {', '.join(SUBSETS)}")
    which.add_argument("--shards", nargs="+", help="glob patterns of repository paths, e.g. 'data/CC-MAIN-2024-10/*'")
    p.add_argument("--output", required=True, help="directory; files keep their repository paths")
    p.add_argument("--max-files", type=int_at_least(1), help="fetch only the first N matching files")
    p.add_argument("--source", default="hub", help="'hub' (default) or a local directory laid out like the repository")
    p.add_argument("--revision", help="hub revision (branch, tag or commit)")
    args = p.parse_args(argv)
    if args.revision and args.source != "hub":
        p.error(f"--revision {args.revision}: a hub revision; --source {args.source} is a local directory")
    try:
        source = HubSource(revision=args.revision) if args.source == "hub" else LocalSource(args.source)
        sizes = source.list_files()
        paths = select(sizes, args.name, args.shards, args.max_files)
        fetched = download(source, args.output, paths, sizes, log=lambda m: print(m, file=sys.stderr))
    except DownloadError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # the output directory (or the mirror) cannot be written or read
        print(f"error: {err.filename or args.output}: {err.strerror or err}", file=sys.stderr)
        return 2
    total = sum(sizes[p] for p in paths)
    print(f"{len(paths)} files ({total / 1e9:.2f} GB) in {args.output}, {fetched} fetched now", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
