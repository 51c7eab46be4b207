"""rope_patch.plots and `rope-patch plot`: every figure kind renders with labelled axes, a legend entry per scheme,
log scales where they belong and the original window marked; PNG and SVG; the results reader is tolerant."""

from __future__ import annotations

import json

import pytest

from rope_patch import plots
from rope_patch.cli import main
from rope_patch.evaluation.results import read_results

ROPE = dict(head_dim=32, rope_theta=10000.0, max_position_embeddings=256)
SCHEMES = ["default", "yarn:4", "linear:4", "dynamic:4"]


def _window_marked(fig) -> bool:
    return any(artist.get_gid() == "original-window" for ax in fig.axes for artist in ax.get_children())


def _legend_texts(ax) -> list[str]:
    legend = ax.get_legend()
    return [t.get_text() for t in legend.get_texts()] if legend else []


# kind -> (schemes, extra kwargs, expected scales per axis: (xscale, yscale))
KINDS = {
    "frequencies": (SCHEMES, {}, [("linear", "log"), ("linear", "log")]),
    "wavelengths": (SCHEMES, {}, [("linear", "log"), ("linear", "log")]),
    "decay": (SCHEMES, {"max_distance": 2048}, [("log", "linear")]),
    "angles": (SCHEMES, {"length": 1024}, [("linear", "log")]),
    "distance": (["default", "rerope:64", "leaky_rerope:window_size=64,factor=8",
                  "self_extend:group_size=4,window_size=64", "alibi", "nope"], {"max_distance": 1024, "num_heads": 8},
                 [("linear", "linear"), ("linear", "symlog")]),
    "score": (["default", "yarn:4", "alibi", "rerope:64"], {"max_distance": 1024, "num_samples": 16},
              [("log", "linear"), ("log", "linear")]),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_kind_is_a_complete_figure(kind):
    schemes, kw, scales = KINDS[kind]
    fig = plots.make(kind, schemes, **kw, **ROPE)
    axes = [ax for ax in fig.axes if ax.get_label() != "<colorbar>"]
    assert len(axes) == len(scales)
    for ax, (xscale, yscale) in zip(axes, scales, strict=True):
        assert ax.get_xlabel() and ax.get_ylabel() and ax.get_title()
        assert (ax.get_xscale(), ax.get_yscale()) == (xscale, yscale)
    labels = _legend_texts(axes[0])
    for spec in schemes:
        name = spec.split(":")[0]
        assert any(label.startswith(name) for label in labels), (spec, labels)
    assert _window_marked(fig)
    assert any("L = 256" in t for ax in axes for t in _legend_texts(ax))


def test_length_dependent_schemes_are_drawn_at_their_window():
    fig = plots.frequencies(["dynamic:4"], **ROPE)
    assert any("ℓ = 1,024" in t for t in _legend_texts(fig.axes[0]))


def test_decay_linear_axis_and_normalize():
    fig = plots.decay(["default"], max_distance=200, log_x=False, normalize=True, **ROPE)
    ax = fig.axes[0]
    assert ax.get_xscale() == "linear" and "÷" in ax.get_ylabel()
    assert any("beyond this range" in t for t in _legend_texts(ax))  # L = 256 > 200: named, not drawn
    line = ax.get_lines()[0]
    assert line.get_ydata()[0] == pytest.approx(1.0)


@pytest.mark.parametrize("fmt,magic", [("png", b"\x89PNG"), ("svg", b"<?xml")])
def test_save_png_and_svg(tmp_path, fmt, magic):
    fig = plots.wavelengths(["default", "yarn:4"], **ROPE)
    path = plots.save(fig, tmp_path / "fig", fmt)
    assert path.suffix == f".{fmt}" and path.read_bytes().startswith(magic)
    assert plots.save(fig, tmp_path / f"by_ext.{fmt}").read_bytes().startswith(magic)
    with pytest.raises(ValueError, match="png or svg"):
        plots.save(fig, tmp_path / "x.pdf")


def test_plot_errors():
    with pytest.raises(ValueError, match="Did you mean 'decay'"):
        plots.make("decy", ["default"], **ROPE)
    with pytest.raises(ValueError, match="at least one scheme"):
        plots.decay([], **ROPE)
    with pytest.raises(TypeError, match="unknown keyword"):
        plots.decay(["default"], head_dimm=4)


# ------------------------------------------------------------------------------------------------------------------
# Results files
COMPARE = {  # the keys its schema requires (rope_patch.schema.COMPARE)
    "format": "rope_patch.compare/1",
    "model": {"name": "tiny", "window": 256},
    "settings": {"lengths": [256, 1024], "depths": [0.1, 0.5], "passkey_samples": 2, "seed": 0, "ppl_tokens": 2048},
    "schemes": [{"spec": "default", "label": "default", "name": "default", "params": {}},
                {"spec": "yarn:8", "label": "yarn×8", "name": "yarn", "params": {"factor": 8.0}}],
    "records": [
        {"scheme": "default", "label": "default", "length": 256, "perplexity": 81.0, "passkey_accuracy": 1.0},
        {"scheme": "default", "label": "default", "length": 1024, "perplexity": "inf", "passkey_accuracy": 0.0},
        {"scheme": "yarn:8", "label": "yarn×8", "length": 256, "perplexity": 90.0, "passkey_accuracy": 0.9},
        {"scheme": "yarn:8", "label": "yarn×8", "length": 1024, "perplexity": 91.0, "passkey_accuracy": None},
    ],
    "passkey": [{"scheme": "yarn:8", "label": "yarn×8", "length": 1024, "depth": d, "accuracy": a, "n": 2,
                 "correct": int(2 * a)} for d, a in ((0.1, 1.0), (0.5, 0.5))],
    "buckets": [{"scheme": s, "label": s, "length": 1024, "start": a, "end": b, "perplexity": p}
                for s, (a, b, p) in [("default", (0, 256, 80.0)), ("default", (256, 1024, 400.0)),
                                     ("yarn:8", (0, 256, 88.0)), ("yarn:8", (256, 1024, 92.0))]],
}


def test_read_compare_json(tmp_path):
    path = tmp_path / "compare.json"
    path.write_text(json.dumps(COMPARE))
    res = read_results(path)
    assert res["window"] == 256 and res["name"] == "tiny"
    assert res["schemes"] == [("default", "default"), ("yarn:8", "yarn×8")]
    assert res["records"][1]["perplexity"] == float("inf")
    assert res["records"][3]["passkey_accuracy"] == pytest.approx(0.75)  # pooled from the passkey cells
    assert len(res["buckets"]) == 4 and len(res["passkey"]) == 2


TOLERANT = [
    # a bare list, other key names, inline bucket dicts, a passkey cell as its own record
    [{"spec": "ntk:4", "seq_len": 512, "ppl": 20.5, "bucket_perplexity": {"0-256": 19.0, "256–512": 22.0}},
     {"spec": "ntk:4", "seq_len": 512, "depth": 0.5, "passkey": 1.0},
     {"spec": "ntk:4", "context_length": 1024, "perplexity": 21.0, "unknown_key": [1, 2]},
     {"note": "no scheme: skipped"}, "not a record"],
    {"results": [{"scheme": "default", "length": 256, "perplexity": 10}], "window": 128},
]


@pytest.mark.parametrize("data", TOLERANT, ids=["list", "results-key"])
def test_read_results_is_tolerant(tmp_path, data):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(data))
    res = read_results(path)
    assert res["records"] and res["schemes"]
    fig = plots.results(res)
    assert all(ax.get_xlabel() and ax.get_ylabel() for ax in fig.axes)


def test_read_jsonl_and_buckets_list(tmp_path):
    rows = [{"scheme": "yarn:8", "length": 512, "perplexity": 30.0,
             "buckets": [{"start": 0, "end": 256, "perplexity": 29.0}, {"start": 256, "end": 512, "perplexity": 31.0}]},
            {"scheme": "yarn:8", "length": 1024, "perplexity": 32.0}]
    path = tmp_path / "sweep.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    res = read_results(path)
    assert [r["length"] for r in res["records"]] == [512, 1024] and len(res["buckets"]) == 2


def test_results_figure_panels_and_window():
    fig = plots.results(COMPARE)
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == ["Perplexity vs. context length", "Passkey retrieval", "Perplexity by position"]
    assert fig.axes[0].get_yscale() == "log" and fig.axes[0].get_xscale() == "log"
    assert _window_marked(fig)
    assert [t for t in _legend_texts(fig.axes[0]) if "×" in t or t == "default"] == ["default", "yarn×8"]


def test_results_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_results(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")  # one broken document: the JSON parser's position, naming the file
    with pytest.raises(ValueError, match=r"bad.json: not valid JSON \(.*line 1, column 2"):
        read_results(bad)
    bad.write_text('{"scheme": "a", "length": 1}\n{not json\n')  # lines, one of them broken
    with pytest.raises(ValueError, match="bad.json: neither JSON nor JSON Lines"):
        read_results(bad)
    with pytest.raises(ValueError, match="no records"):
        read_results([{"perplexity": 3}])


# ------------------------------------------------------------------------------------------------------------------
# The command
CLI = [
    ["decay", "--schemes", "default", "yarn:4", "--head-dim", "32", "--window", "256", "--max-distance", "1024"],
    ["decay", "--schemes", "default", "--head-dim", "32", "--window", "256", "--max-distance", "300", "--linear",
     "--normalize"],
    ["wavelengths", "--schemes", "default", "llama3:8", "--head-dim", "32", "--window", "256"],
    ["frequencies", "--schemes", "default", "p_rope:0.5", "--head-dim", "32", "--window", "256"],
    ["angles", "--schemes", "default", "ntk:4", "--head-dim", "32", "--window", "256", "--max-distance", "1024"],
    ["distance", "--schemes", "rerope:64", "alibi", "--window", "256", "--max-distance", "512", "--num-heads", "4"],
    ["score", "--schemes", "default", "alibi", "--head-dim", "32", "--window", "256", "--max-distance", "512",
     "--logits"],
]


@pytest.mark.parametrize("argv", CLI, ids=[" ".join(a[:1] + a[-2:]) for a in CLI])
def test_cli_writes_figures(tmp_path, argv, capsys):
    out = tmp_path / "fig.png"
    assert main(["plot", *argv, "--out", str(out)]) == 0
    assert out.read_bytes().startswith(b"\x89PNG") and "Wrote" in capsys.readouterr().out


def test_cli_svg_default_name_and_results(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["plot", "wavelengths", "--head-dim", "32", "--format", "svg"]) == 0
    assert (tmp_path / "wavelengths.svg").read_bytes().startswith(b"<?xml")
    (tmp_path / "compare.json").write_text(json.dumps(COMPARE))
    assert main(["plot", "results", "compare.json", "--out", "summary.svg"]) == 0
    assert (tmp_path / "summary.svg").exists()


SEARCH_LOG = {  # the keys its schema requires (rope_patch.schema.SEARCH_LOG)
    "format": "rope_patch.tune/1", "model": {}, "split": {}, "status": "done",
    "settings": {"scheme": "yarn", "method": "grid", "target": 64, "window": 32},
    "evaluations": [{"index": 0, "generation": 0, "spec": "yarn:2", "params": {"factor": 2}, "objective": 3.0},
                    {"index": 1, "generation": 0, "spec": "yarn:4", "params": {"factor": 4}, "objective": "inf"}],
    "best": {"index": 0, "spec": "yarn:2", "params": {"factor": 2}, "objective": 3.0}}


def _row(scheme, task, length, value, family=None):
    return {"scheme": scheme, "task": task, "family": family, "length": length, "metric": str(length),
            "value": value, "metrics": {str(length): value}, "n_samples": 5}


RULER_SWEEP = {"format": "rope_patch.sweep/1",
               "settings": {"name": "tiny", "model": "tiny", "tasks": ["niah_single_1", "ruler_vt"],
                            "lengths": [4096, 8192]},
               "schemes": [{"spec": "default"}, {"spec": "dca:chunk_size=64,local_size=16"}],
               "rows": [_row("default", "niah_single_1", 4096, 1.0), _row("default", "ruler_vt", 4096, 0.16),
                        _row("dca:chunk_size=64,local_size=16", "niah_single_1", 4096, 0.4),
                        _row("default", "niah_single_1", 8192, 0.0)]}


def test_tasks_figure_draws_one_bar_per_cell():
    fig = plots.tasks(RULER_SWEEP)
    (ax,) = fig.axes
    heights = sorted(round(p.get_height(), 6) for p in ax.patches)
    assert heights == [0.0, 16.0, 40.0, 100.0]  # in %, one bar per (task, length, scheme) cell
    ticks = [t.get_text() for t in ax.get_xticklabels()]
    assert ticks == ["niah_single_1\n4k\nn = 5", "ruler_vt\n4k\nn = 5", "niah_single_1\n8k\nn = 5"]
    assert {t.get_text() for t in ax.get_legend().get_texts()} == {"default", "dca:chunk_size=64,local_size=16"}
    rope_only = {**RULER_SWEEP, "rows": [_row("default", "rope_ppl_64", 64, 3.0, family="rope_ppl")]}
    with pytest.raises(ValueError, match="no lm-eval task scores"):
        plots.tasks(rope_only)
    assert plots.write_tasks_figure(rope_only, ".") is None


@pytest.mark.parametrize(("name", "content", "figure"), [
    ("search_log.json", SEARCH_LOG, "search.png"),  # a tune log: the search figure (what tune writes)
    ("sweep.json", RULER_SWEEP, "tasks.png"),  # a sweep of lm-eval's own tasks (RULER): their scores (sweep's)
])
def test_cli_results_draws_a_search_log_or_a_task_sweep(tmp_path, monkeypatch, name, content, figure):
    """`plot results` recognises the file and draws its own figure; neither has a window axis."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / name).write_text(json.dumps(content))
    assert main(["plot", "results", name, "--out", figure]) == 0
    assert (tmp_path / figure).read_bytes().startswith(b"\x89PNG")
    assert main(["plot", "results", name, "--window", "64"]) == 2


def test_a_sweep_writes_its_tasks_figure(tmp_path):
    assert plots.write_tasks_figure(RULER_SWEEP, tmp_path / "out").name == "tasks.png"


def test_cli_reads_a_model_config(tmp_path):
    from helpers.models import tiny_config

    tiny_config("llama").save_pretrained(tmp_path / "model")
    assert main(["plot", "decay", "--schemes", "default", "yarn:4", "--config", str(tmp_path / "model"),
                 "--out", str(tmp_path / "d.png")]) == 0


@pytest.mark.parametrize("argv,message", [
    (["decay", "--schemes", "yran:8"], "Did you mean 'yarn'"),
    (["decay", "--head-dim", "127"], "must be even"),
    (["results"], "needs the results file"),
    (["results", "nowhere.json"], "does not exist"),
    (["decay", "extra.json"], "takes no file argument"),
    (["decay", "--format", "svg", "--out", "x.png", "--schemes", "default", "--head-dim", "8", "--max-distance", "8",
      "--config", "cfg", "--window", "5"], "drop --window"),
])
def test_cli_errors_are_messages(tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.chdir(tmp_path)
    assert main(["plot", *argv]) == 2
    assert message in capsys.readouterr().err
