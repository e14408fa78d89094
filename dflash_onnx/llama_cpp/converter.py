"""`python -m dflash_onnx.llama_cpp.converter LLAMA_CPP_SOURCE [convert_hf_to_gguf.py arguments]`: llama.cpp's own
converter, with two settings made at conversion time for tokenizers it does not know (the script is not edited):

- the pre-tokenizer is named (`default`) where the converter's table of published tokenizers' hashes has no entry
  (our tiny char-level and byte-level tokenizers);
- a tokenizer without BPE merges gets one inert merge (two special tokens, which BPE never sees side by side, so
  tokenization is unchanged), since llama.cpp refuses a BPE vocabulary with no merges.
A published tokenizer converts exactly as the script alone converts it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

UNKNOWN_PRE_TOKENIZER = "default"


def _inert_merge(model_dir: Path) -> str:
    tokenizer = Path(model_dir) / "tokenizer.json"
    specials = []
    if tokenizer.is_file():
        specials = [t["content"] for t in json.loads(tokenizer.read_text()).get("added_tokens", [])
                    if t.get("special") and " " not in t["content"]]
    return " ".join((specials + ["<inert-a>", "<inert-b>"])[:2])


def main(argv: list[str]) -> None:
    source = Path(argv[0])
    sys.path[:0] = [str(source), str(source / "gguf-py")]
    import convert_hf_to_gguf
    import gguf

    try:  # the converter split into conversion/ (2026); before, its classes lived in the script
        from conversion.base import TextModel
    except ImportError:
        TextModel = convert_hf_to_gguf.TextModel

    table = TextModel.get_vocab_base_pre

    def named_when_unknown(self, tokenizer) -> str:
        try:
            return table(self, tokenizer)
        except NotImplementedError:
            return UNKNOWN_PRE_TOKENIZER

    loaded = gguf.SpecialVocab._try_load_from_tokenizer_json

    def with_a_merge(self, path: Path) -> bool:
        found = loaded(self, path)
        if self.load_merges and not self.merges:
            self.merges = [_inert_merge(path)]
        return found

    TextModel.get_vocab_base_pre = named_when_unknown
    gguf.SpecialVocab._try_load_from_tokenizer_json = with_a_merge
    sys.argv = [str(source / "convert_hf_to_gguf.py"), *argv[1:]]
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    main(sys.argv[1:])
