"""The benchmark's one table (stdout and markdown), its summary lines, raw JSON."""
from __future__ import annotations

import json
from pathlib import Path

COLUMNS = ("model", "workload", "B", "dec ms", "floor ms", "x floor", "tax", "dec tok/s", "run tok/s", "TTFT ms",
           "loads", "peak GiB", "note")
BASELINE = {"hf": None, "hf+peft": "hf"}  # workload -> the row its tax is measured against (default: "base")


def add_taxes(rows: list[dict]) -> None:
    """tax = decode step / the baseline's decode step at the same model and batch, minus 1."""
    index = {(r["model"], r["workload"], r["batch"]): r for r in rows}
    for r in rows:
        base = index.get((r["model"], BASELINE.get(r["workload"], "base"), r["batch"]))
        if base is not None and base is not r and r.get("decode_ms") and base.get("decode_ms"):
            r["tax"] = r["decode_ms"] / base["decode_ms"] - 1


def _num(value, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return str(value)
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.{digits if abs(value) < 10 else 1}f}"


def _cells(r: dict) -> list[str]:
    note = r.get("error") or r.get("note") or ""
    if r.get("decode_batch") not in (None, r["batch"]):
        note = "; ".join(x for x in (f"decode B~{r['decode_batch']:g}", note) if x)
    return [
        r["model"], r["workload"], str(r["batch"]), _num(r.get("decode_ms")), _num(r.get("floor_ms")),
        _num(r.get("x_floor")), f"{100 * r['tax']:+.1f}%" if r.get("tax") is not None else "-",
        _num(r.get("decode_tok_s"), 0), _num(r.get("run_tok_s"), 0), _num(r.get("ttft_ms"), 1),
        _num(r.get("loads")), _num(r.get("peak_gib"), 1), note[:70],
    ]


def text_table(rows: list[dict]) -> str:
    cells = [list(COLUMNS)] + [_cells(r) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(c[i].ljust(widths[i]) for i in range(len(COLUMNS))).rstrip() for c in cells]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def markdown_table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in _cells(r)) + " |" for r in rows]
    return "\n".join(lines)


def hotswap_line(model: str, h: dict) -> str:
    if "error" in h:
        return f"hot-swap {model}: {h['error']}"
    return (f"hot-swap {model}: rank-16 all-projection adapter host->slot {h['load_ms']:.2f} ms (median of "
            f"{len(h['load_ms_all'])}); {h['others']} decoding requests delayed {h['delay_ms']:.2f} ms = "
            f"{h['delay_steps']:.2f} decode steps of {h['decode_ms']:.2f} ms (arrival windows beyond plain decode: "
            f"cold {h['cold_extra_ms']:.2f} ms, resident {h['resident_extra_ms']:.2f} ms)")


def _row(rows: list[dict], model: str, workload: str, batch: int) -> dict:
    return next((r for r in rows if (r["model"], r["workload"], r["batch"]) == (model, workload, batch)), {})


def ratio_lines(rows: list[dict], hf_batch: int) -> list[str]:
    lines = []
    for model in dict.fromkeys(r["model"] for r in rows):
        ours, peft, hf = (_row(rows, model, w, hf_batch) for w in ("distinct", "hf+peft", "hf"))
        if ours.get("decode_tok_s") and peft.get("decode_tok_s"):
            lines.append(
                f"{model} B={hf_batch} on {hf_batch} adapters: adapterserve/PEFT decode tok/s "
                f"{ours['decode_tok_s'] / peft['decode_tok_s']:.3g}x, run tok/s "
                f"{ours['run_tok_s'] / peft['run_tok_s']:.3g}x (PEFT run: prefill + {peft['decode_steps']} steps)")
        base = _row(rows, model, "base", hf_batch)
        if base.get("decode_tok_s") and hf.get("decode_tok_s"):
            lines.append(f"{model} B={hf_batch} base: adapterserve/transformers decode tok/s "
                         f"{base['decode_tok_s'] / hf['decode_tok_s']:.3g}x")
    return lines


def target_lines(rows: list[dict], hotswap: dict[str, dict], batch: int = 64) -> list[str]:
    """The issue's targets, where this run measured them."""
    lines = []
    for model in dict.fromkeys(r["model"] for r in rows):
        base, distinct, zipf = (_row(rows, model, w, batch) for w in ("base", "distinct", "zipf"))
        if base.get("x_floor"):
            lines.append(f"{model}: base B={batch} at {base['x_floor']:.2f}x floor (target <= 1.3x for 8b)")
        if distinct.get("tax") is not None:
            lines.append(f"{model}: tax {batch} distinct {100 * distinct['tax']:+.1f}% (target <= 10%); "
                         f"zipf {_pct(zipf.get('tax'))} (target <= 20%)")
        h = hotswap.get(model, {})
        if "load_ms" in h:
            lines.append(f"{model}: load {h['load_ms']:.2f} ms (target < 5 ms), delay {h['delay_steps']:.2f} steps "
                         "(target <= 1)")
    return lines


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def write_outputs(out: Path, header: list[str], rows: list[dict], extra: list[str], raw: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    body = ["## Engine throughput", "", *header, "", markdown_table(rows), "", *[f"- {x}" for x in extra], ""]
    out.write_text("\n".join(body))
    out.with_suffix(".json").write_text(json.dumps(raw, indent=1, default=str))
