"""`python -m dflash_onnx`: the dflash-onnx command line."""

import sys

from dflash_onnx.cli import main

sys.exit(main())
