"""llama.cpp as a peer of `bench`: its build (found or made once), the checkpoints converted to GGUF with its own
converter and quantized to the directory's precision, and its greedy and DFlash runs."""
