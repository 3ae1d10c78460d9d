"""What both conversion directions share: their errors, the staged output directory and the logit
probe."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import threading
from pathlib import Path

import torch

from megaloop.cli import signals_handled

# Relative and absolute tolerance of the probe comparison in fp32: the parity tests hold the
# reference to megatron-core at 1e-5 on tiny models; deeper and wider models accumulate more.
PROBE_TOLERANCE = 1e-4
# What an export may store its weights in (config.json's ``dtype`` names the same).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_STAGING_TOKEN_BYTES = 4  # of the staging directory name's random part
log = logging.getLogger("megaloop.hf")


def quiet_transformers() -> None:
    """No progress bars or load reports: a conversion reports its own findings."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


class ConversionError(ValueError):
    """Bad input to a conversion (checkpoint, directory, tensor, tokenizer); one line naming it."""


class ProbeMismatch(RuntimeError):
    """The converted model's logits differ from the source's: a bug, not bad input."""


def holding_dtype(dtypes: set) -> torch.dtype:
    """The DTYPES member that holds tensors of ``dtypes`` (their floating dtypes) exactly: the
    one they share, else float32."""
    return next(iter(dtypes)) if len(dtypes) == 1 and dtypes <= set(DTYPES.values()) \
        else torch.float32


def export_dtype(name: str) -> torch.dtype:
    """The torch dtype of ``name`` (a DTYPES key), or a ConversionError naming the choices."""
    if name not in DTYPES:
        raise ConversionError(f"dtype {name!r}: an export stores {', '.join(DTYPES)}")
    return DTYPES[name]


@contextlib.contextmanager
def staged_output(out: str | os.PathLike):
    """Yields a fresh temporary directory beside ``out`` that becomes ``out`` when the block ends
    without an error (one rename); on any error it is removed, so ``out`` never holds a partial
    conversion. ``out`` must not exist yet, or be an empty directory."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConversionError(f"{out}: already exists and is not an empty directory; choose a new "
                              "output directory")
    if _is_working_directory(out):  # ('.' has no name to stage beside: a traceback before)
        raise ConversionError(f"{out}: the current directory, which the result would replace (a "
                              "shell in it would list nothing); run from its parent (cd ..) or "
                              "choose a new output directory")
    _note_killed_stagings(out)
    tmp = out.with_name(f".{out.name}.tmp-{_host()}-{os.getpid()}-"
                        f"{secrets.token_hex(_STAGING_TOKEN_BYTES)}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    except OSError as e:
        raise ConversionError(f"{out}: cannot create it ({e.strerror}: {e.filename})") from None
    try:
        with sigterm_as_exit():
            yield tmp
        _readable_as_plain_files(tmp)
        try:
            if out.exists():
                out.rmdir()
            os.replace(tmp, out)
        except OSError as e:  # another process wrote it meanwhile
            raise ConversionError(f"{out}: cannot move the conversion there ({e.strerror}); "
                                  "choose a new output directory") from None
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, Terminated):
            log.error("%s: terminated (SIGTERM): the conversion stopped, nothing was written", out)
        failure = _io_failure(out, e)
        if failure is None:
            raise
        raise ConversionError(failure) from None


def _is_working_directory(path: Path) -> bool:
    with contextlib.suppress(OSError):  # the working directory removed
        return os.path.samefile(path, os.curdir)
    return False


class Terminated(SystemExit):
    """SIGTERM during a conversion or an evaluation: exits as the signal would (128 + 15), once
    the temporary files are removed."""


@contextlib.contextmanager
def sigterm_as_exit():
    """SIGTERM (``timeout``, ``kill``, a scheduler's time limit before its SIGKILL) raised as
    Terminated while the block runs, so that a staging or temporary directory, as large as a
    model, is removed: the default action ends the process on the spot and left it. Only where
    SIGTERM has its default action, in the main thread (a program handling it keeps its own
    handler)."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def terminate(signum, frame):
        raise Terminated(128 + signum)

    with signals_handled((signal.SIGTERM,), terminate):
        yield


def _note_killed_stagings(out: Path) -> None:
    """A warning line for each staging directory of ``out`` that another conversion made: nothing
    else removes one a killed conversion (SIGKILL: the out-of-memory killer, a scheduler's last
    resort) left, and it is as large as a model. Not removed. Its name holds the host and process
    that made it: on this host, the line says whether that process still runs (a conversion into
    the same ``out`` running beside this one: the later to finish is refused) or has ended (the
    leftover of a killed one); made on another host (a shared file system), or before the name
    held the host, the line cannot tell the two apart."""
    token = f"[0-9a-f]{{{2 * _STAGING_TOKEN_BYTES}}}"
    staging = re.compile(rf"\.{re.escape(out.name)}\.tmp-(?:(.+)-)?(\d+)-{token}")
    if not out.parent.is_dir():
        return
    for leftover in sorted(p for p in out.parent.iterdir() if staging.fullmatch(p.name)):
        size = _tree_bytes(leftover)
        if not leftover.exists():  # a running conversion has just moved it into place, or failed
            continue
        host, pid = staging.fullmatch(leftover.name).groups()
        head = f"{leftover} ({_shown_size(size)}): the staging directory of a conversion into {out}"
        if host != _host():
            where = f" on host {host}" if host else ""
            log.warning("%s by process %s%s, which was killed or is still running; not removed: "
                        "remove it unless that conversion is running", head, pid, where)
        elif _running(int(pid)):
            log.warning("%s by process %s on this host, still running: of the two conversions "
                        "into it, the later to finish will be refused", head, pid)
        else:
            log.warning("%s by process %s on this host, which has ended (killed); not removed: "
                        "remove it", head, pid)


def _host() -> str:
    """This host's name as staging directory names hold it (file-name characters only)."""
    return re.sub(r"[^A-Za-z0-9._]", "_", socket.gethostname()) or "_"


def _running(pid: int) -> bool:
    """Whether a process ``pid`` runs on this host (another user's included: PermissionError).
    0 would signal this process group; a number past the pid range names no process."""
    try:
        os.kill(pid, 0)
    except PermissionError:
        return True
    except (ProcessLookupError, OverflowError):
        return False
    return pid > 0


def _shown_size(size: int) -> str:
    """``size`` bytes in the largest decimal unit it reaches, "1.5 KB", "20.0 MB": a leftover of
    config files only is no "0.00 GB", which reads as empty."""
    if size < 1000:
        return f"{size} bytes"
    for unit in ("KB", "MB", "GB", "TB"):
        size /= 1000
        if round(size, 1) < 1000 or unit == "TB":  # 999,960 bytes: 1.0 MB, no 1000.0 KB
            return f"{size:.1f} {unit}"


def _tree_bytes(directory: Path) -> int:
    """The bytes of the files under ``directory``, as far as they stay: a running conversion may
    rename or remove them (or the directory) while they are counted."""
    total = 0
    with contextlib.suppress(OSError):  # the directory itself renamed or removed
        for path in directory.rglob("*"):
            with contextlib.suppress(OSError):
                if path.is_file():
                    total += path.stat().st_size
    return total


def _io_failure(out: Path, error: BaseException) -> str | None:
    """The line for a conversion into ``out`` stopped by the I/O error ``error`` (a full disk, a
    checkpoint file removed while it was read, ...): its cause, the file, and for a full disk or
    quota the room left beside ``out`` once the partial conversion is gone; None for any other
    error."""
    if isinstance(error, OSError):
        cause, filename, code = error.strerror or str(error), error.filename, error.errno
    else:
        # safetensors reports its I/O errors as SafetensorError ("I/O error: No space left on
        # device (os error 28)"), not OSError.
        found = re.search(r"I/O error: (.*?) \(os error (\d+)\)", str(error))
        if type(error).__name__ != "SafetensorError" or found is None:
            return None
        cause, filename, code = found.group(1), None, int(found.group(2))
    line = f"{out}: the conversion stopped, nothing was written ({cause}"
    line += f": {filename}" if filename else ""
    if code in (errno.ENOSPC, errno.EDQUOT):
        line += f"; {shutil.disk_usage(out.parent).free / 2**20:.1f} MiB free there"
    return line + ")"


def _readable_as_plain_files(directory: Path) -> None:
    """Gives every file the permissions a plain ``open`` gives (0666 less the umask): some writers
    (safetensors through a temporary file) leave 0600, and teammates read shared exports."""
    umask = os.umask(0)
    os.umask(umask)
    for path in directory.rglob("*"):
        if path.is_file():
            path.chmod(0o666 & ~umask)


def probe_ids(vocab_size: int, length: int) -> torch.Tensor:
    """Two fixed pseudo-random sequences [2, length] of token ids."""
    generator = torch.Generator().manual_seed(20250611)
    return torch.randint(0, vocab_size, (2, length), generator=generator)


def probe_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """fp32 logits on the CPU of a megaloop model or a Hugging Face one."""
    from transformers import PreTrainedModel

    with torch.no_grad():
        if isinstance(model, PreTrainedModel):
            return model(ids, use_cache=False).logits.float()
        return model(ids.to(next(model.parameters()).device)).float().cpu()


def compare_logits(source: torch.Tensor, converted: torch.Tensor, what: str) -> float:
    """Raises ProbeMismatch unless the logits agree to PROBE_TOLERANCE; returns the largest
    difference."""
    source, converted = source.float(), converted.float()
    if source.shape != converted.shape:
        raise ProbeMismatch(f"{what}: probe logits of shape {tuple(converted.shape)}, the source "
                            f"gives {tuple(source.shape)}")
    difference = (source - converted).abs()
    allowed = PROBE_TOLERANCE * (1 + source.abs())
    if not bool((difference <= allowed).all()):
        worst = (difference - allowed).flatten().argmax().item()
        position = [int(i) for i in torch.unravel_index(torch.tensor(worst), source.shape)]
        raise ProbeMismatch(f"{what}: probe logits differ from the source by up to "
                            f"{difference.max().item():.3g} (batch, position, token {position}; "
                            f"allowed {PROBE_TOLERANCE:g} x (1 + |logit|))")
    return difference.max().item()


def by_layer(names):
    """Yields a megatron-core state dict's ``names`` in groups: the rest at once (embedding, final
    norm, head, LatentLoop's per-visit tensors), then a layer at a time ("<...>layers.<i>." names).
    A conversion maps one such group at a time to the reference model's names
    (megaloop.models.export.reference_state_dict), so that no more than one group's temporary
    copies exist at once; the rest, which holds the embedding and head, comes first, while little
    else is held."""
    groups = {"": []}
    for name in names:
        layer = re.match(r"^(.*?\blayers\.\d+\.)", name)
        groups.setdefault(layer.group(1) if layer else "", []).append(name)
    yield from (group for group in groups.values() if group)
