"""Network profiles as data: Tier, Profile, the shipped bench/profiles.yaml and users' YAML.

Exercised by `pytest tests/test_network.py -k profile`. The YAML schema (docs/network-model.md):

    tiers:                       # named link kinds (optional in a user's file)
      lab: {latency: 10ms, bandwidth: 100Mbit/s}          # or latency_s / bandwidth_Bps
    profiles:
      my-cluster:
        description: free text
        intra: nvlink            # a tier name (the file's or a built-in) or an inline tier
        inter: lab
        sites: {site_of_node: [0, 0, 1], within: lab, across: wan-1g}   # optional
        links:                   # optional per node-pair overrides (both directions)
          - {nodes: [0, 2], tier: {latency: 30ms, bandwidth: 10Mbit/s}}

A user's file may also hold ONE profile at the top level (keys `intra`, `inter`, ...).
`get_profile(name_or_path)` accepts a built-in name, `path.yaml` or `path.yaml#name`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import yaml

SHIPPED = Path(__file__).resolve().parent.parent / "profiles.yaml"


MAX_LATENCY_S = 10.0
MIN_BANDWIDTH_BPS, MAX_BANDWIDTH_BPS = 125e3, 1e14
"""The links a profile may describe: one-way latency up to 10 s (a geostationary hop is
0.25 s), bandwidth from 1 Mbit/s to 800 Tbit/s. Beyond them a value is a typo (ms for
us, bit for byte) or NaN, and an emulated run would sleep for hours per message."""

LINUX_TCP_INITIAL_WINDOW_B = 14480
"""Linux's initial congestion window: 10 segments of 1448 B (netprobe's gloo tiers, the
shaped-link lab; bench/profiles.yaml spells it for wan-1g)."""


def _valid_exchange_scale(points) -> bool:
    """(bytes, ratio) pairs, every number finite and > 0, the sizes ascending."""
    return (all(len(p) == 2 and all(0 < v < math.inf for v in p) for p in points)
            and all(a[0] < b[0] for a, b in pairwise(points)))


@dataclass(frozen=True)
class Tier:
    """One kind of link: latency alpha in seconds, bandwidth beta in bytes per second.

    `nics`: independent links of this kind out of one node (e.g. one NIC per GPU); flows
    leaving a node at once share ceil(flows / nics) of them (see the model's contention).
    `tcp_initial_window_B`: a TCP link's initial congestion window in bytes (Linux: 10
    segments, 14480 B): a message over a connection idle longer than the RTO ramps up
    by slow start (bench/network/costs.py `slow_start_extra_s`); None = no slow start
    (RDMA, NVLink, InfiniBand).
    `exchange_scale`: the two-way exchange (gossip) as netprobe measured it on this link,
    ((bytes per peer, measured / formula), ...) with sizes ascending; the projection
    multiplies the exchange's warm formula by `exchange_factor` (docs/network-model.md,
    "TCP's window on short round trips"). () = the formula as it is.
    `tcp_queue_s`: seconds of queue at line rate a TCP window grows into past the
    bandwidth-delay product before losses cap it, which decides how far it has to ramp
    after an idle (`slow_start_extra_s`); 0 = the window capped at the bandwidth-delay
    product. netprobe measures the queue one bulk TCP flow keeps standing; by hand, the
    bottleneck buffer's depth is an upper bound on it.
    `tcp_rtt_s`: the round trip TCP's slow start runs on (netprobe: the smallest ping-pong
    of one element on the idle link); None = 2 x `latency_s`. netprobe's `latency_s` is
    what an op's message costs through the backend (its handshakes and copies), which on
    short links is well above half the round trip (1.2-1.6 ms against 1.05 at 1 Gbit/s +
    1 ms in the shaped-link lab, docs/network-model.md).
    """

    latency_s: float
    bandwidth_Bps: float
    nics: int = 1
    tcp_initial_window_B: float | None = None
    exchange_scale: tuple[tuple[float, float], ...] = ()
    tcp_queue_s: float = 0.0
    tcp_rtt_s: float | None = None

    def __post_init__(self):
        if not self.latency_s >= 0:
            raise ValueError(f"Tier.latency_s must be >= 0, got {self.latency_s!r}")
        if not self.bandwidth_Bps > 0:
            raise ValueError(f"Tier.bandwidth_Bps must be > 0, got {self.bandwidth_Bps!r}")
        if not isinstance(self.nics, int) or self.nics < 1:
            raise ValueError(f"Tier.nics must be an integer >= 1, got {self.nics!r}")
        if self.tcp_initial_window_B is not None and not self.tcp_initial_window_B > 0:
            raise ValueError(f"Tier.tcp_initial_window_B must be > 0 bytes or None, got "
                             f"{self.tcp_initial_window_B!r}")
        if not _valid_exchange_scale(self.exchange_scale):
            raise ValueError("Tier.exchange_scale must be (bytes > 0, ratio > 0) pairs with "
                             f"the sizes ascending, got {self.exchange_scale!r}")
        if not 0 <= self.tcp_queue_s <= MAX_LATENCY_S:
            raise ValueError(f"Tier.tcp_queue_s must be from 0 to {MAX_LATENCY_S:g} s, got "
                             f"{self.tcp_queue_s!r}")
        if self.tcp_rtt_s is not None and not 0 < self.tcp_rtt_s <= 2 * MAX_LATENCY_S:
            raise ValueError(f"Tier.tcp_rtt_s must be > 0 and at most {2 * MAX_LATENCY_S:g} s, "
                             f"or None, got {self.tcp_rtt_s!r}")

    @property
    def round_trip_s(self) -> float:
        """The round trip TCP sees: `tcp_rtt_s`, else 2 x `latency_s`."""
        return 2 * self.latency_s if self.tcp_rtt_s is None else self.tcp_rtt_s

    def exchange_factor(self, nbytes: float) -> float:
        """`exchange_scale`'s ratio at `nbytes` per peer: linear in log(size) between the
        measured sizes, held at the nearest one outside them; 1 without measurements."""
        points = self.exchange_scale
        if not points:
            return 1.0
        if nbytes <= points[0][0]:
            return points[0][1]
        for (s0, r0), (s1, r1) in pairwise(points):
            if nbytes <= s1:
                w = math.log(nbytes / s0) / math.log(s1 / s0)
                return r0 + w * (r1 - r0)
        return points[-1][1]


@dataclass(frozen=True)
class Profile:
    """A network: the Tier inside a node, across nodes, and optionally per node pair."""

    name: str
    intra: Tier
    inter: Tier
    links: tuple[tuple[Tier, ...], ...] | None = None
    """Heterogeneous networks: links[a][b] joins node a to node b (a != b); None = `inter`."""
    description: str = ""
    overrides: tuple[tuple[tuple[int, int], Tier], ...] = ()
    """Per node-pair overrides ((a, b), tier), consulted before `links` and `inter`."""

    def __post_init__(self):
        if self.links is not None and any(len(row) != len(self.links) for row in self.links):
            raise ValueError(f"network profile {self.name!r}: links must be a square matrix")

    def link(self, src_rank: int, dst_rank: int, ranks_per_node: int = 1) -> Tier:
        """The Tier that carries traffic from `src_rank` to `dst_rank`."""
        return self.node_link(src_rank // ranks_per_node, dst_rank // ranks_per_node)

    def node_link(self, src_node: int, dst_node: int) -> Tier:
        if src_node == dst_node:
            return self.intra
        for pair, tier in self.overrides:
            if pair == (src_node, dst_node):
                return tier
        if self.links is None:
            return self.inter
        if max(src_node, dst_node) >= len(self.links):
            raise ValueError(
                f"network profile {self.name!r} describes {len(self.links)} nodes, got node "
                f"{max(src_node, dst_node)}; lower the world size, raise network.ranks_per_node "
                f"or build a larger profile (a YAML `sites` map, docs/network-model.md)"
            )
        return self.links[src_node][dst_node]


def sites_profile(name: str, site_of_node: Sequence[int], intra: Tier, within_site: Tier,
                  across_sites: Tier, description: str = "") -> Profile:
    """A heterogeneous Profile from a node -> site map: `within_site` links nodes of one
    site, `across_sites` links nodes of different sites, `intra` ranks of one node."""
    links = tuple(
        tuple(within_site if a == b else across_sites for b in site_of_node) for a in site_of_node
    )
    return Profile(name, intra, across_sites, links, description)


# ---------------------------------------------------------------------- YAML -> Profile

_PER_SECOND = {"": 1.0, "s": 1.0, "ms": 1e3, "us": 1e6, "µs": 1e6, "ns": 1e9}  # divisors
_PREFIX = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
           "Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40}
_NUM = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(\S*)\s*$")
_RATE = re.compile(r"^(?:(k|K|M|G|T|Ki|Mi|Gi|Ti)?(B/s|bit/s|bps))?$")
LATENCY_UNITS = "a number of seconds or e.g. '10ms', '5us' (units s, ms, us, ns)"
BANDWIDTH_UNITS = ("a number of bytes/s or e.g. '12.5GB/s', '100Mbit/s', '1Gbps' "
                   "(B/s, bit/s or bps with prefix k, M, G, T, Ki, Mi, Gi, Ti)")


def _fail(where: str, value, valid: str) -> ValueError:
    return ValueError(f"{where} must be {valid}, got {value!r}")


def parse_latency(value, where: str) -> float:
    """Seconds from a number (seconds) or a string with a unit."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    m = _NUM.match(value) if isinstance(value, str) else None
    if m is None or m.group(2) not in _PER_SECOND:
        raise _fail(where, value, LATENCY_UNITS)
    return float(m.group(1)) / _PER_SECOND[m.group(2)]


def parse_bandwidth(value, where: str) -> float:
    """Bytes per second from a number (bytes/s) or a string with a unit."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    m = _NUM.match(value) if isinstance(value, str) else None
    unit = _RATE.match(m.group(2)) if m else None
    if unit is None:
        raise _fail(where, value, BANDWIDTH_UNITS)
    scale = _PREFIX[unit.group(1) or ""] / (1 if unit.group(2) in ("B/s", None) else 8)
    return float(m.group(1)) * scale


_TIER_KEYS = {"latency", "latency_s", "bandwidth", "bandwidth_Bps", "nics", "tcp_initial_window",
              "exchange_scale", "tcp_queue", "tcp_rtt", "fit"}


def _reject_unknown(spec: dict, allowed: set[str], where: str, noun: str) -> None:
    unknown = sorted(set(spec) - allowed)
    if unknown:
        raise _fail(f"{where}.{unknown[0]}", spec[unknown[0]],
                    f"absent: a {noun}'s keys are {sorted(allowed)}")


def parse_tier(spec, where: str, named: dict[str, Tier]) -> Tier:
    """A Tier from a name in `named` or an inline mapping (`fit` is ignored: netprobe notes)."""
    if isinstance(spec, str):
        if spec not in named:
            raise _fail(where, spec, f"a tier name ({sorted(named)}) or an inline "
                                     "{latency: ..., bandwidth: ...}")
        return named[spec]
    if not isinstance(spec, dict):
        raise _fail(where, spec, "a tier name or a mapping {latency: ..., bandwidth: ...}")
    _reject_unknown(spec, _TIER_KEYS, where, "tier")
    values = []
    for short, parse in (("latency", parse_latency), ("bandwidth", parse_bandwidth)):
        full = "latency_s" if short == "latency" else "bandwidth_Bps"
        present = [k for k in (short, full) if k in spec]
        if len(present) != 1:
            raise _fail(f"{where}.{short}", spec.get(short, spec.get(full)),
                        f"given exactly once, as `{short}` (with units) or `{full}` (a number)")
        values.append(parse(spec[present[0]], f"{where}.{present[0]}"))
    nics = spec.get("nics", 1)
    if not isinstance(nics, int) or isinstance(nics, bool) or nics < 1:
        raise _fail(f"{where}.nics", nics, "an integer >= 1")
    latency, bandwidth = values
    if not 0 <= latency <= MAX_LATENCY_S:
        raise _fail(f"{where}.latency", spec.get("latency", spec.get("latency_s")),
                    f"from 0 to {MAX_LATENCY_S:g} s (a link's one-way latency; a run emulating "
                    "it sleeps that long per message)")
    if not MIN_BANDWIDTH_BPS <= bandwidth <= MAX_BANDWIDTH_BPS:
        raise _fail(f"{where}.bandwidth", spec.get("bandwidth", spec.get("bandwidth_Bps")),
                    f"from {MIN_BANDWIDTH_BPS:g} to {MAX_BANDWIDTH_BPS:g} B/s (1 Mbit/s to "
                    "800 Tbit/s)")
    window = spec.get("tcp_initial_window")
    if window is not None and (isinstance(window, bool) or not isinstance(window, (int, float))
                               or not 0 < window < float("inf")):
        raise _fail(f"{where}.tcp_initial_window", window,
                    "a number of bytes > 0 (Linux: 14480 = 10 segments of 1448 B), or absent "
                    "for links without TCP slow start")
    queue = parse_latency(spec.get("tcp_queue", 0.0), f"{where}.tcp_queue")
    if not 0 <= queue <= MAX_LATENCY_S:
        raise _fail(f"{where}.tcp_queue", spec["tcp_queue"],
                    f"from 0 to {MAX_LATENCY_S:g} s (how long the link's bottleneck buffer "
                    "queues at line rate, e.g. 20ms; absent: a shallow buffer)")
    rtt = spec.get("tcp_rtt")
    if rtt is not None:
        rtt = parse_latency(rtt, f"{where}.tcp_rtt")
        if not 0 < rtt <= 2 * MAX_LATENCY_S:
            raise _fail(f"{where}.tcp_rtt", spec["tcp_rtt"],
                        f"> 0 and at most {2 * MAX_LATENCY_S:g} s (the link's round trip as "
                        "TCP sees it, e.g. 2.1ms; absent: twice the latency)")
    return Tier(latency, bandwidth, nics, None if window is None else float(window),
                _parse_exchange_scale(spec.get("exchange_scale", []), f"{where}.exchange_scale"),
                queue, rtt)


def _parse_exchange_scale(spec, where: str) -> tuple[tuple[float, float], ...]:
    """netprobe's measured exchange ratios: a list of [bytes per peer, measured / formula]."""
    valid = ("a list of [bytes per peer, measured / formula] pairs, sizes ascending, every "
             "number > 0 (written by commbench netprobe)")
    if not isinstance(spec, list):
        raise _fail(where, spec, valid)
    for item in spec:
        if (not isinstance(item, (list, tuple)) or len(item) != 2
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                           for v in item)
                or not _valid_exchange_scale([item])):
            raise _fail(where, item, valid)
    points = tuple((float(b), float(r)) for b, r in spec)
    if not _valid_exchange_scale(points):
        raise _fail(where, spec, valid)
    return points


_PROFILE_KEYS = {"name", "description", "intra", "inter", "sites", "links"}


def parse_profile(name: str, spec, where: str, named: dict[str, Tier]) -> Profile:
    """A Profile from its YAML mapping (see the module docstring)."""
    if not isinstance(spec, dict):
        raise _fail(where, spec, "a mapping with keys intra, inter (or sites), ...")
    _reject_unknown(spec, _PROFILE_KEYS, where, "profile")
    if "intra" not in spec:
        raise _fail(f"{where}.intra", None, "a tier (the link between ranks of one node)")
    intra = parse_tier(spec["intra"], f"{where}.intra", named)
    description = str(spec.get("description", ""))
    sites = spec.get("sites")
    if sites is not None:
        profile = _parse_sites(name, sites, f"{where}.sites", named, intra, description)
        if "inter" in spec:
            raise _fail(f"{where}.inter", spec["inter"], "absent when `sites` is given")
    else:
        if "inter" not in spec:
            raise _fail(f"{where}.inter", None, "a tier (the link between nodes) or a `sites` map")
        profile = Profile(name, intra, parse_tier(spec["inter"], f"{where}.inter", named),
                          description=description)
    overrides = _parse_links(spec.get("links", []), f"{where}.links", named)
    return Profile(profile.name, profile.intra, profile.inter, profile.links,
                   profile.description, overrides)


def _parse_sites(name, sites, where, named, intra, description) -> Profile:
    if not isinstance(sites, dict) or set(sites) != {"site_of_node", "within", "across"}:
        raise _fail(where, sites, "a mapping with exactly site_of_node, within, across")
    site_of_node = sites["site_of_node"]
    if (not isinstance(site_of_node, list) or not site_of_node
            or not all(isinstance(s, int) and s >= 0 for s in site_of_node)):
        raise _fail(f"{where}.site_of_node", site_of_node,
                    "a non-empty list of site numbers >= 0, one per node")
    return sites_profile(name, site_of_node, intra,
                         parse_tier(sites["within"], f"{where}.within", named),
                         parse_tier(sites["across"], f"{where}.across", named), description)


def _parse_links(links, where, named) -> tuple:
    if not isinstance(links, list):
        raise _fail(where, links, "a list of {nodes: [a, b], tier: ..., directed: false}")
    out = []
    for i, item in enumerate(links):
        here = f"{where}[{i}]"
        if not isinstance(item, dict) or not {"nodes", "tier"} <= set(item) \
                or set(item) - {"nodes", "tier", "directed"}:
            raise _fail(here, item, "a mapping {nodes: [a, b], tier: ..., directed: false}")
        nodes = item["nodes"]
        if (not isinstance(nodes, list) or len(nodes) != 2 or nodes[0] == nodes[1]
                or not all(isinstance(n, int) and n >= 0 for n in nodes)):
            raise _fail(f"{here}.nodes", nodes, "two different node numbers >= 0")
        tier = parse_tier(item["tier"], f"{here}.tier", named)
        a, b = nodes
        out.append(((a, b), tier))
        if not item.get("directed", False):
            out.append(((b, a), tier))
    return tuple(out)


def parse_document(doc, source: str, base_tiers: dict[str, Tier] | None = None
                   ) -> dict[str, Profile]:
    """Every Profile of one YAML document (`tiers` + `profiles`, or one top-level profile)."""
    named = dict(base_tiers or {})
    if not isinstance(doc, dict):
        raise _fail(source, doc, "a mapping with `profiles` (and `tiers`), or one profile")
    if "profiles" not in doc:  # a single profile at the top level
        name = str(doc.get("name", Path(source).stem))
        return {name: parse_profile(name, doc, source, named)}
    unknown = sorted(set(doc) - {"tiers", "profiles"})
    if unknown:
        raise _fail(f"{source}: {unknown[0]}", doc[unknown[0]], "absent: top-level keys are "
                    "tiers, profiles")
    tiers = doc.get("tiers") or {}
    if not isinstance(tiers, dict):
        raise _fail(f"{source}: tiers", tiers, "a mapping name -> tier")
    for tname, spec in tiers.items():
        named[str(tname)] = parse_tier(spec, f"{source}: tiers.{tname}", named)
    profiles = doc["profiles"]
    if not isinstance(profiles, dict) or not profiles:
        raise _fail(f"{source}: profiles", profiles, "a non-empty mapping name -> profile")
    return {str(n): parse_profile(str(n), spec, f"{source}: profiles.{n}", named)
            for n, spec in profiles.items()}


def _load_shipped() -> tuple[dict[str, Tier], dict[str, Profile]]:
    doc = yaml.safe_load(SHIPPED.read_text())
    tiers = {str(n): parse_tier(s, f"{SHIPPED.name}: tiers.{n}", {})
             for n, s in doc["tiers"].items()}
    return tiers, parse_document(doc, SHIPPED.name)


TIERS, PROFILES = _load_shipped()


def load_profiles(path: str | Path) -> dict[str, Profile]:
    """Every Profile in a user's YAML file (built-in tier names may be used in it)."""
    path = Path(path).expanduser()
    try:
        doc = yaml.safe_load(path.read_text())
    except OSError as err:
        raise ValueError(f"network profile file {str(path)!r} cannot be read: {err}") from err
    except yaml.YAMLError as err:
        raise ValueError(f"network profile file {str(path)!r} is not valid YAML: {err}") from err
    return parse_document(doc, str(path), TIERS)


def is_profile_path(name: str) -> bool:
    """True when `name` refers to a YAML file rather than a built-in profile."""
    base = name.split("#", 1)[0]
    return base.endswith((".yaml", ".yml")) or "/" in base or Path(base).expanduser().is_file()


def get_profile(name_or_path: str | Profile) -> Profile:
    """A built-in profile by name, or a user's from `path.yaml` / `path.yaml#name`."""
    if isinstance(name_or_path, Profile):
        return name_or_path
    name = str(name_or_path)
    if name in PROFILES:
        return PROFILES[name]
    if not is_profile_path(name):
        raise ValueError(f"network profile must be one of {sorted(PROFILES)} or a path to a "
                         f"YAML profile (docs/network-model.md), got {name!r}")
    path, _, pick = name.partition("#")
    found = load_profiles(path)
    if pick:
        if pick not in found:
            raise _fail(f"profile name after '#' in {name!r}", pick, f"one of {sorted(found)}")
        return found[pick]
    if len(found) != 1:
        raise ValueError(f"network profile file {path!r} holds {sorted(found)}: pick one with "
                         f"'{path}#NAME'")
    return next(iter(found.values()))
