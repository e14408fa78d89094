"""Checkpoints to graphs: the target/draft pair loaded and validated, the PyTorch forms of both (the export's,
and the retained-state and stateful forms the AI 100 and CoreML lowerings re-export), the streamed export and
tiny random pairs in the published layouts.

Everything here needs torch (the `export` extra) except `export_request`, the checks the CLI runs before
importing the rest; importing this package imports nothing."""
