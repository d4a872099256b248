"""Codec benchmark: how fast the compress/ codecs are, and whether they pay for themselves.

    python -m testbeds.bench.codecs                      # 1, 4, 16, 64 MiB; ratios 0.01, 0.05, 0.25
    python -m testbeds.bench.codecs --sizes-mib 1,16 --ratios 0.01 --repeats 5 --json

Inputs are fp32 tensors of random normal values (the worst case for zstd: mantissas are
noise). The numbers mean:

- **Throughput** (part a): encode and decode speed in MB/s of *dense input* (10^6 bytes of
  the fp32 tensor per second), the median of ``--repeats`` runs after one warm-up, for
  ``zstd`` and ``fp16`` (dense codecs, no ratio), ``quant`` at 8 and 4 bits, and ``topk``
  and 4-bit ``topk-quant`` at each keep ratio, with the encoded size as a fraction of the
  dense size.
- **Cost against savings** (part b): for each codec, size and ratio, the encode + decode
  time as a fraction of the transfer time the encoding *saves* on an 8, 100 and 1,000 Mbps
  link, ``(encode_s + decode_s) / ((dense_bytes - encoded_bytes) * 8 / link_bits_per_s)``.
  Below 1 the codec wins; the AdaTopK target is below 0.10 for every lossy codec
  (:data:`TARGET_CODECS`) on links up to 100 Mbps (the slow cuts it is meant for); on
  faster links the controller sends dense tensors anyway. ``zstd`` and ``fp16`` are shown
  for reference, without a target.

Times are wall-clock on whatever cores torch is given (``torch threads`` is printed); the
encoder runs on the CPU here, as it does on CPU workers.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from typing import Any

import torch

from compress import get_compressor

logger = logging.getLogger(__name__)

MIB = 1 << 20
#: Links of part b, in Mbit/s.
LINKS_MBPS = (8, 100, 1000)
#: Part b target: a lossy codec's encode + decode under this fraction of the time saved ...
TARGET_FRACTION = 0.10
#: ... on links up to this speed.
TARGET_MAX_MBPS = 100
#: The codecs the target applies to: those AdaTopK may choose for a slow cut.
TARGET_CODECS = ("topk", "quant", "topk-quant")
#: Bits of the quantized cases: ``quant`` at each, ``topk-quant`` at the last.
QUANT_BITS = (8, 4)


def _median_time_s(fn: Any, repeats: int) -> tuple[float, Any]:
    """Median wall time of ``fn()`` over ``repeats`` runs after a warm-up, and its last result."""
    result = fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def measure(
    size_mib: float,
    codec: str,
    keep_ratio: float | None,
    repeats: int,
    tensor: torch.Tensor,
    bits: int | None = None,
) -> dict[str, Any]:
    """Encode/decode times and sizes of one codec on ``tensor`` (``bits`` for the quantized ones)."""
    compressor = get_compressor(codec)
    ratio = 1.0 if keep_ratio is None else keep_ratio
    # Every encoder takes ``bits`` (the dense codecs and top-k ignore it); 8 is its default.
    encode_s, enc = _median_time_s(
        lambda: compressor.encode(tensor, keep_ratio=ratio, bits=8 if bits is None else bits), repeats
    )
    decode_s, _ = _median_time_s(
        lambda: compressor.decode(enc.data, dtype=tensor.dtype, shape=tuple(tensor.shape)), repeats
    )
    dense_mb = enc.dense_bytes / 1e6
    row: dict[str, Any] = {
        "size_mib": size_mib,
        "codec": codec,
        "keep_ratio": keep_ratio,
        "bits": bits,
        "dense_bytes": enc.dense_bytes,
        "encoded_bytes": len(enc.data),
        "size_fraction": len(enc.data) / enc.dense_bytes,
        "encode_s": encode_s,
        "decode_s": decode_s,
        "encode_mb_per_s": dense_mb / encode_s,
        "decode_mb_per_s": dense_mb / decode_s,
        "cost_over_saved": {},
    }
    saved_bytes = enc.dense_bytes - len(enc.data)
    for mbps in LINKS_MBPS:
        saved_s = saved_bytes * 8 / (mbps * 1e6)
        row["cost_over_saved"][str(mbps)] = (encode_s + decode_s) / saved_s if saved_s > 0 else None
    if codec in TARGET_CODECS:
        row["meets_target"] = all(
            f is not None and f < TARGET_FRACTION
            for m, f in row["cost_over_saved"].items()
            if int(m) <= TARGET_MAX_MBPS
        )
    return row


def run(sizes_mib: list[float], ratios: list[float], repeats: int, seed: int = 0) -> dict[str, Any]:
    """Every codec on a random fp32 tensor of each size; returns the JSON document."""
    rows = []
    generator = torch.Generator().manual_seed(seed)
    for size_mib in sizes_mib:
        tensor = torch.randn(max(1, int(size_mib * MIB) // 4), generator=generator)
        cases: list[tuple[str, float | None, int | None]] = [
            ("zstd", None, None),
            ("fp16", None, None),
            *(("quant", None, b) for b in QUANT_BITS),
            *(("topk", r, None) for r in ratios),
            *(("topk-quant", r, QUANT_BITS[-1]) for r in ratios),
        ]
        for codec, keep_ratio, bits in cases:
            rows.append(measure(size_mib, codec, keep_ratio, repeats, tensor, bits))
            logger.info("%s", rows[-1])
    lossy = [r for r in rows if r["codec"] in TARGET_CODECS]
    return {
        "torch_threads": torch.get_num_threads(),
        "repeats": repeats,
        "links_mbps": list(LINKS_MBPS),
        "target": {"fraction": TARGET_FRACTION, "max_mbps": TARGET_MAX_MBPS},
        "all_lossy_meet_target": all(r["meets_target"] for r in lossy),
        "rows": rows,
    }


def _ratio(row: dict[str, Any]) -> str:
    return "-" if row["keep_ratio"] is None else f"{row['keep_ratio']:g}"


def _codec(row: dict[str, Any]) -> str:
    return row["codec"] if row.get("bits") is None else f"{row['codec']}{row['bits']}"


def _frac(value: float | None) -> str:
    return "  never" if value is None else f"{value:7.3f}"


def format_report(doc: dict[str, Any]) -> str:
    """The document as two plain-text tables."""
    lines = [
        f"Codecs on random-normal fp32 tensors (torch threads: {doc['torch_threads']}, median of {doc['repeats']})",
        "",
        "a) throughput, MB/s of dense input",
        f"{'size MiB':>8}  {'codec':<12} {'ratio':>6}  {'encode MB/s':>11}  {'decode MB/s':>11}  {'encoded/dense':>13}",
    ]
    for r in doc["rows"]:
        lines.append(
            f"{r['size_mib']:>8g}  {_codec(r):<12} {_ratio(r):>6}  {r['encode_mb_per_s']:>11.1f}  "
            f"{r['decode_mb_per_s']:>11.1f}  {r['size_fraction']:>13.4f}"
        )
    target = doc["target"]
    links = doc["links_mbps"]
    lines += [
        "",
        "b) (encode + decode time) / transfer time saved; < 1 pays off",
        f"   target for {', '.join(TARGET_CODECS)}: < {target['fraction']:g} on links up to {target['max_mbps']} Mbps",
        f"{'size MiB':>8}  {'codec':<12} {'ratio':>6}  {'enc+dec s':>9}  "
        + "  ".join(f"{str(m) + ' Mbps':>9}" for m in links)
        + "  target",
    ]
    for r in doc["rows"]:
        mark = "-" if "meets_target" not in r else ("ok" if r["meets_target"] else "MISS")
        fracs = "  ".join(f"{_frac(r['cost_over_saved'][str(m)]):>9}" for m in links)
        lines.append(
            f"{r['size_mib']:>8g}  {_codec(r):<12} {_ratio(r):>6}  "
            f"{r['encode_s'] + r['decode_s']:>9.3f}  {fracs}  {mark}"
        )
    lines += ["", f"all lossy rows meet the target: {'yes' if doc['all_lossy_meet_target'] else 'NO'}"]
    return "\n".join(lines)


def _floats(text: str, what: str, parser: argparse.ArgumentParser) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        parser.error(f"{what} must be comma-separated numbers, got {text!r}")
    if not values:
        parser.error(f"{what} is empty")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testbeds.bench.codecs", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mib", default="1,4,16,64", help="tensor sizes in MiB (default 1,4,16,64)")
    parser.add_argument("--ratios", default="0.01,0.05,0.25", help="top-k keep ratios (default 0.01,0.05,0.25)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per case, after one warm-up (default 3)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random tensors")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    sizes = _floats(args.sizes_mib, "--sizes-mib", parser)
    ratios = _floats(args.ratios, "--ratios", parser)
    if any(s <= 0 for s in sizes):
        parser.error("--sizes-mib must be > 0")
    if any(not 0 < r <= 1 for r in ratios):
        parser.error("--ratios must be in (0, 1]")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    doc = run(sizes, ratios, args.repeats, args.seed)
    print(json.dumps(doc, indent=2) if args.json else format_report(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
