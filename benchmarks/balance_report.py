"""The JSON document and the printed tables of benchmarks/balance.py."""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import List

from balance_figures import imbalance_floor, imbalance_of_optimum, whole_vw_optimum_units
from balance_workload import Config, fine_config
from harness import median, median_of, print_table


def summarise(config: Config, rounds: List[dict]) -> dict:
    """The JSON document: headline medians, goals, simulator inputs, and every round."""

    def median_steps(key):
        # A round that never got within the target counts as "never" (infinitely
        # many steps), not as a missing value: the median is then None if most did not.
        middle = median([math.inf if result[key] is None else result[key] for result in rounds])
        return None if math.isinf(middle) else middle

    floor = imbalance_floor(config.speeds, config.virtual_workers)
    imbalance_median = median_of(rounds, "imbalance")
    fine_rounds = [result["v128"] for result in rounds if result.get("v128")]
    fine_efficiencies = [
        result["efficiency_vs_ideal"] for result in fine_rounds if result["efficiency_vs_ideal"] is not None
    ]
    figures = {
        "efficiency_vs_ideal": median_of(rounds, "efficiency_vs_ideal"),
        "speedup_vs_uniform": median_of(rounds, "speedup_vs_uniform"),
        "imbalance_over_floor": None if imbalance_median is None else imbalance_median - floor,
        "rebalance_steps": median_steps("rebalance_steps"),
        "efficiency_vs_ideal_v128": median(fine_efficiencies) if fine_efficiencies else None,
        "imbalance_median": imbalance_median,
    }
    ceiling_units = whole_vw_optimum_units(config.speeds, config.virtual_workers)
    fine = fine_config(config)
    fine_ceiling = (
        None
        if not fine_rounds
        else (fine.virtual_workers / sum(fine.speeds) / whole_vw_optimum_units(fine.speeds, fine.virtual_workers))
    )
    return {
        **figures,
        "goals": dict(GOALS),
        # Inputs for the simulator's validation: per device (local-0, local-1, ...).
        "devices": config.devices,
        "virtual_workers": config.virtual_workers,
        "speeds": list(config.speeds),
        "seconds_per_vw": [
            median([result["seconds_per_vw"][index] for result in rounds]) for index in range(config.devices)
        ],
        "step_time_s": median_of(rounds, "flexpar_step_s"),
        "assignment": [median([result["assignment"][index] for result in rounds]) for index in range(config.devices)],
        # What whole VWs allow at all, with exact speeds: the ceilings of the goals.
        "efficiency_ceiling_whole_vws": config.virtual_workers / sum(config.speeds) / ceiling_units,
        "speedup_ceiling_whole_vws": (config.virtual_workers / config.devices / min(config.speeds)) / ceiling_units,
        "imbalance_floor_whole_vws": floor,
        "imbalance_of_optimal_assignment": imbalance_of_optimum(config.speeds, config.virtual_workers),
        "rebalance_steps_vs_single_device_ideal": median_steps("rebalance_steps_vs_single_device_ideal"),
        "rebalance_steps_vs_continuous_ideal": median_steps("rebalance_steps_vs_continuous_ideal"),
        "efficiency_vs_measured_rates": median_of(rounds, "efficiency_vs_measured_rates"),
        "single_device_seconds_per_vw": median_of(rounds, "single_seconds_per_vw"),
        "ideal_step_s": median_of(rounds, "ideal_step_s"),
        "uniform_step_s": median_of(rounds, "uniform_step_s"),
        "v128": None
        if not fine_rounds
        else {
            "virtual_workers": fine.virtual_workers,
            "efficiency_vs_measured_rates": median([result["efficiency_vs_measured_rates"] for result in fine_rounds]),
            "imbalance_median": median([result["imbalance"] for result in fine_rounds]),
            "ideal_step_s": median([result["ideal_step_s"] for result in fine_rounds]),
            "step_time_s": median([result["flexpar_step_s"] for result in fine_rounds]),
            "final_assignments": [result["final_assignment"] for result in fine_rounds],
            "settled_steps": [result["settled_step"] for result in fine_rounds],
        },
        "efficiency_ceiling_whole_vws_v128": fine_ceiling,
        "config": asdict(config),
        "rounds": rounds,
    }


# The balancing goals (whole-VW ceiling, against the uniform split, imbalance), measured side by side in one run.
GOALS = (
    ("efficiency_vs_ideal", ">= 0.95"),
    ("speedup_vs_uniform", ">= 2.6"),
    ("imbalance_over_floor", "<= 0.03"),
    ("rebalance_steps", "<= 3"),
    ("efficiency_vs_ideal_v128", ">= 0.96"),
)


def print_report(summary: dict) -> None:
    columns = ["round", "ideal_s", "flexpar_s", "uniform_s", "efficiency", "speedup", "imbalance", "rebalance_steps"]
    rows = [
        {
            "round": index + 1,
            "ideal_s": result["ideal_step_s"],
            "flexpar_s": result["flexpar_step_s"],
            "uniform_s": result["uniform_step_s"],
            "efficiency": result["efficiency_vs_ideal"],
            "speedup": result["speedup_vs_uniform"],
            "imbalance": result["imbalance"],
            "rebalance_steps": result["rebalance_steps"],
        }
        for index, result in enumerate(summary["rounds"])
    ]
    rows.append(
        {
            "round": "median",
            "ideal_s": summary["ideal_step_s"],
            "flexpar_s": summary["step_time_s"],
            "uniform_s": summary["uniform_step_s"],
            "efficiency": summary["efficiency_vs_ideal"],
            "speedup": summary["speedup_vs_uniform"],
            "imbalance": summary["imbalance_median"],
            "rebalance_steps": summary["rebalance_steps"],
        }
    )
    config = summary["config"]
    print_table(
        rows,
        columns,
        title=(
            f"load balancing: speeds {config['speeds']}, V={config['virtual_workers']}, step times in seconds "
            f"(ideal = single device / {sum(config['speeds'])}; uniform = torch DDP, equal shares)"
        ),
    )
    print()
    limits = {
        "efficiency_vs_ideal": summary["efficiency_ceiling_whole_vws"],
        "speedup_vs_uniform": summary["speedup_ceiling_whole_vws"],
        "imbalance_over_floor": 0.0,
        "efficiency_vs_ideal_v128": summary["efficiency_ceiling_whole_vws_v128"],
    }
    goals = [
        {"figure": key, "measured": summary[key], "goal": goal, "whole-VW limit": limit}
        for key, goal, limit in [(key, goal, limits.get(key)) for key, goal in GOALS]
        + [
            ("imbalance_median", "(no goal)", summary["imbalance_floor_whole_vws"]),
            ("efficiency_vs_measured_rates", "(no goal)", summary["efficiency_ceiling_whole_vws"]),
            ("rebalance_steps_vs_single_device_ideal", "(no goal)", None),
            ("rebalance_steps_vs_continuous_ideal", "(no goal)", None),
        ]
    ]
    print_table(goals, ["figure", "measured", "goal", "whole-VW limit"])
    print("('-' for rebalance steps: the moving median never got within 5% of that ideal)")
    print(
        f"per-device seconds per VW (local-0..): {[round(value, 4) for value in summary['seconds_per_vw']]}; "
        f"median assignment {summary['assignment']}; imbalance of the exact optimum "
        f"{summary['imbalance_of_optimal_assignment']:.3f}"
    )
    if summary["v128"]:
        fine = summary["v128"]
        print(
            f"V={fine['virtual_workers']} round: ideal {fine['ideal_step_s']:.4g} s, flexpar "
            f"{fine['step_time_s']:.4g} s, imbalance {fine['imbalance_median']:.3f}; final splits "
            f"{fine['final_assignments']}, settled at steps {fine['settled_steps']}"
        )
