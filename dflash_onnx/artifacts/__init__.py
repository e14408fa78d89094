"""The directories every stage reads and writes: checkpoint directories read as data, ONNX files checked and
described for the manifest, outputs published whole or not at all, and the progress of long stages.

Torch-free, above the runtime: the exporter, the passes, the lowerings and training share it."""
