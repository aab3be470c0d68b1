"""Write an f32 copy of a K3 checkpoint for llama.cpp's converter.

`A_log` is flattened to 1-D. The routed experts are decoded from MXFP4 to f32 (`experts.{e}.w{1,2,3}.weight`) and
`quantization_config` is dropped, so the converter takes its plain path and the GGUF
holds every weight in f32. Why: llama.cpp's native MXFP4 path rounds each expert's
input to Q8_0, a ~1% change per expert on a random model, enough to flip routing.

Usage: python dequantize_hf.py SRC_DIR DST_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from safetensors.numpy import save_file

from k3_checkpoint import load_config, load_text_tensors

CONTEXT_LENGTH = 4096


def strip_quant(cfg: dict) -> dict:
    cfg = {k: v for k, v in cfg.items() if k != "quantization_config"}
    cfg["torch_dtype"] = "float32"
    if "text_config" in cfg:
        cfg["text_config"] = strip_quant(cfg["text_config"])
        # llama.cpp requires a context length; the synthetic config has none. Any value
        # above the prompt length gives the same logits (no rotary embedding in K3).
        cfg["text_config"].setdefault("max_position_embeddings", CONTEXT_LENGTH)
    return cfg


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit("usage: dequantize_hf.py SRC_DIR DST_DIR")
    src, dst = Path(sys.argv[1]), Path(sys.argv[2])
    dst.mkdir(parents=True, exist_ok=True)
    root, _ = load_config(src)
    tensors = load_text_tensors(src)
    for name in tensors:
        if name.endswith(".A_log"):
            # llama.cpp's K3 loader wants A_log as 1-D [heads]; checkpoints may store it
            # [1, 1, heads, 1] (the Kimi Linear layout) - the same numbers either way.
            tensors[name] = tensors[name].reshape(-1)
    save_file({k: v for k, v in sorted(tensors.items())}, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(strip_quant(root), indent=2) + "\n")
    print(f"wrote {len(tensors)} f32 tensors to {dst}")


if __name__ == "__main__":
    main()
