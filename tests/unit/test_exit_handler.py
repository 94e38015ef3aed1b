"""megatron.training.exit_handler (--exit-signal-handler-for-training) in this process: the
signal finishes the saver's save in flight and exits with status 0; handlers are restored."""

import argparse
import os
import signal

import pytest

from megatron.training import exit_handler


class _Saver:
    def __init__(self, in_flight):
        self.in_flight, self.waited = in_flight, 0

    def wait(self):
        self.waited += 1


def test_not_installed_without_the_flag():
    before = signal.getsignal(signal.SIGTERM)
    assert exit_handler.install(argparse.Namespace(exit_signal_handler_for_training=False)) \
        is None
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_waits_for_the_save_and_exits_zero(sig, capsys):
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    handler = exit_handler.install(argparse.Namespace(exit_signal_handler_for_training=True))
    saver = _Saver(in_flight=4)
    exit_handler.watch_saver(saver)
    try:
        with pytest.raises(SystemExit) as stop:
            os.kill(os.getpid(), sig)
    finally:
        handler.release()
    assert stop.value.code == 0
    assert saver.waited == 1
    assert f"{signal.Signals(sig).name} received" in capsys.readouterr().out
    assert {s: signal.getsignal(s) for s in before} == before


def test_no_wait_without_a_save_in_flight():
    handler = exit_handler.install(argparse.Namespace(exit_signal_handler_for_training=True))
    saver = _Saver(in_flight=None)
    exit_handler.watch_saver(saver)
    try:
        with pytest.raises(SystemExit):
            os.kill(os.getpid(), signal.SIGTERM)
    finally:
        handler.release()
    assert saver.waited == 0
