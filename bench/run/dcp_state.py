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
tensor (`rank{r}/skeleton`): every DCP item is a tensor, read with
`torch.load(weights_only=True)`; DCP's own `.metadata` is a pickle, read first with only
its classes (`Reader`), so loading a received checkpoint runs nothing. Each skeleton names
its rank, step and run key (`identity`), and `check` (the launcher, before a resume changes
anything) and `load` refuse a part copied or swapped between ranks, checkpoints or runs,
and a torn or corrupt file, naming it.

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
import pickle
import shutil
import warnings
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

# ------------------------------------------------------------------ where on disk
# (the names: bench/run/records.py RunDir.state_dir, state_dirs, STATE_COMPLETE)


def marker(path: Path) -> dict | None:
    """A checkpoint directory's complete.json, or None when it has none (a save that did not
    finish). ValueError naming the file when it is there but not one rank 0 wrote (not a
    JSON object with an integer step and world size, or no DCP `.metadata` beside it)."""
    file = path / RunDir.STATE_COMPLETE
    try:
        text = file.read_text()
    except FileNotFoundError:
        return None
    except OSError as err:
        raise ValueError(f"checkpoint {file} cannot be read ({err.strerror})") from None
    try:
        info = json.loads(text)
    except ValueError:
        info = None
    if not (isinstance(info, dict) and all(type(info.get(k)) is int and info[k] >= 0
                                           for k in ("step", "world_size"))):
        raise ValueError(f"checkpoint {file} is corrupt (not the JSON object with the step "
                         "and world size that rank 0 writes once every rank saved)")
    if not (path / ".metadata").is_file():
        raise ValueError(f"checkpoint {path} has a {RunDir.STATE_COMPLETE} but no .metadata: "
                         "its torch.distributed.checkpoint files are incomplete")
    return info


def latest(run: RunDir) -> tuple[Path, dict] | None:
    """The complete checkpoint of the highest step, with its complete.json; None if none."""
    for _, path in reversed(run.state_dirs()):
        info = marker(path)
        if info is not None:
            return path, info
    return None


def remove_except(run: RunDir, keep: Path | None) -> None:
    """Remove every state-stepN directory but `keep` (None: all of them); complete.json
    first, so that one removed halfway (a crash) reads as unfinished, not as corrupt."""
    for _, path in run.state_dirs():
        if path != keep:
            (path / RunDir.STATE_COMPLETE).unlink(missing_ok=True)
            shutil.rmtree(path, ignore_errors=True)


# ------------------------------------------------------------------ reading safely


_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "TensorProperties",
        "ChunkStorageMetadata", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"}, "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"}}
"""What DCP's `.metadata` pickle may name (besides torch's dtypes): its own records."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if name in _METADATA_GLOBALS.get(module, ()) or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}")


class Reader(FileSystemReader):
    """DCP's FileSystemReader, except that `.metadata` (a pickle) is first read with only
    the classes DCP's metadata are made of: run directories travel (tarballs, shared
    filesystems), and a crafted .metadata naming any other object would run code when
    unpickled; it is refused (pickle.UnpicklingError), never run. The tensors themselves
    DCP reads with `torch.load(weights_only=True)`."""

    def read_metadata(self, *args, **kwargs):
        with open(Path(self.path) / ".metadata", "rb") as file:
            _MetadataUnpickler(file).load()
        return super().read_metadata(*args, **kwargs)


def metadata_of(path: Path):
    """The checkpoint's DCP metadata, read safely (`Reader`); ValueError naming the file
    when it is crafted, corrupt or truncated."""
    try:
        return Reader(path).read_metadata()
    except pickle.UnpicklingError as err:
        if "it names" not in str(err):
            raise ValueError(f"checkpoint {path / '.metadata'} is corrupt or truncated "
                             f"({err})") from None
        raise ValueError(f"checkpoint {path / '.metadata'} holds objects other than a "
                         f"checkpoint's metadata ({err}; not loaded: loading it could run "
                         "code); it was not written by commbench") from None
    except Exception as err:  # EOFError, a torn pickle, I/O
        raise ValueError(f"checkpoint {path / '.metadata'} is corrupt or truncated "
                         f"({type(err).__name__}: {err})") from None


def check(path: Path, info: dict, world_size: int) -> None:
    """What the launcher checks before a resume changes anything (cheap: no tensor but the
    skeletons is read): the metadata load safely, every stored item lies within its file,
    and the skeleton of every saved rank this world reads is that rank's of this step and
    run (`skeleton`). ValueError naming the file otherwise."""
    metadata = metadata_of(path)
    sizes: dict[str, int] = {}
    for item in metadata.storage_data.values():
        file = path / item.relative_path
        if item.relative_path not in sizes:
            sizes[item.relative_path] = file.stat().st_size if file.is_file() else -1
        if item.offset + item.length > sizes[item.relative_path]:
            raise ValueError(f"checkpoint {file} is " + (
                "missing" if sizes[item.relative_path] < 0 else "truncated") +
                f" (its metadata place an item at bytes {item.offset}-"
                f"{item.offset + item.length})")
    saved = int(info["world_size"])
    for source in sorted({r if r < saved else 0 for r in range(world_size)}):
        skeleton(path, info, source, metadata)


def _file_of(metadata, key: str) -> str:
    return next((item.relative_path for index, item in metadata.storage_data.items()
                 if index.fqn == key), ".metadata")


def skeleton(path: Path, info: dict, source: int, metadata, group=None,
             no_dist: bool = True) -> dict:
    """Saved rank `source`'s skeleton (the JSON tree of its state; a collective on `group`
    unless `no_dist`), checked to be that rank's, of the step and run complete.json names
    (a file copied from another checkpoint, run or rank is refused). ValueError naming the
    file otherwise."""
    key = f"rank{source}/skeleton"
    meta = metadata.state_dict_metadata.get(key)
    if meta is None or not hasattr(meta, "size"):
        raise ValueError(f"checkpoint {path} holds no {key} (rank {source}'s): not a "
                         "commbench state, or not one of this world")
    file = path / _file_of(metadata, key)
    blob = {key: torch.empty(meta.size, dtype=torch.uint8)}
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(blob, storage_reader=Reader(path), process_group=group, no_dist=no_dist)
        tree = json.loads(bytes(blob[key].numpy()).decode())
    except Exception as err:
        reason = str(err).split(". ")[0].splitlines()[0] if str(err) else ""
        raise ValueError(f"checkpoint {file} is corrupt or truncated ({type(err).__name__}"
                         f": {reason[:300]})") from None
    mine = tree.get("identity") if isinstance(tree, dict) else None
    if not isinstance(tree, dict) or "strategy" not in tree or "own" not in tree:
        raise ValueError(f"checkpoint {file}: {key} is not a commbench state's skeleton")
    if isinstance(mine, dict):  # saved before skeletons carried one: not judged
        wanted = {"rank": source, "step": info.get("step"), "run": info.get("run")}
        if {k: mine.get(k) for k in wanted} != wanted:
            raise ValueError(
                f"checkpoint {file} holds rank {mine.get('rank')}'s state of step "
                f"{mine.get('step')} of run {mine.get('run')}, not rank {source}'s of step "
                f"{info.get('step')} of run {info.get('run')} ({RunDir.STATE_COMPLETE}): a "
                "file copied or swapped between ranks, checkpoints or runs")
    return tree


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
    named = strategy.state_scopes()
    own = f"rank{dist.get_rank()}"
    return {key: named.get(key, own) for key in state}


def replicated(scopes: dict[str, str]) -> bool:
    return bool(scopes) and all(scope == "world" for scope in scopes.values())


# ------------------------------------------------------------------ the tree as tensors


def _host(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` on the host as DCP writes it: a copy only where the host tensor is a view
    into a larger storage (whose whole storage would be written) or not contiguous. A
    CPU run's state is not copied: a copy of every tensor raised a CPU rank's peak by a
    whole state (PipeDream-2BW's measured/planned peak went from 1.33 to 1.6)."""
    host = tensor.detach().cpu()
    whole = (host.is_contiguous() and host.storage_offset() == 0
             and host.untyped_storage().nbytes() == host.numel() * host.element_size())
    return host if whole else host.clone(memory_format=torch.contiguous_format)


def flatten(value: Any, path: str, leaves: dict[str, torch.Tensor]) -> Any:
    """`value` as a JSON tree whose tensors are moved into `leaves` under `path`-based keys."""
    if isinstance(value, torch.Tensor):
        if path in leaves:
            raise ValueError(f"checkpoint: two values map to the key {path!r}")
        if isinstance(value, DTensor):
            leaves[path] = _host(value.to_local())
            return {"t": path, "dt": {"shape": list(value.shape),
                                      "stride": list(value.stride()),
                                      "placements": [_placement(p) for p in value.placements]}}
        leaves[path] = _host(value)
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
            "own": flatten(own, f"rank{rank}/own", leaves),
            "identity": {"rank": rank, "step": step, "run": identity.get("run")}}
    leaves[f"rank{rank}/skeleton"] = torch.frombuffer(
        bytearray(json.dumps(tree).encode()), dtype=torch.uint8)
    path = run.state_dir(step)
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
        write_text(path / RunDir.STATE_COMPLETE, json.dumps(info, indent=1) + "\n")
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
    try:
        full = metadata_of(path)
        tree = skeleton(path, info, source, full, group, no_dist=False)
    except ValueError as err:
        raise RuntimeError(f"resume: {err}") from None
    metadata = full.state_dict_metadata
    wanted = [k for _, _, sub in tree["strategy"] for k in leaf_keys(sub)]
    wanted += leaf_keys(tree["own"])
    leaves = {}
    for k in wanted:
        meta = metadata.get(k)
        if meta is None or not hasattr(meta, "size"):
            raise RuntimeError(f"resume from {path}: its metadata lack {k} (truncated?)")
        leaves[k] = torch.empty(meta.size, dtype=meta.properties.dtype)
    try:
        dcp.load(leaves, storage_reader=Reader(path), process_group=group)
    except Exception as err:  # a torn or swapped .distcp file (a rank's own or another's)
        reason = str(err).split(". ")[0].splitlines()[0] if str(err) else ""
        raise RuntimeError(f"resume from {path}: its tensors cannot be read ({type(err).__name__}"
                           f": {reason[:300]}); nothing was loaded") from None
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


def read(path: Path, rank: int) -> dict[str, Any]:
    """What saved rank `rank` holds in the complete checkpoint at `path`, read in one
    process without a group (tests, inspection): {"strategy": its state_dict, "own": the
    RNG, ledger and loop state}. Unsharded states only (a DTensor needs its mesh: `load`)."""
    info = marker(path)
    if info is None:
        raise ValueError(f"checkpoint {path} is not complete (no {RunDir.STATE_COMPLETE})")
    metadata = metadata_of(path)
    tree = skeleton(path, info, rank, metadata)
    items = metadata.state_dict_metadata
    keys = [k for _, _, sub in tree["strategy"] for k in leaf_keys(sub)]
    leaves = {k: torch.empty(items[k].size, dtype=items[k].properties.dtype)
              for k in [*keys, *leaf_keys(tree["own"])]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(leaves, storage_reader=Reader(path), no_dist=True)
    return {"strategy": {key: unflatten(sub, leaves, None) for key, _, sub in tree["strategy"]},
            "own": unflatten(tree["own"], leaves, None)}
