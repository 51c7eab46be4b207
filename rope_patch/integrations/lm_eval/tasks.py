"""The rope_* lm-eval tasks shipped as package data (rope_patch/data/tasks): where they are, and the groups
`rope_passkey` / `rope_ppl` / `rope_niah` expanded to one task per length. No lm_eval import."""

from __future__ import annotations

from pathlib import Path

from ... import resources

GROUPS = ("rope_passkey", "rope_ppl", "rope_niah")


def tasks_dir() -> Path | None:
    """The rope_* task folder shipped as package data (rope_patch/data/tasks), None if the install lacks it."""
    found = resources.tasks_dir()
    return found if (found / "rope").is_dir() else None


def expand_tasks(tasks: list[str], lengths) -> list[str]:
    """`rope_passkey` + lengths [256, 1024] -> rope_passkey_256, rope_passkey_1024 (other names unchanged)."""
    if not lengths:
        return list(tasks)
    if isinstance(lengths, (int, str)):
        lengths = [int(x) for x in str(lengths).replace("[", "").replace("]", "").replace("/", ",").split(",") if x]
    out = []
    for t in tasks:
        out += [f"{t}_{int(n)}" for n in lengths] if t in GROUPS else [t]
    return out
