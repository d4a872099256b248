"""The codec benchmark measures every codec AdaTopK may choose and judges each against the target."""

from __future__ import annotations

from testbeds.bench import codecs


def test_every_lossy_codec_is_measured_and_judged() -> None:
    doc = codecs.run([1 / 64], [0.25], repeats=1)
    cases = {(r["codec"], r["keep_ratio"], r["bits"]) for r in doc["rows"]}
    assert cases == {
        ("zstd", None, None),
        ("fp16", None, None),
        ("quant", None, 8),
        ("quant", None, 4),
        ("topk", 0.25, None),
        ("topk-quant", 0.25, 4),
    }
    for row in doc["rows"]:
        assert ("meets_target" in row) == (row["codec"] in codecs.TARGET_CODECS)
        assert 0 < row["encoded_bytes"] < row["dense_bytes"] or row["codec"] == "zstd"
    quant4 = next(r for r in doc["rows"] if r["codec"] == "quant" and r["bits"] == 4)
    assert quant4["size_fraction"] < 1 / 8
    assert doc["all_lossy_meet_target"] == all(r["meets_target"] for r in doc["rows"] if "meets_target" in r)
    report = codecs.format_report(doc)
    assert "quant4" in report and "topk-quant4" in report
