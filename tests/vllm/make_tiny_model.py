"""Generate a tiny random Llama with a byte-level BPE tokenizer and a chat template, with no download.

Why: no model hub is reachable from the test machines, and the integration tier needs a model that
vLLM's CPU build loads in seconds. The weights are random (outputs are noise, deterministic with
``temperature: 0``); what matters is that the tokenizer and the chat template are real, so the
router's local tokenization can be compared with the engine's.

Run with a Python that has ``transformers`` and ``torch`` (the vLLM venv, ``~/.cache/kvroute/vllm-venv``)::

    ~/.cache/kvroute/vllm-venv/bin/python tests/vllm/make_tiny_model.py tests/.models/tiny-llama

The result is reused when the folder already holds a finished model (a stamp file).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

#: Bump when the generated model changes, so stale folders are rebuilt.
MODEL_VERSION = "2"
STAMP = ".kvroute-tiny-model"
#: Versions that differ from this one by the chat template only (rewritten in place, nothing retrained).
TEMPLATE_ONLY_UPGRADES = frozenset({"1"})

VOCAB_SIZE = 1024
SPECIAL_TOKENS = ["<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]

#: Llama-style template: BOS once, then role-tagged turns; the engine tokenizes the rendered text
#: without adding special tokens again (vLLM's default for chat completions). Plain conversations render
#: as the first version did; the rest gives every option the router must reproduce something to change:
#: a ``persona`` template kwarg, ``tools``, ``documents``, assistant ``reasoning_content`` and
#: ``tool_calls`` (arguments as JSON), ``enable_thinking`` (set by ``reasoning_effort``). It accepts a
#: system message anywhere (vLLM keeps /v1/messages' inline system messages in place) and does not know
#: the ``developer`` role (vLLM turns it into ``system``).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if persona is defined %}<|system|>\npersona: {{ persona }}<|end|>\n{% endif %}"
    "{% if tools %}<|system|>\ntools: {{ tools | tojson }}<|end|>\n{% endif %}"
    "{% if documents %}<|system|>\ndocuments:"
    "{% for d in documents %} [{{ d['title'] }}] {{ d['text'] }}{% endfor %}<|end|>\n{% endif %}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n"
    "{% if message['reasoning_content'] %}<think>{{ message['reasoning_content'] }}</think>{% endif %}"
    "{{ message['content'] }}"
    "{% if message['tool_calls'] %}{% for call in message['tool_calls'] %}"
    " call {{ call['function']['name'] }}({{ call['function']['arguments'] | tojson }})"
    "{% endfor %}{% endif %}"
    "<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n"
    "{% if enable_thinking is defined %}<think mode={{ enable_thinking }}>{% endif %}"
    "{% endif %}"
)


def corpus(seed: int = 7, lines: int = 4000) -> list[str]:
    """Pseudo-English lines from a fixed syllable set: enough variety for ~1000 merges."""
    rng = random.Random(seed)
    syllables = [
        "ka",
        "lo",
        "mi",
        "ne",
        "ru",
        "sa",
        "to",
        "vi",
        "ze",
        "pa",
        "qu",
        "do",
        "fe",
        "gi",
        "ha",
        "ju",
        "be",
        "co",
        "xi",
        "wy",
        "an",
        "er",
        "in",
        "on",
        "us",
        "th",
        "st",
        "ch",
    ]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(3000)]
    words += [
        "the",
        "and",
        "of",
        "to",
        "in",
        "is",
        "you",
        "that",
        "it",
        "for",
        "tool",
        "call",
        "result",
        "user",
        "assistant",
        "system",
        "file",
        "read",
        "write",
        "error",
        "ok",
        "0",
        "1",
        "2",
        "3",
        "4",
        "5",
        "6",
        "7",
        "8",
        "9",
        "{",
        "}",
        "(",
        ")",
        ":",
        ",",
        ".",
        '"',
        "'",
        "-",
        "_",
    ]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(5, 30))) for _ in range(lines)]


def build_tokenizer(out: Path) -> int:
    """Train the BPE, save it as a transformers fast tokenizer with the chat template; return vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    bos_id = tok.token_to_id("<s>")
    # Completions get a BOS like Llama tokenizers do; the router must reproduce it.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A",
        pair="<s> $A <s> $B",
        special_tokens=[("<s>", bos_id)],
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="</s>",
        additional_special_tokens=SPECIAL_TOKENS[3:],
        model_max_length=2048,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    write_template(out)
    return tok.get_vocab_size()


def write_template(out: Path) -> None:
    """Older transformers keep the template only in tokenizer_config.json, newer ones in a .jinja file:
    write both so any reader (vLLM, the router) finds it. Each file is replaced whole (a reader never
    sees half of one)."""
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    for path, text in ((out / "chat_template.jinja", CHAT_TEMPLATE), (config_path, json.dumps(config, indent=2))):
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(text)
        tmp.replace(path)


def build_model(out: Path, vocab_size: int) -> None:
    """A 2-layer Llama; head_dim 32 because the CPU attention backend refuses 16."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)


def ensure_model(out: Path) -> Path:
    """Build the model into ``out`` unless a finished one of this version is there."""
    stamp = out / STAMP
    built = stamp.read_text().strip() if stamp.exists() else None
    if built == MODEL_VERSION:
        return out
    if built in TEMPLATE_ONLY_UPGRADES:
        # Same weights and vocabulary: servers already running on the folder are not disturbed.
        write_template(out)
        stamp.write_text(MODEL_VERSION)
        return out
    out.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(out)
    build_model(out, vocab)
    stamp.write_text(MODEL_VERSION)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder to write the model into")
    args = parser.parse_args(argv)
    print(ensure_model(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
