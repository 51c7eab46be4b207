"""Tunables of the attention functions, read at call time (so a test or a user can change them for one run)."""

# Scores per query block in the blocked function (b × heads × block × keys). 2**22 fp32 = 16 MiB: at L = 16384 with
# 4 heads a block is 64 queries, few enough blocks that the Python loop costs nothing next to the matmuls.
BLOCK_ELEMENTS = 1 << 22
FUSED_BLOCK: int | None = None  # query rows per block on the fused path; None: the scheme's choice
# flex_attention through torch.compile (flex.compiled_flex), as transformers' own flex backend does.
# False runs flex eagerly: exact, but it materialises the scores (debugging / tests on CPU, where the compiled kernel
# is refused at apply(): schemes/common.py).
FLEX_COMPILE = True
# Compiled flex variants (score_mod, mask_mod, lse, dtype, static then dynamic shapes) kept per process before a call
# raises (torch's own limit, 8, would run the rest uncompiled without a word: flex.compiled_flex). The GPU check's
# seven schemes at three lengths and two dtypes made 36 on an H200; each compiles once, in seconds.
FLEX_RECOMPILES = 256
FLASH_DEVICES = ("cuda",)  # devices on which flash_attn's kernels run
# Calls with at most this many query rows (decoding steps) take the materialised path: one row of scores per head and
# key (8k keys × 9 heads: 0.3 MB) costs less than the fused path's several kernel calls and log-sum-exp merge; and a
# re-positioned layer runs its position copies stacked in one call rather than one after another (attention/copies.py).
DECODE_ROWS = 4
