"""Shared test code (importable as `helpers.*`: pytest puts tests/ on the path, see pyproject's `pythonpath`).

    models.py         the one tiny-model builder (every architecture the tests cover), native twins, logits
    text.py           the one filler text, a character tokenizer, a byte-level BPE tokenizer trained in a second
    reference.py      straightforward references of the attention schemes written from their papers
    reference_dca.py  Dual Chunk Attention's reference (three partial softmaxes, materialised)
    training.py       packed rows for the rope_patch.training tests
    lm_eval.py        running lm-eval in-process on the tiny assets
    recipes.py        saved tiny models and configs for the fine-tuning recipe
    scripts.py        the project's scripts (recipes/, bench/, eval/) loaded as modules

Fixtures live in the conftest.py of the directory that uses them.
"""
