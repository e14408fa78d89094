"""What the subcommands do beyond parsing (dflash_onnx/cli.py): bench and its peers, steps, parity, demo.

The top layer: it reaches backends only through the `targets` registry."""
