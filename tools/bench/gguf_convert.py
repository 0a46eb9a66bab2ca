#!/usr/bin/env python3
"""Run llama.cpp's convert_hf_to_gguf.py on make_models.py's checkpoints.

    python tools/bench/gguf_convert.py HF_DIR --outtype bf16 --outfile OUT.gguf   (its usual flags)

llama.cpp's tree is $LLAMA_CPP_DIR (default: the one build_llama.sh unpacked). One change, for
OLMoE only: its converter reads the vocabulary with transformers' AutoTokenizer from a
tokenizer.json and refuses any BPE tokenizer whose pre-tokenizer checksum it does not know,
which a synthetic tokenizer cannot match. Our checkpoints carry a sentencepiece tokenizer.model,
so OlmoeModel is told to read that (as the Llama/Mixtral converter does). The weights are
converted unchanged; only the GGUF's vocabulary kind differs from a real OLMoE GGUF, which
llama-bench (token ids, no text) never uses.
"""
import os
import sys
from pathlib import Path

LLAMA_CPP_DIR = Path(os.environ.get("LLAMA_CPP_DIR",
                                    "/work/bench_cache/llama_cpp_python-0.3.36/vendor/llama.cpp"))


def main():
    sys.path.insert(0, str(LLAMA_CPP_DIR))
    import convert_hf_to_gguf
    from conversion.olmo import OlmoeModel

    OlmoeModel.set_vocab = lambda self: self._set_vocab_sentencepiece()
    sys.argv[0] = str(LLAMA_CPP_DIR / "convert_hf_to_gguf.py")
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    main()
