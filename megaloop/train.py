"""The training entry point: ``python -m megaloop.train`` or ``megaloop-train``.

    megaloop-train --preset 135M --config run.yaml model.arch=asymloop train.lr=1e-3 \\
        data.path='[data/fwe_text_document]' data.tokenizer_model=tok.model

Configuration is layered: defaults < ``--preset`` (model size) < ``--config`` YAML < dotted
overrides. The resolved config is validated before anything heavy runs, and the Trainer writes it
to ``<train.out_dir>/config.yaml`` once set-up has completed. Launch under torchrun, srun or
mpiexec for more than one process.

Exit codes: 0 finished, or found finished (relaunched at its train.train_steps); 2 a
configuration, data, storage or checkpoint problem (one line on stderr); 3 training aborted
(NaN/Inf streak); 75 stopped by SIGTERM/SIGUSR1 (resumable: a checkpoint of the last step was
saved, or the signal came during set-up, before there was anything to save); 128 + the signal's
number (143, 138) on a second stop signal, which exits at once without saving
(megaloop.training.signals), and 130 on SIGINT (Ctrl-C), which does too. torchrun reports any failed worker as 1, so requeue-on-75 needs srun
or a direct launch.

Only the standard library is imported at module level: the stop-signal handlers go in before torch
loads (about 1.5 s), so that a SIGTERM during start-up is acted on, not an unexplained exit 143;
before those handlers, the stop signals are blocked (megaloop.stop_first), from the first
statement below when this module runs as a program and from the console script's first.
"""

from __future__ import annotations

if __name__ == "__main__":  # python -m megaloop.train, torchrun's workers: before any import
    from megaloop.stop_first import block_stop_signals

    block_stop_signals()

import argparse
import dataclasses
import logging
import signal
import sys
from typing import Callable, NoReturn

from megaloop.cli import (ALIKE_ON_EVERY_RANK, ArgumentParser, int_at_least, log_to_stderr,
                          print_error, quiet_third_party_warnings)
from megaloop.training.signals import StopSignals

log = logging.getLogger("megaloop.train")
EXIT_RESUMABLE = 75  # EX_TEMPFAIL: stopped by a preemption signal; a rerun continues the run
EXIT_INTERRUPTED = 128 + signal.SIGINT  # the shell's status for Ctrl-C


def build_config(argv: list[str] | None = None):
    """(validated RunConfig, parsed arguments)."""
    from megaloop.config import ConfigError, RunConfig, apply_overrides, load_yaml
    from megaloop.presets import PRESETS, check_arch

    parser = ArgumentParser(prog="megaloop-train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", action=_Once, help=f"model preset ({', '.join(PRESETS)})")
    parser.add_argument("--config", action=_Once,
                        help="YAML run config (sections model, parallel, train, data, checkpoint, "
                             "alrs)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the resolved config, rank layout and memory estimate; no "
                             "training")
    parser.add_argument("--world-size", type=int_at_least(1),
                        help="processes for --dry-run (default: the launcher's)")
    parser.add_argument("overrides", nargs="*", help="section.field=value (before or after the "
                                                     "options)")
    args = parser.parse_intermixed_args(argv)
    if args.world_size is not None and not args.dry_run:
        raise ConfigError(f"--world-size {args.world_size}: only read with --dry-run; a run's "
                          "world size is the launcher's (torchrun, srun, mpiexec)")
    cfg = RunConfig()
    if args.preset:
        if args.preset not in PRESETS:
            raise ConfigError(f"--preset {args.preset!r}: unknown; choose one of {', '.join(PRESETS)}")
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(PRESETS[args.preset]))
    try:
        if args.config:
            cfg = load_yaml(args.config, base=cfg)
        cfg = apply_overrides(cfg, args.overrides)
        if args.preset and args.config:
            _warn_preset_unread(args, cfg.model)
        if args.preset:
            check_arch(args.preset, cfg.model.arch)
        return cfg.validate(), args
    except ConfigError as e:
        # Each node reads the --config file for itself, and may see another one at its path (a
        # node-local copy, a stale one) or none: a refusal of its settings may be its own.
        e.config_file_read_on_each_node = bool(args.config)
        raise


def _warn_preset_unread(args: argparse.Namespace, model) -> None:
    """A warning line where ``--config`` sets every model field ``--preset`` sets (a run's saved
    config.yaml holds them all), so that the preset changes nothing, while its model differs from
    the one the run gets (``model``, overrides applied): a user who gave it for its dimensions
    would otherwise train the config's without a word. Where the two agree (a relaunch naming the
    run's preset), or the preset is in effect, nothing is said."""
    from megaloop.config import ConfigError, ModelConfig, RunConfig, apply_overrides, load_yaml
    from megaloop.presets import PRESETS

    try:
        if apply_overrides(load_yaml(args.config), args.overrides,
                           note_repeats=False).model != model:
            return  # the preset is in effect
        # What the preset gives with the overrides: a field an override sets is no difference.
        given = apply_overrides(RunConfig(model=PRESETS[args.preset]), args.overrides,
                                note_repeats=False).model
    except ConfigError:  # what the preset alone made valid: the preset is in effect
        return
    preset, config, default = args.preset, args.config, ModelConfig()
    differ = [f"model.{name}={getattr(model, name)!r} (the preset's {getattr(given, name)!r})"
              for name in (field.name for field in dataclasses.fields(model))
              if getattr(given, name) not in (getattr(default, name), getattr(model, name))]
    if differ:
        log.warning("--preset %s: without effect, --config %s sets every model field it sets: "
                    "%s%s; give one of the two", preset, config,
                    ", ".join(differ[:4]), f" and {len(differ) - 4} more" if len(differ) > 4
                    else "", extra=ALIKE_ON_EVERY_RANK)


class _Once(argparse.Action):
    """An option given at most once: argparse keeps the last of several, so a ``--config`` or
    ``--preset`` added after a job script's own (slurm/ scripts pass theirs, then the user's
    arguments) replaced it whole without a word, instead of layering on it."""

    def __call__(self, parser, namespace, value, option_string=None):
        from megaloop.config import ConfigError

        first = getattr(namespace, self.dest)
        if first is not None:
            raise ConfigError(f"{option_string} given twice ({first}, then {value}): one is read; "
                              "give further settings as section.field=value overrides")
        setattr(namespace, self.dest, value)


def bad_input_errors() -> tuple[type[Exception], ...]:
    """What megaloop-train reports as one ``error:`` line with exit 2: a configuration (storage
    problems are ConfigErrors naming the path), data or checkpoint problem. Imported when called,
    so that ``except bad_input_errors()`` loads nothing heavy: a CheckpointError can only come
    from megaloop.training.checkpoint once it is loaded, and loading it (torch and megatron-core,
    about 4 s) only to report a typo in an override would keep the user waiting."""
    from megaloop.config import ConfigError
    from megaloop.data import DataError

    checkpoint = sys.modules.get("megaloop.training.checkpoint")
    return (ConfigError, DataError) + ((checkpoint.CheckpointError,) if checkpoint else ())


def check_alrs_names(cfg) -> None:
    """For the dry run, what ALRS checks of the weight names at start-up: an alrs.exclude
    pattern or a prefix that matches no weight matrix is refused (ConfigError), and it warns of
    prefixes that pin nothing. On a one-process model of ``cfg`` on the meta device (no weights
    made), which holds every name the run's ranks hold between them: ALRS names blocks globally,
    across tensor, pipeline and expert parallelism."""
    if not cfg.train.use_alrs:
        return
    import torch
    from megatron.core import parallel_state

    from megaloop.alrs import ALRS
    from megaloop.config import ParallelConfig
    from megaloop.models.model import build_model
    from megaloop.platform.distributed import init_distributed

    if not (torch.distributed.is_initialized() and parallel_state.model_parallel_is_initialized()):
        init_distributed()
    with torch.device("meta"), _meta_device_mode():
        model = build_model(cfg.model, ParallelConfig(), use_te=False, initialize=False)
    ALRS(model, total_steps=cfg.train.train_steps, config=cfg.alrs)


def _meta_device_mode():
    from torch.overrides import TorchFunctionMode

    class OnMeta(TorchFunctionMode):
        """Every device argument read as the meta device: on a GPU megatron-core allocates the
        weights on ``torch.cuda.current_device()``, which ``torch.device("meta")`` leaves."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if kwargs.get("device") is not None:
                kwargs = {**kwargs, "device": "meta"}
            return func(*args, **kwargs)

    return OnMeta()


def main(argv: list[str] | None = None, *, then_exit: bool = False,
         accepted: Callable[[object], None] | None = None) -> int:
    """megaloop-train in this process: the exit status, with the previous signal handlers back.
    ``then_exit``: the caller exits with that status at once (a command line). Stop signals then
    stay ignored from the end of the run to the exit: with the default handler back, one arriving
    then (srun ending the job step while slower ranks finish their save) would turn a saved run's
    75, or 0, into 143. ``accepted(cfg)``: called once the Trainer has set the run up to train
    (new or resumed), before training, when it writes ``<train.out_dir>/config.yaml``; not after a
    refusal, a stop during set-up, or for a run found finished (whose config.yaml keeps the
    settings it trained with: a changed one is not applied)."""
    stop_signals = StopSignals()  # first: see the module docstring
    try:
        return _run(argv, stop_signals, accepted)
    except KeyboardInterrupt:
        # Ctrl-C stops at once, not at the end of the step as SIGTERM does: the Trainer has
        # released what it held on the way out. One line saying what is on disk, rather than
        # the traceback of wherever the interrupt fell (and exit 1, as a crash).
        print(f"error: interrupted by SIGINT (Ctrl-C): exiting with status {EXIT_INTERRUPTED}, "
              f"without saving (SIGTERM or SIGUSR1 saves first); {stop_signals.left_behind}",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        stop_signals.restore(signal.SIG_IGN if then_exit else None)


def cli() -> NoReturn:
    """The ``megaloop-train`` command."""
    sys.exit(main(then_exit=True))


def _run(argv: list[str] | None, stop_signals: StopSignals,
         accepted: Callable[[object], None] | None) -> int:
    from megaloop.config import ConfigError

    quiet_third_party_warnings()
    log_to_stderr()
    try:
        cfg, args = build_config(argv)
    except ConfigError as e:
        # Every rank reads the same arguments, so fails alike on them; with a --config file,
        # every rank of a node (which all read the same file there).
        if getattr(e, "config_file_read_on_each_node", False):
            print_error(e, alike_on_its_node=True)
        else:
            print_error(e, alike=True)
        return 2
    try:
        if args.dry_run:
            from megaloop.platform.distributed import detect_launch_env
            from megaloop.scale.dry_run import report

            text = report(cfg, args.world_size or detect_launch_env().world_size)
            check_alrs_names(cfg)
            print(text)
            return 0
        from megaloop.training.trainer import Trainer, TrainingAborted

        try:
            trainer = Trainer(cfg, stop_signals)
            if accepted is not None and not (trainer.stopped_during_set_up or trainer.complete):
                try:
                    accepted(cfg)
                except BaseException:
                    trainer.close()
                    raise
            if not (trainer.stopped_during_set_up or trainer.complete or trainer.resume_path):
                # Said, not left to the step numbers: a requeued job pointed at another
                # directory than its first run's would start over without a word.
                log.info("no checkpoint in %s: the run starts at step 1", trainer.checkpoint_dir)
            result = trainer.train()
        except TrainingAborted as e:
            # Decided alike on every rank: by the all-reduced loss, or the all-reduced check of
            # the weights.
            print_error(e, alike=True)
            return 3
    except bad_input_errors() as e:
        print_error(e)  # from rank 0 alone when the ranks decided it together
        return 2
    # A relaunched finished run (result["complete"]) exits 0 as well, as Megatron-LM and
    # torchtitan do when the checkpoint they load is at the last step: what was asked for, a run
    # trained to train.train_steps, is there; a requeue-on-failure job or `train && export`
    # would otherwise retry or stop on a run that is done.
    #
    # Stopped early by SIGTERM/SIGUSR1 (with a checkpoint of any step run, or during set-up with
    # nothing to save): "try again later", so that a job script can requeue (slurm/common.sh does)
    # while a finished run exits 0. The rerun resumes from the same checkpoint or starts afresh.
    return EXIT_RESUMABLE if result.get("stopped_by_signal") else 0


if __name__ == "__main__":
    cli()
