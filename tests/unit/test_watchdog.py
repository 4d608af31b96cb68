"""The collective watchdog: a wait past the timeout is reported once, with its collective."""

import threading
import time

import pytest

from hvctr.distributed.watchdog import CollectiveWatchdog


def test_a_wait_past_the_timeout_is_reported_once_naming_the_collective():
    fired: list[str] = []
    dog = CollectiveWatchdog(rank=3, timeout_s=0.2, program="hvctr train", on_stall=fired.append)
    try:
        with dog.waiting("window7.merge"):
            time.sleep(0.05)
        assert dog.oldest() is None and fired == []  # short waits are work, not stalls
        release = threading.Event()

        def stuck():
            with dog.waiting("window8.pull.keys"):
                with dog.waiting("window8.pull.keys.len"):  # nested: the outer name stands
                    release.wait(5)

        t = threading.Thread(target=stuck)
        t.start()
        deadline = time.monotonic() + 5
        while not fired and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.3)  # a second period: still reported once
        release.set()
        t.join()
    finally:
        dog.close()
    assert len(fired) == 1, fired
    assert "rank 3: collective 'window8.pull.keys' has waited" in fired[0]
    assert "train.stall_timeout_s = 0.2" in fired[0]


def test_a_timeout_must_be_positive():
    with pytest.raises(ValueError, match="timeout"):
        CollectiveWatchdog(rank=0, timeout_s=0)


def test_a_horovod_shutdown_is_recognised_through_the_prefetch_threads_wrapper():
    from hvctr.cli import _horovod_shut_down

    class HorovodInternalError(RuntimeError):  # horovod's class, by name (the cli does not import it)
        pass

    try:
        try:
            raise HorovodInternalError("Horovod has been shut down")
        except HorovodInternalError as inner:
            raise RuntimeError("prefetch thread failed") from inner
    except RuntimeError as outer:
        assert _horovod_shut_down(outer)
    assert not _horovod_shut_down(RuntimeError("something else"))
