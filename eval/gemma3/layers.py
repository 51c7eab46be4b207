"""Which layers each scheme of the Gemma 3 study changes, read from the patched model (no forward): per layer type,
the rotary's frequencies and the factor its cos/sin scale puts on the logits (its square) at a 65,536-token forward
(a dynamic scheme's frozen there), and,
for an attention-side scheme, the shortest distance within the layer's reach (its sliding window, else the whole
input) at which the last query's relative position differs from the distance (`Scheme.relative_position`: regrouped,
clamped, shifted or hidden). Gemma 3 270M: 15 sliding layers (window 512,
θ = 10,000) and 3 global ones (θ = 1,000,000).

    python eval/gemma3/layers.py          # the markdown table of docs/studies/gemma3.md
"""

from __future__ import annotations

import itertools
import shlex
import sys
from pathlib import Path

import torch

import rope_patch
from rope_patch.evaluation.common import at_length
from rope_patch.zoo import load_model

LENGTH = 65536
RUN = Path(__file__).with_name("run_ppl64k.sh")


def schemes() -> list[str]:
    """The study's scheme specs, as its run script lists them."""
    words = shlex.split(RUN.read_text(encoding="utf-8").replace("\\\n", " "), comments=True)
    return list(itertools.takewhile(lambda w: not w.startswith("--"), words[words.index("--schemes") + 1:]))


def frequencies(model) -> dict[str, tuple[torch.Tensor, float]]:
    rotary = model.model.rotary_emb
    return {kind: (rotary._buffers[f"{kind}_inv_freq"].clone(), float(getattr(rotary, f"{kind}_attention_scaling")))
            for kind in model.config.layer_types}


def remapped(scheme, reach: int) -> int | None:
    """The shortest distance < reach whose relative position the scheme changes for the last query of a
    LENGTH-token input (None: none does)."""
    if not hasattr(scheme, "relative_position") or scheme.kind != "attention":
        return None
    i = torch.tensor(LENGTH - 1)
    d = torch.arange(reach)
    rel = scheme.relative_position(i, i - d)
    changed = torch.isnan(rel) | (rel != d.to(rel.dtype))
    return int(d[changed][0]) if bool(changed.any()) else None


def row(model, spec: str, vanilla: dict) -> str:
    cells = []
    with rope_patch.patched(model, spec), at_length(model, LENGTH):
        scheme = rope_patch.current(model)
        now = frequencies(model)
        for kind in dict.fromkeys(model.config.layer_types):
            window = model.config.sliding_window if kind == "sliding_attention" else None
            (f0, t0), (f1, t1) = vanilla[kind], now[kind]
            parts = []
            moved = int((~torch.isclose(f1, f0, rtol=1e-6, atol=0)).sum())
            if moved:
                parts.append(f"{moved}/{f0.numel()} frequencies")
            if abs(t1 - t0) > 1e-9:  # the cos/sin scale multiplies q and k: the logits by its square
                parts.append(f"logits ×{t1 * t1:.3f}")
            first = remapped(scheme, window or LENGTH)
            if first is not None:
                parts.append(f"distances ≥ {first:,} changed")
            cells.append("; ".join(parts) or "unchanged")
    return f"| `{spec}` | " + " | ".join(cells) + " |"


def main() -> None:
    model, _ = load_model("gemma3")
    kinds = list(dict.fromkeys(model.config.layer_types))
    counts = {k: model.config.layer_types.count(k) for k in kinds}
    vanilla = frequencies(model)
    head = " | ".join(f"{counts[k]} {k.replace('_attention', '')} layers" for k in kinds)
    lines = [f"| scheme | {head} |", "| --- | " + " | ".join("---" for _ in kinds) + " |"]
    lines += [row(model, spec, vanilla) for spec in schemes() if spec != "default"]
    print("\n".join(lines))


if __name__ == "__main__":
    try:
        main()
    except Exception as e:  # noqa: BLE001 (one line, no traceback)
        sys.exit(f"layers.py: {e}")
