"""The GPU gate: one at a time, bounded FIFO queue, 'full' at once, cancellation and closing while queued."""

from __future__ import annotations

import threading
import time

import pytest

from orin.serve.admission import Abandoned, Closed, Gate, QueueFull


def _hold(gate: Gate, entered: threading.Event, release: threading.Event, order: list, name: str,
          cancel: threading.Event | None = None, errors: list | None = None) -> threading.Thread:
    def run():
        try:
            with gate.turn(cancel):
                order.append(name)
                entered.set()
                release.wait(5)
        except (QueueFull, Closed, Abandoned) as exc:
            (errors if errors is not None else order).append((name, type(exc).__name__))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _wait_for(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_one_at_a_time_fifo_then_full():
    gate = Gate(max_queue=2, poll_s=0.01)
    release = threading.Event()
    order: list = []
    first_in = threading.Event()
    t1 = _hold(gate, first_in, release, order, "a")
    assert first_in.wait(5)
    t2 = _hold(gate, threading.Event(), release, order, "b")
    _wait_for(lambda: gate.queued == 1)
    t3 = _hold(gate, threading.Event(), release, order, "c")
    _wait_for(lambda: gate.queued == 2)
    with pytest.raises(QueueFull):
        with gate.turn():
            pass
    assert gate.busy
    release.set()
    for t in (t1, t2, t3):
        t.join(5)
    assert order == ["a", "b", "c"]
    assert not gate.busy and gate.queued == 0


def test_zero_queue_refuses_while_busy():
    gate = Gate(max_queue=0, poll_s=0.01)
    release, entered = threading.Event(), threading.Event()
    t = _hold(gate, entered, release, [], "a")
    assert entered.wait(5)
    with pytest.raises(QueueFull):
        with gate.turn():
            pass
    release.set()
    t.join(5)
    with gate.turn():  # free again
        pass


def test_a_cancelled_waiter_leaves_the_queue():
    gate = Gate(max_queue=1, poll_s=0.01)
    release, entered = threading.Event(), threading.Event()
    order, errors = [], []
    t1 = _hold(gate, entered, release, order, "a")
    assert entered.wait(5)
    cancel = threading.Event()
    t2 = _hold(gate, threading.Event(), release, order, "b", cancel=cancel, errors=errors)
    _wait_for(lambda: gate.queued == 1)
    cancel.set()
    t2.join(5)
    assert errors == [("b", "Abandoned")]
    assert gate.queued == 0
    release.set()
    t1.join(5)
    assert order == ["a"]


def test_close_wakes_the_queue_and_refuses_new_work_but_lets_the_running_one_finish():
    gate = Gate(max_queue=3, poll_s=0.01)
    release, entered = threading.Event(), threading.Event()
    order, errors = [], []
    t1 = _hold(gate, entered, release, order, "a")
    assert entered.wait(5)
    t2 = _hold(gate, threading.Event(), release, order, "b", errors=errors)
    _wait_for(lambda: gate.queued == 1)
    gate.close()
    t2.join(5)
    assert errors == [("b", "Closed")]
    with pytest.raises(Closed):
        with gate.turn():
            pass
    assert gate.busy
    release.set()
    t1.join(5)
    assert order == ["a"] and not gate.busy


def test_the_gate_is_released_when_the_body_raises():
    gate = Gate(max_queue=0)
    with pytest.raises(RuntimeError):
        with gate.turn():
            raise RuntimeError("boom")
    assert not gate.busy
    with gate.turn():
        pass


def test_spare_work_runs_only_when_idle_and_gives_way_to_a_request():
    """Spare work (the server's deferred graph captures) starts only on a free GPU with nobody waiting, does not
    count as busy (no 429 with --max-queue 0, no 'busy' for Realtime), and its stop() turns true as soon as a
    request queues, which then runs once the work has returned."""
    gate = Gate(max_queue=0, poll_s=0.01)
    steps: list = []
    queued = threading.Event()

    def work(stop):
        steps.append("start")
        assert not gate.busy
        queued.set()
        _wait_for(stop)  # returns at its next step once the request below queues
        steps.append("stopped")

    order: list = []
    runner = threading.Thread(target=gate.spare, args=(work,), daemon=True)
    runner.start()
    assert queued.wait(5)
    go = threading.Event()
    go.set()
    req = _hold(gate, threading.Event(), go, order, "request")
    req.join(5)
    runner.join(5)
    assert steps == ["start", "stopped"] and order == ["request"]

    release, entered = threading.Event(), threading.Event()
    holder = _hold(gate, entered, release, order, "held")
    assert entered.wait(5)
    gate.spare(lambda stop: steps.append("ran while busy"))  # not started: a request holds the GPU
    release.set()
    holder.join(5)
    assert "ran while busy" not in steps
    gate.close()
    gate.spare(lambda stop: steps.append("ran after close"))
    assert "ran after close" not in steps


def test_wait_spare_returns_once_closed_work_has_stopped():
    gate = Gate(max_queue=1, poll_s=0.01)
    started, done = threading.Event(), []

    def work(stop):
        started.set()
        _wait_for(stop)
        time.sleep(0.05)  # the step in progress when close() came
        done.append(True)

    t = threading.Thread(target=gate.spare, args=(work,), daemon=True)
    t.start()
    assert started.wait(5)
    gate.close()
    gate.wait_spare()
    assert done == [True]
    t.join(5)
