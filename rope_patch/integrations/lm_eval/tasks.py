"""The rope_* lm-eval tasks shipped as package data (rope_patch/data/tasks): where they are, the groups
`rope_passkey` / `rope_ppl` / `rope_niah` expanded to one task per length, and their `chat_template` metadata (read
here for the tasks themselves, `rope-patch-lm-eval` and `rope-patch sweep`). No lm_eval import."""

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


TRUE_WORDS = ("1", "true", "yes", "on")


def metadata_flag(value) -> bool:
    """A boolean `--metadata` value: a bool (or number) as given, a string true for "1", "true", "yes" or "on" (any
    case, spaces around ignored)."""
    if isinstance(value, str):
        return value.strip().lower() in TRUE_WORDS
    return bool(value)


def chat_layout_error(given, templated: bool, flag: str, tasks: str = "rope_passkey / rope_niah") -> str | None:
    """The error of a `--metadata chat_template` (`given`; None: not given) that disagrees with whether the run
    renders its prompts with the chat template (`templated`, from `flag`, e.g. "--apply_chat_template given"): the
    `tasks`' prompts would be the template's tokens longer (or shorter) than the length in their names."""
    if given is None or metadata_flag(given) == templated:
        return None
    return (f"--metadata chat_template={given} disagrees with {flag} (prompts {'' if templated else 'not '}templated): "
            f"the {tasks} prompts would not be the length in their names (chat_template=true builds them for a "
            "templated run, the template's tokens counted in the length; false, for a plain one). Leave "
            "chat_template out of --metadata: it follows the flag.")
