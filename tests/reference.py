"""The reference `dflash` package, the tests' oracle, or a module skip that says how to install it."""

import time

import pytest

dflash_model = pytest.importorskip(
    "dflash.model", reason="the reference dflash package (the oracle) is not installed: "
    "pip install --no-deps dflash==0.1.0")
DFlashDraftModel = dflash_model.DFlashDraftModel

# The reference times itself with torch.cuda.synchronize; on CPU machines use the plain clock.
dflash_model._cuda_time = time.perf_counter
