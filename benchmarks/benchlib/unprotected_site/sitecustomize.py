"""Runs at interpreter start-up in every process that has this folder on ``PYTHONPATH``: the
benchmark's protections-off stack (``benchlib/unprotected.py``). It does nothing unless its report
variable is set and the process is a ``kvfence serve prefill|decode`` node (the control plane and
``kvfence up`` itself are left as they are, without even importing torch).

``unprotected.py`` is loaded from its file, not as ``benchlib.unprotected``: the ``benchlib``
package sets a benchmark script's signal handling, and ``benchmarks/`` on ``sys.path`` would
shadow the ``kernels`` package with ``benchmarks/kernels.py``."""

import os
import sys

_report = os.environ.get("KVFENCE_BENCH_UNPROTECTED_REPORT")
_argv = list(getattr(sys, "orig_argv", sys.argv))
_i = _argv.index("serve") if "serve" in _argv else -1
_role = _argv[_i + 1] if 0 <= _i < len(_argv) - 1 else None
if _report and _role in ("prefill", "decode"):
    import importlib.util

    _here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _spec = importlib.util.spec_from_file_location(
        "kvfence_bench_unprotected", os.path.join(_here, "unprotected.py")
    )
    assert _spec is not None and _spec.loader is not None
    _module = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = _module
    _spec.loader.exec_module(_module)
    _module.apply(_module.Path(_report), _role)
