"""Experiment trackers: the job's records in TensorBoard, MLflow, Weights & Biases or a CSV file.

`fit(..., trackers=["tensorboard", "mlflow", "wandb", "csv"])` (CLI: `--tracker NAME`,
repeatable) adds one callback per name; each writes into the run directory
(`summary["run_dir"]`):

    tensorboard   run_dir/tensorboard/       event files (`tensorboard --logdir run_dir/tensorboard`)
    mlflow        run_dir/mlruns/            an MLflow file store, one run named after the run directory
                                             (or the server/database MLFLOW_TRACKING_URI names)
    wandb         run_dir/wandb/             a W&B run in project "flexpar" (or WANDB_PROJECT), named after
                                             the run directory; WANDB_MODE=offline needs no network
    csv           run_dir/csv/metrics.csv    one row per value: time, kind, step, name, value, detail

The CSV file sits in its own folder, so it cannot be the job's metrics file
(`--metrics run/metrics.csv` makes `run` the run directory); a CSV left there
by an earlier run with the same run directory is kept, and this run's goes to
`metrics-2.csv` (`-3`, ...), which it says on stderr (`CSVTracker.path`).

What each tracker logs of a record (names, values, the step on the x axis)
is decided in tracker_values.py; here each tracker writes them with its
library. TensorBoard also gets each event as text (tag `events`). The
libraries are optional extras: naming a tracker whose library is missing is an
error before any worker starts, naming what to install.
"""

from __future__ import annotations

import contextlib
import csv
import importlib.util
import os
import sys
import time
from typing import Iterable, Optional

from flexpar.observe.tracker_values import Tracker, eval_values, step_values

# name -> (module that must import, what to install)
REQUIREMENTS = {
    "tensorboard": ("tensorboard", 'pip install -e ".[tensorboard]" in flexpar\'s checkout (the tensorboard package)'),
    "mlflow": ("mlflow", 'pip install -e ".[mlflow]" in flexpar\'s checkout (the mlflow or mlflow-skinny package)'),
    "wandb": ("wandb", 'pip install -e ".[wandb]" in flexpar\'s checkout (the wandb package)'),
    "csv": (None, ""),
}
TRACKER_NAMES = tuple(REQUIREMENTS)


def check_names(names) -> tuple:
    """The tracker names as a tuple, checked: known names, each library importable (ValueError otherwise)."""
    if not names:
        return ()
    if isinstance(names, str):
        names = [part.strip() for part in names.split(",") if part.strip()]
    checked = []
    for name in names:
        if name not in REQUIREMENTS:
            raise ValueError(f"unknown tracker {name!r}: choose from {', '.join(TRACKER_NAMES)}")
        module, install = REQUIREMENTS[name]
        if module is not None and importlib.util.find_spec(module) is None:
            raise ValueError(f"the {name} tracker needs the {module} package, which is not installed: {install}")
        if name not in checked:
            checked.append(name)
    return tuple(checked)


def create(names: Iterable[str], run_dir: str, resume: bool = False) -> list:
    """One tracker callback per name, writing under `run_dir`; `resume`: a resumed job (a restarted
    driver) continues what its earlier driver wrote there (the CSV file, the MLflow run)."""
    makers = {"tensorboard": TensorBoardTracker, "mlflow": MLflowTracker, "wandb": WandbTracker, "csv": CSVTracker}
    return [makers[name](run_dir, resume=resume) for name in check_names(tuple(names))]


def fresh_path(folder: str, name: str) -> str:
    """folder/name, or folder/<stem>-2<ext> (-3, ...) when that exists: an earlier run's file is kept."""
    stem, extension = os.path.splitext(name)
    path, number = os.path.join(folder, name), 1
    while os.path.exists(path):
        number += 1
        path = os.path.join(folder, f"{stem}-{number}{extension}")
    return path


class CSVTracker(Tracker):
    """run_dir/csv/metrics.csv: `time,kind,step,name,value,detail`, one row per value, flushed per record.

    Its own folder: the job's metrics file is in run_dir itself, whatever its
    name, so the two cannot be one file. A CSV of an earlier run there is not
    overwritten: this run writes the next free `metrics-N.csv` and says so.
    """

    name = "csv"
    never_stops = True  # for its own on_eval too (flexpar.callbacks.vouched_never_stops)
    COLUMNS = ("time", "kind", "step", "name", "value", "detail")
    FOLDER, FILE = "csv", "metrics.csv"

    def __init__(self, run_dir: str, resume: bool = False):
        super().__init__(run_dir, resume)
        folder = os.path.join(run_dir, self.FOLDER)
        os.makedirs(folder, exist_ok=True)
        if resume and os.path.exists(os.path.join(folder, self.FILE)):  # a resumed job continues its CSV
            self.path = os.path.join(folder, self.FILE)
            self._file = open(self.path, "a", encoding="utf-8", newline="")
            self._writer = csv.writer(self._file)
            return
        self.path = fresh_path(folder, self.FILE)
        if os.path.basename(self.path) != self.FILE:
            print(
                f"flexpar: the csv tracker keeps {os.path.join(folder, self.FILE)} (an earlier run's) and "
                f"writes {self.path}",
                file=sys.stderr,
                flush=True,
            )
        # "x": never truncate a file that appeared since (another run starting in the same folder).
        self._file = open(self.path, "x", encoding="utf-8", newline="")
        self._writer = csv.writer(self._file)
        self._writer.writerow(self.COLUMNS)
        self._file.flush()

    def _rows(self, kind: str, values: dict, step: int, wall: float, detail: str = "") -> None:
        if self._file is None:
            return
        for name, value in values.items():
            self._writer.writerow((f"{wall:.6f}", kind, step, name, repr(float(value)), detail))
        self._file.flush()

    def on_step(self, record):
        self._rows("train", step_values(record), record["step"], record["time"])

    def on_eval(self, record):
        self._rows("eval", eval_values(record), record["step"], record["time"])

    def on_event(self, record):
        self._rows(
            "event",
            {f"event/{record['event']}/stall_s": record["stall_s"]},
            record["step"],
            record["time"],
            record["detail"],
        )

    def finish_tracking(self, failed: bool = False) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class TensorBoardTracker(Tracker):
    """run_dir/tensorboard/: event files written by torch.utils.tensorboard's SummaryWriter."""

    name = "tensorboard"

    def __init__(self, run_dir: str, resume: bool = False):
        super().__init__(run_dir, resume)
        self.log_dir = os.path.join(run_dir, "tensorboard")  # a resumed job adds an event file beside
        self._writer = None

    def _open(self):
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=self.log_dir, flush_secs=5)
        return self._writer

    def log(self, values: dict, step: int, wall: float) -> None:
        writer = self._open()
        for name, value in values.items():
            writer.add_scalar(name, value, global_step=step, walltime=wall)

    def on_event(self, record):
        super().on_event(record)
        text = f"{record['event']} at step {record['step']}: {record['detail']}".rstrip(": ")
        self._open().add_text("events", text, global_step=record["step"], walltime=record["time"])

    def finish_tracking(self, failed: bool = False) -> None:
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None


class MLflowTracker(Tracker):
    """An MLflow run (experiment "flexpar") in run_dir/mlruns, or where MLFLOW_TRACKING_URI says.

    MLflow 3 keeps its plain-file store only on request: flexpar asks for it
    (MLFLOW_ALLOW_FILE_STORE=true, unless set otherwise) when it uses one, and
    only for its own calls into MLflow (`_file_store_allowed`): the variable is
    set around each and removed after, so the user's process, and MLflow code
    of their own in it, see their own environment.
    Values are batched and sent at most every `flush_s` seconds, and at the end.
    """

    name = "mlflow"
    EXPERIMENT = "flexpar"

    def __init__(self, run_dir: str, flush_s: float = 1.0, resume: bool = False):
        super().__init__(run_dir, resume)
        self.tracking_uri = os.environ.get("MLFLOW_TRACKING_URI") or "file:" + os.path.abspath(
            os.path.join(run_dir, "mlruns")
        )
        self.flush_s = flush_s
        self._client = None
        self.run_id: Optional[str] = None
        self._pending: list = []
        self._last_flush = time.monotonic()

    @contextlib.contextmanager
    def _file_store_allowed(self):
        """MLFLOW_ALLOW_FILE_STORE=true for the block, when the store is a file store and the user set nothing.

        Every call into MLflow runs in it, not only the client's creation:
        MLflow builds its store object on demand (cached per URI, evicted
        after 100 others), and the check runs in that object's constructor.
        """
        if not self.tracking_uri.startswith("file:") or "MLFLOW_ALLOW_FILE_STORE" in os.environ:
            yield
            return
        os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
        try:
            yield
        finally:
            os.environ.pop("MLFLOW_ALLOW_FILE_STORE", None)

    def _open(self):
        if self._client is None:
            with self._file_store_allowed():
                self._create_run()
        return self._client

    def _create_run(self) -> None:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=self.tracking_uri)
        experiment = client.get_experiment_by_name(self.EXPERIMENT)
        experiment_id = experiment.experiment_id if experiment else client.create_experiment(self.EXPERIMENT)
        if self.resume:  # a resumed job continues the run its earlier driver left RUNNING
            tag = os.path.abspath(self.run_dir).replace("'", "\\'")
            found = client.search_runs(
                [experiment_id], f"tags.`flexpar.run_dir` = '{tag}' and attributes.status = 'RUNNING'", max_results=1
            )
            if found:
                self._client, self.run_id = client, found[0].info.run_id
                return
        run = client.create_run(
            experiment_id,
            run_name=os.path.basename(os.path.abspath(self.run_dir)),
            tags={"flexpar.run_dir": os.path.abspath(self.run_dir)},
        )
        self._client, self.run_id = client, run.info.run_id

    def log(self, values: dict, step: int, wall: float) -> None:
        from mlflow.entities import Metric

        self._open()
        stamp = int(wall * 1000)
        self._pending.extend(Metric(name, float(value), stamp, int(step)) for name, value in values.items())
        if time.monotonic() - self._last_flush > self.flush_s or len(self._pending) >= 900:
            self._flush()

    def _flush(self) -> None:
        self._last_flush = time.monotonic()
        with self._file_store_allowed():
            while self._pending:
                batch, self._pending = self._pending[:900], self._pending[900:]  # MLflow takes 1000 a batch
                self._client.log_batch(self.run_id, metrics=batch)

    def finish_tracking(self, failed: bool = False) -> None:
        if self._client is None:
            return
        self._flush()
        with self._file_store_allowed():
            self._client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")
        self._client = None


class WandbTracker(Tracker):
    """A Weights & Biases run: project "flexpar" (or WANDB_PROJECT), named after the run directory.

    Files in run_dir/wandb/ (or WANDB_DIR); syncing is wandb's own setting
    (WANDB_MODE=offline: no network, `wandb sync` uploads later). Started when
    the tracker is made, before any worker: a login problem is one line then.
    A run of its own (`reinit="create_new"`: the user's run is left alone), not
    capturing the terminal (`console="off"`: the display stays). One row per
    record, the metrics file's step as metric `step`, the x axis of every other one; a
    resumed job continues its earlier driver's run (id in flexpar-run-id).
    """

    name = "wandb"
    PROJECT = "flexpar"
    ID_FILE = "flexpar-run-id"

    def __init__(self, run_dir: str, resume: bool = False):
        super().__init__(run_dir, resume)
        self._run = None
        self._open()

    def _open(self):
        if self._run is not None:
            return self._run
        import wandb

        try:
            self._run = self._start_run(wandb)
        except wandb.errors.Error as error:
            raise ValueError(
                f"the wandb tracker cannot start a run ({str(error).rstrip('.')}): log in with `wandb login` (or "
                "set WANDB_API_KEY), or log offline with WANDB_MODE=offline and upload later with `wandb sync`"
            ) from None
        self._run.define_metric("step")
        for prefix in ("train", "eval", "event"):
            self._run.define_metric(f"{prefix}/*", step_metric="step")
        return self._run

    def _start_run(self, wandb):
        """The run: the earlier driver's when this job is resumed, else a new one; its id kept for a resume."""
        folder = os.path.join(self.run_dir, "wandb")
        os.makedirs(folder, exist_ok=True)
        id_path = os.path.join(folder, self.ID_FILE)
        earlier = None
        if self.resume and os.path.exists(id_path):
            with open(id_path, encoding="utf-8") as handle:
                earlier = handle.read().strip() or None
        run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or self.PROJECT,
            name=os.path.basename(os.path.abspath(self.run_dir)),
            dir=None if os.environ.get("WANDB_DIR") else self.run_dir,
            id=earlier,
            resume="allow" if earlier else None,
            reinit="create_new",
            settings=wandb.Settings(console="off"),
        )
        with open(id_path, "w", encoding="utf-8") as handle:
            handle.write(run.id + "\n")
        return run

    def log(self, values: dict, step: int, wall: float) -> None:
        if self._run is not None:  # None once finished
            self._run.log({**values, "step": step})

    def finish_tracking(self, failed: bool = False) -> None:
        if self._run is not None:
            self._run.finish(exit_code=1 if failed else 0)
            self._run = None
