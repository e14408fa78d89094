"""The numpy runtime: the decoding loop and everything it reads (the manifest, the Session protocol, the
runners that feed each graph form, sampling, the verify policy and its cost curve, tokenizer and chat template).

The bottom layer: it imports nothing from the rest of dflash-onnx and no library beyond numpy, tokenizers and
jinja2, so a deployment box runs it without torch (tests/test_layering.py holds it to that)."""

__version__ = "0.1.0"  # the tool version every manifest records; the distribution's (pyproject.toml)
