"""The benchmarks' shared harness: what every experiment would otherwise repeat.

A benchmark file (overhead.py, elastic.py, ...) holds its experiment only; it
takes the rest from here:

- command line and entry point (`cli`): `base_parser` (`--json PATH`,
  `--quick`), `run(main)` (every process the benchmark started ends with it,
  even on error, Ctrl-C or SIGTERM);
- timing (`timing`): `alternate` (rounds alternating ours and the baseline),
  `ratio_of_medians`, `timed`, `step_durations`, `slowest_rank`, `median`,
  `median_of`, `ratio`;
- output (`output`): `print_table`, `fmt`, `write_json`, `progress`;
- processes (`processes`): `free_port`, `cpu_count`, `started`
  (multiprocessing children always ended), `run_in_own_group`,
  `kill_group`, `workers`, `end_descendants`;
- folders (`folders`): `run_folder` (removed at the end), `unique_path`;
- `PeakMemoryWatcher`, `peak_rss_bytes` (`memory`); `run_ddp`,
  `ddp_training_rank` (`ddp`: the torch DDP baseline's standard loop);
  `step_records`, `metrics_records`, `json_lines` (`records`: flexpar's metrics and other JSON lines).

Importing it is light (the standard library only); torch and flexpar are
imported by the functions that use them.
"""

from .cli import base_parser, run
from .ddp import ddp_training_rank, run_ddp
from .folders import run_folder, unique_path
from .memory import PeakMemoryWatcher, peak_rss_bytes
from .output import fmt, print_table, progress, write_json
from .processes import (
    command_line,
    commands_said,
    cpu_count,
    descendants,
    end_descendants,
    free_port,
    kill_group,
    run_in_own_group,
    started,
    workers,
)
from .records import json_lines, metrics_records, step_records
from .timing import (
    alternate,
    measured,
    median,
    median_of,
    ratio,
    ratio_of_medians,
    slowest_rank,
    step_durations,
    timed,
)

__all__ = [
    "PeakMemoryWatcher",
    "alternate",
    "base_parser",
    "command_line",
    "commands_said",
    "cpu_count",
    "ddp_training_rank",
    "descendants",
    "end_descendants",
    "fmt",
    "free_port",
    "json_lines",
    "kill_group",
    "measured",
    "median",
    "median_of",
    "metrics_records",
    "peak_rss_bytes",
    "print_table",
    "progress",
    "ratio",
    "ratio_of_medians",
    "run",
    "run_ddp",
    "run_folder",
    "run_in_own_group",
    "slowest_rank",
    "started",
    "step_records",
    "step_durations",
    "timed",
    "unique_path",
    "workers",
    "write_json",
]
