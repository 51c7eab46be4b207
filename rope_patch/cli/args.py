"""What the `rope-patch` subcommands share in parsing their arguments: argparse types (a bad number or an unknown
scheme name fails while parsing, with one line that names the flag, the value and what is allowed; argparse adds
`argument --flag:` in front), and the RoPE layout that `plot` and `explain` read from --head-dim/--rope-theta/--window
or --config.

Nothing here imports torch or transformers at module level: parsing (and so `--help` and every argument error) runs
before the library is imported. Scheme specs are checked against the generated name table (rope_patch.scheme_names).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from .. import scheme_names, zoo
from ..evaluation.defaults import AS_LOADED


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def count(minimum: int = 1, maximum: int | None = None):
    """An integer in [minimum, maximum]; `1e6` and `4096.0` are accepted when they are whole numbers."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            x = _number(text)
            if not x.is_integer():
                raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
            value = int(x)
        if value < minimum or (maximum is not None and value > maximum):
            span = f">= {minimum:,}" if maximum is None else f"between {minimum:,} and {maximum:,}"
            raise argparse.ArgumentTypeError(f"must be an integer {span}, got {text}")
        return value

    parse.__name__ = "integer"  # argparse's "invalid <name> value" fallback
    return parse


def real(minimum: float | None = None, maximum: float | None = None, *, above: float | None = None):
    """A finite float in [minimum, maximum] (or strictly above `above`)."""

    def parse(text: str) -> float:
        value = _number(text)
        if above is not None and not value > above:
            raise argparse.ArgumentTypeError(f"must be a number > {above:g}, got {text}")
        if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
            span = (f"in [{minimum:g}, {maximum:g}]" if minimum is not None and maximum is not None
                    else f">= {minimum:g}" if minimum is not None else f"<= {maximum:g}")
            raise argparse.ArgumentTypeError(f"must be a number {span}, got {text}")
        return value

    parse.__name__ = "number"
    return parse


positive = count(1)
fraction = real(0.0, 1.0)


def scheme_spec(*, loaded: bool = False):
    """A scheme spec (`yarn:8`, `yarn:factor=8`, `yarn:4+logn`) whose names are known: the scheme (with "Did you
    mean"), its positional value and its parameter keys, with the messages of `apply()`. The values are checked when
    the command builds the schemes. `loaded`: `loaded` (the model as loaded, compare's baseline row) is accepted too."""

    def parse(text: str) -> str:
        if loaded and text == AS_LOADED:
            return text
        try:
            scheme_names.check_spec(text)
        except (ValueError, TypeError) as err:
            raise argparse.ArgumentTypeError(str(err)) from None
        return text

    parse.__name__ = "scheme spec"
    return parse


def scheme_name(text: str) -> str:
    """A registered scheme name or alias (with "Did you mean"), as given."""
    try:
        scheme_names.canonical_name(text)
    except (ValueError, TypeError) as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def model_help(default: str | None = "tiny") -> str:
    """The help of a model argument, from the model zoo (rope_patch.zoo.MODELS): "tiny, smollm2, gemma3, or a local
    model folder (default: tiny)"."""
    return (f"{', '.join(zoo.MODELS)}, or a local model folder"
            + (f" (default: {default})" if default is not None else ""))


def dtype(text: str) -> str:
    """A model dtype name (float32/fp32, bfloat16/bf16, float16/fp16), as given; checked while parsing, with "Did you
    mean", so that a typo fails before the model loads."""
    try:
        zoo.dtype_name(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


DTYPE_HELP = "model dtype: float32, bfloat16 or float16 (fp32, bf16, fp16) (default: %(default)s)"


def text_file(text: str) -> str:
    """An existing file (--heldout), as given; checked while parsing, so that a wrong path fails before the model
    loads."""
    path = Path(text).expanduser()
    if not path.is_file():
        found = "is a folder" if path.is_dir() else "does not exist"
        raise argparse.ArgumentTypeError(f"{path} {found}: expected a UTF-8 text file (leave the option out to use "
                                         "the held-out text shipped with rope_patch).")
    return text


text_file.__name__ = "file"


def rope_layout(args) -> dict:
    """The RoPE keyword arguments of rope_patch.analysis / rope_patch.plots from `--head-dim --rope-theta --window
    --partial-rotary-factor [--seq-len]`, or `--config MODEL` (tiny, smollm2, gemma3 or a model folder; then
    "_num_heads" too: the config's head count)."""
    if args.config is not None:
        if args.window is not None or args.partial_rotary_factor is not None:
            raise ValueError("--config gives the window and rotary layout; drop --window / --partial-rotary-factor.")
        import transformers

        from .. import zoo

        # tiny / smollm2 / gemma3 / a local folder (never the hub: an unknown name is an error, not a download); only
        # its config.json is read. The lazy transformers module loads its auto classes only now.
        cfg = transformers.AutoConfig.from_pretrained(zoo.resolve_model_path(args.config))
        rope = {"config": cfg, "_num_heads": getattr(cfg, "num_attention_heads", None)}
    else:
        rope = {"head_dim": args.head_dim, "rope_theta": args.rope_theta,
                "max_position_embeddings": args.window or 4096, "partial_rotary_factor": args.partial_rotary_factor}
    if args.seq_len is not None:
        rope["seq_len"] = args.seq_len
    return {k: v for k, v in rope.items() if v is not None or k == "_num_heads"}


def load_model(console, spec, threads: int | None, dtype):
    """Set the torch threads (--threads, else the cores not busy), load `spec` as saved (with the patch of its
    rope_patch.json, evaluation.loading) and say so: (path, model, tokenizer)."""
    import torch

    from .. import zoo
    from ..evaluation import loading
    from ..evaluation.common import auto_threads

    torch.set_num_threads(threads or auto_threads())
    path = zoo.resolve_model_path(spec)
    console.print(f"Loading {spec} from {path} ({torch.get_num_threads()} threads) ...")
    model, tokenizer = loading.load_model(spec, dtype=dtype)
    patch = loading.loaded_patch(model, path)
    if patch:
        console.print(f"{spec} carries {patch['label']}, re-applied from {patch['file']} (the `loaded` row).")
    return path, model, tokenizer
