"""YAML read strictly onto typed dataclasses: the machinery under minite.config, free of its schema.

- `load_yaml(text, where)`: yaml.safe_load that refuses a key given twice in one mapping (PyYAML keeps the last one
  silently): a ConfigError naming the key, its lines and `where`.
- `from_dict(cls, data, where)`: a dataclass from a mapping: an unknown key, a value of the wrong type, or a NaN or
  Inf in a float field is a ConfigError naming the file and the key (`FILE: section.key: ...`); the dataclass's own
  checks (__post_init__'s ValueError) come back as `FILE: section: ...`.
- `check_key(root, item, parts, value)`: a `--set a.b=value` override against `root`'s fields and types alone.
Fields with `metadata={"internal": True}` are set by the program, not written in a file: they are not keys (an unknown
key where given, and not listed as known).
"""
from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from typing import Any, Literal, Union

import yaml

_FLOAT_LITERAL = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


class ConfigError(ValueError):
    """A configuration file or override is invalid; the message names the key and the file."""


class _Loader(yaml.SafeLoader):
    """SafeLoader whose mappings refuse a key given twice (_DuplicateKey)."""


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key, lines: tuple[int, int]):
        super().__init__(f"key {key!r} given twice")
        self.key, self.lines = key, lines


def _construct_mapping(loader: _Loader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`: its keys may be overridden, as YAML means
            continue
        key = loader.construct_object(key_node, deep=deep)
        line = key_node.start_mark.line + 1
        try:
            if key in seen:
                raise _DuplicateKey(key, (seen[key], line))
            seen[key] = line
        except TypeError:  # an unhashable key: construct_mapping refuses it in its own words
            pass
    return loader.construct_mapping(node, deep=deep)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load_yaml(text: str, where: str) -> Any:
    """yaml.safe_load(text), and a ConfigError `WHERE: key 'k' is given twice (lines a and b): keep one` for a
    duplicate key; other YAML errors propagate (yaml.YAMLError) for the caller to word."""
    try:
        return yaml.load(text, Loader=_Loader)
    except _DuplicateKey as e:
        lines = f" (lines {e.lines[0]} and {e.lines[1]})" if e.lines[0] != e.lines[1] else ""
        raise ConfigError(f"{where}: key {e.key!r} is given twice{lines}: keep one") from None


def public_fields(cls) -> list[str]:
    """The keys of dataclass `cls` that a file or --set may give (init fields that are not internal)."""
    return [f.name for f in dataclasses.fields(cls) if f.init and not f.metadata.get("internal")]


def _at(where: str, key: str) -> str:
    """The location of `key` (dotted, inside file `where`) as messages name it."""
    return f"{where}: {key}" if key else where


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _to_float(value: Any, where: str) -> float:
    """A float field's value: an int, or YAML 1.1's dotless exponent string (3e-4), converted. NaN and Inf are
    refused: no float field of the config gives them a meaning (a disabled limit is 0 or null, as each field says)."""
    if isinstance(value, str) and _FLOAT_LITERAL.fullmatch(value.strip()):
        value = float(value)  # YAML 1.1 reads 3e-4 (no dot) as a string
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{where}: expected float, got {type(value).__name__} {value!r}")
    try:
        value = float(value)
    except OverflowError:  # an int beyond the float range
        value = math.inf
    if not math.isfinite(value):
        raise ConfigError(f"{where}: expected a finite number, got {value}")
    return value


def _convert(tp, value: Any, where: str, key: str):
    """`value` as type `tp`, for the field `key` (dotted) of file `where`."""
    origin, args, here = typing.get_origin(tp), typing.get_args(tp), _at(where, key)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, where, key)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _convert(arg, value, where, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{here}: expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{here}: expected one of {list(args)}, got {value!r}")
        return value
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{here}: expected a list, got {value!r}")
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            if len(value) != len(args):
                raise ConfigError(f"{here}: expected {len(args)} items, got {len(value)}")
            return tuple(_convert(a, v, where, f"{key}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
        item = args[0] if args else Any
        out = [_convert(item, v, where, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(out) if origin is tuple else out
    if tp is Any:
        return value
    if tp is float:
        return _to_float(value, here)
    if tp in (bool, int, str):
        if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
            raise ConfigError(f"{here}: expected {tp.__name__}, got {type(value).__name__} {value!r}")
        return value
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{here}: expected a mapping, got {value!r}")
        return dict(value)
    raise ConfigError(f"{here}: unsupported field type {tp}")


def from_dict(cls, data: Any, where: str, key: str = ""):
    """Build dataclass `cls` from a mapping, strictly: unknown keys and wrong types raise ConfigError. `where`: the
    file (or what stands for it); `key`: the dotted path of this mapping in it ("" at the top)."""
    here = _at(where, key)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{here}: expected a mapping, got {type(data).__name__} {data!r}")
    hints = typing.get_type_hints(cls)
    names = public_fields(cls)
    for k in data:
        if k not in names:
            raise ConfigError(f"{here}: unknown key {k!r} (known: {', '.join(names)})")
    kwargs = {k: _convert(hints[k], v, where, f"{key}.{k}" if key else k) for k, v in data.items()}
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{here}: {e}") from e


def check_key(root, item: str, parts: list[str], value) -> None:
    """Walk `root`'s dataclasses along `parts`; ConfigError (naming the --set item) for an unknown key or a value of
    the wrong type. A section given whole (a mapping) is left to from_dict with the rest of the config."""
    cls = root
    for i, part in enumerate(parts):
        if not dataclasses.is_dataclass(cls):
            raise ConfigError(f"--set {item}: {'.'.join(parts[:i])} is not a section")
        names = public_fields(cls)
        if part not in names:
            raise ConfigError(f"--set {item}: unknown key {part!r} (known: {', '.join(names)})")
        cls = typing.get_type_hints(cls)[part]
    if not dataclasses.is_dataclass(cls):
        _convert(cls, value, f"--set {item}", "")
    elif not isinstance(value, dict):
        raise ConfigError(f"--set {item}: {'.'.join(parts)} is a section: set one of its keys, e.g. "
                          f"{'.'.join(parts)}.{dataclasses.fields(cls)[0].name}=...")
