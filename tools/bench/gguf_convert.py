#!/usr/bin/env python3
"""Run llama.cpp's convert_hf_to_gguf.py on make_models.py's checkpoints.

    python tools/bench/gguf_convert.py HF_DIR --outtype bf16 --outfile OUT.gguf   (its usual flags)

llama.cpp's tree is $LLAMA_CPP_DIR (default: the one build_llama.sh unpacked). One change, for
OLMoE only: its converter reads the vocabulary with transformers' AutoTokenizer from a
tokenizer.json and refuses any BPE tokenizer whose pre-tokenizer checksum it does not know,
which a synthetic tokenizer cannot match. Our checkpoints carry a sentencepiece tokenizer.model,
so OlmoeModel is told to read that (as the Llama/Mixtral converter does). The weights are
converted unchanged; only the GGUF's vocabulary kind differs from a real OLMoE GGUF, which
llama-bench (token ids, no text) never uses. The gpt-oss and DeepSeek-V3 checkpoints carry no
tokenizer at all (vocabularies of 201088 / 129280 pieces): their converters' GPT-2 vocabulary
reader is given a synthetic byte-level one of vocab_size pieces (the 256 byte symbols, one merge,
placeholders), which llama.cpp loads and llama-bench never uses either.
"""

import os
import sys
from pathlib import Path

LLAMA_CPP_DIR = Path(os.environ.get("LLAMA_CPP_DIR", "/work/bench_cache/llama_cpp_python-0.3.36/vendor/llama.cpp"))


def synthetic_gpt2_vocab(self) -> None:
    """vocab_size pieces: GPT-2's 256 byte symbols (so "\\n" is a token), "ĠĠ" with its one merge,
    then placeholders; bos 0, eos 1."""
    n = self.hparams["vocab_size"]
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    symbols = [chr(b) for b in keep] + [chr(256 + i) for i in range(256 - len(keep))]
    tokens = symbols + ["\u0120\u0120"] + [f"<t{i}>" for i in range(n - len(symbols) - 1)]
    w = self.gguf_writer
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * n)
    w.add_token_merges(["\u0120 \u0120"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)


def main():
    sys.path.insert(0, str(LLAMA_CPP_DIR))
    import convert_hf_to_gguf
    from conversion.olmo import OlmoeModel

    from conversion.base import TextModel

    OlmoeModel.set_vocab = lambda self: self._set_vocab_sentencepiece()
    TextModel._set_vocab_gpt2 = synthetic_gpt2_vocab
    sys.argv[0] = str(LLAMA_CPP_DIR / "convert_hf_to_gguf.py")
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    main()
