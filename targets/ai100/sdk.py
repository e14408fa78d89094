"""Where the Cloud AI 100 SDK lives: its runtime (qaicrt and the IO-descriptor protobufs) and its compiler."""

from __future__ import annotations

import os
import platform
import shutil
import sys
from pathlib import Path

from dflash_onnx.runtime.errors import DFlashError

SDK_DIR = Path("/opt/qti-aic")


def import_runtime():
    """qaicrt and QAicApi_pb2 from the platform and apps SDKs, or a clear error."""
    for extra in (f"{SDK_DIR}/dev/lib/{platform.machine()}", f"{SDK_DIR}/dev/python"):
        if os.path.isdir(extra) and extra not in sys.path:
            sys.path.append(extra)
    try:
        import QAicApi_pb2 as aicapi
        import qaicrt
    except ImportError:
        raise DFlashError(
            "--backend ai100 needs the Cloud AI 100 platform and apps SDKs (qaicrt, QAicApi_pb2 under "
            f"{SDK_DIR}); on other machines run the same graphs with --backend ort"
        ) from None
    return qaicrt, aicapi


def find_compiler() -> list[str] | None:
    """`qaic-compile` (SDK >= 1.22), else `qaic-exec -compile-only`, on PATH or under /opt/qti-aic/exec."""
    for name, extra in (("qaic-compile", []), ("qaic-exec", ["-compile-only"])):
        found = shutil.which(name) or (str(SDK_DIR / "exec" / name) if (SDK_DIR / "exec" / name).is_file() else None)
        if found:
            return [found, *extra]
    return None
