"""What megaloop's command-line entry points share (``megaloop-train``, the quickstart, tools/)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import re
import signal
import sys
import warnings
from pathlib import Path
from typing import Sequence, TypeVar


def quiet_third_party_warnings() -> None:
    """megatron-core warns at import about optional GPU packages and deprecated torch APIs; on a
    CPU machine those lines bury the training log."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module=r"(megatron|torch)\b.*")
    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).*")
    # Raised inside megatron-core's DDP hooks, surfacing through the CPU layer's function mode.
    warnings.filterwarnings("ignore", message=r"The \.grad attribute of a Tensor that is not a leaf")
    logging.getLogger("megatron").setLevel(logging.WARNING)  # per-parameter INFO lists


def log_to_stderr() -> None:
    """megaloop's log lines (warnings, and the notes at INFO) on stderr, each naming its logger,
    as megaloop-train writes them; a process that set up logging already keeps its own. Once the
    process group is up, the notes come from rank 0 alone: every rank makes the same ones (the
    resume point, each setting a resume changes, the data), and srun gathers all ranks' stderr in
    one job log, where 128 ranks wrote each line 128 times. Warnings and errors, which may be one
    rank's own, come from every rank, and so do notes logged with ``extra=EVERY_RANK``; warnings
    logged with ``extra=ALIKE_ON_EVERY_RANK`` come from rank 0 alone."""
    if logging.getLogger().handlers:
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger().handlers[0].addFilter(_notes_from_rank0)


EVERY_RANK = {"every_rank": True}  # a note of this rank's own (what it alone did or wrote)
# A warning that every rank logs alike after a decision they took together (the stop on a
# signal, which all ranks agree on): rank 0's line says it for all.
ALIKE_ON_EVERY_RANK = {"alike_on_every_rank": True}


def _notes_from_rank0(record: logging.LogRecord) -> bool:
    if getattr(record, "alike_on_every_rank", False):
        return _rank() in (0, None)
    if record.levelno >= logging.WARNING or getattr(record, "every_rank", False):
        return True
    dist = sys.modules.get("torch.distributed")  # not imported here: the CLI starts without torch
    return dist is None or not dist.is_initialized() or dist.get_rank() == 0


E = TypeVar("E", bound=BaseException)


def decided_on_every_rank(error: E) -> E:
    """``error``, marked as one that every rank raises alike, having decided it together
    (megaloop.training.collective): ``print_error`` leaves it to rank 0. The mark is the error's
    own: an error of one rank that quotes an agreed message is not taken for it."""
    error.decided_on_every_rank = True
    return error


def is_decided_on_every_rank(error: BaseException) -> bool:
    """Whether ``error`` bears ``decided_on_every_rank``'s mark: raised alike on every rank, none
    of which waits in a collective for it."""
    return getattr(error, "decided_on_every_rank", False)


def restating(cause: BaseException, error: E) -> E:
    """``error``, which says ``cause`` in more words (a save's or load's error naming the
    failure): decided on every rank when ``cause`` was."""
    return decided_on_every_rank(error) if is_decided_on_every_rank(cause) else error


def print_error(error: BaseException, *, alike: bool = False,
                alike_on_its_node: bool = False) -> None:
    """``error: <error>`` on stderr, a command's one-line report of why it failed. From rank 0
    alone when every rank fails alike: ``alike`` (the caller knows), or an error the ranks
    decided together (``decided_on_every_rank``, or ``restating`` one in more words); srun
    gathers every rank's stderr in one job log, which held the line once per rank. From the
    first rank of each node (its local rank 0) when the ranks of a node fail alike, but those of
    another node may not (``alike_on_its_node``: a file each node reads for itself), so that no
    node's error is left unsaid. Any other error may be this rank's own (a file its node cannot
    read, a fault in its part of the model), and every rank that has one says it."""
    if alike or is_decided_on_every_rank(error):
        if _rank() not in (0, None):
            _let_rank0_exit_first()
            return
    elif alike_on_its_node:
        launch = _launch_env()
        if launch is not None and launch.local_rank != 0:
            return
    print(f"error: {error}", file=sys.stderr)


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser for a command that runs on every rank of a launch (megaloop-train under
    torchrun or srun): a usage error, which every rank finds alike in the same arguments, comes
    from rank 0 alone (the launcher's rank: no process group is up yet), and every rank exits 2.
    ``launchers``: those whose ranks run the command together (LaunchEnv.launcher; None: all);
    under any other, the process is alone, and says its error whatever rank its environment
    holds (torchrun's RANK is in every container of a PyTorchJob's worker pods). An option cut
    short is refused, as Megatron-LM's parsers do (allow_abbrev=False): else --output-pre was
    --output-prefix, its meaning changed by a later option sharing the prefix."""

    launchers: tuple[str, ...] | None = None

    def __init__(self, *args, allow_abbrev: bool = False, **kwargs):
        super().__init__(*args, allow_abbrev=allow_abbrev, **kwargs)

    def error(self, message):
        launch = _launch_env()
        if self.launchers is not None and (launch is None or launch.launcher not in self.launchers):
            super().error(message)
        if _rank() not in (0, None):
            _let_rank0_exit_first()
            self.exit(2)
        super().error(message)


RANK0_GRACE_S = 2.0


def _let_rank0_exit_first() -> None:
    """A rank other than 0 that leaves an error to rank 0 waits a moment before it exits: the
    launchers end every rank as soon as one fails (torchrun's agent, mpiexec, srun
    --kill-on-bad-exit), and a rank 0 still on its way to the line (under torchrun still in its
    interpreter's start; under mpiexec after the ranks agreed the error) died of it without a
    word, the error said by no rank (seen 1 in 10 under torchrun on a loaded machine, and once
    in a full test run under mpiexec). Only error exits of multi-rank runs pay it."""
    import time

    time.sleep(RANK0_GRACE_S)


def _rank() -> int | None:
    """This process's rank: the process group's, else the launcher's (torchrun, srun, mpiexec);
    None when unknown (a launch environment megaloop refuses)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_initialized():
        return dist.get_rank()
    launch = _launch_env()
    return None if launch is None else launch.rank


def _launch_env():
    """The launcher's ranks (megaloop.platform.launch.LaunchEnv), None when megaloop refuses
    them. Found without the rendezvous address: an error of `mpiexec -n 2` without MASTER_PORT
    (which megaloop-train refuses later) was printed by every rank."""
    from megaloop.config import ConfigError
    from megaloop.platform.launch import detect_launch_env

    try:
        return detect_launch_env(rendezvous=False)
    except ConfigError:
        return None


class Stopped(BaseException):
    """A stop signal received outside training (a BaseException, as KeyboardInterrupt is, so that
    no ``except Exception`` on the way swallows it), raised where it was received."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def raise_stopped(signum, frame):
    """A signal handler raising Stopped: temporary files are removed as the stack unwinds, where
    SIGTERM's default action ends the process on the spot."""
    raise Stopped(signum)


@contextlib.contextmanager
def signals_handled(signals, handler):
    """``handler`` for each of ``signals`` while the block runs; the previous handlers after it
    (a handler raising an exception turns a signal whose default action would end the process on
    the spot into an unwinding that removes a command's temporary files)."""
    previous = {s: signal.signal(s, handler) for s in signals}
    try:
        yield
    finally:
        for s, before in previous.items():
            signal.signal(s, before)


def int_at_least(minimum: int):
    """An argparse ``type``: an integer >= ``minimum``; argparse reports any other value in one
    line naming the flag (``argument --limit: 0: must be >= 1``)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value}: must be >= {minimum}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


def float_above(bound: float):
    """An argparse ``type``: a finite number > ``bound`` (``argument --tolerance: 0.0: must be > 0``)."""
    def parse(text: str) -> float:
        value = _number(text)
        if not math.isfinite(value) or value <= bound:
            raise argparse.ArgumentTypeError(f"{value}: must be > {bound:g}")
        return value

    parse.__name__ = f"number > {bound:g}"
    return parse


def float_in(low: float, high: float):
    """An argparse ``type``: a number in [``low``, ``high``] (``argument --character-coverage:
    0.5: must be in [0.98, 1.0]``)."""
    def parse(text: str) -> float:
        value = _number(text)
        if not low <= value <= high:  # nan fails too
            raise argparse.ArgumentTypeError(f"{value}: must be in [{low}, {high}]")
        return value

    parse.__name__ = f"number in [{low}, {high}]"
    return parse


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: not a number") from None


def unwritable(path: str | os.PathLike) -> str | None:
    """Why an output file cannot be written at ``path`` (None when it can), for a check before
    hours of work: the path must not be a directory, and its nearest existing ancestor (where the
    missing directories will be made) must be a writable directory."""
    target = Path(path).absolute()
    if target.is_dir():
        return "it is a directory"
    ancestor = target.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir() or not os.access(ancestor, os.W_OK | os.X_OK):
        return f"{ancestor} is not a writable directory"
    return None


# The last line of a Python exception, as a crashed child prints it (torchrun's own ChildFailedError,
# the launcher's report after every worker's failure, says nothing of the cause).
_EXCEPTION_LINE = re.compile(r"^(?!.*ChildFailedError)[\w.]*(Error|Exception|Interrupt)\b[^:]*:")
_RANK_PREFIX = re.compile(r"^\[rank\d+\]:")


def child_failure(done, what: str) -> str | None:
    """None if the child process ``done`` (a subprocess.CompletedProcess with ``stderr`` as
    text) succeeded, else one message naming ``what``, its exit status and the child's reasons:
    its ``error:`` lines (megaloop's one-line errors) or the last lines of its exceptions, each
    once (torchrun's ranks repeat them), else the end of its stderr. A launch's stderr ends with
    torchrun's failure report, which hides them: a tail of it or check=True's traceback would."""
    if done.returncode == 0:
        return None
    # torch's excepthook prefixes a worker's traceback with "[rank0]: " once its group is up.
    lines = [_RANK_PREFIX.sub("", line).strip() for line in (done.stderr or "").splitlines()]
    lines = [line for line in lines if line]
    reasons = list(dict.fromkeys(line.removeprefix("error: ") for line in lines
                                 if line.startswith("error: ") or _EXCEPTION_LINE.match(line)))
    detail = "; ".join(reasons[:3]) if reasons else "\n".join(lines[-5:]) or "nothing on stderr"
    return f"{what} failed (exit {done.returncode}): {detail}"


def refuse_overrides_of(overrides: list[str], set_by: dict[str, str | None]) -> None:
    """ConfigError for the first ``section.field=value`` override of a setting the command makes
    itself, which the override would silently replace or be replaced by. ``set_by`` maps a key, or
    ``section.*`` for a whole section, to what sets it (the option to use instead); a key mapped
    to None stays free inside such a section."""
    from megaloop.config import ConfigError  # here: this module imports the standard library only

    for item in overrides:
        key = item.partition("=")[0]
        section = f"{key.partition('.')[0]}.*"
        by = set_by[key] if key in set_by else set_by.get(section)
        if by is not None:
            raise ConfigError(f"override {item!r}: set by {by}")


def with_settings(cfg, settings: dict[str, object]):
    """A copy of the RunConfig ``cfg`` with each ``section.field`` of ``settings`` set to its
    value. A command sets what it sets itself through this, and refuses overrides of the same
    keys (``set_by`` and ``refuse_overrides_of``), so the refusal cannot miss a field it sets."""
    import dataclasses

    for key, value in settings.items():
        section, _, name = key.partition(".")
        cfg = dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section),
                                                                       **{name: value})})
    return cfg


def set_by(settings: dict[str, object], options: tuple[str, ...], otherwise: str) -> dict[str, str]:
    """``{section.field: what sets it}`` for ``refuse_overrides_of``, of a command's ``settings``
    made with each option's value being the option's own name (``"--out"``): a field whose value
    holds an option's name is set by that option, any other by ``otherwise``."""
    return {key: next((option for option in options if option in str(value)), otherwise)
            for key, value in settings.items()}


def replaced_settings(given, configs: list, setters: dict[str, str | None]) -> str | None:
    """What ``given`` (a RunConfig as the user's --config and overrides make it) sets away from its
    default that a command replaces in a config it runs (``configs``), grouped by what replaces it:
    ``train.train_steps=50 replaced by --steps; ...``; None when nothing is. ``setters`` maps keys
    and ``section.*`` as for ``refuse_overrides_of``. Derived from the configs that run, so no
    replaced field goes unsaid."""
    from megaloop.config import RunConfig, flat_settings

    default, ours = flat_settings(RunConfig()), flat_settings(given)
    runs = [flat_settings(cfg) for cfg in configs]
    by: dict[str, list[str]] = {}
    for key, value in ours.items():
        setter = setters[key] if key in setters else setters.get(f"{key.partition('.')[0]}.*")
        if setter is not None and value != default[key] and any(r[key] != value for r in runs):
            by.setdefault(setter, []).append(f"{key}={value!r}")
    return "; ".join(f"{', '.join(keys)} replaced by {setter}" for setter, keys in by.items()
                     ) or None


def parsed_preset(parser: argparse.ArgumentParser, name: str, **overrides):
    """``megaloop.presets.preset(name, **overrides)`` for a command whose options give them, or
    argparse's one-line error (exit 2) naming the preset, field or value: an unknown ``--preset``
    or ``--arch`` is the user's input, not a traceback."""
    from megaloop.config import ConfigError
    from megaloop.presets import preset

    try:
        return preset(name, **overrides)
    except ConfigError as e:
        parser.error(str(e))


def train_config_args(preset: str | None, config: str | None) -> list[str]:
    """megaloop-train's ``--preset`` / ``--config`` arguments (for megaloop.train.build_config) of
    a tool that takes the same two options."""
    return [word for flag, value in (("--preset", preset), ("--config", config)) if value
            for word in (flag, value)]


def default_model_note(preset: str | None, config: str | None, model) -> str | None:
    """With neither ``--preset`` nor ``--config`` a tool works on megaloop's default model, as
    megaloop-train does; a line naming its size, so that it does not pass for one the user chose
    (None when either option is given)."""
    if preset or config:
        return None
    return (f"neither --preset nor --config: megaloop's default model (model.arch={model.arch}, "
            f"num_layers={model.num_layers}, hidden_size={model.hidden_size}, seq_length="
            f"{model.seq_length}, after the overrides); give --preset or --config for another")


def json_keys_refusal(keys: Sequence[str]) -> str | None:
    """The command-line refusal of a --json-keys list naming a field twice, or None. Each key is
    a pass over the input: a repeat would train on that field twice, or write one output twice."""
    twice = next((key for i, key in enumerate(keys) if key in keys[:i]), None)
    return None if twice is None else f"--json-keys {' '.join(keys)}: {twice!r} given twice"
