"""The JSON document and the printed table of benchmarks/elastic.py."""

from __future__ import annotations

from elastic_plan import FAILURES, GLOBAL_BATCH, SCALE_INS, SCALE_OUTS, VIRTUAL_WORKERS
from harness import fmt, measured, median, median_of, print_table


def change_values(rounds: list, changes: tuple, key: str) -> list:
    """`key` of the named changes of every round, in order, where it was measured (not None or NaN)."""
    values = [r[change][key] for r in rounds for change in changes if change in r and key in r[change]]
    return [value for value in values if measured(value)]


def _medians(rounds: list, changes: tuple, key: str):
    """Median of `key` over the named changes of every round."""
    values = change_values(rounds, changes, key)
    return median(values) if values else None


def summarise(settings, flexpar_rounds, torchrun_rounds, floor, parameter_count) -> dict:
    scale_out = [dict(r[name]) for name in SCALE_OUTS for r in flexpar_rounds if name in r]
    scale_out_stall = median([c["stall_s"] for c in scale_out]) if scale_out else None
    restart_stall = median_of(torchrun_rounds, "stall_s")
    step_time = median_of(flexpar_rounds, "step_time_2_s")
    scale_in_stall = _medians(flexpar_rounds, SCALE_INS, "stall_s")
    return {
        "baseline": (
            "torchrun elastic (python -m torch.distributed.run --nnodes=2:3 --nproc-per-node=1, c10d "
            "rendezvous on 127.0.0.1, a third agent joins on the same host; DDP over gloo, checkpoint "
            "(torch.save of model+optimizer) after every step, loaded by the restarted workers). It "
            "needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: without it, torch 2.13 agents reuse the "
            "first round's cached store address and the joining agent times out (role_info / "
            "MASTER_ADDR), which is the failure shared/DESIGN.md records."
        ),
        "model": settings.model_name,
        "parameter_count": parameter_count,
        "state_bytes": floor["state_bytes"],
        "global_batch": GLOBAL_BATCH,
        "virtual_workers": VIRTUAL_WORKERS,
        "rounds": settings.rounds,
        "scale_out_stall_s": scale_out_stall,
        "scale_out_event_stall_s": median([c["event_stall_s"] for c in scale_out]) if scale_out else None,
        "scale_out_request_to_first_step_s": (
            median([c["request_to_first_step_s"] for c in scale_out]) if scale_out else None
        ),
        "restart_stall_s": restart_stall,
        "restart_request_to_first_step_s": median_of(torchrun_rounds, "request_to_first_step_s"),
        "restart_step_time_s": median_of(torchrun_rounds, "step_time_2_s"),
        "restart_step_time_3_workers_s": median_of(torchrun_rounds, "normal_step_s"),
        "restart_checkpoint_save_s": median_of(torchrun_rounds, "save_s"),
        "restart_steps_lost": [r["steps_lost"] for r in torchrun_rounds],
        "scale_out_speedup": (restart_stall / scale_out_stall) if restart_stall and scale_out_stall else None,
        "scale_in_stall_s": scale_in_stall,
        "scale_in_event_stall_s": _medians(flexpar_rounds, SCALE_INS, "event_stall_s"),
        "scale_in_request_to_first_step_s": _medians(flexpar_rounds, SCALE_INS, "request_to_first_step_s"),
        "scale_in_goal_s": (step_time + 0.2) if step_time is not None else None,
        "step_time_s": step_time,
        "step_time_3_devices_s": median_of(flexpar_rounds, "step_time_3_s"),
        "failure_resume_s": _medians(flexpar_rounds, FAILURES, "stall_s"),
        "failure_event_stall_s": _medians(flexpar_rounds, FAILURES, "event_stall_s"),
        "failure_last_commit_to_first_step_s": _medians(flexpar_rounds, FAILURES, "commit_gap_s"),
        "broadcast_s": floor["send_2_s"],
        "broadcast_3_processes_s": floor["broadcast_3_s"],
        "process_group_formation_s": floor["pg_again_s"],
        # The calls of flexpar.state: the source's capture and send_state, the
        # receiver's receive_state (from the same start, so it spans the source's
        # part) and restore; fresh_receive_s and fresh_restore_s are the same in a new
        # process that has built the model, as a joiner receives.
        "flexpar_transfer_parts_s": {
            key.replace("flexpar_", ""): floor[key]
            for key in (
                "flexpar_capture_s",
                "flexpar_send_s",
                "flexpar_receive_s",
                "flexpar_restore_s",
                "flexpar_fresh_receive_s",
                "flexpar_fresh_restore_s",
            )
        },
        "direct_tensor_send_s": floor["direct_tensor_send_s"],
        "restart_parts_s": {
            key: median([r["parts_s"][key] for r in torchrun_rounds])
            for key in (torchrun_rounds[0]["parts_s"] if torchrun_rounds else {})
        },
        "flexpar_rounds": flexpar_rounds,
        "torchrun_rounds": torchrun_rounds,
    }


def print_report(summary: dict) -> None:
    rows = [
        {
            "figure": "scale out 2->3: stall (step records)",
            "flexpar": summary["scale_out_stall_s"],
            "torchrun restart": summary["restart_stall_s"],
            "note": f"speedup {fmt(summary['scale_out_speedup'])}x (goal >= 10)",
        },
        {"figure": "scale out 2->3: stall (event stall_s)", "flexpar": summary["scale_out_event_stall_s"]},
        {
            "figure": "scale out: request -> first new step",
            "flexpar": summary["scale_out_request_to_first_step_s"],
            "torchrun restart": summary["restart_request_to_first_step_s"],
        },
        {
            "figure": "scale in 3->2: stall (step records)",
            "flexpar": summary["scale_in_stall_s"],
            "note": f"goal <= one step + 0.2 = {fmt(summary['scale_in_goal_s'])}",
        },
        {"figure": "scale in 3->2: stall (event stall_s)", "flexpar": summary["scale_in_event_stall_s"]},
        {"figure": "scale in: request -> first new step", "flexpar": summary["scale_in_request_to_first_step_s"]},
        {"figure": "failure 3->2 (kill -9): stall (step records)", "flexpar": summary["failure_resume_s"]},
        {"figure": "failure 3->2: stall (event stall_s)", "flexpar": summary["failure_event_stall_s"]},
        {
            "figure": "step time, 2 devices (commit to commit)",
            "flexpar": summary["step_time_s"],
            "torchrun restart": summary["restart_step_time_s"],
            "note": f"baseline incl. its checkpoint save, {fmt(summary['restart_checkpoint_save_s'])} s",
        },
        {
            "figure": "step time, 3 devices (on 2 cores)",
            "flexpar": summary["step_time_3_devices_s"],
            "torchrun restart": summary["restart_step_time_3_workers_s"],
        },
        {
            "figure": "floor: gloo send of the state, 1 -> 1",
            "flexpar": summary["broadcast_s"],
            "note": f"{summary['state_bytes'] / 1e6:.0f} MB",
        },
        {"figure": "floor: gloo broadcast, 1 -> 2", "flexpar": summary["broadcast_3_processes_s"]},
        {
            "figure": "state tensors sent straight into the joiner's",
            "flexpar": summary["direct_tensor_send_s"],
            "note": "into tensors that exist already: no allocation, no restore",
        },
        {"figure": "new process group in running processes", "flexpar": summary["process_group_formation_s"]},
    ]
    print_table(
        rows,
        ["figure", "flexpar", "torchrun restart", "note"],
        title=f"\nElastic changes, {summary['parameter_count'] / 1e6:.1f}M parameters + Adam, "
        f"medians of {summary['rounds']} rounds (seconds)",
    )
    print(
        "\nflexpar state transfer, by part (seconds):",
        ", ".join(f"{k} {v:.3f}" for k, v in summary["flexpar_transfer_parts_s"].items()),
    )
    print(
        "torchrun restart stall, by part (seconds):",
        ", ".join(f"{k} {v:.3f}" for k, v in summary["restart_parts_s"].items()),
    )
    print(f"\nbaseline: {summary['baseline']}")
