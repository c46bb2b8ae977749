"""Reading a Prometheus scrape in tests: prometheus_client's own parser, samples by name and labels."""
from __future__ import annotations

from dataclasses import dataclass

import requests
from prometheus_client.parser import text_string_to_metric_families

Labels = frozenset[tuple[str, str]]


@dataclass(frozen=True)
class Scrape:
    samples: dict[tuple[str, Labels], float]
    types: dict[str, str]  # family name -> counter, gauge, histogram

    def total(self, name: str, **labels: str) -> float:
        """The sum of samples `name` whose labels include `labels` (0 when there is none)."""
        wanted = set(labels.items())
        return sum(v for (n, ls), v in self.samples.items() if n == name and wanted <= ls)

    def label_values(self, name: str, label: str) -> set[str]:
        return {dict(ls)[label] for (n, ls), _ in self.samples.items() if n == name and label in dict(ls)}

    def names(self) -> set[str]:
        return {n for n, _ in self.samples}

    def minus(self, earlier: Scrape, name: str, **labels: str) -> float:
        return self.total(name, **labels) - earlier.total(name, **labels)


def parse(text: str) -> Scrape:
    samples, types = {}, {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return Scrape(samples, types)


def scrape(url: str) -> Scrape:
    reply = requests.get(url, timeout=30)
    assert reply.status_code == 200, reply.text
    assert reply.headers["content-type"].startswith("text/plain"), reply.headers
    return parse(reply.text)
