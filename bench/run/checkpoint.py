"""Checkpoints of a run: its resumable state, and the final evaluation model.

    commbench run configs/ddp-tiny.yaml --set checkpoint.every=50   # checkpoints/state-step50/
    commbench run --resume RUN_DIR                                  # continue from it

The state (every rank's strategy `state_dict`, loop state, torch RNG and CommLedger
aggregates) is saved at one step through torch.distributed.checkpoint, in
checkpoints/state-step{N}/ (bench/run/dcp_state.py: the format, what is written once, which
layouts resume onto which); by default 4 times per run (`checkpoint.every: null` = every
run.steps // 4 steps). A checkpoint is complete when rank 0 has written its complete.json,
after every rank saved; only then are the older ones removed, and a directory without it is
never resumed from. Before a resume touches any record, the launcher checks with
`verify_states` that a complete checkpoint exists (per-rank state-rankN.pt files, the
format before DCP, are still read: every rank's must load and hold the same step). On
resume each rank restores its state, and rank 0 drops the metrics rows logged after the
checkpoint (the steps are trained again). A run that starts from step 0 (new, or resumed
without a checkpoint) starts with no metrics rows and no stale checkpoints, so no step is
ever recorded twice.
checkpoints/final.pt holds the eval model's weights, its GPT config and tokenizer name:
what `commbench eval` and `export` load. Rank 0 receives the ranks' parts one at a time
(never every part on every rank: an all-gather of the whole model runs out of memory on
large presets) and writes the file.

The ranks wait for each other around checkpoint writes (a multi-GB state or final.pt can
take minutes) on their own gloo group, `barrier_group`, whose timeout is
`checkpoint.timeout_s`, not on the training group, whose `parallel.timeout_s` is meant to
catch a hung collective quickly. The torch RNG state is saved with the strategy's, and on
CUDA the device's generator too, so a resumed run draws the same dropout masks.
"""

from __future__ import annotations

import os
import pickle
import sys
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from algorithms.base import Strategy
from algorithms.ledger import CommLedger
from bench.run import dcp_state
from bench.run.records import RunDir

if TYPE_CHECKING:
    from bench.config import Config


def interval(cfg: Config) -> int:
    """Steps between resumable checkpoints; 0 = none (`checkpoint.every`, null = steps // 4)."""
    every = cfg.checkpoint.every
    return max(1, cfg.run.steps // 4) if every is None else every


def verify_states(run: RunDir, world_size: int) -> int | None:
    """The step every rank's state checkpoint holds, or None when there is none.

    Reads each file (memory-mapped: cheap for large states) and changes nothing. A rank
    may hold two files, its saved state and one being saved (a stop in the middle of a
    save): the latest step that every rank holds wins; the files of a first save that not
    every rank finished (a full disk) count as none. A missing, unreadable or truncated
    file, or ranks with no step in common, raise ValueError naming the file.

    A DCP checkpoint (bench/run/dcp_state.py) wins over per-rank files (an older format):
    its latest complete directory's step; one of another world size only when its state is
    replicated on every rank (else ValueError naming both). It must be this run's (its
    complete.json's run key), its metadata must load safely and its files hold every item,
    and the skeleton each rank will read must be that rank's of that step
    (`dcp_state.check`); else ValueError naming the file."""
    where = f"--resume {run.path}"
    try:
        found = dcp_state.latest(run)
    except ValueError as err:
        raise ValueError(f"{where}: {err}; delete that checkpoints/state-step* directory: the "
                         "run then resumes from an earlier checkpoint if one is left, else "
                         "restarts at step 0") from None
    if found is not None:
        path, info = found
        foreign = another_runs(run, path, info)
        if foreign:
            raise ValueError(f"{where}: {foreign}")
        saved = int(info.get("world_size", 0))
        if saved != world_size and not info.get("replicated"):
            raise ValueError(
                f"{where}: checkpoint {path} was written by "
                f"{dcp_state.describe(info.get('layout', {}))}, not {world_size} ranks; only a "
                "state replicated on every rank (DDP, backend torch, unsharded) resumes onto "
                "another world size")
        try:
            dcp_state.check(path, info, world_size)
        except ValueError as err:
            raise ValueError(f"{where}: {err}; delete {path}: the run then resumes from an "
                             "earlier checkpoint if one is left, else restarts at step 0") from None
        return int(info["step"])
    per_rank: list[dict[int, Path]] = []
    problems, seen = [], False
    for rank in range(world_size):
        held = {}
        for path in (run.state_checkpoint(rank), run.pending_state_checkpoint(rank)):
            if path.exists():
                seen = True
                try:
                    payload = load_payload(path, map_location="cpu", mmap=True)
                    problem = identity_problem(path, payload.get("identity"), run, rank,
                                               world_size)
                    if problem:
                        problems.append(problem)
                        continue
                    held[int(payload["step"])] = path
                except pickle.UnpicklingError:  # weights_only refused an object
                    problems.append(f"checkpoint {path} holds objects other than tensors and "
                                    "plain data (not loaded: loading them could run code); "
                                    "it was not written by commbench")
                except Exception as err:  # truncated zip, wrong content, I/O error
                    reason = str(err).split(". ")[0]  # torch adds paragraphs of advice
                    problems.append(f"checkpoint {path} is corrupt or truncated "
                                    f"({type(err).__name__}: {reason})")
        per_rank.append(held)
    if not seen:
        return None
    common = set.intersection(*(set(held) for held in per_rank))
    if common:
        return max(common)
    if not problems and not any(run.state_checkpoint(r).exists() for r in range(world_size)):
        return None  # the first save did not finish on every rank (a full disk): none saved
    if problems:
        raise ValueError(f"{where}: {problems[0]}; delete the run's checkpoints/state-rank* "
                         "files to restart it from step 0")
    missing = [str(run.state_checkpoint(r)) for r, held in enumerate(per_rank) if not held]
    if missing:
        raise ValueError(f"{where}: checkpoint {missing[0]} is missing (every rank of "
                         f"parallel.world_size {world_size} needs its state-rankN.pt)")
    listing = ", ".join(f"{p.name}: step {s}" for held in per_rank for s, p in held.items())
    raise ValueError(f"{where}: the ranks' checkpoints are at different steps ({listing}); "
                     "they must all be at one step")


def adopt_states(run: RunDir, world_size: int, step: int) -> None:
    """Make every rank's state-rankN.pt the one at `step` (after `verify_states`): a
    save that every rank finished is kept, one that some did not is dropped. A DCP
    checkpoint: the complete one at `step` is kept, every other state-stepN removed."""
    found = dcp_state.latest(run)
    if found is not None and int(found[1]["step"]) == step:
        dcp_state.remove_except(run, found[0])
        return
    for rank in range(world_size):
        pending = run.pending_state_checkpoint(rank)
        try:  # another node's launcher may adopt the same files at the same time
            if _saved_step(pending) == step:
                os.replace(pending, run.state_checkpoint(rank))
            else:
                pending.unlink()
        except FileNotFoundError:
            pass


def _saved_step(path) -> int:
    return int(load_payload(path, map_location="cpu", mmap=True)["step"])


def state_identity(run: RunDir, rank: int, world_size: int) -> dict[str, Any]:
    """What a state file belongs to: the run (its recorded config's identity without
    run.steps, which a resume may grow: `run_key`), the rank, the world size and the
    layout (strategy, replica groups, stages, sharding: part of the run key, spelled out
    for the messages)."""
    key, layout = run_key(run)
    return {"run": key, "rank": rank, "world_size": world_size, "layout": layout}


_RUN_KEYS: dict[tuple, tuple[str, str]] = {}


LAYOUT_KEYS = ("parallel.world_size", "parallel.group_size", "data.batch_size")
"""The identity keys a resume onto another layout may change (`layout_change_problem`)."""


def layout_change_problem(old: Config, new: Config) -> str | None:
    """Why a run recorded with config `old` cannot resume with `new`'s LAYOUT_KEYS (world
    size, replica groups, per-rank batch), or None when it can: only DDP with backend
    torch, unsharded, one stage (its whole state is replicated on every rank: written once,
    read by any world size, bench/run/dcp_state.py), keeping the global batch (the data
    position is the step; a step's samples are the global batch's, whatever its split).
    For the launcher's `check_resume`, before anything starts; the ranks check the
    checkpoint's own layout again when they load it."""
    def value(cfg, dotted):
        section, key = dotted.split(".")
        return getattr(getattr(cfg, section), key)

    changed = [k for k in LAYOUT_KEYS if value(old, k) != value(new, k)]
    if not changed:
        return None

    def words(cfg) -> str:
        p = cfg.parallel
        return (f"{cfg.strategy.name} on {p.world_size} ranks (parallel.group_size "
                f"{p.group_size}, data.batch_size {cfg.data.batch_size}: global batch "
                f"{cfg.data.batch_size * p.world_size})")

    head = (f"{', '.join(changed)} differ: the checkpoint was written by {words(old)}, this "
            f"resume asks {words(new)}; ")
    p = old.parallel
    if not (old.strategy.name == "ddp" and getattr(old.strategy, "backend", "torch") == "torch"
            and p.shard == "none" and p.num_stages == 1):
        return head + ("only DDP with strategy.backend torch, parallel.shard none and one "
                       "stage resumes onto another layout (its state is replicated on every "
                       "rank); this strategy's state is per replica, shard or rank")
    before = old.data.batch_size * p.world_size
    if new.data.batch_size * new.parallel.world_size != before:
        return head + (f"the global batch must stay {before} (the data position is the step): "
                       f"set data.batch_size to {before} / parallel.world_size")
    return None


def another_runs(run: RunDir, path, info: dict) -> str | None:
    """Why the complete checkpoint `path` (its complete.json `info`) is not `run`'s, or
    None: its run key (the config without the layout keys) is another run's."""
    key, words = run_key(run, without_layout=True)
    if key and info.get("run") and info["run"] != key:
        return (f"checkpoint {path} belongs to another run (run key {info['run']}: "
                f"{info.get('layout_words')}), not this run's ({key}: {words})")
    return None


def run_key(run: RunDir, without_layout: bool = False) -> tuple[str, str]:
    """(12 hex digits of the recorded config's identity minus run.steps, the layout in
    words) of the run at `run`; ("", "") without a readable config.yaml. `without_layout`:
    minus LAYOUT_KEYS too (a DCP checkpoint's key; its layout is checked on its own)."""
    import hashlib
    import json

    from bench.config import from_dict, identity_dict, load_raw

    try:
        stat = run.config.stat()
    except OSError:
        return "", ""
    cache = (str(run.config), stat.st_mtime_ns, stat.st_size, without_layout)
    if cache not in _RUN_KEYS:
        cfg = from_dict(load_raw(run.config))
        identity = identity_dict(cfg)
        identity.get("run", {}).pop("steps", None)
        for dotted in LAYOUT_KEYS if without_layout else ():
            section, key = dotted.split(".")
            identity.get(section, {}).pop(key, None)
        blob = json.dumps(identity, sort_keys=True, separators=(",", ":"), default=str)
        p = cfg.parallel
        layout = (f"{cfg.strategy.name}, world {p.world_size}, groups of {p.group_size}, "
                  f"{p.num_stages} stage{'s' * (p.num_stages != 1)}, "
                  f"shard {getattr(p, 'shard', None)}")
        _RUN_KEYS[cache] = (hashlib.sha256(blob.encode()).hexdigest()[:12], layout)
    return _RUN_KEYS[cache]


def identity_problem(path: Path, identity: Any, run: RunDir, rank: int,
                     world_size: int) -> str | None:
    """Why the state file at `path` is not rank `rank`'s of this run and layout, or None.
    A file without an identity (saved before state files carried one) is not judged."""
    if not isinstance(identity, dict):
        return None
    if identity.get("rank") != rank or identity.get("world_size") != world_size:
        return (f"checkpoint {path} holds rank {identity.get('rank')}'s state of a world of "
                f"{identity.get('world_size')}, not rank {rank}'s of {world_size}: a state "
                "file copied or swapped between ranks")
    key, layout = run_key(run)
    if key and identity.get("run") and identity["run"] != key:
        return (f"checkpoint {path} belongs to another run or layout (run key "
                f"{identity['run']}: {identity.get('layout')}), not this run's ({key}: "
                f"{layout})")
    return None


def load_payload(path, map_location=None, mmap: bool = False) -> dict:
    """A checkpoint file's content, loaded with `weights_only=True`: tensors and plain data
    only. Run directories travel (tarballs, shared filesystems): a pickle that names any
    other object would run code when loaded, so it is refused (pickle.UnpicklingError).
    Every checkpoint commbench writes holds tensors, numbers, strings, lists and dicts."""
    return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)


def barrier_group(timeout_s: float):
    """A gloo group of every rank with its own timeout (`checkpoint.timeout_s`), for the
    waits around checkpoint writes and the final model's transfer to rank 0 (CPU objects:
    no device memory). Collective: every rank creates it, at the same point."""
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


def rng_states(device: torch.device) -> dict[str, torch.Tensor]:
    """The random generators a step draws from: the CPU's and, on CUDA, the device's."""
    states = {"rng": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda_rng"] = torch.cuda.get_rng_state(device)
    return states


def set_rng_states(payload: dict, device: torch.device) -> None:
    torch.set_rng_state(payload["rng"])
    if device.type == "cuda" and "cuda_rng" in payload:
        torch.cuda.set_rng_state(payload["cuda_rng"], device)


def resume_requested() -> bool:
    """`commbench run --resume` sets COMMBENCH_RESUME=1 for the ranks."""
    return bool(os.environ.get("COMMBENCH_RESUME"))


def save_state(run: RunDir, rank: int, step: int, strategy: Strategy, ledger: CommLedger,
               loop_state: dict[str, Any], group=None) -> None:
    """Save the run's state after `step` steps as a DCP checkpoint (bench/run/dcp_state.py:
    a value replicated on several ranks is written once); returns when it is complete on
    disk (waiting on `group`, the `barrier_group`; None: the default group)."""
    try:
        state = strategy.state_dict()
    except NotImplementedError:
        raise NotImplementedError(f"strategy {type(strategy).__name__} cannot save its state "
                                  "(state_dict); set checkpoint.every=0") from None
    own = {"loop": loop_state, "ledger": ledger.state_dict(),
           **rng_states(strategy.comm.device)}
    key, words = run_key(run, without_layout=True)
    dcp_state.save(run, rank, step, strategy, state, own,
                   {"run": key, "layout_words": words}, group)


def save_periodic(run: RunDir, rank: int, step: int, strategy: Strategy, ledger: CommLedger,
                  loop_state: dict, cfg: Config, every: int, group=None) -> int:
    """`save_state` at a periodic checkpoint; returns the interval to keep using.

    A strategy that cannot save its state (NotImplementedError, the same on every rank)
    fails the run when `checkpoint.every` was asked for explicitly; under the default
    (null) the run goes on without checkpoints (returns 0) and says so."""
    try:
        save_state(run, rank, step, strategy, ledger, loop_state, group)
    except NotImplementedError as err:
        if cfg.checkpoint.every is not None:
            raise ValueError(f"checkpoint.every={every}: {err}") from None
        if rank == 0:
            print(f"warning: no checkpoints: {err}", file=sys.stderr)
        return 0
    return every


def save_at_stop(run: RunDir, rank: int, step: int, strategy: Strategy, ledger: CommLedger,
                 loop_state: dict, group=None) -> None:
    """`save_state` at the step a stop request agreed on (bench/run/stop.py), off the
    `checkpoint.every` grid; a strategy that cannot save stops without one (a resume then
    restarts at step 0, and says so)."""
    try:
        save_state(run, rank, step, strategy, ledger, loop_state, group)
    except NotImplementedError as err:
        if rank == 0:
            print(f"warning: stopping at step {step} without a checkpoint: {err}",
                  file=sys.stderr)


def load_state(run: RunDir, rank: int, strategy: Strategy,
               ledger: CommLedger, group=None) -> dict[str, Any] | None:
    """Restore this rank's saved state when resuming; the saved loop state, or None.

    A collective (on `group`, the `barrier_group`: loading a large state takes time).
    The latest complete DCP checkpoint (bench/run/dcp_state.py), else per-rank
    state-rankN.pt files (an older format). Without a checkpoint to resume from (a new
    run, or `--resume` of a run that saved none), rank 0 removes earlier metrics rows and
    checkpoints first: the run starts at step 0 with a clean record."""
    found = dcp_state.latest(run) if resume_requested() else None
    if not all_agree(found is not None, group):
        raise RuntimeError("resume: some ranks see a complete checkpoint under "
                           f"{run.checkpoints} and some do not (rank {rank}: "
                           f"{'found' if found else 'none'}): is the run directory shared?")
    if found is not None:
        path, info = found
        foreign = another_runs(run, path, info)
        if foreign:
            raise RuntimeError(f"resume: {foreign}")
        own = dcp_state.load(path, info, rank, strategy, group)
        set_rng_states(own, strategy.comm.device)
        if "ledger" in own:
            ledger.load_state_dict(own["ledger"])
        step = int(info["step"])
        if rank == 0:  # drop rows logged after the checkpoint; they will be redone
            run.write_metrics([r for r in run.read_metrics() if r["step"] <= step])
        dist.barrier(group=group)
        return own["loop"]
    return _load_rank_files(run, rank, strategy, ledger, group)


def _load_rank_files(run: RunDir, rank: int, strategy: Strategy,
                     ledger: CommLedger, group=None) -> dict[str, Any] | None:
    """`load_state` from per-rank state-rankN.pt files (the format before DCP)."""
    path = run.state_checkpoint(rank)
    found = resume_requested() and path.exists()
    if not all_agree(found, group):
        raise RuntimeError(f"resume: some ranks have a state checkpoint and some do not "
                           f"(rank {rank}: {path} {'exists' if found else 'missing'})")
    if not found:
        if rank == 0:
            run.write_metrics([])
            for stale in run.state_files():
                stale.unlink()
            dcp_state.remove_except(run, None)
        dist.barrier(group=group)
        return None
    try:
        payload = load_payload(path)
    except Exception as err:
        raise RuntimeError(f"resume: cannot load {path}: {type(err).__name__}: {err}") from err
    problem = identity_problem(path, payload.get("identity"), run, rank,
                               dist.get_world_size())
    steps = [None] * dist.get_world_size()
    dist.all_gather_object(steps, (payload["step"], problem), group=group)
    problems = [p for _, p in steps if p]
    if problems:
        raise RuntimeError(f"resume: {problems[0]}")
    steps = [s for s, _ in steps]
    if len(set(steps)) > 1:
        raise RuntimeError(f"resume: the ranks' checkpoints are at different steps {steps}")
    strategy.load_state_dict(payload["strategy"])
    set_rng_states(payload, strategy.comm.device)
    ledger.load_state_dict(payload["ledger"])
    step = payload["step"]
    if rank == 0:  # drop rows logged after the checkpoint; they will be redone
        rows = [r for r in run.read_metrics() if r["step"] <= step]
        run.write_metrics(rows)
    return payload["loop"]


def all_agree(flag: bool, group=None) -> bool:
    """Whether every rank passes the same flag (a collective)."""
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, bool(flag), group=group)
    return len(set(flags)) == 1


def save_eval_model(run: RunDir, rank: int, strategy: Strategy, gpt_config: dict,
                    tokenizer: str, step: int, group=None) -> None:
    """Rank 0 writes checkpoints/final.pt from every rank's `export_state()` (merged, the
    first rank's value of a key wins); every rank calls it (a collective on `group`, the
    `barrier_group`, and it returns once the file is written).

    Rank 0 receives the other ranks' parts one after another, so it holds the merged
    model and one part at a time; no other rank holds more than its own part."""
    with strategy.comm.phase("eval"):
        mine = {k: v.detach().cpu() for k, v in strategy.export_state().items()}
    if rank == 0:
        state: dict[str, torch.Tensor] = dict(mine)
        for src in range(1, dist.get_world_size()):
            part: list = [None]
            dist.recv_object_list(part, src=src, group=group)
            for key, value in part[0].items():
                state.setdefault(key, value)
        payload = {"model": state, "gpt_config": dict(gpt_config), "tokenizer": tokenizer,
                   "step": step}
        run.save_torch(payload, run.final_checkpoint)
    else:
        dist.send_object_list([mine], dst=0, group=group)
    dist.barrier(group=group)  # the others wait for the write here, not in a training op
