"""Line up an executor trace (:mod:`executor.trace`) step by step and link by link.

    FUSION_TRACE_DIR=/tmp/trace python -m testbeds.bench --topology two-sites --job J --systems uniform ...
    python -m testbeds.bench.timeline /tmp/trace --skip 4

For each step of the traced job (the one over the most stages with the most steps the
driver finished, or ``--job``): the driver's ``RunStep`` (all stages answered), when the
last of the driver's inputs and targets reached each stage it feeds, when each stage was done and how
long it computed (forwards and backwards, emulated sleeps included), when the driver had
heard from all of them, and the end of the optimizer call, in milliseconds from the step's
start. Then, for each ordered pair of stages, the transfers between them: from when the
transfer left (the sender's ``leave`` event, after its pacing wait,
``executor.sender.PeerSender``) to its arrival
(received and checked) and to the sender hearing the answer; the first transfer of a
step apart from the rest, and the rest split by whether the sending stage was computing
for most of the transfer (its compute thread and its sender share the interpreter). These
are the quantities :mod:`testbeds.sim.replay` prices.

The events of one host share its clock (``time.time()``); on a one-host testbed all do.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fusion.errors import FusionError

DRIVER = -1


@dataclass
class StepTimeline:
    """One step as traced, in seconds from the driver's ``step`` event."""

    step: int
    step_s: float
    run_step_s: float | None
    forward_backward_s: float | None
    done_s: dict[int, float] = field(default_factory=dict)
    compute_s: dict[int, float] = field(default_factory=dict)
    fed_s: dict[int, float] = field(default_factory=dict)
    """Per stage the driver feeds, when the last of its inputs and targets arrived."""


@dataclass
class Transfer:
    """One transfer between stages, its times absolute (``time.time()``)."""

    step: int
    src: int
    dst: int
    kind: int
    micro_batch: int
    sent: float
    start: float
    """When it left: the sender's ``leave`` event (after the pacing wait); in older traces,
    when it could leave: handed over, and the previous transfer on the pair answered."""
    arrived: float
    answered: float
    first: bool
    sender_computing: bool

    @property
    def one_way_s(self) -> float:
        return self.arrived - self.start

    @property
    def answer_s(self) -> float:
        return self.answered - self.start


def load_events(directory: Path) -> tuple[list[dict[str, Any]], int]:
    """Every event in ``directory``'s ``trace-*.jsonl`` files, by time, and how many lines
    were not events (a line cut off by a killed process)."""
    files = sorted(directory.glob("trace-*.jsonl"))
    if not files:
        raise FusionError(f"no trace files (trace-*.jsonl) in {directory}: was FUSION_TRACE_DIR set for the run?")
    events, bad = [], 0
    for path in files:
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                ev = json.loads(line)
            except json.JSONDecodeError:
                bad += 1
                continue
            if isinstance(ev, dict) and isinstance(ev.get("t"), (int, float)) and isinstance(ev.get("ev"), str):
                events.append(ev)
            else:
                bad += 1
    events.sort(key=lambda e: e["t"])
    return events, bad


def pick_job(events: Iterable[dict[str, Any]], job: str | None = None) -> str:
    """``job`` if the trace has it, else the job over the most stages whose driver finished
    the most steps (the coordinator's calibration jobs run many short steps on one)."""
    finished: dict[str, int] = defaultdict(int)
    stages: dict[str, set[int]] = defaultdict(set)
    for e in events:
        if e["ev"] == "applied" and e.get("stage") == DRIVER:
            finished[str(e.get("job"))] += 1
        elif isinstance(e.get("stage"), int) and e["stage"] != DRIVER:
            stages[str(e.get("job"))].add(e["stage"])
    if job is not None:
        if job not in finished:
            raise FusionError(f"job {job!r} finished no traced step; traced jobs: {sorted(finished) or 'none'}")
        return job
    if not finished:
        raise FusionError(
            "the trace has no finished step (no driver 'applied' event): trace the coordinator's host too"
        )
    return max(finished, key=lambda j: (len(stages[j]), finished[j]))


def _by_step(events: Iterable[dict[str, Any]], job: str) -> dict[int, list[dict[str, Any]]]:
    out: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e.get("job") == job and isinstance(e.get("step"), int):
            out[e["step"]].append(e)
    return out


def _compute_spans(events: Sequence[dict[str, Any]]) -> dict[int, list[tuple[float, float]]]:
    spans: dict[int, list[tuple[float, float]]] = defaultdict(list)
    began: dict[tuple[int, str], float] = {}
    for e in events:
        ev, stage = e["ev"], e.get("stage")
        if ev in ("F0", "B0"):
            began[(stage, ev[0])] = e["t"]
        elif ev in ("F1", "B1") and (stage, ev[0]) in began:
            spans[stage].append((began.pop((stage, ev[0])), e["t"]))
    return spans


def step_timelines(events: Sequence[dict[str, Any]], job: str) -> list[StepTimeline]:
    """Each step of ``job`` the driver started and finished."""
    out = []
    for step, evs in sorted(_by_step(events, job).items()):
        driver = {e["ev"]: e["t"] for e in evs if e.get("stage") == DRIVER}
        if "step" not in driver or "applied" not in driver:
            continue
        t0 = driver["step"]
        timeline = StepTimeline(
            step=step,
            step_s=driver["applied"] - t0,
            run_step_s=driver["run_step"] - t0 if "run_step" in driver else None,
            forward_backward_s=driver["forward_backward"] - t0 if "forward_backward" in driver else None,
        )
        for e in evs:
            if e["ev"] == "done" and e.get("stage") != DRIVER:
                timeline.done_s[e["stage"]] = e["t"] - t0
            elif e["ev"] == "arrive" and e.get("src") == DRIVER:
                timeline.fed_s[e["stage"]] = max(timeline.fed_s.get(e["stage"], 0.0), e["t"] - t0)
        for stage, spans in _compute_spans(evs).items():
            timeline.compute_s[stage] = sum(b - a for a, b in spans)
        out.append(timeline)
    return out


def transfers(events: Sequence[dict[str, Any]], job: str, steps: Iterable[int] | None = None) -> list[Transfer]:
    """Every transfer between stages of ``job`` (in ``steps``) whose hand-over, arrival and
    answer were all traced."""
    keep = None if steps is None else set(steps)
    out = []
    for step, evs in sorted(_by_step(events, job).items()):
        if keep is not None and step not in keep:
            continue
        spans = _compute_spans(evs)
        sent, left, answered, arrived = {}, {}, {}, {}
        for e in evs:
            ev = e["ev"]
            if ev == "send":
                sent[(e["stage"], e["dst"], e["kind"], e["mb"])] = e["t"]
            elif ev == "leave":
                left[(e["stage"], e["dst"], e["kind"], e["mb"])] = e["t"]
            elif ev == "answered":
                answered[(e["stage"], e["dst"], e["kind"], e["mb"])] = e["t"]
            elif ev == "arrive" and e.get("src") != DRIVER:
                arrived[(e["src"], e["stage"], e["kind"], e["mb"])] = e["t"]
        free_at: dict[tuple[int, int], float] = {}
        for key in sorted(sent, key=sent.get):
            if key not in arrived or key not in answered:
                continue
            src, dst, kind, mb = key
            pair = (src, dst)
            # The sender's own record of the start where it wrote one (paced sends); else, in
            # traces of one-at-a-time senders, the hand-over or the last answer on the pair.
            start = left.get(key, max(sent[key], free_at.get(pair, 0.0)))
            first = pair not in free_at
            free_at[pair] = answered[key]
            busy = sum(max(0.0, min(b, arrived[key]) - max(a, start)) for a, b in spans.get(src, []))
            computing = arrived[key] > start and busy > 0.5 * (arrived[key] - start)
            out.append(
                Transfer(step, src, dst, kind, mb, sent[key], start, arrived[key], answered[key], first, computing)
            )
    return out


def link_summary(found: Sequence[Transfer]) -> list[dict[str, Any]]:
    """Per ordered stage pair: counts and median milliseconds (one way and to the answer) of
    the first transfer of each step, of the rest, and of the rest split by the sender computing."""
    pairs: dict[tuple[int, int], list[Transfer]] = defaultdict(list)
    for x in found:
        pairs[(x.src, x.dst)].append(x)
    rows = []
    for (src, dst), xs in sorted(pairs.items()):
        first = [x for x in xs if x.first]
        rest = [x for x in xs if not x.first]
        row: dict[str, Any] = {"src": src, "dst": dst, "transfers": len(xs)}
        for label, group in (
            ("first", first),
            ("rest", rest),
            ("rest_sender_idle", [x for x in rest if not x.sender_computing]),
            ("rest_sender_computing", [x for x in rest if x.sender_computing]),
        ):
            row[label] = {
                "n": len(group),
                "one_way_ms": round(statistics.median(x.one_way_s for x in group) * 1e3, 2) if group else None,
                "answer_ms": round(statistics.median(x.answer_s for x in group) * 1e3, 2) if group else None,
            }
        rows.append(row)
    return rows


def summarize(directory: Path, *, job: str | None = None, skip: int = 0) -> dict[str, Any]:
    """The document :func:`render` prints: the job's steps (the first ``skip`` left out) and links."""
    events, bad = load_events(directory)
    job = pick_job(events, job)
    steps = step_timelines(events, job)[skip:]
    if not steps:
        raise FusionError(f"job {job} has no traced step after the first {skip}")
    found = transfers(events, job, [s.step for s in steps])
    return {
        "job": job,
        "directory": str(directory),
        "unreadable_lines": bad,
        "steps": [
            {
                "step": s.step,
                "step_ms": round(s.step_s * 1e3, 1),
                "run_step_ms": _round_ms(s.run_step_s),
                "forward_backward_ms": _round_ms(s.forward_backward_s),
                "done_ms": {str(k): round(v * 1e3, 1) for k, v in sorted(s.done_s.items())},
                "compute_ms": {str(k): round(v * 1e3, 1) for k, v in sorted(s.compute_s.items())},
                "fed_ms": {str(k): round(v * 1e3, 1) for k, v in sorted(s.fed_s.items())},
            }
            for s in steps
        ],
        "median_step_ms": round(statistics.median(s.step_s for s in steps) * 1e3, 1),
        "links": link_summary(found),
    }


def _round_ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 1)


def render(doc: dict[str, Any]) -> str:
    """Markdown tables of :func:`summarize`'s document."""
    stages = sorted({int(k) for s in doc["steps"] for k in s["done_ms"]})
    lines = [
        (
            f"Job `{doc['job']}`: {len(doc['steps'])} steps, median {doc['median_step_ms']} ms "
            "(ms from each step's start)."
        ),
        "",
        "| step | step | RunStep | fed (last input) | "
        + " | ".join(f"stage {k} done / computed" for k in stages)
        + " | all heard |",
        "|---:|---:|---:|---|" + "---:|" * len(stages) + "---:|",
    ]
    for s in doc["steps"]:
        cells = [f"{s['done_ms'].get(str(k), '-')} / {s['compute_ms'].get(str(k), '-')}" for k in stages]
        fed = ", ".join(f"{k}: {v}" for k, v in s["fed_ms"].items()) or "-"
        lines.append(
            f"| {s['step']} | {s['step_ms']} | {s['run_step_ms']} | {fed} | "
            + " | ".join(cells)
            + f" | {s['forward_backward_ms']} |"
        )
    lines += [
        "",
        "Transfers, median ms from when each could leave to its arrival / to its answer (n):",
        "",
        "| link | first of a step | the rest | the rest, sender idle | the rest, sender computing |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in doc["links"]:
        cells = []
        for label in ("first", "rest", "rest_sender_idle", "rest_sender_computing"):
            g = r[label]
            cells.append("-" if not g["n"] else f"{g['one_way_ms']} / {g['answer_ms']} ({g['n']})")
        lines.append(f"| {r['src']} -> {r['dst']} | " + " | ".join(cells) + " |")
    if doc["unreadable_lines"]:
        lines.append(f"\n{doc['unreadable_lines']} trace lines were not events and were skipped.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m testbeds.bench.timeline", description=__doc__.split("\n\n")[0])
    p.add_argument("directory", type=Path, help="the FUSION_TRACE_DIR of a run")
    p.add_argument("--job", default=None, help="job id (default: the one with the most finished steps)")
    p.add_argument("--skip", type=int, default=0, help="first steps left out (warm-up; default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print the JSON document instead of the tables")
    p.add_argument("--out", default=None, help="also write OUT.md and OUT.json")
    args = p.parse_args(argv)
    if args.skip < 0:
        print("error: --skip must be 0 or more", file=sys.stderr)
        return 2
    try:
        doc = summarize(args.directory, job=args.job, skip=args.skip)
    except FusionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    text = render(doc)
    if args.out:
        Path(args.out + ".json").write_text(json.dumps(doc, indent=2) + "\n")
        Path(args.out + ".md").write_text(
            "# Executor timeline\n\n"
            f"`python -m testbeds.bench.timeline {' '.join(sys.argv[1:] if argv is None else argv)}`\n\n{text}"
        )
    print(json.dumps(doc, indent=2) if args.json else text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
