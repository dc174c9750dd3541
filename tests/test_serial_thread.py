"""``SerialThread`` (omnishm/client/serial.py), the client's one-thread queue: a stop is bounded behind a handler
that never returns, the idle thread keeps no item it handled, and a process that never stopped one still exits.
MUTATIONS (stop 57): ``join()`` without its timeout, ``del item`` dropped, ``daemon=False``."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import weakref


def test_stop_is_bounded_by_its_timeout_behind_a_handler_that_does_not_return():
    from omnishm.client.serial import SerialThread

    release = threading.Event()
    entered = threading.Event()

    def handle(_item):
        entered.set()
        release.wait()

    st = SerialThread("mut-int-stuck", handle)
    assert st.put(1)
    assert entered.wait(10)
    stopper = threading.Thread(target=st.stop, args=(0.2,), daemon=True)
    t0 = time.monotonic()
    stopper.start()
    stopper.join(20)
    returned = not stopper.is_alive()
    release.set()  # let both finish either way
    stopper.join(20)
    assert returned, "stop(0.2) did not return behind a stuck handler"
    assert time.monotonic() - t0 < 20


class _Item:
    pass


def test_a_handled_item_is_not_kept_alive_by_the_idle_thread():
    from omnishm.client.serial import SerialThread

    handled = threading.Event()
    st = SerialThread("mut-int-drop", lambda item: handled.set())
    item = _Item()
    gone = threading.Event()
    weakref.finalize(item, gone.set)  # set when the last reference goes, on whichever thread drops it
    assert st.put(item)
    del item
    assert handled.wait(10)
    # The thread runs ``del item`` right after the handler returns, then blocks in ``get``.
    released = gone.wait(10)
    st.stop(10)
    assert released, "the idle serial thread still holds the item it handled"


def test_a_process_that_never_stops_its_serial_thread_still_exits():
    code = ("from omnishm.client.serial import SerialThread\n"
            "st = SerialThread('mut-int-exit', lambda item: None)\n"
            "st.put(1)\n"
            "print('done', flush=True)\n")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        raise AssertionError("a process with a serial thread never stopped did not exit") from None
    assert out.returncode == 0 and "done" in out.stdout, out.stderr
