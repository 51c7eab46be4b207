"""`rope-patch export DIR`: the native `rope_parameters` of a saved model or adapter, and the vLLM argument; with
`--engine vllm|sglang`, the exact command line that serves it as patched.

DIR is what `rope_patch.save_pretrained` (or the fine-tuning recipe) wrote: a full or merged model (config.json)
or a peft adapter (adapter_config.json), each with rope_patch.json. Prints the `rope_parameters` dict, the
`max_position_embeddings` that goes with it, and the checked `vllm serve ...` command (`--json`: "vllm", or null
and "vllm_refused" where vLLM would not run the patch as transformers does, or the folder has no tokenizer for it to
load); for schemes without a native form (dynamic_yarn, attention schemes) it fails with the reason and what to do
instead.

With --engine, it prints the engine's command line (its override flag with the native `rope_parameters`, per layer
type where the model has them, the context length the patch serves, and the engine's allow-longer environment
variable where that length passes what the engine derives from the config) and writes the engine-ready config.json
to DIR/serve-ENGINE/ (or --out), never over the checkpoint's own. Where the engine does not run the patch (attention
schemes, modifiers, stacks with either, keys the engine does not read) it refuses in one line naming the scheme and
the engine's rope types; where the folder the engine loads (DIR, or an adapter's base) has no tokenizer, in one line
saying how to save one there. What each engine accepts is read from its source: rope_patch/data/engines.json
(`python -m rope_patch.engines`; rope_patch.serving explains the rules).
"""

from __future__ import annotations

import argparse
import json

from .. import engines


def engine_name(text: str) -> str:
    """An engine of the snapshot (torch-free: checked while parsing, with "Did you mean")."""
    name = text.strip().lower()
    if name not in engines.ENGINES:
        raise argparse.ArgumentTypeError(engines.unknown_engine(text))
    return name


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("export", help="print the native rope_parameters and vLLM --hf-overrides of "
                                             "a saved model, or (--engine) the vLLM / SGLang command line "
                                             "that serves it")
    p.add_argument("dir", help="a folder written by rope_patch.save_pretrained (model, merged model or adapter)")
    p.add_argument("--base", default=None, help="the adapter's base model (default: the path recorded in "
                                                "adapter_config.json)")
    p.add_argument("--engine", type=engine_name, default=None, metavar="|".join(engines.ENGINES),
                   help="print this serving engine's command line and write its config.json (vllm, sglang)")
    p.add_argument("--out", default=None, metavar="FOLDER",
                   help="with --engine: the folder for the engine's config.json (default DIR/serve-ENGINE; never the "
                        "checkpoint's own config.json)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(func=_export)


def _export(args) -> int:
    if args.engine is not None:
        return _engine(args)
    if args.out is not None:
        raise ValueError("--out is the folder of --engine's config.json: pass --engine vllm or --engine sglang too.")
    from ..persistence import export_info  # torch: only now, after the arguments parsed

    info = export_info(args.dir, args.base)  # errors: one line from cli.main
    from ..serving import MissingTokenizerError, export  # the checked command line; nothing written

    try:
        info["vllm"], refused = export(args.dir, "vllm", base=args.base, write=False)["command"], None
    except MissingTokenizerError as err:  # a command that could not start is not printed
        info["vllm"], refused, untokenized = None, str(err), True
    except ValueError as err:  # (export_info's raw --hf-overrides would serve another model: not shown)
        info["vllm"], refused, untokenized = None, str(err), False
    if args.json:
        print(json.dumps({**info, **({"vllm_refused": refused} if refused else {})}, indent=2))
        return 0
    print(f"scheme: {info['scheme'] or 'none (unpatched)'}")
    print(f"rope_parameters: {json.dumps(info['rope_parameters'])}")
    print(f"max_position_embeddings: {info['max_position_embeddings']}")
    print(f"vLLM: {info['vllm']}" if refused is None else f"vLLM: {refused}" if untokenized else
          f"vLLM: not served as patched: {refused}")
    print(f"(`rope-patch export {args.dir} --engine vllm|sglang`: the engine's command line, "
          "its notes and config.json)")
    return 0


def _engine(args) -> int:
    from ..serving import export  # torch: only now

    info = export(args.dir, args.engine, base=args.base, out=args.out)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"# {info['engine']} {info['version']}: {info['scheme'] or 'none (unpatched)'}, context length "
          f"{info['context_length']} (the engine derives {info['derived_length']} from the config)")
    for note in info["notes"]:
        print(f"# note: {note}")
    print(f"# config.json with these rope_parameters: {info['config_path']}")
    if info["alternative"]:
        print(f"# or, reading that config.json: {info['alternative']}")
    print(info["command"])
    return 0
