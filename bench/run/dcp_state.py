"""Resumable state through torch.distributed.checkpoint (DCP): what bench/run/checkpoint.py
saves at `checkpoint.every` and at a stop, and loads on `--resume`.

On disk: RUN_DIR/checkpoints/state-step{N}/ holds DCP's files (`.metadata`, one
`__R_0.distcp` per rank that writes) and `complete.json`, written by rank 0 after every
rank's save returned: the step, the world size, the layout (`layout_of`), whether the
strategy's state is replicated on every rank, the run's key. A directory without
`complete.json` is a save that did not finish (a stop, a crash, a full disk): never resumed
from, removed by the next resume or save. Older directories are removed only once a newer
one is complete, so a crash mid-save leaves the previous checkpoint resumable.

Written once per replicated value. Every tensor is stored under `SCOPE/PATH`, and DCP
writes a key that several ranks hold once (its deduplication), so the scope says which
ranks hold the same value: `world` (every rank: DDP's model and optimizer), `replica@R`
(a replica's ranks, R its first), `shard@J` (the J-th shard of every replica: DiLoCo's
global θ under FSDP), `rank{r}` (this rank's own: the default, and always the RNG, ledger,
loop state and metrics window). The strategy names its scopes (a `state_scopes()` method:
algorithms/ddp.py, algorithms/diloco.py); a key it does not name is its rank's own, which
is always correct, only not deduplicated. Sharded (FSDP2 DTensor) values are stored as
this rank's local shard, with the global shape and placements, rebuilt on the live mesh.

Everything else a state holds (numbers, strings, None, lists, tuples, dicts with any such
keys) is kept, with the tree's shape, in one JSON document per rank, stored as a uint8
tensor (`rank{r}/skeleton`): every DCP item is a tensor, so loading runs no pickle.

Resuming onto another layout: allowed when the saved and the current strategy state are
both replicated on every rank (`world` scope: DDP with backend torch, unsharded, one
stage) and the global batch (data.batch_size x data shards) is the same: the data
position is the step, and a step's samples are the global batch's whatever its split
(bench/data/batches.py), so the resumed run trains on the same token sequence. Rank r
takes saved rank r's own state (rank 0's when the world grew, with an empty ledger).
The summary's noise-robust projection (`projected_robust`) is then left out: its stretches
were recorded per rank of the saved world. Anything else is refused before any training,
naming both layouts.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.tensor import DTensor, Replicate, Shard

from algorithms.base import Strategy
from bench.run.files import write_text
from bench.run.records import RunDir

PREFIX = "state-step"
COMPLETE = "complete.json"


# ------------------------------------------------------------------ where on disk


def directory(run: RunDir, step: int) -> Path:
    """The checkpoint of `step` (a directory; complete when it holds complete.json)."""
    return run.checkpoints / f"{PREFIX}{step}"


def directories(run: RunDir) -> list[tuple[int, Path]]:
    """Every state-stepN directory, complete or not, by step."""
    if not run.checkpoints.is_dir():
        return []
    found = []
    for path in run.checkpoints.glob(f"{PREFIX}*"):
        suffix = path.name[len(PREFIX):]
        if path.is_dir() and suffix.isdigit():
            found.append((int(suffix), path))
    return sorted(found)


def marker(path: Path) -> dict | None:
    """A checkpoint directory's complete.json, or None (a save that did not finish)."""
    try:
        info = json.loads((path / COMPLETE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(info, dict) or not (path / ".metadata").exists():
        return None
    return info


def latest(run: RunDir) -> tuple[Path, dict] | None:
    """The complete checkpoint of the highest step, with its complete.json; None if none."""
    for _, path in reversed(directories(run)):
        info = marker(path)
        if info is not None:
            return path, info
    return None


def remove_except(run: RunDir, keep: Path | None) -> None:
    """Remove every state-stepN directory but `keep` (None: all of them)."""
    for _, path in directories(run):
        if path != keep:
            shutil.rmtree(path, ignore_errors=True)


# ------------------------------------------------------------------ layouts


def layout_of(strategy: Strategy) -> dict[str, Any]:
    """What a checkpoint's state is laid out for: the strategy, world, replica groups,
    stages, sharding and the global batch (rank batch x data shards)."""
    setup = strategy.setup
    return {"strategy": type(strategy).__name__, "world_size": dist.get_world_size(),
            "group_size": setup.group_size, "num_stages": setup.num_stages,
            "shard": setup.shard,
            "global_batch": setup.rank_batch_size * strategy.data_shard()[1]}


def describe(layout: dict) -> str:
    return (f"{layout.get('strategy')} on {layout.get('world_size')} ranks (groups of "
            f"{layout.get('group_size')}, {layout.get('num_stages')} stage(s), shard "
            f"{layout.get('shard')}, global batch {layout.get('global_batch')})")


def layout_problem(saved: dict, now: dict, saved_replicated: bool,
                   now_replicated: bool) -> str | None:
    """Why a checkpoint of layout `saved` cannot resume onto `now`, or None when it can."""
    if saved == now:
        return None
    head = f"the checkpoint was written by {describe(saved)}; this run is {describe(now)}: "
    if saved.get("strategy") != now.get("strategy"):
        return head + "another strategy"
    if not (saved_replicated and now_replicated):
        return head + ("only a strategy whose whole state is replicated on every rank (DDP "
                       "with backend torch, parallel.shard none) resumes onto another layout; "
                       "this one's state is per replica, shard or rank")
    for key in ("num_stages", "shard"):
        if saved.get(key) != now.get(key):
            return head + f"{key} differs"
    if saved.get("global_batch") != now.get("global_batch"):
        return head + ("the global batch differs: the data position is the step, so keep "
                       "data.batch_size x world size (set data.batch_size to "
                       f"{saved.get('global_batch')} / world size)")
    return None


def scopes_of(strategy: Strategy, state: dict) -> dict[str, str]:
    """Top-level state key -> scope: the strategy's `state_scopes`, else this rank's own."""
    named = strategy.state_scopes() if hasattr(strategy, "state_scopes") else {}
    own = f"rank{dist.get_rank()}"
    return {key: named.get(key, own) for key in state}


def replicated(scopes: dict[str, str]) -> bool:
    return bool(scopes) and all(scope == "world" for scope in scopes.values())


# ------------------------------------------------------------------ the tree as tensors


def flatten(value: Any, path: str, leaves: dict[str, torch.Tensor]) -> Any:
    """`value` as a JSON tree whose tensors are moved into `leaves` under `path`-based keys."""
    if isinstance(value, torch.Tensor):
        if path in leaves:
            raise ValueError(f"checkpoint: two values map to the key {path!r}")
        if isinstance(value, DTensor):
            leaves[path] = value.to_local().detach().cpu().clone()
            return {"t": path, "dt": {"shape": list(value.shape),
                                      "stride": list(value.stride()),
                                      "placements": [_placement(p) for p in value.placements]}}
        leaves[path] = value.detach().cpu().clone()
        return {"t": path, "device": str(value.device)}
    if isinstance(value, dict):
        return {"d": [[flatten(k, "", {}), flatten(v, f"{path}.{k}", leaves)]
                      for k, v in value.items()]}
    if isinstance(value, (list, tuple)):
        items = [flatten(v, f"{path}.{i}", leaves) for i, v in enumerate(value)]
        return {"l" if isinstance(value, list) else "u": items}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"v": value}
    raise TypeError(f"checkpoint: {path or 'a key'} holds a {type(value).__name__}; a state "
                    "holds tensors, numbers, strings, None, lists, tuples and dicts")


def unflatten(tree: Any, leaves: dict[str, torch.Tensor], mesh) -> Any:
    """The value `flatten` made `tree` of, its tensors taken from `leaves`."""
    if "t" in tree:
        tensor = leaves[tree["t"]]
        if "dt" in tree:
            spec = tree["dt"]
            if mesh is None:
                raise RuntimeError(f"resume: {tree['t']} was sharded (a DTensor), and this "
                                   "run's strategy holds no sharded state")
            return DTensor.from_local(tensor.to(mesh.device_type), mesh,
                                      [_placement_of(p) for p in spec["placements"]],
                                      run_check=False, shape=torch.Size(spec["shape"]),
                                      stride=tuple(spec["stride"]))
        return tensor.to(tree.get("device", "cpu"))
    if "d" in tree:
        return {_key(unflatten(k, leaves, mesh)): unflatten(v, leaves, mesh)
                for k, v in tree["d"]}
    if "l" in tree:
        return [unflatten(v, leaves, mesh) for v in tree["l"]]
    if "u" in tree:
        return tuple(unflatten(v, leaves, mesh) for v in tree["u"])
    return tree["v"]


def _key(value):
    return tuple(value) if isinstance(value, list) else value


def _placement(p) -> list:
    if isinstance(p, Shard):
        return ["S", p.dim]
    if isinstance(p, Replicate):
        return ["R"]
    raise TypeError(f"checkpoint: a DTensor placement {p!r} (only Shard and Replicate)")


def _placement_of(spec: list):
    return Shard(spec[1]) if spec[0] == "S" else Replicate()


def leaf_keys(tree: Any) -> list[str]:
    if "t" in tree:
        return [tree["t"]]
    children = ([v for pair in tree["d"] for v in pair] if "d" in tree else
                tree.get("l", tree.get("u", [])))
    return [key for child in children for key in leaf_keys(child)]


def _mesh_of(state: Any):
    """The device mesh of the first DTensor in a live state (None: nothing sharded)."""
    if isinstance(state, DTensor):
        return state.device_mesh
    values = state.values() if isinstance(state, dict) else (
        state if isinstance(state, (list, tuple)) else ())
    for value in values:
        mesh = _mesh_of(value)
        if mesh is not None:
            return mesh
    return None


# ------------------------------------------------------------------ save and load


def save(run: RunDir, rank: int, step: int, strategy: Strategy, state: dict,
         own: dict[str, Any], identity: dict, group=None) -> None:
    """Save the strategy's `state` (its `state_dict()`) and this rank's `own` (RNG, ledger,
    loop) at `step` as a DCP checkpoint (a collective on `group`); returns when it is
    complete on disk."""
    scopes = scopes_of(strategy, state)
    leaves: dict[str, torch.Tensor] = {}
    tree = {"strategy": [[key, scopes[key], flatten(value, f"{scopes[key]}/strategy.{key}",
                                                    leaves)]
                         for key, value in state.items()],
            "own": flatten(own, f"rank{rank}/own", leaves)}
    leaves[f"rank{rank}/skeleton"] = torch.frombuffer(
        bytearray(json.dumps(tree).encode()), dtype=torch.uint8)
    path = directory(run, step)
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)  # an unfinished save of the same step
        path.mkdir(parents=True)
    dist.barrier(group=group)
    dcp.save(leaves, storage_writer=FileSystemWriter(path, thread_count=1),
             process_group=group)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, replicated(scopes), group=group)
    if rank == 0:
        info = {"step": step, "world_size": dist.get_world_size(), "layout": layout_of(strategy),
                "replicated": all(everyone), **identity}
        write_text(path / COMPLETE, json.dumps(info, indent=1) + "\n")
        remove_except(run, path)  # the older checkpoints, now that this one is complete
        for stale in run.state_files():  # per-rank files of an older format
            stale.unlink()
    dist.barrier(group=group)


def load(path: Path, info: dict, rank: int, strategy: Strategy, group=None) -> dict[str, Any]:
    """Load the checkpoint at `path` (complete.json `info`) into `strategy`; returns this
    rank's own part (`save`'s `own`; no "ledger" on a rank the saved world did not have).
    A collective on `group`. RuntimeError, before anything is loaded, when the checkpoint's
    layout cannot resume onto this run's (`layout_problem`)."""
    live = strategy.state_dict()
    now = layout_of(strategy)
    problem = layout_problem(info.get("layout", {}), now, bool(info.get("replicated")),
                             replicated(scopes_of(strategy, live)))
    if problem:
        raise RuntimeError(f"resume from {path}: {problem}")
    saved_world = int(info["world_size"])
    source = rank if rank < saved_world else 0
    reader = FileSystemReader(path)
    metadata = reader.read_metadata().state_dict_metadata
    key = f"rank{source}/skeleton"
    if key not in metadata:
        raise RuntimeError(f"resume from {path}: it holds no {key}: not a commbench state")
    blob = {key: torch.empty(metadata[key].size, dtype=torch.uint8)}
    dcp.load(blob, storage_reader=reader, process_group=group)
    tree = json.loads(bytes(blob[key].numpy()).decode())
    wanted = [k for _, _, sub in tree["strategy"] for k in leaf_keys(sub)]
    wanted += leaf_keys(tree["own"])
    leaves = {}
    for k in wanted:
        meta = metadata.get(k)
        if meta is None or not hasattr(meta, "size"):
            raise RuntimeError(f"resume from {path}: its metadata lack {k} (truncated?)")
        leaves[k] = torch.empty(meta.size, dtype=meta.properties.dtype)
    dcp.load(leaves, storage_reader=FileSystemReader(path), process_group=group)
    mesh = _mesh_of(live)
    del live
    strategy.load_state_dict({key: unflatten(sub, leaves, mesh)
                              for key, _, sub in tree["strategy"]})
    own = unflatten(tree["own"], leaves, None)
    if rank >= saved_world:
        own.pop("ledger", None)  # this rank sent nothing before the resume
    loop = own.get("loop")
    if saved_world != dist.get_world_size() and isinstance(loop, dict):
        # the robust projection's stretches hold one entry per rank of the saved world
        # (bench/run/meter.py LoopState): not priceable on this one, so dropped
        loop.update(robust_stretches={}, robust_dropped=True)
    return own
