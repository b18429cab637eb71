"""Generate a tiny LoRA adapter (rank 8 on ``q_proj`` / ``v_proj``) for the tiny Llama, with no download.

Why: the LoRA tests need an engine serving a real adapter, and no hub is reachable from the test
machines. ``peft`` writes the adapter exactly as vLLM loads one (``adapter_config.json`` +
``adapter_model.safetensors``). Both LoRA matrices are random (seeded), so the adapter really changes
the model's output: a request for it is visibly not served by the base model.

Run with the vLLM venv (``~/.cache/kvroute/vllm-venv``: ``peft``, ``transformers``, ``torch``), after the model exists::

    ~/.cache/kvroute/vllm-venv/bin/python tests/vllm/make_tiny_lora.py tests/.models/tiny-llama tests/.models/tiny-lora

The result is reused when the folder already holds a finished adapter of this version (a stamp file).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

#: Bump when the generated adapter changes, so stale folders are rebuilt.
LORA_VERSION = "1"
STAMP = ".kvroute-tiny-lora"
RANK = 8


def build_adapter(base: Path, out: Path) -> None:
    """Wrap the tiny model with a seeded LoRA and save only the adapter."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(1)
    model = LlamaForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    config = LoraConfig(
        r=RANK,
        lora_alpha=2 * RANK,
        target_modules=["q_proj", "v_proj"],
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
        # Random A and B (the default zero B would make the adapter an identity).
        init_lora_weights=False,
    )
    peft_model = get_peft_model(model, config)
    peft_model.save_pretrained(out, safe_serialization=True)


def ensure_adapter(base: Path, out: Path) -> Path:
    """Build the adapter into ``out`` unless a finished one of this version is there."""
    stamp = out / STAMP
    if stamp.exists() and stamp.read_text().strip() == LORA_VERSION:
        return out
    out.mkdir(parents=True, exist_ok=True)
    build_adapter(base, out)
    stamp.write_text(LORA_VERSION)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", type=Path, help="folder of the tiny model (make_tiny_model.py)")
    parser.add_argument("out", type=Path, help="folder to write the adapter into")
    args = parser.parse_args(argv)
    print(ensure_adapter(args.base, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
