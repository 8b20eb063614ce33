"""``kvik export MODEL OUT_DIR``: write a model as a Hugging Face folder.

config.json, generation_config.json, model.safetensors, the tokenizer and its chat template: what
transformers and other engines load. It is how the same weights reach another system (the
benchmarks hand the default model, dequantised from GGUF, to vLLM and transformers this way).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="a model folder, a .gguf file, a hub id or an alias")
    parser.add_argument("out_dir", help="the folder to write (created; must be empty if it exists)")
    parser.add_argument("--dtype", default="float32", help="float32 (default), bfloat16 or float16")


def export_model(model: str | None, out_dir: Path, dtype: str = "float32") -> Path:
    from safetensors.torch import save_file

    from kvik.config import parse_dtype
    from kvik.engine.input_processor import load_tokenizer
    from kvik.model_loader.loader import iterate_weights, load_model_config

    torch_dtype = parse_dtype(dtype)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ValueError(f"{out_dir} exists and is not empty")
    config = load_model_config(model, dtype=torch_dtype)
    tensors = {name: t.to(torch_dtype).contiguous() for name, t in iterate_weights(config)}
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    hf_config = config.hf_config
    hf_config.dtype = torch_dtype
    hf_config.save_pretrained(out_dir)
    if config.generation_config:
        with open(out_dir / "generation_config.json", "w") as f:
            json.dump(config.generation_config, f, indent=2)
    tokenizer = load_tokenizer(config.tokenizer or config.path)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    return out_dir


def run(args: argparse.Namespace) -> int:
    try:
        out = export_model(args.model, Path(args.out_dir), args.dtype)
    except ValueError as e:
        print(f"kvik export: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0
