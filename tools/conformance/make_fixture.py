"""Make one conformance fixture from a synthetic K3 checkpoint.

Steps: dequantize the checkpoint to f32 (dequantize_hf.py), convert it with llama.cpp's
converter (convert_k3.py), run llama.cpp on the prompt (llama_logits), run the numpy f64
reference (numpy_forward.py), compare the two, and write
  FIXTURE_DIR/prompt.json    {"ids": [...]}
  FIXTURE_DIR/logits.f32     llama.cpp's logits, little-endian f32 [positions x vocab]
  FIXTURE_DIR/metadata.json  versions, commands, checkpoint fingerprint, agreement figures

Usage: python make_fixture.py --model DIR --preset P --seed S --ids 1,2,3 \
         --llama-src DIR --llama-logits BIN --work DIR --out FIXTURE_DIR
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def fingerprint(model_dir: Path) -> str:
    """FNV-1a 64 over name + bytes of every *.safetensors and config.json, in name order
    (the same function as checkpoint_fingerprint() in tests/model/conformance.rs)."""
    names = sorted(p.name for p in model_dir.iterdir() if p.name.endswith(".safetensors") or p.name == "config.json")
    h = 0xCBF29CE484222325
    mask = (1 << 64) - 1
    for name in names:
        data = name.encode() + (model_dir / name).read_bytes()
        for b in data:
            h = ((h ^ b) * 0x100000001B3) & mask
    return f"{h:016x}"


def run(cmd: list[str], log: list[str]) -> None:
    # Logged with the repository and scratch paths abbreviated, so metadata is portable.
    text = " ".join(str(c) for c in cmd)
    text = text.replace(str(HERE.parent.parent) + "/", "")
    log.append(text.replace(os.environ.get("K3_CONF_SCRATCH", "/nonexistent") + "/", "$SCRATCH/"))
    print("+", text, flush=True)
    subprocess.run([str(c) for c in cmd], check=True)


def compare(ours: np.ndarray, ref: np.ndarray) -> list[dict]:
    rows = []
    for pos, (a, b) in enumerate(zip(ours, ref)):
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        top2 = np.sort(b64)[-2:]
        rows.append(
            {
                "pos": pos,
                "rel_l2": float(np.linalg.norm(a64 - b64) / np.linalg.norm(b64)),
                "argmax_match": bool(np.argmax(a) == np.argmax(b)),
                "ref_top2_gap": float(top2[1] - top2[0]),
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--preset", required=True)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--ids", required=True)
    ap.add_argument("--llama-src", type=Path, required=True)
    ap.add_argument("--llama-logits", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--synth-command", default="")
    args = ap.parse_args()

    ids = [int(s) for s in args.ids.split(",") if s]
    cfg = json.loads((args.model / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    vocab = text["vocab_size"]
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    cmds: list[str] = []
    if args.synth_command:
        cmds.append(args.synth_command)

    hf32 = work / "hf-f32"
    gguf = work / "model-f32.gguf"
    run([py, HERE / "dequantize_hf.py", args.model, hf32], cmds)
    run([py, HERE / "convert_k3.py", args.llama_src, hf32, gguf], cmds)
    llama_batch = work / "llama-batch.f32"
    llama_serial = work / "llama-one-by-one.f32"
    run([args.llama_logits, gguf, args.ids, llama_batch], cmds)
    run([args.llama_logits, gguf, args.ids, llama_serial, "--one-by-one"], cmds)
    ref = work / "numpy-f64.f32"
    run([py, HERE / "numpy_forward.py", args.model, args.ids, ref, "--routing-log", work / "routing.txt"], cmds)
    # The same reference with llama.cpp's KDA l2-norm eps: what is left is f32 rounding.
    ref_e5 = work / "numpy-f64-l2eps1e-5.f32"
    run([py, HERE / "numpy_forward.py", args.model, args.ids, ref_e5, "--l2-eps", "1e-5"], cmds)

    shape = (len(ids), vocab)
    lb = np.fromfile(llama_batch, dtype="<f4").reshape(shape)
    ls = np.fromfile(llama_serial, dtype="<f4").reshape(shape)
    npy = np.fromfile(ref, dtype="<f4").reshape(shape)
    npy_e5 = np.fromfile(ref_e5, dtype="<f4").reshape(shape)
    vs_numpy = compare(lb, npy)
    vs_numpy_e5 = compare(lb, npy_e5)
    batch_vs_serial = compare(ls, lb)
    worst = max(r["rel_l2"] for r in vs_numpy)
    print(f"llama.cpp (one batch) vs numpy f64: worst rel L2 {worst:.3e}, "
          f"argmax all equal: {all(r['argmax_match'] for r in vs_numpy)}")
    print(f"llama.cpp (one batch) vs numpy f64 with l2 eps 1e-5: worst rel L2 "
          f"{max(r['rel_l2'] for r in vs_numpy_e5):.3e}")
    print(f"llama.cpp one-by-one vs one batch: worst rel L2 {max(r['rel_l2'] for r in batch_vs_serial):.3e}")

    try:
        commit = subprocess.run(["git", "-C", str(args.llama_src), "rev-parse", "HEAD"],
                                capture_output=True, text=True, check=True).stdout.strip()
    except (subprocess.CalledProcessError, FileNotFoundError):
        commit = "unknown"

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "prompt.json").write_text(json.dumps({"ids": ids}) + "\n")
    lb.astype("<f4").tofile(out / "logits.f32")
    meta = {
        "preset": args.preset,
        "seed": args.seed,
        "vocab_size": vocab,
        "positions": len(ids),
        "checkpoint_fnv1a64": fingerprint(args.model),
        "reference": "llama.cpp kimi-k3, CPU, whole prompt in one llama_decode batch, every weight f32",
        "llama_cpp": {
            "source": "llama-cpp-python sdist (PyPI), vendor/llama.cpp",
            "llama_cpp_python_version": args.llama_src.resolve().parent.parent.name.split("-")[-1],
            "commit": commit,
        },
        "commands": cmds,
        "agreement_llama_cpp_vs_numpy_f64": vs_numpy,
        "agreement_llama_cpp_vs_numpy_f64_l2eps_1e-5": vs_numpy_e5,
        "agreement_llama_cpp_one_by_one_vs_batch": batch_vs_serial,
    }
    (out / "metadata.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"wrote fixture {out}")


if __name__ == "__main__":
    main()
