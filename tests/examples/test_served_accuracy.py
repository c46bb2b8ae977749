"""The example task adapters, served through the encoder engine in one mixed
stream of requests, reach the held-out accuracy they have offline."""
import re
import sys
from pathlib import Path

import torch
from peft import PeftModel
from transformers import AutoModelForSequenceClassification

from adapterserve import Engine
from adapterserve.models.encoder_loader import default_encoder_dir

EXAMPLES = Path(__file__).parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))
from task_data import sentiment, topic  # noqa: E402
from train_tasks import HELDOUT_SIZE, SEED  # noqa: E402


def _offline_sentiment(data, tokenizer) -> float:
    model = PeftModel.from_pretrained(AutoModelForSequenceClassification.from_pretrained(
        default_encoder_dir(), num_labels=2, dtype=torch.float32), EXAMPLES / "adapters" / "sentiment-lora").eval()
    right = 0
    with torch.no_grad():
        for start in range(0, len(data), 64):
            chunk = data[start : start + 64]
            enc = tokenizer([t for t, _ in chunk], padding=True, return_tensors="pt")
            right += int((model(**enc).logits.argmax(-1) == torch.tensor([y for _, y in chunk])).sum())
    return right / len(data)


def _recorded_offline(task: str) -> float:
    """Held-out accuracy the adapters library measured (its own environment; RESULTS.md)."""
    text = (EXAMPLES / "adapters" / "RESULTS.md").read_text()
    row = next(line for line in text.splitlines() if line.startswith(f"| {task} |"))
    return float(re.split(r"\s*\|\s*", row)[4])


def test_served_accuracy_equals_offline():
    engine = Engine.from_pretrained(default_encoder_dir(), max_loras=2)
    engine.load_adapter("sentiment", EXAMPLES / "adapters" / "sentiment-lora")
    engine.load_adapter("topic", EXAMPLES / "adapters" / "topic-bottleneck")
    data = {"sentiment": sentiment(HELDOUT_SIZE, held_out=True, seed=SEED + 1),
            "topic": topic(HELDOUT_SIZE, held_out=True, seed=SEED + 1)}
    texts = [t for task in data for t, _ in data[task]]
    ids = [task for task in data for _ in data[task]]
    results = engine.classify(texts, ids)
    served = {task: sum(r.label_index == y for r, (_, y), a in zip(results, [p for t in data for p in data[t]], ids)
                        if a == task) / len(data[task]) for task in data}
    assert abs(served["sentiment"] - _offline_sentiment(data["sentiment"], engine.tokenizer)) < 1e-9
    assert abs(served["topic"] - _recorded_offline("topic")) < 1.5 / HELDOUT_SIZE
    assert served["sentiment"] > 0.7 and served["topic"] > 0.7
    print(served)
