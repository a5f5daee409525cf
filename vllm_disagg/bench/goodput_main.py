"""``vllm-disagg bench goodput``: the sweep of arms against offered load (goodput.py), or admission's
scenarios past capacity (``--scenario admission|tenants``: goodput_admission.py)."""

from __future__ import annotations

import argparse

from vllm_disagg.bench import goodput, goodput_admission


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The sweep's flags and the scenarios'."""
    goodput.add_arguments(parser)
    goodput_admission.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """The scenario ``--scenario`` names."""
    if args.scenario == "arms":
        return goodput.run(args)
    return goodput_admission.run(args)
