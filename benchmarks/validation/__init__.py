"""The simulator validation's pieces (benchmarks/sim_validation.py runs them), by what each validates.

- `comparison`: a predicted figure against its measurement (`Comparison`), the
  verdict over all rows, the bootstrap interval of a measured median;
- `inputs`: balance.py's and elastic.py's JSON (given, or run now) and metrics;
- `probe`: the costs measured apart in fresh gloo processes (all-reduce,
  optimizer, boundaries by group size, failure detection);
- `balance_rows`: balance.py's step times (balanced, uniform, after the slowdown);
- `elastic_rows`: elastic.py's scale-out and scale-in stalls, group formation;
- `failure_rows`: elastic.py's failure stall (the step in flight lost, the notice);
- `join_rows`: join_stream.py's streamed join (boundary stall, stream steps, members' lost time);
- `report`: what calibrates what, the notes on misses, the printed tables.

The names below are the package's API, which sim_validation.py and
tests/test_sim_validation.py use.
"""

# recovery_notice_seconds reads flexpar.control's poll period; the tests set it through this name.
from flexpar.worker import device_link as control

from .balance_rows import (
    balance_calibration,
    balance_noise,
    balance_step_records,
    compare_balance,
    ddp_slowest_seconds_per_vw,
    independent_log_deviations,
    noise_sigma,
    per_vw_samples,
    predict_balance,
    simulated_step_times,
)
from .comparison import FLOOR_S, GOAL, Comparison, error_of, median_interval, verdict
from .elastic_rows import (
    boundary_calibration,
    compare_elastic,
    nonnegative_line_fit,
    step_interval_noise_s,
    transfer_path_seconds,
)
from .failure_rows import (
    failed_step_inputs,
    failed_steps_inputs,
    fault_death_fraction,
    predict_failure_stall,
    recovery_notice_seconds,
)
from .inputs import JOIN_SIZES, gather_inputs, gather_join_stream, load_json, read_step_records, run_benchmark
from .join_rows import compare_joins, join_calibration_rows, join_scenario, predict_join, why_join
from .probe import BOUNDARY_REPEATS, PROBE_RUNS, boundaries_by_size, boundary_seconds, combine_probes, run_probe
from .report import _against_interval, calibration_rows, explanations, print_report

__all__ = [
    "BOUNDARY_REPEATS",
    "FLOOR_S",
    "JOIN_SIZES",
    "GOAL",
    "PROBE_RUNS",
    "Comparison",
    "_against_interval",
    "balance_calibration",
    "balance_noise",
    "balance_step_records",
    "boundaries_by_size",
    "boundary_calibration",
    "boundary_seconds",
    "calibration_rows",
    "combine_probes",
    "compare_balance",
    "compare_elastic",
    "compare_joins",
    "control",
    "ddp_slowest_seconds_per_vw",
    "error_of",
    "explanations",
    "failed_step_inputs",
    "failed_steps_inputs",
    "fault_death_fraction",
    "gather_inputs",
    "gather_join_stream",
    "independent_log_deviations",
    "join_calibration_rows",
    "join_scenario",
    "load_json",
    "median_interval",
    "noise_sigma",
    "nonnegative_line_fit",
    "per_vw_samples",
    "predict_balance",
    "predict_failure_stall",
    "predict_join",
    "print_report",
    "read_step_records",
    "recovery_notice_seconds",
    "run_benchmark",
    "run_probe",
    "simulated_step_times",
    "step_interval_noise_s",
    "transfer_path_seconds",
    "verdict",
    "why_join",
]
