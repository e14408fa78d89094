"""Graph passes (ONNX -> ONNX). The registry is filled by the passes issue; export applies none yet."""

PASSES: dict = {}
