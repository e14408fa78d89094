"""vllm-project's `speculators` (0.9.0), the oracle for DFlash2 and DSpark drafts (and a second one for DFlash),
or a module skip that says how to install it.

speculators' package __init__ imports its EAGLE-3 training-data module, which needs openai and datasets (about
300 MB with pyarrow and pandas) for a name, `BatchType`, that no draft model reads. Installed --no-deps as the
reference `dflash` package is, the import is given that one name instead; the model modules themselves run
unchanged."""

import sys
import types

import pytest

try:
    import speculators  # noqa: F401  (the whole package, where its training extras are installed)
except ModuleNotFoundError as exc:
    if exc.name is None or exc.name.split(".")[0] == "speculators":
        pytest.skip("speculators (the DFlash2/DSpark oracle) is not installed: pip install --no-deps "
                    "speculators==0.9.0", allow_module_level=True)
    for name in [n for n in sys.modules if n == "speculators" or n.startswith("speculators.")]:
        del sys.modules[name]
    training_data = types.ModuleType("speculators.train.data")
    training_data.BatchType = dict
    sys.modules["speculators.train.data"] = training_data
    import speculators  # noqa: F401

from speculators import SpeculatorModelConfig  # noqa: E402
from speculators.models.dflash import DFlashDraftModel  # noqa: E402
from speculators.models.dflash2 import DFlash2DraftModel  # noqa: E402
from speculators.models.dspark import DSparkDraftModel  # noqa: E402

__all__ = ["MODELS", "SpeculatorModelConfig"]
MODELS = {"dflash": DFlashDraftModel, "dflash2": DFlash2DraftModel, "dspark": DSparkDraftModel}
