"""Sweep specs: a YAML file that expands into the resolved configs of a sweep's runs.

    commbench sweep configs/quickstart.yaml --dry-run     # the runs a spec expands into

The spec format is documented in bench/study/sweep/__init__.py. Parsing checks everything
before a run starts: unknown keys, empty or malformed axes, a key set in two places, zip
lists of different lengths, a missing base config, and every run's resolved config
(validated as `commbench run` would), and the what-if scenario the spec's `whatif:` key
names (its table goes into the sweep's report). Errors name the spec file, the key and
what is valid. Besides the keys listed there (`SPEC_KEYS`):

    whatif: ../whatif/streaming-diloco-paper.yaml   # optional: a what-if scenario, relative
                                                    # to this file; its table in the report
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.config import Config, config_hash, from_dict, load_raw, set_value
from bench.config.typed import (
    check_name,
    from_mapping,
    load_yaml_mapping,
    parse_assignment,
    unknown_key,
)
from bench.launch.executors import ExecutorSpec

SPEC_KEYS = ("name", "description", "base", "set", "grid", "zip", "seeds", "variants",
             "target_loss", "output_dir", "report_dir", "executor", "whatif")
MAX_RUNS = 10_000
"""Runs per sweep at most (seeds x grid points x variants): every run's config is built and
validated before anything starts, so a typo that multiplies the grid (10^6 runs) would
otherwise hang even a --dry-run."""


@dataclass
class SweepRun:
    """One run of a sweep: its resolved config and where it came from."""

    run_id: str
    """config_hash of the resolved config: the identity resume keys on."""
    variant: str
    seed: int
    point: dict[str, Any]
    """The grid and zip values of this run (dotted key -> value)."""
    overrides: dict[str, Any]
    """Every dotted override applied to the base (set, point, variant, seed)."""
    label: str
    """Variant name plus the grid point: the comparison group shown by the report."""
    config: Config

    @property
    def dir_name(self) -> str:
        return f"{self.config.run.name}-{self.run_id}"


@dataclass
class SweepSpec:
    name: str
    path: Path
    base: dict
    """The raw base config (file contents or the inline mapping)."""
    set: dict[str, Any]
    grid: dict[str, list]
    zip: list[dict[str, list]]
    seeds: list[int] | None
    variants: dict[str, dict[str, Any]]
    target_loss: float | None
    output_dir: Path
    report_dir: Path
    executor: ExecutorSpec
    description: str = ""
    whatif: Path | None = None
    """A what-if scenario (configs/whatif/*.yaml) whose table the sweep's report shows
    (`whatif:` in the spec, relative to the spec's folder; checked when the spec loads)."""
    runs: list[SweepRun] = field(default_factory=list)

    @property
    def sweep_dir(self) -> Path:
        return self.output_dir / self.name



# ------------------------------------------------------------------------------ spec


def _check_key(key: Any, where: str) -> str:
    if not isinstance(key, str) or not all(p.strip() for p in key.split(".")):
        raise ValueError(f"{where}: keys must be dotted config paths like run.steps, got {key!r}")
    return ".".join(p.strip() for p in key.split("."))


def _dotted_mapping(data: Any, where: str) -> dict[str, Any]:
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{where} must be a mapping of dotted keys to values, got {data!r}")
    return {_check_key(k, where): v for k, v in data.items()}


def _axes(data: Any, where: str) -> dict[str, list]:
    axes = _dotted_mapping(data, where)
    if not axes:
        raise ValueError(f"{where} is empty: give at least one axis (key: [values]) or remove it")
    for key, values in axes.items():
        if not isinstance(values, list):
            raise ValueError(f"{where}.{key} must be a list of values, got {values!r}")
        if not values:
            raise ValueError(f"{where}.{key} has no values: give at least one")
    return axes




def load_spec(path: str | os.PathLike, *, output_dir: str | os.PathLike | None = None,
              overrides: list[str] | tuple[str, ...] = ()) -> SweepSpec:
    """Read and check a sweep spec, and resolve every run's config (nothing is launched).

    `output_dir` replaces the spec's; `overrides` (`KEY=VALUE`, as `commbench run --set`)
    are set on every run, like the spec's `set`. Raises ValueError naming the spec, the
    key and what is valid.
    """
    path = Path(path)
    raw = load_yaml_mapping(path, "sweep spec")
    try:
        cli = dict(parse_assignment(a) for a in overrides)
        if output_dir is not None:
            raw["output_dir"] = str(output_dir)
        return _parse_spec(raw, path, cli)
    except ValueError as err:
        raise ValueError(f"sweep spec {str(path)!r}: {err}") from None


def _parse_spec(raw: dict, path: Path, cli: dict[str, Any]) -> SweepSpec:
    for key in raw:
        if key not in SPEC_KEYS:
            raise unknown_key(key, list(SPEC_KEYS), "")
    name = raw.get("name", path.stem)
    check_name("name", name, "the sweep's directory")

    base = raw.get("base")
    if base is None:
        base_data = {}
    elif isinstance(base, str):
        base_path = path.parent / base
        if not base_path.is_file():
            raise ValueError(f"base config {base!r} not found (looked for {str(base_path)!r}; "
                             "a path is relative to the spec's folder)")
        if base_path.resolve() == path.resolve():
            raise ValueError(f"base {base!r} is this sweep spec itself; give a run config "
                             "(e.g. configs/ddp-tiny.yaml) or an inline mapping")
        base_data = load_raw(base_path)
    elif isinstance(base, dict):
        base_data = copy.deepcopy(base)
    else:
        raise ValueError(f"base must be a config path or an inline mapping, got {base!r}")

    common = _dotted_mapping(raw.get("set"), "set")
    cli = _dotted_mapping(cli, "--set")
    grid = _axes(raw["grid"], "grid") if "grid" in raw else {}
    zip_raw = raw.get("zip")
    zip_groups = []
    if zip_raw is not None:
        groups = zip_raw if isinstance(zip_raw, list) else [zip_raw]
        if not groups:
            raise ValueError("zip is empty: give a mapping of key: [values] or remove it")
        for i, group in enumerate(groups):
            where = "zip" if len(groups) == 1 and not isinstance(zip_raw, list) else f"zip[{i}]"
            axes = _axes(group, where)
            lengths = {k: len(v) for k, v in axes.items()}
            if len(set(lengths.values())) > 1:
                raise ValueError(f"{where}: lists advanced together must have the same length, "
                                 f"got {lengths}")
            zip_groups.append(axes)

    seeds = raw.get("seeds")
    if seeds is not None:
        if (not isinstance(seeds, list) or not seeds
                or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds)):
            raise ValueError(f"seeds must be a non-empty list of integers, got {seeds!r}")
        if len(set(seeds)) != len(seeds):
            raise ValueError(f"seeds has duplicates: {seeds}")

    variants_raw = raw.get("variants")
    if variants_raw is None:
        variants = {}
    elif not isinstance(variants_raw, dict) or not variants_raw:
        raise ValueError("variants must be a non-empty mapping of name -> dotted overrides, "
                         f"got {variants_raw!r}")
    else:
        variants = {}
        for vname, overrides in variants_raw.items():
            check_name("variant name", vname, "the variant's run directories")
            variants[vname] = _dotted_mapping(overrides, f"variants.{vname}")

    common = {k: v for k, v in common.items() if k not in cli}  # the command line wins
    _check_axes_disjoint(common, cli, grid, zip_groups, variants, seeds)
    common.update(cli)

    target = raw.get("target_loss")
    if target is not None and (isinstance(target, bool) or not isinstance(target, int | float)
                               or not math.isfinite(target)):
        raise ValueError(f"target_loss must be a finite validation loss, got {target!r}")
    output_dir = raw.get("output_dir", "results")
    report_dir = raw.get("report_dir", str(Path("reports") / name))
    for key, value in (("output_dir", output_dir), ("report_dir", report_dir)):
        if not isinstance(value, str) or not value:
            raise ValueError(f"{key} must be a directory path, got {value!r}")
    description = raw.get("description", "")
    spec = SweepSpec(
        name=name, path=path, base=base_data, set=common, grid=grid, zip=zip_groups,
        seeds=seeds, variants=variants,
        target_loss=float(target) if target is not None else None,
        output_dir=Path(output_dir), report_dir=Path(report_dir),
        executor=_parse_executor(raw.get("executor")),
        description=str(description or ""),
        whatif=whatif_scenario(raw.get("whatif"), path),
    )
    spec.runs = expand(spec)
    return spec


def whatif_scenario(value: Any, path: Path) -> Path | None:
    """The spec's `whatif:` key: a what-if scenario file, relative to the spec's folder
    (as `base`), loaded and every method's run config built as `commbench whatif` would
    (bench/study/whatif/scenario.py); None when the key is absent. ValueError naming the
    key when the file is missing or the scenario invalid."""
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"whatif must be a what-if scenario path (e.g. "
                         f"../whatif/streaming-diloco-paper.yaml), got {value!r}")
    scenario_path = Path(os.path.normpath(path.parent / value))
    if not scenario_path.is_file():
        raise ValueError(f"whatif scenario {value!r} not found (looked for "
                         f"{str(scenario_path)!r}; a path is relative to the spec's folder)")
    from bench.study.whatif.scenario import load_scenario, method_config

    try:
        scenario = load_scenario(str(scenario_path))
        for name in scenario.methods:
            method_config(scenario, name)
    except ValueError as err:
        raise ValueError(f"whatif scenario {value!r}: {err}") from None
    return scenario_path


def _parse_executor(data: Any) -> ExecutorSpec:
    if isinstance(data, str):  # `executor: slurm` for {name: slurm}
        data = {"name": data}
    return from_mapping(ExecutorSpec, data, "executor")


def _check_axes_disjoint(common, cli, grid, zip_groups, variants, seeds) -> None:
    """A key set in two places is ambiguous: say which places."""
    sources: list[tuple[str, str]] = [(k, "set") for k in common]
    sources += [(k, "--set") for k in cli]
    sources += [(k, "grid") for k in grid]
    for i, group in enumerate(zip_groups):
        sources += [(k, f"zip[{i}]" if len(zip_groups) > 1 else "zip") for k in group]
    variant_keys = {k for overrides in variants.values() for k in overrides}
    sources += [(k, "variants") for k in sorted(variant_keys)]
    if seeds is not None:
        sources.append(("run.seed", "seeds"))
    for (k1, s1), (k2, s2) in itertools.combinations(sources, 2):
        if k1 == k2 or k1.startswith(k2 + ".") or k2.startswith(k1 + "."):
            same = f"{k1!r}" if k1 == k2 else f"{k1!r} and {k2!r}"
            raise ValueError(f"{same} is set twice: in {s1} and in {s2}; set each key in one place")


def _points(spec: SweepSpec) -> list[dict[str, Any]]:
    """Grid points: the cartesian product of the grid axes and the zip groups."""
    factors: list[list[dict[str, Any]]] = [
        [{key: value} for value in values] for key, values in spec.grid.items()
    ]
    for group in spec.zip:
        keys = list(group)
        rows = zip(*group.values(), strict=True)
        factors.append([dict(zip(keys, vals, strict=True)) for vals in rows])
    points = []
    for combo in itertools.product(*factors):
        point: dict[str, Any] = {}
        for part in combo:
            point.update(part)
        points.append(point)
    return points


def _short_keys(keys: list[str]) -> dict[str, str]:
    """Last component of each dotted key, or the full key where the short ones collide."""
    last = [k.rsplit(".", 1)[-1] for k in keys]
    return {k: s if last.count(s) == 1 else k for k, s in zip(keys, last, strict=True)}


def format_value(value: Any) -> str:
    return json.dumps(value) if isinstance(value, list | dict) else str(value)


def expand(spec: SweepSpec) -> list[SweepRun]:
    """Every run of the spec, seeds outermost so that a partial sweep is comparable early.
    ValueError when there would be more than MAX_RUNS (counted before any is built)."""
    counts = {"seeds": len(spec.seeds or [None]), "variants": len(spec.variants or [None])}
    counts.update({f"grid.{key}": len(values) for key, values in spec.grid.items()})
    counts.update({f"zip[{i}]": len(next(iter(group.values()), []))
                   for i, group in enumerate(spec.zip)})
    if math.prod(counts.values()) > MAX_RUNS:
        sizes = " x ".join(f"{n} ({where})" for where, n in counts.items() if n > 1)
        raise ValueError(f"the sweep has {math.prod(counts.values())} runs ({sizes}); at most "
                         f"{MAX_RUNS} are allowed: shrink the grid or split the sweep")
    strategy = spec.base.get("strategy")
    base_strategy = strategy.get("name", "ddp") if isinstance(strategy, dict) else None
    variants = spec.variants or {None: {}}
    seeds = spec.seeds if spec.seeds is not None else [None]
    points = _points(spec)
    short = _short_keys(list(spec.grid) + [k for g in spec.zip for k in g])
    runs: list[SweepRun] = []
    seen: dict[str, str] = {}
    for seed in seeds:
        for point in points:
            for vname, voverrides in variants.items():
                data = copy.deepcopy(spec.base)
                changes = {**point, **voverrides}
                new_strategy = changes.get("strategy.name", spec.set.get("strategy.name"))
                if new_strategy not in (None, base_strategy) and base_strategy is not None:
                    data["strategy"] = {}  # the base's knobs belong to another algorithm
                overrides = {**spec.set, **({"run.name": vname} if vname is not None else {}),
                             **changes, **({"run.seed": seed} if seed is not None else {})}
                for key, value in overrides.items():
                    set_value(data, key, value)
                set_value(data, "run.output_dir", str(spec.sweep_dir))
                where = _describe(vname, point, seed)
                try:
                    cfg = from_dict(data)
                except ValueError as err:
                    raise ValueError(f"run {where}: {err}") from None
                run_id = config_hash(cfg)
                if run_id in seen:
                    raise ValueError(f"runs {seen[run_id]} and {where} resolve to the same "
                                     f"config ({run_id}); make the variants differ")
                seen[run_id] = where
                name = vname if vname is not None else cfg.run.name
                suffix = " ".join(f"{short[k]}={format_value(v)}" for k, v in point.items())
                runs.append(SweepRun(
                    run_id=run_id, variant=name, seed=cfg.run.seed, point=point,
                    overrides=overrides, label=f"{name} {suffix}".strip(), config=cfg,
                ))
    return runs


def _describe(variant: str | None, point: dict, seed: int | None) -> str:
    parts = [f"variant {variant!r}"] if variant is not None else []
    parts += [f"{k}={format_value(v)}" for k, v in point.items()]
    if seed is not None:
        parts.append(f"seed {seed}")
    return "(" + ", ".join(parts) + ")" if parts else "(base)"

