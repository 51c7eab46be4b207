"""`rope-patch export DIR`: the native `rope_parameters` of a saved model or adapter, and the vLLM argument.

DIR is what `rope_patch.save_pretrained` (or the fine-tuning recipe) wrote: a full or merged model (config.json)
or a peft adapter (adapter_config.json), each with rope_patch.json. Prints the `rope_parameters` dict, the
`max_position_embeddings` that goes with it, and the matching `vllm serve ... --hf-overrides '...'` argument; for
schemes without a native form (dynamic_yarn, attention schemes) it fails with the reason and what to do instead.
"""

from __future__ import annotations

import json


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("export", help="print the native rope_parameters and vLLM --hf-overrides of a saved model")
    p.add_argument("dir", help="a folder written by rope_patch.save_pretrained (model, merged model or adapter)")
    p.add_argument("--base", default=None, help="the adapter's base model (default: the path recorded in adapter_config.json)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(func=_export)


def _export(args) -> int:
    from ..persistence import export_info  # torch: only now, after the arguments parsed

    info = export_info(args.dir, args.base)  # errors: one line from cli.main
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"scheme: {info['scheme'] or 'none (unpatched)'}")
    print(f"rope_parameters: {json.dumps(info['rope_parameters'])}")
    print(f"max_position_embeddings: {info['max_position_embeddings']}")
    print(f"vLLM: vllm serve {args.dir} {info['vllm']}")
    return 0
