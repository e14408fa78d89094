"""Training DFlash drafts for a frozen target (`dflash-onnx distill`)."""
