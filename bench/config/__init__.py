"""The commbench config: reading a run config, its overrides, and the run's identity.

bench/config: a part the training loop is built from, at the bottom of bench with data,
model, network, optim, memory and env. It owns the run config: its schema (schema.py),
the checks across fields (checks.py), the checks against the machine (preflight.py) and
the generic typed-YAML engine (typed.py); it imports algorithms and, inside its checks,
the parts it checks against (data, model, network, memory), never run, launch, study,
node or cli (tests/test_layers.py).

`commbench config show configs/ddp-tiny.yaml` prints the resolved tree with each
field's documentation. `load_config(path, overrides)` reads YAML, applies `--set
a.b=value` overrides, parses the sections into their dataclasses (bench/config/schema.py)
and validates them (bench/config/checks.py): everything fails here, before any process
starts, naming the key path, the value and what is valid. Reading YAML, overrides, types
and did-you-mean are the generic engine in bench/config/typed.py. The resolved config (minus
output paths) hashes to the run's identity (`config_hash`). Checks against the machine
that will train the run: bench/config/preflight.py.
"""

from __future__ import annotations

import hashlib
import json
import os

import yaml

from bench.config.checks import validate
from bench.config.schema import Config, DataConfig
from bench.config.typed import (  # noqa: F401  (re-exported: the public names of bench.config)
    NAME_RE,
    check_name,
    describe_sections,
    field_docs,
    from_mapping,
    load_yaml_mapping,
    parse_assignment,
    set_override,
    set_value,
    to_dict,
    without_keys,
)

# Not the run's identity: where things go, the checkpoint cadence (resume is bit-exact),
# and the tracking sinks (views of the records, written by the launcher: bench/study/tracking/).
NON_IDENTITY_KEYS = ("run.output_dir", "run.warmup_steps", "run.compute_clock",
                     "data.cache_dir", "launch",
                     "checkpoint", "tracking")


# ---------------------------------------------------------------------------- reading


def load_raw(path: str | os.PathLike) -> dict:
    """The raw mapping of a YAML config file (errors name the file and the line)."""
    return load_yaml_mapping(path, "config file")


def from_dict(data: dict) -> Config:
    _check_retired_keys(data)
    config = from_mapping(Config, data, "")
    validate(config)
    return config


def _check_retired_keys(data: dict) -> None:
    """Keys that were replaced: fail saying by what, and the value that means the same."""
    run = data.get("run")
    if isinstance(run, dict) and "val_batches" in run:
        batches = run["val_batches"]
        batch_size = (data.get("data") or {}).get("batch_size", DataConfig.batch_size)
        same = (f"run.val_sequences: {batches * batch_size} (val_batches {batches} x "
                f"data.batch_size {batch_size})"
                if isinstance(batches, int) and isinstance(batch_size, int) else
                "run.val_sequences: val_batches x data.batch_size")
        raise ValueError(
            f"run.val_batches ({batches!r}) was replaced by run.val_sequences, a number of "
            "validation windows that is the same for every batch size and layout, so that "
            f"validation losses compare; as many windows as before: {same} (spread over "
            "the whole validation split, where val_batches took its first windows)")


def apply_overrides(data: dict, overrides: list[str] | tuple[str, ...]) -> dict:
    """Apply `--set KEY=VALUE` overrides to a raw config in place.

    Switching `strategy.name` drops the strategy knobs of the file: they belong to
    another algorithm (as in sweeps); knobs given with --set are kept."""
    pairs = [parse_assignment(a) for a in overrides]
    new_name = dict(pairs).get("strategy.name")
    strategy = data.get("strategy")
    if isinstance(strategy, dict) and new_name is not None and \
            new_name != strategy.get("name", "ddp"):
        data["strategy"] = {}
    for key, value in pairs:
        set_value(data, key, value)
    return data


def load_config(path: str | os.PathLike | None, overrides: list[str] = ()) -> Config:
    """Read YAML (or start from defaults), apply `--set` overrides, parse and validate."""
    data = load_raw(path) if path else {}
    return from_dict(apply_overrides(data, overrides))


# ---------------------------------------------------------------------- serialisation


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


IDENTITY_DEFAULTS = {"optim.delay_profile": "uniform", "optim.delay_stages": None}
"""Keys added after runs were recorded: left out of the identity while at these defaults,
so that every config that does not use them keeps the hash (run ids, sweep resume, the
run key of checkpoints) it had before they existed. A new key goes here too."""


def identity_dict(cfg: Config) -> dict:
    data = without_keys(to_dict(cfg), NON_IDENTITY_KEYS)
    for key, default in IDENTITY_DEFAULTS.items():
        section, name = key.split(".")
        if name in data.get(section, {}) and data[section][name] == default:
            del data[section][name]
    return data


def config_hash(cfg: Config) -> str:
    """Stable 12-hex-digit identity of the computation a config describes."""
    blob = json.dumps(identity_dict(cfg), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def describe(cfg: Config) -> str:
    """The resolved config as YAML with each field's documentation as a comment."""
    return "\n".join([f"# identity: {config_hash(cfg)}", *describe_sections(cfg)]) + "\n"
