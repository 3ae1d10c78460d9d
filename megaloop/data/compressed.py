"""The decompressed bytes of an input file (.gz, .zst or plain, by suffix), for megaloop.data.readers.

A compressed file cut short raises EOFError where its data ends, for .zst as gzip does, so a
truncated shard is reported instead of ending quietly.
"""

from __future__ import annotations

import gzip
import io
from typing import Iterator


def open_binary(path: str) -> io.BufferedIOBase:
    """The decompressed byte stream of a file, chosen by suffix."""
    name = path.lower()
    if name.endswith(".gz"):
        return gzip.open(path, "rb")
    if name.endswith(".zst"):
        return io.BufferedReader(_ZstdReader(path), buffer_size=1 << 20)
    return open(path, "rb")


class _ZstdReader(io.RawIOBase):
    """The decompressed bytes of every frame of a .zst file; EOFError where the data ends inside a
    frame, as gzip raises on a cut file (python-zstandard's stream_reader just ends there)."""

    def __init__(self, path: str):
        import zstandard

        self._file = open(path, "rb")
        self._blocks = self._decompress(zstandard.ZstdDecompressor())
        self._block = memoryview(b"")

    def _decompress(self, decompressor) -> Iterator[bytes]:
        frame = None  # the decompressor of a frame begun and not yet ended
        # Small reads bound the output of one call: text often compresses 5-10x.
        while data := self._file.read(1 << 17):
            while data:
                frame = frame or decompressor.decompressobj()
                yield frame.decompress(data)
                data, frame = (frame.unused_data, None) if frame.eof else (b"", frame)
        if frame is not None:
            raise EOFError(f"{self._file.name}: zstd data ends inside a frame")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self._block:
            block = next(self._blocks, None)
            if block is None:
                return 0
            self._block = memoryview(block)
        n = min(len(buffer), len(self._block))
        buffer[:n] = self._block[:n]
        self._block = self._block[n:]
        return n

    def close(self) -> None:
        self._file.close()
        super().close()


def read_errors() -> tuple[type[BaseException], ...]:
    import zlib

    import zstandard

    return (EOFError, OSError, zlib.error, zstandard.ZstdError)
