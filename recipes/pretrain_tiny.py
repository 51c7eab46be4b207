"""Pretrain rope-tiny, the project's embedded small LLaMA, from scratch on Jane Austen's novels (CPU only).

rope-tiny is the test subject for position-encoding swaps: a real trained LlamaForCausalLM small enough for a
2-core CPU, with a short training window (256 tokens) so that extrapolation failure and its repair by a
context-extension scheme show up at 512 - 2048 tokens in seconds. It is trained to retrieve passkeys inside its
window, so that retrieval beyond the window is a meaningful test.

One launch trains rope-tiny from scratch: a byte-level BPE tokenizer on five novels (Persuasion is held out),
then a freshly initialised model on random 256-token stretches of them, a share of which are replaced by passkey
prompts followed by their answer (answer tokens up-weighted in the loss; a curriculum from short prompts to
prompts spanning the window, see `BatchSampler`). It saves model, tokenizer, a training record and a model card
with held-out measurements to ``output_dir``, and writes the held-out text to ``heldout_path``:

    python recipes/pretrain_tiny.py --config recipes/configs/pretrain_tiny.yaml

A config with ``init_from`` (an earlier run's output folder) continues that model with its own data mix and
schedule instead, as a further stage recorded in the same model card.

Deterministic given the seeds on a given machine and torch version (one data RNG per stage, seeded torch, fixed
thread count).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from transformers.optimization import get_cosine_with_min_lr_schedule_with_warmup

# Run from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from check_tiny import passkey_accuracy, perplexity  # noqa: E402
from corpus import HELDOUT_TITLE, load_austen  # noqa: E402

from rope_patch import schema  # noqa: E402
from rope_patch.evaluation.passkey import make_passkey_sample  # noqa: E402

BOS, EOS = "<s>", "</s>"
# Per-stage record (config, loss curve, time) saved beside the model, so a later stage can report the whole run.
STATE_FILE = "training_state.json"


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE (GPT-2 style: no unknown tokens) with every digit its own token.

    Split digits make every 5-digit passkey five tokens out of the ten digit tokens, all well trained, so that
    retrieval is copying; with merged digit runs, keys would map to rare multi-digit tokens that a novel corpus
    barely trains.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    # Like LLaMA's tokenizer, encoding a text starts it with BOS.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tokenizer.token_to_id(BOS))]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS, pad_token=EOS)


def build_model(cfg: dict, tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_key_value_heads"],
        max_position_embeddings=cfg["max_position_embeddings"],
        rope_parameters={"rope_type": "default", "rope_theta": float(cfg["rope_theta"])},
        tie_word_embeddings=cfg["tie_word_embeddings"],
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config)


class BatchSampler:
    """Training batches of ``seq_len`` tokens with per-token loss weights, all randomness from one RNG.

    A row is either a random stretch of the training text or, with the probability the current curriculum phase
    gives, as many passkey samples as fit (a prompt of random length in the phase's range with the needle at a
    uniform random depth, then the answer and EOS), then text again to fill the row. Answer tokens get
    ``answer_loss_weight``: they are 6 of up to 256 tokens, and without the extra weight retrieval is learned late
    or not at all in a run this short.

    The curriculum (``passkey_curriculum``: phases ``{until_step, fraction, min_tokens, max_tokens}``) starts with
    short prompts and ends with prompts that span the whole window. Retrieval in a small model appears as a
    phase change (an induction-style copy circuit forms); short prompts pack many answers into a step and make
    the lookup easy, so the circuit forms early, and the later phases stretch it to every distance inside the
    window. A model only trained on short needle-to-question distances fails at longer ones even inside its
    window: an earlier rope-tiny trained on prompts of at most 160 tokens missed nearly every needle placed
    more than ~150 tokens before the question.
    """

    def __init__(self, tokenizer, stream: list[int], cfg: dict, rng: random.Random):
        self.tokenizer, self.stream, self.rng = tokenizer, stream, rng
        self.seq_len, self.batch_size = cfg["seq_len"], cfg["batch_size"]
        self.curriculum = cfg["passkey_curriculum"]
        self.answer_weight = cfg["answer_loss_weight"]

    def phase(self, step: int) -> dict:
        """The curriculum phase that ``step`` (1-based) falls in; the last phase continues to the end."""
        return next((p for p in self.curriculum if step <= p["until_step"]), self.curriculum[-1])

    def _text(self, n: int) -> list[int]:
        start = self.rng.randint(0, len(self.stream) - n)
        return self.stream[start : start + n]

    def _row(self, phase: dict) -> tuple[list[int], list[float]]:
        if self.rng.random() >= phase["fraction"]:
            return self._text(self.seq_len), [1.0] * self.seq_len
        ids, weights = [], []
        # 8 = room for the answer (space + 5 digits) and EOS, with a token to spare.
        while (room := self.seq_len - len(ids) - 8) >= phase["min_tokens"]:
            length = self.rng.randint(phase["min_tokens"], min(phase["max_tokens"], room))
            sample = make_passkey_sample(self.tokenizer, self.stream, length, self.rng.random(), self.rng)
            answer = sample["answer_ids"]
            ids += sample["prompt_ids"] + answer + [self.tokenizer.eos_token_id]
            weights += [1.0] * length + [self.answer_weight] * len(answer) + [1.0]
        rest = self.seq_len - len(ids)
        return ids + self._text(rest), weights + [1.0] * rest

    def __call__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        phase = self.phase(step)
        rows = [self._row(phase) for _ in range(self.batch_size)]
        return torch.tensor([r[0] for r in rows]), torch.tensor([r[1] for r in rows])


def train(model, sampler: BatchSampler, cfg: dict, probe: Callable[[], str]) -> tuple[list[tuple[int, float]], float]:
    """Returns the loss curve as (step, mean weighted loss over the last ``log_every`` steps) and the wall time.

    Every ``eval_every`` steps prints ``probe()``, a quick held-out measurement, so that a run that will miss its
    targets can be stopped early; it draws from no random generator the training uses.
    """
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]  # norms: decaying them only shrinks the signal
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg["lr"],
        betas=tuple(cfg["betas"]),
    )
    steps = cfg["steps"]
    # transformers' schedule, the one the fine-tuning recipe gets from Trainer (lr_scheduler_type="cosine_with_min_lr").
    # Its warm-up starts at 0 (step s gets s/warmup of the lr; the copy it replaces gave (s+1)/warmup); after the
    # warm-up the two are the same cosine down to lr x min_lr_ratio.
    schedule = get_cosine_with_min_lr_schedule_with_warmup(
        optimizer, cfg["warmup_steps"], steps, min_lr_rate=cfg["min_lr_ratio"]
    )
    tokens_per_step = cfg["batch_size"] * cfg["seq_len"]
    curve, window_losses, answer_losses = [], [], []
    model.train()
    start = last = time.perf_counter()
    for step in range(1, steps + 1):
        ids, weights = sampler(step)
        logits = model(input_ids=ids).logits[:, :-1]
        # [b, s-1, vocab] -> [b*(s-1), vocab]: next-token loss, each target weighted.
        nll = F.cross_entropy(logits.reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1), reduction="none")
        target_weights = weights[:, 1:].reshape(-1)
        loss = (nll * target_weights).sum() / target_weights.sum()
        # Loss on the passkey answers alone: it drops from ~ln(10) per digit to ~0 when the copy circuit forms.
        answers = target_weights > 1
        if answers.any():
            answer_losses.append(nll[answers].mean().item())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["grad_clip"])
        optimizer.step()
        schedule.step()
        window_losses.append(loss.item())

        if step % cfg["log_every"] == 0 or step == steps:
            now = time.perf_counter()
            mean_loss = sum(window_losses) / len(window_losses)
            curve.append((step, mean_loss))
            rate = len(window_losses) * tokens_per_step / (now - last)
            eta = (steps - step) * tokens_per_step / rate / 60
            answer_loss = sum(answer_losses) / len(answer_losses) if answer_losses else float("nan")
            print(
                f"step {step:5d}/{steps}  loss {mean_loss:.3f}  answer loss {answer_loss:.3f}  "
                f"lr {schedule.get_last_lr()[0]:.2e}  "
                f"{rate:,.0f} tok/s  elapsed {(now - start) / 60:.1f} min  eta {eta:.1f} min",
                flush=True,
            )
            window_losses, answer_losses, last = [], [], now
        if step % cfg["eval_every"] == 0 and step != steps:
            model.eval()
            print(f"step {step:5d}/{steps}  held-out: {probe()}", flush=True)
            model.train()
            last = time.perf_counter()
    model.eval()
    return curve, time.perf_counter() - start


def truncate_utf8(text: str, max_bytes: int) -> str:
    """The longest prefix of whole lines that fits in ``max_bytes`` UTF-8 bytes."""
    if len(text.encode("utf-8")) <= max_bytes:
        return text
    cut = text.encode("utf-8")[:max_bytes].decode("utf-8", errors="ignore")
    return cut[: cut.rfind("\n") + 1]


def _loss_rows(curve: list[list[float]]) -> str:
    """About ten rows of the loss curve, always including the last."""
    every = max(len(curve) // 10, 1)
    shown = curve[every - 1 :: every]
    if shown[-1] != curve[-1]:
        shown.append(curve[-1])
    return "\n".join(f"| {step} | {loss:.3f} |" for step, loss in shown)


def _curriculum_rows(curriculum: list[dict]) -> str:
    rows, first = [], 1
    for phase in curriculum:
        rows.append(
            f"  - steps {first}-{phase['until_step']}: {phase['fraction']:.0%} of sequences hold passkey samples, "
            f"prompts of {phase['min_tokens']}-{phase['max_tokens']} tokens"
        )
        first = phase["until_step"] + 1
    return "\n".join(rows)


def _stage_section(number: int, stage: dict) -> str:
    t = stage["train"]
    tokens = t["steps"] * t["batch_size"] * t["seq_len"]
    return f"""### Stage {number}: `{stage["config"]}`

    {stage["launch"]}

- AdamW: lr {t["lr"]:g}, betas {tuple(t["betas"])}, weight decay {t["weight_decay"]:g} on weight matrices
- {t["warmup_steps"]} linear warm-up steps, then cosine decay to {t["min_lr_ratio"]:g} x lr; gradient clipping \
{t["grad_clip"]:g}
- {t["steps"]} steps x {t["batch_size"]} sequences x {t["seq_len"]} tokens = {tokens:,} tokens seen
- passkey curriculum (as many samples as fit in a passkey sequence), answer tokens weighted \
{t["answer_loss_weight"]:g}x:
{_curriculum_rows(t["passkey_curriculum"])}
- fp32, {t["threads"]} CPU thread(s), {stage["seconds"] / 60:.1f} min; seed {stage["seed"]}

The weighted loss steps up where a curriculum phase starts: longer prompts mean fewer, harder answers per
sequence and more prose, not a worse model.

| step | training loss (weighted, mean over {t["log_every"]} steps) |
| ---: | ---: |
{_loss_rows(stage["curve"])}
"""


def model_card(config, n_params: int, state: dict, ev: dict, heldout_path: str, n_passkey: int) -> str:
    """README.md of the saved model: data, tokenizer, architecture, training stages and held-out measurements."""
    window = config.max_position_embeddings
    stages = "\n".join(_stage_section(i, stage) for i, stage in enumerate(state["stages"], 1))
    tokens_seen = sum(st["train"]["steps"] * st["train"]["batch_size"] * st["train"]["seq_len"]
                      for st in state["stages"])
    minutes = sum(st["seconds"] for st in state["stages"]) / 60
    ppl_rows = "\n".join(f"| {n} | {ev['ppl'][n]:.1f} |" for n in sorted(ev["ppl"]))
    return f"""---
license: mit
language: en
library_name: transformers
pipeline_tag: text-generation
---

# rope-tiny

A {n_params / 1e6:.1f}M-parameter `LlamaForCausalLM` trained from scratch on Jane Austen's novels, embedded in
`rope_patch` as a CPU-sized test subject for position-encoding swaps. Its training window is {window} tokens, so
vanilla RoPE degrades visibly at 512-2048 tokens and context-extension schemes have something to repair. It was
also trained to retrieve passkeys inside its window. It is a research fixture, not a useful language model.

## Data
- Training: {", ".join(state["train_books"])} ({state["stream_tokens"]:,} tokens), from Debian's
  `r-cran-janeaustenr` (Project Gutenberg texts, public domain), read by `recipes/corpus.py`.
- Held out: *{HELDOUT_TITLE}*, stored as `{heldout_path}`; never trained on.
- Passkeys: a share of training sequences hold as many passkey prompts as fit (`rope_patch/evaluation/passkey.py`,
  after Mohtashami & Jaggi 2023; prose filler from the training books, needle depth uniform in [0, 1]), each
  followed by its answer and EOS, the rest of the sequence filled with prose.

## Tokenizer
- Byte-level BPE, vocabulary {config.vocab_size}, trained on the training books with the `tokenizers` library.
- Every digit is its own token.
- `<s>`: BOS, prepended on encoding. `</s>`: EOS, also the padding token.

## Architecture
- hidden {config.hidden_size}, {config.num_hidden_layers} layers, {config.num_attention_heads} heads of dimension \
{config.head_dim}, {config.num_key_value_heads} key/value heads
- SwiGLU MLP {config.intermediate_size}, RMSNorm, tied input/output embeddings
- RoPE theta {config.rope_parameters["rope_theta"]:g}, max_position_embeddings {window} (the training window)

## Training
{len(state["stages"])} stage(s), {tokens_seen:,} tokens in all, {minutes:.1f} min of training on a shared 2-core CPU.

{stages}
## Evaluation (vanilla RoPE, held-out *{HELDOUT_TITLE}*)
Perplexity over non-overlapping windows of each length, all lengths scoring the same {ev["n_tokens"]:,} tokens:

| tokens | perplexity |
| ---: | ---: |
{ppl_rows}

Passkey accuracy with {window}-token prompts: {ev["passkey"]:.0%} of {n_passkey} (`rope_patch.evaluation`: greedy
decoding of the answer's length + 1 tokens, exact match of the first number; needles at depths 0.1, 0.3, 0.5, 0.7,
0.9; filler from the held-out book). Perplexity and passkey are measured as `rope-patch compare` and the fine-tuning
recipe measure them (no BOS added to the held-out text), so the numbers agree wherever the settings do.

Re-measure with `python recipes/check_tiny.py`.
"""


def read_config(path: Path) -> dict:
    """The checked config (rope_patch's one file schema, schema.PRETRAIN_CONFIG): a missing key, a value of the wrong
    type, or a broken file stops the run at once with one line naming the file and the key, not mid-training."""
    try:
        return schema.read(path, schema.PRETRAIN_CONFIG)
    except (ValueError, FileNotFoundError) as err:
        sys.exit(f"pretrain_tiny: config error: {err}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, type=Path)
    args = parser.parse_args()
    cfg = read_config(args.config)
    t = cfg["train"]
    torch.set_num_threads(t["threads"])
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(cfg["seed"])
    rng = random.Random(cfg["seed"])

    try:
        books = load_austen()
    except FileNotFoundError as error:
        sys.exit(str(error))
    heldout = truncate_utf8(books.pop(HELDOUT_TITLE), cfg["heldout_max_bytes"])
    heldout_path = Path(cfg["heldout_path"])
    heldout_path.parent.mkdir(parents=True, exist_ok=True)
    heldout_path.write_text(heldout, encoding="utf-8")

    if "init_from" in cfg:
        # A later stage continues the model (and tokenizer) an earlier stage saved, and its record.
        init = Path(cfg["init_from"])
        tokenizer = PreTrainedTokenizerFast.from_pretrained(init)
        model = LlamaForCausalLM.from_pretrained(init)
        state = json.loads((init / STATE_FILE).read_text())
    else:
        tokenizer = train_tokenizer(list(books.values()), cfg["tokenizer"]["vocab_size"])
        model = build_model(cfg["model"], tokenizer)
        state = {"train_books": list(books), "stages": []}
    # One stream of all training books, each framed by BOS/EOS as a document would be.
    stream = []
    for text in books.values():
        stream += tokenizer.encode(text) + [tokenizer.eos_token_id]
    state["stream_tokens"] = len(stream)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"tokenizer: {len(tokenizer)} tokens; training stream: {len(stream):,} tokens", flush=True)
    print(f"model: {n_params:,} parameters", flush=True)

    window = model.config.max_position_embeddings
    # As rope_patch.evaluation reads it (check_tiny, rope-patch compare, the fine-tuning recipe): no BOS added.
    heldout_ids = tokenizer.encode(heldout, add_special_tokens=False)[: cfg["eval"]["heldout_tokens"]]
    probe_ids = heldout_ids[: 32 * window]

    def probe() -> str:
        ppl = {n: perplexity(model, probe_ids, n) for n in (window, 4 * window)}
        # Half the window shows the copy circuit forming before it reaches the window's far end.
        accuracy = {n: passkey_accuracy(model, tokenizer, heldout_ids, n, n_samples=20) for n in (window // 2, window)}
        return (
            f"ppl@{window} {ppl[window]:.1f}  ppl@{4 * window} {ppl[4 * window]:.1f}  "
            + "  ".join(f"passkey@{n} {a:.0%}" for n, a in accuracy.items())
        )

    curve, seconds = train(model, BatchSampler(tokenizer, stream, t, rng), t, probe)
    state["stages"].append(
        {
            "config": args.config.as_posix(),
            "launch": f"python recipes/pretrain_tiny.py --config {args.config.as_posix()}",
            "seed": cfg["seed"],
            "train": t,
            "curve": curve,
            "seconds": seconds,
        }
    )

    out = Path(cfg["output_dir"])
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / STATE_FILE).write_text(json.dumps(state, indent=1))

    n_passkey = cfg["eval"]["passkey_samples"]
    ev = {
        "ppl": {n: perplexity(model, heldout_ids, n) for n in (window, 2 * window, 4 * window, 8 * window)},
        "passkey": passkey_accuracy(model, tokenizer, heldout_ids, window, n_passkey),
        "n_tokens": len(heldout_ids),
    }
    print(f"held-out perplexity {ev['ppl']}; passkey accuracy at {window}: {ev['passkey']:.0%}", flush=True)
    card = model_card(model.config, n_params, state, ev, heldout_path.as_posix(), n_passkey)
    (out / "README.md").write_text(card, encoding="utf-8")
    print(f"saved to {out}/ and {heldout_path}", flush=True)


if __name__ == "__main__":
    main()
