"""Where the simulated instances run, and what a KV link between two of them delivers
(``vllm-disagg sim --topology RACKSxNODESxGPUS``; docs/sim.md, "Topology").

One instance per GPU, the roles interleaved in proportion and spread evenly over the racks, each rack
filling its nodes in order (32P32D on 4x8x8: 16 instances a rack, 4 P's and 4 D's on each of two
nodes), so a P finds a D in its node and its rack, and a topology-blind pick crosses racks most of
the time (3 in 4 with 4 racks). Labels, as an
agent would send them: ``zone`` the rack (``r0``), ``node`` and ``domain`` the node (``r0n3``: the
8 GPUs of an HGX board are one NVLink island).

A link's bandwidth by how close its ends are (the constants below, or the flags): in one node NVLink,
between nodes of a rack one 400 Gb/s InfiniBand port per GPU through the leaf switch, across racks
that port's share of an oversubscribed spine (``cross_rack_share``). A transfer moves the prompt
tokens D does not cache, ``kv_bytes_per_token`` each, on the pair's link; links do not contend (each
transfer gets its link's whole rate).
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass

from vllm_disagg.errors import ConfigError
from vllm_disagg.protocol.messages import LABEL_DOMAIN, LABEL_NODE, LABEL_ZONE

# NVLink 4 on H100 SXM: 900 GB/s both ways, 450 GB/s one way = 3,600 Gb/s.
DOMAIN_GBPS = 3600.0
# One ConnectX-7 port per GPU (400 Gb/s InfiniBand NDR) to the rack's leaf switch.
RACK_GBPS = 400.0
# Across racks: a 4:1 oversubscribed spine leaves a GPU a quarter of its port (100 Gb/s).
CROSS_RACK_SHARE = 0.25
# Llama-3-8B in bf16: 2 (K, V) x 32 layers x 8 KV heads x 128 x 2 bytes = 128 KiB a token.
KV_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2

_SHAPE = re.compile(r"(?P<racks>[0-9]+)x(?P<nodes>[0-9]+)x(?P<gpus>[0-9]+)")


@dataclass(frozen=True, slots=True)
class Location:
    """One instance's GPU: its rack and node (label values) and its index in the node."""

    rack: str
    node: str
    gpu: int


@dataclass(frozen=True, slots=True)
class Topology:
    """Racks of nodes of GPUs, and the bandwidth of each tier."""

    racks: int
    nodes: int  # per rack
    gpus: int  # per node
    domain_gbps: float = DOMAIN_GBPS
    rack_gbps: float = RACK_GBPS
    cross_rack_share: float = CROSS_RACK_SHARE
    kv_bytes_per_token: int = KV_BYTES_PER_TOKEN

    def __post_init__(self) -> None:
        if min(self.racks, self.nodes, self.gpus) < 1:
            raise ConfigError(f"a topology has at least one of each, got {self.shape}")
        if not 0 < self.cross_rack_share <= 1:
            raise ConfigError(f"the cross-rack share is in (0, 1], got {self.cross_rack_share}")
        if self.kv_bytes_per_token < 1 or min(self.domain_gbps, self.rack_gbps) <= 0:
            raise ConfigError("KV bytes per token and link rates must be > 0")

    @property
    def shape(self) -> str:
        """``RACKSxNODESxGPUS``."""
        return f"{self.racks}x{self.nodes}x{self.gpus}"

    @property
    def size(self) -> int:
        """GPUs in all."""
        return self.racks * self.nodes * self.gpus

    def gbps(self, p: Location, d: Location) -> float:
        """The link's rate between two GPUs."""
        if p.node == d.node:
            return self.domain_gbps
        if p.rack == d.rack:
            return self.rack_gbps
        return self.rack_gbps * self.cross_rack_share

    def place(self, prefill: int, decode: int) -> dict[str, Location]:
        """Each instance's GPU (``prefill-i``, ``decode-j``), the roles interleaved in proportion."""
        if prefill + decode > self.size:
            raise ConfigError(f"{prefill + decode} instances do not fit {self.shape} ({self.size} GPUs)")
        # Instance k of a role of n sits at (k + 0.5) / n along the order; ties: prefill first.
        order = sorted(
            [((i + 0.5) / prefill, 0, f"prefill-{i}") for i in range(prefill)]
            + [((j + 0.5) / decode, 1, f"decode-{j}") for j in range(decode)]
        )
        n, racks = len(order), self.racks
        placed: dict[str, Location] = {}
        for k, (_, _, name) in enumerate(order):
            rack = k * racks // n  # rack r: instances ceil(r n / racks) to ceil((r + 1) n / racks) - 1
            node, gpu = divmod(k - -(-rack * n // racks), self.gpus)
            placed[name] = Location(f"r{rack}", f"r{rack}n{node}", gpu)
        return placed


def labels_of(location: Location) -> dict[str, str]:
    """The topology labels an agent on that GPU sends in its Hello."""
    return {LABEL_ZONE: location.rack, LABEL_NODE: location.node, LABEL_DOMAIN: location.node}


def parse_shape(text: str) -> tuple[int, int, int]:
    """``RACKSxNODESxGPUS`` (e.g. ``4x8x8``) as three counts >= 1."""
    m = _SHAPE.fullmatch(text)
    if m is None or min(int(m["racks"]), int(m["nodes"]), int(m["gpus"])) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not RACKSxNODESxGPUS (e.g. 4x8x8)")
    return int(m["racks"]), int(m["nodes"]), int(m["gpus"])


def _share(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"a share in (0, 1], got {text!r}")
    return value


def _bytes(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"a whole number of bytes >= 1, got {text!r}")
    return int(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The topology flags of ``vllm-disagg sim``."""
    parser.add_argument(
        "--topology",
        type=parse_shape,
        metavar="RxNxG",
        help="place instances on R racks of N nodes of G GPUs, KV links by tier, links learned (e.g. 4x8x8)",
    )
    parser.add_argument(
        "--cross-rack-share",
        type=_share,
        default=CROSS_RACK_SHARE,
        metavar="F",
        help=f"--topology: cross-rack rate as a share of in-rack {RACK_GBPS:g} Gb/s ({CROSS_RACK_SHARE})",
    )
    parser.add_argument(
        "--kv-bytes-per-token",
        type=_bytes,
        default=KV_BYTES_PER_TOKEN,
        metavar="B",
        help=f"--topology: KV bytes a token ({KV_BYTES_PER_TOKEN}: Llama-3-8B, bf16)",
    )


def from_args(args: argparse.Namespace) -> Topology | None:
    """The ``--topology`` flags' topology, or None."""
    if args.topology is None:
        return None
    racks, nodes, gpus = args.topology
    return Topology(
        racks, nodes, gpus, cross_rack_share=args.cross_rack_share, kv_bytes_per_token=args.kv_bytes_per_token
    )
