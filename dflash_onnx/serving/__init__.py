"""`dflash-onnx serve`: an OpenAI-compatible HTTP server (app.py) over one engine thread (engine.py) that owns
the decoder's sessions; the Engine is importable on its own for other hosts (Ray Serve, Triton)."""

from dflash_onnx.serving.engine import Engine, Event, GenerationRequest, QueueFull, Submission
from dflash_onnx.serving.host import EngineSettings

__all__ = ["Engine", "EngineSettings", "Event", "GenerationRequest", "QueueFull", "Submission"]
