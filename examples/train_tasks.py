"""Train two real task adapters on all-MiniLM-L6-v2 on the CPU and report held-out accuracy.

1. sentiment (2 labels): PEFT LoRA on query/value + a trained classifier head
   (``modules_to_save``), saved in PEFT's format, evaluated by PEFT from the files.
2. topic (3 labels): a Pfeiffer bottleneck adapter + head trained by the AdapterHub
   ``adapters`` library in its own environment (examples/train_bottleneck.py), saved
   in its format, evaluated by that library from the files and by adapterserve's
   own encoder (the served path).

The data is synthetic (examples/task_data.py): templated sentences whose held-out
split uses templates and key words never seen in training. Seeded; a few minutes
on 2 cores. Needs the adapters environment: ``bash scripts/golden/setup_env.sh``.

    HF_HUB_OFFLINE=1 python examples/train_tasks.py

Writes examples/adapters/sentiment-lora/ (label names as ``id2label`` in its
adapter_config.json), examples/adapters/topic-bottleneck/ (label names as ``label2id``
in head_config.json, as the adapters library writes them) and examples/adapters/RESULTS.md.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForSequenceClassification, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))

from task_data import SENTIMENT_LABELS, sentiment, topic  # noqa: E402

from adapterserve import Engine  # noqa: E402
from adapterserve.models.encoder_loader import default_encoder_dir  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "examples" / "adapters"
ADAPTERS_PYTHON = ROOT / os.environ.get("ADAPTERS_VENV", ".scratch/venv-adapters") / "bin" / "python"
SEED = 0
TRAIN_SIZE, HELDOUT_SIZE = 480, 300
EPOCHS, BATCH, LR = 2, 16, 1e-3


# sentiment: PEFT LoRA + head


def _batches(data, tokenizer, shuffle: torch.Generator | None):
    order = torch.randperm(len(data), generator=shuffle).tolist() if shuffle is not None else list(range(len(data)))
    for start in range(0, len(order), BATCH):
        chunk = [data[i] for i in order[start : start + BATCH]]
        yield tokenizer([t for t, _ in chunk], padding=True, return_tensors="pt"), torch.tensor([y for _, y in chunk])


def _accuracy(model, tokenizer, data) -> float:
    model.eval()
    right = 0
    with torch.no_grad():
        for enc, labels in _batches(data, tokenizer, None):
            right += int((model(**enc).logits.argmax(-1) == labels).sum())
    return right / len(data)


def _base(path: Path):
    id2label = dict(enumerate(SENTIMENT_LABELS))
    return AutoModelForSequenceClassification.from_pretrained(
        str(path), num_labels=2, id2label=id2label, label2id={v: k for k, v in id2label.items()}, dtype=torch.float32
    )


def train_sentiment(path: Path, tokenizer, out: Path) -> dict:
    torch.manual_seed(SEED)
    config = LoraConfig(task_type="SEQ_CLS", r=8, lora_alpha=16, lora_dropout=0.0,
                        target_modules=["query", "value"], modules_to_save=["classifier"])
    model = get_peft_model(_base(path), config)
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    data, shuffle = sentiment(TRAIN_SIZE, held_out=False, seed=SEED), torch.Generator().manual_seed(SEED)
    for _ in range(EPOCHS):
        model.train()
        for enc, labels in _batches(data, tokenizer, shuffle):
            loss = model(**enc, labels=labels).loss
            optim.zero_grad()
            loss.backward()
            optim.step()
    model.peft_config["default"].base_model_name_or_path = "sentence-transformers/all-MiniLM-L6-v2"  # not a local path
    model.save_pretrained(str(out))
    (out / "README.md").unlink(missing_ok=True)  # PEFT's boilerplate model card, naming a local path
    add_id2label(out / "adapter_config.json", SENTIMENT_LABELS)
    reloaded = PeftModel.from_pretrained(_base(path), str(out))  # evaluate what the files hold
    heldout = sentiment(HELDOUT_SIZE, held_out=True, seed=SEED + 1)
    return {"train_accuracy": _accuracy(model, tokenizer, data), "heldout_accuracy": _accuracy(reloaded, tokenizer, heldout)}


# topic: AdapterHub bottleneck + head, in the adapters environment


def train_topic(out: Path) -> dict:
    if not ADAPTERS_PYTHON.exists():
        raise SystemExit(f"{ADAPTERS_PYTHON} not found: run `bash scripts/golden/setup_env.sh` first")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    script = ROOT / "examples" / "train_bottleneck.py"
    done = subprocess.run([str(ADAPTERS_PYTHON), str(script), str(out)], env=env, check=True,
                          capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def add_id2label(config_file: Path, labels: tuple[str, ...]) -> None:
    """Label names for the served head, in adapter_config.json (PEFT keeps keys it does not know)."""
    config = json.loads(config_file.read_text())
    config["id2label"] = {str(i): name for i, name in enumerate(labels)}
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def write_results(rows: list[tuple[str, str, dict, float]]) -> str:
    lines = [
        "# Example task adapters on all-MiniLM-L6-v2",
        "",
        "Written by `examples/train_tasks.py` (seeded, CPU). The data is **synthetic**: templated",
        "sentences from `examples/task_data.py`; the held-out split uses templates and key words",
        "(adjectives, verbs, entities) that never occur in training.",
        "",
        "| task | adapter | train acc. | held-out acc. (offline) | held-out acc. (adapterserve encoder) | wall s |",
        "|---|---|---|---|---|---|",
    ]
    for task, kind, result, seconds in rows:
        served = result["served_heldout_accuracy"]
        served_text = f"{served:.3f}"
        lines.append(f"| {task} | {kind} | {result['train_accuracy']:.3f} | {result['heldout_accuracy']:.3f} "
                     f"| {served_text} | {seconds:.0f} |")
    lines += ["", "Offline: the PEFT / adapters library loading the saved files. Held-out set: "
              f"{HELDOUT_SIZE} sentences per task; training set: {TRAIN_SIZE}. Wall seconds on a 2-core machine "
              "(training and evaluation; they vary with load).", ""]
    return "\n".join(lines)


def served_accuracy(path: Path) -> list[float]:
    """Held-out accuracy of both adapters served together by adapterserve's encoder engine."""
    engine = Engine.from_pretrained(path, max_loras=2)
    engine.load_adapter("sentiment", OUT / "sentiment-lora")
    engine.load_adapter("topic", OUT / "topic-bottleneck")
    data = [("sentiment", sentiment(HELDOUT_SIZE, held_out=True, seed=SEED + 1)),
            ("topic", topic(HELDOUT_SIZE, held_out=True, seed=SEED + 1))]
    results = engine.classify([t for _, rows in data for t, _ in rows], [task for task, rows in data for _ in rows])
    accuracies, start = [], 0
    for _, rows in data:
        chunk = results[start : start + len(rows)]
        accuracies.append(sum(r.label_index == y for r, (_, y) in zip(chunk, rows)) / len(rows))
        start += len(rows)
    return accuracies


def main() -> None:
    torch.set_num_threads(2)
    path = default_encoder_dir()
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    rows = []
    start = time.time()
    out = OUT / "sentiment-lora"
    result = train_sentiment(path, tokenizer, out)
    rows.append(("sentiment", "PEFT LoRA r=8 on query/value + classifier", result, time.time() - start))
    print("sentiment", result, flush=True)
    start = time.time()
    out = OUT / "topic-bottleneck"
    result = train_topic(out)
    rows.append(("topic", "AdapterHub Pfeiffer (reduction 16) + head", result, time.time() - start))
    print("topic", result, flush=True)
    for (task, _, result, _), accuracy in zip(rows, served_accuracy(path)):
        result["served_heldout_accuracy"] = accuracy
    (OUT / "RESULTS.md").write_text(write_results(rows))
    print(f"wrote {OUT / 'RESULTS.md'}")


if __name__ == "__main__":
    main()
