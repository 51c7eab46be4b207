"""How a user calls rope_patch, type-checked by mypy against the package's annotations (tests/test_typing.py)."""

from __future__ import annotations

from pathlib import Path

from torch import nn

import rope_patch
from rope_patch import FrequencyScheme, Scheme


def use(model: nn.Module, folder: Path) -> int:
    patched: nn.Module = rope_patch.apply(model, "yarn", factor=4.0, original_max_position_embeddings=4096)
    rope_patch.apply(patched, "yarn:4")
    scheme: Scheme | None = rope_patch.current(model)
    window: int = rope_patch.context_window(model)
    names: list[str] = rope_patch.list_schemes()
    with rope_patch.patched(model, "alibi") as inner:
        assert inner is model
    params: dict = rope_patch.to_rope_parameters("yarn:4", rope_theta=1e4)
    rope_patch.save_pretrained(model, folder)
    again = rope_patch.from_pretrained(folder)
    rope_patch.remove(again)
    built: Scheme = rope_patch.as_scheme("linear", factor=2.0)
    assert isinstance(built, FrequencyScheme) or scheme is None
    return window + len(names) + len(params)
