"""Network profiles and the alpha-beta cost model that turns CommRecords into seconds.

Exercised by `pytest tests/test_network.py`. bench/run/train.py uses `project` for the
projected step times in summary.json and `delay_policy` for `network.emulate=PROFILE`;
`commbench netprobe` (bench/node/netprobe.py) fits a profile of the user's own network.
The model and every formula: docs/network-model.md.

- profiles.py: `Tier`, `Profile`, the shipped bench/profiles.yaml, users' YAML files
  (`get_profile(name_or_path)`).
- costs.py: the formulas per collective algorithm (naive, gloo, nccl-ring, nccl-tree,
  nccl) and `wire_bytes`.
- model.py: `record_seconds`, `project` (plain sum or overlap-aware), `project_overlap`,
  `delay_policy` (emulation with a per-link busy-until timeline).
- pipeline.py: a pipeline step priced by replaying its schedule on the modelled link
  (`critical_path_time`, `critical_path_times` for many at once).
- timeline.py: the pricing engine of a timeline of steps, used by the loop's clock
  (bench/run/meter.py `StepClock`) and the what-if (bench/study/whatif/engine.py) alike:
  `StepPricer`, `LinkClock`, `coupled_max`, `stretches`, `pipeline_values`,
  `robust_projection` (it imports torch; this package's `__init__` does not).
"""

from bench.network.costs import (
    ALGORITHMS,
    all_gather_s,
    all_reduce_s,
    barrier_s,
    broadcast_s,
    exchange_s,
    p2p_s,
    reduce_scatter_s,
    slow_start_extra_s,
    wire_bytes,
)
from bench.network.model import (
    bucket_timeline,
    delay_policy,
    group_tiers,
    link_keys,
    project,
    project_overlap,
    record_seconds,
    shared_tier,
)
from bench.network.profiles import (
    PROFILES,
    TIERS,
    Profile,
    Tier,
    get_profile,
    is_profile_path,
    load_profiles,
    parse_bandwidth,
    parse_latency,
    sites_profile,
)

NVLINK = TIERS["nvlink"]
IB_400G = TIERS["ib-400g"]
ETH_100G = TIERS["eth-100g"]
ETH_10G = TIERS["eth-10g"]
WAN_1G = TIERS["wan-1g"]

__all__ = [
    "ALGORITHMS", "ETH_100G", "ETH_10G", "IB_400G", "NVLINK", "PROFILES", "TIERS", "WAN_1G",
    "Profile", "Tier", "all_gather_s", "all_reduce_s", "barrier_s", "broadcast_s",
    "bucket_timeline", "delay_policy", "exchange_s", "get_profile", "group_tiers",
    "is_profile_path", "link_keys", "load_profiles", "p2p_s", "parse_bandwidth",
    "parse_latency", "project", "project_overlap", "record_seconds", "reduce_scatter_s",
    "shared_tier", "sites_profile", "slow_start_extra_s", "wire_bytes",
]
