"""One device's process: its start-up, lifecycle, step loop, data loading, evaluation and checkpoints.

`process.main` is what a worker process runs; `lifecycle.Worker` is the
device's training from warm-up to exit; `step_loop` holds one step, from
its VWs to the optimizer update.
"""
