"""Configs to and from plain dicts and YAML files, and dotted ``section.field=value`` overrides."""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml

from megaloop.cli import ALIKE_ON_EVERY_RANK
from megaloop.config.errors import ConfigError
from megaloop.config.run import RunConfig
from megaloop.platform.files import write_text_atomic

log = logging.getLogger("megaloop.config")

# Integers YAML 1.1 (PyYAML, and so omegaconf) and YAML 1.2 read differently: a leading zero is
# octal in 1.1 (0123 = 83) and decimal in 1.2 (123); 1:30 is base 60 in 1.1 (90) and a string in
# 1.2. A number field refuses them rather than read them either way: octal is what no one means
# (seed: 0123), and decimal would make the file mean something else to other YAML 1.1 tools.
_YAML11_ONLY_INT = re.compile(r"[-+]?0[0-7_]+|[-+]?[1-9][0-9_]*(:[0-5]?[0-9])+")


class _Yaml11Scalar(str):
    """A plain scalar as written that YAML 1.1 reads as ``value`` and YAML 1.2 otherwise."""

    def __new__(cls, text: str, value):
        self = super().__new__(cls, text)
        self.value = value
        return self


class _Yaml11Int(_Yaml11Scalar):
    """Such an integer: the text is kept for a text field, a number field refuses it."""

    def refusal(self, where: str) -> str:
        if ":" in self:
            return (f"{where}={self}: YAML 1.1 reads this as base 60 ({self.value}), YAML 1.2 "
                    "as text; write the number")
        return (f"{where}={self}: YAML 1.1 reads a leading zero as octal ({self.value}), YAML "
                f"1.2 as decimal ({int(self.replace('_', ''), 10)}); write the number without it")


class _Yaml11Bool(_Yaml11Scalar):
    """A plain yes/no/on/off/y/n: YAML 1.2 (and so another tool reading the same file) takes it
    as text, so every field refuses it whatever its type; true and false are booleans in both and
    stay so."""

    def refusal(self, where: str) -> str:
        meaning = str(self.value).lower()
        return (f"{where}={self}: YAML 1.1 reads this as {meaning}, YAML 1.2 as the text "
                f"{str(self)!r}; write {meaning} for the boolean, or quote the text")


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load's loader that refuses a key given twice in one mapping, which PyYAML resolves
    silently by keeping the last (``arch: dense`` then ``arch: fullloop`` would train fullloop).
    Keys brought in by a ``<<`` merge may still be overridden: that is what a merge is for.
    Integers that only YAML 1.1 reads as numbers come back as ``_Yaml11Int``, booleans that only
    YAML 1.1 reads as booleans as ``_Yaml11Bool``."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first_line = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge" or \
                        not isinstance(key_node, yaml.ScalarNode):
                    continue  # a non-scalar key is SafeLoader's own error ("unhashable key")
                key, line = self.construct_object(key_node), key_node.start_mark.line + 1
                if key in first_line:
                    raise ConfigError(f"key {key!r} given twice in one mapping, on lines "
                                      f"{first_line[key]} and {line}")
                first_line[key] = line
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node):
        """An integer, or one YAML 1.1 and 1.2 read differently as a _Yaml11Int."""
        text, value = self.construct_scalar(node), super().construct_yaml_int(node)
        if _YAML11_ONLY_INT.fullmatch(text) and (":" in text or
                                                 value != int(text.replace("_", ""), 10)):
            return _Yaml11Int(text, value)
        return value  # 0, 07: the same number either way

    def construct_yaml_bool(self, node):
        """true or false, or one of YAML 1.1's other booleans as a _Yaml11Bool."""
        text = self.construct_scalar(node)
        if text.lower() in ("true", "false"):
            return super().construct_yaml_bool(node)
        return _Yaml11Bool(text, text.lower() in ("y", "yes", "on"))


_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:int", _UniqueKeyLoader.construct_yaml_int)
_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:bool", _UniqueKeyLoader.construct_yaml_bool)
# YAML 1.1's y/Y/n/N booleans, which PyYAML reads as text: refused as the other ones are.
_YAML11_LETTER_BOOL = re.compile(r"^[yYnN]$")
_UniqueKeyLoader.add_implicit_resolver("tag:yaml.org,2002:bool", _YAML11_LETTER_BOOL, "yYnN")


class _QuotingDumper(yaml.SafeDumper):
    """safe_dump's dumper, but quoting y/Y/n/N as well, which the loader above refuses plain:
    a config megaloop writes must load back."""


_QuotingDumper.add_implicit_resolver("tag:yaml.org,2002:bool", _YAML11_LETTER_BOOL, "yYnN")


def dump_yaml(data) -> str:
    """YAML text of plain data (``to_dict`` of a config) that ``load_yaml`` reads back as it was."""
    return yaml.dump(data, Dumper=_QuotingDumper, sort_keys=False)


def _yaml_load(stream):
    return yaml.load(stream, Loader=_UniqueKeyLoader)  # a SafeLoader: safe_load's semantics


def to_dict(cfg) -> dict:
    """Plain dict of a config; tuples become lists so that yaml.safe_dump can write it."""
    return dataclasses.asdict(cfg, dict_factory=lambda items: {
        k: list(v) if isinstance(v, tuple) else v for k, v in items})


def flat_settings(cfg) -> dict[str, Any]:
    """A RunConfig's settings by ``section.field`` (a nested section, such as
    train.downstream_eval, as one dict value)."""
    return {f"{section}.{name}": value for section, fields in to_dict(cfg).items()
            for name, value in fields.items()}


def _coerce(value: Any, hint: Any, where: str) -> Any:
    """Checks ``value`` against a field's type hint, converting ints to floats where declared."""
    if isinstance(value, _Yaml11Bool):
        raise ConfigError(value.refusal(where))
    origin = get_origin(hint)
    if origin is Literal:
        if value not in get_args(hint):
            allowed = ", ".join(repr(a) for a in get_args(hint))
            raise ConfigError(f"{where}={value!r}: must be one of {allowed}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = [a for a in get_args(hint) if a is not type(None)]
        optional = len(args) < len(get_args(hint))
        if value is None and optional:
            return None
        if value == "" and optional:  # no path, project or recipe is named "": unset is null
            raise ConfigError(f"{where}='': must not be empty; null leaves it unset")
        return _coerce(value, args[0], where)
    if origin in (list, tuple):  # tuple: tuple[item, ...] (alrs.exclude), written as a list
        item = get_args(hint)[0]
        # A single value where a list is expected; a string is one value, never its characters
        # (alrs.exclude: router would otherwise exclude every name holding an r, o, u, ...).
        if value is None:  # meant as "none", not as a list holding null
            raise ConfigError(f"{where}=None: must be a list ([] for none)")
        if not isinstance(value, (list, tuple)):
            value = [value]
        return origin(_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value))
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: must be a mapping of {hint.__name__} fields")
        return from_dict(hint, value, where)
    if isinstance(value, _Yaml11Int):
        if hint is str:
            return str(value)
        raise ConfigError(value.refusal(where))
    if hint is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        # Megatron's numbers as YAML reads them: data.split 100, blend weights in data.path.
        return str(value)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str):
        try:  # YAML 1.1 reads "3e-4" (no dot) as a string
            return float(value)
        except ValueError:
            pass
    if hint is str and isinstance(value, dict):
        # An unquoted format string such as data.sft_solution={answer}: YAML reads the braces.
        raise ConfigError(f"{where}={value!r}: must be text; YAML reads an unquoted {{...}} as a "
                          "mapping: write the value in quotes (\"{...}\")")
    if hint in (int, float, str, bool) and not isinstance(value, hint) or (
        hint is int and isinstance(value, bool)
    ):
        raise ConfigError(f"{where}={value!r}: must be of type {hint.__name__}")
    return value


def check_field_names(cls, keys, where: str = "") -> None:
    """Refuses (ConfigError) the first of ``keys`` that is no field of dataclass ``cls``, naming
    the closest field or, without one, all of them; ``where``: the section, as in ``model``."""
    names = [f.name for f in dataclasses.fields(cls)]
    for key in keys:
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f" (did you mean {close[0]}?)" if close else f" (known: {', '.join(names)})"
            raise ConfigError(f"unknown field {f'{where}.{key}' if where else key}{hint}")


def from_dict(cls, data: dict, where: str = ""):
    """Builds dataclass ``cls`` from a (possibly partial) dict, rejecting unknown keys."""
    hints = typing.get_type_hints(cls)
    check_field_names(cls, data, where)
    kwargs = {}
    for key, value in data.items():
        kwargs[key] = _coerce(value, hints[key], f"{where}.{key}" if where else key)
    return cls(**kwargs)  # a section's own checks (ALRSConfig's) raise ConfigErrors naming fields


def apply_overrides(cfg: RunConfig, overrides: list[str], note_repeats: bool = True) -> RunConfig:
    """Applies ``section.field=value`` strings; values are parsed as YAML scalars. A field given
    twice takes the last value (a job script's own overrides come first, the user's after them),
    each repeat one info line naming both (``note_repeats``: False for a second application of
    the same overrides)."""
    data, given = to_dict(cfg), {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r}: expected the form section.field=value")
        if note_repeats and key in given and given[key] != item:
            log.info("override %s given twice: %s, then %s; the last is in effect", key,
                     given[key], item, extra=ALIKE_ON_EVERY_RANK)
        given[key] = item
        node, parts = data, key.split(".")
        for depth, part in enumerate(parts[:-1]):
            if not isinstance(node.get(part), dict):
                sections = [name for name, value in node.items() if isinstance(value, dict)]
                close = difflib.get_close_matches(part, sections, n=1)
                raise ConfigError(f"override {item!r}: {'.'.join(parts[:depth + 1])} is not a "
                                  "section" + (f" (did you mean {close[0]}?)" if close else ""))
            node = node[part]
        try:
            node[parts[-1]] = _yaml_load(raw) if raw else ""
        except yaml.YAMLError:
            raise ConfigError(f"override {item!r}: the value is not valid YAML (quote it, or "
                              "write lists as [a, b])") from None
        except ConfigError as e:
            raise ConfigError(f"override {item!r}: {e}") from None
    return from_dict(RunConfig, data)


def _deep_merge(base: dict, update: dict) -> dict:
    """``base`` with ``update``'s keys replacing its own, nested mappings merged key by key."""
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            value = _deep_merge(merged[key], value)
        merged[key] = value
    return merged


def load_yaml(path: str | os.PathLike, base: RunConfig | None = None) -> RunConfig:
    """Reads a (possibly partial) YAML run config; its fields replace those of ``base``."""
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"config file {path}: not found") from None
    except OSError as e:  # a directory, no permission
        raise ConfigError(f"config file {path}: cannot be read ({e.strerror or e})") from None
    try:
        data = _yaml_load(raw.decode("utf-8")) or {}
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ConfigError(f"config file {path}: not UTF-8 text (byte {raw[e.start]:#04x} on line "
                          f"{line})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path}: invalid YAML ({str(e).splitlines()[0]})") from None
    except ConfigError as e:
        raise ConfigError(f"config file {path}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: top level must be a mapping")
    try:
        return run_config_from(data, base)
    except ConfigError as e:
        raise ConfigError(f"config file {path}: {e}") from None


def run_config_from(data: dict, base: RunConfig | None = None) -> RunConfig:
    """A RunConfig from a (possibly partial) nested mapping, as in a YAML file; its fields replace
    those of ``base`` (default: the defaults)."""
    return from_dict(RunConfig, _deep_merge(to_dict(base or RunConfig()), data))


def save_yaml(cfg: RunConfig, path: str | os.PathLike) -> None:
    """Writes atomically (``megaloop.platform.files.write_text_atomic``)."""
    write_text_atomic(path, dump_yaml(to_dict(cfg)))
