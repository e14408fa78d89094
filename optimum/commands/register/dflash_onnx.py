"""Registers `optimum-cli export dflash` (same flags as `dflash-onnx export`).

Lives in optimum's PEP 420 namespace `optimum.commands.register`; kept import-light as optimum asks.
"""

import sys

from optimum.commands.base import BaseOptimumCLICommand, CommandInfo
from optimum.commands.export.base import ExportCommand


class DFlashExportCommand(BaseOptimumCLICommand):
    COMMAND = CommandInfo(name="dflash", help="Export a target LLM and its DFlash draft to ONNX (dflash-onnx).")

    @staticmethod
    def parse_args(parser):
        from dflash_onnx.cli import add_export_arguments

        add_export_arguments(parser)

    def run(self):
        from dflash_onnx.cli import run_export
        from dflash_onnx.runtime.errors import DFlashError

        try:
            return run_export(self.args)
        except DFlashError as exc:
            print(f"optimum-cli export dflash: error: {exc}", file=sys.stderr)
            sys.exit(2)


REGISTER_COMMANDS = [(DFlashExportCommand, ExportCommand)]
