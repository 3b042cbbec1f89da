"""Typed YAML: plain dataclasses read from YAML files and dotted `--set a.b=value` overrides.

The engine behind `commbench config show configs/ddp-tiny.yaml` and sweep specs; it knows
no commbench schema (that is bench/config/__init__.py). A dataclass field's type says what is
valid; the string literal under a field is its documentation. Every error is a
ValueError naming the dotted key, the value and what is valid; an unknown key suggests
the closest valid one. A field whose `metadata["parse"]` is set is read by that function
(`parse(value, path)`), e.g. a section whose class depends on a name inside it.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import math
import os
import re
import textwrap
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml


def fail(path: str, value: Any, valid: str) -> ValueError:
    """The one error shape: `KEY must be VALID, got VALUE`."""
    return ValueError(f"{path} must be {valid}, got {value!r}")


NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*\Z")
"""Names that become a folder or file name (run, sweep, variant, claim, scenario, a
tracker's run): no path separator, no leading dot, no whitespace or newline. Matched
whole (`check_name`: `re.fullmatch`; `$` with `re.match` would accept a trailing newline)."""
NAME_RULE = "letters, digits, '.', '_' or '-', not starting with '.' or '-'"


def is_name(value: Any) -> bool:
    """Whether `value` may name a folder or file (`NAME_RE`, matched whole)."""
    return isinstance(value, str) and NAME_RE.fullmatch(value) is not None


def check_name(path: str, value: Any, names: str = "a directory") -> str:
    """`value` when it may name a folder or file; else ValueError naming the key `path`,
    the value, the rule and what the name becomes (`names`)."""
    if not is_name(value):
        raise fail(path, value, f"{NAME_RULE} (it names {names})")
    return value


def unknown_key(key: Any, valid: list[str], path: str) -> ValueError:
    hint = difflib.get_close_matches(str(key), [str(v) for v in valid], n=1)
    maybe = f" (did you mean {hint[0]!r}?)" if hint else ""
    where = f"{path}.{key}" if path else str(key)
    return ValueError(f"unknown config key {where!r}{maybe}; valid keys: {list(valid)}")


def coerce(value: Any, tp: Any, path: str) -> Any:
    """`value` (as YAML read it) as type `tp`, or a ValueError naming `path`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for alternative in [a for a in args if a is not type(None)]:  # the first that fits
            try:
                return coerce(value, alternative, path)
            except ValueError as err:
                errors.append(str(err))
        raise ValueError(" Or: ".join(errors))
    if origin is Literal:
        if isinstance(value, list | dict) or value not in args:
            raise fail(path, value, f"one of {list(args)}")
        return value
    if origin is list or tp is list:
        if not isinstance(value, list):
            raise fail(path, value, "a list")
        return [coerce(v, args[0], f"{path}[{i}]") for i, v in enumerate(value)] if args \
            else list(value)
    if origin is tuple:
        if not isinstance(value, list | tuple) or len(value) != len(args):
            raise fail(path, value, f"a list of {len(args)} values")
        pairs = enumerate(zip(value, args, strict=True))
        return tuple(coerce(v, a, f"{path}[{i}]") for i, (v, a) in pairs)
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise fail(path, value, "a mapping")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        return from_mapping(tp, value, path)
    return _scalar(value, tp, path)


def _scalar(value: Any, tp: Any, path: str) -> Any:
    if tp is bool:
        if not isinstance(value, bool):
            raise fail(path, value, "true or false")
        return value
    if tp is int:
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if not isinstance(value, int) or isinstance(value, bool):
            raise fail(path, value, "an integer")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 4e-4 as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise fail(path, value, "a number")
        if not math.isfinite(value):
            raise fail(path, value, "a finite number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise fail(path, value, "a string")
        return value
    raise TypeError(f"{path}: unsupported config type {tp}")  # a bug in a config class


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    """The resolved annotations of a dataclass (evaluating them is most of a parse)."""
    return typing.get_type_hints(cls)


def from_mapping(cls: type, data: Any, path: str = "") -> Any:
    """An instance of dataclass `cls` from a mapping; unknown keys and bad values fail."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"{path or 'config'} must be a mapping of keys, got {data!r}")
    hints = _type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            raise unknown_key(key, list(fields), path)
    kwargs = {}
    for name, value in data.items():
        sub = f"{path}.{name}" if path else name
        parse = fields[name].metadata.get("parse")
        kwargs[name] = parse(value, sub) if parse else coerce(value, hints[name], sub)
    try:
        return cls(**kwargs)
    except ValueError as err:  # a __post_init__ check: make it name the section
        if path and not str(err).startswith(path):
            raise ValueError(f"{path}: {err}") from None
        raise


# -------------------------------------------------------------------------- overrides


def set_value(data: dict, key: str, value: Any) -> None:
    """Set the dotted `key` (e.g. strategy.inner_steps) in a raw config dict."""
    parts = key.strip().split(".")
    if not all(parts):
        raise ValueError(f"config key must be a dotted path like run.steps, got {key!r}")
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ValueError(f"config key {key!r}: {'.'.join(parts[: i + 1])} must be a "
                             f"section (a mapping of keys), got {child!r}")
        node = child
    node[parts[-1]] = value


def parse_assignment(assignment: str) -> tuple[str, Any]:
    """`a.b.c=value` as (dotted key, value parsed as YAML)."""
    if "=" not in assignment:
        raise ValueError(f"--set expects KEY=VALUE (e.g. run.steps=50), got {assignment!r}")
    key, raw = assignment.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as err:
        raise ValueError(f"--set {assignment!r}: the value is not valid YAML: {err}") from None
    return key.strip(), value


def set_override(data: dict, assignment: str) -> None:
    """Apply one `a.b.c=value` override to a raw config dict."""
    set_value(data, *parse_assignment(assignment))


# ------------------------------------------------------------------------------ files


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (YAML keeps the last)."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if isinstance(key, typing.Hashable) and key in seen:
                raise ValueError(f"line {line}: key {key!r} is given twice (first on line "
                                 f"{seen[key]}); keep one")
            if isinstance(key, typing.Hashable):
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


def load_yaml_mapping(path: str | os.PathLike, what: str = "config file") -> dict:
    """The top-level mapping of a YAML file; errors name the file (and the line)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{what} not found: {str(path)!r}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a text file (not UTF-8); a {what} is YAML") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as err:
        raise ValueError(f"{path}: not valid YAML: {err}") from None
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    if data is None:
        raise ValueError(f"{path}: the {what} is empty; it must be a mapping of sections "
                         "(e.g. `run: {steps: 50}`)")
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the top level must be a mapping of sections, got {data!r}")
    return data


# ------------------------------------------------------------------------------ output


def to_dict(obj: Any) -> dict:
    """A dataclass as plain YAML/JSON-ready data (tuples become lists)."""
    def plain(v):
        if isinstance(v, list | tuple):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v

    return plain(dataclasses.asdict(obj))


def without_keys(data: dict, keys: tuple[str, ...]) -> dict:
    """Remove dotted `keys` (a key or a whole section) from nested `data` in place; returns it.

    A key whose section is absent is skipped."""
    for key in keys:
        node: Any = data
        *parents, last = key.split(".")
        for p in parents:
            node = node.get(p) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(last, None)
    return data


def field_docs(cls: type) -> dict[str, str]:
    """The string literal under each dataclass field, keyed by field name."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body
        for node, nxt in zip(body, body[1:], strict=False):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def describe_sections(obj: Any) -> list[str]:
    """YAML lines of a dataclass of sections, each field followed by its doc as a comment."""
    lines = []
    for section in dataclasses.fields(obj):
        value = getattr(obj, section.name)
        docs = field_docs(type(value))
        lines.append(f"{section.name}:")
        plain = to_dict(value)
        for f in dataclasses.fields(value):
            rendered = yaml.safe_dump(plain[f.name], default_flow_style=True).strip()
            rendered = rendered.removesuffix("\n...").removesuffix("...").strip()
            doc = docs.get(f.name, "")
            lines.append(f"  {f.name}: {rendered}" + (f"  # {doc}" if doc else ""))
    return lines


def flatten(tree: dict, prefix: str = "", sep: str = ".") -> dict:
    """Nested mappings as {dotted key: leaf} (lists and scalars are leaves)."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}{sep}", sep))
        else:
            out[f"{prefix}{key}"] = value
    return out
