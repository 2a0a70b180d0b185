"""The casque operator, imported as `casque.operator` (the folder is mapped in pyproject.toml).

If the repository root is ever put on sys.path ahead of the standard library (for example
PYTHONPATH=.), Python would import this folder for the standard library's `operator`
module, which almost every program needs. In that case only, load the real module in our
place, so that a checkout on the path can never break the interpreter.
"""

if __name__ == "operator":
    # Only modules that are loaded before `operator` itself may be used here (no importlib.util).
    import _frozen_importlib as _bootstrap
    import os as _os
    import sys as _sys
    from importlib.machinery import SourceFileLoader as _Loader

    _loader = _Loader("operator", _os.path.join(_os.path.dirname(_os.__file__), "operator.py"))
    _spec = _bootstrap.spec_from_loader("operator", _loader)
    assert _spec is not None
    _module = _bootstrap.module_from_spec(_spec)
    _sys.modules["operator"] = _module
    _loader.exec_module(_module)
