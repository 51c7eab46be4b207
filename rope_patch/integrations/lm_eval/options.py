"""`rope-patch sweep`'s options and their defaults (SweepOptions), apart from the sweep itself so that the command
line builds its parser from them without importing torch or transformers (sweep.py re-exports the class)."""

from __future__ import annotations

import dataclasses

from ...evaluation import defaults as compare


@dataclasses.dataclass
class SweepOptions:
    """What `sweep` reads: the `rope-patch sweep` options under the names of their flags (the CLI passes its
    argparse Namespace, which has the same attributes). Defaults: those of the command, i.e. compare's."""

    model: str = "tiny"  # tiny, smollm2, gemma3, or a local model folder
    schemes: list[str] = dataclasses.field(default_factory=lambda: ["default", "yarn:4"])  # scheme specs
    tasks: list[str] = dataclasses.field(default_factory=lambda: ["rope_passkey", "rope_ppl"])
    lengths: list[int] = dataclasses.field(default_factory=lambda: list(compare.DEFAULT_LENGTHS))
    depths: list[float] = dataclasses.field(default_factory=lambda: list(compare.DEFAULT_DEPTHS))
    passkey_samples: int = compare.PASSKEY_SAMPLES
    windows: int = compare.WINDOWS_AT_LONGEST  # perplexity reads windows x max(L, 2048) tokens at a length L
    seed: int = compare.SEED
    heldout: str | None = None  # held-out text (default: the packaged one)
    model_args: list[str] = dataclasses.field(default_factory=list)  # extra KEY=VALUE model_args
    metadata: list[str] = dataclasses.field(default_factory=list)  # extra KEY=VALUE lm-eval metadata
    limit: float | None = None  # lm-eval --limit
    batch_size: str = "1"
    # auto | on | off: lm-eval's --apply_chat_template (auto: on when the tokenizer has one)
    chat_template: str = "auto"
    include_path: str | None = None  # task folder (default: the packaged rope_patch/data/tasks)
    launcher: str | None = None  # e.g. "torchrun --nproc_per_node 2" or "accelerate launch"
    in_process: bool = False  # run lm-eval in this process (no launcher)
    out: str = "results/sweep"
    no_plots: bool = False
