"""The planner's ranking rule on two grids at a time: AxoNN's key (the time of all collectives)
first, the communication the overlap leaves exposed on a tie. The rows are built as `plan` builds
them: per-collective times, then `step_time` against one computation time."""

from __future__ import annotations

from memaudit.parallel.planner import rank_key, step_time


def _row(times: dict[tuple[str, str], float], compute: float, memory: int) -> dict:
    return {"fits": True, "comm_time_s": sum(times.values()), "memory_bytes": {"total": memory},
            **step_time(times, compute)}


def test_equal_step_time_is_told_apart_by_communication():
    """Computation (10 s) hides both grids' overlapped collectives, so both steps take 10 + 1 s; the
    one that moves less (a data all-reduce, not z all-gathers) ranks first, whatever the memory."""
    gathers = _row({("x", "all_reduce"): 1.0, ("z", "all_gather"): 5.0}, compute=10.0, memory=1)
    data = _row({("x", "all_reduce"): 1.0, ("data", "all_reduce"): 2.0}, compute=10.0, memory=2)
    assert gathers["step_time_s"] == data["step_time_s"] == 11.0
    assert min([gathers, data], key=rank_key) is data
    assert min([data, gathers], key=rank_key) is data


def test_equal_communication_is_told_apart_by_exposed_communication():
    """Both grids communicate for 3 s; the one whose 3 s are z all-gathers (overlapped, hidden by
    10 s of computation) ranks before the one whose 3 s are x all-reduces (blocking)."""
    blocking = _row({("x", "all_reduce"): 3.0}, compute=10.0, memory=1)
    overlapped = _row({("z", "all_gather"): 2.0, ("z", "reduce_scatter"): 1.0}, compute=10.0, memory=2)
    assert blocking["comm_time_s"] == overlapped["comm_time_s"]
    assert (blocking["exposed_comm_s"], overlapped["exposed_comm_s"]) == (3.0, 0.0)
    assert min([blocking, overlapped], key=rank_key) is overlapped
    assert min([overlapped, blocking], key=rank_key) is overlapped


def test_a_rounding_difference_is_a_tie():
    """Communication summed in another order (a last-place difference) still ties, and exposed
    communication decides."""
    a = _row({("z", "all_gather"): 0.1, ("z", "reduce_scatter"): 0.2}, compute=10.0, memory=1)
    b = _row({("x", "all_reduce"): 0.3}, compute=10.0, memory=0)
    assert a["comm_time_s"] != b["comm_time_s"]  # 0.30000000000000004 and 0.3
    assert min([b, a], key=rank_key) is a


def test_without_a_peak_rate_grids_rank_by_communication():
    no_peak = {"fits": True, "comm_time_s": 2.0, "exposed_comm_s": None, "memory_bytes": {"total": 0}}
    less = dict(no_peak, comm_time_s=1.0, memory_bytes={"total": 9})
    unfit = dict(no_peak, comm_time_s=0.5, fits=False)
    assert sorted([unfit, no_peak, less], key=rank_key) == [less, no_peak, unfit]
