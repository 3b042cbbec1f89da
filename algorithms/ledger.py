"""What a communication op records: `CommRecord`, and the `CommLedger` of one rank's records.

    pytest tests/test_comm.py

The Communicator (algorithms/comm.py) appends one `CommRecord` per op to its ledger: the
loop's step, the current phase, the op, the group size, the peers, the logical bytes and
the measured wall time. The loop, the projections (bench/network/) and the what-if read
them; how the strategies' traffic is accounted is described in docs/algorithms.md.

Conventions (the meaning of each field is also documented on `CommRecord`):
- `nbytes` is always the LOGICAL payload of this rank, never wire bytes:
  `numel * element_size` of the tensor it all-reduces (the buffer, once, whatever the
  algorithm underneath), broadcasts, contributes to an all-gather, sends or receives;
  for `exchange` the sum of the tensors it sends (what it receives is not counted), with
  the per-peer split in `peer_nbytes`. What actually crosses the wire (a ring all-reduce
  sends `2(n-1)/n * nbytes` per rank, a gather `(n-1) * nbytes`, ...) is the network
  model's business (`bench/network/`), computed from these fields.
- `peers`: for point-to-point ops the other ranks (sorted); for collectives the group's
  ranks when the op runs on a subgroup, None when it runs on the whole world.
- `tier`: "intra" if every rank involved lives on this rank's node (node = rank //
  ranks_per_node), else "inter". `ranks_per_node=None` means one rank per node, i.e. every
  process stands for a machine (the emulation view).
- `seconds` is wall time, device-synchronised on CUDA before and after, and includes time
  spent waiting for slower peers and any emulation sleep.
- `barrier()` is not recorded: it carries no payload and the harness uses it for
  alignment; a straggler's wait shows up in the next real op's seconds anyway.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class CommRecord:
    """One communication op as seen by one rank (see the module docstring's conventions)."""

    step: int
    """The loop step during which the op ran (`Communicator.step`)."""
    phase: str
    """Tag of the traffic: train, inner, outer, gossip (training); eval, metrics (not)."""
    op: str
    """all_reduce, broadcast, all_gather, send, recv, exchange (or a DeepSpeed op name)."""
    group_size: int
    """Ranks taking part, this one included (p2p: peers + 1)."""
    peers: tuple[int, ...] | None
    """p2p: the other ranks (sorted); collectives: the subgroup's ranks, None = the world."""
    nbytes: int
    """Logical payload of this rank in bytes (never wire bytes; exchange: bytes sent)."""
    seconds: float
    """Measured wall seconds of the op (device-synchronised; DDP buckets: see ddp.py)."""
    tier: str
    """intra if every rank involved is on this rank's node, else inter."""
    lead_s: float | None = None
    """Seconds from this op's launch to the end of the compute it overlaps (DDP buckets:
    from the bucket being handed to the network until the last bucket was, i.e. the end
    of backward compute); None for ops that do not overlap compute. A network model
    exposes `max(0, modelled time - lead_s)` of an overlapped op."""
    peer_nbytes: tuple[int, ...] | None = None
    """exchange: bytes sent to each rank of `peers`, in the same order (0 for a peer only
    received from); sums to `nbytes`. None for every other op."""
    launch_step: int | None = None
    """Ops that span steps (`Communicator.launch`): the step at whose end the op was
    launched (`step` is the one that waited for it); the compute of the steps after the
    launch runs concurrently with it. None for ops launched and finished in one step."""
    tail_s: float | None = None
    """With `launch_step`: the seconds of the waiting step's compute that came after the
    wait (the outer step on the result), which the op did not overlap."""


class CommLedger:
    """One rank's communication: bounded aggregates of every record, and the records of
    the current window.

    `records` holds the records since the last `trim()` (the loop trims at the start of
    each step: a step's records are what its timing, projection and strategy read), or
    every record with `keep_records` (tests, debugging). The aggregates cover every record
    ever added and stay bounded whatever the run's length: per (phase, op, tier, group
    size) the count, bytes and seconds (`aggregate()`: comm.jsonl), and per (phase, peer)
    the bytes sent point to point (`bytes_sent`). Checkpoints carry `state_dict()`: the
    aggregates, not the records.
    """

    def __init__(self, keep_records: bool = False) -> None:
        self.records: list[CommRecord] = []
        self.keep_records = keep_records
        self._rows: dict[tuple, dict] = {}
        self._sent: dict[tuple[str, int], int] = {}

    def __len__(self) -> int:
        return len(self.records)

    def add(self, record: CommRecord) -> None:
        self.records.append(record)
        key = (record.phase, record.op, record.tier, record.group_size)
        row = self._rows.get(key)
        if row is None:
            row = self._rows[key] = dict(phase=record.phase, op=record.op, tier=record.tier,
                                         group_size=record.group_size, count=0, bytes=0,
                                         seconds=0.0)
        row["count"] += 1
        row["bytes"] += record.nbytes
        row["seconds"] += record.seconds
        if record.op in ("send", "exchange") and record.peers:
            sizes = record.peer_nbytes or (record.nbytes,) * len(record.peers)
            for peer, nbytes in zip(record.peers, sizes, strict=True):
                self._sent[record.phase, peer] = self._sent.get((record.phase, peer), 0) + nbytes

    def trim(self) -> None:
        """Drop the records held (their aggregates stay), unless `keep_records`."""
        if not self.keep_records:
            self.records = []

    def totals(self, phases: Iterable[str] | None = None, start: int = 0) -> tuple[int, float]:
        """(bytes, seconds) summed over records from `start`, optionally only these phases."""
        keep = None if phases is None else set(phases)
        nbytes, seconds = 0, 0.0
        for r in self.records[start:]:
            if keep is None or r.phase in keep:
                nbytes += r.nbytes
                seconds += r.seconds
        return nbytes, seconds

    def aggregate(self) -> list[dict]:
        """Rows grouped by (phase, op, tier, group_size), in order of first appearance,
        over every record ever added."""
        return [dict(row) for row in self._rows.values()]

    def bytes_sent(self, phase: str) -> dict[int, int]:
        """Peer -> bytes this rank sent it by `send` and `exchange` in `phase`, all run."""
        return {peer: n for (p, peer), n in self._sent.items() if p == phase}

    def state_dict(self) -> dict:
        return {"rows": self.aggregate(), "sent": dict(self._sent)}

    def load_state_dict(self, state: dict | list) -> None:
        """Restore the aggregates (a list: an older checkpoint's records, re-added)."""
        if isinstance(state, list):
            for record in state:
                self.add(record)
            self.trim()
            return
        self._rows = {(r["phase"], r["op"], r["tier"], r["group_size"]): dict(r)
                      for r in state["rows"]}
        self._sent = dict(state["sent"])
