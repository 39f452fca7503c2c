"""Replay a simulator validation's prediction side from its JSON: the same measured figures, today's model.

    python benchmarks/sim_validation_replay.py VALIDATION.json [--json PATH]

`benchmarks/sim_validation.py --json` records everything its predictions are
made from: the benchmarks' results (`benchmark_results`: balance.py,
elastic.py, join_stream.py), the probe's measurements (`probe`) and the noise
(`noise_sigma`). This script runs nothing: it calibrates and predicts again
from those records with the simulator as it is now, and compares with the
same measured figures, row by row. So a change of the model can be checked
against a quiet machine's measurements after the machine is gone, and the
figures it prints say which model made them (`recorded` against `replayed`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from validation import compare_balance, compare_elastic, compare_joins, verdict


def replay(document: dict) -> dict:
    """The validation's rows and verdict again, from `document`'s recorded inputs."""
    results = document["benchmark_results"]
    balance_rows, _, _ = compare_balance(results["balance"], document["probe"], document["noise_sigma"])
    elastic_rows, elastic_cal, _ = compare_elastic(results["elastic"], document["probe"])
    join_rows, join_predicted = compare_joins(results.get("join_stream"), elastic_cal.parameters)
    rows = balance_rows + elastic_rows + join_rows
    return {**verdict(rows), "comparisons": [asdict(row) for row in rows], "join_predicted": join_predicted}


def print_rows(recorded: dict, replayed: dict) -> None:
    """Each row: the recorded prediction, the replayed one, the measurement, both errors."""
    before = {row["figure"]: row for row in recorded["comparisons"]}
    print(f"{'row':<84} {'recorded':>9} {'replayed':>9} {'measured':>9} {'err was':>8} {'err now':>8}")
    for row in replayed["comparisons"]:
        old = before.get(row["figure"], {})
        print(
            f"{row['figure'][:84]:<84} {_number(old.get('predicted')):>9} {_number(row['predicted']):>9} "
            f"{_number(row['measured']):>9} {_number(old.get('relative_error')):>8} "
            f"{_number(row['relative_error']):>8}{'' if row['counted'] else '  (diagnostic)'}"
        )
    print(
        f"max_relative_error: recorded {_number(recorded.get('max_relative_error'))}, replayed "
        f"{_number(replayed['max_relative_error'])}; over their goal now: {replayed['rows_over_goal'] or 'none'}"
    )


def _number(value) -> str:
    return "-" if value is None else f"{value:.4g}"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("validation_json", help="a sim_validation.py --json file")
    parser.add_argument("--json", metavar="PATH", help="write the replayed rows and verdict here")
    options = parser.parse_args(argv)
    with open(options.validation_json) as handle:
        recorded = json.load(handle)
    replayed = replay(recorded)
    print_rows(recorded, replayed)
    if options.json:
        with open(options.json, "w") as handle:
            json.dump(replayed, handle, indent=1, sort_keys=True)
    return replayed


if __name__ == "__main__":
    main()
