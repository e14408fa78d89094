"""PyTorch modules behind the ONNX graphs: the DFlash draft and the tapped target wrapper."""
