"""Run `python -m MODULE ARGS...` noting the file of every Python function called, for `round_files.py`.

    python benchmarks/trace_calls.py OUT FILE_SUFFIX:FUNCTION MODULE ARGS...

Every thread runs under one profiling hook (`sys.setprofile`, `threading.setprofile`); a module's top level
(run at import) does not count. At exit OUT holds, as JSON, the files of the whole run ("whole") and those
called from the first call of FUNCTION in a file ending in FILE_SUFFIX on ("round"). It imports nothing of
the project itself, so it runs any checkout's code (`round_files.py --tree`).
"""

from __future__ import annotations

import atexit
import json
import runpy
import sys
import threading
from pathlib import Path


def trace(out: Path, start: str, module: str, arguments: list[str]) -> None:
    suffix, function = start.split(":")
    whole: set[str] = set()
    from_start: set[str] = set()
    started = threading.Event()

    def note(frame, event: str, _arg: object) -> None:
        code = frame.f_code
        if event != "call" or code.co_name == "<module>":
            return
        whole.add(code.co_filename)
        if not started.is_set() and code.co_name == function and code.co_filename.endswith(suffix):
            started.set()
        if started.is_set():
            from_start.add(code.co_filename)

    def write() -> None:
        sys.setprofile(None)
        threading.setprofile(None)
        out.write_text(json.dumps({"whole": sorted(whole), "round": sorted(from_start)}))

    atexit.register(write)
    threading.setprofile(note)
    sys.setprofile(note)
    sys.argv = [module, *arguments]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    trace(Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4:])
