"""The HTML report: per-layer numbers in onnxruntime, a self-contained page, the CLI around it."""
import math
import re

import numpy as np
import pytest

from qpasses.cli import main
from qpasses.cli.examples import write_example
from qpasses.ir.model import load
from qpasses.report import build
from qpasses.report.layers import layers, precision_cells
from qpasses.testing import model_from_text

from tests.kits import report_kit

@pytest.fixture(scope="module")
def example(tmp_path_factory):
    return write_example(tmp_path_factory.mktemp("example"))


@pytest.fixture(scope="module")
def convs():
    return report_kit.convs(16)


def test_the_first_tensor_accumulates_only_its_own_error(convs):
    float_model, qdq, feeds = convs
    rows = {r.tensor: r for r in layers(float_model, qdq, feeds)}
    assert set(rows) == {"x", "c1"}   # r1 is dropped: c1 takes its grid (Relu merged into the Conv)
    x = rows["x"]
    assert x.producer == "input" and x.qtype == "uint8"
    assert x.accumulated_snr == pytest.approx(x.local_snr, abs=1e-6)
    # uniform rounding error of a uint8 grid over N(0, 1) values: SNR ~ 10 log10(12 / scale^2)
    assert x.local_snr == pytest.approx(10 * math.log10(12 / x.scale[0] ** 2), abs=1.5)
    assert x.clip == pytest.approx(((0 - x.zero_point[0]) * x.scale[0], (255 - x.zero_point[0]) * x.scale[0]))
    assert sum(x.counts) == 16 * 4 * 8 * 8
    # c1 reads x through its grid and the quantized w1: more error than its own grid alone
    assert rows["c1"].accumulated_snr < rows["c1"].local_snr
    assert rows["c1"].clip[0] == 0.0 and rows["c1"].calibrated[0] == 0.0   # the Relu's range
    assert all(math.isfinite(r.sensitivity) for r in rows.values())
    assert rows["c1"].upstream == ["x"] and x.upstream == []   # what "where the error grows" compares


def test_the_precision_map_reads_the_qdq_graph(convs):
    _, qdq, _ = convs
    cells = precision_cells(qdq.to_proto(metadata=False))
    # 8-bit weights; int8 on grids no pair sum can saturate on without VNNI (protect-pair-sums)
    assert [p for label, p in cells if label.startswith("Conv")] == ["int8", "int8"]


def _self_contained(text: str) -> None:
    for pattern in (r"<script[^>]+src", r"<link", r"url\(", r"@import", r"href=", r"<img", r"<iframe"):
        assert not re.search(pattern, text, re.I), pattern


def test_report_command_writes_one_self_contained_page(example, tmp_path, capsys):
    model, calib, evals = example
    q, page = tmp_path / "q.onnx", tmp_path / "r.html"
    assert main(["run", str(model), "-o", str(q), "--calib", str(calib), "--quiet"]) == 0
    assert main(["report", str(model), str(q), "--data", str(evals), "-o", str(page)]) == 0
    text = page.read_text()
    _self_contained(text)
    assert text.count("<svg") >= 3 and "Where the error grows" in text and "Mixed-precision map" in text
    table = text.split("<h2>Per-layer table</h2>")[1]
    assert table.count("<tr>") - 1 == len(layers(load(model), load(q), [])) >= 5
    assert "8-bit: 100 % of weighted ops" in text and "Time per pass: not recorded" in text
    pairs = text.split("<h2>int16 pair sums by CPU</h2>")[1].split("<h2>")[0]
    assert "int8 grid no pair can saturate on (scale x" in pairs and "cpu <code>x86-64</code>" in pairs
    # a layer at risk is protected (then safe on every CPU), or left int8 with what its calibration data showed
    rows = pairs.split("<tr>")[2:]
    assert rows and all(("int8 grid" in row and "saturates:" not in row) or "left int8: largest pair sum on" in row
                        for row in rows)


def test_run_html_has_the_passes_and_the_output_snr(example, tmp_path, capsys):
    model, calib, evals = example
    page = tmp_path / "r.html"
    code = main(["run", str(model), "-o", str(tmp_path / "q.onnx"), "--calib", str(calib), "--eval", str(evals),
                 "--html", str(page)])
    err = capsys.readouterr().err
    assert code == 0, err
    text = page.read_text()
    snr = re.search(r"output SNR vs float: ([0-9.]+) dB", err).group(1)
    assert f">{snr}<" in text   # the same number as the run's line
    spread = re.search(r"as they spread: SNR [0-9.]+ dB\)", err).group(0)
    assert spread in text   # and the same spread of the samples
    assert "<h3>Time per pass</h3>" in text and ">calibrate<" in text
    assert f"<code>{tmp_path / 'q.onnx'}</code>" in text and ".qpasses-" not in text   # not the staged file


@pytest.mark.parametrize("args, message", [
    (["--html", "{tmp}/r.html"], "--html reports on a quantized model: give --calib"),
    (["--calib", "{calib}", "--html", "{model}"], "--html"),
])
def test_run_html_refusals_write_nothing(args, message, example, tmp_path, capsys):
    model, calib, _ = example
    args = [a.format(tmp=tmp_path, calib=calib, model=model) for a in args]
    code = main(["run", str(model), "-o", str(tmp_path / "q.onnx"), *args])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err
    assert not list(tmp_path.iterdir())


def test_long_tables_are_capped_and_names_wrap():
    from qpasses.report import html

    name = "block." * 50 + "conv"
    text = html._table(["tensor", "x"], [[name, i] for i in range(html.CAP + 1)], sortable=True, cap=html.CAP)
    assert f'data-cap="{html.CAP}"' in text and f'<td class="name" data-v="{name}">{name}</td>' in text
    assert "data-cap" not in html._table(["tensor"], [["a"]] * html.CAP, cap=html.CAP)


def test_report_bad_data_writes_nothing(example, tmp_path, capsys):
    model = example[0]
    bad = tmp_path / "bad.npz"
    np.savez(bad, wrong=np.zeros((2, 3), np.float32))
    code = main(["report", str(model), str(model), "--data", str(bad), "-o", str(tmp_path / "r.html")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert not (tmp_path / "r.html").exists()


def test_build_on_a_float_model_against_itself_has_infinite_snr(example):
    model, _, evals = example
    text = build(model, model, evals)
    assert "No quantized activation to compare per layer" in text and ">inf<" in text


def test_a_minus_one_batch_dimension_takes_any_batch(tmp_path, capsys):
    """Exporters write -1 for a dynamic batch: the data is checked against onnxruntime's session
    inputs, as `qpasses compare` does, so `report`, `run --eval --html` and `compare --per-layer` take it."""
    rng = np.random.default_rng(1)
    text = report_kit.CONVS % tuple(", ".join(f"{v:.4f}" for v in rng.normal(0, 0.3, 144)) for _ in range(2))
    proto = model_from_text(text).to_proto()
    for value in (*proto.graph.input, *proto.graph.output):
        value.type.tensor_type.shape.dim[0].dim_value = -1
    model, calib, evals = tmp_path / "m.onnx", tmp_path / "c.npz", tmp_path / "e.npz"
    model.write_bytes(proto.SerializeToString())
    np.savez(calib, x=rng.standard_normal((8, 1, 4, 8, 8)).astype(np.float32))
    np.savez(evals, x=rng.standard_normal((4, 2, 4, 8, 8)).astype(np.float32))   # batch 2
    q, page = tmp_path / "q.onnx", tmp_path / "r.html"
    assert main(["run", str(model), "-o", str(q), "--calib", str(calib), "--eval", str(evals),
                 "--html", str(tmp_path / "run.html"), "--quiet"]) == 0, capsys.readouterr().err
    assert main(["report", str(model), str(q), "--data", str(evals), "-o", str(page)]) == 0, capsys.readouterr().err
    text = page.read_text()
    assert "Measured on 4 samples" in text and ">c1<" in text
    assert main(["compare", str(model), str(q), "--data", str(evals), "--per-layer"]) == 0
    assert "no tensor is more than 1 LSB apart" in capsys.readouterr().out
    bad = tmp_path / "bad.npz"   # the fixed dimensions are still checked
    np.savez(bad, x=rng.standard_normal((2, 2, 3, 8, 8)).astype(np.float32))
    assert main(["report", str(model), str(q), "--data", str(bad), "-o", str(tmp_path / "b.html")]) == 2
    assert "input 'x' has shape (2, 3, 8, 8)" in capsys.readouterr().err


def test_the_summary_says_what_the_search_aimed_at():
    from qpasses.passes.search_precision import AIM_WITHIN_MARGIN
    from qpasses.report import html

    search = {"metric": "snr", "target": 12.0, "fallback": "float", "quantized": 16.4, "reached": 22.1,
              "promoted": ["a", "b"], "aim": 25.0, "keep_8bit": 0.8, "aimed": "graph order", "aim_met": False,
              "int8_share": 0.83, "feeds": 12, "confirmed": {"feeds": 24, "added": 4, "score": 19.5, "counted": 18.2, "met": True}}
    info = {"summary": "8-bit: 81 %", "data": "calib.npz", "layer_samples": 8,
            "accuracy": {"samples": 8, "outputs": {}}, "decisions": {"precision_search": search}}
    text = "".join(html._summary(info))
    assert ("search-precision: target 12.0 snr (aim 25.0 with 80 % of the weighted ops' int8 latency gain 8-bit, "
            "83 % left, not met: graph order), quantized 16.4, reached 22.1 on 12 check feeds, confirmed on 24 calibration feeds (4 of "
            "them then added to the checks): 19.5, met; 2 tensors promoted to float: a, b") in text
    within = {k: v for k, v in search.items() if k != "keep_8bit"} | {   # the aim not chased: no share spent
        "promoted": [], "aimed": AIM_WITHIN_MARGIN, "aim_met": True, "int8_share": 1.0}
    text = "".join(html._summary(info | {"decisions": {"precision_search": within}}))
    assert f"(aim 25.0, 100 % left, met: {AIM_WITHIN_MARGIN})" in text and "latency gain" not in text
    del search["aimed"]   # an aim the 8-bit model met before any walk: nothing more to say
    search["confirmed"] = {"skipped": "calib.npz: gone"}
    text = "".join(html._summary(info))
    assert "search-precision: target 12.0 snr, quantized" in text and "not confirmed (calib.npz: gone)" in text
    search |= {"met": False, "blocking": {"conv3.w": -12.3, "relu2": -20.0}}
    assert "a, b; target missed, next in the ranking: conv3.w, relu2</p>" in "".join(html._summary(info))
    search["confirmed"] = {"feeds": 8, "added": 4, "met": None}
    assert "confirmed on 8 calibration feeds (4 of them then added to the checks): no evaluation left to read it again" in "".join(
        html._summary(info))
