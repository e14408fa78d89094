"""dflash-onnx: DFlash speculative decoding, exported once to ONNX, run on any backend."""

__version__ = "0.1.0"
