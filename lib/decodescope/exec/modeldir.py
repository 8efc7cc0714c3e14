"""The model directory the server loads: given weights, or one built here for dummy weights.

For the embedded default nothing may come from a model hub, so the directory holds the architecture's
config.json and a byte-level BPE tokenizer trained here on a deterministic synthetic corpus. It is
cached under outputs/.cache keyed by the config's content, and never committed.
"""
from __future__ import annotations

import hashlib
import json
import re
import os
import random
import shutil
import tempfile
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from decodescope.schema.params import Params, placeholder_configs

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_end|>", "<|im_start|>"]
# Qwen-style chat template, so /v1/chat/completions works with the trained tokenizer.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOKENIZER_VERSION = 2


def synthetic_corpus(seed: int = 0, n_lines: int = 4000) -> list[str]:
    """English-like lines from a fixed word list and a seeded RNG: same corpus, same tokenizer."""
    words = ("the decode step of a large model spends time in attention experts routing all reduce "
             "kernels memory bandwidth tokens per second latency throughput server request stream "
             "batch layer hidden state cache prefill sample logits vocabulary expert parallel tensor "
             "graph launch overhead network switch bridge socket copy compute bound communication "
             "one two three four five six seven eight nine ten hundred thousand and or if then why "
             "what where when how is are was were be been on in at to for with from by of").split()
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        n = rng.randint(4, 16)
        sentence = " ".join(rng.choice(words) for _ in range(n))
        lines.append(sentence.capitalize() + rng.choice([".", "?", "!", ",", ";"]) + f" {rng.randint(0, 9999)}")
    return lines


def train_tokenizer(out_dir: Path, vocab_size: int, seed: int = 0) -> Path:
    """Train and save an HF-loadable byte-level BPE tokenizer (tokenizer.json + tokenizer_config.json)
    with exactly vocab_size ids.

    Dummy weights sample any id, so every id must decode to text on its own: the alphabet is the
    corpus's ASCII (no lone bytes of a multi-byte UTF-8 character, which the server would hold back),
    and the ids past the learned merges are plain added words rather than unused slots."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, min_frequency=2,
                                  show_progress=False)
    tok.train_from_iterator(synthetic_corpus(seed), trainer=trainer)
    filler = 0
    while tok.get_vocab_size() < vocab_size:
        tok.add_tokens([f" w{filler:04d}"])
        filler += 1
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "unk_token": None,
        "model_max_length": 1 << 20,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
    }, indent=2))
    (out_dir / "special_tokens_map.json").write_text(json.dumps(
        {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}, indent=2))
    return out_dir


def _cache_key(config: dict) -> str:
    blob = json.dumps(config, sort_keys=True) + f"tokenizer-v{TOKENIZER_VERSION}"
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def build_dummy_model_dir(config: dict, cache_root: Path, name: str) -> Path:
    """config.json + trained tokenizer in cache_root/models/<name>-<hash>; reused when present."""
    # the model name may be an HF id ('org/model') or anything else: never a path of its own
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "model"
    target = cache_root / "models" / f"{slug}-{_cache_key(config)}"
    if (target / "config.json").is_file() and (target / "tokenizer.json").is_file():
        return target
    cache_root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=cache_root, prefix=".building-"))
    try:
        cfg = dict(config)
        # token ids of the trained tokenizer: <|endoftext|> is 0, <|im_end|> is 1
        cfg["bos_token_id"], cfg["eos_token_id"] = 0, 0
        (staging / "config.json").write_text(json.dumps(cfg, indent=2))
        (staging / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 1]}))
        text_cfg = cfg.get("text_config") or cfg
        train_tokenizer(staging, vocab_size=int(text_cfg["vocab_size"]))
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)  # atomic: a crash never leaves a half-built model dir behind
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target


def placeholder_dirs(params: Params) -> dict[str, Path]:
    """'@config:<path>' -> the dummy-weights model directory built from that config (cached like the
    served model's, with the same trained tokenizer)."""
    out = {}
    for rel in placeholder_configs(params.server.engine_args):
        config = json.loads(params.resolve(rel).read_text())
        out[f"@config:{rel}"] = build_dummy_model_dir(config, params.output_root() / ".cache", Path(rel).stem)
    return out


def resolve_model_dir(params: Params) -> tuple[str, str]:
    """(model, tokenizer) as the server should load them."""
    if params.model.path:
        tokenizer = params.model.path if params.model.tokenizer == "model" else str(params.resolve(params.model.tokenizer))
        return params.model.path, tokenizer
    model_dir = build_dummy_model_dir(params.model_config_dict(), params.output_root() / ".cache", params.model.name)
    if params.model.tokenizer == "train":
        return str(model_dir), str(model_dir)
    return str(model_dir), str(params.resolve(params.model.tokenizer))
