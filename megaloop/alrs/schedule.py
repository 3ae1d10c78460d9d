"""ALRS options and the multiplier schedule: when to allocate, how to ramp, when to freeze.

Step numbering: ``step`` is the 1-based index of the optimizer step about to be applied (the first
optimizer step is step 1). Allocation happens at step 1 and at every multiple of ``interval`` while
step <= fraction·T. The first allocation holds at once, from step 1 (in the reference its ramp
coincides with the LR warmup from 0, so the full multiplier is in effect from the start). Each later
allocation at step a starts a linear ramp from the multipliers in effect at step a to the new
targets, reached at step a + transition; after the last ramp the multipliers are frozen. The LR of
matrix i is lr_i(t) = m_i(t)·base_lr(t): the base schedule (warmup, cosine) runs underneath
unchanged. The reference instead ramps the absolute LR towards s_i·base_lr(a + transition)
and then restarts its cosine; both end at s_i·base_lr(t), ours without a kink at the ramp's end.

AdamW's decoupled weight decay is multiplied by the group LR in torch (p -= lr·wd·p), so a matrix
with multiplier 5 also decays 5x faster. That is the reference's behaviour too, and it is kept.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

EIGEN_METHODS = ("gram64", "svd32")  # megaloop.alrs.estimator implements each

MODES = ("alrs", "uniform", "decoder_boost")
# The options only one mode reads: the allocation from spectra (mode alrs) and the constant boost.
ALLOCATION_OPTIONS = ("s1", "s2", "transition", "embedding_head", "embedding_head_prefixes")
BOOST_OPTIONS = ("decoder_boost", "decoder_prefix")
EMBEDDING_HEAD_TREATMENTS = ("pin_s2", "exclude", "include")
GRANULARITIES = ("block", "parameter")


def _one_of(choices: tuple[str, ...]) -> str:
    return "one of " + ", ".join(map(repr, choices))


def config_error(message: str) -> ValueError:
    """megaloop.config.ConfigError(message): one line, which the training entry point prints."""
    from megaloop.config import ConfigError  # here: megaloop.config imports this module

    return ConfigError(message)


@dataclass
class ALRSConfig:
    """All ALRS options. Defaults follow the paper's runs (s in [1, 5], every 100 steps, 50-step
    ramps, first 20% of training).

    granularity: ``block`` (the reference's) gives every logical matrix its own α and LR: Q, K, V
      split out of megatron-core's fused ``linear_qkv``, Global K and V out of ``linear_kv_global``,
      gate and up out of ``linear_fc1`` (``megaloop.alrs.blocks``); ``parameter`` treats each fused
      weight as one matrix.
    mode: ``alrs`` allocates from spectra; ``uniform`` keeps every multiplier at 1 (spectra are still
      logged, for the uniform-vs-ALRS plots); ``decoder_boost`` gives every decoder matrix the constant
      ``decoder_boost`` from step 1 and everything else 1.
    embedding_head: ``pin_s2`` gives embedding and output head s2 without letting their α set the
      range (the reference); ``exclude`` keeps them at 1; ``include`` treats them like any matrix.
    exclude: substrings of parameter names never analysed nor scaled (e.g. ``"router"``).
    monitor_after_freeze: keep computing and logging spectra every ``interval`` steps after the
      allocation window (multipliers stay frozen), so the logs cover the whole run. Off by default:
      the reference computes no spectra after the freeze (7 analyses at T=3200, not 33).
    """

    mode: str = "alrs"
    granularity: str = "block"
    s1: float = 1.0
    s2: float = 5.0
    interval: int = 100
    fraction: float = 0.2
    transition: int = 50
    embedding_head: str = "pin_s2"
    embedding_head_prefixes: tuple[str, ...] = ("embedding.", "output_layer.")
    decoder_prefix: str = "decoder."
    decoder_boost: float = 2.0
    exclude: tuple[str, ...] = ()
    eig_method: str = "gram64"
    log_eigenvalues: bool = False
    monitor_after_freeze: bool = False

    def __post_init__(self) -> None:
        # Imported here: megaloop.config imports this module.
        from megaloop.config.errors import require, require_finite

        require_finite(self, "alrs")  # first: range checks let inf through, and nan fails them all
        self.embedding_head_prefixes = tuple(self.embedding_head_prefixes)
        self.exclude = tuple(self.exclude)
        for name in ("exclude", "embedding_head_prefixes"):  # "" is in every parameter name
            require("" not in getattr(self, name), "alrs", name, list(getattr(self, name)),
                    "free of empty strings (one matches every matrix)")
        # None: pin_s2 and exclude would treat no matrix.
        require(bool(self.embedding_head_prefixes), "alrs", "embedding_head_prefixes", [],
                "a list of at least one prefix (embedding_head='include' treats embedding and "
                "head like any matrix)")
        # "" starts every name: every matrix boosted, embedding and head too.
        require(bool(self.decoder_prefix), "alrs", "decoder_prefix", self.decoder_prefix,
                "non-empty (it starts every matrix name, so decoder_boost would scale every LR "
                "alike)")
        require(self.mode in MODES, "alrs", "mode", self.mode, _one_of(MODES))
        require(self.s1 > 0, "alrs", "s1", self.s1, "> 0")
        require(self.s1 <= self.s2, "alrs", "s1", self.s1, f"<= alrs.s2={self.s2!r}")
        require(0.0 < self.fraction <= 1.0, "alrs", "fraction", self.fraction, "in (0, 1]")
        require(self.interval >= 1, "alrs", "interval", self.interval, ">= 1")
        require(self.transition >= 0, "alrs", "transition", self.transition, ">= 0")
        require(self.decoder_boost > 0, "alrs", "decoder_boost", self.decoder_boost, "> 0")
        require(self.granularity in GRANULARITIES, "alrs", "granularity", self.granularity,
                _one_of(GRANULARITIES))
        require(self.embedding_head in EMBEDDING_HEAD_TREATMENTS, "alrs", "embedding_head",
                self.embedding_head, _one_of(EMBEDDING_HEAD_TREATMENTS))
        require(self.eig_method in EIGEN_METHODS, "alrs", "eig_method", self.eig_method,
                _one_of(EIGEN_METHODS))

    def to_dict(self) -> dict:
        return asdict(self)

    def read_options(self) -> set[str]:
        """The options of ``ALLOCATION_OPTIONS`` and ``BOOST_OPTIONS`` that this mode reads: the
        one rule behind the start-up warning (``unread_options``) and the prefix checks of the
        ALRS hook."""
        if self.mode == "alrs":
            # "include" ranges embedding and head like any matrix: their prefixes mark nothing.
            return set(ALLOCATION_OPTIONS) - ({"embedding_head_prefixes"}
                                              if self.embedding_head == "include" else set())
        if self.mode == "decoder_boost":
            return set(BOOST_OPTIONS)
        return set()

    def reader(self) -> str:
        """The settings that decide ``read_options``, as the messages about unread options name
        them: the mode, and with mode alrs an embedding_head of 'include'."""
        include = self.mode == "alrs" and self.embedding_head == "include"
        return f"alrs.mode={self.mode!r}" + (" with alrs.embedding_head='include'" if include
                                             else "")

    def unread_options(self) -> list[str]:
        """``name=value`` of each option set away from its default that this mode does not read.
        They are accepted, so that one config serves both arms of a comparison (mode=alrs
        against mode=uniform); the ALRS hook names them when it starts."""
        unread = set(ALLOCATION_OPTIONS + BOOST_OPTIONS) - self.read_options()
        default = ALRSConfig()
        return [f"{name}={getattr(self, name)!r}" for name in self.to_dict()
                if name in unread and getattr(self, name) != getattr(default, name)]

    def transition_note(self, total_steps: int) -> str | None:
        """Why ``transition`` does not act as its value suggests over a run of ``total_steps``
        steps, for the ALRS hook's start-up warning; None when it does. Only step 1 allocating
        (interval past the window): no ramp reads it, which is said when it is set away from its
        default (a short test run of a long run's config). A transition longer than the
        allocation window: still read (a warning, not a refusal), but every ramp the next
        allocation starts before it ends is cut short, and the last one carries the multipliers'
        changes past the window, maybe past the run's end, where its targets are never
        reached."""
        if self.mode != "alrs":  # unread_options names it
            return None
        window = self.fraction * total_steps
        if self.interval > window:
            if self.transition == ALRSConfig().transition:
                return None
            return (f"ALRS allocates only at step 1 (alrs.interval={self.interval} > alrs.fraction x "
                    f"total steps = {window:g}), whose multipliers hold at once: "
                    f"alrs.transition={self.transition} has no effect")
        if self.transition <= window:
            return None
        last = int(window // self.interval) * self.interval
        cut = (f"each ramp but the last is cut short by the next allocation "
               f"(every alrs.interval={self.interval} steps), and " if last > self.interval else "")
        past = (f", after the run's last step {total_steps}: its targets are never reached"
                if last + self.transition > total_steps else "")
        return (f"ALRS: alrs.transition={self.transition} is longer than the allocation window "
                f"(alrs.fraction x total steps = {window:g}): {cut}the last ramp, from step {last}, "
                f"ends at step {last + self.transition}{past}")

    def allocates_at(self, step: int, total_steps: int) -> bool:
        """Whether multipliers are re-allocated from spectra at this step.

        Step 1 always allocates, even when fraction·T < 1 (a short debug run): otherwise such a
        run would silently train with uniform LRs.
        """
        return self.mode == "alrs" and self._on_cadence(step) and self._in_window(step, total_steps)

    def analyses_at(self, step: int, total_steps: int) -> bool:
        """Whether spectra are computed (for allocation, or only for the log) at this step."""
        if not self._on_cadence(step):
            return False
        return self.monitor_after_freeze or self._in_window(step, total_steps)

    def _on_cadence(self, step: int) -> bool:
        return step == 1 or (step > 0 and step % self.interval == 0)

    def _in_window(self, step: int, total_steps: int) -> bool:
        return step == 1 or step <= self.fraction * total_steps


class MultiplierSchedule:
    """Per-name multipliers as piecewise-linear ramps between allocations; the first allocation
    holds at once. ``transition``: the length of the ramps that the next allocations start;
    ``ramp_length``: that of the last ramp started, which a resume with another
    ``alrs.transition`` keeps (the new one takes effect at the next allocation, as the other
    allocation options do, rather than bending or reopening a ramp)."""

    def __init__(self, initial: dict[str, float], transition: int):
        self.transition = transition
        self.ramp_length = transition
        self.start = dict(initial)
        self.target = dict(initial)
        self.ramp_step = 0
        self.allocated = False

    def at(self, step: int) -> dict[str, float]:
        """Multipliers in effect at ``step`` (m(a) = start, m(a + ramp_length) = target)."""
        if self.ramp_length == 0 or step >= self.ramp_step + self.ramp_length:
            return dict(self.target)
        frac = max(0, step - self.ramp_step) / self.ramp_length
        return {k: self.start[k] + (self.target[k] - self.start[k]) * frac for k in self.target}

    def retarget(self, step: int, targets: dict[str, float]) -> None:
        """Start a new ramp at ``step`` from the current multipliers to ``targets``; the first
        allocation sets ``targets`` at once."""
        if targets.keys() != self.target.keys():
            raise ValueError("ALRS targets must name exactly the scheduled matrices")
        self.start = self.at(step) if self.allocated else dict(targets)
        self.target = dict(targets)
        self.ramp_step = step
        self.ramp_length = self.transition
        self.allocated = True

    def state_dict(self) -> dict:
        return {"start": dict(self.start), "target": dict(self.target), "ramp_step": self.ramp_step,
                "ramp_length": self.ramp_length, "allocated": self.allocated}

    def load_state_dict(self, state: dict) -> None:
        """Restores the ramp in progress with its own length (checkpoints written before
        "ramp_length" existed: give it, the saved config's alrs.transition, in ``state``)."""
        if set(state["target"]) != set(self.target):
            raise ValueError("ALRS checkpoint names different matrices than this model")
        self.start = dict(state["start"])
        self.target = dict(state["target"])
        self.ramp_step = int(state["ramp_step"])
        self.ramp_length = int(state["ramp_length"])
        # Checkpoints written before "allocated" existed had allocated iff a ramp had started.
        self.allocated = bool(state.get("allocated", self.ramp_step > 0))
