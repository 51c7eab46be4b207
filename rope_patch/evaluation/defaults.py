"""The defaults of `rope-patch compare` (and of the sweep, which takes compare's), in a module that imports nothing:
the command line shows them in its help and checks its arguments before it imports torch."""

DEFAULT_SCHEMES = ("default", "linear:4", "ntk:8", "dynamic:4", "yarn:8", "llama3:8")
# The model as loaded, no patch: the baseline row. Added first on a checkpoint that ships with scaling (Llama 3.x
# `llama3`, Qwen/gpt-oss `yarn`, Phi-3 `longrope`), where `default` is unscaled RoPE, not the model people run.
AS_LOADED = "loaded"
DEFAULT_LENGTHS = (256, 512, 1024, 2048)
DEFAULT_DEPTHS = (0.1, 0.5, 0.9)  # needle depths of the passkey cells
PASSKEY_SAMPLES = 4  # passkey prompts per (length, depth) cell
WINDOWS_AT_LONGEST = 2  # perplexity windows of PPL_SHARED_LENGTH tokens' worth, or of a longer length itself
# Every perplexity length up to it reads the same first WINDOWS_AT_LONGEST x PPL_SHARED_LENGTH held-out tokens, a
# longer length WINDOWS_AT_LONGEST windows of its own: a length's figure never depends on the run's other lengths
# (the longest of DEFAULT_LENGTHS, so a default run reads what it read when every length read windows x longest)
PPL_SHARED_LENGTH = 2048
SEED = 0  # the passkey seed
# From this length on, a perplexity window of a model with sliding-window layers runs them over their window only
# (attention.windowed: no L×L mask, whose float copy alone is 1 GB at 16k and 17 GB at 64k); below it the default
# path, which is as fast or faster there (a fused scheme kernel, one sdpa call)
WINDOWED_FROM = 8192
