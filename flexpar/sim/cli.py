"""``flexpar simulate``: run a scenario (or its scalability sweep), print a table, write a plot.

The lead's ``flexpar/cli/`` calls ``simulate_command``; ``python -m
flexpar.sim`` runs the same thing on its own (``main``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence, TextIO

from .engine import simulate_all
from .plot import plot_comparison, plot_scalability
from .report import comparison_summary, comparison_table, joins_table, scalability_table, write_json
from .scalability import scalability
from .scenario_file import load_scenario, shipped_scenarios


def _default_plot_path(scenario_name: str, suffix: str) -> Path:
    return Path(f"{scenario_name}-{suffix}.png")


def simulate_command(
    scenario_path,
    plot_path=None,
    json_path=None,
    out: Optional[TextIO] = None,
    *,
    scalability_sweep: bool = False,
    plot: bool = True,
) -> int:
    """Simulate the scenario under each of its policies; print the table, write plot and JSON.

    ``scenario_path``: a TOML file, or the name of a shipped scenario
    (``mixed_cluster``, ``spot_churn``). ``plot_path`` defaults to
    ``<name>-simulation.png`` (``<name>-scalability.png`` for the sweep) in the
    current folder; ``plot=False`` writes none. ``scalability_sweep=True`` runs
    throughput versus device count (the scenario's ``[scalability]`` table)
    instead of the scenario itself. ``out``: where the table goes (default
    ``sys.stdout`` at call time). Returns the exit status: 0, or 2 for a bad
    scenario file (the error, naming the field, goes to stderr).
    """
    out = sys.stdout if out is None else out
    try:
        scenario = load_scenario(str(scenario_path))
    except ValueError as error:
        print(f"flexpar simulate: {error}", file=sys.stderr)
        return 2
    if scalability_sweep:
        sweep = scalability(scenario)
        print(scalability_table(sweep), file=out)
        summary = sweep.summary()
        figure = _plot(
            lambda path: plot_scalability(sweep, path),
            plot,
            plot_path,
            _default_plot_path(scenario.name, "scalability"),
        )
    else:
        results = simulate_all(scenario)
        print(comparison_table(results), file=out)
        for result in results:
            if result.joins():
                print("\n" + joins_table(result), file=out)
        summary = comparison_summary(results)
        figure = _plot(
            lambda path: plot_comparison(results, path),
            plot,
            plot_path,
            _default_plot_path(scenario.name, "simulation"),
        )
    if figure is not None:
        print(f"plot: {figure}", file=out)
    if json_path is not None:
        write_json(summary, json_path)
        print(f"json: {json_path}", file=out)
    return 0


def _plot(draw, enabled: bool, plot_path, default: Path) -> Optional[Path]:
    if not enabled:
        return None
    try:
        return draw(Path(plot_path) if plot_path is not None else default)
    except RuntimeError as error:  # matplotlib missing: the table still stands
        print(f"flexpar simulate: no plot: {error}", file=sys.stderr)
        return None


SIMULATE_DESCRIPTION = "Simulate a cluster scenario under flexpar, uniform split (DDP) and checkpoint-restart."


def add_simulate_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``simulate``'s arguments to ``parser`` (e.g. a subcommand parser of ``flexpar``)."""
    parser.add_argument("scenario", help="scenario TOML file, or the name of a shipped scenario")
    parser.add_argument("-o", "--output", dest="plot_path", help="plot file (PNG); default <name>-simulation.png")
    parser.add_argument("--json", dest="json_path", help="write the results as JSON here")
    parser.add_argument("--scalability", action="store_true", help="throughput versus device count instead")
    parser.add_argument("--no-plot", action="store_true", help="print the table only")
    return parser


def run_from_arguments(arguments: argparse.Namespace) -> int:
    """``simulate_command`` from arguments parsed with ``add_simulate_arguments``."""
    return simulate_command(
        arguments.scenario,
        arguments.plot_path,
        arguments.json_path,
        scalability_sweep=arguments.scalability,
        plot=not arguments.no_plot,
    )


def build_parser() -> argparse.ArgumentParser:
    return add_simulate_arguments(
        argparse.ArgumentParser(
            prog="flexpar simulate",
            description=SIMULATE_DESCRIPTION,
            epilog=f"shipped scenarios: {', '.join(shipped_scenarios())}",
        )
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_from_arguments(build_parser().parse_args(argv))
