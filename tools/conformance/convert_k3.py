"""Run llama.cpp's convert_hf_to_gguf.py on a synthetic K3 checkpoint.

The only change: the vocab step. The real converter reads the Kimi tiktoken tokenizer,
which a synthetic checkpoint does not have; the logits do not depend on it, so the
vocab is written as llama.cpp's tokenizer model "none", which the loader fills with
vocab_size dummy tokens (token ids still index the embedding and the head).

Usage: python convert_k3.py LLAMA_CPP_DIR HF_DIR OUT.gguf
"""

from __future__ import annotations

import sys
from pathlib import Path


def main() -> None:
    if len(sys.argv) != 4:
        sys.exit("usage: convert_k3.py LLAMA_CPP_DIR HF_DIR OUT.gguf")
    llama_dir, hf_dir, out = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    sys.path.insert(0, str(llama_dir / "gguf-py"))
    sys.path.insert(0, str(llama_dir))

    import convert_hf_to_gguf  # noqa: E402  (path set above)
    from conversion import kimi_k3  # noqa: E402

    def set_vocab(self) -> None:
        self.gguf_writer.add_tokenizer_model("none")

    kimi_k3.KimiK3Model.set_vocab = set_vocab
    sys.argv = ["convert_hf_to_gguf.py", hf_dir, "--outtype", "f32", "--outfile", out]
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    main()
