"""Runs at interpreter start-up in every process that has this folder on ``PYTHONPATH``
(tests/stack/test_node_sigterm.py): in a ``kvfence serve decode`` process with
``KVFENCE_TEST_DECODE_STEP_S`` set, every decode step sleeps that long first, so a stream is still
running when the test sends SIGTERM. Any other process is left as it is."""

import os
import sys

_delay = os.environ.get("KVFENCE_TEST_DECODE_STEP_S")
_argv = list(getattr(sys, "orig_argv", sys.argv))
_i = _argv.index("serve") if "serve" in _argv else -1
_role = _argv[_i + 1] if 0 <= _i < len(_argv) - 1 else None
if _delay and _role == "decode":
    import time

    from decode_svc.batcher import DecodeBatcher

    _real_step = DecodeBatcher._step

    def _slow_step(self, batch):  # type: ignore[no-untyped-def]
        time.sleep(float(_delay))
        _real_step(self, batch)

    DecodeBatcher._step = _slow_step  # type: ignore[method-assign]
