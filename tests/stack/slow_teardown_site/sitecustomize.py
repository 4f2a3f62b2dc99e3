"""Runs at interpreter start-up in every process that has this folder on ``PYTHONPATH``
(tests/stack/test_serve_signals.py): with ``KVFENCE_TEST_TEARDOWN_MARK`` set, the teardown that
follows a service's stop (``kvfence.transfer.stop_ucx_notifier``, called once ``asyncio.run``
has returned) first creates that file and sleeps ``KVFENCE_TEST_TEARDOWN_S``, so the test can
send a second signal inside it. Any other process is left as it is."""

import os

_mark = os.environ.get("KVFENCE_TEST_TEARDOWN_MARK")
if _mark:
    import time

    import kvfence.transfer

    _real_stop = kvfence.transfer.stop_ucx_notifier

    def _slow_stop() -> None:
        with open(_mark, "w"):
            pass
        time.sleep(float(os.environ.get("KVFENCE_TEST_TEARDOWN_S", "2")))
        _real_stop()

    kvfence.transfer.stop_ucx_notifier = _slow_stop  # type: ignore[assignment]
