"""rope_patch for lm-evaluation-harness (the optional `lm-eval` extra).

    model.py   the `rope_patch` lm-eval model (HFLM + a scheme), registered with lm-eval when imported
    cli.py     `rope-patch-lm-eval`: lm-eval's own command line with that model registered
    tasks.py   where the packaged rope_* tasks are (rope_patch/data/tasks) and their per-length expansion
    sweep.py   `rope-patch sweep`: lm-eval tasks x schemes, one lm-eval run per scheme, resumable

Only model.py and cli.py import lm_eval at module level; this package, tasks.py and sweep.py import without it.
"""
