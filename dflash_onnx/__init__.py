"""dflash-onnx: DFlash speculative decoding, exported once to ONNX, run on any backend.

This package is the top layer: the `dflash-onnx` command line (cli.py) and what its subcommands do beyond
parsing (bench and its peers, steps, parity, demo). It reaches backends only through the `targets` registry;
the layers below it are the top-level packages runtime, artifacts, exporter, training, passes and targets."""

from dflash_onnx.runtime import __version__

__all__ = ["__version__"]
