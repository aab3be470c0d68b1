"""Read a Kimi K3 Hugging Face checkpoint (as `k3 synth` writes it) into f32 numpy arrays.

Independent of our Rust code and of llama.cpp: a minimal safetensors parser (BF16, F32,
U8), MXFP4 decoding written from docs/model.md#mxfp4-experts, and the `language_model.`
prefix stripped. Used by dequantize_hf.py and numpy_forward.py.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

PREFIX = "language_model."
SKIP_PREFIXES = ("vision_tower.", "mm_projector.")

# E2M1 magnitudes indexed by bits 0-2 of a nibble (docs/model.md#mxfp4-experts).
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)


def load_config(model_dir: Path) -> tuple[dict, dict]:
    """Return (root config, text config); the text part is `text_config` when present."""
    root = json.loads((model_dir / "config.json").read_text())
    return root, root.get("text_config", root)


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of one shard, BF16 widened to f32, U8 and F32 as stored."""
    raw = path.read_bytes()
    (hlen,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + hlen])
    base = 8 + hlen
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        buf = raw[base + start : base + end]
        shape = info["shape"]
        dtype = info["dtype"]
        if dtype == "BF16":
            bits = np.frombuffer(buf, dtype="<u2").astype(np.uint32) << 16
            arr = bits.view(np.float32)
        elif dtype == "F32":
            arr = np.frombuffer(buf, dtype="<f4").copy()
        elif dtype == "U8":
            arr = np.frombuffer(buf, dtype=np.uint8).copy()
        else:
            raise ValueError(f"{path}: tensor {name} has dtype {dtype}, expected BF16, F32 or U8")
        out[name] = arr.reshape(shape)
    return out


def mxfp4_dequantize(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """packed U8 [O, In/2] (low nibble = even column), scale U8 E8M0 [O, In/32] -> f32 [O, In]."""
    rows, half = packed.shape
    lo = packed & 0x0F
    hi = packed >> 4
    nib = np.empty((rows, half * 2), dtype=np.uint8)
    nib[:, 0::2] = lo
    nib[:, 1::2] = hi
    mag = E2M1[nib & 0x7]
    val = np.where(nib & 0x8, -mag, mag).astype(np.float32)
    # The f32 whose bit pattern is s << 23: 2^(s-127) for 1 <= s <= 254, 0 for s = 0.
    s = (scale.astype(np.uint32) << 23).view(np.float32)
    return (val.reshape(rows, -1, 32) * s[:, :, None]).reshape(rows, half * 2)


def load_text_tensors(model_dir: Path) -> dict[str, np.ndarray]:
    """All text tensors by unprefixed name, with MXFP4 experts dequantized to
    `...experts.{e}.w{1,2,3}.weight` f32 [out, in]."""
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    raw: dict[str, np.ndarray] = {}
    for shard in shards:
        for name, arr in read_safetensors(model_dir / shard).items():
            name = name[len(PREFIX) :] if name.startswith(PREFIX) else name
            if name.startswith(SKIP_PREFIXES):
                continue
            raw[name] = arr
    out: dict[str, np.ndarray] = {}
    for name, arr in raw.items():
        if name.endswith(".weight_scale"):
            continue
        if name.endswith(".weight_packed"):
            base = name[: -len(".weight_packed")]
            scale = raw.get(base + ".weight_scale")
            if scale is None:
                raise KeyError(f"{model_dir}: {name} has no {base}.weight_scale")
            out[base + ".weight"] = mxfp4_dequantize(arr, scale)
        else:
            out[name] = arr.astype(np.float32)
    return out
