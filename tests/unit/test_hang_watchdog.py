"""The hang watchdog's verdict, where it finds a thread, and one rank's dump end to end.

The multi-rank run with a rank that never arrives at a collective is in
tests/reliability/test_stragglers_and_hangs.py.
"""

import argparse
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

from megatron.training import watchdog


def _state(iteration, phase="train-step", collective="", at="pretrain_gpt.py:99 in loss_func"):
    return {"iteration": iteration, "phase": phase, "collective": collective, "at": at}


def test_the_rank_outside_the_collective_is_named():
    states = {0: _state(3, collective="all_reduce"), 1: _state(3, collective="all_reduce"),
              2: _state(3, at="faulty.py:12 in forward_step")}
    lines = watchdog.verdict(states, 3)
    assert lines[0] == ("hang watchdog: rank(s) 2 did not arrive where the others wait")
    assert "rank 2: iteration 3 train-step, not in a collective, at faulty.py:12" in lines[3]
    assert "rank 0: iteration 3 train-step, waiting in torch.distributed.all_reduce" in lines[1]


def test_ranks_at_an_earlier_point_or_silent_are_named():
    states = {0: _state(5, "after-step", "barrier"), 1: _state(5, "train-step", "all_reduce"),
              3: _state(5, "after-step", "barrier")}
    lines = watchdog.verdict(states, 4, marks={2: "4 after-step"})
    assert lines[0] == "hang watchdog: rank(s) 1, 2 did not arrive where the others wait"
    assert lines[-1].startswith("  rank 2: no answer") and "4 after-step" in lines[-1]


def test_same_point_everywhere_names_no_one():
    states = {r: _state(2, collective="all_reduce") for r in range(3)}
    assert watchdog.verdict(states, 3)[0].endswith("none is behind")


def test_a_thread_blocked_in_torch_distributed_is_found_there():
    """A frame of torch.distributed's own code on the stack: the collective and its caller."""
    code = compile("def all_reduce(fn):\n    return fn()\n",
                   os.path.join(os.path.dirname(dist.__file__), "distributed_c10d.py"), "exec")
    scope = {}
    exec(code, scope)
    seen = {}

    def caller_in_training():
        return scope["all_reduce"](lambda: seen.update(watchdog._where(sys._getframe(1))))

    caller_in_training()
    assert seen["collective"] == "all_reduce"
    assert "in caller_in_training" in seen["at"]
    assert watchdog._where(sys._getframe())["collective"] == ""


def _thread_place(target, *args):
    """``watchdog._where`` of a thread blocked in ``target(*args)``."""
    thread = threading.Thread(target=target, args=args, daemon=True)
    thread.start()
    for _ in range(200):
        frame = sys._current_frames().get(thread.ident)
        if frame is not None and frame.f_code.co_name == target.__name__:
            break
        time.sleep(0.01)
    time.sleep(0.1)
    return thread, watchdog._where(sys._current_frames()[thread.ident])


def _await_handle(handle):
    handle.wait()


def _await_event(event):
    event.wait()


def test_a_wait_on_a_compiled_handle_counts_as_communication():
    """Pipeline sends and overlapped reductions wait on torch's compiled work handles from the
    project's own code; a threading.Event's wait (Python code) is not communication."""
    handle, event = torch._C.Future([]), threading.Event()
    thread, place = _thread_place(_await_handle, handle)
    handle.set_result(None)
    thread.join(5)
    assert place["collective"] == "wait" and "in _await_handle" in place["at"]
    thread_b, place_b = _thread_place(_await_event, event)
    event.set()
    thread_b.join(5)
    assert place_b == {"collective": "", "at": place_b["at"]}
    assert "in _await_event" in place_b["at"]
    lines = watchdog.verdict({0: _state(1, collective="wait", at="p2p.py:142 in _wait"),
                              1: _state(1, at="faulty.py:3 in step")}, 2)
    assert lines[0].startswith("hang watchdog: rank(s) 1 did not arrive")
    assert "rank 0: iteration 1 train-step, waiting for an asynchronous communication" in lines[1]


def _sleeping_step(stop):
    stop.wait(30)


def test_one_rank_dumps_its_stacks_and_names_itself(tmp_path, monkeypatch, capsys):
    """One rank whose step outlives the timeout: its stack file holds the blocked code, the
    verdict is printed, and the process would end with the watchdog's exit code."""
    exited = []
    stop = threading.Event()

    def fake_exit(code):
        exited.append(code)
        stop.set()

    monkeypatch.setattr(watchdog, "_exit", fake_exit)
    args = argparse.Namespace(rank=0, world_size=1, hang_dump_timeout_s=0.3,
                              hang_dump_dir=str(tmp_path / "dumps"), save=None,
                              tensorboard_dir=None)
    dog = watchdog.HangWatchdog(args, store=dist.HashStore())
    start = time.monotonic()
    dog.phase(7, "train-step")
    _sleeping_step(stop)
    elapsed = time.monotonic() - start
    dog.close()
    assert exited == [watchdog.HANG_EXIT_CODE]
    assert elapsed < 0.3 + 5.0
    text = (tmp_path / "dumps" / "hang_rank0.txt").read_text()
    assert text.startswith("rank 0 of 1 on ")
    assert "iteration 7 train-step" in text.splitlines()[0]
    assert "in _sleeping_step" in text and "hang-watchdog" not in text.splitlines()[0]
    err = capsys.readouterr().err
    assert "none is behind" in err   # alone: no one to wait for
    assert "rank 0: iteration 7 train-step, not in a collective, at " in err
    assert "_sleeping_step" in err
