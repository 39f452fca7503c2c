"""What the driver tells the user when the job stops before it ended well: pure wording of what it saw.

The driver's loop (driver_loop.py) decides that the job stops (the coordinator
stopped it, a member reported an error, rank 0 ended without handing the model
over) and raises `TrainingError`; the message it raises with is made here, from
the reason and what the driver knows of its devices.
"""

from __future__ import annotations

import os

from flexpar.core import membership
from flexpar.worker.settings import EXIT_MAIN_GUARD, MAIN_GUARD_MESSAGE

RANK_0_GONE = (
    "the job stopped: its devices ended after the last step, but rank 0 never handed the "
    "trained model over (it failed while finishing); resume from the latest checkpoint, if any"
)


def stop_message(reason: str, exit_codes: dict, refused: list) -> str:
    """Why the coordinator stopped the job (`reason`), in the words a user can act on.

    `exit_codes`: device id -> exit code of the local workers that ended; a worker that
    exited for a script without the `__main__` guard names that cause instead. `refused`: the
    devices refused at their warm-up, each already said in its own line.
    """
    if EXIT_MAIN_GUARD in exit_codes.values():
        return MAIN_GUARD_MESSAGE
    if reason == membership.NO_DEVICE_STARTED and refused:
        # Each refusal was said in its own line, with its reason: the `__main__` hint is not the cause.
        # In id order: the refusals came in whatever order the devices said they were ready.
        names = " and ".join(sorted(refused, key=membership.id_order))
        return f"the job stopped: no device could start ({names} refused, above)"
    return f"the job stopped: {reason}"


def device_error(message: dict, run_dir: str, verbose: bool) -> str:
    """A member's error, said once; its traceback goes to the run directory's error.log (and here with `verbose`)."""
    detail = message.get("traceback", "").strip()
    if not detail:  # an error said in full in its message (a sharded job's lost state)
        return f"device {message['device_id']}: {message['message']}"
    path = os.path.join(run_dir, "error.log")
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(f"device {message['device_id']}: {message['message']}\n\n{detail}\n\n")
    text = f"device {message['device_id']}: {message['message']}"
    if verbose:
        return f"{text}\n\n--- the device's traceback ---\n{detail}"
    return f"{text}\n(the device's traceback is in {path}; --verbose shows it here)"
